"""Results and errors as JSON text: never pickle (docs/design.md §6).

A result is stored as JSON and replayed as an equal value: falsy results (``0``, ``""``, ``[]``,
``None``) replay as themselves, and a result whose type is the tool's annotated return type
(dataclasses, named tuples, TypedDicts and pydantic models, generic ones included, enums,
``Literal``, ``datetime``, ``Decimal``, ``UUID``, paths, containers of these) is rebuilt as that
type.
A mapping's keys are kept as JSON's text; enums, UUIDs, dates, ``Decimal``, ``float`` and ``bool``
keys come back as such where the annotation names them, and keys that would collide as text are
refused.

Stored data the annotation cannot rebuild (an operator's ``twiceshy resolve --succeeded``, a
reconciler's result, a tool that returned another type) replays as the JSON it is, never as an
error: an error there would answer every retry of the intent with it.

A return annotation with no JSON form (a plain class, a callable, an iterator) is refused when the
tool is declared (:func:`unstorable`). A result that still cannot be kept once the tool has run
is recorded as done all the same (:func:`not_kept`): its type, why, and a bounded text of it; a
retry is told so (:class:`NotKept`), never that the tool failed.
"""

from __future__ import annotations

import abc
import base64
import collections.abc
import dataclasses
import datetime as dt
import enum
import inspect
import json
import json.scanner
import math
import pathlib
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any, Final, cast

from .errors import ResultNotStorable

__all__ = [
    "MAX_RESULT_BYTES",
    "NotKept",
    "ResultCodec",
    "ReturnOf",
    "decode_error",
    "encode_error",
    "not_kept",
    "type_name",
    "unstorable",
]

MAX_RESULT_BYTES = 1_048_576
"""The default bound on a stored result's JSON text, in UTF-8 bytes."""

_MARK: Final = "$twiceshy"
"""The key of the one-key objects that stand for what is not a result as such: a result that
was not kept, or a result whose own text would read as such an object."""
_MARKED: Final = '{"$twiceshy":'
_KEPT_TEXT: Final = 1000
"""How many characters of a result that could not be kept are kept, as text."""


class NotKept(Exception):
    """Raised by :meth:`ResultCodec.decode` for a result recorded as not kept.

    Attributes:
        type_name: the result's type, qualified.
        why: why it could not be kept.
        text: the first characters of its ``str()``.
    """

    def __init__(self, type_name: str, why: str, text: str) -> None:
        super().__init__(why)
        self.type_name = type_name
        self.why = why
        self.text = text


def not_kept(value: object, why: str) -> str:
    """The stored text for a result of a tool that ran and could not be kept as JSON."""
    try:
        text = str(value)
    except Exception:
        text = ""
    if len(text) > _KEPT_TEXT:
        text = text[:_KEPT_TEXT] + "..."
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else type_name(kind)
    data = {_MARK: "not kept", "type": name, "why": why, "text": text}
    return json.dumps(data)  # ASCII escapes: any text is storable


_AS_IS: frozenset[Any] = frozenset(
    {None, Any, object, str, int, bool, dict, list, type(None), inspect.Signature.empty}
)


