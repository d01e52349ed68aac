"""Google ADK agents: every call of a protected function tool through a twiceshy ledger.

One line protects an agent's tools (``from twiceshy import KEYED, SAFE, UNSAFE``)::

    agent = LlmAgent(
        name="billing",
        model=model,
        tools=protect([charge, wire, lookup], ledger, effects={"charge": KEYED, "wire": UNSAFE},
                      default=SAFE),
    )

Where it sits: inside the tool, at the call of its function, after everything ADK does first:
the before-tool callbacks of plugins and agent, the confirmation gate (``require_confirmation``,
a tool confirmation requested, granted or refused), ADK's argument preparation (pydantic models
built from their JSON, and with ADK's ``FUNCTION_TOOL_ARG_VALIDATION`` feature the values
coerced to their annotations), the check of mandatory arguments. A call any of those answers
never meets the ledger, and a gate is never passed by. The ledger's outcome is what the
function returned; what an after-tool callback makes of it is no part of it, so a callback that
answers instead of the tool cannot overwrite what the ledger knows.

How a call is handled:

- The intent is ``(scope, tool, arguments)``, the arguments being those the function receives
  from ADK, bound to its parameters by name with their defaults. The tool context and ADK's
  ``input_stream`` are no part of it, nor is the function-call id, which is new every time the
  model calls again. ADK hands the function the model's JSON values unless its
  ``FUNCTION_TOOL_ARG_VALIDATION`` feature is on: without it, ``"4900"`` sent for an ``int``
  reaches the function as text and names another intent than ``4900``.
- The scope is, in this order: ``scope(tool_context)`` when ``protect`` has a ``scope=``
  function; else ``twiceshy.current_scope()``: a ``twiceshy.run(...)`` around the run, or, for an
  agent run inside a protected tool, the scope that call passes on; else the session id,
  ``tool_context.session.id``, which a persistent session service keeps across restarts and
  which a resumed invocation keeps too.
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from .. import Effect, Guard, Ledger, MissingScope, current_scope
from ._calls import effect_at_of, for_the_model, received
from ._core import ReturnOf

__all__ = ["ScopeFunction", "protect", "protect_tool", "session_scope"]

ScopeFunction: TypeAlias = Callable[[ToolContext], "str | None"]
"""``scope(tool_context)``: the scope of one call; ``None`` from it means the call has none."""

_INJECTED = ("input_stream",)
"""Parameters ADK fills in itself, besides the tool context."""


def session_scope(tool_context: ToolContext) -> str | None:
    """The id of the session a tool is called in (``tool_context.session.id``), or ``None``."""
    session = getattr(tool_context, "session", None)
    session_id = getattr(session, "id", None)
    return session_id if isinstance(session_id, str) and session_id else None


def protect(
    tools: Iterable[FunctionTool | Callable[..., Any]],
    ledger: Ledger,
    *,
    effects: Mapping[str, Effect | Guard] | None = None,
    default: Effect | None = None,
    scope: ScopeFunction | None = None,
) -> list[FunctionTool]:
    """Copies of ``tools`` whose every function call goes through ``ledger``.

    Args:
        tools: ``FunctionTool`` objects (``LongRunningFunctionTool`` and other subclasses
            included), or plain functions (made into ``FunctionTool(fn)``, as an agent would).
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options (attempts,
            ``definite=``, ``key_args=``, ``reconcile=``...).
        default: the effect class of the tools not named in ``effects``.
        scope: ``scope(tool_context)`` gives each call's scope instead of
            ``twiceshy.current_scope()`` and the session id.

    Returns:
        The protected tools, in order, for ``LlmAgent(tools=...)``.

    Raises:
        TypeError: a tool is neither a ``FunctionTool`` nor a function, an effect is of no
            known kind, or a recorded tool's function is a generator.
        ValueError: a tool has no effect class, or ``effects`` names a tool not given.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
    if default is not None and not isinstance(default, Effect):
        raise TypeError("default= must be twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE")
    effects = dict(effects or {})
    protected: list[FunctionTool] = []
    named: set[str] = set()
    for given in tools:
        tool = _as_function_tool(given)
        declared = effects.get(tool.name, default)
        if declared is None:
            raise ValueError(
                f"the tool {tool.name!r} has no effect class: name it in effects= "
                "(twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE) or give default="
            )
        named.add(tool.name)
        if isinstance(declared, Guard):
            guard = declared
        elif isinstance(declared, Effect):
            guard = _guard_for(ledger, tool, declared)
        else:
            raise TypeError(
                f"the effect of {tool.name!r} must be an effect class or a twiceshy.Guard, not "
                f"{type(declared).__name__}"
            )
        protected.append(protect_tool(tool, guard, scope=scope))
    unknown = sorted(set(effects) - named)
    if unknown:
        raise ValueError(f"effects= names tools that are not given: {', '.join(unknown)}")
    return protected


