"""OpenAI Agents SDK: every call of a protected ``FunctionTool`` goes through a twiceshy ledger.

One line protects an agent's function tools (``from twiceshy import KEYED, UNSAFE``)::

    tools = protect([charge, notify], ledger, effects={"charge": KEYED, "notify": UNSAFE})

and each run names its scope, by default ``RunConfig(group_id=...)``::

    await Runner.run(agent, text, run_config=RunConfig(group_id=conversation_id))

How a call is handled:

- The intent is ``(scope, tool, arguments)``, the arguments being the JSON object the model
  sent (defaults from the tool's schema filled in); the tool-call id, which changes on every
  re-call, and the injected ``ToolContext`` are not part of it.
- The scope is, in this order: an active ``twiceshy.run(...)``; else the ``scope=`` source (a
  field of the run context, or a function of the ``ToolContext``); else, when ``scope=`` is not
  given, ``RunConfig.group_id``. Nothing the SDK generates (trace ids, call ids) survives a
  restart: the application supplies a stable id. No scope fails the run with ``MissingScope``
  before the tool runs (a SAFE tool, which keeps no record, needs none).
- ``OutcomeUnknown`` and ``InProgress`` become the tool's output, their text written for the
  model (it never says "try again"); the tool's ``failure_error_function`` is not consulted.
  So do ``KeyReuseMismatch`` and ``UnkeyableArgument`` (nothing ran). A tool with a declared
  output schema (``output_type=``) cannot answer in text: for it they fail the run
  (``agents.UserError`` caused by them).
- Other errors of the tool keep the SDK's behaviour (the tool's ``failure_error_function``):
  a retry of them is safe, because the ledger replays definite failures and runs a KEYED tool
  again only with the same key. Arguments the tool's schema refuses release the intent (the
  body never ran). ``MissingScope``, ``StoreError`` and ``ResultNotStorable`` always fail the
  run: they are the application's to fix, not the model's.
- A tool's ``timeout`` moves inside the ledger: it bounds each attempt, so a timed-out UNSAFE
  tool answers ``OutcomeUnknown`` instead of the SDK's "timed out" text.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeAlias

from agents import FunctionTool, ModelBehaviorError, Tool, ToolTimeoutError
from agents.tool import (
    default_tool_timeout_error_message,
    maybe_invoke_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tool_context import ToolContext

from .._ledger import Guard, Ledger
from .._records import Effect
from .._scope import current_scope
from ..errors import (
    InProgress,
    KeyReuseMismatch,
    MissingScope,
    NotApplied,
    OutcomeUnknown,
    ResultNotStorable,
    StoreError,
    UnkeyableArgument,
)

__all__ = ["ScopeSource", "protect", "protect_tool"]

log = logging.getLogger("twiceshy")

ScopeSource: TypeAlias = str | Callable[[ToolContext[Any]], str | None] | None
"""Where a call's scope comes from when no ``twiceshy.run(...)`` is active.

- a ``str``: the name of a key (a mapping context) or an attribute (any other context) of the
  application's run context, the ``context=`` given to ``Runner.run``;
- a function of the ``ToolContext`` (``ctx.context``, ``ctx.run_config``, ...) answering the
  scope or ``None``;
- ``None``: ``RunConfig.group_id``.
"""

_FOR_THE_MODEL = (OutcomeUnknown, InProgress, KeyReuseMismatch, UnkeyableArgument)
"""Errors whose text is the tool's output: the honest answers, and refusals before any run."""

_ALWAYS_RAISED = (MissingScope, StoreError, ResultNotStorable)
"""Errors that fail the run whatever the tool's failure policy: the application must fix them."""


_SDK_REFUSAL = "Invalid JSON input for tool "
"""How the SDK's ``ModelBehaviorError`` starts when it refuses a call's arguments (0.24)."""


class _AttemptTimedOut(TimeoutError):
    """One attempt outlasted the tool's ``timeout``: ambiguous, like any timeout."""


class _ArgumentsRefused(NotApplied):
    """The SDK refused the arguments before the tool's body ran: nothing took effect."""

    def __init__(self, error: ModelBehaviorError) -> None:
        super().__init__(str(error))
        self.error = error


