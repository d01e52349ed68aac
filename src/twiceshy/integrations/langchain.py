"""LangChain 1.x agents and LangGraph's ``ToolNode``: every tool call through a twiceshy ledger.

One line protects an agent's tools; list it *after* ``ToolRetryMiddleware`` (the first listed
middleware is the outermost), so that every retry of a call meets the ledger::

    protect = TwiceshyMiddleware(ledger, {"create_charge": KEYED, "wire": UNSAFE}, default=SAFE)

    agent = create_agent(
        model,
        tools=[create_charge, wire, lookup],
        middleware=[ToolRetryMiddleware(), protect],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "order-1234"}})

A plain LangGraph ``ToolNode`` takes the same middleware's two hooks::

    ToolNode(tools, wrap_tool_call=mw.wrap_tool_call, awrap_tool_call=mw.awrap_tool_call)

What it does with a tool call:

- The intent is (scope, tool name, arguments): the arguments exactly as the model sent them
  (``tool_call["args"]``, with the schema's defaults filled in for omitted parameters), never the
  tool-call id, which changes every time the model calls again. What LangGraph injects
  (``ToolRuntime``, ``InjectedState``, ``InjectedStore``, ``InjectedToolCallId``) is added after
  this middleware and is no part of it; a value the model sends for such a parameter is left out
  of the intent, as ``ToolNode`` drops it.
- The scope is the LangGraph thread id (``config["configurable"]["thread_id"]``, else the
  runtime's ``execution_info.thread_id``), else an enclosing ``twiceshy.run(...)``; ``scope=``
  replaces that with a function of the request. A recorded tool called without any scope raises
  :class:`ScopeNotFound`, which passes through ``ToolRetryMiddleware``, ``ToolNode``'s error
  handling and LangGraph's ``RetryPolicy`` (it is one of LangGraph's "bubble-up" signals) and
  ends the run: a missing scope is a programming error, not something to retry or to tell the
  model.
- ``OutcomeUnknown`` and ``InProgress`` come back as ``ToolMessage(status="error")`` carrying
  twiceshy's message for the model (it may have happened, it will not be run again, tell the
  user). They are not raised, so no retry layer outside runs the call again.
- What the model saw the first time is recorded (the ``ToolMessage``'s content and status, and
  its ``artifact`` when that has a JSON form) and a retry gets it again as a ``ToolMessage``
  answering the *new* tool-call id. A tool that returns a ``Command`` has that ``Command``
  applied on its first run; a retry gets the content of the ``ToolMessage`` inside it (the
  state update is not applied twice).
- An ``interrupt()`` inside a tool releases the intent: LangGraph runs the tool again from its
  start when the run resumes, and that run is the intent's. Another LangGraph signal raised
  inside a tool (a sub-agent handing off with a ``Command`` for the parent graph) is the tool's
  finished answer: recorded as done and passed on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from langchain.agents.middleware import AgentMiddleware, AgentState, ToolCallRequest
from langchain_core.messages import ToolMessage
from langgraph.errors import GraphBubbleUp, GraphInterrupt
from langgraph.types import Command
from pydantic import BaseModel

from .. import (
    Effect,
    Guard,
    InProgress,
    KeyReuseMismatch,
    Ledger,
    MissingScope,
    NotApplied,
    OutcomeUnknown,
    TwiceshyError,
    UnkeyableArgument,
    current_scope,
)

__all__ = [
    "EffectNotDeclared",
    "ScopeFunction",
    "ScopeNotFound",
    "TwiceshyMiddleware",
    "thread_scope",
]

ScopeFunction = Callable[[ToolCallRequest], "str | None"]
"""``scope(request)``: the run's scope for one tool call, or ``None`` when it has none."""

_Result = ToolMessage | Command[Any]
_Status = Literal["success", "error"]

# Errors that mean "nothing ran, and running again cannot help": the model reads them and may
# change its call. They are answered, not raised, so no retry layer repeats a refused call.
_ANSWERED = (OutcomeUnknown, InProgress, KeyReuseMismatch, UnkeyableArgument)