def _to_json(value: Any) -> Any:
    """The JSON form of one non-JSON value (``json.dumps``'s ``default``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump) and hasattr(type(value), "model_fields"):
        # round_trip: what the model validates back (no computed fields, Json[] fields as text).
        return dump(mode="json", round_trip=True)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID | pathlib.PurePath):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, set | frozenset):
        return sorted(value, key=lambda v: json.dumps(v, default=_to_json, sort_keys=True))
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__qualname__} has no JSON form")


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
        if isinstance(annotation, ReturnOf):
            annotation = annotation.resolved()
        self._rebuild: Rebuild | None
        if isinstance(annotation, ReturnOf):
            self._rebuild = _deferred(annotation)
        else:
            reason = unstorable(annotation)
            if reason is not None:
                raise ResultNotStorable(reason)
            self._rebuild = _rebuilder(annotation)
        self._max_bytes = max_bytes

    def encode(self, value: object) -> str:
        """The JSON text of a result.

        Raises:
            ResultNotStorable: the value has no JSON form, or its text exceeds the bound.
        """
        try:
            try:
                text = _ENCODE(value)
            except TypeError:
                # Perhaps a mapping key json writes no text for (an enum, a UUID, a date): once
                # more the slow way, with every key made its text first.
                value = _with_text_keys(value)
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
                f"the tool's result is larger than the bound of {self._max_bytes} bytes "
                "(max_result_bytes=)"
            )
        if text.startswith(_MARKED):
            # A result whose own text reads as a marked object: kept inside one, as a value.
            text = f'{{"{_MARK}":"value","value":{text}}}'
        return text

    def decode(self, text: str) -> Any:
        """The replayed result: the stored JSON, rebuilt as the annotated type where it can be.

        Raises:
            NotKept: the tool ran, and its result was recorded as not kept.
        """
        # json.loads(text), with the text this codec writes (no white space around it) read by
        # the decoder's scanner directly: a replay decodes on every call.
        try:
            data, end = _SCAN(text, 0)
        except StopIteration:
            end = -1
        if end != len(text):
            data = json.loads(text)  # white space around the value, or not JSON: loads says what
        if text.startswith(_MARKED) and type(data) is dict and len(data) >= 2:
            if data.get(_MARK) == "value":
                data = data["value"]
            elif data.get(_MARK) == "not kept":
                raise NotKept(str(data.get("type")), str(data.get("why")), str(data.get("text")))
        if self._rebuild is None:
            return data
        try:
            return self._rebuild(data)
        except Exception:  # e.g. decimal.InvalidOperation, a __post_init__'s own error
            return data


# The scanner json.loads uses (typeshed types its argument as the scanner class, not a decoder).
_SCAN: Final[Callable[[str, int], tuple[Any, int]]] = json.scanner.make_scanner(
    cast(Any, json.JSONDecoder())
)


class ReturnOf:
    """The return annotation of ``fn``, read when first needed: it may name a type defined
    after the tool (under ``from __future__ import annotations``, or imported for type checking
    only), which cannot be resolved when the tool is decorated."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def resolved(self) -> Any:
        """The annotation itself where it can be read now, else this object."""
        try:
            return typing.get_type_hints(self.fn, include_extras=True).get("return")
        except Exception:
            return self


def unstorable(hint: Any) -> str | None:
    """Why results annotated ``hint`` could never be kept as JSON, or ``None`` when they can be.

    Only what is sure to fail is refused: a plain class with no JSON form, a callable, an
    iterator or a coroutine, also inside containers, unions and the fields of dataclasses,
    TypedDicts and named tuples. What cannot be read (a forward reference, a type variable)
    passes; its values are checked when stored.
    """
    return _unstorable(hint, set())


_NO_JSON_ORIGINS: Final = frozenset(
    {
        collections.abc.Callable,
        collections.abc.Iterator,
        collections.abc.Generator,
        collections.abc.AsyncIterator,
        collections.abc.AsyncIterable,
        collections.abc.AsyncGenerator,
        collections.abc.Awaitable,
        collections.abc.Coroutine,
        type,
    }
)

_JSON_CLASSES: Final = (
    str,
    int,
    float,
    bool,
    list,
    tuple,
    dict,
    set,
    frozenset,
    collections.abc.Mapping,
    dt.date,
    dt.time,
    Decimal,
    uuid.UUID,
    pathlib.PurePath,
    bytes,
    bytearray,
    enum.Enum,
    type(None),
)


def _unstorable(hint: Any, seen: set[int]) -> str | None:
    try:
        if hint in _AS_IS:
            return None
    except TypeError:
        pass
    if isinstance(hint, str | typing.ForwardRef | typing.TypeVar) or hint is typing.NoReturn:
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated or origin in _FIELD_WRAPPERS:
        return _unstorable(args[0], seen)
    if origin is typing.Literal:
        return None
    if origin in _NO_JSON_ORIGINS or hint in _NO_JSON_ORIGINS:
        return f"{_hint_name(hint)} has no JSON form"
    if origin is typing.Union or origin is types.UnionType:
        # Sure to fail only when every member is: `Foo | None` may well answer None.
        reasons = [_unstorable(arg, seen) for arg in args]
        return reasons[0] if all(reasons) else None
    if origin is not None:
        if (
            isinstance(origin, type)
            and origin not in _CONTAINERS
            and not _json_class(origin)
            and not _abstract(origin)
            and not dataclasses.is_dataclass(origin)
            and not hasattr(origin, "model_fields")
        ):
            return f"{origin.__qualname__} has no JSON form"
        for arg in args:
            if arg is not Ellipsis and not isinstance(arg, list):
                reason = _unstorable(arg, seen)
                if reason is not None:
                    return reason
        return None
    if not isinstance(hint, type):
        return None  # something typing-specific that cannot be read: checked when stored
    if id(hint) in seen:
        return None
    seen.add(id(hint))
    if _json_class(hint) or (hasattr(hint, "model_fields") and hasattr(hint, "model_dump")):
        if issubclass(hint, dict | tuple) or dataclasses.is_dataclass(hint):
            return _fields_unstorable(hint, seen)
        return None
    if dataclasses.is_dataclass(hint):
        return _fields_unstorable(hint, seen)
    if _abstract(hint):
        return None  # an ABC or a protocol: what is returned may well have a JSON form
    return f"{hint.__qualname__} has no JSON form"


