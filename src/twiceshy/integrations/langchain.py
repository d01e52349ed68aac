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

- The intent is (scope, tool name, arguments): the arguments the tool's function receives, by
  parameter name, after LangChain's own parsing and validation (``"2"`` coerced to ``2``, an
  omitted optional argument and its default sent, an ``IntEnum`` sent as text, a nested model
  with coercible fields: one intent each), never the tool-call id, which changes every time the
  model calls again. What LangGraph injects (``ToolRuntime``, ``InjectedState``,
  ``InjectedStore``, ``InjectedToolCallId``, callbacks, the run config) is no part of it; a
  value the model sends for such a parameter is left out, as ``ToolNode`` drops it. A tool with
  a JSON-schema ``args_schema`` (no Python signature) is keyed by ``tool_call["args"]`` with
  the schema's defaults.
- A call the tool refuses before its function runs never meets the ledger: arguments its
  schema refuses (a required one left out, a value of the wrong type) are handed on to the tool,
  which refuses them as without twiceshy (``ToolNode`` tells the model "Error invoking tool
  ..."); arguments its schema accepts but its function does not take raise the ``TypeError``
  Python raises for them, and LangChain handles it as its own. Nothing is claimed and nothing
  runs, so the next well-formed call runs.
- A recorded tool (KEYED, UNSAFE, or SAFE with ``record=True``) whose function is a generator
  is refused with :class:`GeneratorTool` when it is first called: LangChain would show the model
  the generator object, its body never run, and the ledger would record that as done.
- The scope: inside a protected call (a sub-agent or subgraph run by a tool), the scope that
  call's nested runs inherit (:func:`twiceshy.inherited_scope`, or a ``twiceshy.run`` entered in
  the tool); else the LangGraph thread id (``config["configurable"]["thread_id"]``, else the
  runtime's ``execution_info.thread_id``), else an enclosing ``twiceshy.run(...)``. ``scope=``
  replaces all of that with a function of the request. A recorded tool called without any scope
  raises :class:`ScopeNotFound`, which passes through ``ToolRetryMiddleware``, ``ToolNode``'s
  error handling and LangGraph's ``RetryPolicy`` (it is one of LangGraph's "bubble-up" signals)
  and ends the run: a missing scope is a programming error, not something to retry or to tell
  the model.
- twiceshy's own answers come back as an error ``ToolMessage`` carrying its text for the model:
  ``OutcomeUnknown`` and ``InProgress`` (it may have happened, it is not run again, tell the
  user), a refused key, and a KEYED tool whose attempts ran out (it may have taken effect; an
  identical call later is safe, the provider deduplicates by the same key). They are returned,
  not raised, so no retry layer outside runs the call again or words it "Please try again".
- What the model saw the first time is recorded (the ``ToolMessage``'s content and status, and
  its ``artifact`` when that has a JSON form) and a retry gets it again as a ``ToolMessage``
  answering the *new* tool-call id. The first call reads the content as it was stored too, so
  the model reads the same on every call. A tool that returns a ``Command`` has that
  ``Command`` applied on its first run; a retry gets the content of the ``ToolMessage`` inside
  it (the state update is not applied twice).
- A tool whose function calls :func:`twiceshy.point_of_no_return` and is declared by its class
  alone is guarded with ``effect_at="mark"``: an exception before the mark releases the intent
  and is raised as the tool raised it, so the next call runs it.
- An ``interrupt()`` inside a tool releases the intent: LangGraph runs the tool again from its
  start when the run resumes, and that run is the intent's. Another LangGraph signal raised
  inside a tool (a sub-agent handing off with a ``Command`` for the parent graph) is the tool's
  finished answer: recorded as done and passed on.
