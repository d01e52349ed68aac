"""CrewAI: every call of a protected tool goes through a twiceshy ledger.

One line protects an agent's tools (``from twiceshy import KEYED, UNSAFE``)::

    tools = protect([create_charge, send_sms], ledger, effects={"create_charge": KEYED,
                                                                "send_sms": UNSAFE})

and each run names its scope, an id the application keeps (an order id, a persisted Flow's
``state.id``)::

    with twiceshy.run(order_id):
        crew.kickoff(inputs=...)

How a call is handled:

- Where: the function the tool runs (a ``@tool`` function, a ``BaseTool`` subclass's ``_run``
  / ``_arun``), so every path meets the ledger: a native tool call, a text (ReAct) tool call,
  and each of CrewAI's own reruns of a failing call (a text tool call that raises is run again,
  up to six times by default). The tool-call id, new on every re-call, is never part of it.
- The intent is ``(scope, tool, arguments)``, the arguments being those the function receives:
  CrewAI validates the model's arguments with the tool's ``args_schema`` (``"2"`` for an
  ``int`` is ``2``, an omitted parameter its default) and hands the function the result, which
  names the intent. A value a ``default_factory`` made for an argument the model left out (a
  fresh request id) is left out of it.
- A call the function never runs never meets the ledger: arguments the ``args_schema`` refuses
  (a required one left out) are refused by CrewAI before the function is called, as without
  twiceshy; arguments the schema lets through but the function does not take raise the
  ``TypeError`` Python raises for them, before anything is claimed, and CrewAI answers it as a
  tool's error. The next well-formed call runs.
- A recorded tool (KEYED, UNSAFE, or SAFE with ``record=True``) whose function is a generator
  is refused by ``protect``: its effects would happen after its call was recorded.
- The scope is, in this order: an enclosing ``twiceshy.run(...)`` (an id the application keeps
  across restarts); the scope a protected call passes on to the runs started inside it (a crew
  a tool kicks off); a guard's own ``scope=``. CrewAI's own ids do not survive a restart: a
  ``Crew``'s ``id`` is drawn per object, and the ``current_flow_id`` a tool sees is drawn per
  kickoff even for a persisted Flow (1.15.30), so none is used. With no scope a recorded tool
  raises :class:`twiceshy.MissingScope` before it runs.
- twiceshy's own answers are returned as a ``ToolFailure`` (``retryable=False``) carrying its
  text for the model, never "try again": an unknown outcome, an identical call in progress, a
  refused key, and a KEYED tool out of attempts (it may have taken effect; an identical call
  later is safe). Returned, not raised, so CrewAI does not rerun the call; with the tool's or
  agent's ``tool_failure_policy="raise"`` the run stops instead. A result that ran but could
  not be kept reads as text (it succeeded).
- Other errors are raised as the tool raised them, and CrewAI answers (and reruns) as usual:
  their rerun is safe, because the ledger replays certain failures (``definite=``) and an error
  before the tool's ``twiceshy.point_of_no_return()`` ran nothing. A ``ToolFailure`` the tool
  returns is a certain failure: recorded and replayed.
- The model reads the same on the first call and on every replay: the result as the ledger
  stores it, rebuilt as the function's return annotation; a result with no JSON form is kept
  as the text CrewAI shows the model for it, ``str(result)``.
"""

from __future__ import annotations

try:
    from crewai.tools import BaseTool
    from crewai.tools.base_tool import Tool
    from crewai.tools.structured_tool import CrewStructuredTool
    from crewai.tools.tool_failure import ToolFailure
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        "twiceshy.integrations.crewai needs CrewAI 1.15.9 or later: "
        f"pip install 'twiceshy[crewai]' ({exc})"
    ) from exc

import contextvars
import copy
import functools
import inspect
import json
import sys
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

from pydantic import PrivateAttr

from .. import Effect, Guard, Ledger, ResultNotStorable
from ._calls import (
    ArgumentsDoNotFit,
    effect_at_of,
    factory_fields,
    for_the_model,
    received,
    refuse_generator,
)
from ._core import ResultCodec, ReturnOf
from ._declared import Declarations

__all__ = ["protect", "protect_tool"]

_PLAIN = (str, int, float, bool, type(None))
"""Results the ledger keeps as they are, without a trial encoding."""

_ANY_SIZE = ResultCodec(max_bytes=sys.maxsize)
"""Tells a result with no JSON form from one only too large to keep."""

_SENT: contextvars.ContextVar[tuple[int, Mapping[str, Any]] | None] = contextvars.ContextVar(
    "twiceshy_crewai_sent", default=None
)
"""The arguments the model sent for the call being made, by the id of the tool it reached."""


