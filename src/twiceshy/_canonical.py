"""The canonical JSON text of a call's arguments, and the idempotency key built from it.

:func:`canonical_json` writes, for every JSON value, exactly the text of this TypeScript recipe,
so that an agent written in TypeScript and a tool server written in Python name one intent alike::

    function stableStringify(v) {
      if (v === null || typeof v !== "object") return JSON.stringify(v);
      if (Array.isArray(v)) return `[${v.map(stableStringify).join(",")}]`;
      return `{${Object.keys(v).sort().map((k) =>
        `${JSON.stringify(k)}:${stableStringify(v[k])}`).join(",")}}`;
    }

Python values are first mapped to JSON values (see :func:`canonical_json`); anything without a
canonical form is refused with :class:`~twiceshy.errors.UnkeyableType` or
:class:`~twiceshy.errors.UnkeyableValue`, naming where in the arguments it sits.

The module is written for speed: one recursive pass that appends text to a list, with exact-type
fast paths for the common JSON types, string escaping done by the C helper behind :mod:`json`, the
sorted and quoted keys of each shape of dict remembered (see ``_SHAPES``), and no bookkeeping on
the happy path: paths are built only while a refusal travels up the stack, and cycles are found
by the depth bound (a cycle is infinitely deep) rather than by tracking the containers on the way.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import decimal
import enum
import hashlib
import itertools
import re
import reprlib
import sys
import uuid
from collections.abc import Iterable, Mapping
from json import dumps as _json_dumps
from json.encoder import encode_basestring as _quote
from typing import Any, Final

from twiceshy.errors import UnkeyableArgument, UnkeyableType, UnkeyableValue

__all__ = ["MAX_BYTES", "MAX_DEPTH", "canonical_digest", "canonical_json", "idempotency_key"]

MAX_DEPTH: Final = 64
"""How many containers (arrays and objects) may nest inside one another."""

MAX_BYTES: Final = 1_048_576
"""The largest canonical text, in UTF-8 bytes (1 MiB), that makes a key."""

# `encode_basestring` is json's `ensure_ascii=False` string writer: it escapes `"`, `\` and
# U+0000-U+001F exactly as JSON.stringify does (`\b \f \n \r \t`, others `\u00xx` in lowercase)
# and leaves everything else raw. Where it differs (lone surrogates, which it leaves raw) the
# finished text is mended once by `_mend_surrogates`.

_SURROGATE: Final = re.compile("[\ud800-\udfff]")
_float_repr: Final = float.__repr__
_int_repr: Final = int.__repr__


class _Refusal(Exception):
    """A refusal on its way up the recursion; each container on the way adds its path segment."""

    DEPTH: Final = "depth"
    SIZE: Final = "size"

    def __init__(
        self, error: type[UnkeyableArgument], reason: str, value: object = None, kind: str = ""
    ) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason
        self.kind = kind
        self.segments: list[str] = []  # innermost first
        self.values: list[object] = [value]  # the refused value, then its containers outwards

    def passing(self, segment: str, container: object) -> None:
        """Record that the refusal leaves ``container`` through ``segment``."""
        self.segments.append(segment)
        self.values.append(container)

    def to_error(self, max_depth: int, max_bytes: int) -> UnkeyableArgument:
        """Build the public error, with the path from ``args`` down to the refused value."""
        if self.kind == _Refusal.SIZE:
            error = UnkeyableValue(
                "args", f"the canonical form of the arguments is larger than {max_bytes} bytes"
            )
            error.bound = "max_bytes"
            return error
        segments = self.segments[::-1]
        values = self.values[::-1]
        if self.kind == _Refusal.DEPTH:
            # No cycle check runs on the way down: a cycle is infinitely deep, so it always ends
            # here, and the chain of containers tells whether some container holds itself.
            seen: dict[int, int] = {}
            for depth, value in enumerate(values):
                first = seen.setdefault(id(value), depth)
                if first != depth:
                    return UnkeyableValue(
                        _path(segments[:depth]),
                        f"cycle: this is the same object as {_path(segments[:first])}",
                    )
            error = UnkeyableValue(_path(segments), f"nested more than {max_depth} levels deep")
            error.bound = "max_depth"
            return error
        return self.error(_path(segments), self.reason)


def _path(segments: list[str]) -> str:
    return "args" + "".join(segments)


def _key_segment(key: str) -> str:
    return f".{key}" if key.isidentifier() else f"[{_json_dumps(key)}]"


def _index_segment(items: Iterable[object], item: object) -> str:
    # The loops do not count items (it costs on every call). Refusals depend only on the value
    # and its depth, so the first sibling that is this very object is the one that was refused.
    for index, other in enumerate(items):
        if other is item:
            return f"[{index}]"
    return "[?]"  # pragma: no cover - the item came from `items`


def _too_large() -> _Refusal:
    return _Refusal(UnkeyableValue, "too large", kind=_Refusal.SIZE)


def _too_deep(value: object) -> _Refusal:
    return _Refusal(UnkeyableValue, "too deep", value, kind=_Refusal.DEPTH)


_SHORT = reprlib.Repr()  # for values quoted in messages
_SHORT.maxstring = _SHORT.maxother = 40
_short: Final = _SHORT.repr


def _type_name(value: object) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else cls.__name__


# ---------------------------------------------------------------------------------------------
# scalars


def _float_text(x: float) -> str:
    """ECMAScript Number::toString of a finite float; NaN and infinities are refused."""
    text = _float_repr(x)
    if "e" in text or "n" in text:  # exponent form, or inf / nan
        return _float_text_slow(x, text)
    if text[-2:] == ".0":
        return "0" if x == 0 else text[:-2]
    # Python writes 1e-4 <= |x| < 1e16 in fixed notation with the same shortest digits.
    return text


def _float_text_slow(x: float, text: str) -> str:
    if x != x:  # NaN
        raise _Refusal(UnkeyableValue, "NaN has no JSON form (JavaScript would write null)")
    if "n" in text:
        raise _Refusal(
            UnkeyableValue,
            f"{text.replace('inf', 'Infinity')} has no JSON form (JavaScript would write null)",
        )
    sign = "-" if text[0] == "-" else ""
    mantissa, _, exponent = text.lstrip("-").partition("e")
    digits = mantissa.replace(".", "")
    k = len(digits)
    n = int(exponent) + 1  # the value is 0.<digits> * 10**n
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = f"{digits[:n]}.{digits[n:]}"
    elif -6 < n <= 0:
        body = f"0.{'0' * -n}{digits}"
    else:
        e = n - 1
        body = f"{digits[0]}{'.' if k > 1 else ''}{digits[1:]}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + body


def _int_text(x: int, budget: int) -> str:
    """Exact decimal text of an int, past Python's int-to-str digit limit too.

    An int too long for ``budget`` is refused before it is written out: writing a hostile one
    (millions of digits) costs seconds even the fast way.
    """
    try:
        return _int_repr(x)
    except ValueError:  # more digits than sys.get_int_max_str_digits() allows
        pass
    if x.bit_length() * _LOG10_2 > budget + 1:
        raise _too_large() from None
    return _big_int_text(x)


_LOG10_2: Final = 0.30102999566398120
_BIG_PIECE: Final = 4096  # bits converted by Decimal(int) at once


def _big_int_text(x: int) -> str:
    """The decimal text of a big int in about O(n log² n) rather than Python's O(n²): split in
    halves by powers of two, joined as Decimals (libmpdec multiplies big numbers fast)."""
    context = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
    powers: dict[int, decimal.Decimal] = {}

    def power(bits: int) -> decimal.Decimal:
        found = powers.get(bits)
        if found is None:
            found = powers[bits] = context.power(decimal.Decimal(2), bits)
        return found

    def convert(n: int, bits: int) -> decimal.Decimal:
        if bits <= _BIG_PIECE:
            return decimal.Decimal(n)
        low_bits = bits >> 1
        high = n >> low_bits
        low = n - (high << low_bits)
        return context.add(
            context.multiply(convert(high, bits - low_bits), power(low_bits)),
            convert(low, low_bits),
        )

    magnitude = abs(x)
    with decimal.localcontext(context):
        text = str(convert(magnitude, magnitude.bit_length()))
    return "-" + text if x < 0 else text


def _decimal_text(x: decimal.Decimal, budget: int) -> str:
    """The exact value of a finite Decimal in plain notation, trailing zeros dropped."""
    if not x.is_finite():
        raise _Refusal(UnkeyableValue, f"Decimal {x} is not a finite number")
    sign, digit_tuple, exponent = x.as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).lstrip("0")
    if not digits:
        return "0"
    stripped = digits.rstrip("0")
    exponent += len(digits) - len(stripped)
    digits = stripped
    # Refuse before writing out a huge exponent such as Decimal("1E+999999999").
    if len(digits) + abs(exponent) > budget:
        raise _too_large()
    if exponent >= 0:
        body = digits + "0" * exponent
    elif -exponent < len(digits):
        body = f"{digits[:exponent]}.{digits[exponent:]}"
    else:
        body = f"0.{'0' * (-exponent - len(digits))}{digits}"
    return "-" + body if sign else body


def _datetime_text(x: datetime.datetime) -> str:
    offset = x.utcoffset()
    if offset is None:
        raise _Refusal(
            UnkeyableValue,
            "a naive datetime names no instant; give it a tzinfo (e.g. datetime.timezone.utc). "
            "Sent as JSON, it needs an offset (2026-12-01T09:30:00Z, or +02:00)",
        )
    try:
        u = (x.replace(tzinfo=None) - offset) if offset else x
    except OverflowError:
        raise _Refusal(UnkeyableValue, "the datetime is out of range in UTC") from None
    text = f"{u.year:04d}-{u.month:02d}-{u.day:02d}T{u.hour:02d}:{u.minute:02d}:{u.second:02d}"
    if u.microsecond:
        text += f".{u.microsecond:06d}"
    return text + "Z"


# ---------------------------------------------------------------------------------------------
# the recursive pass; every _emit* appends to `out` and returns what is left of the budget


def _emit(v: Any, out: list[str], room: int, budget: int) -> int:
    """Append the canonical text of any value; the entry point of the recursion."""
    t = type(v)
    if t is str:
        budget -= len(v)
        if budget < 0:
            raise _too_large()
        out.append(_quote(v))
        return budget
    if t is int:
        out.append(_int_text(v, budget))
        return budget
    if t is float:
        out.append(_float_text(v))
        return budget
    if t is dict:
        return _emit_dict(v, out, room, budget)
    if t is list or t is tuple:
        return _emit_list(v, out, room, budget)
    if v is None:
        out.append("null")
        return budget
    if t is bool:
        out.append("true" if v else "false")
        return budget
    return _emit_other(v, out, room, budget)


def _emit_dict(d: dict[Any, Any], out: list[str], room: int, budget: int) -> int:
    """Append an exact dict; mappings with keys other than str take the general path."""
    if room <= 0:
        raise _too_deep(d)
    if not d:
        out.append("{}")
        return budget
    shape = tuple(d)
    plan = _SHAPES.get(shape)
    if plan is None:
        plan = _plan(shape)
        if plan is None:
            return _emit_pairs(_mapping_pairs(d), out, room, budget, d)
        if len(shape) <= _SHAPE_KEYS_MAX and plan[1] <= _SHAPE_CHARS_MAX:
            if len(_SHAPES) >= _SHAPES_MAX:
                _SHAPES.clear()
            _SHAPES[shape] = plan
    steps, key_chars = plan
    budget -= key_chars
    if len(out) > budget:
        raise _too_large()
    room -= 1
    append = out.append
    it = iter(steps)
    while True:
        try:
            for k, p in it:
                x = d[k]
                t = type(x)
                if t is str:
                    budget -= len(x)
                    if budget < 0:
                        raise _too_large()
                    append(p + _quote(x))
                elif t is int:
                    append(f"{p}{x}")
                elif t is float:
                    r = f"{x!r}"
                    if r[-1] == "0" or "e" in r or "n" in r:
                        r = _float_text(x)
                    append(p + r)
                elif t is dict:
                    append(p)
                    budget = _emit_dict(x, out, room, budget)
                elif t is list:
                    append(p)
                    budget = _emit_list(x, out, room, budget)
                elif t is bool:
                    append(p + ("true" if x else "false"))
                elif x is None:
                    append(p + "null")
                else:
                    append(p)
                    budget = _emit(x, out, room, budget)
        except ValueError:
            # An int past Python's int-to-str digit limit: write it exactly, then carry on with
            # the same iterator (caught here, it costs the per-item path nothing).
            if type(x) is not int:
                raise
            append(p + _int_text(x, budget))
            continue
        except _Refusal as refusal:
            refusal.passing(_key_segment(k), d)
            raise
        break
    append("}")
    return budget


_Plan = list[tuple[str, str]]

# Tool arguments come in few shapes: a tool is called again and again with the same keys, and
# one call often holds many dicts of one shape (rows, line items). The sorted, quoted keys of each
# str-keyed shape are therefore kept in a small memo. It is looked up by the tuple of keys in
# insertion order, holds nothing but str, and forgets everything when it is full.
_SHAPES: Final[dict[tuple[Any, ...], tuple[_Plan, int]]] = {}
_SHAPES_MAX: Final = 1024  # shapes
_SHAPE_KEYS_MAX: Final = 64  # keys of one shape
_SHAPE_CHARS_MAX: Final = 1024  # characters of one shape's keys


def _plan(keys: tuple[Any, ...]) -> tuple[_Plan, int] | None:
    """How to write the keys of a dict: None unless they are all str.

    The plan lists (key, ``{"key":`` or ``,"key":``) in output order; with it comes the keys'
    total length.
    """
    try:
        ordered = sorted(keys)
    except Exception:  # keys of several types, or that fail to compare: the general path
        return None  # converts them to text or refuses them
    steps = []
    sep = "{"
    chars = 0
    for k in ordered:
        if type(k) is not str:
            return None
        if not k.isascii():  # code-point order is UTF-16 order only for ASCII
            return _plan_utf16(keys)
        steps.append((k, f"{sep}{_quote(k)}:"))
        sep = ","
        chars += len(k)
    return steps, chars


def _plan_utf16(keys: tuple[Any, ...]) -> tuple[_Plan, int] | None:
    if not all(type(k) is str for k in keys):
        return None
    ordered = sorted(keys, key=_utf16)
    if len(set(map(_utf16, keys))) < len(keys):  # a surrogate pair and its character
        return None  # the general path names the collision
    steps = [(k, f"{',' if n else '{'}{_quote(k)}:") for n, k in enumerate(ordered)]
    return steps, sum(map(len, keys))


def _emit_list(v: list[Any] | tuple[Any, ...], out: list[str], room: int, budget: int) -> int:
    """Append an exact list or tuple."""
    if room <= 0:
        raise _too_deep(v)
    if not v:
        out.append("[]")
        return budget
    if len(out) > budget:
        raise _too_large()
    room -= 1
    append = out.append
    sep = "["
    it = iter(v)
    while True:
        try:
            for x in it:
                t = type(x)
                if t is str:
                    budget -= len(x)
                    if budget < 0:
                        raise _too_large()
                    append(sep + _quote(x))
                elif t is int:
                    append(f"{sep}{x}")
                elif t is float:
                    r = f"{x!r}"
                    if r[-1] == "0" or "e" in r or "n" in r:
                        r = _float_text(x)
                    append(sep + r)
                elif t is dict:
                    append(sep)
                    budget = _emit_dict(x, out, room, budget)
                else:
                    append(sep)
                    budget = _emit(x, out, room, budget)
                sep = ","
        except ValueError:
            if type(x) is not int:  # see _emit_dict
                raise
            append(sep + _int_text(x, budget))
            sep = ","
            continue
        except _Refusal as refusal:
            refusal.passing(_index_segment(v, x), v)
            raise
        break
    append("]")
    return budget


def _emit_pairs(
    pairs: list[tuple[str, object]],
    out: list[str],
    room: int,
    budget: int,
    origin: object,
) -> int:
    """Append an object from (key text, value) pairs already sorted by UTF-16 code units.

    ``origin`` is the Python object the pairs came from; it stands in the refusal's chain of
    containers so that cycles through dataclasses and other objects are recognised.
    """
    if room <= 0:
        raise _too_deep(origin)
    if not pairs:
        out.append("{}")
        return budget
    for k, _ in pairs:
        budget -= len(k)
    if len(out) > budget or budget < 0:
        raise _too_large()
    room -= 1
    sep = "{"
    try:
        for k, x in pairs:
            out.append(f"{sep}{_quote(k)}:")
            budget = _emit(x, out, room, budget)
            sep = ","
    except _Refusal as refusal:
        refusal.passing(_key_segment(k), origin)
        raise
    out.append("}")
    return budget


def _emit_set(v: set[object] | frozenset[object], out: list[str], room: int, budget: int) -> int:
    """Append a set as an array of its members' canonical texts in UTF-16 order."""
    if room <= 0:
        raise _too_deep(v)
    if not v:
        out.append("[]")
        return budget
    if len(out) > budget:
        raise _too_large()
    texts = []
    try:
        for x in v:
            part: list[str] = []
            budget = _emit(x, part, room - 1, budget)
            texts.append(_mend_surrogates("".join(part)))
    except _Refusal as refusal:
        refusal.passing("[?]", v)  # a set has no order to point into
        raise
    if all(map(str.isascii, texts)):
        texts.sort()
    else:
        texts.sort(key=_utf16)
    out.append(f"[{','.join(texts)}]")
    return budget


def _emit_other(v: object, out: list[str], room: int, budget: int) -> int:
    """Map every value that is not an exact JSON type, or refuse it."""
    # Enum first: IntEnum and StrEnum members are also ints and strs, but they stand for .value.
    if isinstance(v, enum.Enum):
        return _emit(v.value, out, room, budget)
    if isinstance(v, str):
        return _emit(str.__str__(v), out, room, budget)
    if isinstance(v, int):  # bool is handled (and can't be subclassed)
        out.append(_int_text(v, budget))
        return budget
    if isinstance(v, float):
        out.append(_float_text(v))
        return budget
    if isinstance(v, Mapping):
        return _emit_pairs(_mapping_pairs(v), out, room, budget, v)
    if isinstance(v, (list, tuple)):
        return _emit_list(v, out, room, budget)
    if isinstance(v, (set, frozenset)):
        return _emit_set(v, out, room, budget)
    if isinstance(v, datetime.datetime):
        return _emit(_datetime_text(v), out, room, budget)
    if isinstance(v, datetime.date):
        return _emit(f"{v.year:04d}-{v.month:02d}-{v.day:02d}", out, room, budget)
    if isinstance(v, decimal.Decimal):
        return _emit(_decimal_text(v, budget), out, room, budget)
    if isinstance(v, uuid.UUID):
        return _emit(uuid.UUID.__str__(v), out, room, budget)
    if isinstance(v, (bytes, bytearray, memoryview)):
        data = bytes(v)
        if len(data) > budget:
            raise _too_large()
        return _emit(base64.b64encode(data).decode("ascii"), out, room, budget)
    if not isinstance(v, type):
        cls = type(v)
        if dataclasses.is_dataclass(v):
            fields = [(f.name, getattr(v, f.name)) for f in dataclasses.fields(v)]
            return _emit_pairs(_sorted_pairs(fields), out, room, budget, v)
        attrs = getattr(cls, "__attrs_attrs__", None)
        if attrs is not None:
            fields = [(a.name, getattr(v, a.name)) for a in attrs]
            return _emit_pairs(_sorted_pairs(fields), out, room, budget, v)
        if hasattr(cls, "model_fields") and callable(getattr(cls, "model_dump", None)):
            try:
                dumped = v.model_dump(mode="python")  # type: ignore[attr-defined]
            except Exception as exc:
                raise _Refusal(
                    UnkeyableValue, f"model_dump() of a {_type_name(v)} failed: {exc}"
                ) from exc
            return _emit(dumped, out, room, budget)
    raise _Refusal(UnkeyableType, f"cannot make a key from a {_type_name(v)}", v)


# ---------------------------------------------------------------------------------------------
# mapping keys and ordering


def _utf16(text: str) -> bytes:
    # Big-endian UTF-16 bytes compare exactly as JavaScript compares strings: by code units.
    return text.encode("utf-16-be", "surrogatepass")


def _key_text(key: object) -> str:
    """The JSON text of a mapping key: str as itself, int in decimal; others are refused."""
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return _int_text(key, MAX_BYTES)
    if isinstance(key, enum.Enum):
        return _key_text(key.value)
    raise _Refusal(
        UnkeyableType,
        f"a mapping key must be a str or an int, not a {_type_name(key)} ({_short(key)})",
    )


def _mapping_pairs(m: Mapping[Any, object]) -> list[tuple[str, object]]:
    return _sorted_pairs([(_key_text(k), x) for k, x in m.items()], m)


def _sorted_pairs(
    pairs: list[tuple[str, object]], original: Mapping[Any, object] | None = None
) -> list[tuple[str, object]]:
    """Sort (key text, value) pairs by UTF-16 code units and refuse keys that collide."""
    if all(k.isascii() for k, _ in pairs):
        pairs.sort(key=_first)
    else:
        pairs.sort(key=_utf16_first)
    for before, after in itertools.pairwise(pairs):
        # Equal UTF-16 means one JavaScript string (a surrogate pair and its astral character).
        if before[0] == after[0] or _utf16(before[0]) == _utf16(after[0]):
            colliding = (
                [_short(k) for k in original if _utf16(_key_text(k)) == _utf16(before[0])]
                if original is not None
                else []
            )
            raise _Refusal(
                UnkeyableValue,
                f"the keys {' and '.join(colliding) or _short(before[0])} collide: "
                f"both are written as {_quote(after[0])}",
            )
    return pairs


def _first(pair: tuple[str, object]) -> str:
    return pair[0]


def _utf16_first(pair: tuple[str, object]) -> bytes:
    return _utf16(pair[0])


# ---------------------------------------------------------------------------------------------
# the finished text


def _mend_surrogates(text: str) -> str:
    """Join surrogate pairs into the character they encode and escape lone surrogates.

    JavaScript strings are UTF-16: a high surrogate followed by a low one *is* the astral
    character, and JSON.stringify escapes any other surrogate as ``\\udxxx``.
    """
    if text.isascii() or not _SURROGATE.search(text):
        return text
    text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    return _SURROGATE.sub(_escape_surrogate, text)


def _escape_surrogate(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _canonical(value: object, max_depth: int, max_bytes: int) -> tuple[str, bytes | None]:
    """The canonical text, and its UTF-8 bytes when they had to be computed anyway."""
    out: list[str] = []
    try:
        if type(value) is dict:  # the usual case, one call shorter
            _emit_dict(value, out, max_depth, max_bytes)
        else:
            _emit(value, out, max_depth, max_bytes)
    except _Refusal as refusal:
        raise refusal.to_error(max_depth, max_bytes) from None
    except RecursionError:
        raise UnkeyableValue(
            "args", "nested too deeply for Python's recursion limit (is there a cycle?)"
        ) from None
    text = "".join(out)
    if text.isascii():
        if len(text) > max_bytes:
            raise _too_large().to_error(max_depth, max_bytes)
        return text, None
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # surrogates in some string
        text = _mend_surrogates(text)
        data = text.encode("utf-8")
    if len(data) > max_bytes:
        raise _too_large().to_error(max_depth, max_bytes)
    return text, data


class _Digest(list[str]):
    """Where the recursive pass writes when only the text's SHA-256 is wanted: the text is
    hashed in pieces as it is written, never held whole (a large document's fingerprint)."""

    __slots__ = ("_hash", "_size")

    _PIECE: Final = 65536  # characters hashed at once

    def __init__(self, head: bytes) -> None:
        super().__init__()
        self._hash = hashlib.sha256(head)
        self._size = 0

    def append(self, text: str) -> None:
        list.append(self, text)
        self._size += len(text)
        if self._size > self._PIECE:
            self.flush()

    def flush(self) -> None:
        # A surrogate pair never spans two pieces (each piece holds whole JSON strings), so
        # mending piece by piece writes the text the whole would.
        self._hash.update(_mend_surrogates("".join(self)).encode("utf-8"))
        self.clear()
        self._size = 0

    def hexdigest(self) -> str:
        self.flush()
        return self._hash.hexdigest()


def canonical_digest(value: object, head: bytes, *, max_depth: int = MAX_DEPTH) -> str:
    """The hex SHA-256 of ``head`` followed by the UTF-8 canonical text of ``value``, with no
    bound on the text's size, computed without holding the text.

    Raises:
        UnkeyableArgument: as :func:`canonical_json`, but never for the size.
    """
    sink = _Digest(head)
    try:
        _emit(value, sink, max_depth, sys.maxsize)
    except _Refusal as refusal:
        raise refusal.to_error(max_depth, sys.maxsize) from None
    except RecursionError:
        raise UnkeyableValue(
            "args", "nested too deeply for Python's recursion limit (is there a cycle?)"
        ) from None
    return sink.hexdigest()


def canonical_json(value: object, *, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> str:
    """Return the canonical JSON text of ``value``.

    For every JSON value this is exactly the text of the TypeScript recipe in this module's
    docstring: object keys sorted by UTF-16 code units, strings escaped as ``JSON.stringify``
    escapes them (lone surrogates as ``\\udxxx``), numbers as ECMAScript's
    ``Number.prototype.toString`` (``1.0`` → ``1``, ``-0.0`` → ``0``, ``1e21`` → ``1e+21``),
    no whitespace.

    Python values are mapped to JSON first:

    - ``None`` → ``null``; ``bool`` → ``true``/``false``, never a number.
    - ``int`` → its exact decimal text, at any size. This differs from JavaScript beyond
      2**53: a JavaScript number cannot hold ``2**64 + 1`` and writes ``2**70`` as
      ``1.1805916207174113e+21``, where Python writes ``18446744073709551617`` and
      ``1180591620717411303424``. Within ±2**53 an int and the equal float give one text; beyond
      it they may not, and a TypeScript agent that sends such numbers names another intent.
    - ``float`` → ECMAScript number text; ``1`` and ``1.0`` are one intent. NaN and ±Infinity
      are refused (JavaScript would write ``null`` and silently merge intents).
    - ``str`` → itself; subclasses of ``str``, ``int`` and ``float`` map as the base type.
    - ``list``, ``tuple`` (and subclasses) → array; ``set``, ``frozenset`` → array sorted by
      the canonical texts of the members, in UTF-16 order (as JavaScript's default sort).
    - ``Mapping`` with ``str`` or ``int`` keys → object: a ``str`` key (a StrEnum member
      included) is its text, an ``int`` key (an IntEnum member included) its decimal text, and
      another enum member its value, if that is a str or an int. Keys of other types (``bool``,
      ``None``, ``float``, tuples...) are refused, and so are keys that collide once converted
      (``{1: ..., "1": ...}``).
    - dataclass, attrs and pydantic model instances → object of their fields (a pydantic model
      through ``model_dump(mode="python")``); a TypedDict is a dict.
    - ``enum.Enum`` → its ``value``, mapped in turn (IntEnum and StrEnum included).
    - aware ``datetime`` → its instant in UTC as ``YYYY-MM-DDTHH:MM:SS[.ffffff]Z``, the
      fraction only when not zero; a naive datetime is refused (it names no instant).
    - ``date`` → ``YYYY-MM-DD``. ``time`` and ``timedelta`` are refused like any other type.
    - ``Decimal`` → a string of its exact value in plain notation without trailing zeros
      (``Decimal("1.10")`` → ``"1.1"``, ``Decimal("1E+2")`` → ``"100"``); NaN and infinite
      decimals are refused.
    - ``UUID`` → its lowercase hyphenated text.
    - ``bytes``, ``bytearray``, ``memoryview`` → standard base64 text with padding.

    A high surrogate followed by a low one inside a Python string is the astral character they
    encode, as in a JavaScript string.

    Args:
        value: the arguments (any of the types above, nested).
        max_depth: how many arrays and objects may nest inside one another (dataclasses and
            models count as objects, sets as arrays); a cycle is refused as such.
        max_bytes: the largest canonical text, in UTF-8 bytes.

    Returns:
        The canonical JSON text.

    Raises:
        UnkeyableType: a value has a type with no canonical form; the message names its path,
            e.g. ``args.items[2].when: cannot make a key from a Foo``.
        UnkeyableValue: NaN or an infinity, a naive datetime, a cycle, nesting deeper than
            ``max_depth``, a text longer than ``max_bytes``, or colliding mapping keys.
    """
    return _canonical(value, max_depth, max_bytes)[0]


def _checked_names(scope: object, tool: object) -> tuple[str, str]:
    names = []
    for path, name in (("scope", scope), ("tool", tool)):
        if not isinstance(name, str):
            raise UnkeyableType(path, f"must be a str, not a {_type_name(name)}")
        if not name:
            raise UnkeyableValue(path, "must not be empty")
        if path == "tool" and ":" in name:
            raise UnkeyableValue(
                path, f"must not contain ':' (it makes keys ambiguous): {_short(name)}"
            )
        if _SURROGATE.search(name):
            raise UnkeyableValue(path, f"must not contain a lone surrogate: {_short(name)}")
        names.append(str.__str__(name))
    return names[0], names[1]


def idempotency_key(scope: str, tool: str, args: object) -> str:
    """Return the key of an intent: the lowercase hex SHA-256 of ``f"{scope}:{tool}:{canonical}"``.

    The text is hashed as UTF-8; ``canonical`` is :func:`canonical_json` of ``args``.

    Args:
        scope: the run the intent belongs to; any non-empty string, ``:`` included.
        tool: the tool's name; non-empty, without ``:``.
        args: the call's arguments.

    Returns:
        64 lowercase hex digits.

    Raises:
        UnkeyableType: ``scope`` or ``tool`` is not a str, or ``args`` holds a value with no
            canonical form (see :func:`canonical_json`).
        UnkeyableValue: an empty scope or tool name, a tool name with ``:``, a lone surrogate in
            either, or a refused value in ``args``.
    """
    if type(scope) is not str or type(tool) is not str or not scope or not tool or ":" in tool:
        scope, tool = _checked_names(scope, tool)
    try:
        head = f"{scope}:{tool}:".encode()
    except UnicodeEncodeError:  # a surrogate: let the check say where
        scope, tool = _checked_names(scope, tool)
        raise  # pragma: no cover - the check raises
    text, data = _canonical(args, MAX_DEPTH, MAX_BYTES)
    return hashlib.sha256(head + (text.encode() if data is None else data)).hexdigest()
