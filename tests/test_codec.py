"""Results and errors as JSON: what a replay rebuilds from a tool's return annotation, and the
class and message a recorded failure is replayed with."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import logging
import uuid
from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from decimal import Decimal
from typing import (
    Annotated,
    Any,
    Generic,
    Literal,
    NamedTuple,
    NotRequired,
    Optional,
    TypedDict,
    TypeVar,
)

import pydantic
import pytest

import twiceshy
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


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Box(Generic[T]):
    """A generic dataclass: its field's type comes from the annotation's argument."""

    item: T


class Slot(NamedTuple, Generic[T]):
    """A generic named tuple."""

    item: T
    n: int


class Order(TypedDict):
    """A TypedDict result whose fields need rebuilding."""

    total: Decimal
    when: dt.date
    note: NotRequired[uuid.UUID]


class Held(TypedDict, Generic[T]):
    """A generic TypedDict."""

    item: T


class Aliased(pydantic.BaseModel):
    """A pydantic model whose field goes by an alias (``from`` is a keyword)."""

    from_: Decimal = pydantic.Field(alias="from")


class Strict(pydantic.BaseModel):
    """A pydantic model that forbids extra fields and has a computed one."""

    model_config = pydantic.ConfigDict(extra="forbid")
    n: int

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def double(self) -> int:
        """Computed on dump; not an input."""
        return self.n * 2


class Checked(pydantic.BaseModel):
    """A strict pydantic model: it refuses a Decimal's or a date's JSON text in Python mode."""

    model_config = pydantic.ConfigDict(strict=True)
    total: Decimal
    when: dt.date


class Rate(enum.Enum):
    """An enum whose values JSON keeps as text or lists."""

    LOW = Decimal("0.5")
    RANGE = (1, 2)


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        (Box[Decimal], Box(Decimal("1.5"))),
        (Box[Line], Box(LINE)),
        (Box[list[Decimal]], Box([Decimal("1.5")])),
        (list[Box[uuid.UUID]], [Box(UID)]),
        (Slot[Decimal], Slot(Decimal("2.5"), 1)),
        (Order, Order(total=Decimal("1.5"), when=dt.date(2026, 1, 2), note=UID)),
        (list[Order], [Order(total=Decimal("0"), when=dt.date(2026, 1, 2))]),
        (Held[Decimal], Held(item=Decimal("3"))),
        (Literal[Color.RED], Color.RED),
        (list[Literal[Color.RED, "other"]], [Color.RED, "other"]),
        (Aliased, Aliased.model_validate({"from": Decimal("1.5")})),
        (Strict, Strict(n=2)),
        (Checked, Checked(total=Decimal("1.5"), when=dt.date(2026, 1, 2))),
        (Rate, Rate.LOW),
        (Rate, Rate.RANGE),
        (dict[Color, int], {Color.RED: 1}),
        (dict[uuid.UUID, Decimal], {UID: Decimal("1.5")}),
        (dict[dt.date, int], {dt.date(2026, 1, 2): 3}),
        (dict[float, str], {1.5: "a"}),
        (dict[bool, str], {True: "a", False: "b"}),
        (Line, dataclasses.replace(LINE, when=dt.datetime(2026, 1, 2, 3, 4, tzinfo=dt.UTC))),
        (bytearray, bytearray(b"\x00raw")),
        (Collection[Decimal], [Decimal("1.5")]),
        (Iterable[dt.date], [dt.date(2026, 1, 2)]),
        (AbstractSet[uuid.UUID], {UID}),
        (MutableMapping[str, Decimal], {"a": Decimal("2")}),
    ],
)
def test_replay_rebuilds_generic_typed_dict_literal_and_keyed_results(
    annotation: Any, value: Any
) -> None:
    """Generic classes, TypedDicts, Literals, aliased models and non-text keys replay equal."""
    codec = ResultCodec(annotation)
    again = codec.decode(codec.encode(value))
    assert again == value
    assert type(again) is type(value)


@dataclasses.dataclass(frozen=True)
class Positive:
    """A dataclass that checks its value with an exception of its own."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise RuntimeError("negative")


def test_a_stored_value_that_fails_to_rebuild_replays_as_stored() -> None:
    """Whatever the annotated type raises while rebuilding, the stored JSON comes back."""
    assert ResultCodec(Decimal).decode('"n/a"') == "n/a"
    assert ResultCodec(Positive).decode('{"n": -1}') == {"n": -1}


