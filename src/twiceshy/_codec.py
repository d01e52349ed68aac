"""Results and errors as JSON text: never pickle (DESIGN.md §6).

A result is stored as JSON and replayed as an equal value: falsy results (``0``, ``""``, ``[]``,
``None``) replay as themselves, and a result whose type is the tool's annotated return type
(dataclasses, pydantic models, ``datetime``, ``Decimal``, ``UUID``, containers of these) is rebuilt
as that type.
"""

from __future__ import annotations

import base64
import collections.abc
import dataclasses
import datetime as dt
import enum
import inspect
import json
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any, Final

from .errors import ResultNotStorable

__all__ = [
    "MAX_RESULT_BYTES",
    "ResultCodec",
    "ReturnOf",
    "decode_error",
    "encode_error",
    "type_name",
]

MAX_RESULT_BYTES = 1_048_576
"""The default bound on a stored result's JSON text, in UTF-8 bytes."""


_AS_IS: frozenset[Any] = frozenset(
    {None, Any, object, str, int, bool, dict, list, type(None), inspect.Signature.empty}
)


def _to_json(value: Any) -> Any:
    """The JSON form of one non-JSON value (``json.dumps``'s ``default``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump) and hasattr(type(value), "model_fields"):
        return dump(mode="json")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, set | frozenset):
        return sorted(value, key=lambda v: json.dumps(v, default=_to_json, sort_keys=True))
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"a {type(value).__name__} has no JSON form")


# Made once: json.dumps with options builds a new encoder for every call.
_ENCODE: Final = json.JSONEncoder(
    default=_to_json, ensure_ascii=False, allow_nan=False, separators=(",", ":")
).encode
_ENCODE_ASCII: Final = json.JSONEncoder(
    default=_to_json, allow_nan=False, separators=(",", ":")
).encode


class ResultCodec:
    """Encodes a tool's results and rebuilds them as its annotated return type.

    The annotation is read once, into a rebuilder; an annotation that JSON's own types already
    satisfy (``dict[str, object]``, ``list[str]``, none at all) needs no rebuilding, and a replay
    then costs one ``json.loads``.

    Args:
        annotation: the tool's return annotation (``inspect.Signature.empty`` or ``None`` for none).
        max_bytes: the bound on the stored text.
    """

    __slots__ = ("_max_bytes", "_rebuild")

    def __init__(self, annotation: Any = None, *, max_bytes: int = MAX_RESULT_BYTES) -> None:
        self._rebuild = (
            _deferred(annotation) if isinstance(annotation, ReturnOf) else _rebuilder(annotation)
        )
        self._max_bytes = max_bytes

    def encode(self, value: object) -> str:
        """The JSON text of a result.

        Raises:
            ResultNotStorable: the value has no JSON form, or its text exceeds the bound.
        """
        try:
            text = _ENCODE(value)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ResultNotStorable(f"the tool's result cannot be stored as JSON: {exc}") from exc
        size = len(text)
        if not text.isascii():
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:
                # A lone surrogate has no UTF-8 form: keep it as a \udxxx escape instead.
                text = _ENCODE_ASCII(value)
                size = len(text)
        if size > self._max_bytes:
            raise ResultNotStorable(
                f"the tool's result is larger than the bound of {self._max_bytes} bytes"
            )
        return text

    def decode(self, text: str) -> Any:
        """The replayed result: the stored JSON, rebuilt as the annotated type where it can be."""
        data = json.loads(text)
        if self._rebuild is None:
            return data
        try:
            return self._rebuild(data)
        except (TypeError, ValueError, KeyError):
            return data


class ReturnOf:
    """The return annotation of ``fn``, read when first needed: it may name a type defined
    after the tool (under ``from __future__ import annotations``, or imported for type checking
    only), which cannot be resolved when the tool is decorated."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn


Rebuild = Callable[[Any], Any]
"""Rebuilds decoded JSON as one type; ``None`` stands for "the data is that type already"."""


def _rebuilder(hint: Any) -> Rebuild | None:
    """How to rebuild decoded JSON as ``hint``, worked out once per annotation."""
    try:
        if hint in _AS_IS:
            return None
    except TypeError:  # an unhashable annotation: not one of JSON's own types
        pass
    if isinstance(hint, str | typing.ForwardRef | typing.TypeVar):
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        return _rebuilder(args[0])
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in args if a is not type(None)]
        inner = _rebuilder(options[0]) if len(options) == 1 else None
        return None if inner is None else _optional(inner)
    if origin is tuple or hint is tuple:
        return _tuple_rebuilder(args)
    if origin in (set, frozenset):
        return _collected(origin, _rebuilder(args[0]) if args else None)
    if origin in (list, typing.Sequence, collections.abc.Sequence):
        inner = _rebuilder(args[0]) if args else None
        return None if inner is None else _listed(inner)
    if origin in (dict, typing.Mapping, collections.abc.Mapping):
        key = _key_rebuilder(args[0]) if len(args) == 2 else None
        inner = _rebuilder(args[1]) if len(args) == 2 else None
        if key is not None:
            return _keyed(key, inner or _same)
        return None if inner is None else _valued(inner)
    if not isinstance(hint, type):
        return None
    if issubclass(hint, tuple) and hasattr(hint, "_fields"):  # a NamedTuple: JSON keeps a list
        return _named_tuple_rebuilder(hint)
    validate = getattr(hint, "model_validate", None)
    if callable(validate) and hasattr(hint, "model_fields"):
        return validate  # type: ignore[no-any-return]
    if dataclasses.is_dataclass(hint):
        return _dataclass_rebuilder(hint)
    if issubclass(hint, enum.Enum):
        return hint
    if hint is float:
        return lambda data: float(data) if type(data) is int else data
    parse = _FROM_TEXT.get(hint)
    if parse is not None:
        return lambda data: parse(data) if type(data) is str else data
    return None


