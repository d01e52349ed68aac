"""What the durable-engine adapters share: which of twiceshy's answers end an engine's retries,
and errors that survive the engine's journal.

A durable engine (DBOS, Prefect, Temporal) retries a step that raised. Most of twiceshy's answers
are final: retrying the step asks the ledger the same question and gets the same answer
(``OutcomeUnknown`` for an UNSAFE tool that may have taken effect; a refused key; arguments with
no key form), so a retry only burns the engine's budget - or, with Temporal's unlimited default,
never ends. Two answers say that nothing ran and a later attempt may succeed: ``NotApplied`` (the
tool's own word) and ``StoreUnavailable`` (the ledger could not be reached, so the tool was not
started). Those, and every error of the tool's own, are left to the engine's retry policy.

Engines journal a step's error: DBOS and Prefect pickle it. twiceshy's errors take their fields
as arguments, while pickle rebuilds an exception from its message alone, so :func:`portable`
gives an error a reduction that rebuilds it with its fields.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from twiceshy import NotApplied, StoreUnavailable, TwiceshyError

__all__ = ["is_final", "portable", "retried"]

E = TypeVar("E", bound=BaseException)

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


def portable(error: E) -> E:
    """``error``, made to survive pickling with its fields (``tool``, ``key``, ...).

    ``pickle`` rebuilds an exception by calling its type with ``args`` - the message - which
    twiceshy's errors do not take (``OutcomeUnknown(tool, key, reason)``). The error is given a
    reduction of its own that rebuilds it from its message and fields; the rebuilt error has it
    too, so a journal may load and store it again. Errors that are not twiceshy's are returned
    as they are.
    """
    if isinstance(error, TwiceshyError) and "__reduce_ex__" not in vars(error):
        error.__reduce_ex__ = _Reduction(error)  # type: ignore[method-assign, assignment]
    return error


class _Reduction:
    """The reduction :func:`portable` gives an error: its type, its ``args`` and its fields."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __call__(self, protocol: int) -> tuple[Any, ...]:
        error = self._error
        fields = {name: value for name, value in vars(error).items() if name != "__reduce_ex__"}
        return (_rebuilt, (type(error), error.args, fields))


def _rebuilt(kind: type[BaseException], args: tuple[Any, ...], fields: dict[str, Any]) -> Any:
    """An error of ``kind`` with ``args`` and ``fields``, made without calling its constructor."""
    error = kind.__new__(kind, *args)
    error.args = args
    vars(error).update(fields)
    return portable(error)
