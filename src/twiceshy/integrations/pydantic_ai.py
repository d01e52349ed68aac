"""Pydantic AI agents: every tool call through a twiceshy ledger, as a capability.

One line protects an agent's tools; list it last among the capabilities (the first listed is the
outermost), and pass the run a stable ``run_id``::

    effects = {"create_charge": KEYED, "wire_money": UNSAFE}
    agent = Agent(
        model,
        tools=[create_charge, wire_money, lookup],
        capabilities=[TwiceshyCapability(ledger, effects, default=SAFE)],
    )
    await agent.run("Charge order 1234", run_id="order-1234")

What it does with a tool call (``AbstractCapability.wrap_tool_execute``):

- The intent is (scope, tool name, arguments): the arguments exactly as the model sent them
  (``ToolCallPart.args``, parsed, with the tool schema's defaults filled in for omitted
  parameters), never the tool-call id, which changes every time the model calls again. What
  Pydantic AI injects (``RunContext``, dependencies) is no part of them.
- The scope is the run's ``RunContext.run_id`` (``agent.run(..., run_id=...)``; without one
  Pydantic AI draws a fresh UUID7 per run, so pass a stable id for retries across processes;
  a durable engine derives it from its workflow run). An enclosing ``twiceshy.run(...)`` comes
  before it, and ``scope=`` replaces both with a function of the ``RunContext``.
- The effect class comes from the ``effects`` mapping, else from the tool's metadata
  (``metadata={"twiceshy": "keyed"}``), else from ``default=``; a tool with none raises
  :class:`EffectNotDeclared` before it runs and ends the run.
- ``OutcomeUnknown`` and ``InProgress`` reach the model as ``ToolFailed``: a failed tool result
  with twiceshy's message (it may have happened, it will not be run again, tell the user), which
  asks for no retry and uses none of the tool's retry budget. Never as ``ModelRetry``.
- A result is replayed as the tool function's annotated return type (a ``ToolReturn``, a
  dataclass, a pydantic model...), so the model reads what the first call gave it; a
  :class:`twiceshy.Guard` given in ``effects`` keeps its own ``returns=``.
- How the ledger reads what the tool did: a result is recorded and replayed; ``ToolFailed`` is a
  certain failure, recorded and replayed; a deferral (``CallDeferred``, ``ApprovalRequired``,
  ``SkipToolExecution``) and a ``ModelRetry`` raised outside any ``except`` block (a refusal:
  "no such customer") mean nothing took effect, and the call may run again; anything else - an
  exception, Pydantic AI's own ``timeout=`` (which it turns into a retry request), a
  ``ModelRetry`` raised while handling an error - may have taken effect: a KEYED tool is run
  again with the same key, an UNSAFE one is not run again.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic_ai.capabilities import (
    AbstractCapability,
    ValidatedToolArgs,
    WrapToolExecuteHandler,
)
from pydantic_ai.exceptions import (
    ApprovalRequired,
    CallDeferred,
    ModelRetry,
    SkipToolExecution,
    ToolFailed,
    ToolFailedError,
    ToolRetryError,
    UnexpectedModelBehavior,
    UserError,
)
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.tools import AgentDepsT, RunContext, ToolDefinition
from pydantic_ai.toolsets.function import FunctionToolsetTool

from twiceshy import (
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
from twiceshy._codec import ReturnOf

__all__ = [
    "METADATA_KEY",
    "EffectNotDeclared",
    "ScopeFunction",
    "TwiceshyCapability",
    "run_scope",
]

METADATA_KEY = "twiceshy"
"""The key of ``ToolDefinition.metadata`` that may carry a tool's effect class."""

ScopeFunction = Callable[[RunContext[AgentDepsT]], "str | None"]
"""``scope(ctx)``: the run's scope for one tool call, or ``None`` when it has none."""

# Refusals from twiceshy that the model should read: nothing (more) runs, and running the same
# call again cannot help. They become ``ToolFailed``: no retry prompt, no retry budget.
_ANSWERED = (OutcomeUnknown, InProgress, KeyReuseMismatch, UnkeyableArgument)

