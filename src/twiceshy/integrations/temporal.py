"""Temporal: a tool protected inside an activity, scoped by its workflow.

Temporal retries an activity that failed or timed out, without limit by default: an activity
whose worker died is run again once its timeout passes, and one that raised after its effect (a
lost answer) is run again at once. One line puts twiceshy inside the activity, where every one
of those runs meets the ledger, and one more tells every activity which workflow it works for,
child workflows included::

    from twiceshy import KEYED
    from twiceshy.integrations.temporal import TwiceshyInterceptor, activity

    @activity(ledger, effect=KEYED)
    async def create_charge(amount: int, customer: str) -> str:
        return stripe.PaymentIntent.create(..., idempotency_key=twiceshy.current_key()).id

    worker = Worker(client, ..., interceptors=[TwiceshyInterceptor()])

What it does:

- Inside the activity, never in the workflow. The ledger is asked in the activity, so a
  workflow's deterministic replay, which takes completed activities from the workflow's history
  without running them, never asks it; a protected tool called in workflow code raises
  :class:`InWorkflowCode` before anything runs. With OpenAI Agents' Temporal integration, hand
  the protected activity to ``activity_as_tool(...)`` (its ``on_invoke_tool`` runs in workflow
  code, so no tool wrapper may stand there). A Pydantic AI agent made durable with
  ``TemporalDurability`` runs each tool call in an activity: protect its tool function with
  :func:`protect` (not ``TwiceshyCapability``, whose hook runs in the workflow).
- The scope of a workflow started by a client is its workflow id, which Temporal keeps for every
  attempt of an activity, and across the workflow's runs (a retried, reset or continued-as-new
  workflow): every attempt names one intent. It wins over a ``twiceshy.run(...)`` around the
  worker. Two calls with the same arguments in one workflow are one intent; a deliberate repeat
  (a turn of a conversation) must differ in an argument, such as a turn id. Outside any
  activity, the tool is scoped as any protected tool.
- A child workflow started without an id of its own gets one drawn at random, anew in each run
  of its parent: when the parent is retried, its child runs again under another id. So
  :class:`TwiceshyInterceptor`, on the worker, scopes a child by what stays: its parent's scope,
  ``/``, the child's workflow type, ``#``, and how many children of that type its parent started
  before it (``"order-1234/ChargeWorkflow#0"``; recursively for a child of a child). A child
  started with an id of your own keeps that id as its scope, as before. An id drawn at run time
  is told by its form: a bare UUID (what the SDK draws, ``str(workflow.uuid4())`` too), or one
  that holds the parent's run id. The interceptor passes the scope to each activity in a header;
  an activity that comes without one (a worker without the interceptor) is scoped by its
  workflow id, and twiceshy logs a warning once per process.
- twiceshy's final answers end Temporal's retries: every :class:`twiceshy.TwiceshyError` but
  ``NotApplied`` and ``StoreUnavailable`` (nothing ran) leaves the activity as an
  ``ApplicationError(non_retryable=True)`` whose ``type`` is the error's name (``"OutcomeUnknown"``,
  ``"InProgress"``, ``"KeyReuseMismatch"``...), its message the error's text for the model, and
  its details ``{"tool": ..., "key": ...}`` where the error names them; the twiceshy error is its
  ``__cause__`` in the worker. The workflow then gets an ``ActivityError`` caused by it at once,
  instead of the activity retrying forever. The tool's own errors are retried as the activity's
  retry policy says. ``InProgress`` says that Temporal does not retry the activity.
- A retry waits out a dead worker's lease: unless the options give ``wait=``, an activity waits
  ``lease=`` plus 5 seconds for an identical call that holds the claim, so an attempt that meets
  the claim of a worker that died takes the intent over once its lease lapses (KEYED, with the
  same key) or answers ``OutcomeUnknown`` (UNSAFE), instead of ``InProgress``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn, ParamSpec, TypeVar, cast

import temporalio.client
import temporalio.worker
from temporalio import activity as temporal_activity
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadConverter
from temporalio.exceptions import ApplicationError

from twiceshy import Effect, InProgress, Ledger, TwiceshyError, run

from ._durable import in_engine, is_final, waiting_out_the_lease

__all__ = [
    "InWorkflowCode",
    "TwiceshyInterceptor",
    "activity",
    "non_retryable",
    "protect",
    "workflow_scope",
]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger(__name__)

HEADER: Final = "twiceshy-scope"
"""The header that carries a workflow's scope to its activities, its children and its next run
(continue-as-new): a JSON object ``{"scope": ..., "children": {...}, "unsure": ...}``."""

# What the SDK draws for a child workflow started without an id: str(workflow.uuid4()).
_UUID: Final = re.compile(r"[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")


class InWorkflowCode(TwiceshyError, RuntimeError):
    """A protected tool was called in Temporal workflow code; nothing ran, and the ledger was not
    asked.

    Workflow code must be deterministic: the ledger's answers are not, and a replay would ask it
    again. Call the tool in an activity (:func:`activity`), and from the workflow, run that
    activity. Raised as a plain error, it fails the workflow task, which Temporal retries until
    a worker with the fixed code takes it.
    """


@dataclass(frozen=True, slots=True)
class _Told:
    """A workflow run's scope, as its start header tells it (or its id, without one).

    Attributes:
        scope: the scope of the run's activities.
        children: how many children of each workflow type the workflow started in earlier runs
            (continue-as-new): the next one's number.
        unsure: the scope is the workflow's own id, and that id may have been drawn at random
            (a child whose parent's worker has no twiceshy interceptor).
    """

    scope: str
    children: Mapping[str, int] = field(default_factory=dict)
    unsure: bool = False

    def payload(self, children: Mapping[str, int] | None = None) -> Payload:
        """This scope as the header's value, with ``children`` counted where given."""
        told: dict[str, Any] = {"scope": self.scope}
        if children:
            told["children"] = dict(children)
        if self.unsure:
            told["unsure"] = True
        return PayloadConverter.default.to_payload(told)


def _read(headers: Mapping[str, Payload]) -> _Told | None:
    """The scope a header tells, or ``None`` without a readable one."""
    payload = headers.get(HEADER)
    if payload is None:
        return None
    try:
        told = PayloadConverter.default.from_payload(payload, dict)
    except Exception:  # another program's header of that name: as if there were none
        return None
    if not isinstance(told, dict) or not isinstance(told.get("scope"), str) or not told["scope"]:
        return None
    children = told.get("children")
    counted = {
        name: count
        for name, count in (children.items() if isinstance(children, dict) else ())
        if isinstance(name, str) and isinstance(count, int)
    }
    return _Told(told["scope"], counted, told.get("unsure") is True)


def _drawn(workflow_id: str, parent_run_id: str) -> bool:
    """Whether a child's id was drawn in its parent's run: a bare UUID (the SDK's own draw when
    no id is given), or an id that holds the parent's run id."""
    return _UUID.fullmatch(workflow_id) is not None or parent_run_id in workflow_id


class TwiceshyInterceptor(temporalio.client.Interceptor, temporalio.worker.Interceptor):
    """Scopes every activity by its workflow, child workflows by what stays across their
    parent's retries.

    Install it on every worker that runs your workflows or your protected activities::

        Worker(client, task_queue=..., workflows=[...], activities=[...],
               interceptors=[TwiceshyInterceptor()])

    or once on the client, which passes it to every worker made with it::

        client = await Client.connect(address, interceptors=[TwiceshyInterceptor()])

    In workflow code it is deterministic: it reads the run's start header and counts the
    children the workflow starts, and asks nothing else. It adds the header ``twiceshy-scope``
    to each activity, local activity and child workflow the workflow starts, and to its next run
    (continue-as-new); in an activity, it hands the header's scope to the protected tool.
    """

    def intercept_activity(
        self, next: temporalio.worker.ActivityInboundInterceptor
    ) -> temporalio.worker.ActivityInboundInterceptor:
        """Hand each activity the scope its workflow sent."""
        return _ActivityInbound(next)

    def workflow_interceptor_class(
        self, input: temporalio.worker.WorkflowInterceptorClassInput
    ) -> type[temporalio.worker.WorkflowInboundInterceptor]:
        """Tell each activity, child and next run the workflow starts its scope."""
        return _WorkflowInbound


class _WorkflowInbound(temporalio.worker.WorkflowInboundInterceptor):
    """One per workflow run: gives it an outbound interceptor of its own."""

    def init(self, outbound: temporalio.worker.WorkflowOutboundInterceptor) -> None:
        super().init(_WorkflowOutbound(outbound))


class _WorkflowOutbound(temporalio.worker.WorkflowOutboundInterceptor):
    """Adds the run's scope to what the workflow starts, and numbers its children by type.

    Everything here is workflow code: it reads only the run's info, so a replay, and a retried
    run of the parent, tells its children the same scopes.
    """

    def __init__(self, next: temporalio.worker.WorkflowOutboundInterceptor) -> None:
        super().__init__(next)
        self._told: _Told | None = None
        self._children: dict[str, int] = {}

    def _run(self) -> _Told:
        """This run's scope, read from its start header on first use (a signal handler may
        start an activity before the workflow's run method has begun)."""
        if self._told is None:
            info = workflow.info()
            told = _read(info.headers)
            if told is None:
                unsure = info.parent is not None and _drawn(info.workflow_id, info.parent.run_id)
                told = _Told(info.workflow_id, unsure=unsure)
            self._told = told
            self._children = dict(told.children)
        return self._told

    def start_activity(
        self, input: temporalio.worker.StartActivityInput
    ) -> workflow.ActivityHandle[Any]:
        input.headers = {**input.headers, HEADER: self._run().payload()}
        return super().start_activity(input)

    def start_local_activity(
        self, input: temporalio.worker.StartLocalActivityInput
    ) -> workflow.ActivityHandle[Any]:
        input.headers = {**input.headers, HEADER: self._run().payload()}
        return super().start_local_activity(input)

    async def start_child_workflow(
        self, input: temporalio.worker.StartChildWorkflowInput
    ) -> workflow.ChildWorkflowHandle[Any, Any]:
        told = self._run()
        number = self._children.get(input.workflow, 0)
        self._children[input.workflow] = number + 1
        if _drawn(input.id, workflow.info().run_id):
            child = _Told(f"{told.scope}/{input.workflow}#{number}", unsure=told.unsure)
        else:  # an id of the user's own names the child, as it always did
            child = _Told(input.id)
        input.headers = {**input.headers, HEADER: child.payload()}
        return await super().start_child_workflow(input)

    def continue_as_new(self, input: temporalio.worker.ContinueAsNewInput) -> NoReturn:
        # The next run goes on numbering the children where this one stopped: a child it
        # starts is not taken for one of this run's.
        told = self._run()
        input.headers = {**input.headers, HEADER: told.payload(self._children)}
        super().continue_as_new(input)


# The scope the running activity's workflow sent, set by the interceptor for the activity's
# duration (a thread-pool activity gets a copy of the context); _UNTOLD where it sent none.
_UNTOLD: Final = _Told("")
_told: ContextVar[_Told | None] = ContextVar("twiceshy_temporal_told", default=None)


class _ActivityInbound(temporalio.worker.ActivityInboundInterceptor):
    """Hands the activity the scope its workflow sent."""

    async def execute_activity(self, input: temporalio.worker.ExecuteActivityInput) -> Any:
        token = _told.set(_read(input.headers) or _UNTOLD)
        try:
            return await super().execute_activity(input)
        finally:
            _told.reset(token)


def workflow_scope() -> str | None:
    """The scope of the workflow whose activity the caller runs in, or ``None`` outside any
    activity (or in an activity started by itself, outside a workflow).

    That is the scope :class:`TwiceshyInterceptor` sent with the activity: the workflow id, or
    for a child workflow started without an id of its own, its parent's scope, its type and its
    number among its parent's children of that type. Without the interceptor, the workflow id
    (and a warning, logged once per process).
    """
    if not temporal_activity.in_activity():
        return None
    info = temporal_activity.info()
    workflow_id = info.workflow_id
    if not workflow_id:
        return None
    told = _told.get()
    if told is None or told is _UNTOLD:
        _warn_once(
            "untold",
            "twiceshy: the activity %r of workflow %r came without twiceshy's scope: install "
            "twiceshy.integrations.temporal.TwiceshyInterceptor on the workers that run the "
            "workflow and the activity (Worker(..., interceptors=[TwiceshyInterceptor()]), or "
            "on the client). Without it, an activity is scoped by its workflow id, which a "
            "child workflow started without an id of its own draws anew when its parent is "
            "retried: its tools would then run again under new keys",
            info.activity_type,
            workflow_id,
        )
        return workflow_id
    if told.unsure:
        _warn_once(
            "unsure",
            "twiceshy: the activity %r runs in the child workflow %r, whose id looks drawn at "
            "random (a child started without an id of its own) and whose parent sent no "
            "twiceshy scope: its scope is that id, which a retry of the parent draws anew, so "
            "its tools would run again under new keys. Install TwiceshyInterceptor on the "
            "worker that runs the parent, or start the child with an id of your own",
            info.activity_type,
            workflow_id,
        )
    return told.scope


# The warnings logged in this process, by kind: every activity of a worker set up without the
# interceptor would say the same.
_warned: set[str] = set()


def _warn_once(kind: str, message: str, *args: object) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(message, *args)


def non_retryable(error: BaseException) -> ApplicationError | None:
    """The ``ApplicationError(non_retryable=True)`` that stands for one of twiceshy's final
    answers (every ``TwiceshyError`` but ``NotApplied`` and ``StoreUnavailable``), or ``None``
    for any other error.

    For an activity of your own around a twiceshy tool: ``raise non_retryable(exc) from exc``.
    """
    if not is_final(error):
        return None
    named = {name: getattr(error, name) for name in ("tool", "key") if getattr(error, name, "")}
    details = (named,) if named else ()
    return ApplicationError(str(error), *details, type=type(error).__name__, non_retryable=True)


def protect(
    ledger: Ledger, *, effect: Effect, **options: Any
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Protect a tool with ``ledger``, scoped by the workflow, for use inside an activity.

    Use it where something else makes the activity: an ``@activity.defn`` of your own, or
    Pydantic AI's ``TemporalDurability``, which runs each tool call in an activity.
    :func:`activity` is both in one.

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
        return _in_workflow_scope(ledger.tool(effect=effect, **options)(function))

    return decorate


def activity(
    ledger: Ledger, *, effect: Effect, name: str | None = None, **options: Any
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Protect a tool with ``ledger`` inside a Temporal activity of its own (``activity.defn``).

    Args:
        ledger: where intents are claimed and outcomes kept.
        effect: the tool's effect class (``twiceshy.SAFE``, ``KEYED``, ``UNSAFE``).
        name: the activity's name in Temporal and the tool's name in keys (default: the
            function's ``__name__``).
        **options: the options of :meth:`twiceshy.Ledger.tool` (``attempts=``, ``lease=``,
            ``key_args=``, ``reconcile=``, ``key_window=``...). ``wait=`` is ``lease=`` plus 5
            seconds unless given: a retry waits out a dead worker's lease.

    Returns:
        A decorator that makes a ``def`` or ``async def`` tool an activity (a ``def`` one needs
        the worker's ``activity_executor``).

    Raises:
        TypeError: ``ledger`` is not a :class:`twiceshy.Ledger`; or a twiceshy option is wrong.
        ValueError: a twiceshy option is out of range.
        ResultNotStorable: a KEYED or UNSAFE tool's return annotation has no JSON form.
    """
    if name is not None:
        options["name"] = name
    protecting = protect(ledger, effect=effect, **options)

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        return temporal_activity.defn(name=name)(protecting(function))

    return decorate


def _refuse_workflow_code(name: str) -> None:
    """Raise :class:`InWorkflowCode` when called from a workflow's own code."""
    if workflow.in_workflow():
        raise InWorkflowCode(
            f"the protected tool {name!r} was called in Temporal workflow code: the ledger is "
            "asked only inside activities (a replay would ask it again). Make the tool an "
            "activity (twiceshy.integrations.temporal.activity) and run that from the "
            "workflow (workflow.execute_activity, or activity_as_tool for an agent); it did "
            "not run"
        )


def _ending(error: TwiceshyError) -> ApplicationError | None:
    """The non-retryable application error that ends the activity with one of twiceshy's final
    answers, the answer as its cause (an ``InProgress`` saying that Temporal does not retry the
    activity); ``None`` for the rest."""
    if isinstance(error, InProgress):
        error = in_engine(error, ends="Temporal does not retry this activity")
    final = non_retryable(error)
    if final is not None:
        final.__cause__ = error
    return final


def _in_workflow_scope(protected: Callable[P, R]) -> Callable[P, R]:
    """``protected``, refused in workflow code; inside an activity, called in the workflow's
    scope, its final answers raised as non-retryable application errors; elsewhere, as it is."""
    name = getattr(protected, "__name__", "tool")
    if inspect.iscoroutinefunction(protected):

        @functools.wraps(protected)
        async def scoped_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            _refuse_workflow_code(name)
            if not temporal_activity.in_activity():
                return await protected(*args, **kwargs)
            scope = workflow_scope()
            try:
                if scope is None:  # an activity started by itself, outside a workflow
                    return await protected(*args, **kwargs)
                with run(scope):
                    return await protected(*args, **kwargs)
            except TwiceshyError as exc:
                final = _ending(exc)
                if final is None:
                    raise
                raise final from final.__cause__

        return cast(Callable[P, R], scoped_async)

    @functools.wraps(protected)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        _refuse_workflow_code(name)
        if not temporal_activity.in_activity():
            return protected(*args, **kwargs)
        scope = workflow_scope()
        try:
            if scope is None:  # an activity started by itself, outside a workflow
                return protected(*args, **kwargs)
            with run(scope):
                return protected(*args, **kwargs)
        except TwiceshyError as exc:
            final = _ending(exc)
            if final is None:
                raise
            raise final from final.__cause__

    return scoped