def protect(
    tools: Iterable[FunctionTool],
    ledger: Ledger,
    *,
    effects: Mapping[str, Effect | Guard] | None = None,
    default: Effect | None = None,
    scope: ScopeSource = None,
) -> list[Tool]:
    """Protect function tools: the list, each tool wrapped by :func:`protect_tool`.

    Args:
        tools: the ``FunctionTool`` objects (``@function_tool`` or built by hand).
        ledger: the ledger the calls go through.
        effects: each tool's effect class by name (its ``name`` or ``qualified_name``), or a
            :class:`twiceshy.Guard` from ``ledger.guard(name, effect=..., ...)`` for more options
            (``attempts=``, ``definite=``, ``reconcile=``, ...).
        default: the effect class of the tools ``effects`` does not name. There is no silent
            default: without it, every tool must be named.
        scope: where the scope comes from (see :data:`ScopeSource`).

    Returns:
        New tools, in the same order, for ``Agent(tools=...)``; the given ones are left as
        they were.

    Raises:
        TypeError: a tool is not a ``FunctionTool`` (hosted tools cannot be protected here), or
            an effect is neither an effect class nor a guard.
        ValueError: a tool has no effect class, or ``effects`` names a tool not in ``tools``.
    """
    effects = dict(effects or {})
    if default is not None and not isinstance(default, Effect):
        raise TypeError("default= must be twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE")
    protected: list[Tool] = []
    named: set[str] = set()
    for tool in tools:
        if not isinstance(tool, FunctionTool):
            raise TypeError(
                f"only FunctionTool objects can be protected, not {type(tool).__name__}; "
                "list hosted tools next to the protected ones"
            )
        name = tool.qualified_name if tool.qualified_name in effects else tool.name
        declared = effects.get(name, default)
        if declared is None:
            raise ValueError(
                f"the tool {tool.qualified_name!r} has no effect class: name it in effects= "
                "(twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE) or give default="
            )
        if name in effects:
            named.add(name)
        if isinstance(declared, Guard):
            guard = declared
        elif isinstance(declared, Effect):
            guard = ledger.guard(tool.qualified_name, effect=declared, returns=_returns(tool))
        else:
            raise TypeError(
                f"the effect of {tool.qualified_name!r} must be an effect class or a "
                f"twiceshy.Guard, not {type(declared).__name__}"
            )
        protected.append(protect_tool(tool, guard, scope=scope))
    unknown = sorted(set(effects) - named)
    if unknown:
        raise ValueError(f"effects= names tools that are not given: {', '.join(unknown)}")
    return protected


def protect_tool(tool: FunctionTool, guard: Guard, *, scope: ScopeSource = None) -> FunctionTool:
    """A copy of ``tool`` whose every invocation goes through ``guard``.

    The copy keeps the tool's name, schema, guardrails, approval policy and failure policy. The
    tool's ``timeout`` bounds each attempt inside the ledger instead of the whole call.

    Args:
        tool: the ``FunctionTool`` to protect (it is left unchanged).
        guard: its guard, from ``ledger.guard(name, effect=..., ...)``; the guard's name is the
            tool's name in keys.
        scope: where the scope comes from (see :data:`ScopeSource`).

    Returns:
        The protected tool, to give to ``Agent(tools=[...])``.

    Raises:
        TypeError: ``tool`` is not a ``FunctionTool`` or ``scope`` is of no known kind.
    """
    if not isinstance(tool, FunctionTool):
        raise TypeError(f"only a FunctionTool can be protected, not {type(tool).__name__}")
    if not isinstance(guard, Guard):
        raise TypeError("guard= must be a twiceshy.Guard, from ledger.guard(...)")
    if scope is not None and not isinstance(scope, str) and not callable(scope):
        raise TypeError(
            "scope= must be a context field name, a function of the ToolContext, or None"
        )
    # An invoker built by @function_tool answers failures itself, with the tool's
    # failure_error_function ("... Please try again."). The inner copy has that answer turned
    # off, so the ledger sees the real exception; the outer copy keeps the tool's own policy for
    # the errors whose retry is safe. A hand-built invoker raises, and keeps raising.
    answers_failures = callable(getattr(tool.on_invoke_tool, "__agents_bind_function_tool__", None))
    inner = copy.copy(tool)
    if answers_failures:
        set_function_tool_failure_error_function(inner, None)
    inner.timeout_seconds = None
    outer = copy.copy(tool)
    outer.timeout_seconds = None
    outer.on_invoke_tool = _invoker(
        outer,
        inner,
        guard,
        scope,
        answers_failures=answers_failures,
        timeout=tool.timeout_seconds,
        timeout_behavior=tool.timeout_behavior,
        timeout_error_function=tool.timeout_error_function,
    )
    return outer


