"""Strands Agents: every tool call of an agent through a twiceshy ledger, as a plugin.

One line protects an agent's tools (``from twiceshy import KEYED, SAFE, UNSAFE``)::

    agent = Agent(
        model=model,
        tools=[charge, wire, lookup],
        plugins=[TwiceshyPlugin(ledger, {"charge": KEYED, "wire": UNSAFE}, default=SAFE)],
    )

The plugin registers one wrap handler for Strands' ``ExecuteToolStage`` (it is
:meth:`TwiceshyPlugin.wrap_tool`, which ``agent.add_middleware(ExecuteToolStage, ...)`` takes as
well). Every execution of a tool passes through it, so each retry meets the ledger: the model
calling again (a new ``toolUseId``), an ``AfterToolCallEvent`` hook that sets ``retry``, a run
started again.

How a call is handled:

- The intent is ``(scope, tool, arguments)``, the arguments being those the tool's function
  receives: the model's input as the ``@tool`` decorator validates it (``"4900"`` for an ``int``
  is ``4900``, an omitted parameter its default), bound to the function's parameters by name.
  What Strands injects (``ToolContext``, ``agent``) is no part of it, nor is the ``toolUseId``,
  which is new every time the model calls again. A tool with no Python function behind it (an
  MCP tool, a module tool) is keyed by the model's input with its schema's defaults.
- A call the tool never runs never meets the ledger: an input the decorator refuses (a required
  argument left out, a value of the wrong type) passes by it, and the tool refuses it the same
  way; an input the decorator accepts but the function does not take (a positional-only
  parameter, which Strands passes by name) gets the error result Strands makes of the
  ``TypeError`` the call would raise, without calling it. Nothing is claimed, so the next
  well-formed call runs.
- A recorded tool (KEYED, UNSAFE, or SAFE with ``record=True``) whose function is a sync
  generator is refused, when the plugin is attached to the agent or, for a tool added later,
  when it is first called: Strands shows the model the generator object, its body never run.
  An async generator tool is protected as any other: Strands streams it inside the call the
  ledger wraps, so its body runs within the claim.
- The scope is, in this order: ``scope(context)`` when the plugin has a ``scope=`` function (the
  ``ExecuteToolContext``: ``context.invocation_state``, ``context.agent``...); else
  ``twiceshy.current_scope()``: a ``twiceshy.run(...)`` around the call, or, for an agent run
  inside a protected tool (an agent as a tool), the scope that call passes on; else the agent's
  ``session_id``, which a session manager keeps across restarts (without one, Strands draws a
  fresh one for every ``Agent``).
- How the ledger reads a call: the tool's result (its status and content) is recorded and
  replayed under the new ``toolUseId``; an exception the tool raised (Strands turns it into an
  error result, keeping the exception) is read as twiceshy reads any exception: ambiguous
  unless the guard lists it as ``definite=`` or ``not_applied=``, or it was raised before the
  tool called ``twiceshy.point_of_no_return()``. An interrupt (``InterruptException``, from the
  tool or from a middleware inside this one) means nothing ran: the intent is released and the
  interrupt passes on; the tool runs when the agent resumes.
- twiceshy's own answers reach the model as an error result carrying its text for the model,
  never "try again": an unknown outcome, an identical call in progress, a refused key, a result
  that ran but could not be kept, and a KEYED tool out of attempts (it may have taken effect;
  an identical call later is safe). The exception rides along (``AfterToolCallEvent.exception``).
  Other errors keep Strands' own answer.
- Events a tool streams while it runs reach the caller when its call ends.
"""

from __future__ import annotations

try:
    from strands.agent import Agent
    from strands.interrupt import InterruptException
    from strands.middleware import ExecuteToolContext, ExecuteToolStage, ToolResultEvent
    from strands.middleware.types import MiddlewareNext
    from strands.plugins import Plugin
    from strands.tools.decorator import DecoratedFunctionTool
    from strands.types._events import ToolInterruptEvent
    from strands.types.events import TypedEvent
    from strands.types.tools import AgentTool, ToolResult
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.strands needs Strands Agents: pip install 'twiceshy[strands]'"
        f" ({exc})"
    ) from exc

import inspect
from collections.abc import AsyncGenerator, Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeAlias

