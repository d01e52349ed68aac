"""Asking a tool's reconciler what became of an intent, from blocking and from async code."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ._protocol import DidNotHappen, Happened
from .typing import Reconciler

__all__ = ["Reconciler", "areconciled", "awaited", "is_async", "loop_running", "reconciled"]

log = logging.getLogger("twiceshy")


async def awaited(answer: Awaitable[Any], key: str) -> Any:
    try:
        return _answer(await answer, key)
    except Exception:
        log.warning("twiceshy: reconcile of key %s failed", key, exc_info=True)
        return None


def reconciled(reconcile: Reconciler, key: str, arguments: Mapping[str, Any] | None) -> Any:
    """Ask a reconciler; a reconciler that fails cannot tell, and the doubt stands."""
    try:
        return _answer(reconcile(key, arguments), key)
    except Exception:
        log.warning("twiceshy: reconcile of key %s failed", key, exc_info=True)
        return None


def _answer(answer: Any, key: str) -> Any:
    """A reconciler's answer; one that is none of the three it may give is said in the log."""
    if answer is None or isinstance(answer, Happened | DidNotHappen) or inspect.isawaitable(answer):
        return answer
    log.warning(
        "twiceshy: the reconciler of key %s answered %r, which is not Happened(...), "
        "DidNotHappen() or None: taken as None (it cannot tell)",
        key,
        answer,
    )
    return None


async def areconciled(reconcile: Reconciler, key: str, arguments: Mapping[str, Any] | None) -> Any:
    """Ask a reconciler from async code: awaited if async, in a worker thread if blocking (it
    looks at a provider: it must not stop the event loop meanwhile)."""
    if is_async(reconcile):
        answer = reconciled(reconcile, key, arguments)
    else:
        answer = await asyncio.to_thread(reconciled, reconcile, key, arguments)
    if inspect.isawaitable(answer):
        return await awaited(answer, key)
    return answer


def loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calls of ``fn`` answer a coroutine: an async def, or an object whose ``__call__``
    is one. A wrapper is taken for what it is, not for what it wraps: a blocking wrapper of an
    async def may run it to the end itself."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - the method itself, not callable()
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(call)