"""

from __future__ import annotations

import functools
import inspect
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.v1 import ValidationError as ValidationErrorV1

try:
    from langchain.agents.middleware import AgentMiddleware, AgentState, ToolCallRequest
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import BaseTool, StructuredTool, Tool
    from langchain_core.tools.base import FILTERED_ARGS, _get_runnable_config_param
    from langgraph.errors import GraphBubbleUp, GraphInterrupt
    from langgraph.prebuilt import ToolNode
    from langgraph.prebuilt.tool_node import _get_all_injected_args
    from langgraph.types import Command
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.langchain needs LangChain 1.x and LangGraph 1.x: "
        f"pip install 'twiceshy[langchain]' ({exc})"
    ) from exc

from .. import (
    Effect,
    Guard,
    Ledger,
    MissingScope,
    NotApplied,
    ResultNotStorable,
    TwiceshyError,
    UnkeyableArgument,
    UnkeyableType,
    canonical_json,
    current_scope,
    errors,
    inherited_scope,
)
from ._calls import (
    ArgumentsDoNotFit,
    effect_at_of,
    factory_fields,
    for_the_model,
    received,
    refuse_generator,
    with_schema_defaults,
)
from ._core import current_call

__all__ = [
    "EffectNotDeclared",
    "GeneratorTool",
    "ScopeFunction",
    "ScopeNotFound",
    "TwiceshyMiddleware",
    "thread_scope",
]

ScopeFunction = Callable[[ToolCallRequest], "str | None"]
"""``scope(request)``: the run's scope for one tool call, or ``None`` when it has none."""

_Result = ToolMessage | Command[Any]
_Status = Literal["success", "error"]
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class ScopeNotFound(MissingScope, GraphBubbleUp):
    """A recorded tool was called in a run with no thread id and no other scope; nothing ran.

    A :class:`twiceshy.MissingScope`, and one of LangGraph's bubble-up signals, so that no tool
    error handler or retry layer turns it into a message for the model: it ends the run.
    """


class EffectNotDeclared(errors.EffectNotDeclared, GraphBubbleUp):
    """A tool without a declared effect class was called, and no ``default=`` was given:
    :class:`twiceshy.EffectNotDeclared` as a LangGraph bubble-up signal.

    Like :class:`ScopeNotFound` it ends the run instead of reaching the model: there is no
    silent default effect.
    """


class GeneratorTool(TwiceshyError, TypeError, GraphBubbleUp):
    """A recorded tool's function is a generator: refused when the tool is first called, before
    anything runs. Like :class:`ScopeNotFound` it ends the run: the tool must return its results
    (a list), or collect them inside itself.
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


@dataclass(frozen=True, slots=True)
class _Intent:
    """One call's guard, and the arguments and scope its key is derived from."""

    guard: Guard
    arguments: dict[str, Any]
    scope: str | None