class ScopeNotFound(MissingScope, GraphBubbleUp):
    """A recorded tool was called in a run with no thread id and no other scope; nothing ran.

    A :class:`twiceshy.MissingScope`, and one of LangGraph's bubble-up signals, so that no tool
    error handler or retry layer turns it into a message for the model: it ends the run.
    """


class EffectNotDeclared(TwiceshyError, LookupError, GraphBubbleUp):
    """A tool without a declared effect class was called, and no ``default=`` was given.

    Like :class:`ScopeNotFound` it ends the run instead of reaching the model: there is no
    silent default effect.
    """


class _Interrupted(NotApplied):
    """Carries a LangGraph interrupt through the ledger: the tool stopped to wait for input."""

    def __init__(self, interrupt: GraphInterrupt) -> None:
        super().__init__("the tool was interrupted; LangGraph runs it again on resume")
        self.interrupt = interrupt


def thread_scope(request: ToolCallRequest) -> str | None:
    """The LangGraph thread id of the run a tool call belongs to, or ``None``.

    Read from the run config (``config["configurable"]["thread_id"]``), else from the runtime's
    ``execution_info`` (set when the graph has a checkpointer). A ``str``, ``int`` or ``UUID``
    thread id becomes its text.
    """
    runtime = request.runtime
    if runtime is None:
        return None
    config = runtime.config or {}
    thread: object = (config.get("configurable") or {}).get("thread_id")
    info = getattr(runtime, "execution_info", None)
    if thread is None and info is not None:
        thread = info.thread_id
    if isinstance(thread, bool) or not isinstance(thread, str | int | uuid.UUID):
        return None
    return str(thread) or None


class _Attempt:
    """One call as this middleware handles it: its ids, and its own run's live outcome.

    Per call, never shared. The ledger records what a retry should see (a JSON mapping); the
    call that ran the tool returns the live ``ToolMessage`` or ``Command`` instead, or re-raises
    the LangGraph signal the tool raised.
    """

    __slots__ = ("call_id", "record", "result", "signal", "tool")

    def __init__(self, request: ToolCallRequest) -> None:
        self.call_id: str = request.tool_call.get("id") or ""
        self.tool: str = request.tool_call["name"]
        self.result: _Result | None = None
        self.signal: GraphBubbleUp | None = None
        self.record: dict[str, Any] | None = None

    def ran(self, result: _Result) -> dict[str, Any]:
        """The tool answered: keep its result, and what a retry should see of it."""
        self.result = result
        self.record = _record_of(_answering_message(result, self.call_id), self.tool)
        return self.record

    def signalled(self, signal: GraphBubbleUp) -> dict[str, Any]:
        """The tool raised a LangGraph control signal: an interrupt, or a hand-off.

        An interrupt releases the intent (LangGraph runs the tool again from its start on
        resume); any other signal (a ``Command`` for a parent graph) is the tool's finished
        answer: recorded as done, then re-raised live.
        """
        if isinstance(signal, GraphInterrupt):
            raise _Interrupted(signal) from signal
        self.signal = signal
        self.record = _record_of(None, self.tool)
        return self.record

    def answer(self, value: object) -> _Result:
        """This call's own live outcome, or the recorded answer rebuilt for this tool-call id."""
        if value is self.record and self.record is not None:
            if self.signal is not None:
                raise self.signal
            if self.result is not None:
                return self.result
        artifact: object = None
        if isinstance(value, Mapping) and "content" in value:
            content = value["content"]
            status: _Status = "error" if value.get("status") == "error" else "success"
            artifact = value.get("artifact")
        else:  # recorded by something other than this adapter under the same key
            content = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            status = "success"
        return ToolMessage(
            content=content,
            tool_call_id=self.call_id,
            name=self.tool,
            status=status,
            artifact=artifact,
        )

    def refused(self, exc: Exception) -> ToolMessage:
        """twiceshy's message for the model, as the framework's own failed tool answer."""
        return ToolMessage(
            content=str(exc), tool_call_id=self.call_id, name=self.tool, status="error"
        )