# Pydantic AI's signals that the tool was not run (yet): another capability deferred or skipped it.
_NOT_RUN = (CallDeferred, ApprovalRequired, SkipToolExecution)


class EffectNotDeclared(TwiceshyError, UserError):
    """A tool without a declared effect class was called; it did not run.

    Raised before the tool runs, when neither ``effects``, the tool's metadata nor ``default=``
    names its class: there is no silent default. A Pydantic AI ``UserError``: it ends the run.
    """


class _NothingHappened(NotApplied):
    """Carries a Pydantic AI signal that means "nothing took effect" through the ledger."""

    def __init__(self, signal: Exception) -> None:
        super().__init__(f"the tool did not take effect ({type(signal).__name__})")
        self.signal = signal


def run_scope(ctx: RunContext[Any]) -> str | None:
    """The run's ``run_id``: the scope a call gets when no ``twiceshy.run(...)`` encloses it."""
    return ctx.run_id


@dataclass(init=False)
class TwiceshyCapability(AbstractCapability[AgentDepsT]):
    """Sends every tool call of a Pydantic AI agent through a twiceshy ledger.

    Register it with ``Agent(capabilities=[...])``, last in the list, so it sits inside the other
    capabilities' tool wrappers; Pydantic AI's own retries (a ``ModelRetry``, a tool's
    ``timeout=``, the model calling again) all come back through it.

    Args:
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options (attempts,
            ``key_args=``, ``reconcile=``...; it keeps its own ledger, and ``ToolFailed`` is
            added to its ``definite=`` types). Wins over the tool's metadata.
        default: the effect class of tools neither in ``effects`` nor carrying one in their
            metadata (``metadata={"twiceshy": "keyed"}``). Without it, calling such a tool raises
            :class:`EffectNotDeclared`.
        scope: ``scope(ctx)`` gives the run's scope instead of an enclosing ``twiceshy.run(...)``
            or the run's ``run_id``; ``None`` from it means the call has no scope.

    Raises:
        TypeError: the ledger, an effect or the default is of the wrong kind.
        ValueError: a tool name is not usable in keys, or a guard is named after another tool.
    """

    ledger: Ledger
    guards: Mapping[str, Guard]
    default: Effect | None
    scope: ScopeFunction[AgentDepsT] | None
    _effects: Mapping[str, Effect] = field(repr=False, compare=False)
    _typed: weakref.WeakKeyDictionary[Callable[..., Any], dict[tuple[str, Effect], Guard]] = field(
        repr=False, compare=False
    )

    def __init__(
        self,
        ledger: Ledger,
        effects: Mapping[str, Effect | Guard] | None = None,
        *,
        default: Effect | None = None,
        scope: ScopeFunction[AgentDepsT] | None = None,
    ) -> None:
        if not isinstance(ledger, Ledger):
            raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
        if default is not None and not isinstance(default, Effect):
            raise TypeError("default= must be twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE")
        guards: dict[str, Guard] = {}
        classes: dict[str, Effect] = {}
        for name, effect in (effects or {}).items():
            if isinstance(effect, Guard):
                if effect.name != name:
                    raise ValueError(f"the guard for the tool {name!r} is named {effect.name!r}")
                if not any(issubclass(ToolFailed, kind) for kind in effect.policy.definite):
                    # A ToolFailed is a certain failure, to be replayed.
                    effect = effect.with_errors(definite=(ToolFailed,))
                guards[name] = effect
            elif isinstance(effect, Effect):
                guards[name] = _guard(ledger, name, effect)
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
        self._effects = MappingProxyType(classes)
        # Guards that rebuild replays as the tool's return type, by tool function; weak, so
        # agents made and dropped per request do not pile up here.
        self._typed = weakref.WeakKeyDictionary()

    @classmethod
    def get_serialization_name(cls) -> str | None:
        """Not loadable from an agent spec: it needs a live :class:`twiceshy.Ledger`."""
        return None

    async def wrap_tool_execute(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: ValidatedToolArgs,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        """Run the call through the ledger: once per intent; a retry gets the first outcome.

        Args:
            ctx: the run's context (``run_id``, dependencies).
            call: the model's tool call (name, arguments, tool-call id).
            tool_def: the called tool's definition (name, schema, metadata).
            args: the validated arguments, handed to ``handler`` unchanged.
            handler: runs the tool (the inner capabilities' hooks, then the tool).

        Returns:
            The first run's result, or the recorded one replayed.

        Raises:
            ToolFailed: twiceshy's honest answer (``OutcomeUnknown``, ``InProgress``, a refused
                key), or the tool's own certain failure, replayed.
            EffectNotDeclared, MissingScope: before anything runs; they end the run.
        """
        guard = self._guard_for(ctx, tool_def)
        arguments = _arguments(call, tool_def)
        scope = self._scope_for(ctx, guard) if guard.recorded else None

        async def work() -> Any:
            try:
                return await handler(args)
            except ToolFailedError as exc:
                raise ToolFailed(str(exc)) from exc
            except Exception as exc:
                if _nothing_happened(exc):
                    raise _NothingHappened(exc) from exc
                raise

        signal: Exception
        try:
            return await guard.acall(arguments, work, scope=scope)
        except _NothingHappened as exc:
            signal = exc.signal
        except ToolFailed as exc:
            # The tool's own failure goes on as Pydantic AI made it; a replay as rebuilt.
            signal = exc.__cause__ if isinstance(exc.__cause__, ToolFailedError) else exc
        except _ANSWERED as exc:
            raise ToolFailed(str(exc)) from exc
        # Raised outside the handler above, so the signal keeps its own context.
        raise _for_call(signal, call)

    # -- shared, no I/O --------------------------------------------------------------------

    def _guard_for(self, ctx: RunContext[AgentDepsT], tool_def: ToolDefinition) -> Guard:
        """The guard of the called tool: by name, else by its metadata, else the default."""
        name = tool_def.name
        effect = self._effects.get(name)
        if effect is None:
            guard = self.guards.get(name)
            if guard is not None:  # the application's own guard, with its own returns=
                return guard
            effect = _declared(tool_def) or self.default
        if effect is None:
            raise EffectNotDeclared(
                f"the tool {name!r} has no declared effect class: add it to TwiceshyCapability's "
                f"effects ({{{name!r}: twiceshy.SAFE | KEYED | UNSAFE}}), set metadata="
                f"{{{METADATA_KEY!r}: 'keyed'}} on the tool, or give default=; it did not run"
            )
        function = _tool_function(ctx, name)
        if function is None:  # not a Python function tool (MCP, external): replays as JSON
            return self.guards.get(name) or _guard(self.ledger, name, effect)
        try:
            typed = self._typed.setdefault(function, {})
        except TypeError:  # a callable that takes no weak reference: not kept
            return _guard(self.ledger, name, effect, function)
        guard = typed.get((name, effect))
        if guard is None:
            guard = typed[name, effect] = _guard(self.ledger, name, effect, function)
        return guard

    def _scope_for(self, ctx: RunContext[AgentDepsT], guard: Guard) -> str:
        """The call's scope: ``scope(ctx)``, else ``twiceshy.run(...)``, else the run id."""
        if self.scope is not None:
            scope = self.scope(ctx)
            where = "the scope= function returned no scope"
        else:
            scope = current_scope() or run_scope(ctx)
            where = "the run has no run_id: pass agent.run(..., run_id=...)"
        if not isinstance(scope, str) or not scope:
            raise MissingScope(
                f"the tool {guard.name!r} cannot be protected: {where}; it did not run"
            )
        return scope


def _guard(
    ledger: Ledger, name: str, effect: Effect, function: Callable[..., Any] | None = None
) -> Guard:
    """A guard with the adapter's defaults: ``ToolFailed`` is a certain failure, and results
    replay as ``function``'s return annotation (read when first needed)."""
    returns = ReturnOf(function) if function is not None else None
    return ledger.guard(name, effect=effect, definite=(ToolFailed,), returns=returns)


def _tool_function(ctx: RunContext[Any], name: str) -> Callable[..., Any] | None:
    """The Python function behind the called tool, or ``None`` when it is not a function tool.

    Combining toolsets keep the tool they were given as ``source_tool``; renaming and prefixing
    ones keep its ``call_func``, the bound ``call`` of the function's schema.
    """
    manager = ctx.tool_manager
    tool: object = manager.tools.get(name) if manager is not None and manager.tools else None
    while tool is not None and not isinstance(tool, FunctionToolsetTool):
        tool = getattr(tool, "source_tool", None)
    if tool is None:
        return None
    function = getattr(getattr(tool.call_func, "__self__", None), "function", None)
    return function if callable(function) else None


def _for_call(signal: Exception, call: ToolCallPart) -> Exception:
    """The signal, answering ``call``: a duplicate that joined the first call's run gets that
    call's failure or retry request under its own tool-call id (a provider refuses a request in
    which a call has no result of its own)."""
    part: ToolReturnPart | None = None
    if isinstance(signal, ToolFailedError):
        part = signal.tool_failed
    elif isinstance(signal, ToolRetryError) and isinstance(signal.tool_retry, ToolReturnPart):
        part = signal.tool_retry
    if part is None or part.tool_call_id == call.tool_call_id:
        return signal
    own = dataclasses.replace(part, tool_call_id=call.tool_call_id)
    answer = ToolFailedError(own) if isinstance(signal, ToolFailedError) else ToolRetryError(own)
    answer.__cause__ = signal.__cause__
    return answer


def _declared(tool_def: ToolDefinition) -> Effect | None:
    """The effect class the tool's metadata declares, or ``None``.

    Raises:
        EffectNotDeclared: the metadata names something that is not an effect class.
    """
    value = (tool_def.metadata or {}).get(METADATA_KEY)
    if value is None or isinstance(value, Effect):
        return value
    if isinstance(value, str):
        try:
            return Effect(value.lower())
        except ValueError:
            pass
    raise EffectNotDeclared(
        f"the tool {tool_def.name!r} has metadata {{{METADATA_KEY!r}: {value!r}}}, which names no "
        "effect class: use 'safe', 'keyed' or 'unsafe' (or twiceshy.SAFE, KEYED, UNSAFE)"
    )


def _arguments(call: ToolCallPart, tool_def: ToolDefinition) -> dict[str, Any]:
    """The call's arguments as the model sent them, with the schema's top-level defaults.

    An omitted parameter and its default spelled out are one intent. The defaults are read from
    the JSON schema the model was shown, so they are JSON like the arguments themselves.
    """
    arguments = dict(call.args_as_dict())
    properties = tool_def.parameters_json_schema.get("properties")
    if isinstance(properties, dict):
        for name, spec in properties.items():
            if name not in arguments and isinstance(spec, dict) and "default" in spec:
                arguments[name] = spec["default"]
    return arguments


def _nothing_happened(error: Exception) -> bool:
    """Whether a Pydantic AI signal from the tool's run means that nothing took effect.

    A deferral or a skip (the tool was not run), or a ``ModelRetry`` raised outside any ``except``
    block: a refusal ("no such customer"). A ``ModelRetry`` raised while handling another error -
    Pydantic AI's own ``timeout=`` raises one from the ``TimeoutError`` - may follow an effect.
    A ``ModelRetry`` from the tool reaches here as a ``ToolRetryError`` (or, past the tool's retry
    budget, an ``UnexpectedModelBehavior``) caused by it.
    """
    if isinstance(error, _NOT_RUN):
        return True
    retry: BaseException | None = error
    if isinstance(error, ToolRetryError | UnexpectedModelBehavior):
        retry = error.__cause__
    return isinstance(retry, ModelRetry) and retry.__context__ is None and retry.__cause__ is None
