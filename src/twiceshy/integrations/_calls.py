"""What every framework adapter does alike: name the intent by what the tool receives, and word
twiceshy's answers for the model.

- :func:`received`: the arguments a tool function receives, by parameter name, defaults applied
  and the framework's injected parameters left out, from the positional and keyword arguments
  the framework's own parsing and validation produced. A model that sends ``"2"`` for an ``int``
  parameter, or leaves out an optional one, names the same intent as one that sends ``2`` or
  the default (docs/design.md §2, "Which arguments"). Given the JSON the model sent, a value the
  framework made with a ``default_factory`` for an argument or field the model left out (a
  fresh id, the time) is left out of the intent, at any depth: it names nothing the model asked
  for, and keying it would make every retry a new intent. Arguments that do not fit the
  function by Python's own rules (a required one left out, one it has no parameter for) raise
  :class:`ArgumentsDoNotFit`, the ``TypeError`` the call itself would raise: such a call never
  runs, so the adapter answers it as its framework answers that error, and nothing is claimed.
- :func:`refuse_generator`: a recorded tool whose function is a generator is refused where it is
  declared: calling it returns at once, and its effects would run after the call is recorded.
- :func:`with_schema_defaults`: for a tool with no Python function behind it (a remote MCP tool),
  the JSON arguments with the input schema's defaults for the ones left out.
- :func:`for_the_model`: the text the model reads for an error twiceshy must word itself: an
  unknown outcome, a call in progress, a refused key, a result not kept, and a KEYED tool out of
  attempts (it may have taken effect; an identical call later is safe, since the provider
  deduplicates by the same key). Other errors keep the framework's own handling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import typing
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .. import Effect, Guard
from ..errors import (
    InProgress,
    KeyReuseMismatch,
    OutcomeUnknown,
    ResultNotStorable,
    TwiceshyError,
    UnkeyableArgument,
)
from ._core import Binder, calls_point_of_no_return, describe, exhausted, refuse_generator

__all__ = [
    "ANSWERED",
    "ArgumentsDoNotFit",
    "effect_at_of",
    "factory_fields",
    "for_the_model",
    "keyed_exhausted",
    "received",
    "refuse_generator",
    "with_schema_defaults",
]

ANSWERED = (OutcomeUnknown, InProgress, KeyReuseMismatch, UnkeyableArgument, ResultNotStorable)
"""twiceshy's own answers whose text is for the model: nothing (more) runs for this call."""

_BINDERS: weakref.WeakKeyDictionary[Callable[..., Any], dict[frozenset[str], Binder]] = (
    weakref.WeakKeyDictionary()
)
_MADE: weakref.WeakKeyDictionary[Callable[..., Any], frozenset[str]] = weakref.WeakKeyDictionary()

_PURE: frozenset[Any] = frozenset({list, dict, set, frozenset, tuple, str, int, float, bool, bytes})
"""Default factories that make an equal value every time: their value names the intent as a
plain default does (a ``tags`` list left out and ``[]`` sent are one intent)."""


class ArgumentsDoNotFit(TypeError):
    """A call's arguments do not fit the tool function's parameters by Python's own rules (a
    required one left out, one it has no parameter for): calling the function would raise this
    ``TypeError`` before its body ran.

    Raised before anything is claimed: the call never runs, so it is no intent of the ledger's.
    An adapter answers it as its framework answers such an error (design §4), with the plain
    ``TypeError`` of :meth:`as_raised`, which the framework words as Python's own.
    """

    def as_raised(self) -> TypeError:
        """The ``TypeError`` the function's call would raise, as a framework handles it."""
        return TypeError(*self.args)