from .. import Effect, Guard, Ledger, MissingScope, NotApplied, current_scope
from ..errors import EffectNotDeclared
from ._calls import (
    ArgumentsDoNotFit,
    effect_at_of,
    for_the_model,
    received,
    refuse_generator,
    with_schema_defaults,
)

__all__ = ["EffectNotDeclared", "ScopeFunction", "TwiceshyPlugin", "session_scope"]

ScopeFunction: TypeAlias = Callable[[ExecuteToolContext], "str | None"]
"""``scope(context)``: the scope of one tool call; ``None`` from it means the call has none."""

_SPECIAL = frozenset({"agent", "self", "cls"})
"""Parameters Strands fills in itself, besides the tool context."""


class _NotRun(NotApplied):
    """Carries an interrupt through the ledger: the tool stopped before taking effect."""

    def __init__(self, interrupt: InterruptException | TypedEvent) -> None:
        super().__init__("the tool was interrupted; it runs when the agent resumes")
        self.interrupt = interrupt
        """The interrupt: raised by a middleware inside the plugin, or the tool's event."""


def session_scope(context: ExecuteToolContext) -> str | None:
    """The agent's ``session_id``: the scope a call gets when nothing else names one."""
    session_id = getattr(context.agent, "session_id", None)
    return session_id if isinstance(session_id, str) and session_id else None


