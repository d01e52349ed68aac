"""The Claude Agent SDK and the ``anthropic`` SDK's tool runners: every call of a protected tool
goes through a twiceshy ledger.

One line protects the tools, ``@tool`` tools of the Agent SDK and ``@beta_tool`` /
``@beta_async_tool`` tools of the ``anthropic`` SDK alike::

    tools = protect([create_charge, send_sms], ledger, effects={"create_charge": KEYED,
                                                                "send_sms": UNSAFE})

An Agent SDK session then serves them from its in-process MCP server, and names its scope, the
session id, through twiceshy's hook::

    options = ClaudeAgentOptions(
        mcp_servers={"billing": create_sdk_mcp_server("billing", tools=tools)},
        hooks=tools.hooks,
    )

The ``anthropic`` tool runners take them as they are (``client.beta.messages.tool_runner(...,
tools=tools)``, ``client.beta.sessions.events.tool_runner(session_id, tools=tools)``), inside
``twiceshy.run(run_id)``.

How a call is handled:

- Where: the tool's own handler (an Agent SDK tool's ``handler``, a runner tool's function), so
  every call that runs it meets the ledger: the model calling again under a new tool-use id, a
  session resumed after a crash, the sessions tool runner running a call again whose result it
  could not post.
- The intent is ``(scope, tool, arguments)``, the arguments being those the handler receives:
  for an Agent SDK tool the JSON object the SDK validated against the tool's schema (it does not
  coerce: ``"2"`` for an integer is refused before the handler runs), the schema's defaults
  filled in for the ones left out; for a runner tool the values pydantic's ``validate_call``
  gives the function (``"2"`` is ``2``, an omitted parameter its default), a value a
  ``default_factory`` made for one the model left out left out. Never the tool-use id.
- The scope is, in this order: an enclosing ``twiceshy.run(...)``; the scope a protected call
  passes on to the runs started inside it; the Agent SDK session's id, which ``tools.hooks``
  (a ``PreToolUse`` hook) hands each call of a protected tool (a session resumed with
  ``resume=`` keeps its id, so a call repeated after a crash is the same intent); a guard's own
  ``scope=``. A recorded tool called with none does not run, and says so.
- twiceshy's own answers reach the model as an error result carrying its text, never "try
  again" (an Agent SDK tool's ``is_error`` result, a runner tool's ``ToolError``): an unknown
  outcome, an identical call in progress, a refused key, a missing scope, and a KEYED tool out
  of attempts (it may have taken effect; an identical call later is safe). A result that ran but
  could not be kept reads as text (it succeeded).
- Other errors are raised as the tool raised them, and the SDK answers them as usual (an
  ``is_error`` result with the error's text): their repeat is safe, because the ledger replays
  certain failures (``definite=``) and an error before ``twiceshy.point_of_no_return()`` ran
  nothing. An Agent SDK result with ``is_error`` that the tool returned is its answer: recorded
  and replayed like any other.
- The model reads the same on the first call and on every replay: the result as the ledger
  stores it, rebuilt as the runner tool function's return annotation.
- A call the tool never runs never meets the ledger: arguments the SDK's validation refuses (a
  required one left out, a value of the wrong type) are refused before the handler or function
  is called, as without twiceshy (the Agent SDK's "Input validation error", the runner's
  validation error); arguments that do not fit a runner tool's function raise the ``TypeError``
  Python raises for them, before anything is claimed. The next well-formed call runs.
- A recorded tool (KEYED, UNSAFE, or SAFE with ``record=True``) whose handler or function is a
  generator is refused by ``protect``: its effects would happen after its call was recorded.
"""

from __future__ import annotations

try:
    from anthropic.lib.tools import BetaAsyncFunctionTool, BetaFunctionTool, ToolError
    from claude_agent_sdk import HookMatcher, SdkMcpTool
    from claude_agent_sdk.types import HookContext, HookEvent, HookInput, HookJSONOutput
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.claude_agent_sdk needs the Claude Agent SDK and the anthropic "
        f"SDK: pip install 'twiceshy[claude-agent-sdk]' ({exc})"
    ) from exc