def test_a_result_the_annotation_cannot_rebuild_is_replayed_not_an_error() -> None:
    """A tool annotated ``Decimal`` that returned other text replays that text to every retry."""
    ledger = twiceshy.Ledger("memory://")
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def price(sku: str) -> Decimal:
        runs.append(sku)
        return "n/a"  # type: ignore[return-value]

    with twiceshy.run("codec-1"):
        assert price("a") == "n/a"
        assert price("a") == "n/a"
    assert runs == ["a"]


def test_keys_that_collide_as_text_are_refused() -> None:
    """Two keys of one mapping that JSON would write as one text are refused, not merged."""
    with pytest.raises(ResultNotStorable, match="collide"):
        ResultCodec().encode({Color.RED: 1, "red": 2})


def test_keys_without_a_json_text_are_refused() -> None:
    """A mapping key with no text form (a tuple) is refused with ResultNotStorable."""
    with pytest.raises(ResultNotStorable):
        ResultCodec().encode({(1, 2): "a"})


class Garbled(Exception):
    """A provider's error whose message cannot be read (its ``__str__`` raises)."""

    def __str__(self) -> str:
        raise AttributeError("no attribute 'detail'")


def test_a_definite_error_whose_message_cannot_be_read_is_still_recorded() -> None:
    """The failure is recorded and replayed; the tool never runs again and no claim is left."""
    ledger = twiceshy.Ledger("memory://")
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, definite=[Garbled])
    def charge(amount: int) -> None:
        runs.append(amount)
        raise Garbled

    with twiceshy.run("codec-2"):
        with pytest.raises(Garbled):
            charge(1)
        with pytest.raises(Garbled) as replayed:
            charge(1)
    assert "message could not be read" in replayed.value.args[0]
    assert runs == [1]
    (record,) = ledger.store.records("")
    assert record.state is twiceshy.State.FAILED


# -- errors and late types on replay ----------------------------------------------------------


class PaymentError(Exception):
    """A failure the tool lists as certain."""


class CardDeclined(PaymentError):
    """A kind of it the tool does not list by name."""


def test_a_listed_failure_of_a_subclass_replays_as_the_listed_type() -> None:
    """A subclass of a ``definite=`` failure is replayed as the listed class, with its message."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, definite=(PaymentError,))
    def charge(amount: int) -> str:
        runs.append(amount)
        raise CardDeclined("the card was declined")

    with twiceshy.run("run-1"):
        with pytest.raises(CardDeclined):
            charge(4900)
        with pytest.raises(PaymentError, match="the card was declined") as replayed:
            charge(4900)  # the caller's `except PaymentError` holds for the replay too
    assert type(replayed.value) is PaymentError
    assert runs == [4900]


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_an_error_whose_message_cannot_be_read_is_recorded_as_unknown(
    effect: twiceshy.Effect, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller gets the honest answer, not the message's own error; nothing stays claimed."""
    caplog.set_level(logging.DEBUG, logger="twiceshy")  # every call's log line is written
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=effect, attempts=1)
    def wire(amount: int) -> None:
        runs.append(amount)
        assert twiceshy.current_key()  # handed to the provider, which deduplicates by it
        raise Garbled

    expected = twiceshy.OutcomeUnknown if effect is twiceshy.UNSAFE else Garbled
    with twiceshy.run("run-garbled"), pytest.raises(expected):
        wire(1)
    records = ledger.store.records("")
    assert [r.state for r in records] == [twiceshy.State.UNKNOWN]
    assert "message could not be read" in (records[0].reason or "")
    assert "Garbled" in caplog.text
    assert runs == [1]


# Decorated when this module is imported, before the class it returns is defined.
LATE = twiceshy.Ledger("memory://", counts_interval=None)


@LATE.tool(effect=twiceshy.KEYED)
def issue_receipt(amount: int) -> LateReceipt:
    return LateReceipt("rc_1", amount)


@dataclasses.dataclass(frozen=True)
class LateReceipt:
    """Defined after the tool that returns it."""

    id: str
    amount: int


def test_a_return_type_defined_after_the_tool_is_rebuilt_on_replay() -> None:
    """A return annotation naming a class defined after the tool is resolved when replayed."""
    with twiceshy.run("run-1"):
        first = issue_receipt(5)
        again = issue_receipt(5)
    assert again == first
    assert type(again) is LateReceipt
