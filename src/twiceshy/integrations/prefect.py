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
- A subflow's run id is no scope: when its parent is retried after the subflow failed (or
  finished without a persisted result), Prefect starts a new subflow run. A subflow is scoped by
  its parent's scope, ``/``, and the subflow's identity in its parent, as Prefect itself tells it
  apart there: the task key of the task run that stands for it (the flow function's name;
  twiceshy leaves out the hash of its code that Prefect appends, so a fix deployed before the
  retry keeps it), ``#``, and its dynamic key (how many calls of it came before in the parent's
  run): ``"<parent's flow run id>/charge_order#0"``, recursively for a subflow of a subflow. It
  is the same in every retry of the parent, and two calls of one subflow are two intents. A
  subflow called inside a task (or run on remote infrastructure) has no such identity: Prefect
  draws it at random, so its scope is rooted at its own run id, and twiceshy logs a warning;
  call the subflow from the flow's own code. A subflow's parents are read from Prefect's API,
  once per subflow run and process.
- twiceshy's final answers end the task's retries: the retry condition refuses every
  :class:`twiceshy.TwiceshyError` but ``NotApplied`` and ``StoreUnavailable`` (nothing ran), so
  the task fails at once and the flow hears ``OutcomeUnknown``, ``InProgress``,
  ``KeyReuseMismatch``... instead of the task running to the end of its ``retries``. The tool's
  own errors are retried as ``retries`` (and your ``retry_condition_fn=``) say. ``InProgress``
  then says that Prefect does not retry the task.
- A retry waits out a dead worker's lease: unless the options give ``wait=``, a task waits
  ``lease=`` plus 5 seconds for an identical call that holds the claim, so a task run again at
  once after its worker died takes the intent over (KEYED, with the same key) or answers
  ``OutcomeUnknown`` (UNSAFE), instead of ``InProgress``.
