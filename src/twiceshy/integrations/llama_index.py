"""LlamaIndex agents and workflows: every call of a protected ``FunctionTool`` through a twiceshy
ledger.

One line protects an agent's tools (``from twiceshy import KEYED, SAFE, UNSAFE``)::

    tools = protect([charge, wire, lookup], ledger, effects={"charge": KEYED, "wire": UNSAFE},
                    default=SAFE)
    agent = FunctionAgent(tools=tools, llm=llm)
    await agent.run("Charge order 1234", run_id="order-1234")

How a call is handled:

- The intent is ``(scope, tool, arguments)``, the arguments being those the tool's function
  receives, bound to its parameters by name with their defaults. LlamaIndex shows the model the
  tool's schema (``fn_schema``) but hands the function the model's JSON unchecked; a protected
  tool first validates what the model sent against that schema, as the other frameworks do, so
  ``"4900"`` for an ``int`` parameter reaches the function as ``4900`` and names one intent with
  it. Arguments the schema refuses reach the function as sent, as without twiceshy. The
  workflow ``Context`` parameter is no part of the intent, nor is the tool-call id, which is new
  every time the model calls again; a ``Field(default_factory=...)`` default the model left out
  is left out too. A tool's ``partial_params`` are arguments the function receives: part of it.
- A call whose arguments do not fit the function (a required argument left out, one it has no
  parameter for) never runs: it raises the ``TypeError`` Python raises for it, which the agent
  answers as an error output the model reads, as without twiceshy. Nothing is claimed, so the
  next well-formed call runs.
- A KEYED or UNSAFE tool (or a SAFE one with ``record=True``) whose function is a generator is
  refused by ``protect``: its effects would happen after its call was recorded. Return the
  results (a list), or collect them inside the tool.
- The scope is, in this order: ``scope(ctx)`` when ``protect`` has a ``scope=`` function (``ctx``
  is the running step's ``Context``, or ``None`` outside a workflow); else
  ``twiceshy.current_scope()``: a ``twiceshy.run(...)`` around the run, or, for a run started
  inside a protected tool, the scope that call passes on; else the workflow's run id,
  ``agent.run(..., run_id=...)``. Without one, LlamaIndex draws a fresh id for every run: pass a
  stable one, so that a run started again after a crash names the same intents. A recorded tool
  called with no scope at all raises :class:`twiceshy.MissingScope` before it runs.
- twiceshy's own answers reach the model as an error ``ToolOutput`` (``is_error=True``, the
  error itself in ``exception``) carrying its text for the model, never "try again": an unknown
  outcome, an identical call in progress, a refused key, a result that ran but could not be
  kept, and a KEYED tool out of attempts (it may have taken effect; an identical call later is
  safe). Other errors are raised as the tool raised them, and LlamaIndex answers them as usual.
- The model reads the same on the first call and on every replay: the function's result as the
  ledger stores it, rebuilt as its return annotation (LlamaIndex's content blocks as blocks),
  then made into the tool's output by LlamaIndex's own rules and the tool's ``callback``.
"""

from __future__ import annotations

try:
    from llama_index.core.base.llms.types import ContentBlock
    from llama_index.core.bridge.pydantic import BaseModel, ValidationError
    from llama_index.core.tools import BaseTool, FunctionTool, ToolOutput
    from workflows import Context
    from workflows.errors import WorkflowRuntimeError
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.llama_index needs LlamaIndex: pip install 'twiceshy[llama-index]'"
        f" ({exc})"
    ) from exc

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import pydantic

from .. import Effect, Guard, Ledger, MissingScope, current_scope
from ._calls import ArgumentsDoNotFit, effect_at_of, for_the_model, received, refuse_generator
from ._core import ReturnOf
from ._declared import Declarations

__all__ = ["ScopeFunction", "protect", "protect_tool", "run_scope"]

