"""The tool decorator: it binds a Python function's calls by name and hands each to a guard."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, cast

from ._binding import Binder, calls_point_of_no_return, refuse_generator, warn_if_keyless
from ._codec import ReturnOf
from ._drivers import aexecute, execute
from ._reconciling import is_async
from ._records import Effect
from ._scope import current_call
from .typing import NOT_GIVEN, NotGiven

if TYPE_CHECKING:
    from ._guard import Guard
    from ._ledger import Ledger

__all__ = ["decorating"]

P = ParamSpec("P")
R = TypeVar("R")


def decorating(
    ledger: Ledger,
    *,
    name: str | NotGiven,
    key_param: str,
    inject: Collection[str],
    effect_at: Literal["auto", "mark", "http"] | None,
    options: dict[str, Any],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """What ``ledger.tool(...)`` answers: a decorator protecting a function with a guard made by
    ``ledger.guard`` from ``options`` (the options :meth:`Ledger.tool` shares with it)."""
    reconcile = options.get("reconcile")
    key_args = options.get("key_args", NOT_GIVEN)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        blocking = not is_async(fn)
        if reconcile is not None and blocking and is_async(reconcile):
            raise TypeError("a sync tool needs a sync reconcile= function")
        try:
            returns = inspect.get_annotations(fn, eval_str=True).get("return")
        except Exception:  # it names what is not defined yet: read it at the first replay
            returns = ReturnOf(fn)
        binder = Binder(
            fn,
            key_param=key_param,
            inject=inject,
            key_args=None if key_args is NOT_GIVEN else key_args,
            ignore_args=options.get("ignore_args", ()),
        )
        where: Literal["mark", "http"] | None
        if effect_at == "auto":
            where = "mark" if calls_point_of_no_return(fn) else None
        else:
            where = effect_at
        named = fn.__name__ if name is NOT_GIVEN else name
        effect = options.get("effect")
        recorded = effect is not Effect.SAFE or options.get("record") is True
        if isinstance(effect, Effect) and recorded:
            refuse_generator(fn, named)  # before its return annotation is judged
        guard = ledger.guard(named, returns=returns, effect_at=where, **options)
        if guard.effect is Effect.KEYED:
            warn_if_keyless(fn, named, key_param=binder.key_param, effect_at=where)
        if blocking:
            wrapper = _sync_tool(fn, guard, binder)
        else:
            wrapper = _async_tool(cast("Callable[..., Awaitable[Any]]", fn), guard, binder)
        wrapper.twiceshy = guard  # type: ignore[attr-defined]
        return cast("Callable[P, R]", wrapper)

    return decorate


def _sync_tool(fn: Callable[..., Any], guard: Guard, binder: Binder) -> Callable[..., Any]:
    protection = guard.protection

    @functools.wraps(fn)
    def protected(*args: Any, **kwargs: Any) -> Any:
        arguments, explicit = binder.bind(args, kwargs)
        bound = guard.bind(arguments, key=explicit)

        def work(key: str) -> Any:
            call_args, call_kwargs = _with_key(binder, args, kwargs, key)
            return fn(*call_args, **call_kwargs)

        return execute(protection, bound, work, None)

    return protected


def _async_tool(
    fn: Callable[..., Awaitable[Any]], guard: Guard, binder: Binder
) -> Callable[..., Awaitable[Any]]:
    protection = guard.protection

    @functools.wraps(fn)
    async def protected(*args: Any, **kwargs: Any) -> Any:
        arguments, explicit = binder.bind(args, kwargs)
        bound = guard.bind(arguments, key=explicit)

        def work(key: str) -> Awaitable[Any]:
            call_args, call_kwargs = _with_key(binder, args, kwargs, key)
            return fn(*call_args, **call_kwargs)

        return await aexecute(protection, bound, work, None)

    return protected


def _with_key(
    binder: Binder, args: tuple[Any, ...], kwargs: dict[str, Any], key: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments to run the tool with: the key injected through its key parameter, if it
    has one, which hands the key on (the tool has it to give its provider)."""
    if not key or binder.key_param is None:
        return args, kwargs
    current = current_call()
    if current is not None:
        current.handed = True
    return binder.call_args(args, kwargs, key)
