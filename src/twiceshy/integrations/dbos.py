"""DBOS: a tool protected inside a ``@DBOS.step``, the workflow id as its scope.

DBOS runs a step at least once: a step whose process died before its output was checkpointed
runs again when the workflow is recovered, and a step with ``retries_allowed=True`` runs again
after an error - an error that may have come after the effect (a lost answer). One line puts
twiceshy inside the step, where every one of those runs meets the ledger::

    from twiceshy import KEYED
    from twiceshy.integrations.dbos import step

    @step(ledger, effect=KEYED, retries_allowed=True, max_attempts=5)
    def create_charge(amount: int, customer: str) -> str:
        return stripe.PaymentIntent.create(..., idempotency_key=twiceshy.current_key()).id

What it does:

- Inside the step, never around it. The ledger is asked inside the step's body, so a workflow's
  recovery, which replays checkpointed steps from DBOS's journal without running them, makes no
  ledger I/O in workflow code; only a step that runs again meets the ledger. Never protect a
  tool from workflow code (a Pydantic AI ``TwiceshyCapability`` on a ``DBOSDurability`` agent):
  its ledger I/O would run in the workflow on every replay, and a replayed answer would skip a
  checkpointed step, which DBOS refuses (``DBOSUnexpectedStepError``).
- The scope is the workflow id (``DBOS.workflow_id``), which recovery and step retries keep:
  every run of the step names one intent. It wins over a ``twiceshy.run(...)`` the caller entered,
  which a recovery would not have. Two calls with the same arguments in one workflow are one
  intent; a deliberate repeat must differ in an argument. Called outside any workflow, the step is
  a plain call, scoped as any protected tool (an enclosing ``twiceshy.run(...)``, ``scope=``).
- A child workflow started without an id of its own gets one that DBOS derives from its parent's
  id and the call's position in the parent (``"wf-1-2"``), the same in every recovery of the
  parent: its steps' scope is stable as it is. A forked workflow (``DBOS.fork_workflow``) has a
  new id, and so do its children: a new scope, whose steps run again.
- A recovery waits out the dead worker's lease: unless the options give ``wait=``, a step waits
  ``lease=`` plus 5 seconds for an identical call that holds the claim, so a workflow recovered
  at once after its process died takes the intent over (KEYED, with the same key) or answers
  ``OutcomeUnknown`` (UNSAFE), instead of ``InProgress``. Where ``InProgress`` is still the
  answer (a live owner outlasted the wait), it says that DBOS does not run the step again and
  that nothing will take the intent up by itself: a recovery or a resume of the workflow answers
  the same.
- twiceshy's final answers end the step's retries: ``should_retry`` refuses every
  :class:`twiceshy.TwiceshyError` but ``NotApplied`` and ``StoreUnavailable`` (nothing ran), so
  the step fails at once and the workflow hears ``OutcomeUnknown``, ``InProgress``,
  ``KeyReuseMismatch``... instead of the step retrying to the end of ``max_attempts``. The
  tool's own errors are retried as DBOS's options say (and as your ``should_retry=`` allows).
- twiceshy's errors survive DBOS's journal: DBOS pickles a failed step's error, and a recovery,
  ``DBOSClient`` or ``retrieve_workflow`` rebuilds it, fields (``tool``, ``key``) included.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar, cast

from dbos import DBOS

from twiceshy import Effect, InProgress, Ledger, OutcomeUnknown, run

from ._durable import in_engine, is_final, retried, waiting_out_the_lease

__all__ = ["retryable", "step", "workflow_scope"]

P = ParamSpec("P")
R = TypeVar("R")

ShouldRetry = Callable[[BaseException], "bool | Awaitable[bool]"]
"""DBOS's ``should_retry``: whether a step that raised this error runs again."""


def workflow_scope() -> str | None:
    """The running workflow's id (``DBOS.workflow_id``), or ``None`` outside any workflow."""
    workflow_id = DBOS.workflow_id
    return workflow_id if isinstance(workflow_id, str) and workflow_id else None


def retryable(error: BaseException) -> bool:
    """``should_retry`` for a ``@DBOS.step`` of your own around a twiceshy tool: ``False`` for
    twiceshy's final answers (every ``TwiceshyError`` but ``NotApplied`` and
    ``StoreUnavailable``), ``True`` for anything else."""
    return not is_final(error)