ScopeFunction: TypeAlias = Callable[["Context[Any] | None"], "str | None"]
"""``scope(ctx)``: the scope of one call, from the running step's ``Context`` (``None`` outside
a workflow); ``None`` from it means the call has no scope."""

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def run_scope(ctx: Context[Any] | None = None) -> str | None:
    """The id of the workflow run a tool is called in: ``agent.run(..., run_id=...)``.

    ``ctx`` is a running step's ``Context``; by default the step's that is running now. ``None``
    outside a workflow.
    """
    if ctx is None:
        try:
            ctx = Context.get_step_context()
        except WorkflowRuntimeError:
            return None
    # The run's adapter holds its id (LlamaIndex Workflows 2.x); a step's context reaches it.
    adapter = getattr(getattr(ctx, "_face", None), "_internal_adapter", None)
    run_id = getattr(adapter, "run_id", None)
    return run_id if isinstance(run_id, str) and run_id else None


def protect(
    tools: Iterable[FunctionTool | Callable[..., Any]],
    ledger: Ledger,
    *,
    effects: Mapping[str, Effect | Guard] | None = None,
    default: Effect | None = None,
    scope: ScopeFunction | None = None,
) -> list[FunctionTool]:
    """Copies of ``tools`` whose every call goes through ``ledger``.

    Args:
        tools: ``FunctionTool`` objects, or plain functions (made into tools with
            ``FunctionTool.from_defaults``, as an agent would).
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options (attempts,
            ``definite=``, ``key_args=``, ``reconcile=``...).
        default: the effect class of the tools not named in ``effects``.
        scope: ``scope(ctx)`` gives each call's scope instead of ``twiceshy.current_scope()``
            and the workflow's run id (see the module's documentation).

    Returns:
        The protected tools, in order, to give to the agent (``FunctionAgent(tools=...)``).

    Raises:
        TypeError: a tool is not a ``FunctionTool`` or a function, an effect is of no known
            kind, or a recorded tool's function is a generator.
        EffectNotDeclared: a tool has no effect class (a ``ValueError``).
        ValueError: ``effects`` names a tool not given, or a guard named for another tool.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
    declarations = Declarations(effects, default)
    protected: list[FunctionTool] = []
    for given in tools:
        tool = _as_function_tool(given)
        guard = declarations.guard(
            tool.metadata.get_name(), functools.partial(_guard_for, ledger, tool)
        )
        protected.append(protect_tool(tool, guard, scope=scope))
    declarations.check_all_used()
    return protected


def protect_tool(
    tool: FunctionTool, guard: Guard, *, scope: ScopeFunction | None = None
) -> FunctionTool:
    """A copy of ``tool`` whose every call (``call``, ``acall``) goes through ``guard``.

    The copy keeps the tool's function, metadata (name, description, schema, ``return_direct``),
    ``callback`` and ``partial_params``; the tool itself is left unchanged. The guard answers the
    first caller with the result as stored (``with_stored_answers()``), so the model reads the
    same on the first call and on every replay.

    Args:
        tool: the ``FunctionTool`` to protect.
        guard: its guard, from ``ledger.guard(name, effect=..., ...)``; the guard's name is the
            tool's name in keys.
        scope: where the scope comes from (see :func:`protect`).

    Raises:
        TypeError: ``tool`` is not a ``FunctionTool``, ``guard`` not a guard, or the guard
            keeps records and the tool's function is a generator.
        ValueError: the guard is named after another tool.
    """
    if not isinstance(tool, FunctionTool):
        raise TypeError(f"only a FunctionTool can be protected, not {type(tool).__name__}")
    if not isinstance(guard, Guard):
        raise TypeError("guard= must be a twiceshy.Guard, from ledger.guard(...)")
    if guard.name != tool.metadata.get_name():
        raise ValueError(
            f"the guard for the tool {tool.metadata.get_name()!r} is named {guard.name!r}"
        )
    if scope is not None and not callable(scope):
        raise TypeError("scope= must be a function of the step's Context, or None")
    if guard.recorded:
        refuse_generator(tool.real_fn, guard.name)
        refuse_generator(tool.async_fn, guard.name)
    return _ProtectedTool(tool, guard.with_stored_answers(), scope)


def _as_function_tool(given: object) -> FunctionTool:
    if isinstance(given, FunctionTool):
        return given
    if isinstance(given, BaseTool):
        raise TypeError(
            f"only FunctionTool objects can be protected, not {type(given).__name__}; list "
            "other tools next to the protected ones"
        )
    if callable(given):
        return FunctionTool.from_defaults(given)
    raise TypeError(f"a tool must be a FunctionTool or a function, not {type(given).__name__}")


def _guard_for(ledger: Ledger, tool: FunctionTool, effect: Effect) -> Guard:
    """The guard ``protect`` builds for a tool declared by its effect class alone: results
    replay as the function's return annotation, and a function that calls
    ``twiceshy.point_of_no_return()`` says where its effect starts."""
    fn = tool.real_fn
    if effect is not Effect.SAFE:  # said before its return annotation is found unstorable
        refuse_generator(fn, tool.metadata.get_name())
    returns = ReturnOf(fn) if effect is not Effect.SAFE else None
    return ledger.guard(
        tool.metadata.get_name(), effect=effect, returns=returns, effect_at=effect_at_of(fn)
    )


@dataclass(frozen=True, slots=True)
class _Call:
    """One call as the function receives it, and the intent it names."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arguments: dict[str, Any]
    shown: dict[str, Any]
    """The keyword arguments as LlamaIndex shows them in ``ToolOutput.raw_input``."""