class _Attempt:
    """One call as this middleware handles it: its ids, and its own run's live outcome.

    Per call, never shared. The ledger records what a retry should see (a JSON mapping, marked
    with this call's ``run`` token); the call that ran the tool returns its live ``ToolMessage``
    (with the content as the ledger kept it) or ``Command``, or re-raises the LangGraph signal
    the tool raised.
    """

    __slots__ = ("call_id", "result", "run", "signal", "tool")

    def __init__(self, request: ToolCallRequest) -> None:
        self.call_id: str = request.tool_call.get("id") or ""
        self.tool: str = request.tool_call["name"]
        self.run = uuid.uuid4().hex
        self.result: _Result | None = None
        self.signal: GraphBubbleUp | None = None

    def ran(self, result: _Result) -> dict[str, Any]:
        """The tool answered: keep its result, and what a retry should see of it."""
        self.result = result
        return _record_of(_answering_message(result, self.call_id), self.tool, self.run)

    def signalled(self, signal: GraphBubbleUp) -> dict[str, Any]:
        """The tool raised a LangGraph control signal: an interrupt, or a hand-off.

        An interrupt releases the intent (LangGraph runs the tool again from its start on
        resume); any other signal (a ``Command`` for a parent graph) is the tool's finished
        answer: recorded as done, then re-raised live.
        """
        if isinstance(signal, GraphInterrupt):
            raise _Interrupted(signal) from signal
        self.signal = signal
        return _record_of(None, self.tool, self.run)

    def answer(self, value: object) -> _Result:
        """This call's own live outcome, or the recorded answer rebuilt for this tool-call id.

        The guard hands the call that ran the tool its record as stored, which every replay
        reads too: the live ``ToolMessage`` is returned with that content (a content block's
        bytes as base64 text, a tuple as a list), so the model reads the same on every call.
        """
        if isinstance(value, Mapping) and value.get("run") == self.run:  # this call's own run
            if self.signal is not None:
                raise self.signal
            if isinstance(self.result, ToolMessage) and "content" in value:
                return self.result.model_copy(update={"content": value["content"]})
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

    def told(self, intent: _Intent, error: Exception) -> ToolMessage:
        """twiceshy's text for ``error`` as the tool's answer; the error itself when it has none.

        A result that ran but could not be kept is a success the model cannot read again, not a
        failure: its answer says so with ``status="success"``.
        """
        text = for_the_model(intent.guard, error, intent.arguments, scope=intent.scope)
        if text is None:
            raise error
        status: _Status = "success" if isinstance(error, ResultNotStorable) else "error"
        return ToolMessage(content=text, tool_call_id=self.call_id, name=self.tool, status=status)


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
            ``definite=``, ``key_args=``, ``reconcile=``, ``effect_at=``...); a guard keeps its
            own ledger and options. A tool declared by its class alone whose function calls
            :func:`twiceshy.point_of_no_return` is guarded with ``effect_at="mark"``.
        default: the effect class of tools not named in ``effects``. Without it, calling such a
            tool raises :class:`EffectNotDeclared`.
        scope: ``scope(request)`` gives the run's scope instead of the inherited scope or the
            thread id (:func:`thread_scope`); ``None`` from it means the call has no scope.

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
        classes: dict[str, Effect] = {}
        built: dict[tuple[str, str | None], Guard] = {}
        for name, effect in (effects or {}).items():
            if isinstance(effect, Guard):
                if effect.name != name:
                    raise ValueError(f"the guard for the tool {name!r} is named {effect.name!r}")
                guards[name] = effect.with_stored_answers()
            elif isinstance(effect, Effect):
                # Built now to check the name; rebuilt with effect_at="mark" for tools that mark.
                built[name, None] = ledger.guard(name, effect=effect).with_stored_answers()
                classes[name] = effect
            else:
                raise TypeError(
                    f"the effect of the tool {name!r} must be twiceshy.SAFE, KEYED, UNSAFE or a "
                    f"twiceshy.Guard, not {effect!r}"
                )
        self.tools = []
        self._ledger = ledger
        self._guards = guards
        self._classes = classes
        # Guards built from an effect class, by tool name and where the tool's effect starts;
        # at most two per tool. Filled as tools are first called; a racing fill builds an equal
        # guard, so no lock is needed.
        self._built = built
        self._default = default
        self._scope = scope

    def __repr__(self) -> str:
        default = self._default.name if self._default is not None else None
        names = sorted({*self._guards, *self._classes})
        return f"TwiceshyMiddleware({self._ledger!r}, tools={names}, {default=})"

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
            current tool-call id, or a ``ToolMessage`` with twiceshy's text for the model.

        Raises:
            ScopeNotFound, EffectNotDeclared, GeneratorTool: before anything runs; they end
                the run.
            TypeError: the arguments do not fit the tool's function (raised as its call would
                raise it, before anything runs); LangChain handles it as a tool's error.
        """
        intent = self._intent(request, asynchronous=False)
        if intent is None:
            return handler(request)
        attempt = _Attempt(request)

        def work() -> dict[str, Any]:
            try:
                return attempt.ran(handler(request))
            except GraphBubbleUp as signal:
                return attempt.signalled(signal)

        try:
            return attempt.answer(intent.guard.call(intent.arguments, work, scope=intent.scope))
        except _Interrupted as exc:
            raise exc.interrupt from None
        except Exception as exc:
            return attempt.told(intent, exc)

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        """:meth:`wrap_tool_call` for agents and graphs run with ``ainvoke`` / ``astream``."""
        intent = self._intent(request, asynchronous=True)
        if intent is None:
            return await handler(request)
        attempt = _Attempt(request)

        async def work() -> dict[str, Any]:
            try:
                return attempt.ran(await handler(request))
            except GraphBubbleUp as signal:
                return attempt.signalled(signal)

        try:
            answer = await intent.guard.acall(intent.arguments, work, scope=intent.scope)
        except _Interrupted as exc:
            raise exc.interrupt from None
        except Exception as exc:
            return attempt.told(intent, exc)
        return attempt.answer(answer)

    # -- shared, no I/O --------------------------------------------------------------------

    def _intent(self, request: ToolCallRequest, *, asynchronous: bool) -> _Intent | None:
        """The call's guard, the arguments its function receives, and its scope.

        ``None`` for a call the tool or ``ToolNode`` refuses before anything runs: a name that
        is neither declared nor a tool ("not a valid tool"), or arguments the tool's schema
        refuses. It reaches them unprotected, and they answer it as without twiceshy.

        Raises:
            TypeError: the arguments do not fit the tool's function.
        """
        name = request.tool_call["name"]
        fn = _function_of(request.tool, asynchronous=asynchronous)
        guard = self._guards.get(name)
        if guard is None:
            effect = self._classes.get(name, self._default)
            if effect is None:
                if request.tool is None:
                    return None
                raise EffectNotDeclared(
                    f"the tool {name!r} has no declared effect class: add it to "
                    f"TwiceshyMiddleware's effects ({{{name!r}: twiceshy.SAFE | KEYED | UNSAFE}}) "
                    "or give default="
                )
            guard = self._built_guard(name, effect, effect_at_of(fn))
        if guard.recorded:
            refuse_generator(fn, name, error=GeneratorTool)
        # A SAFE tool kept out of the ledger still names the scope of the runs inside it.
        try:
            arguments = _received(request, fn)
        except ArgumentsDoNotFit as exc:
            raise exc.as_raised() from None  # as the function's call would raise it
        if arguments is None:
            return None
        if self._scope is not None:
            scope = self._scope(request)
            where = "the scope= function returned no scope"
        else:
            scope = _nested_scope() or thread_scope(request) or current_scope()
            where = (
                "the run has no thread id: invoke it with "
                "config={'configurable': {'thread_id': ...}}, or give TwiceshyMiddleware a "
                "scope= function"
            )
        if guard.recorded and not (isinstance(scope, str) and scope):
            raise ScopeNotFound(
                f"the tool {guard.name!r} cannot be protected: {where}; it did not run"
            )
        return _Intent(guard, arguments, scope or None)

    def _built_guard(self, name: str, effect: Effect, effect_at: Literal["mark"] | None) -> Guard:
        """The guard for a tool declared by its effect class alone."""
        guard = self._built.get((name, effect_at))
        if guard is None:
            guard = self._ledger.guard(name, effect=effect, effect_at=effect_at)
            guard = self._built[name, effect_at] = guard.with_stored_answers()
        return guard


def _nested_scope() -> str | None:
    """The scope of a run started inside a protected call, if this is one.

    The scope the call's nested runs inherit, or a ``twiceshy.run(...)`` the tool entered: the
    application's choice. Either one wins over the thread id, which a subgraph or a sub-agent
    inherits from the outer run's config and which would make two different outer intents
    share their inner ones.
    """
    scope = inherited_scope()
    if scope is None and current_call() is not None:  # (reading current_key() hands it on)
        scope = current_scope()
    return scope


def _function_of(tool: BaseTool | None, *, asynchronous: bool) -> Callable[..., Any] | None:
    """The Python function a call of ``tool`` runs, if it is known.

    A ``@tool`` function (``StructuredTool``, ``Tool``) runs its ``coroutine`` under
    ``ainvoke`` when it has one, else its ``func``; a ``BaseTool`` subclass runs ``_run``
    (or its own ``_arun``).
    """
    if tool is None:
        return None
    if isinstance(tool, StructuredTool | Tool):
        first, second = (tool.coroutine, tool.func) if asynchronous else (tool.func, tool.coroutine)
        return first or second
    if asynchronous and type(tool)._arun is not BaseTool._arun:
        return tool._arun
    return tool._run


def _received(request: ToolCallRequest, fn: Callable[..., Any] | None) -> dict[str, Any] | None:
    """The arguments ``fn`` receives for this call, by name, after LangChain's parsing; ``None``
    when the tool's own validation refuses what the model sent.

    The call goes through what ``ToolNode`` and the tool do before the function runs:
    LangGraph's injection (state, store, runtime), then the tool's own validation
    (``_to_args_and_kwargs``); the result is bound to the function's signature, the injected
    parameters left out. Where that cannot be done (no function, a JSON schema, an injection or
    a validation that fails otherwise, a value of a type with no canonical form) the call is
    keyed by ``tool_call["args"]`` with the schema's defaults: never left unprotected.

    Raises:
        ArgumentsDoNotFit: the validated arguments do not fit the function.
    """
    tool = request.tool
    if tool is None or fn is None or isinstance(tool.args_schema, dict):
        return _with_defaults(request)  # no signature to bind the JSON to
    try:
        call = _injector()._inject_tool_args(request.tool_call, request.runtime, tool)
    except Exception:  # ToolNode answers this call with its own error; keyed as it was sent
        return _with_defaults(request)
    try:
        args, kwargs = tool._to_args_and_kwargs(dict(call["args"]), call.get("id"))
    except (ValidationError, ValidationErrorV1):
        if _injected_alike(tool, request.runtime):
            return None  # ToolNode's own validation refuses it too: the function never runs
        return _with_defaults(request)  # a refusal that may hang on what LangGraph injects
    except Exception:  # the tool answers this call with its own error; keyed as it was sent
        return _with_defaults(request)
    try:
        injected = _injected_names(tool, fn)
        parameters = inspect.signature(fn).parameters
        for name in injected & set(parameters):
            # StructuredTool passes the run config and callbacks itself: left out all the same.
            if parameters[name].kind not in _VARIADIC:
                kwargs.setdefault(name, None)
        arguments = received(
            fn,
            args,
            kwargs,
            inject=injected,
            sent=request.tool_call.get("args") or {},
            made=factory_fields(tool.get_input_schema()),
        )
    except ArgumentsDoNotFit:
        raise  # Python refuses the call before the function runs: no intent to claim
    except Exception:  # a signature that cannot be read: keyed as it was sent
        return _with_defaults(request)
    try:
        canonical_json(arguments)
    except UnkeyableType:  # a value LangChain built (a Path...) that has no canonical form
        return _with_defaults(request)
    except UnkeyableArgument:  # a value refused (a naive datetime...): the guard words it
        pass
    return arguments


def _injected_alike(tool: BaseTool, runtime: object) -> bool:
    """Whether ``ToolNode`` injects for ``tool`` what the injection here did, so that the tool's
    validation gives its call the same verdict there.

    It does but for graph state injected from a list state, which ``ToolNode`` maps by a
    ``messages_key`` of its own that the middleware cannot read: the same method
    (``_inject_tool_args``) with the same runtime and tool.
    """
    state = getattr(runtime, "state", None)
    return not (isinstance(state, list) and _get_all_injected_args(tool).state)


@functools.cache
def _injector() -> ToolNode:
    """A ``ToolNode`` with no tools of its own: it injects for any tool it is handed."""
    return ToolNode([])


def _injected_names(tool: BaseTool, fn: Callable[..., Any]) -> set[str]:
    """The parameters of ``fn`` that LangChain or LangGraph fill in, not the model."""
    names = set(FILTERED_ARGS) | set(tool._injected_args_keys)
    schema = tool.tool_call_schema
    full = tool.get_input_schema()
    if isinstance(schema, type) and issubclass(schema, BaseModel) and issubclass(full, BaseModel):
        names |= set(full.model_fields) - set(schema.model_fields)
    config = _get_runnable_config_param(fn)
    if config:
        names.add(config)
    return names


def _with_defaults(request: ToolCallRequest) -> dict[str, Any]:
    """``tool_call["args"]`` with the tool schema's plain defaults for omitted parameters.

    A model may leave out an optional parameter once and send its default the next time: one
    intent (docs/design.md §2). Defaults made by a factory are left out: they may differ every call.
    A value the model sent for an injected parameter (``InjectedState``, ``InjectedToolCallId``,
    ``ToolRuntime``...) is left out too: ``ToolNode`` replaces it, so it names nothing.
    """
    arguments = dict(request.tool_call.get("args") or {})
    tool = request.tool
    if tool is None:
        return arguments
    if isinstance(tool.args_schema, dict):
        return with_schema_defaults(arguments, tool.args_schema)
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


def _record_of(message: ToolMessage | None, tool: str, run: str) -> dict[str, Any]:
    """What a retry should see: the answering message's content, status and artifact, or a note.

    ``run`` marks the record as the one the current call made. An artifact with no JSON form (a
    document object, say) is left out rather than making the whole outcome unstorable: the
    model never reads it, only the application does.
    """
    if message is not None:
        record: dict[str, Any] = {"content": message.content, "status": message.status, "run": run}
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
        "run": run,
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