import contextvars
import copy
import dataclasses
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeAlias, cast

import jsonschema  # type: ignore[import-untyped]  # a dependency of the Agent SDK
import pydantic

from .. import Effect, Guard, Ledger, MissingScope, ResultNotStorable, inherited_scope
from ._calls import (
    ArgumentsDoNotFit,
    effect_at_of,
    for_the_model,
    received,
    refuse_generator,
    with_schema_defaults,
)
from ._core import ReturnOf, entered_scope
from ._declared import Declarations

__all__ = ["SESSION_KEY", "ProtectedTools", "protect"]

SESSION_KEY = "twiceshy/session"
"""The argument under which twiceshy's ``PreToolUse`` hook hands a protected Agent SDK tool
its session's id; taken out before the tool's handler sees the arguments."""

RunnerTool: TypeAlias = "BetaFunctionTool[Any] | BetaAsyncFunctionTool[Any]"
AnyTool: TypeAlias = "SdkMcpTool[Any] | BetaFunctionTool[Any] | BetaAsyncFunctionTool[Any]"

_SENT: contextvars.ContextVar[tuple[int, Mapping[str, Any]] | None] = contextvars.ContextVar(
    "twiceshy_anthropic_sent", default=None
)
"""The input the model sent for the runner tool being called, by the id of that tool."""


class ProtectedTools(list[Any]):
    """The protected tools, in order (a list), and the hook that names their session.

    Give the list to ``create_sdk_mcp_server(..., tools=...)`` or to a tool runner, and
    :attr:`hooks` to ``ClaudeAgentOptions(hooks=...)``.
    """

    def __init__(self, tools: Iterable[Any], names: frozenset[str]) -> None:
        super().__init__(tools)
        self._names = names

    @property
    def hooks(self) -> dict[HookEvent, list[HookMatcher]]:
        """``ClaudeAgentOptions(hooks=...)``: a ``PreToolUse`` hook that hands each call of a
        protected Agent SDK tool its session's id. To keep hooks of your own, add yours to the
        lists: ``{**tools.hooks, "PostToolUse": [...]}``."""
        return {"PreToolUse": [HookMatcher(hooks=[self._hand_session])]}

    async def _hand_session(
        self, input: HookInput, tool_use_id: str | None, context: HookContext
    ) -> HookJSONOutput:
        """Add the session id to the input of a call of one of these tools (an SDK server's)."""
        data = cast("Mapping[str, Any]", input)
        server = data.get("mcp_server")
        name = data.get("tool_name")
        session = data.get("session_id")
        given = data.get("tool_input")
        if (
            not isinstance(server, Mapping)
            or server.get("source") != "sdk"
            or not isinstance(name, str)
            or not isinstance(session, str)
            or not isinstance(given, Mapping)
            or name.removeprefix(f"mcp__{server.get('name')}__") not in self._names
        ):
            return {}
        return {
            "hookSpecificOutput": {
                "hookEventName": "PreToolUse",
                "updatedInput": {**given, SESSION_KEY: session},
            }
        }