- twiceshy's errors survive Prefect's result storage, which pickles a failed task's error: read
  back, they keep their fields (``tool``, ``key``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any, Final, ParamSpec, TypeVar, cast
from uuid import UUID

import prefect
from prefect import Task
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import State, TaskRun
from prefect.context import FlowRunContext, TaskRunContext

from twiceshy import Effect, InProgress, Ledger, run

from ._durable import in_engine, is_final, waiting_out_the_lease

__all__ = ["RetryCondition", "flow_run_scope", "protect", "retry_condition", "task"]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger(__name__)

RetryCondition = Callable[[Task[..., Any], TaskRun, State[Any]], Any]
"""Prefect's ``retry_condition_fn(task, task_run, state)``: whether a failed task runs again
(a bool, or an awaitable of one)."""

# The hash of the function's code that Prefect appends to a task key ("charge_order-1a2b3c4d"):
# any edit changes it, a fix deployed between a subflow's failure and its parent's retry too.
_CODE_HASH: Final = re.compile(r"-(?:[0-9a-f]{8}|unknown)\Z")
# The task key of the task run that stands for a run_deployment() call starts so; no code hash.
_DEPLOYMENT_KEY: Final = "prefect.deployments."
# Subflows nested deeper are refused rather than walked up without end.
_MAX_DEPTH: Final = 64
# Marks the retry conditions that refuse twiceshy's final answers: a tool in a task under one
# knows that Prefect does not retry the task after its InProgress.
_REFUSES_FINAL: Final = "__twiceshy_refuses_final__"


def flow_run_scope() -> str | None:
    """The scope of the flow run the caller runs in (from a task or the flow itself), or
    ``None`` outside any flow run.

    A flow run of its own is scoped by its id. A subflow run, whose id a retry of its parent
    may draw anew, by its parent's scope, ``/``, and its identity in the parent (the task key
    without Prefect's hash of the code, ``#``, the dynamic key): ``"<id>/charge_order#0"``.

    Raises:
        RuntimeError: subflows are nested more than 64 deep.
    """
    here = _here()
    return _scope_of(here) if isinstance(here, UUID) else here


def _here() -> str | UUID | None:
    """The scope of the flow run here when the context tells it (a flow run of its own), the id
    of a flow run whose scope must be read from the API (a subflow's), or ``None`` outside any
    flow run."""
    task_run = TaskRunContext.get()
    flow = FlowRunContext.get()
    flow_run = flow.flow_run if flow is not None else None
    if task_run is not None and task_run.task_run.flow_run_id is not None:
        flow_run_id = task_run.task_run.flow_run_id
    elif flow_run is not None:
        flow_run_id = flow_run.id
    else:
        return None
    if flow_run is not None and flow_run.id == flow_run_id and flow_run.parent_task_run_id is None:
        return str(flow_run_id)
    return flow_run_id


@functools.lru_cache(maxsize=256)  # a flow run's parents never change: read them once
def _scope_of(flow_run_id: UUID) -> str:
    """The scope of the flow run ``flow_run_id``, its parents read from Prefect's API."""
    with get_client(sync_client=True) as client:
        return _walked(client, flow_run_id)


def _walked(client: SyncPrefectClient, flow_run_id: UUID) -> str:
    """The scope of ``flow_run_id``: its identity in each parent, up to a flow run that is no
    subflow - or to a subflow with no stable identity in its parent, rooted there with a
    warning."""
    identities: list[str] = []
    flow_run = client.read_flow_run(flow_run_id)
    for _ in range(_MAX_DEPTH):
        if flow_run.parent_task_run_id is None:
            break
        tracking = client.read_task_run(flow_run.parent_task_run_id)
        identity = _identity(tracking)
        if identity is None or tracking.flow_run_id is None:
            log.warning(
                "twiceshy: the subflow run %s (%r) has no stable identity in its parent: it was "
                "called inside a task, or on remote infrastructure, where Prefect names it at "
                "random, and a retry of the parent may start it as a new run. Its tools are "
                "scoped by its own run id, so after such a retry they would run again under new "
                "keys. Call the subflow from the flow's own code",
                flow_run.id,
                flow_run.name,
            )
            break
        identities.append(identity)
        flow_run = client.read_flow_run(tracking.flow_run_id)
    else:
        raise RuntimeError(
            f"the flow run {flow_run_id} is nested in more than {_MAX_DEPTH} subflows: twiceshy "
            "cannot name its scope, and the tool did not run"
        )
    return "/".join([str(flow_run.id), *reversed(identities)])


def _identity(tracking: TaskRun) -> str | None:
    """How a subflow is told apart in its parent's run, the same in every retry of the parent:
    the task key of the task run that stands for it there, without the hash of the code, and its
    dynamic key. ``None`` where Prefect drew the dynamic key at random."""
    if not tracking.dynamic_key.isdecimal():
        return None
    name = tracking.task_key
    if not name.startswith(_DEPLOYMENT_KEY):
        name = _CODE_HASH.sub("", name)
    return f"{name}#{tracking.dynamic_key}"


async def retry_condition(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """``retry_condition_fn`` for a task of your own around a twiceshy tool: ``False`` when the
    task failed with one of twiceshy's final answers (every ``TwiceshyError`` but
    ``NotApplied`` and ``StoreUnavailable``), ``True`` otherwise."""
    return not is_final(await _error_of(state))


setattr(retry_condition, _REFUSES_FINAL, True)


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
            ``lease=``, ``key_args=``, ``reconcile=``, ``key_window=``...). ``wait=`` is
            ``lease=`` plus 5 seconds unless given: a retry waits out a dead worker's lease.

    Returns:
        A decorator for a ``def`` or ``async def`` tool; the tool keeps its signature.

    Raises:
        TypeError: ``ledger`` is not a :class:`twiceshy.Ledger`; or a twiceshy option is wrong.
        ValueError: a twiceshy option is out of range.
        ResultNotStorable: a KEYED or UNSAFE tool's return annotation has no JSON form.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
    options = waiting_out_the_lease(options)

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
            ``key_args=``, ``reconcile=``, ``key_window=``...). ``wait=`` is ``lease=`` plus 5
            seconds unless given: a retry waits out a dead worker's lease.

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

    setattr(unless_final, _REFUSES_FINAL, True)
    return unless_final


async def _error_of(state: State[Any]) -> object:
    """What a failed run raised, as Prefect hands it to a retry condition."""
    result: Any = state.result(raise_on_failure=False)
    if inspect.isawaitable(result):
        result = await result
    return result


def _worded(error: InProgress) -> InProgress:
    """``error`` as a task answers it: where the running task has no retries, or a retry
    condition that refuses twiceshy's final answers, it says that Prefect does not retry the
    task. A retry of the flow run, or the tool called again, is still a next identical call,
    which may take it up."""
    running = TaskRunContext.get()
    if running is None:
        return error
    refused = getattr(running.task.retry_condition_fn, _REFUSES_FINAL, False)
    if not refused and running.task.retries != 0:
        return error
    return in_engine(error, ends="Prefect does not retry this task")


def _in_flow_run_scope(protected: Callable[P, R]) -> Callable[P, R]:
    """``protected``, called in the flow run's scope when there is one."""
    if inspect.iscoroutinefunction(protected):

        @functools.wraps(protected)
        async def scoped_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            here = _here()
            # A subflow's parents are read from Prefect's API, with a blocking client: off the
            # event loop.
            scope = await asyncio.to_thread(_scope_of, here) if isinstance(here, UUID) else here
            if scope is None:
                return await protected(*args, **kwargs)
            try:
                with run(scope):
                    return await protected(*args, **kwargs)
            except InProgress as exc:
                raise _worded(exc) from None

        return cast(Callable[P, R], scoped_async)

    @functools.wraps(protected)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        scope = flow_run_scope()
        if scope is None:
            return protected(*args, **kwargs)
        try:
            with run(scope):
                return protected(*args, **kwargs)
        except InProgress as exc:
            raise _worded(exc) from None

    return scoped
