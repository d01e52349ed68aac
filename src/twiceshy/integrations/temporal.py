"""Temporal: a tool protected inside an activity, the workflow id as its scope.

Temporal retries an activity that failed or timed out, without limit by default: an activity
whose worker died is run again once its timeout passes, and one that raised after its effect (a
lost answer) is run again at once. One line puts twiceshy inside the activity, where every one
of those runs meets the ledger::

    from twiceshy import KEYED
    from twiceshy.integrations.temporal import activity

    @activity(ledger, effect=KEYED)
    async def create_charge(amount: int, customer: str) -> str:
        return stripe.PaymentIntent.create(..., idempotency_key=twiceshy.current_key()).id

What it does:

- Inside the activity, never in the workflow. The ledger is asked in the activity, so a
  workflow's deterministic replay, which takes completed activities from the workflow's history
  without running them, never asks it; a protected tool called in workflow code raises
  :class:`InWorkflowCode` before anything runs. With OpenAI Agents' Temporal integration, hand
  the protected activity to ``activity_as_tool(...)`` (its ``on_invoke_tool`` runs in workflow
  code, so no tool wrapper may stand there). A Pydantic AI agent made durable with
  ``TemporalDurability`` runs each tool call in an activity: protect its tool function with
  :func:`protect` (not ``TwiceshyCapability``, whose hook runs in the workflow).
- The scope is the workflow id (``activity.info().workflow_id``), which Temporal keeps for every
  attempt of an activity, and across the workflow's runs (a retried or continued-as-new
  workflow): every attempt names one intent. It wins over a ``twiceshy.run(...)`` around the
  worker. Two calls with the same arguments in one workflow are one intent; a deliberate repeat
  (a turn of a conversation) must differ in an argument, such as a turn id. Outside any activity,
  the tool is scoped as any protected tool.
- twiceshy's final answers end Temporal's retries: every :class:`twiceshy.TwiceshyError` but
  ``NotApplied`` and ``StoreUnavailable`` (nothing ran) leaves the activity as an
  ``ApplicationError(non_retryable=True)`` whose ``type`` is the error's name (``"OutcomeUnknown"``,
  ``"InProgress"``, ``"KeyReuseMismatch"``...), its message the error's text for the model, and
  its details ``{"tool": ..., "key": ...}`` where the error names them; the twiceshy error is its
  ``__cause__`` in the worker. The workflow then gets an ``ActivityError`` caused by it at once,
  instead of the activity retrying forever. The tool's own errors are retried as the activity's
  retry policy says.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from temporalio import activity as temporal_activity
from temporalio import workflow
from temporalio.exceptions import ApplicationError

from twiceshy import Effect, Ledger, TwiceshyError, run

from ._durable import is_final

__all__ = ["InWorkflowCode", "activity", "non_retryable", "protect", "workflow_scope"]

P = ParamSpec("P")
R = TypeVar("R")


class InWorkflowCode(TwiceshyError, RuntimeError):
    """A protected tool was called in Temporal workflow code; nothing ran, and the ledger was not
    asked.

    Workflow code must be deterministic: the ledger's answers are not, and a replay would ask it
    again. Call the tool in an activity (:func:`activity`), and from the workflow, run that
    activity. Raised as a plain error, it fails the workflow task, which Temporal retries until
    a worker with the fixed code takes it.
    """


def workflow_scope() -> str | None:
    """The id of the workflow whose activity the caller runs in, or ``None`` outside any
    activity (or in an activity started by itself, outside a workflow)."""
    if not temporal_activity.in_activity():
        return None
    workflow_id = temporal_activity.info().workflow_id
    return workflow_id or None


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
            ``key_args=``, ``reconcile=``, ``key_window=``...).

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
                final = non_retryable(exc)
                if final is None:
                    raise
                raise final from exc

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
            final = non_retryable(exc)
            if final is None:
                raise
            raise final from exc

    return scoped
