"""Google ADK agents: every call of a protected function tool or agent tool through a twiceshy
ledger.

One line protects an agent's tools (``from twiceshy import KEYED, SAFE, UNSAFE``)::

    agent = LlmAgent(
        name="billing",
        model=model,
        tools=protect([charge, wire, lookup, AgentTool(refunds)], ledger,
                      effects={"charge": KEYED, "wire": UNSAFE}, default=SAFE),
    )

Where it sits: inside the tool, at the call of its function, after everything ADK does first:
the before-tool callbacks of plugins and agent, the confirmation gate (``require_confirmation``,
a tool confirmation requested, granted or refused), ADK's argument preparation (pydantic models
built from their JSON, and with ADK's ``FUNCTION_TOOL_ARG_VALIDATION`` feature the values
coerced to their annotations), the check of mandatory arguments. A call any of those answers
never meets the ledger, and a gate is never passed by. The ledger's outcome is what the
function returned; what an after-tool callback makes of it is no part of it, so a callback that
answers instead of the tool cannot overwrite what the ledger knows. An agent tool
(``AgentTool``) is protected around its whole run of its agent, once its request is read.

How a call is handled:

- The intent is ``(scope, tool, arguments)``, the arguments being those the function receives
  from ADK, bound to its parameters by name with their defaults. The tool context and ADK's
  ``input_stream`` are no part of it, nor is the function-call id, which is new every time the
  model calls again. ADK hands the function the model's JSON values unless its
  ``FUNCTION_TOOL_ARG_VALIDATION`` feature is on: without it, ``"4900"`` sent for an ``int``
  reaches the function as text and names another intent than ``4900``. An agent tool's
  argument is its ``request``, or the agent's ``input_schema`` model built from what was sent.
- The scope is, in this order: ``scope(tool_context)`` when ``protect`` has a ``scope=``
  function; else ``twiceshy.current_scope()``: a ``twiceshy.run(...)`` around the run, or, for
  an agent run inside a protected call (a protected agent tool's agent), the scope that call
  passes on; else, for a run a trigger delivery started, the delivery (:func:`delivery_scope`);
  else the session id, ``tool_context.session.id``, which a persistent session service keeps
  across restarts and which a resumed invocation keeps too.
- ADK runs an agent tool's agent in a new, empty session on every call, so a recorded tool
  inside an agent tool that is not protected has no scope a retry shares: it raises
  ``MissingScope`` (protect the agent tool) instead of taking that session's id.
- twiceshy's own answers become the function's response, ``{"error": text}`` as ADK words a
  tool's refusal, so that no ``on_tool_error`` callback (``ReflectAndRetryToolPlugin``) turns
  them into a retry: an unknown outcome, an identical call in progress, a refused key, a result
  that ran but could not be kept, and a KEYED tool out of attempts (it may have taken effect;
  an identical call later is safe). Other errors are raised as the function raised them, and
  ADK handles them as usual.
- The model reads the same on the first call and on every replay: the function's result as the
  ledger stores it, rebuilt as its return annotation. What a tool did to ``tool_context``
  (state changes, a transfer, artifacts) happens on its run only, never on a replay.
"""

from __future__ import annotations

try:
    from google.adk.agents.llm_agent import ToolUnion
    from google.adk.tools._forwarding_artifact_service import ForwardingArtifactService
    from google.adk.tools.agent_tool import AgentTool, _get_input_schema
    from google.adk.tools.base_tool import BaseTool
    from google.adk.tools.function_tool import FunctionTool
    from google.adk.tools.tool_context import ToolContext
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.google_adk needs Google ADK: pip install 'twiceshy[google-adk]'"
        f" ({exc})"
    ) from exc

import contextvars
import functools
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar, cast

from .. import Effect, Guard, Ledger, MissingScope, current_scope
from ._calls import ArgumentsDoNotFit, effect_at_of, for_the_model, received
from ._core import ReturnOf, refuse_generator
from ._declared import Declarations

__all__ = [
    "TRIGGER_DELIVERY",
    "ScopeFunction",
    "delivery_scope",
    "protect",
    "protect_tool",
    "session_scope",
]

ScopeFunction: TypeAlias = Callable[[ToolContext], "str | None"]
"""``scope(tool_context)``: the scope of one call; ``None`` from it means the call has none."""

