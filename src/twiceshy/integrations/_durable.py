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

A recovered unit may meet the claim of the worker that died, still inside its lease. Since
``InProgress`` ends the engine's retries, the adapters make a unit wait the lease out by default
(:func:`waiting_out_the_lease`), so that the recovery takes the intent over (KEYED, with the same
key) or answers ``OutcomeUnknown`` (UNSAFE). Where ``InProgress`` is still the answer (a live
owner outlasted the wait, or a ``wait=`` of the user's own), :func:`in_engine` words it for the
engine: its retries end there, and where the engine brings no later call of the intent, the
answer promises none.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Final

from twiceshy import InProgress, Ledger, NotApplied, StoreUnavailable, TwiceshyError

__all__ = ["WAIT_MARGIN", "in_engine", "is_final", "retried", "waiting_out_the_lease"]

# Answers that say nothing ran, where a later attempt may go through.
_NOT_FINAL: tuple[type[BaseException], ...] = (NotApplied, StoreUnavailable)

WAIT_MARGIN: Final = 5.0
"""Seconds a unit under an engine waits beyond ``lease=`` by default: a recovery that starts
at once after its worker died outwaits the dead claim's lease, clocks a little apart included."""

# Ledger.tool's own default lease, read from its signature so that the two never drift apart.
_DEFAULT_LEASE: Final = inspect.signature(Ledger.tool).parameters["lease"].default


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


def waiting_out_the_lease(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` of :meth:`twiceshy.Ledger.tool`, with a ``wait=`` longer than ``lease=``
    unless they give one: ``lease + WAIT_MARGIN`` seconds.

    A unit that a recovery runs again while the dead worker's claim is still inside its lease
    then waits for the lease to lapse, instead of answering ``InProgress``, which would end the
    engine's retries with nothing taken up. A ``lease=`` of the wrong type is left for
    ``Ledger.tool`` to refuse by name.
    """
    if "wait" in options:
        return dict(options)
    lease = options.get("lease", _DEFAULT_LEASE)
    if isinstance(lease, timedelta):
        lease = lease.total_seconds()
    if isinstance(lease, bool) or not isinstance(lease, int | float):
        return dict(options)
    return {**options, "wait": lease + WAIT_MARGIN}


def in_engine(error: InProgress, *, ends: str, resumable: bool = True) -> InProgress:
    """``error`` as a unit of an engine answers it: the same fields, and a text that says what
    ends with it (``ends``), and whether a later identical call may take the intent up.

    Args:
        error: the ledger's answer.
        ends: what ends here, e.g. ``"Prefect does not retry this task"``.
        resumable: whether a later identical call may come by itself (``False`` where the engine
            ends the run with this answer and brings no later call of the intent).
    """
    return InProgress(
        error.tool,
        error.key,
        started_at=error.started_at,
        lapses_at=error.lapses_at,
        effect=error.effect,
        here=error.here,
        resumed=error.resumed,
        ends=ends,
        resumable=resumable,
    )