_FROM_TEXT: dict[type, Rebuild] = {
    dt.datetime: dt.datetime.fromisoformat,
    dt.date: dt.date.fromisoformat,
    dt.time: dt.time.fromisoformat,
    Decimal: Decimal,
    uuid.UUID: uuid.UUID,
    bytes: base64.b64decode,
}


def _key_rebuilder(hint: Any) -> Rebuild | None:
    """How to rebuild a mapping's key, which JSON keeps as text; ``None`` for text keys.

    Only keys JSON can store come back: ``int`` and enums whose members are ``str`` or ``int``
    (other keys are refused when the result is stored).
    """
    if hint is int:
        return int
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        by_text = {str(member.value): member for member in hint}
        return lambda text: by_text.get(text, text)
    return None


def _keyed(key: Rebuild, inner: Rebuild) -> Rebuild:
    def rebuild(data: Any) -> Any:
        if type(data) is not dict:
            return data
        try:
            return {key(k): inner(v) for k, v in data.items()}
        except (TypeError, ValueError):
            return data

    return rebuild


def _field_hints(cls: type) -> dict[str, Any]:
    """A class's field annotations, resolved; none where they cannot be (replayed as stored)."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:
        return {}


def _named_tuple_rebuilder(cls: type) -> Rebuild:
    # As for dataclasses, the fields' annotations are read at first use.
    parts: list[Rebuild] | None = None

    def rebuild(data: Any) -> Any:
        nonlocal parts
        if type(data) is not list:
            return data
        if parts is None:
            hints = _field_hints(cls)
            parts = [_rebuilder(hints.get(name, Any)) or _same for name in cls._fields]  # type: ignore[attr-defined]
        if len(data) != len(parts):
            return data
        return cls(*(part(v) for part, v in zip(parts, data, strict=True)))

    return rebuild


def _deferred(hint: ReturnOf) -> Rebuild:
    rebuild: Rebuild | None = None
    resolved = False

    def first(data: Any) -> Any:
        nonlocal rebuild, resolved
        if not resolved:
            try:
                rebuild = _rebuilder(
                    typing.get_type_hints(hint.fn, include_extras=True).get("return")
                )
            except Exception:
                rebuild = None  # still not resolvable: replay the data as stored
            resolved = True
        return data if rebuild is None else rebuild(data)

    return first


def _optional(inner: Rebuild) -> Rebuild:
    return lambda data: None if data is None else inner(data)


def _listed(inner: Rebuild) -> Rebuild:
    return lambda data: [inner(v) for v in data] if type(data) is list else data


def _valued(inner: Rebuild) -> Rebuild:
    return lambda data: {k: inner(v) for k, v in data.items()} if type(data) is dict else data


def _collected(make: Callable[[Any], Any], inner: Rebuild | None) -> Rebuild:
    if inner is None:
        return lambda data: make(data) if type(data) is list else data
    return lambda data: make(map(inner, data)) if type(data) is list else data


def _tuple_rebuilder(args: tuple[Any, ...]) -> Rebuild:
    if len(args) == 2 and args[1] is Ellipsis:
        inner = _rebuilder(args[0])
        if inner is None:
            return lambda data: tuple(data) if type(data) is list else data
        return lambda data: tuple(map(inner, data)) if type(data) is list else data
    parts = [_rebuilder(a) or _same for a in args]

    def rebuild(data: Any) -> Any:
        if type(data) is not list:
            return data
        if parts and len(parts) == len(data):
            return tuple(part(v) for part, v in zip(parts, data, strict=True))
        return tuple(data)

    return rebuild


def _same(data: Any) -> Any:
    return data


def _dataclass_rebuilder(cls: type) -> Rebuild:
    # The fields' annotations may name types defined after the tool: read them at first use.
    fields: list[tuple[str, Rebuild | None]] | None = None

    def rebuild(data: Any) -> Any:
        nonlocal fields
        if type(data) is not dict:
            return data
        if fields is None:
            hints = _field_hints(cls)
            fields = [
                (f.name, _rebuilder(hints.get(f.name, Any)))
                for f in dataclasses.fields(cls)
                if f.init
            ]
        values = {
            name: data[name] if part is None else part(data[name])
            for name, part in fields
            if name in data
        }
        return cls(**values)

    return rebuild


def type_name(kind: type) -> str:
    """A type's qualified name, as stored errors name it."""
    return f"{kind.__module__}.{kind.__qualname__}"


def encode_error(exc: BaseException, listed: type[BaseException] | None = None) -> str:
    """The JSON text kept for a failed call: the error's type and message, and the ``definite=``
    type it was recorded as, when that is a base of its own."""
    data = {"type": type_name(type(exc)), "message": str(exc)}
    if listed is not None and listed is not type(exc):
        data["as"] = type_name(listed)
    # ASCII escapes keep any text storable, lone surrogates included.
    return json.dumps(data)


def decode_error(text: str | None) -> tuple[str, str, str]:
    """The type name, message and listed type name ("" for none) of a stored error."""
    if not text:
        return "", "", ""
    data = json.loads(text)
    return str(data.get("type", "")), str(data.get("message", "")), str(data.get("as", ""))