class _ProtectedTool(FunctionTool):
    """A ``FunctionTool`` whose calls go through a guard: a copy of the tool it protects."""

    def __init__(self, tool: FunctionTool, guard: Guard, scope: ScopeFunction | None) -> None:
        # Every attribute of the tool (function, metadata, callbacks, partial parameters, the
        # context parameter, field defaults), so that LlamaIndex calls the copy as the tool.
        vars(self).update(vars(tool))
        self._guard = guard
        self._scope_function = scope

    @property
    def guard(self) -> Guard:
        """The guard every call of this tool goes through."""
        return self._guard

    def call(self, *args: Any, **kwargs: Any) -> ToolOutput:
        """Call the tool through the ledger, blocking: once per intent."""
        call = self._prepare(args, kwargs)
        scope = self._call_scope()
        try:
            raw = self._guard.call(
                call.arguments, lambda: self._fn(*call.args, **call.kwargs), scope=scope
            )
        except Exception as exc:
            return self._answer(call, exc, scope)
        output = self._output(call, raw)
        return self._overridden(call, raw, output, self._run_sync_callback(raw))

    async def acall(self, *args: Any, **kwargs: Any) -> ToolOutput:
        """Call the tool through the ledger: once per intent; a retry gets the first outcome."""
        call = self._prepare(args, kwargs)
        scope = self._call_scope()
        try:
            raw = await self._guard.acall(
                call.arguments, lambda: self._async_fn(*call.args, **call.kwargs), scope=scope
            )
        except Exception as exc:
            return self._answer(call, exc, scope)
        output = self._output(call, raw)
        return self._overridden(call, raw, output, await self._run_async_callback(raw))

    # -- shared, no I/O --------------------------------------------------------------------

    def _prepare(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _Call:
        """The call as the function receives it, and the arguments that name its intent.

        What LlamaIndex's ``FunctionTool`` hands the function (its partial parameters, the
        call's own arguments, then its field defaults for the ones left out), with what the
        model sent validated by the tool's schema first.

        Raises:
            ValueError: the function takes a workflow ``Context`` and none was given (as
                ``FunctionTool`` raises).
            TypeError: the arguments do not fit the function (as its call would raise it);
                nothing is claimed.
        """
        given = {**self.partial_params, **kwargs}
        context = self.ctx_param_name
        if self.requires_context and context is not None and context not in given:
            raise ValueError("Context is required for this tool")
        sent = {name: value for name, value in given.items() if name != context}
        checked = {**given, **_validated(self.metadata.fn_schema, self.real_fn, sent)}
        full = {**self._field_defaults, **checked}
        inject = (context,) if context is not None else ()
        try:
            arguments = received(self.real_fn, args, full, inject=inject, sent=sent)
        except ArgumentsDoNotFit as exc:
            # Python refuses the call before the function runs: no intent to claim.
            raise exc.as_raised() from None
        except (TypeError, ValueError):
            # A signature that cannot be read: the function may still take the call, which
            # is keyed by what was sent.
            arguments = dict(sent)
        shown = {name: value for name, value in full.items() if name != context}
        return _Call(tuple(args), full, arguments, shown)

    def _call_scope(self) -> str | None:
        """The call's scope (see :func:`protect`); ``MissingScope`` for a recorded tool with
        none (a SAFE tool needs none: where there is one, it names its nested runs' scope)."""
        ctx = _step_context()
        if self._scope_function is not None:
            scope = self._scope_function(ctx)
            where = "the scope= function returned no scope"
        else:
            scope = current_scope() or run_scope(ctx)
            where = (
                "it was called outside any workflow run and any twiceshy.run(...): run the "
                "agent (agent.run(..., run_id=...)) or enter `with twiceshy.run(run_id):`"
            )
        if isinstance(scope, str) and scope:
            return scope
        if not self._guard.recorded:
            return None
        raise MissingScope(
            f"the tool {self._guard.name!r} cannot be protected: {where}; it did not run"
        )

    def _output(self, call: _Call, raw: Any) -> ToolOutput:
        """The tool's output for ``raw`` by LlamaIndex's own rules (``FunctionTool.acall``)."""
        return ToolOutput(
            blocks=self._parse_tool_output(_as_blocks(raw)),
            tool_name=self.metadata.get_name(),
            raw_input={"args": call.args, "kwargs": call.shown},
            raw_output=raw,
        )

    def _overridden(
        self, call: _Call, raw: Any, output: ToolOutput, override: ToolOutput | str | None
    ) -> ToolOutput:
        """The output, or what the tool's ``callback`` made of it."""
        if override is None:
            return output
        if isinstance(override, ToolOutput):
            return override
        return ToolOutput(
            content=str(override),
            tool_name=self.metadata.get_name(),
            raw_input={"args": call.args, "kwargs": call.shown},
            raw_output=raw,
        )

    def _answer(self, call: _Call, error: Exception, scope: str | None) -> ToolOutput:
        """twiceshy's text for ``error`` as an error output; the error itself when it has none."""
        text = for_the_model(self._guard, error, call.arguments, scope=scope)
        if text is None:
            raise error
        return ToolOutput(
            content=text,
            tool_name=self.metadata.get_name(),
            raw_input={"args": call.args, "kwargs": call.shown},
            raw_output=text,
            is_error=True,
            exception=error,
        )


def _step_context() -> Context[Any] | None:
    try:
        return Context.get_step_context()
    except WorkflowRuntimeError:
        return None


def _validated(
    schema: type[BaseModel] | None, fn: Callable[..., Any], sent: Mapping[str, Any]
) -> dict[str, Any]:
    """The values of ``sent`` as the tool's schema validates them (``"2"`` for an ``int`` as
    ``2``, a nested model as the model), for the names the schema and the function share; an
    empty mapping when the schema is not the function's or refuses them (the function then
    receives them as sent, as without twiceshy)."""
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        return {}
    fields = schema.model_fields
    if not fields or not set(fields) <= _parameters(fn):
        return {}  # a schema of its own (given as fn_schema=): not the function's parameters
    chosen = {name: value for name, value in sent.items() if name in fields}
    try:
        model = schema.model_validate(chosen)
    except Exception:  # refused, or a schema pydantic cannot complete (an unresolved name)
        return {}
    return {name: getattr(model, name) for name in chosen}


def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        return _signature_names(fn)
    except TypeError:  # a callable that cannot be cached: read afresh
        return _signature_names.__wrapped__(fn)


@functools.lru_cache(maxsize=256)
def _signature_names(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters if p.kind not in _VARIADIC)


@functools.cache
def _blocks() -> pydantic.TypeAdapter[Any]:
    """Validates one of LlamaIndex's content blocks from its JSON form."""
    return pydantic.TypeAdapter(ContentBlock)


def _as_blocks(raw: Any) -> Any:
    """``raw``, with LlamaIndex's content blocks rebuilt from their stored JSON form, so that a
    replayed image or text block reaches the model as a block, not as its fields."""
    if isinstance(raw, Mapping) and isinstance(raw.get("block_type"), str):
        try:
            return _blocks().validate_python(raw)
        except ValidationError:
            return raw
    if isinstance(raw, list) and raw and all(isinstance(item, Mapping) for item in raw):
        blocks = [_as_blocks(item) for item in raw]
        if all(not isinstance(block, Mapping) for block in blocks):
            return blocks
    return raw