class TwiceshyPlugin(Plugin):
    """Sends every tool call of a Strands agent through a twiceshy ledger.

    Give it to ``Agent(plugins=[...])``; it registers :meth:`wrap_tool` for
    ``ExecuteToolStage``. Middleware registered before it (``agent.add_middleware``, other
    plugins listed first) wraps it; put an approval gate or a retrying middleware there, so
    that each retry meets the ledger.

    Args:
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options (attempts,
            ``definite=``, ``key_args=``, ``reconcile=``...).
        default: the effect class of tools not named in ``effects``. Without it, the agent's
            tools must all be named (checked when the plugin is attached), and a tool added
            later and called undeclared is refused with :class:`EffectNotDeclared`.
        scope: ``scope(context)`` gives each call's scope instead of
            ``twiceshy.current_scope()`` and the agent's session id.

    Raises:
        TypeError: the ledger, an effect or the default is of the wrong kind.
        ValueError: nothing is declared, a tool name is not usable in keys, or a guard is named
            after another tool.
    """

    name = "twiceshy"

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
        if scope is not None and not callable(scope):
            raise TypeError("scope= must be a function of the ExecuteToolContext, or None")
        guards: dict[str, Guard] = {}
        classes: dict[str, Effect] = {}
        for name, effect in (effects or {}).items():
            if isinstance(effect, Guard):
                if effect.name != name:
                    raise ValueError(f"the guard for the tool {name!r} is named {effect.name!r}")
                guards[name] = effect
            elif isinstance(effect, Effect):
                ledger.guard(name, effect=effect)  # checks the name now
                classes[name] = effect
            else:
                raise TypeError(
                    f"the effect of the tool {name!r} must be twiceshy.SAFE, KEYED, UNSAFE or a "
                    f"twiceshy.Guard, not {effect!r}"
                )
        self.ledger = ledger
        self.guards = MappingProxyType(guards)
        self.default = default
        self.scope = scope
        self._classes = MappingProxyType(classes)
        # Guards built from an effect class, by tool name and function; filled as tools are
        # first called (a racing fill builds an equal guard).
        self._built: dict[tuple[str, Any], Guard] = {}

    def __repr__(self) -> str:
        default = self.default.name if self.default is not None else None
        names = sorted({*self.guards, *self._classes})
        return f"TwiceshyPlugin({self.ledger!r}, tools={names}, {default=})"

    def init_agent(self, agent: Agent) -> None:
        """Attach to ``agent``: check its tools are declared, and wrap their execution.

        Raises:
            ValueError: without ``default=``, a tool of the agent has no effect class.
            TypeError: a recorded tool's function is a sync generator.
        """
        if self.default is None:
            names = set(agent.tool_registry.registry)
            undeclared = sorted(names - set(self.guards) - set(self._classes))
            if undeclared:
                raise ValueError(
                    "these tools have no effect class: "
                    f"{', '.join(undeclared)}; name them in TwiceshyPlugin's effects "
                    "(twiceshy.SAFE, KEYED or UNSAFE) or give default="
                )
        for name, tool in agent.tool_registry.registry.items():
            if self._recorded(name):
                _refuse_generator(name, tool)
        agent.add_middleware(ExecuteToolStage, self.wrap_tool)

    async def wrap_tool(
        self,
        context: ExecuteToolContext,
        next_fn: MiddlewareNext[ExecuteToolContext, TypedEvent],
    ) -> AsyncGenerator[TypedEvent, None]:
        """Run the tool call through the ledger: once per intent; a retry gets the first result.

        A wrap handler for ``ExecuteToolStage``. Yields the events of the tool's run (its last is
        the ``ToolResultEvent``), or only the recorded result, replayed for this call's
        ``toolUseId``, or an error result with twiceshy's text for the model.

        Raises:
            EffectNotDeclared, MissingScope: before anything runs; Strands answers the call
                with an error result.
            TypeError: a recorded tool's function is a sync generator; likewise.
        """
        tool = context.tool
        if tool is None:  # a name with no tool: Strands answers it, nothing runs
            async for event in next_fn(context):
                yield event
            return
        name = context.tool_use["name"]
        use_id = str(context.tool_use.get("toolUseId"))
        guard = self._guard_for(name, tool)
        if guard.recorded:
            _refuse_generator(name, tool)  # a tool added to the agent after the plugin
        try:
            arguments = _arguments(tool, context.tool_use.get("input"))
        except ArgumentsDoNotFit as exc:
            # Strands' own error result for the TypeError its call of the function would raise.
            error = exc.as_raised()
            yield ToolResultEvent(_error(use_id, f"Error: TypeError - {error}"), exception=error)
            return
        if arguments is None:  # refused by the tool's own validation: nothing runs
            async for event in next_fn(context):
                yield event
            return
        scope = self._scope_for(context, guard)
        streamed: list[TypedEvent] = []
        live: list[ToolResultEvent] = []

        async def work() -> dict[str, Any]:
            # One attempt: a KEYED tool retried in place streams and answers anew.
            streamed.clear()
            live.clear()
            result: ToolResultEvent | None = None
            try:
                async for event in next_fn(context):
                    if isinstance(event, ToolInterruptEvent):
                        raise _NotRun(event)
                    if isinstance(event, ToolResultEvent):
                        result = event
                    else:
                        streamed.append(event)
            except InterruptException as signal:  # a middleware inside this one interrupted
                raise _NotRun(signal) from signal
            if result is None:
                raise RuntimeError(
                    f"the tool {name!r} ended without a result: a middleware inside "
                    "TwiceshyPlugin must forward the events of next_fn(context)"
                )
            live.append(result)
            if result.exception is not None:
                # The tool raised; Strands made it an error result. The ledger reads the
                # exception itself: ambiguous, certain or "nothing happened".
                raise result.exception
            return _record_of(result.tool_result)

        try:
            value = await guard.acall(arguments, work, scope=scope)
        except _NotRun as stopped:
            for event in streamed:
                yield event
            if isinstance(stopped.interrupt, InterruptException):
                raise stopped.interrupt from None
            yield stopped.interrupt
            return
        except Exception as exc:
            for event in streamed:
                yield event
            text = for_the_model(guard, exc, arguments, scope=scope)
            if text is not None:
                yield ToolResultEvent(_error(use_id, text), exception=exc)
            elif live:  # this call ran the tool: Strands' own answer to its error
                yield live[0]
            else:
                raise
            return
        for event in streamed:
            yield event
        if live:
            yield live[0]  # this call's own run, exactly as the tool answered it
        else:
            yield ToolResultEvent(_replayed(use_id, value))

    # -- shared, no I/O --------------------------------------------------------------------

    def _guard_for(self, name: str, tool: AgentTool) -> Guard:
        """The called tool's guard: the application's own, else one built from its class."""
        guard = self.guards.get(name)
        if guard is not None:
            return guard
        effect = self._classes.get(name, self.default)
        if effect is None:
            raise EffectNotDeclared(
                f"the tool {name!r} has no declared effect class: add it to TwiceshyPlugin's "
                f"effects ({{{name!r}: twiceshy.SAFE | KEYED | UNSAFE}}) or give default=; it "
                "did not run"
            )
        fn = _function_of(tool)
        built = self._built.get((name, fn))
        if built is None:
            # The result is recorded as Strands shaped it for the model: a JSON mapping.
            built = self.ledger.guard(name, effect=effect, effect_at=effect_at_of(fn))
            self._built[name, fn] = built
        return built

    def _recorded(self, name: str) -> bool:
        """Whether the tool ``name``'s calls are recorded (its guard's, or its effect class's)."""
        guard = self.guards.get(name)
        if guard is not None:
            return guard.recorded
        effect = self._classes.get(name, self.default)
        return effect is not None and effect is not Effect.SAFE

    def _scope_for(self, context: ExecuteToolContext, guard: Guard) -> str | None:
        """The call's scope (see the module's documentation); ``MissingScope`` for a recorded
        tool with none (a SAFE tool needs none: where there is one, it names its nested runs')."""
        if self.scope is not None:
            scope = self.scope(context)
            where = "the scope= function returned no scope"
        else:
            scope = current_scope() or session_scope(context)
            where = "the agent has no session id and no twiceshy.run(...) encloses the call"
        if isinstance(scope, str) and scope:
            return scope
        if not guard.recorded:
            return None
        raise MissingScope(f"the tool {guard.name!r} cannot be protected: {where}; it did not run")