class _Reported(Exception):
    """Carries a ``ToolFailure`` the tool returned through the ledger, as a certain failure.

    Its message is the failure as JSON, so that a replay rebuilds the same failure.
    """


def protect(
    tools: Iterable[BaseTool],
    ledger: Ledger,
    *,
    effects: Mapping[str, Effect | Guard] | None = None,
    default: Effect | None = None,
) -> list[BaseTool]:
    """Copies of ``tools`` whose every call goes through ``ledger``.

    Args:
        tools: CrewAI tools: ``@tool`` functions or ``BaseTool`` subclasses' instances.
        ledger: where intents are claimed and outcomes kept.
        effects: each tool's effect class by tool name (``twiceshy.SAFE``, ``KEYED``,
            ``UNSAFE``), or a :class:`twiceshy.Guard` of that name for more options
            (``attempts=``, ``definite=``, ``key_args=``, ``reconcile=``, ``scope=``...).
        default: the effect class of tools not named in ``effects``.

    Returns:
        The protected tools, in order, to give to ``Agent(tools=[...])``.

    Raises:
        TypeError: a tool is not a CrewAI ``BaseTool``, an effect is of the wrong kind, or a
            recorded tool's function is a generator.
        EffectNotDeclared: a tool has no effect class (a ``ValueError``).
        ValueError: ``effects`` names a tool that is not given, a guard is named for another
            tool, or a tool name is not usable in keys.
        ResultNotStorable: a KEYED or UNSAFE tool's return annotation has no JSON form.
    """
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a twiceshy.Ledger, not {type(ledger).__name__}")
    declarations = Declarations(effects, default)
    protected: list[BaseTool] = []
    for tool in tools:
        if not isinstance(tool, BaseTool):
            raise TypeError(
                f"only CrewAI tools (a @tool function or a BaseTool) can be protected, not "
                f"{type(tool).__name__}"
            )
        guard = declarations.guard(tool.name, functools.partial(_guard_for, ledger, tool))
        protected.append(protect_tool(tool, guard))
    declarations.check_all_used()
    return protected


def protect_tool(tool: BaseTool, guard: Guard) -> BaseTool:
    """A copy of ``tool`` whose every call goes through ``guard``.

    The copy keeps the tool's name, description, schemas, usage limit, cache function and
    failure policy; the tool given is left as it was. The guard answers the first caller with
    the result as stored (``with_stored_answers()``), so the model reads the same text on the
    first call and on every replay; a ``ToolFailure`` the tool returns is recorded as a certain
    failure and replayed.

    Raises:
        TypeError: ``tool`` is not a CrewAI ``BaseTool``, ``guard`` is not a guard, or the guard
            keeps records and the tool's function is a generator.
    """
    if not isinstance(tool, BaseTool):
        raise TypeError(f"only a CrewAI BaseTool can be protected, not {type(tool).__name__}")
    if not isinstance(guard, Guard):
        raise TypeError("guard= must be a twiceshy.Guard, from ledger.guard(...)")
    if guard.recorded:
        _refuse_generator(tool)
    guard = guard.with_errors(definite=(_Reported,)).with_stored_answers()
    copied = copy.copy(tool)
    # A class of its own that captures the model's arguments and, for a BaseTool subclass,
    # sends _run / _arun through the guard; the object keeps every field of the original.
    object.__setattr__(copied, "__class__", _protected_class(type(tool)))
    copied.__pydantic_private__ = {**(tool.__pydantic_private__ or {}), "_twiceshy": guard}
    if isinstance(tool, Tool):
        # A @tool's every path (run, _run, _arun, its structured form) calls its func.
        cast("Tool[..., Any]", copied).func = _guarded(
            tool.func, _Call(tool.func, guard, tool), id(copied)
        )
    return copied


# -- the protected classes ------------------------------------------------------------------

_CLASSES: weakref.WeakKeyDictionary[type[BaseTool], type[BaseTool]] = weakref.WeakKeyDictionary()