def protect_tool(
    tool: FunctionTool, guard: Guard, *, scope: ScopeFunction | None = None
) -> FunctionTool:
    """A copy of ``tool`` whose every function call goes through ``guard``.

    The copy is of the tool's own class and keeps all it has (name, declaration, confirmation
    policy, long-running flag); the tool itself is left unchanged. The guard answers the first
    caller with the result as stored (``with_stored_answers()``), so the model reads the same on
    the first call and on every replay.

    Args:
        tool: the ``FunctionTool`` to protect.
        guard: its guard, from ``ledger.guard(name, effect=..., ...)``; the guard's name is the
            tool's name in keys.
        scope: where the scope comes from (see :func:`protect`).

    Raises:
        TypeError: ``tool`` is not a ``FunctionTool``, ``guard`` not a guard, or a recorded
            tool's function is a generator (ADK runs it as a workflow node, past the ledger).
        ValueError: the guard is named after another tool.
    """
    if not isinstance(tool, FunctionTool):
        raise TypeError(f"only a FunctionTool can be protected, not {type(tool).__name__}")
    if not isinstance(guard, Guard):
        raise TypeError("guard= must be a twiceshy.Guard, from ledger.guard(...)")
    if guard.name != tool.name:
        raise ValueError(f"the guard for the tool {tool.name!r} is named {guard.name!r}")
    if scope is not None and not callable(scope):
        raise TypeError("scope= must be a function of the ToolContext, or None")
    if guard.recorded:
        _refuse_streaming(tool)
    copy = object.__new__(_protected_class(type(tool)))
    # Every attribute of the tool (function, declaration caches, confirmation policy), so that
    # ADK calls the copy exactly as it calls the tool.
    vars(copy).update(vars(tool))
    copy._twiceshy = _Protection(guard.with_stored_answers(), scope)
    return copy


def _as_function_tool(given: object) -> FunctionTool:
    if isinstance(given, FunctionTool):
        return given
    if isinstance(given, BaseTool):
        raise TypeError(
            f"only function tools can be protected, not {type(given).__name__}; list other "
            "tools next to the protected ones"
        )
    if callable(given):
        return FunctionTool(given)
    raise TypeError(f"a tool must be a FunctionTool or a function, not {type(given).__name__}")


def _refuse_streaming(tool: FunctionTool) -> None:
    """A recorded tool's function must return its result: ADK runs a generator as a workflow
    node, past the call the ledger wraps, and a stream cannot be replayed."""
    if inspect.isgeneratorfunction(tool.func) or inspect.isasyncgenfunction(tool.func):
        raise TypeError(
            f"the tool {tool.name!r} streams (its function is a generator): its results cannot "
            "be kept for a replay; declare it SAFE, or return its result at once"
        )


def _guard_for(ledger: Ledger, tool: FunctionTool, effect: Effect) -> Guard:
    """The guard ``protect`` builds for a tool declared by its effect class alone: results
    replay as the function's return annotation, and a function that calls
    ``twiceshy.point_of_no_return()`` says where its effect starts."""
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
        scope = self._scope_for(invocation.tool_context)

        async def work() -> Any:
            return await super(_Protected, self)._invoke_callable(target, args_to_call)

        try:
            return await guard.acall(arguments, work, scope=scope)
        except Exception as exc:
            text = for_the_model(guard, exc, arguments, scope=scope)
            if text is None:
                raise
            return {"error": text}

    # -- shared, no I/O --------------------------------------------------------------------

    def _received(self, args_to_call: Mapping[str, Any], sent: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments the function receives, by name, ADK's injected parameters left out."""
        inject = (self._context_param_name, *_INJECTED)
        try:
            return received(self.func, [], args_to_call, inject=inject, sent=sent)
        except TypeError:  # a signature ADK binds its own way (positional-only parameters)
            return {k: v for k, v in args_to_call.items() if k not in inject}

    def _scope_for(self, tool_context: ToolContext) -> str | None:
        """The call's scope (see :func:`protect`); ``MissingScope`` for a recorded tool with
        none (a SAFE tool needs none: where there is one, it names its nested runs' scope)."""
        protection = self._twiceshy
        if protection.scope is not None:
            scope = protection.scope(tool_context)
            where = "the scope= function returned no scope"
        else:
            scope = current_scope() or session_scope(tool_context)
            where = "the call has no session id and no twiceshy.run(...) encloses it"
        if isinstance(scope, str) and scope:
            return scope
        if not protection.guard.recorded:
            return None
        raise MissingScope(
            f"the tool {protection.guard.name!r} cannot be protected: {where}; it did not run"
        )


@functools.cache
def _protected_class(cls: type[FunctionTool]) -> type[_Protected]:
    """The protected twin of a tool class: the class itself, with :class:`_Protected` first."""
    if issubclass(cls, _Protected):
        return cls
    return cast(
        "type[_Protected]",
        type(f"Protected{cls.__name__}", (_Protected, cls), {"__module__": __name__}),
    )