_ToolT = TypeVar("_ToolT", bound=BaseTool)

TRIGGER_DELIVERY: Final = "trigger_delivery"
"""The session-state key where ADK's trigger routes (``/apps/{app}/trigger/pubsub`` and
``/trigger/eventarc``, ADK 2.12 and later) keep the delivery that started a run."""

_WITHIN: Final = {"pubsub": "subscription", "eventarc": "event_source"}
"""Per delivery source, the field of ADK's delivery record within which its ``id`` is unique:
a Pub/Sub message id within its subscription's topic (every subscription gets the message), a
CloudEvents id within its source."""

_INJECTED = ("input_stream",)
"""Parameters ADK fills in itself, besides the tool context."""


def session_scope(tool_context: ToolContext) -> str | None:
    """The id of the session a tool is called in (``tool_context.session.id``), or ``None``."""
    session = getattr(tool_context, "session", None)
    session_id = getattr(session, "id", None)
    return session_id if isinstance(session_id, str) and session_id else None


def delivery_scope(tool_context: ToolContext) -> str | None:
    """The scope of the trigger delivery that started the run a tool is called in, or ``None``
    for a run no trigger started.

    ADK's Pub/Sub and Eventarc trigger routes (ADK 2.12 and later) run each delivery in a new
    session and keep the delivery in its state (:data:`TRIGGER_DELIVERY`). A redelivered message
    gets another session but is the same delivery: the scope is made of what stays the same
    across redeliveries, the source, the Pub/Sub subscription or CloudEvents source, and the
    message or event id (never the delivery attempt, nor the publish time).

    Raises:
        MissingScope: the run was started by a delivery that carries no id, or by one of a
            source twiceshy does not know.
    """
    scope, problem = _delivery(tool_context)
    if problem is not None:
        raise MissingScope(f"no scope for this call: {problem}")
    return scope


