"""OpenAI Agents SDK: every call of a protected ``FunctionTool`` goes through a twiceshy ledger.

One line protects an agent's function tools (``from twiceshy import KEYED, UNSAFE``)::

    tools = protect([charge, notify], ledger, effects={"charge": KEYED, "notify": UNSAFE})

and each run names its scope, by default ``RunConfig(group_id=...)``::

    await Runner.run(agent, text, run_config=RunConfig(group_id=conversation_id))

How a call is handled:

- The intent is ``(scope, tool, arguments)``, the arguments being those the tool's function
  receives: the model's JSON as the SDK parses and validates it (``"2"`` for an ``int`` is ``2``,
  an omitted parameter its default, a nested model its fields), bound to the function's
  parameters by name, its context parameter left out. The SDK's preparation is then handed to
  the invocation, so the function receives the very values that named the intent (releases
  before 0.22.3, which take none, parse the same JSON again with the same schema: equal
  values). A ``FunctionTool`` with no Python function behind it (built by hand,
  ``agent.as_tool(...)``) is named by the JSON object the model sent, its schema's defaults
  filled in. The tool-call id, new on every re-call, is never part of it.
- The scope is, in this order: a ``twiceshy.run(...)`` the application entered; else the
  ``scope=`` source (a field of the run context, or a function of the ``ToolContext``); else
  the scope inherited from the protected call the run is nested in (a sub-agent behind a
  protected ``agent.as_tool``), so every retry of the outer call names the same inner intents
  and two outer intents never share one; else, without ``scope=``, ``RunConfig.group_id``.
  Nothing the SDK generates (trace ids, call ids) survives a restart: the application supplies a
  stable id. No scope fails the run with ``MissingScope`` before the tool runs (a SAFE tool,
  which keeps no record, needs none).
- twiceshy's own answers become the tool's output, written for the model (never "try again"),
  whatever the tool's ``failure_error_function`` / ``timeout_error_function``: an unknown
  outcome, an identical call in progress, a refused key, a result that could not be kept, and a
  KEYED tool out of attempts (it may have taken effect; an identical call later is safe). A tool
  with a declared output schema (``output_type=``) cannot answer in text: for it they fail the
  run (``agents.UserError`` caused by them).
- Other errors keep the SDK's behaviour (the tool's ``failure_error_function``): their retry is
  safe, because the ledger replays definite failures, and an error before the tool's
  ``twiceshy.point_of_no_return()`` ran nothing. ``MissingScope`` and ``StoreError`` always fail
  the run: they are the application's to fix.
- A call whose arguments the SDK's validation refuses (a required one left out, a value of the
  wrong type), or that do not fit the function, never runs: the SDK answers it with its own
  text (the tool's ``failure_error_function``), and nothing is claimed, so the next well-formed
  call runs.
- A recorded tool (KEYED, UNSAFE, or SAFE with ``record=True``) whose function is a generator
  is refused by ``protect``: its effects would happen after its call was recorded.
- The model reads the same text on the first call and on every replay: the first caller gets
  the result as the ledger stores it (``Guard.with_stored_answers()``), and a result with no JSON
  form is kept as the text the SDK shows the model for it, ``str(result)``.
- A tool's ``timeout`` moves inside the ledger: it bounds each attempt.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import logging
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeAlias

try:
    from agents import (
        FunctionTool,
        ModelBehaviorError,
        RunContextWrapper,
        Tool,
        ToolTimeoutError,
        UserError,
    )
    from agents.function_schema import FuncSchema
    from agents.tool import (
        default_tool_timeout_error_message,
        maybe_invoke_function_tool_failure_error_function,
        set_function_tool_failure_error_function,
    )
    from agents.tool_context import ToolContext
    from pydantic import ValidationError
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.openai_agents needs the OpenAI Agents SDK 0.17.5 or later: "
        f"pip install 'twiceshy[openai-agents]' ({exc})"
    ) from exc

from .. import Effect, Guard, Ledger, inherited_scope
from ..errors import (
    MissingScope,
    NotApplied,
    ResultNotStorable,
    StoreError,
    UnkeyableType,
)
from ._calls import (
    ArgumentsDoNotFit,
    effect_at_of,
    for_the_model,
    received,
    refuse_generator,
    with_schema_defaults,
)
from ._core import ResultCodec, entered_scope
from ._declared import Declarations

__all__ = ["ScopeSource", "protect", "protect_tool"]

log = logging.getLogger("twiceshy")

ScopeSource: TypeAlias = str | Callable[[ToolContext[Any]], str | None] | None
"""Where a call's scope comes from when no ``twiceshy.run(...)`` is active.