def _abstract(cls: type) -> bool:
    """Whether ``cls`` only describes what its values can do (an ABC, a protocol)."""
    return isinstance(cls, abc.ABCMeta) or bool(getattr(cls, "_is_protocol", False))


def _json_class(cls: type) -> bool:
    return issubclass(cls, _JSON_CLASSES)


def _fields_unstorable(cls: type, seen: set[int]) -> str | None:
    """Why a field of a dataclass, TypedDict or named tuple could never be kept, if one can't."""
    if not (
        dataclasses.is_dataclass(cls)
        or hasattr(cls, "__required_keys__")
        or hasattr(cls, "_fields")
    ):
        return None
    for name, hint in _field_hints(cls, {}).items():
        reason = _unstorable(hint, seen)
        if reason is not None:
            return f"{reason} (field {cls.__qualname__}.{name})"
    return None


def _hint_name(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    return str(getattr(origin, "__qualname__", None) or getattr(hint, "_name", None) or hint)


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
    if origin is typing.Annotated or origin in _FIELD_WRAPPERS:
        return _rebuilder(args[0])
    if origin is typing.Literal:
        return _literal_rebuilder(args)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in args if a is not type(None)]
        inner = _rebuilder(options[0]) if len(options) == 1 else None
        return None if inner is None else _optional(inner)
    if origin is tuple or hint is tuple:
        return _tuple_rebuilder(args)
    if origin in (set, frozenset, collections.abc.Set, collections.abc.MutableSet):
        make = origin if origin in (set, frozenset) else set  # an abstract set: a set
        return _collected(make, _rebuilder(args[0]) if args else None)
    if origin in _LIST_LIKE:
        inner = _rebuilder(args[0]) if args else None
        return None if inner is None else _listed(inner)
    if origin in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        key = _key_rebuilder(args[0]) if len(args) == 2 else None
        inner = _rebuilder(args[1]) if len(args) == 2 else None
        if key is not None:
            return _keyed(key, inner or _same)
        return None if inner is None else _valued(inner)
    if isinstance(origin, type):
        # A generic class given its arguments (Box[Decimal]): they stand for its type variables.
        params = getattr(origin, "__parameters__", ())
        return _class_rebuilder(origin, dict(zip(params, args, strict=False)))
    if not isinstance(hint, type):
        return None
    return _class_rebuilder(hint, {})


_LIST_LIKE: Final = frozenset(
    {
        list,
        collections.abc.Sequence,
        collections.abc.MutableSequence,
        collections.abc.Collection,
        collections.abc.Iterable,
    }
)
"""Annotations whose results JSON keeps as a list, and a replay rebuilds as one."""

_FIELD_WRAPPERS: Final = frozenset(
    w for w in (getattr(typing, n, None) for n in ("Required", "NotRequired", "ReadOnly")) if w
)
"""A TypedDict field's qualifiers, around the field's type."""

_CONTAINERS: Final = frozenset(
    {
        typing.Union,
        types.UnionType,
        collections.abc.Set,
        collections.abc.MutableSet,
        collections.abc.Mapping,
        collections.abc.MutableMapping,
    }
    | _LIST_LIKE
)
"""Generic origins whose arguments say whether their values can be kept."""


def _class_rebuilder(cls: type, params: Mapping[Any, Any]) -> Rebuild | None:
    """How to rebuild decoded JSON as an instance of ``cls``, its type variables bound to
    ``params``."""
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):  # a NamedTuple: JSON keeps a list
        return _named_tuple_rebuilder(cls, params)
    validate = getattr(cls, "model_validate", None)
    if callable(validate) and hasattr(cls, "model_fields"):
        return _model_rebuilder(validate)
    if dataclasses.is_dataclass(cls):
        return _dataclass_rebuilder(cls, params)
    if issubclass(cls, dict) and hasattr(cls, "__required_keys__"):  # a TypedDict
        return _typed_dict_rebuilder(cls, params)
    if issubclass(cls, enum.Enum):
        return _enum_rebuilder(cls)
    if cls is float:
        return lambda data: float(data) if type(data) is int else data
    parse = _FROM_TEXT.get(cls)
    if parse is not None:
        return lambda data: parse(data) if type(data) is str else data
    return None


