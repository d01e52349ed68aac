"""Results as JSON: what a replay rebuilds from a tool's return annotation."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any, NamedTuple, Optional

import pydantic
import pytest

from twiceshy._codec import ResultCodec
from twiceshy.errors import ResultNotStorable


class Color(enum.Enum):
    """An enum result."""

    RED = "red"


class Size(enum.StrEnum):
    """An enum that JSON can keep as a mapping's key."""

    SMALL = "s"


class Pair(NamedTuple):
    """A named tuple result (JSON keeps it as a list)."""

    n: int
    price: Decimal


@dataclasses.dataclass(frozen=True)
class Line:
    """A dataclass whose fields need rebuilding themselves."""

    sku: str
    price: Decimal
    when: dt.date
    later: Later | None = None


@dataclasses.dataclass(frozen=True)
class Later:
    """Defined after the dataclass that names it."""

    id: uuid.UUID


class Model(pydantic.BaseModel):
    """A pydantic result."""

    id: str
    total: Decimal


UID = uuid.UUID("12345678-1234-5678-1234-567812345678")
LINE = Line("a", Decimal("1.10"), dt.date(2026, 1, 2), Later(UID))


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        (None, {"a": [1, 2.5, "x", None, True]}),
        (Any, [0, "", [], {}]),
        (dict[str, object], {"id": "ch_1", "n": 3}),
        (list[str], ["a", "b"]),
        (int, 0),
        (str, ""),
        (float, 2.0),
        (Decimal, Decimal("12.50")),
        (dt.datetime, dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)),
        (dt.date, dt.date(2026, 1, 2)),
        (uuid.UUID, UID),
        (bytes, b"\x00\xffraw"),
        (Color, Color.RED),
        (tuple[int, ...], (1, 2, 3)),
        (tuple[str, Decimal], ("a", Decimal("1.5"))),
        (tuple, (1, 2)),
        (set[int], {1, 2, 3}),
        (frozenset[str], frozenset({"a", "b"})),
        (list[Decimal], [Decimal("1.5"), Decimal("2")]),
        (Sequence[uuid.UUID], [UID]),
        (dict[str, Decimal], {"a": Decimal("1.5")}),
        (Mapping[str, dt.date], {"a": dt.date(2026, 1, 2)}),
        (Optional[Decimal], Decimal("3")),  # noqa: UP045 - the typing spelling is rebuilt too
        (Decimal | None, None),
        (Annotated[Decimal, "money"], Decimal("4.5")),
        (Line, LINE),
        (list[Line], [LINE, Line("b", Decimal("2"), dt.date(2026, 1, 3))]),
        (Model, Model(id="m", total=Decimal("9.99"))),
        (dict[str, Model], {"x": Model(id="m", total=Decimal("1"))}),
        (dt.time, dt.time(12, 30)),
        (dict[int, str], {1: "a", 2: "b"}),
        (dict[int, Decimal], {3: Decimal("1.5")}),
        (dict[Size, int], {Size.SMALL: 1}),
        (Pair, Pair(1, Decimal("2.5"))),
        (list[Pair], [Pair(1, Decimal("2.5"))]),
    ],
)
def test_replay_rebuilds_an_equal_value_of_the_annotated_type(annotation: Any, value: Any) -> None:
    """A stored result decodes to a value equal to the one returned, of the same type."""
    codec = ResultCodec(annotation)
    again = codec.decode(codec.encode(value))
    assert again == value
    assert type(again) is type(value)


def test_float_annotation_rebuilds_whole_numbers_as_floats() -> None:
    """JSON writes 2.0 as 2; a float-annotated tool still replays a float."""
    codec = ResultCodec(float)
    assert codec.decode("2") == 2.0
    assert type(codec.decode("2")) is float


def test_a_result_that_does_not_fit_its_annotation_replays_as_stored() -> None:
    """Data the annotation cannot rebuild comes back as the stored JSON, not an error."""
    assert ResultCodec(Line).decode('{"sku": "a"}') == {"sku": "a"}
    assert ResultCodec(Color).decode('"blue"') == "blue"
    assert ResultCodec(list[Decimal]).decode('{"a": 1}') == {"a": 1}


def test_unions_of_several_types_replay_as_stored() -> None:
    """An annotation that does not say which type to build leaves the data as it is."""
    assert ResultCodec(Decimal | dt.date).decode('"1.5"') == "1.5"


def test_unstorable_results_are_refused() -> None:
    """A result without a JSON form, or over the bound, raises ResultNotStorable."""
    with pytest.raises(ResultNotStorable):
        ResultCodec().encode(object())
    with pytest.raises(ResultNotStorable):
        ResultCodec().encode(float("nan"))
    with pytest.raises(ResultNotStorable, match="bound of 8 bytes"):
        ResultCodec(max_bytes=8).encode("x" * 20)
