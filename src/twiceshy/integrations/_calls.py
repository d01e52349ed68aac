"""What every framework adapter does alike: name the intent by what the tool receives, and word
twiceshy's answers for the model.

- :func:`received`: the arguments a tool function receives, by parameter name, defaults applied
  and the framework's injected parameters left out, from the positional and keyword arguments
  the framework's own parsing and validation produced. A model that sends ``"2"`` for an ``int``
  parameter, or leaves out an optional one, names the same intent as one that sends ``2`` or
  the default (DESIGN.md §2, "Which arguments").
- :func:`with_schema_defaults`: for a tool with no Python function behind it (a remote MCP tool),
  the JSON arguments with the input schema's defaults for the ones left out.
- :func:`for_the_model`: the text the model reads for an error twiceshy must word itself: an
  unknown outcome, a call in progress, a refused key, a result not kept, and a KEYED tool out of
  attempts (it may have taken effect; an identical call later is safe, since the provider
  deduplicates by the same key). Other errors keep the framework's own handling.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from .._binding import Binder, calls_point_of_no_return
from .._ledger import Guard
from .._protocol import describe, exhausted
from .._records import Effect
from ..errors import (
    InProgress,
    KeyReuseMismatch,
    OutcomeUnknown,
    ResultNotStorable,
    TwiceshyError,
    UnkeyableArgument,
)

__all__ = [
    "ANSWERED",
    "effect_at_of",
    "for_the_model",
    "keyed_exhausted",
    "received",
    "with_schema_defaults",
]

ANSWERED = (OutcomeUnknown, InProgress, KeyReuseMismatch, UnkeyableArgument, ResultNotStorable)
"""twiceshy's own answers whose text is for the model: nothing (more) runs for this call."""

_BINDERS: weakref.WeakKeyDictionary[Callable[..., Any], dict[frozenset[str], Binder]] = (
    weakref.WeakKeyDictionary()
)


def received(
    fn: Callable[..., Any],
    args: tuple[Any, ...] | list[Any],
    kwargs: Mapping[str, Any],
    *,
    inject: Collection[str] = (),
) -> dict[str, Any]:
    """The arguments ``fn`` receives from a call ``fn(*args, **kwargs)``, by parameter name.

    Defaults are applied for omitted parameters; ``inject`` names the parameters the framework
    fills in (a context, a dependency), which are left out (they need not be given).

    Raises:
        TypeError: the arguments do not fit the signature.
    """
    inject = frozenset(inject)
    try:
        binders = _BINDERS.setdefault(fn, {})
    except TypeError:  # a callable that takes no weak reference: bound afresh
        binders = {}
    binder = binders.get(inject)
    if binder is None:
        binder = binders[inject] = Binder(fn, key_param=None, inject=inject)
    return binder.bind(*binder.with_injected(tuple(args), kwargs))[0]


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