def _function_of(tool: AgentTool) -> Callable[..., Any] | None:
    """The Python function behind a ``@tool``, if there is one."""
    if isinstance(tool, DecoratedFunctionTool):
        fn = getattr(tool, "__wrapped__", None)
        return fn if callable(fn) else None
    return None


def _refuse_generator(name: str, tool: AgentTool) -> None:
    """Refuse a recorded ``@tool`` whose function is a sync generator: Strands makes the
    generator object its result, the body never run (an async generator it streams)."""
    refuse_generator(_function_of(tool), name, consumed="async")


def _arguments(tool: AgentTool, sent: object) -> dict[str, Any] | None:
    """The arguments the tool's function receives for the model's input, by name; ``None`` when
    the tool's own validation refuses the input (the tool refuses it alike: nothing runs).

    A ``@tool`` function gets the input as its decorator validates it, bound to its signature
    with the parameters Strands injects left out; any other tool is keyed by the input with its
    schema's defaults.

    Raises:
        ArgumentsDoNotFit: the validated input does not fit the function.
    """
    given = dict(sent) if isinstance(sent, Mapping) else {}
    fn = _function_of(tool)
    metadata = getattr(tool, "_metadata", None)
    validate = getattr(metadata, "validate_input", None)
    if fn is not None and callable(validate):
        try:
            validated = validate(dict(given))
        except ValueError:
            return None
        context = getattr(metadata, "_context_param", None)
        inject = {*_SPECIAL, *([context] if isinstance(context, str) else [])}
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        inject &= set(parameters)
        try:
            return received(fn, [], validated, inject=inject, sent=given)
        except ArgumentsDoNotFit:
            raise  # the call would raise it before the function runs: no intent to claim
        except (TypeError, ValueError):
            pass  # a signature that cannot be read: keyed by the input
    spec = getattr(tool, "tool_spec", None) or {}
    schema = (spec.get("inputSchema") or {}).get("json") if isinstance(spec, Mapping) else None
    return with_schema_defaults(given, schema)


def _record_of(result: ToolResult) -> dict[str, Any]:
    """What a retry should see of a result: its status and content."""
    return {"status": result.get("status", "success"), "content": list(result.get("content", []))}


def _replayed(use_id: str, value: object) -> ToolResult:
    """The recorded result, answering the call ``use_id``."""
    if isinstance(value, Mapping) and "content" in value:
        if value.get("status") == "error":
            return {"toolUseId": use_id, "status": "error", "content": list(value["content"])}
        return {"toolUseId": use_id, "status": "success", "content": list(value["content"])}
    # Recorded by something other than this plugin under the same key.
    return {"toolUseId": use_id, "status": "success", "content": [{"json": value}]}


def _error(use_id: str, text: str) -> ToolResult:
    return {"toolUseId": use_id, "status": "error", "content": [{"text": text}]}