def _protected_class(cls: type[BaseTool]) -> type[BaseTool]:
    """The protected twin of a tool class (made once per class)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = _make_class(cls)
    return made


def _make_class(cls: type[BaseTool]) -> type[BaseTool]:
    """A subclass of ``cls`` whose calls carry the model's arguments to the guarded function,
    and whose ``_run`` / ``_arun`` go through the guard (a ``@tool``'s go through its func)."""

    def run(self: BaseTool, *args: Any, **kwargs: Any) -> Any:
        # A native tool call: the model's arguments are at hand for the intent.
        token = _SENT.set((id(self), kwargs) if not args else None)
        try:
            return cls.run(self, *args, **kwargs)
        finally:
            _SENT.reset(token)

    async def arun(self: BaseTool, *args: Any, **kwargs: Any) -> Any:
        token = _SENT.set((id(self), kwargs) if not args else None)
        try:
            return await cls.arun(self, *args, **kwargs)
        finally:
            _SENT.reset(token)

    def to_structured_tool(self: BaseTool) -> CrewStructuredTool:
        # A text tool call's form: its calls carry the model's arguments too.
        structured = cls.to_structured_tool(self)
        object.__setattr__(structured, "__class__", _Capturing)
        private = structured.__pydantic_private__ or {}
        structured.__pydantic_private__ = {**private, "_protected": id(self)}
        return structured

    body: dict[str, Any] = {
        "__module__": __name__,
        "__qualname__": f"Protected{cls.__name__}",
        "__annotations__": {"_twiceshy": "Any"},
        "_twiceshy": PrivateAttr(default=None),
        "run": run,
        "arun": arun,
        "to_structured_tool": to_structured_tool,
    }
    if not issubclass(cls, Tool):
        # A BaseTool subclass's work is its _run (sync or async) and its _arun.
        body["_run"] = _guarded_method(cls._run)
        if cls._arun is not BaseTool._arun:
            body["_arun"] = _guarded_method(cls._arun)
    return type(f"Protected{cls.__name__}", (cls,), body)


class _Capturing(CrewStructuredTool):
    """A protected tool's structured form: its calls carry the model's arguments to the
    guarded function, which names the intent by what it receives and what was sent."""

    _protected: int = PrivateAttr(default=0)

    def invoke(
        self, input: str | dict[str, Any], config: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        token = _SENT.set((self._protected, _parsed(input)))
        try:
            return super().invoke(input, config, **kwargs)
        finally:
            _SENT.reset(token)

    async def ainvoke(
        self, input: str | dict[str, Any], config: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        token = _SENT.set((self._protected, _parsed(input)))
        try:
            # A sync function runs in the loop's executor, which copies no context: the call
            # is made from here with this context, so the guard sees the run's scope too.
            if not inspect.iscoroutinefunction(self.func):
                func = self.func
                context = contextvars.copy_context()
                self.func = functools.partial(context.run, func)
                try:
                    return await super().ainvoke(input, config, **kwargs)
                finally:
                    self.func = func
            return await super().ainvoke(input, config, **kwargs)
        finally:
            _SENT.reset(token)


def _parsed(input: str | Mapping[str, Any]) -> Mapping[str, Any]:
    """The model's arguments as a mapping (CrewAI parses JSON text the same way)."""
    if isinstance(input, str):
        try:
            value = json.loads(input)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return input


# -- the guarded call -----------------------------------------------------------------------


class _Call:
    """One protected function: its guard, how its arguments name the intent, and the answer."""

    __slots__ = ("fn", "guard", "made", "tool")

    fn: Callable[..., Any]
    guard: Guard
    made: frozenset[str]
    tool: BaseTool

    def __init__(self, fn: Callable[..., Any], guard: Guard, tool: BaseTool) -> None:
        self.fn = fn
        self.guard = guard
        self.tool = tool
        self.made = factory_fields(tool.args_schema)

    def arguments(self, owner: int, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The arguments the function receives, by name; a factory's value for what the model
        left out is left out (when the model's arguments for this call are known).

        Raises:
            TypeError: the arguments do not fit the function: raised as its call would raise
                it, before anything is claimed.
        """
        sent = _SENT.get()
        given = sent[1] if sent is not None and sent[0] == owner else None
        try:
            return received(self.fn, args, kwargs, sent=given, made=self.made)
        except ArgumentsDoNotFit as exc:
            raise exc.as_raised() from None
        except (TypeError, ValueError):
            if args:  # positional values with no names to key them by
                raise
            # A signature that cannot be read: the function may still take the call, which is
            # keyed by what it is handed.
            return dict(kwargs)

    def kept(self, value: Any) -> Any:
        """The result as the ledger is to keep it: a ``ToolFailure`` as a certain failure, a
        value with no JSON form as the text CrewAI shows the model for it."""
        if isinstance(value, ToolFailure):
            raise _Reported(value.model_dump_json())
        if type(value) in _PLAIN or not self.guard.recorded:
            return value
        try:
            _ANY_SIZE.encode(value)
        except ResultNotStorable:
            try:
                return str(value)
            except Exception:  # no text either: the ledger records that it ran, all the same
                return value
        return value

    def answer(self, error: Exception, arguments: Mapping[str, Any]) -> Any:
        """What the model reads for ``error``: twiceshy's text, a recorded failure, or a raise."""
        if isinstance(error, _Reported):
            return ToolFailure.model_validate_json(str(error))
        text = for_the_model(self.guard, error, arguments)
        if text is None:
            raise error
        if isinstance(error, ResultNotStorable):  # it ran and succeeded: not a failure
            return text
        return ToolFailure(message=text, retryable=False)


def _guarded(fn: Callable[..., Any], call: _Call, owner: int) -> Callable[..., Any]:
    """``fn`` (a ``@tool`` function of the tool whose id is ``owner``) sent through the
    guard of ``call``, with its signature."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def aguarded(*args: Any, **kwargs: Any) -> Any:
            return await _acall(call, owner, fn, args, kwargs)

        return aguarded

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        return _call(call, owner, fn, args, kwargs)

    return guarded


def _guarded_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A ``BaseTool`` subclass's ``_run`` or ``_arun``, sent through the tool's guard."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def aguarded(self: BaseTool, *args: Any, **kwargs: Any) -> Any:
            bound = functools.partial(method, self)
            return await _acall(_method_call(self, method), id(self), bound, args, kwargs)

        return aguarded

    @functools.wraps(method)
    def guarded(self: BaseTool, *args: Any, **kwargs: Any) -> Any:
        bound = functools.partial(method, self)
        return _call(_method_call(self, method), id(self), bound, args, kwargs)

    return guarded


def _method_call(tool: BaseTool, method: Callable[..., Any]) -> _Call:
    """The protected call of a ``BaseTool`` subclass's method, bound to its instance."""
    guard = tool.__pydantic_private__.get("_twiceshy") if tool.__pydantic_private__ else None
    if not isinstance(guard, Guard):
        raise TypeError(
            f"the tool {tool.name!r} is a protected copy without its guard (rebuilt from a "
            "checkpoint?): protect the original tool again with twiceshy's protect()"
        )
    return _Call(method.__get__(tool), guard, tool)


def _call(
    call: _Call, owner: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
) -> Any:
    arguments = call.arguments(owner, args, kwargs)

    def work() -> Any:
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):  # a sync _run answering a coroutine: CrewAI's way
            value = _run_awaitable(value)
        return call.kept(value)

    try:
        return call.guard.call(arguments, work)
    except Exception as exc:
        return call.answer(exc, arguments)


async def _acall(
    call: _Call, owner: int, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], kwargs: Any
) -> Any:
    arguments = call.arguments(owner, args, kwargs)

    async def work() -> Any:
        return call.kept(await fn(*args, **kwargs))

    try:
        return await call.guard.acall(arguments, work)
    except Exception as exc:
        return call.answer(exc, arguments)


def _run_awaitable(value: Awaitable[Any]) -> Any:
    import asyncio

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


# -- guards ---------------------------------------------------------------------------------


def _function_of(tool: BaseTool) -> Callable[..., Any]:
    """The function a call of ``tool`` runs: a ``@tool``'s function, else ``_run``."""
    if isinstance(tool, Tool):
        return tool.func
    return type(tool)._run


def _refuse_generator(tool: BaseTool) -> None:
    """Refuse a tool whose function (a ``@tool``'s, or a subclass's ``_run`` / ``_arun``) is a
    generator: CrewAI takes the generator for its result, the body not yet run."""
    refuse_generator(_function_of(tool), tool.name)
    if not isinstance(tool, Tool) and type(tool)._arun is not BaseTool._arun:
        refuse_generator(type(tool)._arun, tool.name)


def _guard_for(ledger: Ledger, tool: BaseTool, effect: Effect) -> Guard:
    """The guard ``protect`` builds for a tool declared by its effect class alone."""
    if effect is not Effect.SAFE:  # said before its return annotation is found unstorable
        _refuse_generator(tool)
    fn = _function_of(tool)
    effect_at = effect_at_of(fn)
    returns = ReturnOf(fn) if effect is not Effect.SAFE else None
    try:
        return ledger.guard(tool.name, effect=effect, returns=returns, effect_at=effect_at)
    except ResultNotStorable:
        # A return type with no JSON form: CrewAI shows the model str() of such a result, and
        # the ledger keeps that text (see _Call.kept).
        return ledger.guard(tool.name, effect=effect, effect_at=effect_at)
