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

- The intent is (scope, tool name, arguments): the arguments the tool function receives, by
  parameter name - Pydantic AI's validated arguments, bound to the function's signature with its
  defaults (``"2"`` coerced to ``2``, an omitted optional argument and its default sent, an enum
  or a nested model given by its fields: one intent each). What Pydantic AI injects
  (``RunContext``) is no part of them, nor the tool-call id, which changes every time the model
  calls again. A tool with no Python function behind it (an MCP toolset, an external tool) is
  keyed by the JSON the model sent, with the schema's defaults.
- The scope is, in this order: ``scope(ctx)`` when the capability has a ``scope=`` function;
  else ``twiceshy.current_scope()``, that is a ``twiceshy.run(...)`` around the run, or - for a
  run started inside a protected tool (a sub-agent a tool delegates to) - the scope that tool's
  call passes on, derived from its key, so every retry of the outer call names the same inner
  intents; else the run's ``RunContext.run_id`` (``agent.run(..., run_id=...)``; without one
  Pydantic AI draws a fresh UUID7 per run, so pass a stable id for retries across processes).
- The effect class comes from the ``effects`` mapping, else from the tool's metadata
  (``metadata={"twiceshy": "keyed"}``), else from ``default=``; a tool with none raises
  :class:`EffectNotDeclared` before it runs and ends the run. A KEYED or UNSAFE tool whose
  return annotation has no JSON form raises :class:`twiceshy.ResultNotStorable` on its first
  call, before it runs, and ends the run.
- What twiceshy must word itself reaches the model as ``ToolFailed`` (a failed tool result that
  asks for no retry and uses none of the tool's retry budget; never ``ModelRetry``): an unknown
  outcome, a call in progress, a refused key, a result that ran but could not be kept, and a
  KEYED tool whose attempts ran out (it may have taken effect; calling again later is safe).
  Reasons name the tool's own error (``TimeoutError``), never Pydantic AI's wrappers.
- Results: the model reads the stored form on the first call as on every replay (the guards
  answer with their stored results), rebuilt as the tool function's return annotation; a
  ``ToolReturn`` and multimodal parts (``BinaryContent``, ``ImageUrl``...) are rebuilt as
  Pydantic AI's own types. A :class:`twiceshy.Guard` given in ``effects`` keeps its own
  ``returns=``.
- How the ledger reads what the tool did: a result is recorded and replayed; ``ToolFailed`` is a
  certain failure, recorded and replayed; a deferral (``CallDeferred``, ``ApprovalRequired``,
  ``SkipToolExecution``) and a ``ModelRetry`` raised outside any ``except`` block (a refusal:
  "no such customer") mean nothing took effect, and the call may run again, as does any error
  raised before the tool calls ``twiceshy.point_of_no_return()``; anything else - an exception,
  Pydantic AI's own ``timeout=`` (which it turns into a retry request), a ``ModelRetry`` raised
  while handling an error - may have taken effect: a KEYED tool is run again with the same key,
  an UNSAFE one is not run again.
- A KEYED or UNSAFE tool whose function is a generator is refused with ``TypeError`` before
  anything runs: when the agent is built, at the start of a run (a tool added with
  ``@agent.tool`` later), and at its call (a toolset given to one run).
- Never in a durable engine's workflow code. Pydantic AI's durable agents - the
  ``DBOSDurability``, ``PrefectDurability`` and ``TemporalDurability`` capabilities, and the
  deprecated ``DBOSAgent``, ``PrefectAgent`` and ``TemporalAgent`` wrappers - run
  ``wrap_tool_execute`` in the workflow's (or flow's) own code, outside the unit that runs the
  tool: :class:`DurableAgentRefused` is raised before anything runs, when the agent is built or
  wrapped, when the capability is given to one of its runs, and when such a run starts. A KEYED
  or UNSAFE tool called in a DBOS workflow's, Prefect flow's or Temporal workflow's own code by
  any other agent is refused too, unless its function protects itself
  (``twiceshy.integrations.dbos.step``, ``prefect.protect``, ``temporal.protect``): that one runs
  as it is, its own protection answering, and so does a SAFE tool; the ledger is not asked.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pydantic

