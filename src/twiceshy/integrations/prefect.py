"""Prefect: a tool protected inside a task, the flow run's id as its scope.

Prefect runs a task again when it failed and has ``retries`` left - an error that may have come
after the effect (a lost answer) - and when a crashed flow run is retried, every task that had not
completed runs again. A cache key is no claim: two runs of a task started together both run. One
line puts twiceshy inside the task, where every one of those runs meets the ledger::

    from twiceshy import KEYED
    from twiceshy.integrations.prefect import task

    @task(ledger, effect=KEYED, retries=3, retry_delay_seconds=2)
    def create_charge(amount: int, customer: str) -> str:
        return stripe.PaymentIntent.create(..., idempotency_key=twiceshy.current_key()).id

What it does:

- Inside the task, never around it. The ledger is asked in the task's body, so Prefect's own
  task retries come back through it, and a task that a retried flow run takes from its cache
  (``persist_result=True``) does not ask the ledger at all. A Pydantic AI agent made durable with
  ``PrefectDurability`` runs each tool call in a task: protect its tool function with
  :func:`protect` (not ``TwiceshyCapability``, whose hook runs in the flow, around the task).
- The scope is the flow run's id, which Prefect keeps when it retries a task and when it retries
  the flow run (``prefect flow-run retry``, a flow's ``retries=``): every run of the task names
  one intent. It wins over a ``twiceshy.run(...)`` the caller entered, which a retried flow run
  would not have. A new flow run is a new scope. Two calls with the same arguments in one flow run
  are one intent; a deliberate repeat must differ in an argument. Outside any flow run (a task
  called by itself), the tool is scoped as any protected tool.
- twiceshy's final answers end the task's retries: the retry condition refuses every
  :class:`twiceshy.TwiceshyError` but ``NotApplied`` and ``StoreUnavailable`` (nothing ran), so
  the task fails at once and the flow hears ``OutcomeUnknown``, ``InProgress``,
  ``KeyReuseMismatch``... instead of the task running to the end of its ``retries``. The tool's
  own errors are retried as ``retries`` (and your ``retry_condition_fn=``) say.
- twiceshy's errors survive Prefect's result storage, which pickles a failed task's error: read
  back, they keep their fields (``tool``, ``key``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import prefect
from prefect import Task
from prefect.client.schemas.objects import State, TaskRun
from prefect.context import FlowRunContext, TaskRunContext

from twiceshy import Effect, Ledger, run

from ._durable import is_final

__all__ = ["RetryCondition", "flow_run_scope", "protect", "retry_condition", "task"]

P = ParamSpec("P")
R = TypeVar("R")

RetryCondition = Callable[[Task[..., Any], TaskRun, State[Any]], Any]
"""Prefect's ``retry_condition_fn(task, task_run, state)``: whether a failed task runs again
(a bool, or an awaitable of one)."""


def flow_run_scope() -> str | None:
    """The id of the flow run the caller runs in (from a task or the flow itself), or ``None``
    outside any flow run."""
    task_run = TaskRunContext.get()
    if task_run is not None and task_run.task_run.flow_run_id is not None:
        return str(task_run.task_run.flow_run_id)
    flow_run = FlowRunContext.get()
    if flow_run is not None and flow_run.flow_run is not None:
        return str(flow_run.flow_run.id)
    return None


async def retry_condition(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """``retry_condition_fn`` for a task of your own around a twiceshy tool: ``False`` when the
    task failed with one of twiceshy's final answers (every ``TwiceshyError`` but
    ``NotApplied`` and ``StoreUnavailable``), ``True`` otherwise."""
    return not is_final(await _error_of(state))


def protect(
    ledger: Ledger, *, effect: Effect, **options: Any
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Protect a tool with ``ledger``, scoped by the flow run, for use inside a Prefect task.

    Use it where something else makes the task: a ``@prefect.task`` of your own (give it
    ``retry_condition_fn=retry_condition``), or Pydantic AI's ``PrefectDurability``, which runs
    each tool call in a task (give its tool tasks the same retry condition through
    ``tool_task_config``). :func:`task` is both in one.

    Args:
        ledger: where intents are claimed and outcomes kept.
        effect: the tool's effect class (``twiceshy.SAFE``, ``KEYED``, ``UNSAFE``).
        **options: the options of :meth:`twiceshy.Ledger.tool` (``name=``, ``attempts=``,
            ``lease=``, ``key_args=``, ``reconcile=``, ``key_window=``...).

    Returns:
        A decorator for a ``def`` or ``async def`` tool; the tool keeps its signature.

    Raises:
        TypeError: ``ledger`` is not a :class:`twiceshy.Ledger`; or a twiceshy option is wrong.
        ValueError: a twiceshy option is out of range.
        ResultNotStorable: a KEYED or UNSAFE tool's return annotation has no JSON form.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        return _in_flow_run_scope(ledger.tool(effect=effect, **options)(function))

    return decorate


def task(
    ledger: Ledger,
    *,
    effect: Effect,
    name: str | None = None,
    retries: int = 0,
    retry_delay_seconds: float | list[float] | None = None,
    retry_condition_fn: RetryCondition | None = None,
    **options: Any,
) -> Callable[[Callable[P, R]], Task[P, R]]:
    """Protect a tool with ``ledger`` inside a Prefect task of its own.

    Prefect's other task options are set on the task it returns, with Prefect's own
    ``.with_options(...)`` (``persist_result=True``, ``timeout_seconds=``...).

    Args:
        ledger: where intents are claimed and outcomes kept.
        effect: the tool's effect class (``twiceshy.SAFE``, ``KEYED``, ``UNSAFE``).
        name: the task's name in Prefect and the tool's name in keys (default: the function's
            ``__name__``).
        retries: Prefect's runs of the task after a failure.
        retry_delay_seconds: Prefect's delay before each retry.
        retry_condition_fn: your own condition over a failed run, asked only when the error is
            not one of twiceshy's final answers.
        **options: the options of :meth:`twiceshy.Ledger.tool` (``attempts=``, ``lease=``,
            ``key_args=``, ``reconcile=``, ``key_window=``...).

    Returns:
        A decorator that makes a ``def`` or ``async def`` tool a Prefect ``Task``.

    Raises:
        TypeError: ``ledger`` is not a :class:`twiceshy.Ledger`; or a twiceshy option is wrong.
        ValueError: a twiceshy option is out of range.
        ResultNotStorable: a KEYED or UNSAFE tool's return annotation has no JSON form.
    """
    if name is not None:
        options["name"] = name
    protecting = protect(ledger, effect=effect, **options)
    condition = _unless_final(retry_condition_fn)

    def decorate(function: Callable[P, R]) -> Task[P, R]:
        made = prefect.task(
            name=name,
            retries=retries,
            retry_delay_seconds=retry_delay_seconds,
            retry_condition_fn=condition,
        )
        return cast(Task[P, R], made(protecting(function)))

    return decorate


def _unless_final(condition: RetryCondition | None) -> RetryCondition:
    """A retry condition that refuses twiceshy's final answers, else asks ``condition``."""
    if condition is None:
        return retry_condition

    async def unless_final(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
        if is_final(await _error_of(state)):
            return False
        decision = condition(task, task_run, state)
        return bool(await decision if inspect.isawaitable(decision) else decision)

    return unless_final


async def _error_of(state: State[Any]) -> object:
    """What a failed run raised, as Prefect hands it to a retry condition."""
    result: Any = state.result(raise_on_failure=False)
    if inspect.isawaitable(result):
        result = await result
    return result


def _in_flow_run_scope(protected: Callable[P, R]) -> Callable[P, R]:
    """``protected``, called in the flow run's scope when there is one."""
    if inspect.iscoroutinefunction(protected):

        @functools.wraps(protected)
        async def scoped_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            scope = flow_run_scope()
            if scope is None:
                return await protected(*args, **kwargs)
            with run(scope):
                return await protected(*args, **kwargs)

        return cast(Callable[P, R], scoped_async)

    @functools.wraps(protected)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        scope = flow_run_scope()
        if scope is None:
            return protected(*args, **kwargs)
        with run(scope):
            return protected(*args, **kwargs)

    return scoped
