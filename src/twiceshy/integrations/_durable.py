"""What the durable-engine adapters share: which of twiceshy's answers end an engine's retries.

A durable engine (DBOS, Prefect, Temporal) retries a step that raised. Most of twiceshy's answers
are final: retrying the step asks the ledger the same question and gets the same answer
(``OutcomeUnknown`` for an UNSAFE tool that may have taken effect; a refused key; arguments with
no key form), so a retry only burns the engine's budget - or, with Temporal's unlimited default,
never ends. Two answers say that nothing ran and a later attempt may succeed: ``NotApplied`` (the
tool's own word) and ``StoreUnavailable`` (the ledger could not be reached, so the tool was not
started). Those, and every error of the tool's own, are left to the engine's retry policy.

Engines journal a step's error (DBOS and Prefect pickle it): twiceshy's errors pickle with their
fields by themselves (``TwiceshyError.__reduce__``), so nothing here converts them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from twiceshy import NotApplied, StoreUnavailable, TwiceshyError

__all__ = ["is_final", "retried"]

# Answers that say nothing ran, where a later attempt may go through.
_NOT_FINAL: tuple[type[BaseException], ...] = (NotApplied, StoreUnavailable)


def is_final(error: object) -> bool:
    """Whether ``error`` is an answer of twiceshy that no retry of the step can change.

    Every :class:`twiceshy.TwiceshyError` but ``NotApplied`` and ``StoreUnavailable``:
    ``OutcomeUnknown``, ``InProgress``, ``KeyReuseMismatch``, ``MissingScope``,
    ``UnkeyableArgument``, ``ResultNotStorable``, ``RepeatedRequest``, ``ReplayedError``,
    ``FencedOut``, ``OutcomeNotRecorded``, the adapters' ``EffectNotDeclared``...
    """
    return isinstance(error, TwiceshyError) and not isinstance(error, _NOT_FINAL)


def retried(
    should_retry: Callable[[BaseException], Any] | None,
) -> Callable[[BaseException], Any]:
    """A retry predicate that refuses twiceshy's final answers, else asks ``should_retry``
    (which may be a coroutine function: the predicate is one too)."""
    if should_retry is None:

        def unless_final(error: BaseException) -> bool:
            return not is_final(error)

        return unless_final
    if inspect.iscoroutinefunction(should_retry):

        async def unless_final_async(error: BaseException) -> bool:
            return not is_final(error) and bool(await should_retry(error))

        return unless_final_async

    def unless_final_then(error: BaseException) -> bool:
        return not is_final(error) and bool(should_retry(error))

    return unless_final_then