def received(
    fn: Callable[..., Any],
    args: tuple[Any, ...] | list[Any],
    kwargs: Mapping[str, Any],
    *,
    inject: Collection[str] = (),
    sent: Mapping[str, Any] | None = None,
    made: Collection[str] = (),
) -> dict[str, Any]:
    """The arguments ``fn`` receives from a call ``fn(*args, **kwargs)``, by parameter name.

    Defaults are applied for omitted parameters; ``inject`` names the parameters the framework
    fills in (a context, a dependency), which are left out (they need not be given). With
    ``sent`` (the JSON object the model sent), what a default factory made for an argument or a
    field the model left out is left out too: the parameters whose default is a pydantic
    ``Field(default_factory=...)``, those the framework's schema names in ``made``, and such
    fields of pydantic models and dataclasses inside the arguments.

    Raises:
        ArgumentsDoNotFit: the arguments do not fit the signature (a ``TypeError``).
        TypeError, ValueError: a signature that cannot be read (a builtin without one): the
            function may still accept the call.
    """
    inject = frozenset(inject)
    try:
        binders = _BINDERS.setdefault(fn, {})
    except TypeError:  # a callable that takes no weak reference: bound afresh
        binders = {}
    binder = binders.get(inject)
    if binder is None:
        binder = binders[inject] = Binder(fn, key_param=None, inject=inject)
    try:
        arguments = binder.bind(*binder.with_injected(tuple(args), kwargs))[0]
    except TypeError as exc:  # inspect's binding: Python's own rules for the call
        raise ArgumentsDoNotFit(f"{_called(fn)} {exc}") from None
    if sent is None:
        return arguments
    factories = _made_by_factories(fn) | frozenset(made)
    kept: dict[str, Any] = {}
    for name, value in arguments.items():
        given = sent.get(name, _ABSENT)
        if given is _ABSENT and name in factories:
            continue
        kept[name] = _as_sent(value, given)
    return kept


_ABSENT: Any = object()


def _called(fn: Callable[..., Any]) -> str:
    """How Python names ``fn`` in the error of a call that does not fit it: ``send_fax()``."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{name if isinstance(name, str) else type(target).__name__}()"


def _made_by_factories(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameters of ``fn`` whose default a factory makes anew (a pydantic ``Field``)."""
    try:
        return _MADE[fn]
    except (KeyError, TypeError):
        pass
    names = set()
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:
        hints = {}
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        parameters = {}  # type: ignore[assignment]
    for name, parameter in parameters.items():
        infos = [parameter.default, *getattr(hints.get(name), "__metadata__", ())]
        if any(isinstance(info, FieldInfo) and _impure(info.default_factory) for info in infos):
            names.add(name)
    found = frozenset(names)
    with contextlib.suppress(TypeError):  # a callable that takes no weak reference: not kept
        _MADE[fn] = found
    return found


def factory_fields(model: object) -> frozenset[str]:
    """The fields of a pydantic model class whose default a factory makes anew (for
    ``received(..., made=)``, where a framework's schema, not the signature, holds them)."""
    fields = getattr(model, "model_fields", None)
    if not isinstance(fields, Mapping):
        return frozenset()
    return frozenset(
        name
        for name, field in fields.items()
        if isinstance(field, FieldInfo) and _impure(field.default_factory)
    )


def _impure(factory: object) -> bool:
    return factory is not None and factory not in _PURE


def _as_sent(value: Any, sent: Any) -> Any:
    """``value`` without what default factories made for the fields ``sent`` left out."""
    if isinstance(value, BaseModel):
        exclude = _model_exclusions(value, sent)
        return value.model_dump(mode="python", exclude=exclude) if exclude else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        given = sent if isinstance(sent, Mapping) else {}
        fields: dict[str, Any] = {}
        changed = False
        for field in dataclasses.fields(value):
            if field.name not in given and _impure(_dataclass_factory(field)):
                changed = True
                continue
            item = getattr(value, field.name)
            fields[field.name] = _as_sent(item, given.get(field.name, _ABSENT))
            changed = changed or fields[field.name] is not item
        return fields if changed else value
    if type(value) is dict:
        given = sent if isinstance(sent, Mapping) else {}
        out = {k: _as_sent(v, given.get(k, _ABSENT)) for k, v in value.items()}
        return out if any(out[k] is not value[k] for k in value) else value
    if type(value) is list or type(value) is tuple:
        given_items = sent if isinstance(sent, list) else []
        items = [
            _as_sent(v, given_items[i] if i < len(given_items) else _ABSENT)
            for i, v in enumerate(value)
        ]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def _dataclass_factory(field: dataclasses.Field[Any]) -> object:
    factory = field.default_factory
    return None if factory is dataclasses.MISSING else factory


