"""The canonical form of arguments and the idempotency key (DESIGN.md section 2)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
import random
import time
import uuid
from collections import OrderedDict
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, TypedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twiceshy import _canonical
from twiceshy._canonical import MAX_BYTES, MAX_DEPTH, canonical_json, idempotency_key
from twiceshy.errors import UnkeyableArgument, UnkeyableType, UnkeyableValue

VECTORS = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "key_vectors.jsonl")
    .read_text("utf-8")
    .splitlines()
]

UTC = datetime.UTC


# ---------------------------------------------------------------------------------------------
# helpers


def json_equal(a: object, b: object) -> bool:
    """JSON equality: numbers by value as doubles (1 == 1.0), but a bool is never a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) or isinstance(b, float):
        # A JSON number is a double: 38123415964448010 reads back as 3.812341596444801e16.
        return isinstance(a, int | float) and isinstance(b, int | float) and float(a) == float(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(json_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def reshuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys inserted in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: reshuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [reshuffled(v, rng) for v in value]
    return value


def refusal(error: type[UnkeyableArgument], value: object, **limits: int) -> UnkeyableArgument:
    """The error canonical_json raises for ``value``, checked to be of the ``error`` class."""
    with pytest.raises(error) as info:
        canonical_json(value, **limits)
    return info.value


SAFE_INTS = st.integers(min_value=-(2**53), max_value=2**53)
FINITE_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | SAFE_INTS | FINITE_FLOATS | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5)
    ),
    max_leaves=25,
)
# A small domain, so that two draws are often equal.
SMALL_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, 0.0, -0.0, 1.0, 0.5, 2, 2.0, 1e21, 2**53, 2.0**53])
    | st.text("ab", max_size=2),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text("ab", max_size=2), children, max_size=3)
    ),
    max_leaves=6,
)


# ---------------------------------------------------------------------------------------------
# what JavaScript computes


@pytest.mark.parametrize("vector", VECTORS, ids=[f"line{n + 1}" for n in range(len(VECTORS))])
def test_key_vectors_match_javascript(vector: dict[str, Any]) -> None:
    """Canonical text and key equal those of the TypeScript recipe (tools/make_key_vectors.mjs)."""
    assert canonical_json(vector["args"]) == vector["canonical"]
    assert idempotency_key(vector["scope"], vector["tool"], vector["args"]) == vector["key"]


def test_key_vectors_cover_what_they_promise() -> None:
    """The golden file holds the tricky cases: -0, 1e21, lone surrogates, UTF-16 key order."""
    canonicals = {v["canonical"] for v in VECTORS}
    assert len(VECTORS) >= 500
    assert {"0", "1e+21", "1e-7", "1.5e-7", "123456789012345680000", "5e-324"} <= canonicals
    assert any("\\ud800" in c for c in canonicals)
    assert '{"\U0001f600":2,"\ue000":1}' in canonicals
    assert any(isinstance(v["args"], float) and math.copysign(1, v["args"]) < 0 for v in VECTORS)


def test_key_is_sha256_of_scope_tool_and_text() -> None:
    """The key is the hex SHA-256 of the UTF-8 of f"{scope}:{tool}:{canonical}"."""
    import hashlib

    args = {"b": [1.0, "é"], "a": None}
    text = canonical_json(args)
    assert text == '{"a":null,"b":[1,"é"]}'
    expected = hashlib.sha256(f"run:1:send:{text}".encode()).hexdigest()
    assert idempotency_key("run:1", "send", args) == expected


# ---------------------------------------------------------------------------------------------
# properties


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES, st.randoms(use_true_random=False))
def test_key_order_never_matters(value: Any, rng: random.Random) -> None:
    """Inserting object keys in another order gives the same text and key."""
    other = reshuffled(value, rng)
    assert canonical_json(other) == canonical_json(value)
    assert idempotency_key("s", "t", other) == idempotency_key("s", "t", value)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_canonical_text_parses_back_to_the_value(value: Any) -> None:
    """json.loads of the canonical text gives back an equal JSON value (-0.0 as 0)."""
    assert json_equal(json.loads(canonical_json(value)), value)


@settings(max_examples=300, deadline=None)
@given(SMALL_JSON, SMALL_JSON)
def test_one_text_per_json_value(a: Any, b: Any) -> None:
    """Two JSON values share a canonical text exactly when they are equal (1 and 1.0 are)."""
    assert (canonical_json(a) == canonical_json(b)) == json_equal(a, b)