def protect(
    tools: Iterable[BaseTool | Callable[..., Any]],
    ledger: Ledger,
    *,
    effects: Mapping[str, Effect | Guard] | None = None,
    default: Effect | None = None,
    scope: ScopeFunction | None = None,
) -> list[ToolUnion]:
    """Copies of ``tools`` whose every function call (or agent run) goes through ``ledger``.

    Args:
        tools: ``FunctionTool`` objects (``LongRunningFunctionTool`` and other subclasses
            included), plain functions (made into ``FunctionTool(fn)``, as an agent would), and
            ``AgentTool`` objects, each named by its agent's name.
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options (attempts,
            ``definite=``, ``key_args=``, ``reconcile=``...).
        default: the effect class of the tools not named in ``effects``.
        scope: ``scope(tool_context)`` gives each call's scope instead of
            ``twiceshy.current_scope()``, the trigger delivery and the session id.

    Returns:
        The protected tools, in order, for ``LlmAgent(tools=...)``: each a copy of the class
        of the tool given (``FunctionTool(fn)`` for a function).

    Raises:
        TypeError: a tool is neither a ``FunctionTool``, an ``AgentTool`` nor a function, an
            effect is of no known kind, or a recorded tool's function is a generator.
        EffectNotDeclared: a tool has no effect class (a ``ValueError``).
        ValueError: ``effects`` names a tool not given, or a guard named for another tool.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
    declarations = Declarations(effects, default)
    protected: list[ToolUnion] = []
    for given in tools:
        tool = _as_tool(given)
        guard = declarations.guard(tool.name, functools.partial(_guard_for, ledger, tool))
        protected.append(protect_tool(tool, guard, scope=scope))
    declarations.check_all_used()
    return protected


def protect_tool(tool: _ToolT, guard: Guard, *, scope: ScopeFunction | None = None) -> _ToolT:
    """A copy of ``tool`` whose every function call (an agent tool: every run of its agent)
    goes through ``guard``.

    The copy is of the tool's own class and keeps all it has (name, declaration, confirmation
    policy, long-running flag); the tool itself is left unchanged. The guard answers the first
    caller with the result as stored (``with_stored_answers()``), so the model reads the same on
    the first call and on every replay.

    Args:
        tool: the ``FunctionTool`` or ``AgentTool`` to protect.
        guard: its guard, from ``ledger.guard(name, effect=..., ...)``; the guard's name is the
            tool's name in keys.
        scope: where the scope comes from (see :func:`protect`).

    Raises:
        TypeError: ``tool`` is neither a ``FunctionTool`` nor an ``AgentTool``, ``guard`` not a
            guard, or a recorded tool's function is a generator (ADK runs it as a workflow
            node, past the ledger).
        ValueError: the guard is named after another tool.
    """
    if not isinstance(tool, FunctionTool | AgentTool):
        raise TypeError(
            f"only a FunctionTool or an AgentTool can be protected, not {type(tool).__name__}"
        )
    if not isinstance(guard, Guard):
        raise TypeError("guard= must be a twiceshy.Guard, from ledger.guard(...)")
    if guard.name != tool.name:
        raise ValueError(f"the guard for the tool {tool.name!r} is named {guard.name!r}")
    if scope is not None and not callable(scope):
        raise TypeError("scope= must be a function of the ToolContext, or None")
    if guard.recorded and isinstance(tool, FunctionTool):
        _refuse_streaming(tool)
    copy = object.__new__(_protected_class(type(tool)))
    # Every attribute of the tool (function or agent, declaration caches, confirmation
    # policy), so that ADK calls the copy exactly as it calls the tool.
    vars(copy).update(vars(tool))
    copy._twiceshy = _Protection(guard.with_stored_answers(), scope)  # type: ignore[attr-defined]
    return cast("_ToolT", copy)


def _as_tool(given: object) -> FunctionTool | AgentTool:
    if isinstance(given, FunctionTool | AgentTool):
        return given
    if isinstance(given, BaseTool):
        raise TypeError(
            f"only function tools and agent tools can be protected, not {type(given).__name__}; "
            "list other tools next to the protected ones"
        )
    if callable(given):
        return FunctionTool(given)
    raise TypeError(
        f"a tool must be a FunctionTool, an AgentTool or a function, not {type(given).__name__}"
        " (an agent is given as a tool wrapped: AgentTool(agent))"
    )


def _refuse_streaming(tool: FunctionTool) -> None:
    """A recorded tool's function must return its result: ADK runs a generator as a workflow
    node, past the call the ledger wraps (it looks through wrappers to find one), and a stream
    cannot be replayed."""
    refuse_generator(tool.func, tool.name, wrapped=True)


def _guard_for(ledger: Ledger, tool: FunctionTool | AgentTool, effect: Effect) -> Guard:
    """The guard ``protect`` builds for a tool declared by its effect class alone: results
    replay as the function's return annotation, and a function that calls
    ``twiceshy.point_of_no_return()`` says where its effect starts. An agent tool's run is
    attempted once: running a whole agent again in place is no retry ADK would make."""
    if isinstance(tool, AgentTool):
        return ledger.guard(tool.name, effect=effect, attempts=1)
    fn = tool.func
    if effect is not Effect.SAFE:
        _refuse_streaming(tool)
    returns = ReturnOf(fn) if effect is not Effect.SAFE else None
    return ledger.guard(tool.name, effect=effect, returns=returns, effect_at=effect_at_of(fn))


@dataclass(frozen=True, slots=True)
class _Protection:
    guard: Guard
    scope: ScopeFunction | None


@dataclass(frozen=True, slots=True)
class _Invocation:
    """What ADK handed the tool for the call now running: the model's arguments and context."""

    args: Mapping[str, Any]
    tool_context: ToolContext


_RUNNING: contextvars.ContextVar[_Invocation | None] = contextvars.ContextVar(
    "twiceshy_adk_invocation", default=None
)