class TwiceshyMiddleware(AgentMiddleware[AgentState[Any], Any, Any]):
    """Sends every tool call of an agent (or a ``ToolNode``) through a twiceshy ledger.

    List it after ``ToolRetryMiddleware`` and ``ToolErrorMiddleware`` (first listed is
    outermost): their retries then meet the ledger, and a tool's exception reaches twiceshy
    before anything turns it into text. For the same reason, give a plain ``ToolNode`` no
    ``handle_tool_errors=True``: it turns the exception into an error ``ToolMessage`` inside
    this middleware's handler, which is then recorded as the tool's answer (replayed, never
    retried in place, without twiceshy's honest message).

    Args:
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options (attempts,
            ``definite=``, ``key_args=``, ``reconcile=``...); a guard keeps its own ledger.
        default: the effect class of tools not named in ``effects``. Without it, calling such a
            tool raises :class:`EffectNotDeclared`.
        scope: ``scope(request)`` gives the run's scope instead of the thread id
            (:func:`thread_scope`); ``None`` from it means the call has no scope.

    Raises:
        TypeError: an effect is not an effect class or a guard.
        ValueError: nothing is declared, a tool name is not usable in keys, or a guard is named
            after another tool.
    """

    def __init__(
        self,
        ledger: Ledger,
        effects: Mapping[str, Effect | Guard] | None = None,
        *,
        default: Effect | None = None,
        scope: ScopeFunction | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(ledger, Ledger):
            raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
        if default is not None and not isinstance(default, Effect):
            raise TypeError("default= must be twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE")
        if not effects and default is None:
            raise ValueError(
                "declare the effect class of the tools (effects={'tool': twiceshy.KEYED, ...}) "
                "and/or a default= for the others: there is no silent default"
            )
        guards: dict[str, Guard] = {}
        for name, effect in (effects or {}).items():
            if isinstance(effect, Guard):
                if effect.name != name:
                    raise ValueError(f"the guard for the tool {name!r} is named {effect.name!r}")
                guards[name] = effect
            elif isinstance(effect, Effect):
                guards[name] = ledger.guard(name, effect=effect)
            else:
                raise TypeError(
                    f"the effect of the tool {name!r} must be twiceshy.SAFE, KEYED, UNSAFE or a "
                    f"twiceshy.Guard, not {effect!r}"
                )
        self.tools = []
        self._ledger = ledger
        self._guards = guards
        self._default = default
        self._scope = scope

    def __repr__(self) -> str:
        default = self._default.name if self._default is not None else None
        return f"TwiceshyMiddleware({self._ledger!r}, tools={sorted(self._guards)}, {default=})"

    def wrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        """Run the call through the ledger: once per intent; a retry gets the first answer.

        Args:
            request: the tool call (``tool_call`` with ``name``, ``args``, ``id``), its tool
                and runtime.
            handler: runs the tool (the inner middleware, then ``ToolNode``).

        Returns:
            The first run's ``ToolMessage`` or ``Command``, its recorded answer replayed for the
            current tool-call id, or an error ``ToolMessage`` with twiceshy's honest message.

        Raises:
            ScopeNotFound, EffectNotDeclared: before anything runs; they end the run.
        """
        guard = self._guard_for(request)
        if guard is None:
            return handler(request)
        arguments, scope = self._intent(request, guard)
        attempt = _Attempt(request)

        def work() -> dict[str, Any]:
            try:
                return attempt.ran(handler(request))
            except GraphBubbleUp as signal:
                return attempt.signalled(signal)

        try:
            return attempt.answer(guard.call(arguments, work, scope=scope))
        except _ANSWERED as exc:
            return attempt.refused(exc)
        except _Interrupted as exc:
            raise exc.interrupt from None

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        """:meth:`wrap_tool_call` for agents and graphs run with ``ainvoke`` / ``astream``."""
        guard = self._guard_for(request)
        if guard is None:
            return await handler(request)
        arguments, scope = self._intent(request, guard)
        attempt = _Attempt(request)

        async def work() -> dict[str, Any]:
            try:
                return attempt.ran(await handler(request))
            except GraphBubbleUp as signal:
                return attempt.signalled(signal)

        try:
            return attempt.answer(await guard.acall(arguments, work, scope=scope))
        except _ANSWERED as exc:
            return attempt.refused(exc)
        except _Interrupted as exc:
            raise exc.interrupt from None

    # -- shared, no I/O --------------------------------------------------------------------

    def _guard_for(self, request: ToolCallRequest) -> Guard | None:
        """The guard of the called tool; ``None`` for a name that is neither declared nor a tool.

        A name the model made up reaches ``ToolNode`` unprotected, which answers it with its
        own "not a valid tool" message: nothing runs.
        """
        name = request.tool_call["name"]
        guard = self._guards.get(name)
        if guard is not None:
            return guard
        if self._default is not None:
            return self._ledger.guard(name, effect=self._default)
        if request.tool is None:
            return None
        raise EffectNotDeclared(
            f"the tool {name!r} has no declared effect class: add it to TwiceshyMiddleware's "
            f"effects ({{{name!r}: twiceshy.SAFE | KEYED | UNSAFE}}) or give default="
        )

    def _intent(self, request: ToolCallRequest, guard: Guard) -> tuple[dict[str, Any], str | None]:
        """The call's arguments as the model sent them (defaults filled in) and its scope."""
        arguments = _with_defaults(request)
        if self._scope is not None:
            scope = self._scope(request)
            where = "the scope= function returned no scope"
        else:
            scope = thread_scope(request) or current_scope()
            where = (
                "the run has no thread id: invoke it with "
                "config={'configurable': {'thread_id': ...}}, or give TwiceshyMiddleware a "
                "scope= function"
            )
        if guard.recorded and not (isinstance(scope, str) and scope):
            raise ScopeNotFound(
                f"the tool {guard.name!r} cannot be protected: {where}; it did not run"
            )
        return arguments, scope or None


def _with_defaults(request: ToolCallRequest) -> dict[str, Any]:
    """``tool_call["args"]`` with the tool schema's plain defaults for omitted parameters.

    A model may leave out an optional parameter once and send its default the next time: one
    intent (DESIGN.md §2). Defaults made by a factory are left out: they may differ every call.
    A value the model sent for an injected parameter (``InjectedState``, ``InjectedToolCallId``,
    ``ToolRuntime``...) is left out too: ``ToolNode`` replaces it, so it names nothing.
    """
    arguments = dict(request.tool_call.get("args") or {})
    tool = request.tool
    if tool is None:
        return arguments
    schema = tool.tool_call_schema
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        return arguments
    # The parameters of the full input schema that the model's schema hides are the injected ones.
    full = tool.get_input_schema()
    hidden = set(full.model_fields) if issubclass(full, BaseModel) else set()
    hidden -= set(schema.model_fields)
    for name in hidden:
        arguments.pop(name, None)
    for name, field in schema.model_fields.items():
        sent_as = field.alias or name
        if sent_as not in arguments and not field.is_required() and field.default_factory is None:
            arguments[sent_as] = field.default
    return arguments


def _record_of(message: ToolMessage | None, tool: str) -> dict[str, Any]:
    """What a retry should see: the answering message's content, status and artifact, or a note.

    An artifact with no JSON form (a document object, say) is left out rather than making the
    whole outcome unstorable: the model never reads it, only the application does.
    """
    if message is not None:
        record: dict[str, Any] = {"content": message.content, "status": message.status}
        if message.artifact is not None:
            try:
                json.dumps(message.artifact, allow_nan=False)
            except (TypeError, ValueError):
                pass
            else:
                record["artifact"] = message.artifact
        return record
    return {
        "content": (
            f"The tool {tool!r} already ran for these arguments and updated the graph's state; "
            "that update is not repeated and the tool was not run again."
        ),
        "status": "success",
    }


def _answering_message(result: object, call_id: str) -> ToolMessage | None:
    """The ``ToolMessage`` answering ``call_id`` in a tool's result (a message or a Command)."""
    if isinstance(result, ToolMessage):
        return result
    if isinstance(result, Command):
        update: object = result.update
        items = update.values() if isinstance(update, Mapping) else [update]
        return _answering_message(list(items), call_id)
    if isinstance(result, list | tuple):
        for item in result:
            if isinstance(item, list | tuple | Command):
                found = _answering_message(item, call_id)
            else:
                found = item if isinstance(item, ToolMessage) else None
            if found is not None and found.tool_call_id == call_id:
                return found
    return None