try:
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
    from pydantic_ai.messages import (
        MULTI_MODAL_CONTENT_TYPES,
        CachePoint,
        RetryPromptPart,
        TextContent,
        ToolCallPart,
        ToolReturn,
        ToolReturnPart,
        UserContent,
    )
    from pydantic_ai.tools import AgentDepsT, RunContext, ToolDefinition
    from pydantic_ai.toolsets.function import FunctionToolset, FunctionToolsetTool
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.pydantic_ai needs Pydantic AI 2.16 or later: "
        f"pip install 'twiceshy[pydantic-ai]' ({exc})"
    ) from exc
try:  # pydantic-ai-slim 2.62 added it; before, no tool result holds such a part
    from pydantic_ai.messages import StructuredContent

    _STRUCTURED: tuple[type, ...] = (StructuredContent,)
except ImportError:  # pragma: no cover - run by .ci/frameworks.sh on the oldest release
    _STRUCTURED = ()
# Durable agents as capabilities (DBOSDurability, PrefectDurability, TemporalDurability): their
# base class, which Pydantic AI 2.16 has but does not export from pydantic_ai.durable_exec yet.
try:
    from pydantic_ai.durable_exec import BaseDurabilityCapability

    _DURABILITY: type | None = BaseDurabilityCapability
except ImportError:  # pragma: no cover - run by .ci/frameworks.sh on the oldest release
    try:
        from pydantic_ai.durable_exec._base import BaseDurabilityCapability as _Base

        _DURABILITY = _Base
    except ImportError:
        _DURABILITY = None

from twiceshy import (
    SAFE,
    Effect,
    Guard,
    Ledger,
    MissingScope,
    NotApplied,
    TwiceshyError,
    current_scope,
    errors,
)
from twiceshy.integrations._calls import (
    ArgumentsDoNotFit,
    effect_at_of,
    for_the_model,
    received,
    with_schema_defaults,
)
from twiceshy.integrations._core import ReturnOf, refuse_generator

__all__ = [
    "METADATA_KEY",
    "DurableAgentRefused",
    "EffectNotDeclared",
    "ScopeFunction",
    "TwiceshyCapability",
    "run_scope",
]

METADATA_KEY = "twiceshy"
"""The key of ``ToolDefinition.metadata`` that may carry a tool's effect class."""

ScopeFunction = Callable[[RunContext[AgentDepsT]], "str | None"]
"""``scope(ctx)``: the run's scope for one tool call, or ``None`` when it has none."""

# Pydantic AI's signals that the tool was not run (yet): another capability deferred or skipped it.
_NOT_RUN = (CallDeferred, ApprovalRequired, SkipToolExecution)


class EffectNotDeclared(errors.EffectNotDeclared, UserError):
    """A tool without a declared effect class was called; it did not run:
    :class:`twiceshy.EffectNotDeclared` as a Pydantic AI ``UserError``.

    Raised before the tool runs, when neither ``effects``, the tool's metadata nor ``default=``
    names its class: there is no silent default. A Pydantic AI ``UserError``: it ends the run.
    """


class DurableAgentRefused(TwiceshyError, UserError):
    """TwiceshyCapability was given an agent whose tool calls a durable engine runs; nothing ran.

    Pydantic AI's durable agents (the ``DBOSDurability``, ``PrefectDurability`` and
    ``TemporalDurability`` capabilities, and the deprecated ``DBOSAgent``, ``PrefectAgent`` and
    ``TemporalAgent`` wrappers) run ``wrap_tool_execute`` in the workflow's (or flow's) own code,
    never in the step, task or activity of a tool: there the ledger would be asked again on every
    replay or recovery, and the engine's retries of the tool would never reach it. Protect
    the tool function instead, inside its unit (``twiceshy.integrations.dbos.step``,
    ``prefect.protect``, ``temporal.protect``). Also raised for a tool of any other agent called in
    a workflow's own code whose function twiceshy does not protect. A Pydantic AI ``UserError``: it
    ends the run, and fails a Temporal workflow (Pydantic AI's plugin) rather than its task.
    """


class _NothingHappened(NotApplied):
    """Carries a Pydantic AI signal that means "nothing took effect" through the ledger."""

    def __init__(self, signal: Exception) -> None:
        cause = signal.__cause__ if isinstance(signal, ToolRetryError) else signal
        super().__init__(f"the tool did not take effect ({type(cause).__name__})")
        self.signal = signal