class _Protected(FunctionTool):
    """The part of a protected tool's class that puts its function's call through the ledger."""

    _twiceshy: _Protection

    async def run_async(self, *, args: dict[str, Any], tool_context: ToolContext) -> Any:
        """ADK's own run of the tool, the call of its function going through the ledger."""
        token = _RUNNING.set(_Invocation(args, tool_context))
        try:
            return await super().run_async(args=args, tool_context=tool_context)
        finally:
            _RUNNING.reset(token)

    async def _invoke_callable(
        self, target: Callable[..., Any], args_to_call: dict[str, Any]
    ) -> Any:
        # ADK calls the tool's function through here once everything before it has passed
        # (callbacks, the confirmation gate, argument checks); it calls other callables too
        # (the require_confirmation predicate), which pass unguarded.
        invocation = _RUNNING.get()
        if target is not self.func or invocation is None:
            return await super()._invoke_callable(target, args_to_call)
        guard = self._twiceshy.guard
        arguments = self._received(args_to_call, invocation.args)
        scope = _scope_for(self._twiceshy, invocation.tool_context)

        async def work() -> Any:
            return await super(_Protected, self)._invoke_callable(target, args_to_call)

        return await _guarded(guard, arguments, work, scope)

    def _received(self, args_to_call: Mapping[str, Any], sent: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments the function receives, by name, ADK's injected parameters left out."""
        inject = (self._context_param_name, *_INJECTED)
        try:
            return received(self.func, [], args_to_call, inject=inject, sent=sent)
        except ArgumentsDoNotFit as unfit:
            # Unfit as ADK calls it, the call never runs: ADK's own TypeError, nothing claimed.
            # (Newer releases make a function with positional-only parameters take them by
            # name: bound as such a release calls it.)
            if not _KEYWORD_COMPATIBLE:
                raise unfit.as_raised() from None
            positional, named = _as_adk_calls(self.func, args_to_call)
            try:
                return received(self.func, positional, named, inject=inject, sent=sent)
            except ArgumentsDoNotFit as still:
                raise still.as_raised() from None
        except (TypeError, ValueError):  # a signature that cannot be read: what ADK hands it
            return {k: v for k, v in args_to_call.items() if k not in inject}


_KEYWORD_COMPATIBLE: Final = hasattr(FunctionTool, "_get_compatible_func")
"""Whether this ADK makes a function with positional-only parameters take them by name (2.13
does); an older one (2.2) calls every function by keyword, which such a function refuses."""


def _as_adk_calls(
    fn: Callable[..., Any], args_to_call: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """``args_to_call`` split as ADK passes them: positional-only parameters by position, in
    order (while each is given), the rest by name."""
    named = dict(args_to_call)
    positional = []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY or parameter.name not in named:
            break
        positional.append(named.pop(parameter.name))
    return positional, named


class _ProtectedAgent(AgentTool):
    """The part of a protected agent tool's class that puts each run of its agent through the
    ledger: a recorded one runs its agent once per intent; every one, SAFE included, gives the
    runs inside it (the agent's own tools) a scope derived from its call's key."""

    _twiceshy: _Protection

    async def run_async(self, *, args: dict[str, Any], tool_context: ToolContext) -> Any:
        """ADK's own run of the agent tool, going through the ledger once its request is read."""
        arguments = self._request(args)
        if isinstance(arguments, str):
            return {"error": arguments}
        scope = _scope_for(self._twiceshy, tool_context)
        if self.skip_summarization:
            # A setting of the tool, not an effect of its run: a replay answers as the run did.
            tool_context.actions.skip_summarization = True

        async def work() -> Any:
            return await super(_ProtectedAgent, self).run_async(
                args=args, tool_context=tool_context
            )

        return await _guarded(self._twiceshy.guard, arguments, work, scope)

    def _request(self, args: Mapping[str, Any]) -> dict[str, Any] | str:
        """What the agent is asked, as the intent's arguments: its ``request``, or its
        ``input_schema`` model built from what was sent (ADK builds it the same way, and raises
        the same error for arguments that do not fit it, before anything runs). The words for
        the model instead when the request is missing (nothing ran)."""
        schema = _get_input_schema(self.agent)
        if schema is not None:
            request: Any = schema.model_validate(args)
        elif "request" in args:
            request = args["request"]
        else:
            return (
                f"Invoking `{self.name}()` failed as its mandatory input parameter `request` is "
                "not present; nothing ran. Call it again with the request for the agent."
            )
        sent = args if schema is not None else args["request"]
        return received(_agent_input, [], {"request": request}, sent={"request": sent})


def _agent_input(request: Any) -> None:
    """The one argument of an agent tool's call, its intent: what its agent is asked."""


async def _guarded(
    guard: Guard, arguments: dict[str, Any], work: Callable[[], Any], scope: str | None
) -> Any:
    """``work`` through ``guard``; twiceshy's own answers worded for the model."""
    try:
        return await guard.acall(arguments, work, scope=scope)
    except Exception as exc:
        text = for_the_model(guard, exc, arguments, scope=scope)
        if text is None:
            raise
        return {"error": text}


# -- the scope of a call, no I/O -----------------------------------------------------------


def _scope_for(protection: _Protection, tool_context: ToolContext) -> str | None:
    """The call's scope (see :func:`protect`); ``MissingScope`` for a recorded tool with none
    (a SAFE tool needs none: where there is one, it names its nested runs' scope)."""
    if protection.scope is not None:
        scope = protection.scope(tool_context)
        why = "the scope= function returned no scope"
    else:
        scope, why = _found_scope(tool_context)
    if isinstance(scope, str) and scope:
        return scope
    if not protection.guard.recorded:
        return None
    raise MissingScope(
        f"the tool {protection.guard.name!r} cannot be protected: {why}; it did not run"
    )


def _found_scope(tool_context: ToolContext) -> tuple[str | None, str]:
    """The scope of a call given no ``scope=`` function, in the order :func:`protect` states,
    or ``None`` and why there is none."""
    scope = current_scope()
    if scope:
        return scope, ""
    agent = _agent_tool_of(tool_context)
    if agent is not None:
        # Checked before the delivery and the session: ADK copies the caller's state (the
        # delivery record with it) into the agent tool's new session, whose id is new per call.
        return None, (
            f"it runs inside the agent {agent!r} called as an AgentTool that is not protected: "
            "ADK runs that agent in a new, empty session on every call, whose id no retry "
            "shares; protect the AgentTool too (protect([AgentTool(agent), ...], ledger, "
            "effects=..., default=twiceshy.SAFE)), which gives the calls inside it the scope "
            "of its own call"
        )
    scope, problem = _delivery(tool_context)
    if problem is not None:
        return None, problem
    if scope is not None:
        return scope, ""
    return session_scope(tool_context), (
        "the call has no session id and no twiceshy.run(...) encloses it"
    )


def _agent_tool_of(tool_context: ToolContext) -> str | None:
    """The name of the agent an agent tool (``AgentTool``) runs, when the call is made inside
    its run, else ``None``.

    ``AgentTool.run_async`` runs its agent on a runner of its own whose artifact service is a
    ``ForwardingArtifactService`` of the agent tool's call (ADK 2.2 to 2.13); ADK makes one
    nowhere else, so an invocation with one is an agent tool's.
    """
    invocation = tool_context.get_invocation_context()
    if not isinstance(invocation.artifact_service, ForwardingArtifactService):
        return None
    agent = invocation.agent
    root = getattr(agent, "root_agent", agent)
    name = getattr(root, "name", None)
    return name if isinstance(name, str) else "?"


def _delivery(tool_context: ToolContext) -> tuple[str | None, str | None]:
    """The scope of the trigger delivery the call's run was started by (``None`` for a run no
    trigger started), or why that delivery names no scope."""
    record = tool_context.state.get(TRIGGER_DELIVERY)
    if record is None:
        return None, None
    if not isinstance(record, Mapping):
        record = {}
    source = record.get("source")
    within = _WITHIN.get(source) if isinstance(source, str) else None
    if within is None:
        return None, (
            f"its run was started by a trigger delivery twiceshy cannot read (the session "
            f"state's {TRIGGER_DELIVERY!r} has no source it knows: {source!r}); give protect() "
            "a scope= function"
        )
    ident = record.get("id")
    if not isinstance(ident, str) or not ident:
        return None, (
            f"its run was started by a {source} delivery that carries no id, so a redelivery "
            "could not be told from a new message; have the publisher send one, or give "
            "protect() a scope= function"
        )
    where = record.get(within)
    parts = [source, where if isinstance(where, str) else None, ident]
    return "adk-trigger:" + json.dumps(parts, ensure_ascii=False, separators=(",", ":")), None


@functools.cache
def _protected_class(cls: type[BaseTool]) -> type[BaseTool]:
    """The protected twin of a tool class: the class itself, with the part that guards its
    calls (:class:`_Protected` or :class:`_ProtectedAgent`) first."""
    if issubclass(cls, _Protected | _ProtectedAgent):
        return cls
    part: type[BaseTool] = _ProtectedAgent if issubclass(cls, AgentTool) else _Protected
    return type(f"Protected{cls.__name__}", (part, cls), {"__module__": __name__})