@settings(max_examples=300, deadline=None)
@given(FINITE_FLOATS)
def test_floats_round_trip_in_ecmascript_form(x: float) -> None:
    """A float's text reads back as that float, in exponent form only where JavaScript uses it."""
    text = canonical_json(x)
    assert float(text) == x
    assert text != "-0"
    assert not text.endswith(".0")
    assert ("e" in text) == (x != 0 and not 1e-6 <= abs(x) < 1e21)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(), SAFE_INTS | st.text(), max_size=8))
def test_every_mapping_type_sorts_alike(value: dict[str, Any]) -> None:
    """A dict, an OrderedDict and a read-only mapping of the same items give one text."""
    text = canonical_json(value)
    assert canonical_json(OrderedDict(reversed(value.items()))) == text
    assert canonical_json(MappingProxyType(value)) == text


# ---------------------------------------------------------------------------------------------
# JSON details


def test_numbers_follow_ecmascript() -> None:
    """Floats are written as Number.prototype.toString writes them."""
    cases = {
        1.0: "1",
        -0.0: "0",
        100.0: "100",
        1e21: "1e+21",
        1e20: "100000000000000000000",
        1.5e-7: "1.5e-7",
        1e-7: "1e-7",
        1e-6: "0.000001",
        123456789012345680000.0: "123456789012345680000",
        0.1 + 0.2: "0.30000000000000004",
        -1.7976931348623157e308: "-1.7976931348623157e+308",
        5e-324: "5e-324",
    }
    for value, text in cases.items():
        assert canonical_json(value) == text, value


def test_ints_are_exact_beyond_2_to_the_53() -> None:
    """Python ints are written exactly, even where JavaScript would round them."""
    assert canonical_json(2**64) == "18446744073709551616"
    assert canonical_json(-(2**53) - 1) == "-9007199254740993"
    assert canonical_json(2**53) == canonical_json(float(2**53))


def test_ints_past_the_int_to_str_limit_are_written() -> None:
    """An int longer than sys.get_int_max_str_digits() is still written exactly, anywhere."""
    big = 10**5000
    digits = "1" + "0" * 5000
    assert canonical_json(big) == digits
    assert canonical_json([big, 2]) == f"[{digits},2]"
    assert canonical_json({"a": big, "b": 1}) == f'{{"a":{digits},"b":1}}'


def test_bools_and_none_are_not_numbers() -> None:
    """True is true and None is null, never 1 or 0."""
    assert canonical_json([True, False, None, 1, 0]) == "[true,false,null,1,0]"
    assert canonical_json({"a": True}) != canonical_json({"a": 1})


def test_strings_are_escaped_like_json_stringify() -> None:
    """Quote, backslash and control characters are escaped; all else is raw."""
    text = canonical_json('"\\\b\f\n\r\t\x00\x1f\x7f\u2028\u2029é😀/')
    assert text == '"\\"\\\\\\b\\f\\n\\r\\t\\u0000\\u001f\x7f\u2028\u2029é😀/"'


def test_lone_surrogates_are_escaped_and_keyable() -> None:
    """A lone surrogate is written as \\udxxx, so the hashed text is valid UTF-8."""
    assert canonical_json("a\ud800b\udfff") == '"a\\ud800b\\udfff"'
    assert canonical_json({"\udc00": "\ud83d"}) == '{"\\udc00":"\\ud83d"}'
    assert len(idempotency_key("s", "t", ["\ud800"])) == 64


def test_a_surrogate_pair_is_the_character_it_encodes() -> None:
    """As in a JavaScript string, a high and a low surrogate together are one astral character."""
    assert canonical_json("\ud83d\ude00") == '"😀"'
    assert canonical_json(["\ud83d\ude00", "\ud83d"]) == '["😀","\\ud83d"]'


def test_keys_sort_by_utf16_code_units() -> None:
    """Astral characters sort before U+E000..U+FFFF, as JavaScript sorts them."""
    assert canonical_json({"\uffff": 1, "\U00010000": 2}) == '{"\U00010000":2,"\uffff":1}'
    assert canonical_json({"\ue000": 1, "😀": 2, "a": 3}) == '{"a":3,"😀":2,"\ue000":1}'


def test_dicts_of_one_shape_are_written_alike() -> None:
    """Dicts sharing keys (rows) are sorted and written one by one, whatever order came first."""
    rows = [{"b": i, "a": str(i)} for i in range(3)] + [{"a": "x", "b": 1.5}]
    assert canonical_json(rows) == (
        '[{"a":"0","b":0},{"a":"1","b":1},{"a":"2","b":2},{"a":"x","b":1.5}]'
    )
    assert canonical_json({"a": "x", "b": 1.5}) == canonical_json({"b": 1.5, "a": "x"})