def _invoker(
    outer: FunctionTool,
    inner: FunctionTool,
    guard: Guard,
    scope: ScopeSource,
    *,
    answers_failures: bool,
    timeout: float | None,
    timeout_behavior: str,
    timeout_error_function: Callable[..., Any] | None,
) -> Callable[[ToolContext[Any], str], Awaitable[Any]]:
    # The SDK hands the ToolContext (with run_config) only to an invoker whose first parameter
    # is annotated with it; a RunContextWrapper annotation would get a stripped context.
    async def invoke(ctx: ToolContext[Any], raw_json_args: str) -> Any:
        try:
            arguments = _arguments(outer, raw_json_args)
        except ModelBehaviorError as exc:
            return await _failed(outer, ctx, exc, answers_failures)
        # A SAFE tool keeps no record: it needs no key, so no scope either.
        run_scope = _scope(scope, ctx, guard.name) if guard.recorded else None

        async def attempt() -> Any:
            try:
                return await inner.on_invoke_tool(ctx, raw_json_args)
            except ModelBehaviorError as exc:
                # Arguments the tool's schema refuses: the body never ran. Any other error
                # (this one raised from inside the body included) stays ambiguous.
                if str(exc).startswith(_SDK_REFUSAL):
                    raise _ArgumentsRefused(exc) from exc
                raise

        async def work() -> Any:
            if timeout is None:
                return await attempt()
            try:
                async with asyncio.timeout(timeout) as deadline:
                    return await attempt()
            except TimeoutError as exc:
                if deadline.expired():
                    raise _AttemptTimedOut(f"{guard.name} outlasted {timeout:g}s") from exc
                raise

        try:
            return await guard.acall(arguments, work, scope=run_scope)
        except _FOR_THE_MODEL as exc:
            if outer.output_json_schema is not None:
                # A tool with a declared output schema cannot answer in text (the SDK refuses
                # the output): the run stops with the honest error instead.
                raise
            return str(exc)
        except _ALWAYS_RAISED:
            raise
        except _ArgumentsRefused as exc:
            return await _failed(outer, ctx, exc.error, answers_failures)
        except _AttemptTimedOut as exc:
            # A KEYED or SAFE tool's last attempt timed out: its retry is safe, so the SDK's
            # own timeout policy answers.
            assert timeout is not None
            error = ToolTimeoutError(tool_name=outer.name, timeout_seconds=timeout)
            if timeout_behavior == "raise_exception":
                raise error from exc
            if timeout_error_function is None:
                return default_tool_timeout_error_message(
                    tool_name=outer.name, timeout_seconds=timeout
                )
            answer = timeout_error_function(ctx, error)
            return await answer if inspect.isawaitable(answer) else answer
        except Exception as exc:
            return await _failed(outer, ctx, exc, answers_failures)

    return invoke


async def _failed(
    tool: FunctionTool, ctx: ToolContext[Any], error: Exception, answers_failures: bool
) -> Any:
    """The SDK's own answer to a tool's error: its failure_error_function's text, or a raise."""
    if answers_failures:
        answer = await maybe_invoke_function_tool_failure_error_function(
            function_tool=tool, context=ctx, error=error
        )
        if answer is not None:
            log.debug("twiceshy: tool %s failed; its failure_error_function answers", tool.name)
            return answer
    raise error


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _arguments(tool: FunctionTool, raw_json_args: str) -> dict[str, Any]:
    """The arguments that name the intent: the model's JSON object, schema defaults filled in."""
    try:
        parsed = json.loads(raw_json_args, parse_constant=_refuse_constant) if raw_json_args else {}
    except ValueError as exc:
        raise ModelBehaviorError(f"Invalid JSON input for tool {tool.name}") from exc
    if not isinstance(parsed, dict):
        raise ModelBehaviorError(f"Invalid JSON input for tool {tool.name}: expected a JSON object")
    # An omitted parameter and its default passed explicitly are one intent.
    properties = tool.params_json_schema.get("properties")
    if isinstance(properties, Mapping):
        for name, spec in properties.items():
            if name not in parsed and isinstance(spec, Mapping) and "default" in spec:
                parsed[name] = spec["default"]
    return parsed


def _scope(source: ScopeSource, ctx: ToolContext[Any], tool: str) -> str:
    """The call's scope; ``MissingScope`` when there is none."""
    active = current_scope()
    if active is not None:
        return active
    value: object
    if callable(source):
        value, origin = source(ctx), "the scope= function"
    elif isinstance(source, str):
        context = ctx.context
        if isinstance(context, Mapping):
            value = context.get(source)
        else:
            value = getattr(context, source, None)
        origin = f"the run context's {source!r}"
    else:
        value = ctx.run_config.group_id if ctx.run_config is not None else None
        origin = "RunConfig.group_id"
    if value is None or value == "":
        raise MissingScope(
            f"the tool {tool!r} has no scope: {origin} is not set. Give each run a stable id "
            "(Runner.run(..., run_config=RunConfig(group_id=...)), a field of the run context "
            "named by scope=, or `with twiceshy.run(run_id):`) so retries of one intent share a key"
        )
    if not isinstance(value, str):
        raise TypeError(f"{origin} must be a string, not {type(value).__name__}")
    return value


def _returns(tool: FunctionTool) -> Any:
    """The return annotation of the function behind a ``@function_tool``, if there is one."""
    try:
        fn = tool.__wrapped__
    except AttributeError:
        return None
    try:
        return inspect.get_annotations(fn, eval_str=True).get("return")
    except Exception:  # an annotation that does not evaluate: results replay as plain JSON
        return None