def _model_exclusions(model: BaseModel, sent: Any) -> dict[Any, Any] | None:
    """What ``model.model_dump(exclude=...)`` leaves out: the fields a default factory made for
    what ``sent`` left out, and such fields of the models inside it."""
    given = sent if isinstance(sent, Mapping) else {}
    exclude: dict[Any, Any] = {}
    for name, field in type(model).model_fields.items():
        alias = field.alias or name
        present = name in given or alias in given
        if not present and _impure(field.default_factory):
            exclude[name] = True
            continue
        inner = _exclusions_of(getattr(model, name), given.get(alias, given.get(name, _ABSENT)))
        if inner:
            exclude[name] = inner
    return exclude or None


def _exclusions_of(value: Any, sent: Any) -> dict[Any, Any] | None:
    """Exclusions inside a model's field: a model, or models inside a list or a dict."""
    if isinstance(value, BaseModel):
        return _model_exclusions(value, sent)
    if isinstance(value, list | tuple):
        given_items = sent if isinstance(sent, list) else []
        found = {
            i: inner
            for i, item in enumerate(value)
            if (inner := _exclusions_of(item, given_items[i] if i < len(given_items) else None))
        }
        return found or None
    if isinstance(value, dict):
        given = sent if isinstance(sent, Mapping) else {}
        found = {
            k: inner for k, item in value.items() if (inner := _exclusions_of(item, given.get(k)))
        }
        return found or None
    return None


def with_schema_defaults(arguments: Mapping[str, Any], schema: object) -> dict[str, Any]:
    """``arguments`` with the JSON schema's top-level defaults for the ones left out."""
    filled = dict(arguments)
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if isinstance(properties, Mapping):
        for name, spec in properties.items():
            if name not in filled and isinstance(spec, Mapping) and "default" in spec:
                filled[name] = spec["default"]
    return filled


def effect_at_of(fn: Callable[..., Any] | None) -> Literal["mark"] | None:
    """``"mark"`` for a tool function whose code calls ``point_of_no_return``, else ``None``."""
    return "mark" if fn is not None and calls_point_of_no_return(fn) else None


def keyed_exhausted(guard: Guard, error: BaseException, key: str) -> str:
    """What the model reads when a KEYED tool failed on every attempt with an ambiguous error."""
    attempts = guard.policy.attempts
    tried = f"{attempts} attempts" if attempts > 1 else "its one attempt"
    return (
        f"The tool {guard.name!r} did not finish on {tried} (the last: "
        f"{describe(error, guard.policy.wrappers)}): it may have taken effect. It was sent with "
        "an idempotency key that stays the same for these arguments, so the provider applies it "
        "at most once: calling it again later with the same arguments is safe and does not "
        "repeat it. If it keeps failing, tell the user that the action may have happened and "
        f"needs to be checked (reference {key[:16]})."
    )


def for_the_model(
    guard: Guard,
    error: BaseException,
    arguments: Mapping[str, Any],
    *,
    scope: str | None = None,
    key: str | None = None,
) -> str | None:
    """twiceshy's text for the model for ``error``, raised by ``guard.call`` / ``acall``; or
    ``None`` when the framework's own handling should answer (a certain failure, an error after
    which nothing happened, a SAFE tool's error, an error of the ledger itself, which must fail
    the run).

    ``arguments``, ``scope`` and ``key`` are those the call was made with: a KEYED tool out of
    attempts is named by its key.
    """
    if isinstance(error, ANSWERED):
        return str(error)
    if guard.effect is not Effect.KEYED or not exhausted(error):
        return None
    try:
        named = guard.key_for(arguments, scope=scope, key=key)
    except TwiceshyError:  # pragma: no cover - the call itself was keyed alike
        return None
    return keyed_exhausted(guard, error, named)