def protect(
    tools: Iterable[AnyTool],
    ledger: Ledger,
    *,
    effects: Mapping[str, Effect | Guard] | None = None,
    default: Effect | None = None,
) -> ProtectedTools:
    """Copies of ``tools`` whose every call goes through ``ledger``.

    Args:
        tools: Agent SDK tools (``@tool``) and ``anthropic`` runner tools (``@beta_tool``,
            ``@beta_async_tool``), in any mix.
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options
            (``attempts=``, ``definite=``, ``key_args=``, ``reconcile=``, ``scope=``...).
        default: the effect class of tools not named in ``effects``.

    Returns:
        The protected tools, with the hook that names an Agent SDK session's scope.

    Raises:
        TypeError: a tool is of no supported kind, an effect is of the wrong kind, or a recorded
            tool's handler or function is a generator.
        EffectNotDeclared: a tool has no effect class (a ``ValueError``).
        ValueError: ``effects`` names a tool that is not given, a guard is named for another
            tool, or a tool name is not usable in keys.
        ResultNotStorable: a KEYED or UNSAFE runner tool's return annotation has no JSON form.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
    declarations = Declarations(effects, default)
    protected: list[Any] = []
    agent_tools: set[str] = set()
    for tool in tools:
        if not isinstance(tool, SdkMcpTool | BetaFunctionTool | BetaAsyncFunctionTool):
            raise TypeError(
                "only Claude Agent SDK tools (@tool) and anthropic runner tools (@beta_tool, "
                f"@beta_async_tool) can be protected, not {type(tool).__name__}"
            )
        guard = declarations.guard(tool.name, functools.partial(_guard_for, ledger, tool))
        if guard.recorded:
            refuse_generator(tool.handler if isinstance(tool, SdkMcpTool) else tool.func, tool.name)
        guard = guard.with_stored_answers()
        if isinstance(tool, SdkMcpTool):
            agent_tools.add(tool.name)
            protected.append(_protect_agent_tool(tool, guard))
        else:
            # A ToolError is the tool's own certain failure: recorded, and replayed.
            protected.append(_protect_runner_tool(tool, guard.with_errors(definite=(ToolError,))))
    declarations.check_all_used()
    return ProtectedTools(protected, frozenset(agent_tools))


def _guard_for(
    ledger: Ledger,
    tool: SdkMcpTool[Any] | BetaFunctionTool[Any] | BetaAsyncFunctionTool[Any],
    effect: Effect,
) -> Guard:
    """The guard ``protect`` builds for a tool declared by its effect class alone: a runner
    tool's results replay as its function's return annotation."""
    fn = tool.handler if isinstance(tool, SdkMcpTool) else tool.func
    if effect is not Effect.SAFE:  # said before its return annotation is read
        refuse_generator(fn, tool.name)
    returns = (
        ReturnOf(fn) if effect is not Effect.SAFE and not isinstance(tool, SdkMcpTool) else None
    )
    return ledger.guard(tool.name, effect=effect, returns=returns, effect_at=effect_at_of(fn))


def _scope(session: object = None) -> str | None:
    """The call's scope, in the order the module docstring gives; ``None`` leaves it to the
    guard (its ``scope=``), which refuses a call with none."""
    entered = entered_scope()
    if entered is not None and not entered[1]:
        return entered[0]
    inherited = inherited_scope()
    if inherited is not None:
        return inherited
    if isinstance(session, str) and session:
        return session
    return None


def _missing(guard: Guard, hooks: bool) -> str:
    """What the model reads when a recorded tool was called with no scope."""
    how = "ClaudeAgentOptions(hooks=tools.hooks) from twiceshy's protect(), or " if hooks else ""
    return (
        f"The tool {guard.name!r} did not run: the application has not named the run it "
        f"belongs to ({how}`async with twiceshy.run(run_id):` around the run). Tell the user "
        "that the action was not taken."
    )


# -- Agent SDK tools ------------------------------------------------------------------------


def _protect_agent_tool(tool: SdkMcpTool[Any], guard: Guard) -> SdkMcpTool[Any]:
    """A copy of an Agent SDK tool whose handler goes through ``guard``."""
    handler = tool.handler
    schema = _input_schema(tool)
    closed = isinstance(schema, Mapping) and schema.get("additionalProperties") is False
    advertised: Any = tool.input_schema
    if closed:
        # The SDK would refuse the session id twiceshy's hook adds: the schema it checks leaves
        # that open, and the handler checks the tool's own schema once the id is taken out.
        advertised = {k: v for k, v in tool.input_schema.items() if k != "additionalProperties"}

    async def protected(args: Any) -> dict[str, Any]:
        given = dict(args) if isinstance(args, Mapping) else {}
        session = given.pop(SESSION_KEY, None)
        if closed:
            try:
                jsonschema.validate(instance=given, schema=schema)
            except jsonschema.ValidationError as exc:
                return _error(f"Input validation error: {exc.message}")
        arguments = with_schema_defaults(given, schema)
        scope = _scope(session)

        async def work() -> dict[str, Any]:
            return await handler(given)

        try:
            return await guard.acall(arguments, work, scope=scope)
        except MissingScope:
            return _error(_missing(guard, hooks=True))
        except Exception as exc:
            text = for_the_model(guard, exc, arguments, scope=scope)
            if text is None:
                raise
            if isinstance(exc, ResultNotStorable):  # it ran and succeeded: not a failure
                return {"content": [{"type": "text", "text": text}]}
            return _error(text)

    functools.update_wrapper(protected, handler)
    return dataclasses.replace(tool, handler=protected, input_schema=advertised)


def _error(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "is_error": True}


def _input_schema(tool: SdkMcpTool[Any]) -> object:
    """The JSON schema the SDK validates a call against (a JSON schema given as such), whose
    defaults fill in what the model left out; a schema of Python types has none."""
    schema = tool.input_schema
    if isinstance(schema, Mapping) and isinstance(schema.get("type"), str):
        return schema
    return None


# -- anthropic runner tools -----------------------------------------------------------------


class _SyncTool(BetaFunctionTool[Any]):
    """A protected sync runner tool: its calls carry the model's input to the guarded
    function, which names the intent by what it receives and what was sent."""

    def call(self, input: object) -> Any:
        token = _SENT.set((id(self), input) if isinstance(input, Mapping) else None)
        try:
            return super().call(input)
        finally:
            _SENT.reset(token)


class _AsyncTool(BetaAsyncFunctionTool[Any]):
    """:class:`_SyncTool` for an async runner tool."""

    async def call(self, input: object) -> Any:
        token = _SENT.set((id(self), input) if isinstance(input, Mapping) else None)
        try:
            return await super().call(input)
        finally:
            _SENT.reset(token)


def _protect_runner_tool(tool: RunnerTool, guard: Guard) -> RunnerTool:
    """A copy of an ``anthropic`` runner tool whose function goes through ``guard``; the
    copy keeps its name, description, schema and options."""
    fn = tool.func
    copied = copy.copy(tool)
    owner = id(copied)

    def arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        sent = _SENT.get()
        try:
            return received(fn, args, kwargs, sent=sent[1] if sent and sent[0] == owner else None)
        except ArgumentsDoNotFit as exc:
            # As the function's call would raise it, before anything is claimed.
            raise exc.as_raised() from None

    def answer(error: Exception, named: Mapping[str, Any], scope: str | None) -> Any:
        if isinstance(error, MissingScope):
            raise ToolError(_missing(guard, hooks=False)) from error
        text = for_the_model(guard, error, named, scope=scope)
        if text is None:
            raise error
        if isinstance(error, ResultNotStorable):  # it ran and succeeded: not a failure
            return text
        raise ToolError(text) from error

    guarded: Callable[..., Any]
    if isinstance(tool, BetaAsyncFunctionTool):
        afn = cast("Callable[..., Awaitable[Any]]", fn)

        @functools.wraps(fn)
        async def aguarded(*args: Any, **kwargs: Any) -> Any:
            named = arguments(args, kwargs)
            scope = _scope()
            try:
                return await guard.acall(named, lambda: afn(*args, **kwargs), scope=scope)
            except ToolError:
                raise
            except Exception as exc:
                return answer(exc, named, scope)

        guarded = aguarded
        object.__setattr__(copied, "__class__", _AsyncTool)
    else:

        @functools.wraps(fn)
        def sguarded(*args: Any, **kwargs: Any) -> Any:
            named = arguments(args, kwargs)
            scope = _scope()
            try:
                return guard.call(named, lambda: fn(*args, **kwargs), scope=scope)
            except ToolError:
                raise
            except Exception as exc:
                return answer(exc, named, scope)

        guarded = sguarded
        object.__setattr__(copied, "__class__", _SyncTool)
    copied.func = guarded
    # The SDK's own validation, made for the guarded function: it follows the wrapped
    # signature, so the function still receives values validated once.
    copied._func_with_validate = pydantic.validate_call(guarded)
    if inspect.iscoroutinefunction(fn) != inspect.iscoroutinefunction(guarded):  # pragma: no cover
        raise TypeError(f"the tool {tool.name!r} could not be wrapped")
    return copied