def step(
    ledger: Ledger,
    *,
    effect: Effect,
    name: str | None = None,
    retries_allowed: bool = False,
    interval_seconds: float = 1.0,
    max_attempts: int = 3,
    backoff_rate: float = 2.0,
    should_retry: ShouldRetry | None = None,
    **options: Any,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Protect a tool with ``ledger`` inside a ``@DBOS.step``; the tool keeps its signature.

    Args:
        ledger: where intents are claimed and outcomes kept.
        effect: the tool's effect class (``twiceshy.SAFE``, ``KEYED``, ``UNSAFE``).
        name: the step's name in DBOS's journal and the tool's name in keys (default: the
            function's ``__qualname__`` for DBOS, its ``__name__`` for twiceshy).
        retries_allowed: DBOS retries the step after an error.
        interval_seconds: DBOS's delay before the first retry.
        max_attempts: DBOS's runs of the step, the first included.
        backoff_rate: DBOS's factor between one delay and the next.
        should_retry: your own predicate over the step's error (sync for a sync step), asked
            only for errors that are not twiceshy's final answers.
        **options: the options of :meth:`twiceshy.Ledger.tool` (``attempts=``, ``lease=``,
            ``key_args=``, ``reconcile=``, ``key_window=``...). ``wait=`` is ``lease=`` plus 5
            seconds unless given: a recovery waits out the dead worker's lease.

    Returns:
        A decorator for a ``def`` or ``async def`` tool.

    Raises:
        TypeError: ``ledger`` is not a :class:`twiceshy.Ledger`; or a twiceshy option is wrong.
        ValueError: a twiceshy option is out of range.
        ResultNotStorable: a KEYED or UNSAFE tool's return annotation has no JSON form.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
    if name is not None:
        options["name"] = name

    options = waiting_out_the_lease(options)

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        protected = ledger.tool(effect=effect, **options)(function)
        return DBOS.step(
            name=name,
            retries_allowed=retries_allowed,
            interval_seconds=interval_seconds,
            max_attempts=max_attempts,
            backoff_rate=backoff_rate,
            should_retry=retried(should_retry),
        )(_in_workflow_scope(protected))

    return decorate


# What ends with InProgress in a step: DBOS's retries, and the workflow, which records it as the
# step's outcome. Neither a recovery nor a resume asks the ledger again; a fork is a new scope.
_ENDS = "DBOS does not run this step again: a recovery or a resume of the workflow answers the same"
# Who answers an unknown outcome again, whatever an operator records: the journal's step error.
_REPLAYED_BY = "a recovery or a resume of this DBOS workflow (a fork is a new scope, and runs it)"


def _unknown_in_a_step(error: OutcomeUnknown) -> OutcomeUnknown:
    """``error`` as a step answers it: an operator's release runs nothing by itself there."""
    return OutcomeUnknown(error.tool, error.key, error.reason, replayed_by=_REPLAYED_BY)


def _in_workflow_scope(protected: Callable[P, R]) -> Callable[P, R]:
    """``protected``, called in the workflow's scope when there is a workflow, its ``InProgress``
    and ``OutcomeUnknown`` worded for a step."""
    if inspect.iscoroutinefunction(protected):

        @functools.wraps(protected)
        async def scoped_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            scope = workflow_scope()
            if scope is None:
                return await protected(*args, **kwargs)
            try:
                with run(scope):
                    return await protected(*args, **kwargs)
            except InProgress as exc:
                raise in_engine(exc, ends=_ENDS, resumable=False) from None
            except OutcomeUnknown as exc:
                raise _unknown_in_a_step(exc) from exc.__cause__

        return cast(Callable[P, R], scoped_async)

    @functools.wraps(protected)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        scope = workflow_scope()
        if scope is None:
            return protected(*args, **kwargs)
        try:
            with run(scope):
                return protected(*args, **kwargs)
        except InProgress as exc:
            raise in_engine(exc, ends=_ENDS, resumable=False) from None
        except OutcomeUnknown as exc:
            raise _unknown_in_a_step(exc) from exc.__cause__

    return scoped