class _Wrapped(Exception):
    """Carries a retry request Pydantic AI made from the tool's own error (its ``timeout=``, a
    ``ModelRetry`` raised while handling an error) through the ledger. Its ``__cause__`` is that
    error, which the reasons the model reads name (a guard's ``wrappers``)."""

    def __init__(self, signal: Exception) -> None:
        super().__init__("the tool's error, as a retry request")
        self.signal = signal


# Pydantic AI's exception types around the tool's own error, and the adapter's own.
_WRAPPERS: tuple[type[BaseException], ...] = (_Wrapped, ToolRetryError, UnexpectedModelBehavior)


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
            ``key_args=``, ``reconcile=``...; it keeps its own ledger, ``returns=`` and
            ``effect_at=``; ``ToolFailed`` is added to its ``definite=`` types, and it answers
            with stored results, as the capability's own guards do). Wins over the tool's
            metadata.
        default: the effect class of tools neither in ``effects`` nor carrying one in their
            metadata (``metadata={"twiceshy": "keyed"}``). Without it, calling such a tool raises
            :class:`EffectNotDeclared`.
        scope: ``scope(ctx)`` gives the run's scope instead of ``twiceshy.current_scope()`` (an
            enclosing ``twiceshy.run(...)``, or the scope an enclosing protected tool passes on
            to the runs it starts) and the run's ``run_id``; ``None`` from it means the call has
            no scope.

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
                # A ToolFailed is a certain failure, to be replayed.
                definite = () if _is_definite(effect) else (ToolFailed,)
                guards[name] = _answering(effect.with_errors(definite=definite))
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

    @property
    def _durable_unsupported_reason(self) -> str | None:  # type: ignore[override]
        """Refuse to be wrapped by ``DBOSAgent``, ``PrefectAgent`` or ``TemporalAgent``.

        Pydantic AI's deprecated wrappers read this of every capability of the agent they wrap,
        and refuse the agent when it names a reason (2.78 does; 2.16 reads nothing, and the run
        refuses instead, in :meth:`for_run`). The answer here is the refusal itself, raised
        with twiceshy's words, so the error names what to do.

        Raises:
            DurableAgentRefused: always.
        """
        raise DurableAgentRefused(
            "TwiceshyCapability cannot protect the tools of an agent wrapped by DBOSAgent, "
            "PrefectAgent or TemporalAgent: the wrapper runs wrap_tool_execute, where the "
            "capability sits, in the workflow's (or flow's) own code, never in a step, task or "
            "activity, so the ledger would be asked again on every replay or recovery and the "
            "engine's retries of the tool would never reach it. Leave "
            "TwiceshyCapability out and protect each tool function: under DBOSAgent, "
            f"{_DURABLE_PLACEMENT['DBOS']}; under PrefectAgent, {_DURABLE_PLACEMENT['Prefect']}; "
            f"under TemporalAgent, {_DURABLE_PLACEMENT['Temporal']} (see twiceshy's "
            "docs/durable_engines.md); nothing ran"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse to be pickled: the capability holds a live ledger.

        An engine pickles what it carries into a workflow (DBOS records ``DBOSAgent.run``'s
        arguments, ``capabilities=`` among them, as the workflow's inputs); the capability would
        then run in the workflow's own code, where it must not.

        Raises:
            DurableAgentRefused: always.
        """
        raise DurableAgentRefused(
            "TwiceshyCapability cannot be pickled: it holds a live twiceshy.Ledger. An engine that "
            "pickles it carries it into a workflow's own code (DBOS records the arguments of "
            "DBOSAgent.run, capabilities= among them, as the workflow's inputs), where it cannot "
            "protect a tool: leave it out of a durable agent's runs and protect each tool "
            "function inside the unit that runs it (twiceshy.integrations.dbos.step, "
            "prefect.protect, temporal.protect; see twiceshy's docs/durable_engines.md); nothing "
            "ran"
        )

    def __copy__(self) -> TwiceshyCapability[AgentDepsT]:
        """A shallow copy, sharing the ledger and the guards (pickling is refused)."""
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def for_agent(self, agent: Any) -> AbstractCapability[AgentDepsT]:
        """Refuse an agent made durable (``DBOSDurability``, ``PrefectDurability``,
        ``TemporalDurability``), when it is built or when the capability is given to a run:
        there the tool function is protected instead. Refuse a recorded tool whose function is a
        generator among the agent's tools.

        Raises:
            DurableAgentRefused: the agent carries a durability capability.
            TypeError: a KEYED or UNSAFE tool of the agent is a generator function.
        """
        _refuse_durable(getattr(agent, "root_capability", None))
        self._refuse_generators(agent)
        return self

    async def for_run(self, ctx: RunContext[AgentDepsT]) -> AbstractCapability[AgentDepsT]:
        """Refuse, before anything runs, a run that a durable wrapper (``DBOSAgent``,
        ``PrefectAgent``, ``TemporalAgent``) makes in its workflow, and a recorded generator
        tool added since the agent was built.

        A wrapper is refused when it is made only on releases that ask each capability then, and
        a capability given to one run, or made per run, is never seen there: the run's model
        (the engine's ``DBOSModel``, ``PrefectModel``, ``TemporalModel``) tells it apart.

        Raises:
            DurableAgentRefused: the run is a durable wrapper's, in its workflow's own code.
            TypeError: a KEYED or UNSAFE tool of the agent is a generator function.
        """
        engine = _workflow_code()
        if engine is not None and _durable_engine_of(ctx.model) is not None:
            wrapper = f"{engine}Agent" if engine in _DURABLE_PLACEMENT else "a durable wrapper"
            raise DurableAgentRefused(
                f"TwiceshyCapability cannot protect the tools of an agent run by {wrapper}, in "
                f"the {_CONTAINER.get(engine, 'workflow')}'s own code: wrap_tool_execute runs "
                f"there, never in {_a(_UNIT.get(engine, 'durable unit'))}, so the ledger would be "
                "asked again on every replay or recovery and the engine's retries of the tool "
                "would never reach it. Leave TwiceshyCapability out of the "
                f"agent and of its runs, and {_advice(engine)} (see twiceshy's "
                "docs/durable_engines.md); nothing ran"
            )
        self._refuse_generators(ctx.agent)
        return self

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
            ToolFailed: twiceshy's words for the model (an unknown outcome, a call in progress,
                a refused key, a result not kept, a KEYED tool out of attempts), or the tool's
                own certain failure, replayed.
            EffectNotDeclared, MissingScope, ResultNotStorable: before anything runs; they end
                the run.
            TypeError: a KEYED or UNSAFE tool's function is a generator; it did not run.
            DurableAgentRefused: a KEYED or UNSAFE tool was called in a durable engine's
                workflow code, and twiceshy does not protect its function; it did not run.
        """
        schema = _tool_schema(ctx, tool_def.name)
        function = _function_of(schema)
        if function is not None and self._records(tool_def.name, tool_def.metadata):
            refuse_generator(function, tool_def.name)  # before its annotation is read
        guard = self._guard_for(tool_def, schema)
        engine = _workflow_code()
        if engine is not None:
            # In workflow code the ledger is never asked: a tool whose function protects itself
            # answers inside its unit, a SAFE one has nothing to keep; any other is refused.
            if guard.recorded and not _protects_itself(function):
                raise DurableAgentRefused(
                    f"the tool {tool_def.name!r} was called in {engine} "
                    f"{_CONTAINER.get(engine, 'workflow')} code, where TwiceshyCapability must "
                    "not ask the ledger (a replay or recovery would ask it again, and the "
                    "engine's retries of the tool would never reach it), and twiceshy does not "
                    f"protect its function: {_advice(engine)} (see twiceshy's "
                    "docs/durable_engines.md); it did not run"
                )
            return await handler(args)
        arguments = _arguments(ctx, call, tool_def, args, schema)
        # A SAFE tool kept out of the ledger needs no scope; where there is one, it names the
        # scope of the runs started inside the tool (a delegation declared SAFE).
        scope = self._scope_for(ctx, guard, required=guard.recorded)

        async def work() -> Any:
            try:
                return await handler(args)
            except ToolFailedError as exc:
                raise ToolFailed(str(exc)) from exc
            except Exception as exc:
                if _nothing_happened(exc):
                    raise _NothingHappened(exc) from exc
                own = _own_error(exc)
                if own is not None:
                    raise _Wrapped(exc) from own
                raise

        signal: Exception
        try:
            value = await guard.acall(arguments, work, scope=scope)
        except _NothingHappened as exc:
            signal = exc.signal
        except ToolFailed as exc:
            # The tool's own failure goes on as Pydantic AI made it; a replay as rebuilt.
            signal = exc.__cause__ if isinstance(exc.__cause__, ToolFailedError) else exc
        except Exception as exc:
            text = for_the_model(guard, exc, arguments, scope=scope)
            if text is not None:
                raise ToolFailed(text) from exc
            if not isinstance(exc, _Wrapped):
                raise
            signal = exc.signal  # e.g. a SAFE tool's timeout: Pydantic AI's own retry request
        else:
            return _live(value) if guard.recorded else value
        # Raised outside the handler above, so the signal keeps its own context.
        raise _for_call(signal, call)

    # -- shared, no I/O --------------------------------------------------------------------

    def _guard_for(self, tool_def: ToolDefinition, schema: Any) -> Guard:
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
        function = _function_of(schema)
        if function is None:  # not a Python function tool (MCP, external): replays as JSON
            return self.guards.get(name) or _guard(self.ledger, name, effect)
        try:
            typed = self._typed.setdefault(function, {})
        except TypeError:  # a callable that takes no weak reference: not kept
            return _guard(self.ledger, name, effect, function)
        guard = typed.get((name, effect))
        if guard is None:
            # Made on the tool's first call, before it runs: a return annotation the ledger
            # cannot keep raises ResultNotStorable here, and the run ends with nothing run.
            guard = typed[name, effect] = _guard(self.ledger, name, effect, function)
        return guard

    def _records(self, name: str, metadata: Mapping[str, Any] | None) -> bool:
        """Whether calls of the tool ``name`` are recorded, as far as its declaration says
        before any call (a class its metadata cannot name is left to the call to refuse)."""
        effect = self._effects.get(name)
        if effect is None:
            guard = self.guards.get(name)
            if guard is not None:
                return guard.recorded
            value = (metadata or {}).get(METADATA_KEY)
            if isinstance(value, Effect):
                effect = value
            elif isinstance(value, str) and value.lower() in {e.value for e in Effect}:
                effect = Effect(value.lower())
            else:
                effect = self.default
        return effect is not None and effect is not SAFE

    def _refuse_generators(self, agent: object) -> None:
        """Refuse a recorded tool whose function is a generator among the agent's function
        tools (a toolset that renames its tools is left to the call, which sees the name).

        Raises:
            TypeError: one is.
        """
        for toolset in getattr(agent, "toolsets", None) or ():
            if not isinstance(toolset, FunctionToolset):
                continue
            for name, tool in toolset.tools.items():
                function = getattr(tool, "function", None)
                if callable(function) and self._records(name, tool.metadata):
                    refuse_generator(function, name)

    def _scope_for(
        self, ctx: RunContext[AgentDepsT], guard: Guard, *, required: bool = True
    ) -> str | None:
        """The call's scope: ``scope(ctx)``, else ``twiceshy.current_scope()`` (an enclosing
        ``twiceshy.run(...)``, or the scope an enclosing protected call passes on to the runs
        started inside it: a sub-agent's), else the run id, which a nested run draws afresh.
        Without one: ``MissingScope``, or ``None`` when not ``required``."""
        if self.scope is not None:
            scope = self.scope(ctx)
            where = "the scope= function returned no scope"
        else:
            scope = current_scope() or run_scope(ctx)
            where = "the run has no run_id: pass agent.run(..., run_id=...)"
        if not isinstance(scope, str) or not scope:
            if not required:
                return None
            raise MissingScope(
                f"the tool {guard.name!r} cannot be protected: {where}; it did not run"
            )
        return scope


# Where the tool function runs under each engine, and how to protect it there.
_DURABLE_PLACEMENT = {
    "DBOS": "make the tool function a twiceshy step: @twiceshy.integrations.dbos.step(ledger, "
    "effect=...) under the tool decorator",
    "Prefect": "protect the tool function inside the task that runs it: "
    "@twiceshy.integrations.prefect.protect(ledger, effect=...) under the tool decorator "
    "(PrefectDurability runs each tool call in a task)",
    "Temporal": "protect the tool function inside the activity that runs it: "
    "@twiceshy.integrations.temporal.protect(ledger, effect=...) under the tool decorator "
    "(TemporalDurability runs each tool call in an activity), with "
    "twiceshy.integrations.temporal.TwiceshyInterceptor() on the worker",
}
# The engines' words for their workflows and for the units that run a tool.
_CONTAINER = {"DBOS": "workflow", "Prefect": "flow", "Temporal": "workflow"}
_UNIT = {"DBOS": "step", "Prefect": "task", "Temporal": "activity"}
# Pydantic AI's durable models by the package they come from (pydantic_ai.durable_exec.dbos...).
_ENGINES = {"dbos": "DBOS", "prefect": "Prefect", "temporal": "Temporal", "hatchet": "Hatchet"}


def _a(noun: str) -> str:
    """``noun`` with its indefinite article."""
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _advice(engine: str) -> str:
    """How to protect a tool under ``engine``."""
    return _DURABLE_PLACEMENT.get(
        engine, "protect the tool function itself, inside the unit that runs it"
    )


def _workflow_code() -> str | None:
    """The durable engine whose workflow (or flow) code is running - not one of its units - or
    ``None``: a DBOS workflow outside its steps, a Prefect flow outside its tasks, a Temporal
    workflow. Read without importing the engines: only a process that imported one can be in
    its workflow."""
    temporal = sys.modules.get("temporalio.workflow")
    in_workflow = getattr(temporal, "in_workflow", None)
    if callable(in_workflow) and in_workflow():
        return "Temporal"
    dbos = getattr(sys.modules.get("dbos"), "DBOS", None)
    if dbos is not None and dbos.workflow_id is not None and dbos.step_id is None:
        return "DBOS"
    prefect = sys.modules.get("prefect.context")
    if (
        prefect is not None
        and prefect.FlowRunContext.get() is not None
        and prefect.TaskRunContext.get() is None
    ):
        return "Prefect"
    return None


def _durable_engine_of(model: object) -> str | None:
    """The engine of the durable model a run goes through (``DBOSModel``, ``PrefectModel``,
    ``TemporalModel``: what Pydantic AI's durable agents run with), or ``None``; wrapping
    models (instrumentation, fallbacks) are looked through."""
    for _ in range(16):  # a chain of wrapping models is short; a cycle must not hang the run
        if model is None:
            return None
        module = type(model).__module__.split(".")
        if module[:2] == ["pydantic_ai", "durable_exec"] and len(module) > 2:
            return _ENGINES.get(module[2], module[2])
        model = getattr(model, "wrapped", None)
    return None


def _protects_itself(function: Callable[..., Any] | None) -> bool:
    """Whether twiceshy protects the tool function itself (``ledger.tool`` and the engine
    adapters built on it mark what they return with its guard; a Prefect task keeps it)."""
    for _ in range(16):  # decorators stack a few levels deep at most
        if function is None:
            return False
        if isinstance(getattr(function, "twiceshy", None), Guard):
            return True
        function = getattr(function, "__wrapped__", None) or getattr(function, "fn", None)
    return False


def _refuse_durable(root: object) -> None:
    """Refuse to protect the tools of a durable agent.

    A durability capability runs the agent in an engine's workflow (or flow) and each tool call
    in a durable unit (a step, a task, an activity). ``wrap_tool_execute`` is never durable: it
    runs in the workflow's own code, around the unit. There the ledger would be asked on every
    deterministic replay (a replayed answer then skips a checkpointed unit, which DBOS and
    Temporal refuse), and the engine's own retries of the unit would never reach it.

    Raises:
        DurableAgentRefused: ``root`` (a capability tree) holds a durability capability; the
            message says where to protect the tool instead.
    """
    if _DURABILITY is None or not isinstance(root, AbstractCapability):
        return
    found: list[AbstractCapability[Any]] = []
    root.apply(found.append)
    for capability in found:
        if not isinstance(capability, _DURABILITY):
            continue
        # Named by its engine's spec; before there was one (2.16), by the class itself.
        named = getattr(type(capability), "engine_spec", None) or type(capability)
        engine = getattr(named, "engine_name", None) or type(capability).__name__
        container = _CONTAINER.get(engine, "workflow")
        unit = _UNIT.get(engine, "durable unit")
        raise DurableAgentRefused(
            f"TwiceshyCapability cannot protect the tools of an agent made durable with "
            f"{type(capability).__name__}: under {engine}, wrap_tool_execute runs in the "
            f"{container}'s own code, never in {_a(unit)}, so the ledger would be asked again "
            f"on every replay and {engine}'s retries of {_a(unit)} would never reach it. Leave "
            f"TwiceshyCapability out and {_advice(engine)} (see twiceshy's "
            "docs/durable_engines.md)"
        )


def _guard(
    ledger: Ledger, name: str, effect: Effect, function: Callable[..., Any] | None = None
) -> Guard:
    """A guard with the adapter's defaults: ``ToolFailed`` is a certain failure, results
    replay as ``function``'s return annotation (read when first needed), and an error raised
    before the function calls ``twiceshy.point_of_no_return()`` means nothing happened.

    Raises:
        ResultNotStorable: a recorded tool's return annotation has no JSON form.
    """
    # A SAFE tool's results are not kept: whatever it returns is fine.
    returns = ReturnOf(function) if function is not None and effect is not SAFE else None
    effect_at = effect_at_of(function)
    guard = ledger.guard(
        name, effect=effect, definite=(ToolFailed,), returns=returns, effect_at=effect_at
    )
    return _answering(guard)


def _answering(guard: Guard) -> Guard:
    """``guard``, answering as the model should read it: reasons name the tool's own error,
    never Pydantic AI's wrappers, and the first caller gets the result as stored, as every
    replay does, so the model reads the same text each time."""
    return guard.with_errors(wrappers=_WRAPPERS).with_stored_answers()


def _is_definite(guard: Guard) -> bool:
    """Whether ``guard`` already reads a ``ToolFailed`` as a certain failure."""
    return any(issubclass(ToolFailed, kind) for kind in guard.policy.definite)


def _tool_schema(ctx: RunContext[Any], name: str) -> Any:
    """The function schema of the called tool (Pydantic AI's ``FunctionSchema``: the function,
    and how its validated arguments are passed), or ``None`` when it is not a function tool.

    Combining toolsets keep the tool they were given as ``source_tool``; renaming and prefixing
    ones keep its ``call_func``, the bound ``call`` of the function's schema.
    """
    manager = ctx.tool_manager
    tool: object = manager.tools.get(name) if manager is not None and manager.tools else None
    while tool is not None and not isinstance(tool, FunctionToolsetTool):
        tool = getattr(tool, "source_tool", None)
    if tool is None:
        return None
    schema = getattr(tool.call_func, "__self__", None)
    return schema if callable(getattr(schema, "function", None)) else None


def _function_of(schema: Any) -> Callable[..., Any] | None:
    """The Python function behind a tool's schema, if any."""
    function = getattr(schema, "function", None)
    return function if callable(function) else None


def _arguments(
    ctx: RunContext[Any],
    call: ToolCallPart,
    tool_def: ToolDefinition,
    args: ValidatedToolArgs,
    schema: Any,
) -> dict[str, Any]:
    """The call's arguments as the tool function receives them, by parameter name.

    Bound as Pydantic AI passes them (``FunctionSchema._call_args``): the context first where
    the function takes one (left out of the intent), then its positional fields and ``*args``,
    the rest by name. A tool with no function, or arguments that do not bind (nothing Pydantic
    AI would pass), are keyed by the model's JSON with the schema's defaults instead: never left
    unprotected.
    """
    function = _function_of(schema)
    if function is not None and isinstance(args, dict):
        try:
            named = dict(args)
            takes_ctx = bool(getattr(schema, "takes_ctx", False))
            positional: list[Any] = [ctx] if takes_ctx else []
            for name in getattr(schema, "positional_fields", None) or ():
                positional.append(named.pop(name))
            rest = getattr(schema, "var_positional_field", None)
            if rest:
                positional.extend(named.pop(rest))
            inject = (_first_parameter(function),) if takes_ctx else ()
            return received(function, positional, named, inject=inject, sent=call.args_as_dict())
        except ArgumentsDoNotFit as unfit:  # the call would never run: nothing is claimed
            raise unfit.as_raised() from None
        except (TypeError, ValueError, KeyError):
            pass
    return with_schema_defaults(call.args_as_dict(), tool_def.parameters_json_schema)


def _first_parameter(function: Callable[..., Any]) -> str:
    """The name of the function's first parameter: where Pydantic AI passes the context.

    Raises:
        ValueError: the function has no readable signature, or no parameter.
    """
    for name in inspect.signature(function).parameters:
        return name
    raise ValueError("the tool takes no context parameter")


def _own_error(error: Exception) -> BaseException | None:
    """The tool's own error inside a retry request Pydantic AI made from it, or ``None``.

    A ``ModelRetry`` raised while handling an error - Pydantic AI's ``timeout=`` raises one from
    its ``TimeoutError`` - reaches here as a ``ToolRetryError`` (or, past the tool's retry budget,
    an ``UnexpectedModelBehavior``) caused by it.
    """
    retry = error.__cause__ if isinstance(error, ToolRetryError | UnexpectedModelBehavior) else None
    if not isinstance(retry, ModelRetry):
        return None
    own = retry.__cause__ or retry.__context__
    if isinstance(own, TimeoutError) and not str(own):
        # The bare TimeoutError of the timeout's cancel scope: said with Pydantic AI's words.
        timed_out = TimeoutError(retry.message)
        timed_out.__cause__ = own
        return timed_out
    return own


def _for_call(signal: Exception, call: ToolCallPart) -> Exception:
    """The signal, answering ``call``: a duplicate that joined the first call's run gets that
    call's failure or retry request under its own tool-call id (a provider refuses a request in
    which a call has no result of its own)."""
    answer: Exception
    if isinstance(signal, ToolFailedError):
        failed = signal.tool_failed
        if failed.tool_call_id == call.tool_call_id:
            return signal
        answer = ToolFailedError(dataclasses.replace(failed, tool_call_id=call.tool_call_id))
    # Before Pydantic AI 2.60 a retry request travels as a RetryPromptPart.
    elif isinstance(signal, ToolRetryError) and isinstance(
        signal.tool_retry, ToolReturnPart | RetryPromptPart
    ):
        retry = signal.tool_retry
        if retry.tool_call_id == call.tool_call_id:
            return signal
        answer = ToolRetryError(dataclasses.replace(retry, tool_call_id=call.tool_call_id))
    else:
        return signal
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


# -- results as Pydantic AI reads them -----------------------------------------------------

# Pydantic AI's content parts by their ``kind``: stored as JSON objects, rebuilt on the way out.
_PART_KINDS = frozenset(
    str(kind)
    for kind in (
        getattr(part, "kind", None)
        for part in (*MULTI_MODAL_CONTENT_TYPES, TextContent, *_STRUCTURED, CachePoint)
    )
    if isinstance(kind, str)
)
_TOOL_RETURN_FIELDS = frozenset(f.name for f in dataclasses.fields(ToolReturn))


@functools.cache
def _parts() -> pydantic.TypeAdapter[Any]:
    """Validates one content part from its JSON text; bytes as base64, as the ledger keeps them."""
    return pydantic.TypeAdapter(UserContent, config=pydantic.ConfigDict(val_json_bytes="base64"))


def _live(value: Any) -> Any:
    """A result as it came from the ledger, with what Pydantic AI reads by type rebuilt: a
    ``ToolReturn`` (its ``content`` goes to the model apart from the result, its ``metadata``
    not at all) and content parts (``BinaryContent``, ``ImageUrl``..., which the model sees as
    files, not as JSON). Anything else is left as it is."""
    if isinstance(value, ToolReturn):
        result, content = _live(value.return_value), _live(value.content)
        if result is value.return_value and content is value.content:
            return value
        return dataclasses.replace(value, return_value=result, content=content)
    if isinstance(value, list):
        items = [_live(item) for item in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if not isinstance(value, dict):
        return value
    kind = value.get("kind")
    if kind == "tool-return" and "return_value" in value and value.keys() <= _TOOL_RETURN_FIELDS:
        # Only the fields this release's ToolReturn has (``tools`` is newer than 2.16).
        given: dict[str, Any] = {
            name: value.get(name) for name in ("metadata", "tools") if name in _TOOL_RETURN_FIELDS
        }
        return ToolReturn(
            return_value=_live(value["return_value"]),
            content=_live(value.get("content")),
            **given,
        )
    if isinstance(kind, str) and kind in _PART_KINDS:
        # The ledger keeps a dataclass by its fields; Pydantic AI names the private ones
        # (``_identifier``, ``_media_type``) by their aliases.
        fields = {name.removeprefix("_"): item for name, item in value.items()}
        try:
            return _parts().validate_json(json.dumps(fields))
        except (ValueError, TypeError):  # not one of Pydantic AI's parts after all
            return value
    entries = {name: _live(item) for name, item in value.items()}
    return entries if any(entries[name] is not item for name, item in value.items()) else value
