"""Results and errors as JSON text: never pickle (DESIGN.md §6).

A result is stored as JSON and replayed as an equal value: falsy results (``0``, ``""``, ``[]``,
``None``) replay as themselves, and a result whose type is the tool's annotated return type
(dataclasses, pydantic models, ``datetime``, ``Decimal``, ``UUID``, containers of these) is rebuilt
as that type.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import inspect
import json
import types
import typing
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from .errors import ResultNotStorable

__all__ = ["MAX_RESULT_BYTES", "ResultCodec", "decode_error", "encode_error"]

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


class ResultCodec:
    """Encodes a tool's results and rebuilds them as its annotated return type.

    Args:
        annotation: the tool's return annotation (``inspect.Signature.empty`` or ``None`` for none).
        max_bytes: the bound on the stored text.
    """

    __slots__ = ("_annotation", "_max_bytes")

    def __init__(self, annotation: Any = None, *, max_bytes: int = MAX_RESULT_BYTES) -> None:
        # JSON's own types come back from json.loads as they are: nothing to rebuild.
        self._annotation = None if annotation in _AS_IS else annotation
        self._max_bytes = max_bytes

    def encode(self, value: object) -> str:
        """The JSON text of a result.

        Raises:
            ResultNotStorable: the value has no JSON form, or its text exceeds the bound.
        """
        try:
            text = json.dumps(
                value, default=_to_json, ensure_ascii=False, allow_nan=False, separators=(",", ":")
            )
        except (TypeError, ValueError, RecursionError) as exc:
            raise ResultNotStorable(f"the tool's result cannot be stored as JSON: {exc}") from exc
        size = len(text)
        if not text.isascii():
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:
                # A lone surrogate has no UTF-8 form: keep it as a \udxxx escape instead.
                text = json.dumps(value, default=_to_json, allow_nan=False, separators=(",", ":"))
                size = len(text)
        if size > self._max_bytes:
            raise ResultNotStorable(
                f"the tool's result is larger than the bound of {self._max_bytes} bytes"
            )
        return text

    def decode(self, text: str) -> Any:
        """The replayed result: the stored JSON, rebuilt as the annotated type where it can be."""
        data = json.loads(text)
        if self._annotation is None:
            return data
        try:
            return _rebuild(data, self._annotation)
        except (TypeError, ValueError, KeyError):
            return data


def _rebuild(data: Any, hint: Any) -> Any:
    """``data`` rebuilt as ``hint`` where the type says how; otherwise ``data`` as it is."""
    if hint is Any or hint is None or hint is type(None) or isinstance(hint, str):
        return data
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _rebuild(data, typing.get_args(hint)[0])
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if data is None or len(options) != 1:
            return data
        return _rebuild(data, options[0])
    if origin in (list, typing.Sequence, set, frozenset) or origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(data, list):
            return data
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_rebuild(v, args[0]) for v in data)
            if args and len(args) == len(data):
                return tuple(_rebuild(v, a) for v, a in zip(data, args, strict=True))
            return tuple(data)
        item = args[0] if args else Any
        items = [_rebuild(v, item) for v in data]
        return origin(items) if origin in (set, frozenset) else items
    if origin in (dict, typing.Mapping):
        args = typing.get_args(hint)
        if not isinstance(data, dict) or len(args) != 2:
            return data
        return {k: _rebuild(v, args[1]) for k, v in data.items()}
    if not isinstance(hint, type):
        return data
    validate = getattr(hint, "model_validate", None)
    if callable(validate) and hasattr(hint, "model_fields"):
        return validate(data)
    if dataclasses.is_dataclass(hint) and isinstance(data, dict):
        hints = typing.get_type_hints(hint)
        fields = {
            f.name: _rebuild(data[f.name], hints.get(f.name, Any))
            for f in dataclasses.fields(hint)
            if f.init and f.name in data
        }
        return hint(**fields)
    if issubclass(hint, enum.Enum):
        return hint(data)
    if hint is dt.datetime and isinstance(data, str):
        return dt.datetime.fromisoformat(data)
    if hint is dt.date and isinstance(data, str):
        return dt.date.fromisoformat(data)
    if hint is Decimal and isinstance(data, str):
        return Decimal(data)
    if hint is uuid.UUID and isinstance(data, str):
        return uuid.UUID(data)
    if hint is bytes and isinstance(data, str):
        return base64.b64decode(data)
    if hint is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    return data


def encode_error(exc: BaseException) -> str:
    """The JSON text kept for a failed call: the error's type and message."""
    kind = type(exc)
    # ASCII escapes keep any text storable, lone surrogates included.
    return json.dumps({"type": f"{kind.__module__}.{kind.__qualname__}", "message": str(exc)})


def decode_error(text: str | None) -> tuple[str, str]:
    """The type name and message of a stored error."""
    if not text:
        return "", ""
    data = json.loads(text)
    return str(data.get("type", "")), str(data.get("message", ""))