def test_the_shape_memo_stays_bounded() -> None:
    """Many shapes of dict keys do not grow the memo past its bound."""
    for n in range(_canonical._SHAPES_MAX + 10):
        canonical_json({f"k{n}": 1})
    assert len(_canonical._SHAPES) <= _canonical._SHAPES_MAX


# ---------------------------------------------------------------------------------------------
# Python types


def test_tuples_and_lists_are_arrays() -> None:
    """A tuple and a list of the same items give one text."""
    assert canonical_json((1, "a", (2,))) == canonical_json([1, "a", [2]]) == '[1,"a",[2]]'


def test_sets_are_sorted_arrays() -> None:
    """A set is an array sorted by the members' canonical texts, whatever its iteration order."""
    words = [f"w{i}" for i in range(50)]
    forward, shuffled = set(words), set(random.Random(7).sample(words, len(words)))
    assert canonical_json(forward) == canonical_json(shuffled) == canonical_json(frozenset(words))
    assert canonical_json({1, "a", 2.5}) == '["a",1,2.5]'
    assert canonical_json(frozenset()) == "[]"


def test_int_keyed_mappings_are_objects() -> None:
    """Int keys become their decimal text, sorted as text (as JavaScript does)."""
    assert canonical_json({2: "b", 10: "a", -1: "c"}) == '{"-1":"c","10":"a","2":"b"}'


@dataclasses.dataclass
class When:
    """A dataclass holding a value of an unsupported type."""

    when: object


def test_dataclasses_are_objects_of_their_fields() -> None:
    """A dataclass is an object of its fields, nested values mapped the same way."""

    @dataclasses.dataclass(frozen=True)
    class Item:
        sku: str
        qty: int
        price: Decimal
        tags: tuple[str, ...] = ()

    item = Item("A-1", 2, Decimal("9.90"), ("x",))
    expected = '{"price":"9.9","qty":2,"sku":"A-1","tags":["x"]}'
    assert canonical_json(item) == expected
    assert canonical_json(item) == canonical_json(
        {"sku": "A-1", "qty": 2, "price": "9.9", "tags": ["x"]}
    )


def test_attrs_classes_are_objects_of_their_fields() -> None:
    """A class with __attrs_attrs__ (attrs) is an object of the attributes it lists."""

    class Attribute:
        def __init__(self, name: str) -> None:
            self.name = name

    class Point:
        __attrs_attrs__ = (Attribute("y"), Attribute("x"))

        def __init__(self, x: int, y: int) -> None:
            self.x, self.y, self.hidden = x, y, object()

    assert canonical_json(Point(1, 2)) == '{"x":1,"y":2}'


def test_pydantic_models_are_objects_of_their_fields() -> None:
    """A pydantic model is an object of its fields, through model_dump(mode="python")."""
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):  # type: ignore[misc, name-defined]
        city: str

    class Customer(pydantic.BaseModel):  # type: ignore[misc, name-defined]
        name: str
        since: datetime.date
        balance: Decimal
        address: Address

    customer = Customer(
        name="Zoë",
        since=datetime.date(2026, 1, 2),
        balance=Decimal("10.50"),
        address={"city": "Zürich"},
    )
    assert canonical_json(customer) == (
        '{"address":{"city":"Zürich"},"balance":"10.5","name":"Zoë","since":"2026-01-02"}'
    )


def test_duck_typed_models_are_dumped() -> None:
    """Any object whose class has model_fields and model_dump is treated as a pydantic model."""

    class Model:
        model_fields: ClassVar[dict[str, object]] = {"a": None}

        def model_dump(self, *, mode: str) -> dict[str, object]:
            assert mode == "python"
            return {"a": datetime.date(2026, 5, 1)}

    assert canonical_json(Model()) == '{"a":"2026-05-01"}'


def test_typed_dicts_are_dicts() -> None:
    """A TypedDict instance is a plain dict."""

    class Order(TypedDict):
        id: int
        note: str

    assert canonical_json(Order(id=1, note="n")) == canonical_json({"note": "n", "id": 1})


class Color(enum.Enum):
    """A plain enum."""

    RED = "red"
    PAIR = (1, 2)


class Level(enum.IntEnum):
    """An int enum."""

    HIGH = 3


class Mode(enum.StrEnum):
    """A str enum."""

    FAST = "fast"