- a ``str``: the name of a key (a mapping context) or an attribute (any other context) of the
  application's run context, the ``context=`` given to ``Runner.run``;
- a function of the ``ToolContext`` (``ctx.context``, ``ctx.run_config``, ...) answering the
  scope or ``None`` (then a nested run's inherited scope, if any, applies);
- ``None``: the inherited scope of a nested run, else ``RunConfig.group_id``.

A given source names the scope of nested runs too (the application's choice): to keep the
scopes of two outer intents apart, answer ``twiceshy.inherited_scope()`` where it is set.
"""

_ALWAYS_RAISED = (MissingScope, StoreError)
"""Errors that fail the run whatever the tool's failure policy: the application must fix them."""

_SDK_REFUSAL = "Invalid JSON input for tool "
"""How the SDK's ``ModelBehaviorError`` starts when it refuses a call's arguments (0.24)."""

_PLAIN = (str, int, float, bool, type(None))
"""Results the ledger keeps as they are, without a trial encoding."""

_ANY_SIZE = ResultCodec(max_bytes=sys.maxsize)
"""Tells a result with no JSON form from one only too large to keep."""


class _AttemptTimedOut(TimeoutError):
    """One attempt outlasted the tool's ``timeout``: ambiguous, like any timeout."""


class _ArgumentsRefused(NotApplied):
    """The SDK refused the arguments before the tool's body ran: nothing took effect."""

    def __init__(self, error: ModelBehaviorError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True, slots=True)
class _Function:
    """The Python function behind a ``@function_tool``, and the SDK's preparation of its calls.

    Attributes:
        fn: the function given to ``@function_tool``.
        prepare: the SDK's own ``(json, tool_name) -> PreparedFunctionArguments``: it parses the
            JSON, validates it with the parameters' pydantic model and makes the call's
            positional and keyword arguments. The tool's invocation accepts its result in place
            of preparing again. (Before 0.22.3: the same parse, see :func:`_parse_with`.)
        context: the name of the function's context parameter, if it takes one.
    """

    fn: Callable[..., Any]
    prepare: Callable[[str, str], Any]
    context: str | None

    def prepared(self, ctx: ToolContext[Any], raw_json_args: str) -> Any:
        """This call prepared by the SDK; raises what the SDK raises for arguments it refuses."""
        return self.prepare(raw_json_args, ctx.tool_name)

    def received(self, prepared: Any, raw_json_args: str) -> dict[str, Any] | None:
        """The arguments the function receives by name, or ``None`` for a signature that
        cannot be read (the model's JSON then names the intent).

        What a default factory made for what the model left out names nothing: left out.

        Raises:
            ArgumentsDoNotFit: the arguments do not fit the function, which would refuse them.
        """
        args = list(prepared.args)
        inject: tuple[str, ...] = ()
        if self.context is not None:
            args.insert(0, None)  # stands for the context, which is left out
            inject = (self.context,)
        try:
            sent = json.loads(raw_json_args) if raw_json_args else {}
        except ValueError:  # pragma: no cover - the SDK parsed this JSON
            return None
        try:
            return received(
                self.fn,
                args,
                prepared.kwargs,
                inject=inject,
                sent=sent if isinstance(sent, dict) else None,
            )
        except ArgumentsDoNotFit:  # pragma: no cover - the SDK made them for this function
            raise
        except (TypeError, ValueError):  # pragma: no cover - the SDK read this signature
            return None


def _function_of(tool: FunctionTool) -> _Function | None:
    """The function behind ``tool`` and the SDK's preparation of its calls, where both are found."""
    fn = _function_behind(tool)
    if fn is None:  # built by hand, or agent.as_tool(): no Python function
        return None
    prepare = _sdk_preparation(tool)
    if prepare is None:  # pragma: no cover - run by .ci/frameworks.sh on the oldest release
        schema = _sdk_schema(tool)
        if schema is None:  # another SDK version: the model's JSON names the intent
            return None
        prepare = _parse_with(schema, redacts=_sdk_redacts())
    return _Function(fn, prepare, _context_parameter(fn))


def _function_behind(tool: FunctionTool) -> Callable[..., Any] | None:
    """The Python function ``@function_tool`` made ``tool`` of (``__wrapped__`` from 0.21; before,
    the invocation keeps it as ``the_func``), or ``None`` for a tool with none behind it."""
    try:
        fn: Callable[..., Any] = tool.__wrapped__
    except AttributeError:
        found = _closure_value(tool, "the_func")
        return found if callable(found) else None
    return fn


def _sdk_invocation(tool: FunctionTool) -> Any:  # pragma: no cover - before 0.22.3
    """The function ``@function_tool`` made to invoke ``tool``, inside the SDK's failure handler."""
    return getattr(tool.on_invoke_tool, "_invoke_tool_impl", None)


def _closure_value(tool: FunctionTool, name: str) -> Any:  # pragma: no cover - before 0.22.3
    """What the invocation ``@function_tool`` made keeps under ``name``, or ``None``: releases
    before 0.22.3 keep the function and its schema there alone."""
    invoke = _sdk_invocation(tool)
    names = getattr(getattr(invoke, "__code__", None), "co_freevars", ())
    for free, cell in zip(names, getattr(invoke, "__closure__", None) or (), strict=False):
        if free == name:
            return cell.cell_contents
    return None


def _sdk_preparation(tool: FunctionTool) -> Callable[[str, str], Any] | None:
    """The SDK's own preparation of the tool's calls (``prepare_arguments``, from 0.22.3)."""
    prepare_for = getattr(tool.on_invoke_tool, "prepare_arguments", None)
    if not callable(prepare_for):  # pragma: no cover - before 0.22.3
        return None
    try:
        # What it answers for approval policies names the SDK's own preparation (its owner).
        prepare: Callable[[str, str], Any] = prepare_for("{}", tool.name).owner
        inspect.signature(prepare).bind("{}", tool.name)
    except Exception:  # pragma: no cover - another SDK version
        return None
    return prepare


def _sdk_schema(tool: FunctionTool) -> FuncSchema | None:  # pragma: no cover - before 0.22.3
    """The schema the invocation of releases before 0.22.3 validates a call with: the very
    object ``@function_tool`` made of the function, which they keep in the invocation only."""
    schema = _closure_value(tool, "schema")
    return schema if isinstance(schema, FuncSchema) else None


def _sdk_redacts() -> bool:  # pragma: no cover - before 0.22.3
    """Whether the SDK's invocation leaves the refused data out of its error when told not to
    log tool data: from 0.20; before, its refusals always carry the validation's details."""
    major, minor = (int(part) for part in metadata.version("openai-agents").split(".")[:2])
    return (major, minor) >= (0, 20)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A call's positional and keyword arguments, as the SDK makes them from its JSON."""

    args: list[Any]
    kwargs: dict[str, Any]


def _parse_with(  # pragma: no cover - before 0.22.3
    schema: FuncSchema, *, redacts: bool
) -> Callable[[str, str], _Prepared]:
    """The preparation of releases before 0.22.3, which they do not expose: their invocation's
    steps with their own JSON parser and the tool's schema, refusals raised as they raise them
    (``redacts``: as :func:`_sdk_redacts` reads the release). Those releases are fixed: the
    private names below are theirs and cannot move."""
    from agents import _debug
    from agents.tool import _parse_function_tool_json_input

    def prepare(raw_json_args: str, tool_name: str) -> _Prepared:
        data = _parse_function_tool_json_input(tool_name=tool_name, input_json=raw_json_args)
        refused = f"Invalid JSON input for tool {tool_name}"
        try:
            parsed = schema.params_pydantic_model(**data)
        except ValidationError as exc:
            if not (redacts and _debug.DONT_LOG_TOOL_DATA):
                raise ModelBehaviorError(f"{refused}: {exc}") from exc
        else:
            args, kwargs = schema.to_call_args(parsed)
            return _Prepared(args, kwargs)
        # Raised outside the except, as the SDK does: the redacted error carries no data.
        raise ModelBehaviorError(refused)

    return prepare


def _context_parameter(fn: Callable[..., Any]) -> str | None:
    """The first parameter's name where it is the SDK's context, as ``function_schema`` reads it."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - the SDK read this signature
        return None
    if not parameters:
        return None
    first = parameters[0]
    annotated = fn if inspect.isroutine(fn) else type(fn).__call__
    try:
        hints = typing.get_type_hints(annotated)
    except Exception:  # pragma: no cover - the SDK resolved these annotations
        hints = {}
    annotation = hints.get(first.name, first.annotation)
    origin = typing.get_origin(annotation) or annotation
    return first.name if origin is RunContextWrapper or origin is ToolContext else None


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
        TypeError: a tool is not a ``FunctionTool`` (hosted tools cannot be protected here), an
            effect is neither an effect class nor a guard, or a recorded tool's function is a
            generator.
        EffectNotDeclared: a tool has no effect class (a ``ValueError``).
        ValueError: ``effects`` names a tool not in ``tools``, or a guard named for another tool.
    """
    declarations = Declarations(effects, default)
    protected: list[Tool] = []
    for tool in tools:
        if not isinstance(tool, FunctionTool):
            raise TypeError(
                f"only FunctionTool objects can be protected, not {type(tool).__name__}; "
                "list hosted tools next to the protected ones"
            )
        qualified = declarations.names(tool.qualified_name)
        guard = declarations.guard(
            tool.qualified_name if qualified else tool.name,
            functools.partial(_guard_for, ledger, tool),
            shown=tool.qualified_name,
            guard_names=(tool.name, tool.qualified_name),
        )
        protected.append(protect_tool(tool, guard, scope=scope))
    declarations.check_all_used()
    return protected


def protect_tool(tool: FunctionTool, guard: Guard, *, scope: ScopeSource = None) -> FunctionTool:
    """A copy of ``tool`` whose every invocation goes through ``guard``.

    The copy keeps the tool's name, schema, guardrails, approval policy and failure policy. The
    tool's ``timeout`` bounds each attempt inside the ledger instead of the whole call. The
    guard answers the first caller with the result as stored (``with_stored_answers()``), so the
    model reads the same text on the first call and on every replay.

    Args:
        tool: the ``FunctionTool`` to protect (it is left unchanged).
        guard: its guard, from ``ledger.guard(name, effect=..., ...)``; the guard's name is the
            tool's name in keys.
        scope: where the scope comes from (see :data:`ScopeSource`).

    Returns:
        The protected tool, to give to ``Agent(tools=[...])``.

    Raises:
        TypeError: ``tool`` is not a ``FunctionTool``, ``scope`` is of no known kind, or the
            guard keeps records and the tool's function is a generator.
    """
    if not isinstance(tool, FunctionTool):
        raise TypeError(f"only a FunctionTool can be protected, not {type(tool).__name__}")
    if not isinstance(guard, Guard):
        raise TypeError("guard= must be a twiceshy.Guard, from ledger.guard(...)")
    if guard.recorded:
        refuse_generator(_function_behind(tool), guard.name)
    if scope is not None and not isinstance(scope, str) and not callable(scope):
        raise TypeError(
            "scope= must be a context field name, a function of the ToolContext, or None"
        )
    # An invoker built by @function_tool answers failures itself, with the tool's
    # failure_error_function ("An error occurred ..."). The inner copy has that answer turned
    # off, so the ledger sees the real exception; the outer copy keeps the tool's own policy for
    # the errors whose retry is safe. A hand-built invoker raises, and keeps raising.
    answers_failures = callable(getattr(tool.on_invoke_tool, "__agents_bind_function_tool__", None))
    inner = copy.copy(tool)
    if answers_failures:
        set_function_tool_failure_error_function(inner, None)
    inner.timeout_seconds = None
    outer = copy.copy(tool)
    outer.timeout_seconds = None
    outer.on_invoke_tool = _Invoker(
        outer,
        inner,
        guard.with_stored_answers(),
        scope,
        function=_function_of(tool),
        answers_failures=answers_failures,
        timeout=tool.timeout_seconds,
    )
    return outer


class _Invoker:
    """A protected tool's ``on_invoke_tool``: each call's intent, its claim, and the answer."""

    def __init__(
        self,
        outer: FunctionTool,
        inner: FunctionTool,
        guard: Guard,
        scope: ScopeSource,
        *,
        function: _Function | None,
        answers_failures: bool,
        timeout: float | None,
    ) -> None:
        self.outer = outer
        self.inner = inner
        self.guard = guard
        self.scope = scope
        self.function = function
        self.answers_failures = answers_failures
        self.timeout = timeout
        self.timeout_behavior = outer.timeout_behavior
        self.timeout_error_function = outer.timeout_error_function

    # The SDK hands the ToolContext (with run_config) only to an invoker whose first parameter
    # is annotated with it; a RunContextWrapper annotation would get a stripped context.
    async def __call__(self, ctx: ToolContext[Any], raw_json_args: str) -> Any:
        outer, guard = self.outer, self.guard
        _refuse_workflow_code(guard.name)
        prepared: Any = None
        arguments: dict[str, Any] | None = None
        if self.function is not None:
            try:
                prepared = self.function.prepared(ctx, raw_json_args)
                arguments = self.function.received(prepared, raw_json_args)
            except ArgumentsDoNotFit as exc:  # pragma: no cover - see _Function.received
                # The function would refuse the call: the SDK answers its TypeError.
                return await _failed(outer, ctx, exc.as_raised(), self.answers_failures)
            except Exception as exc:
                # The SDK's own validation refused the call: the body never runs, as without
                # twiceshy, nothing is claimed, and the SDK answers.
                return await _failed(outer, ctx, exc, self.answers_failures)
        raw: dict[str, Any] | None = None
        if arguments is None:
            try:
                arguments = raw = _arguments(outer, raw_json_args)
            except ModelBehaviorError as exc:
                return await _failed(outer, ctx, exc, self.answers_failures)
        # A SAFE tool keeps no record and needs no scope; where there is one, it names the
        # scope of the runs started inside the tool (a sub-agent behind a SAFE as_tool).
        run_scope = _scope(self.scope, ctx, guard.name, required=guard.recorded)
        if run_scope is not None and raw is None:
            arguments = _keyable(guard, arguments, outer, raw_json_args, run_scope)
        handed = [prepared]

        async def attempt() -> Any:
            given, handed[0] = handed[0], None
            if given is not None and hasattr(ctx, "_function_tool_arguments"):
                # The function receives the very values that named the intent; a later attempt
                # has the SDK prepare them afresh from the same JSON (equal values).
                ctx._function_tool_arguments = given
            try:
                output = await self.inner.on_invoke_tool(ctx, raw_json_args)
            except ModelBehaviorError as exc:
                # Arguments the tool's schema refuses: the body never ran. Any other error
                # (this one raised from inside the body included) stays ambiguous.
                if str(exc).startswith(_SDK_REFUSAL):
                    raise _ArgumentsRefused(exc) from exc
                raise
            return _as_kept(guard, outer, output)

        async def work() -> Any:
            if self.timeout is None:
                return await attempt()
            try:
                async with asyncio.timeout(self.timeout) as deadline:
                    return await attempt()
            except TimeoutError as exc:
                if deadline.expired():
                    raise _AttemptTimedOut(
                        f"the tool {guard.name!r} did not finish within {self.timeout:g} seconds"
                    ) from exc
                raise

        try:
            return await guard.acall(arguments, work, scope=run_scope)
        except _ALWAYS_RAISED:
            raise
        except Exception as exc:
            text = for_the_model(guard, exc, arguments, scope=run_scope)
            if text is not None:
                if _output_schema(outer) is not None:
                    # A tool with a declared output schema cannot answer in text (the SDK
                    # refuses the output): the run stops with the honest error instead.
                    raise
                return text
            if isinstance(exc, _ArgumentsRefused):
                return await _failed(outer, ctx, exc.error, self.answers_failures)
            if isinstance(exc, _AttemptTimedOut):
                return await self._timed_out(ctx, exc)
            return await _failed(outer, ctx, exc, self.answers_failures)

    async def _timed_out(self, ctx: ToolContext[Any], exc: _AttemptTimedOut) -> Any:
        """The SDK's timeout policy, for a timeout whose retry is safe (a SAFE tool's)."""
        assert self.timeout is not None
        error = ToolTimeoutError(tool_name=self.outer.name, timeout_seconds=self.timeout)
        if self.timeout_behavior == "raise_exception":
            raise error from exc
        if self.timeout_error_function is None:
            return default_tool_timeout_error_message(
                tool_name=self.outer.name, timeout_seconds=self.timeout
            )
        answer = self.timeout_error_function(ctx, error)
        return await answer if inspect.isawaitable(answer) else answer


def _guard_for(ledger: Ledger, tool: FunctionTool, effect: Effect) -> Guard:
    """The guard ``protect`` builds for a tool declared by its effect class alone."""
    fn = _function_behind(tool)
    # A function that calls twiceshy.point_of_no_return() says where its effect starts.
    effect_at = effect_at_of(fn)
    try:
        return ledger.guard(
            tool.qualified_name, effect=effect, returns=_returns(fn), effect_at=effect_at
        )
    except ResultNotStorable:
        # A return type with no JSON form: the SDK shows the model str() of such a result, and
        # the ledger keeps that text (see _as_kept).
        return ledger.guard(tool.qualified_name, effect=effect, effect_at=effect_at)


def _output_schema(tool: FunctionTool) -> Any:
    """The tool's declared output schema (``output_json_schema``, from 0.19), if any."""
    return getattr(tool, "output_json_schema", None)


def _as_kept(guard: Guard, tool: FunctionTool, output: Any) -> Any:
    """The output as the ledger is to keep it: itself, or, where it has no JSON form, the text
    the model reads for it (the SDK shows it ``str(output)``), so that a replay reads the same."""
    if type(output) in _PLAIN or not guard.recorded or _output_schema(tool) is not None:
        return output
    try:
        _ANY_SIZE.encode(output)
    except ResultNotStorable:
        try:
            return str(output)
        except Exception:  # no text either: the ledger records that it ran, all the same
            return output
    # One too large to keep (an image, say) stays itself: the ledger records that it ran.
    return output


def _keyable(
    guard: Guard, arguments: dict[str, Any], tool: FunctionTool, raw_json_args: str, scope: str
) -> dict[str, Any]:
    """``arguments``, or the model's JSON where a value the SDK made has no key form
    (a type twiceshy cannot write, which the SDK accepts): never refuse a call the SDK runs."""
    try:
        guard.key_for(arguments, scope=scope)
    except UnkeyableType:
        try:
            return _arguments(tool, raw_json_args)
        except ModelBehaviorError:  # pragma: no cover - the SDK parsed this JSON
            return arguments
    except Exception:  # the call itself answers (a refused value, a bound)
        return arguments
    return arguments


def _refuse_workflow_code(tool: str) -> None:
    """Refuse a protected tool invoked in Temporal workflow code, before the ledger is asked.

    OpenAI Agents' Temporal integration runs the agent loop in the workflow, and with it every
    ``FunctionTool`` not made with ``activity_as_tool``: its ledger I/O would run in workflow
    code, again on every replay. (Read without importing Temporal: only a process that imported
    it can be in a workflow.)

    Raises:
        agents.UserError: the tool was invoked in a Temporal workflow's own code.
    """
    workflow = sys.modules.get("temporalio.workflow")
    in_workflow = getattr(workflow, "in_workflow", None)
    if in_workflow is None or not in_workflow():
        return
    raise UserError(
        f"the protected tool {tool!r} was invoked in Temporal workflow code, where the ledger "
        "must not be asked (a replay would ask it again): protect the activity instead, with "
        "twiceshy.integrations.temporal.activity(ledger, effect=...), hand it to "
        "activity_as_tool(...), and give the worker "
        "twiceshy.integrations.temporal.TwiceshyInterceptor(); it did not run"
    )


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
    """The arguments that name the intent of a tool with no Python function: the model's JSON
    object, the schema's defaults filled in."""
    try:
        parsed = json.loads(raw_json_args, parse_constant=_refuse_constant) if raw_json_args else {}
    except ValueError as exc:
        raise ModelBehaviorError(f"Invalid JSON input for tool {tool.name}") from exc
    if not isinstance(parsed, dict):
        raise ModelBehaviorError(f"Invalid JSON input for tool {tool.name}: expected a JSON object")
    # An omitted parameter and its default passed explicitly are one intent.
    return with_schema_defaults(parsed, tool.params_json_schema)


def _scope(
    source: ScopeSource, ctx: ToolContext[Any], tool: str, *, required: bool = True
) -> str | None:
    """The call's scope; ``MissingScope`` when there is none (``None`` if not ``required``).

    The application's scope comes first (a ``twiceshy.run`` it entered, then ``scope=``); then
    the scope a nested run inherits from the protected call it runs in; then, without
    ``scope=``, the SDK's ``RunConfig.group_id``.
    """
    entered = entered_scope()
    if entered is not None and not entered[1]:
        return entered[0]
    value: object = None
    if callable(source):
        value, origin = source(ctx), "the scope= function"
    elif isinstance(source, str):
        context = ctx.context
        if isinstance(context, Mapping):
            value = context.get(source)
        else:
            value = getattr(context, source, None)
        origin = f"the run context's {source!r}"
    if value is None or value == "":
        inherited = inherited_scope()
        if inherited is not None:
            return inherited
        if source is None:
            value = ctx.run_config.group_id if ctx.run_config is not None else None
            origin = "RunConfig.group_id"
    if (value is None or value == "") and not required:
        return None
    if value is None or value == "":
        raise MissingScope(
            f"the tool {tool!r} has no scope: {origin} is not set. Give each run a stable id "
            "(Runner.run(..., run_config=RunConfig(group_id=...)), a field of the run context "
            "named by scope=, or `with twiceshy.run(run_id):`) so retries of one intent share a key"
        )
    if not isinstance(value, str):
        if not required:
            return None
        raise TypeError(f"{origin} must be a string, not {type(value).__name__}")
    return value


def _returns(fn: Callable[..., Any] | None) -> Any:
    """The return annotation of the function behind a ``@function_tool``, if there is one."""
    if fn is None:
        return None
    target = fn if inspect.isroutine(fn) else type(fn).__call__
    try:
        return inspect.get_annotations(target, eval_str=True).get("return")
    except Exception:  # an annotation that does not evaluate: results replay as plain JSON
        return None