def _date_from_text(text: str) -> dt.date:
    # A datetime is a date: a date-annotated tool may have returned one.
    return dt.datetime.fromisoformat(text) if "T" in text else dt.date.fromisoformat(text)


def _bytes_from_text(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


_FROM_TEXT: dict[type, Rebuild] = {
    dt.datetime: dt.datetime.fromisoformat,
    dt.date: _date_from_text,
    dt.time: dt.time.fromisoformat,
    Decimal: Decimal,
    uuid.UUID: uuid.UUID,
    pathlib.Path: pathlib.Path,
    pathlib.PurePath: pathlib.PurePath,
    pathlib.PosixPath: pathlib.PosixPath,
    pathlib.PurePosixPath: pathlib.PurePosixPath,
    pathlib.PureWindowsPath: pathlib.PureWindowsPath,
    bytes: _bytes_from_text,
    bytearray: lambda text: bytearray(_bytes_from_text(text)),
}


def _key_text(key: Any) -> str:
    """The text JSON keeps a mapping's key as: json's own for text, numbers, ``bool`` and
    ``None``; an enum's value's; the JSON text of a UUID, date, ``Decimal`` or ``bytes``.

    Raises:
        TypeError: the key has no text form (a tuple).
        ValueError: a float key that is not finite.
    """
    if isinstance(key, str):
        return str.__str__(key)  # its text, even for a str-mixed enum with its own __str__
    if key is None or isinstance(key, bool):
        return _ENCODE(key)
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        if not math.isfinite(key):
            raise ValueError(f"a mapping key {key!r} has no JSON form")
        return float.__repr__(key)
    if isinstance(key, enum.Enum):
        return _key_text(key.value)
    text = _to_json(key)
    if not isinstance(text, str):
        raise TypeError(f"a {type(key).__name__} cannot be a key of a stored mapping")
    return text


def _with_text_keys(value: Any) -> Any:
    """``value`` as JSON's own types, every mapping's keys made their text (the slow path).

    Raises:
        TypeError: a part of it has no JSON form.
        ValueError: two keys of one mapping collide as text (``Color.RED`` and ``"red"``).
    """
    if value is None or isinstance(value, str | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_with_text_keys(v) for v in value]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            text = _key_text(key)
            if text in out:
                raise ValueError(f"two keys of a mapping collide as the text {text!r}")
            out[text] = _with_text_keys(item)
        return out
    return _with_text_keys(_to_json(value))


def _key_rebuilder(hint: Any) -> Rebuild | None:
    """How to rebuild a mapping's key, which JSON keeps as text; ``None`` for text keys.

    Keys JSON keeps as text come back as ``int``, ``float``, ``bool``, enums, ``datetime``,
    ``date``, ``time``, ``Decimal``, ``UUID`` and ``bytes`` (keys with no text form, such as
    tuples, are refused when the result is stored).
    """
    if hint is int or hint is float:
        return hint
    if hint is bool:
        return {"true": True, "false": False}.__getitem__
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        by_text = {}
        for member in hint:
            try:
                by_text[_key_text(member.value)] = member
            except (TypeError, ValueError):
                continue  # a member that cannot be a stored key
        return lambda text: by_text.get(text, text)
    return _FROM_TEXT.get(hint)


def _keyed(key: Rebuild, inner: Rebuild) -> Rebuild:
    def rebuild(data: Any) -> Any:
        if type(data) is not dict:
            return data
        try:
            return {key(k): inner(v) for k, v in data.items()}
        except Exception:
            return data

    return rebuild


def _field_hints(cls: type, params: Mapping[Any, Any]) -> dict[str, Any]:
    """A class's field annotations, resolved, its type variables bound to ``params``; none
    where they cannot be resolved (replayed as stored)."""
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:
        return {}
    return {name: _bound(hint, params) for name, hint in hints.items()} if params else hints


def _bound(hint: Any, params: Mapping[Any, Any]) -> Any:
    """``hint`` with the type variables in it replaced by what ``params`` binds them to."""
    if isinstance(hint, typing.TypeVar):
        return params.get(hint, Any)
    free = getattr(hint, "__parameters__", ())
    if not free or isinstance(hint, type):
        return hint
    try:
        return hint[tuple(params.get(p, Any) for p in free)]
    except Exception:
        return hint


def _model_rebuilder(validate: Callable[..., Any]) -> Rebuild:
    def rebuild(data: Any) -> Any:
        try:
            # As dumped: fields by name (aliased or not), values in their JSON form (which a
            # strict model would refuse).
            return validate(data, strict=False, by_name=True)
        except TypeError:  # a pydantic before 2.11, without by_name
            return validate(data, strict=False)

    return rebuild


def _enum_rebuilder(cls: type[enum.Enum]) -> Rebuild:
    by_text: dict[str, enum.Enum] | None = None

    def rebuild(data: Any) -> Any:
        nonlocal by_text
        try:
            return cls(data)
        except (TypeError, ValueError):
            pass
        # A value JSON keeps in another form (a Decimal as text, a tuple as a list).
        if by_text is None:
            by_text = _by_json_text(cls)
        return by_text.get(_ENCODE(data), data)

    return rebuild


def _by_json_text(values: Any) -> dict[str, Any]:
    """The values that have a JSON form, by its text."""
    found: dict[str, Any] = {}
    for value in values:
        try:
            found.setdefault(_ENCODE(value), value)
        except (TypeError, ValueError, RecursionError):
            continue
    return found


def _literal_rebuilder(args: tuple[Any, ...]) -> Rebuild | None:
    """A ``Literal``'s values that JSON keeps in another form (enum members) come back."""
    by_text = _by_json_text(a for a in args if type(a) not in (str, int, bool, type(None)))
    if not by_text:
        return None
    return lambda data: by_text.get(_ENCODE(data), data)


def _typed_dict_rebuilder(cls: type, params: Mapping[Any, Any]) -> Rebuild:
    # As for dataclasses, the fields' annotations are read at first use.
    parts: dict[str, Rebuild] | None = None

    def rebuild(data: Any) -> Any:
        nonlocal parts
        if type(data) is not dict:
            return data
        if parts is None:
            parts = {}
            for name, hint in _field_hints(cls, params).items():
                part = _rebuilder(hint)
                if part is not None:
                    parts[name] = part
        if not parts:
            return data
        return {k: parts[k](v) if k in parts else v for k, v in data.items()}

    return rebuild


def _named_tuple_rebuilder(cls: type, params: Mapping[Any, Any]) -> Rebuild:
    # As for dataclasses, the fields' annotations are read at first use.
    parts: list[Rebuild] | None = None

    def rebuild(data: Any) -> Any:
        nonlocal parts
        if type(data) is not list:
            return data
        if parts is None:
            hints = _field_hints(cls, params)
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


def _dataclass_rebuilder(cls: type, params: Mapping[Any, Any]) -> Rebuild:
    # The fields' annotations may name types defined after the tool: read them at first use.
    fields: list[tuple[str, Rebuild | None]] | None = None

    def rebuild(data: Any) -> Any:
        nonlocal fields
        if type(data) is not dict:
            return data
        if fields is None:
            hints = _field_hints(cls, params)
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
    data = {"type": type_name(type(exc)), "message": _message(exc)}
    if listed is not None and listed is not type(exc):
        data["as"] = type_name(listed)
    # ASCII escapes keep any text storable, lone surrogates included.
    return json.dumps(data)


MAX_ERROR_CHARS: Final = 16_384
"""The most characters of an error's message kept in the ledger (and so replayed)."""


def _message(exc: BaseException) -> str:
    """An error's message, bounded; one whose ``__str__`` raises must still be recorded."""
    try:
        text = str(exc)
    except Exception as broken:
        return f"(its message could not be read: {type(broken).__name__})"
    if len(text) > MAX_ERROR_CHARS:
        left = len(text) - MAX_ERROR_CHARS
        text = f"{text[:MAX_ERROR_CHARS]}... ({left} more characters not kept)"
    return text


def decode_error(text: str | None) -> tuple[str, str, str]:
    """The type name, message and listed type name ("" for none) of a stored error."""
    if not text:
        return "", "", ""
    data = json.loads(text)
    return str(data.get("type", "")), str(data.get("message", "")), str(data.get("as", ""))