def test_enums_are_their_values() -> None:
    """An enum member is its value (IntEnum and StrEnum included), also as a mapping key."""
    assert (
        canonical_json([Color.RED, Color.PAIR, Level.HIGH, Mode.FAST]) == '["red",[1,2],3,"fast"]'
    )
    assert canonical_json({Level.HIGH: Mode.FAST, Mode.FAST: 1}) == '{"3":"fast","fast":1}'


def test_aware_datetimes_naming_one_instant_give_one_text() -> None:
    """Aware datetimes are written in UTC with a Z; one instant, one text, whatever the zone."""
    paris = datetime.timezone(datetime.timedelta(hours=1))
    new_york = datetime.timezone(datetime.timedelta(hours=-5))
    a = datetime.datetime(2026, 1, 2, 4, 4, 5, tzinfo=paris)
    b = datetime.datetime(2026, 1, 1, 22, 4, 5, tzinfo=new_york)
    assert canonical_json(a) == canonical_json(b) == '"2026-01-02T03:04:05Z"'
    with_micros = datetime.datetime(2026, 1, 2, 3, 4, 5, 120, tzinfo=UTC)
    assert canonical_json(with_micros) == '"2026-01-02T03:04:05.000120Z"'


def test_dates_are_iso_text() -> None:
    """A date is YYYY-MM-DD."""
    assert canonical_json(datetime.date(7, 3, 9)) == '"0007-03-09"'


def test_decimals_are_their_normalised_exact_value() -> None:
    """Decimal("1.10") and Decimal("1.1") are one intent; the text is exact and plain."""
    assert canonical_json(Decimal("1.10")) == canonical_json(Decimal("1.1")) == '"1.1"'
    assert canonical_json(Decimal("1E+2")) == '"100"'
    assert canonical_json(Decimal("-0.00")) == canonical_json(Decimal("0")) == '"0"'
    assert canonical_json(Decimal("0.000120")) == '"0.00012"'
    digits = "1.2345678901234567890123456789012345"  # beyond the context's 28 digits
    assert canonical_json(Decimal(digits)) == f'"{digits}"'


def test_uuids_are_lowercase_text() -> None:
    """A UUID is its canonical lowercase hyphenated text."""
    value = uuid.UUID("12345678-ABCD-EF00-1234-56789ABCDEF0")
    assert canonical_json(value) == '"12345678-abcd-ef00-1234-56789abcdef0"'


def test_bytes_are_base64() -> None:
    """Bytes, bytearray and memoryview are standard base64 with padding."""
    assert canonical_json(b"\x00\xffhi") == '"AP9oaQ=="'
    assert canonical_json(bytearray(b"hi")) == canonical_json(memoryview(b"hi")) == '"aGk="'


def test_subclasses_of_str_int_float_map_as_the_base_type() -> None:
    """Subclasses of str, int and float are written as their base value."""

    class Name(str):
        def __str__(self) -> str:
            return "not this"

    class Count(int):
        pass

    class Ratio(float):
        def __repr__(self) -> str:
            return "not this"

    assert canonical_json([Name("n"), Count(3), Ratio(2.0)]) == '["n",3,2]'
    assert canonical_json({Name("k"): 1}) == '{"k":1}'


# ---------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    ("value", "name"), [(math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")]
)
def test_nan_and_infinities_are_refused(value: float, name: str) -> None:
    """NaN and the infinities are refused (JavaScript would silently write null)."""
    error = refusal(UnkeyableValue, {"x": [1, value]})
    assert isinstance(error, ValueError)
    assert error.path == "args.x[1]"
    assert str(error).startswith(f"args.x[1]: {name} ")
    refusal(UnkeyableValue, value)
    refusal(UnkeyableValue, Decimal(name.replace("Infinity", "Inf")))


def test_naive_datetimes_are_refused() -> None:
    """A naive datetime names no instant."""
    error = refusal(UnkeyableValue, {"at": datetime.datetime(2026, 1, 2, 3, 4, 5)})
    assert error.path == "args.at"
    assert "naive" in error.reason


def test_unsupported_types_are_refused_with_their_path() -> None:
    """An unsupported type is refused with the path to it and its type's name."""

    class Foo:
        pass

    args = {"items": [{"when": 1}, {"when": 2}, When(Foo())]}
    error = refusal(UnkeyableType, args)
    assert isinstance(error, TypeError)
    assert str(error) == "args.items[2].when: cannot make a key from a Foo"
    assert refusal(UnkeyableType, [1, (2, {"odd key": [datetime.time(1)]})]).path == (
        'args[1][1]["odd key"][0]'
    )
    for value in (object(), 1j, datetime.timedelta(1), range(3), iter([]), When, None.__class__):
        refusal(UnkeyableType, value)


def test_cycles_are_refused() -> None:
    """A list or dict that contains itself is refused as a cycle, naming where it closes."""
    loop: list[object] = [1]
    loop.append({"again": loop})
    error = refusal(UnkeyableValue, loop)
    assert error.path == "args[1].again"
    assert error.reason == "cycle: this is the same object as args"

    node: dict[str, object] = {"name": "a"}
    node["next"] = {"next": node}
    error = refusal(UnkeyableValue, {"root": node})
    assert error.path == "args.root.next.next"
    assert "cycle" in error.reason
    assert "args.root" in error.reason


def test_nesting_deeper_than_the_bound_is_refused() -> None:
    """MAX_DEPTH levels of arrays and objects are fine; one more is refused, naming the path."""

    def nested(levels: int) -> object:
        value: object = []
        for _ in range(levels - 1):
            value = [value]
        return value

    assert canonical_json(nested(MAX_DEPTH)) == "[" * MAX_DEPTH + "]" * MAX_DEPTH
    error = refusal(UnkeyableValue, nested(MAX_DEPTH + 1))
    assert error.path == "args" + "[0]" * MAX_DEPTH
    assert "deep" in error.reason
    assert canonical_json(nested(3), max_depth=3)
    refusal(UnkeyableValue, nested(4), max_depth=3)


def test_arguments_larger_than_the_bound_are_refused() -> None:
    """A canonical text beyond MAX_BYTES UTF-8 bytes is refused; one at the bound is fine."""
    assert len(canonical_json("x" * (MAX_BYTES - 2))) == MAX_BYTES
    error = refusal(UnkeyableValue, "x" * (MAX_BYTES - 1))
    assert error.path == "args"
    assert str(MAX_BYTES) in error.reason
    refusal(UnkeyableValue, ["é" * (MAX_BYTES // 2)])  # bytes, not characters, count
    refusal(UnkeyableValue, {"a": "x" * 10}, max_bytes=10)


def test_shared_references_cannot_blow_the_bound_up() -> None:
    """Arguments that repeat one object (2**40 times here) are refused quickly, not expanded."""
    value: object = ["x" * 1000]
    for _ in range(40):
        value = [value, value]
    started = time.monotonic()
    refusal(UnkeyableValue, value)
    refusal(UnkeyableValue, ["y" * 500_000] * 10**6)
    assert time.monotonic() - started < 5


def test_colliding_mapping_keys_are_refused() -> None:
    """Keys that become one text ({1: ..., "1": ...}) are refused."""
    error = refusal(UnkeyableValue, {"m": {1: "a", "1": "b"}})
    assert error.path == "args.m"
    assert "collide" in error.reason
    refusal(UnkeyableValue, {"\ud83d\ude00": 1, "😀": 2})


@pytest.mark.parametrize("key", [True, None, 1.5, (1, 2), frozenset(), b"k"])
def test_mappings_with_other_keys_are_refused(key: object) -> None:
    """Keys other than str and int (bool included) are refused."""
    error = refusal(UnkeyableType, {"m": {key: 1}})
    assert isinstance(error, TypeError)
    assert error.path == "args.m"
    refusal(UnkeyableType, {"a": 1, key: 1})


def test_tool_names_and_scopes_are_checked() -> None:
    """A tool name needs no ':' and some text; a scope needs some text, ':' allowed."""
    assert len(idempotency_key("thread:1:step", "send", {})) == 64
    bad: list[tuple[object, object, type[UnkeyableArgument], str]] = [
        ("s", "a:b", UnkeyableValue, "tool"),
        ("s", "", UnkeyableValue, "tool"),
        ("", "t", UnkeyableValue, "scope"),
        (None, "t", UnkeyableType, "scope"),
        ("s", 3, UnkeyableType, "tool"),
        ("\ud800", "t", UnkeyableValue, "scope"),
        ("s", "t\udfff", UnkeyableValue, "tool"),
    ]
    for scope, tool, error, path in bad:
        with pytest.raises(error) as info:
            idempotency_key(scope, tool, {})  # type: ignore[arg-type]
        assert info.value.path == path


def test_refusals_are_type_and_value_errors() -> None:
    """Refusals are UnkeyableArgument, and TypeError or ValueError as their kind says."""
    assert issubclass(UnkeyableType, TypeError)
    assert issubclass(UnkeyableValue, ValueError)
    with pytest.raises(TypeError):
        idempotency_key("s", "t", {"x": object()})
    with pytest.raises(ValueError, match="NaN"):
        idempotency_key("s", "t", {"x": math.nan})
