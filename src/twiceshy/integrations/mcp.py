"""Retry-safe tools on an MCP server built with the official ``mcp`` SDK (2.x, ``MCPServer``).

    protect(server, ledger, effects={"charge_card": twiceshy.KEYED})

That line adds a server middleware that hands every ``tools/call`` to a :class:`twiceshy.Guard`;
every other request passes untouched. Install with ``pip install 'twiceshy[mcp]'``.

- **Intent**: the tool's name and the arguments its function receives: the request's
  ``arguments`` after the server's own validation (``"5"`` for an ``int`` is ``5``, an omitted
  parameter is its default, a nested model is the model it becomes), bound to the function's
  signature; the context and resolved parameters the SDK injects are no part of it. A tool the
  middleware cannot look up is named by its JSON arguments, with the input schema's defaults
  for omitted ones. The run scope is the one the client names in the request's ``_meta`` under
  :data:`SCOPE_META_KEY` (``"dev.twiceshy/scope"``):
  ``await client.call_tool("charge_card", args, meta=twiceshy_meta(run_id))``. A client
  that derives its own key sends :data:`KEY_META_KEY` (``"dev.twiceshy/key"``) instead. Without
  either, the ``scope=`` callable of the middleware is asked; without that, the call does not run
  and the client gets an ``isError`` result saying it must send the scope.
- **Effect class**: an explicit entry in ``effects=`` wins; otherwise the tool's MCP annotations
  decide (:func:`effect_from_annotations`): ``readOnlyHint`` or ``idempotentHint`` → ``SAFE``,
  anything else → ``UNSAFE``. ``KEYED`` is never guessed: declare it. A tool whose function calls
  :func:`twiceshy.point_of_no_return` is guarded with ``effect_at="mark"``.
- **Honest failures**: twiceshy's answers (an unknown outcome, a call in progress, a KEYED tool
  out of attempts, a result that was not kept, a refused key) reach the client as a
  ``CallToolResult`` with ``isError: true`` and twiceshy's message for the model. A retry of a
  finished intent gets the first call's result, replayed from the ledger as it went on the wire.
- **Replays marked**: a result answered without running the tool (replayed from the ledger,
  shared with an identical call running here, a reconciler's answer: ``twiceshy.was_replayed()``)
  carries ``"dev.twiceshy/replayed": true`` in its ``_meta`` (:data:`REPLAYED_META_KEY`), on every
  transport; a result of this call's own run carries no such entry. Over streamable HTTP, wrap
  the server's ASGI app in :class:`ReplayedHeaderMiddleware` to also answer such a call with the
  response header ``Idempotent-Replayed: true``:
  ``app = ReplayedHeaderMiddleware(server.streamable_http_app())``.

The SDK turns a tool's exception into an ``isError`` result before any middleware sees it, so an
``isError`` answer counts as an ambiguous failure (:class:`ToolFailed`): the tool may have taken
effect, unless it had not yet called ``point_of_no_return()``. A call the tool never runs is
never claimed: arguments the server's own validator refuses (a required one left out, a value
of the wrong type) are passed on to the server, which refuses them as without twiceshy; arguments
the validator accepts but the function does not take (a positional-only parameter, which the
server passes by name) are answered with the ``isError`` result the server makes of the
``TypeError`` the call would raise, without calling it. A recorded tool whose function is an
async generator is refused the same way (the server would show the client the generator object,
its body never run); a sync generator is consumed by the server inside the call the ledger
wraps, and is guarded as any tool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Literal, TypeVar, cast

from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

try:
    from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
    from mcp.server.mcpserver import MCPServer
    from mcp.types import CallToolResult, RequestParamsMeta, TextContent, ToolAnnotations
    from mcp.types.methods import is_input_required, serialize_server_result
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        f"twiceshy.integrations.mcp needs the MCP SDK 2: pip install 'twiceshy[mcp]' ({exc})"
    ) from exc

from twiceshy import Effect, Guard, Ledger, was_replayed
from twiceshy.errors import (
    KeyReuseMismatch,
    MissingScope,
    NotApplied,
    ReplayedError,
    ResultNotStorable,
    UnkeyableArgument,
)
from twiceshy.integrations._calls import (
    ANSWERED,
    ArgumentsDoNotFit,
    effect_at_of,
    for_the_model,
    received,
    refuse_generator,
    with_schema_defaults,
)

__all__ = [
    "KEY_META_KEY",
    "REPLAYED_HEADER",
    "REPLAYED_META_KEY",
    "SCOPE_META_KEY",
    "ReplayedHeaderMiddleware",
    "ToolFailed",
    "TwiceshyMiddleware",
    "effect_from_annotations",
    "protect",
    "twiceshy_meta",
]

log = logging.getLogger("twiceshy")

SCOPE_META_KEY: Final = "dev.twiceshy/scope"
"""The ``_meta`` key of a ``tools/call`` request that names the agent's run (a non-empty string)."""

KEY_META_KEY: Final = "dev.twiceshy/key"
"""The ``_meta`` key of a ``tools/call`` request that carries an explicit idempotency key."""

REPLAYED_META_KEY: Final = "dev.twiceshy/replayed"
"""The ``_meta`` key of a ``tools/call`` result answered without running the tool (``true``)."""

REPLAYED_HEADER: Final = "Idempotent-Replayed"
"""The HTTP response header (``true``) of such an answer: see :class:`ReplayedHeaderMiddleware`."""

_MARK_STATE_KEY: Final = "dev.twiceshy/replayed"
"""Where :class:`ReplayedHeaderMiddleware` leaves a request's mark in the ASGI scope's ``state``."""

_REPLAYED_HEADER_LINE: Final = (REPLAYED_HEADER.lower().encode(), b"true")

Effects = Mapping[str, Effect | Guard]
"""Declared tools: a name and its effect class, or a :class:`twiceshy.Guard` for full control."""

ScopeFallback = Callable[[ServerRequestContext[Any, Any]], str | None]
"""Asked for the scope of a request whose ``_meta`` names none; ``None`` means there is none."""

#: The refusals that happen before anything runs, and the failures replayed from the ledger:
#: the client reads them as an ``isError`` result.
REFUSALS: Final = (
    MissingScope,
    KeyReuseMismatch,
    UnkeyableArgument,
    ReplayedError,
    ResultNotStorable,
)

_EffectAt = Literal["mark", "http"] | None

_T = TypeVar("_T")

CANCELLED: Final = "the MCP request was cancelled"
"""How a tool call cancelled while it ran (the client's ``notifications/cancelled``, a dropped
connection) is told in its record, which the next identical call quotes."""


async def _uncancelled(step: Awaitable[_T]) -> _T:
    """``await step``, a cancellation raised on with :data:`CANCELLED` as its message.

    anyio's own message names its cancel scope and the task it runs in (a long repr with a file
    path), which the record's reason, and so the model, would otherwise read. The cancellation
    itself goes on: anyio recognises it through the new error's ``__context__``.
    """
    try:
        return await step
    except asyncio.CancelledError:
        raise asyncio.CancelledError(CANCELLED)  # noqa: B904 - the context is what anyio reads


def twiceshy_meta(scope: str | None = None, *, key: str | None = None) -> RequestParamsMeta:
    """The ``_meta`` of a client's ``tools/call`` that names its run (or an explicit key).

    ``await client.call_tool("charge_card", args, meta=twiceshy_meta(run_id))``. Merge it into a
    ``_meta`` of your own with ``{**mine, **twiceshy_meta(run_id)}``.

    Raises:
        ValueError: neither a scope nor a key is given, or one is not a non-empty string.
    """
    meta: dict[str, Any] = {}
    for name, value in ((SCOPE_META_KEY, scope), (KEY_META_KEY, key)):
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, not {value!r}")
            meta[name] = value
    if not meta:
        raise ValueError("give the run's scope, or an explicit key")
    return cast("RequestParamsMeta", meta)


class ToolFailed(Exception):
    """The tool answered with an error (``isError: true``) instead of a result.

    Raised inside the guard, so the ledger reads it like any exception of a tool: ambiguous by
    default (the tool may have taken effect). List it in a guard's ``definite=`` to record such
    answers as certain failures, replayed to every retry, or in ``not_applied=`` to let the intent
    run again.

    Attributes:
        result: the framework's error result, when this call produced it (``None`` on replay).
    """

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class _Interim(NotApplied):
    """A result that is not the call's outcome (an ``input_required`` round): nothing to keep."""

    def __init__(self, result: object) -> None:
        super().__init__("the tool asked the client for input")
        self.result = result


class _Mark:
    """One HTTP request's mark: whether a tool call it carried was answered by a replay."""

    __slots__ = ("replayed",)

    def __init__(self) -> None:
        self.replayed = False


class ReplayedHeaderMiddleware:
    """An ASGI middleware: ``Idempotent-Replayed: true`` on the HTTP response of a replayed call.

    Neither the ``mcp`` SDK nor FastMCP lets a tool, a middleware or a handler set a header of
    one response: their streamable HTTP transports build each response's headers themselves
    (a JSON response's content type and session id; an event stream's), and an event stream
    sends them before the tool has answered. So the header is set here, around the ASGI app:
    the middleware gives each HTTP request a mark in its scope's ``state``, which twiceshy's MCP
    middleware (this module's and :mod:`twiceshy.integrations.fastmcp`'s) sets when it answers
    that request's ``tools/call`` with a replay; the response's start is held until its first
    body message, then sent with the header if the mark is set. The mark belongs to one HTTP
    request, never to the process: concurrent requests are marked each by its own answer.

    The header is set when the answer is known before the response's first body bytes: always
    for a JSON response (``json_response=True``, and the 2026-07-28 transport's answer to a
    call that sent no notification), and for an event stream whose first event is the answer.
    An event stream that started before the answer (a progress or log notification first, a
    resumability priming event, a keep-alive ping) cannot carry it: the ``_meta`` entry
    :data:`REPLAYED_META_KEY` of the result is there on every transport.

    ``app = ReplayedHeaderMiddleware(server.streamable_http_app())`` for an ``MCPServer``;
    ``server.http_app(middleware=[Middleware(ReplayedHeaderMiddleware)])`` for FastMCP.
    """

    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        mark = _Mark()
        # The state dict is shared by every copy of the scope the app's layers make.
        scope.setdefault("state", {})[_MARK_STATE_KEY] = mark
        held: list[Message] = []

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                held.append(message)  # until the first body message: the answer may come first
                return
            if held:
                await send(_started(held.pop(), mark))
            await send(message)

        await self.app(scope, receive, sending)
        if held:  # a response with no body message at all
            await send(_started(held.pop(), mark))


def _started(start: Message, mark: _Mark) -> Message:
    """The response's start, with the replay header when its request was marked."""
    if not mark.replayed:
        return start
    headers = [
        (name, value)
        for name, value in start.get("headers", ())
        if name.lower() != _REPLAYED_HEADER_LINE[0]
    ]
    return {**start, "headers": [*headers, _REPLAYED_HEADER_LINE]}


def _mark_replayed(request: object) -> None:
    """Mark the HTTP request ``request`` (a Starlette ``Request``) as answered by a replay, for
    :class:`ReplayedHeaderMiddleware`; nothing when it is not around the app, or there is no
    HTTP request (stdio, in-memory)."""
    scope = getattr(request, "scope", None)
    state = scope.get("state") if isinstance(scope, Mapping) else None
    mark = state.get(_MARK_STATE_KEY) if isinstance(state, Mapping) else None
    if isinstance(mark, _Mark):
        mark.replayed = True


def _answered_by_replay(error: BaseException | None = None) -> bool:
    """Whether the guarded call just made (which raised ``error``, if any) was answered without
    running its tool: :func:`twiceshy.was_replayed`.

    A refusal raised before the call reached the ledger (no scope, arguments with no key form)
    is no replay, whatever an earlier call in this context was.
    """
    if isinstance(error, MissingScope | UnkeyableArgument | KeyReuseMismatch):
        return False
    return was_replayed()


def _replayed_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """``meta`` (a result's ``_meta``), with :data:`REPLAYED_META_KEY` set."""
    return {**(meta or {}), REPLAYED_META_KEY: True}


def effect_from_annotations(annotations: ToolAnnotations | None) -> Effect:
    """The effect class MCP tool annotations imply: SAFE when read-only or idempotent, else UNSAFE.

    Annotations are hints: trust them only from a server you trust (here, the server's own tools).
    They never imply ``KEYED``: whether the provider deduplicates by a key is for the tool's
    author to declare.
    """
    if annotations is not None and (annotations.read_only_hint or annotations.idempotent_hint):
        return Effect.SAFE
    return Effect.UNSAFE


class _Guards:
    """The guard of each tool: declared ones, and ones made from an effect class on first use.

    A guard made here knows where its tool's effect starts (``effect_at="mark"`` for a function
    that calls ``point_of_no_return``); a guard the user declared keeps its own.
    """

    __slots__ = ("_declared", "_effects", "_ledger", "_made")

    def __init__(self, ledger: Ledger, effects: Effects | None) -> None:
        if not isinstance(ledger, Ledger):
            raise TypeError("the first argument must be a twiceshy.Ledger")
        self._ledger = ledger
        self._declared: dict[str, Guard] = {}
        self._effects: dict[str, Effect] = {}
        self._made: dict[tuple[str, Effect, _EffectAt], Guard] = {}
        for name, spec in (effects or {}).items():
            if isinstance(spec, Guard):
                if spec.name != name:
                    raise ValueError(
                        f"effects[{name!r}] is a guard of another tool ({spec.name!r})"
                    )
                self._declared[name] = spec
            elif isinstance(spec, Effect):
                self._effects[name] = spec
                self._made[(name, spec, None)] = ledger.guard(name, effect=spec)  # checks the name
            else:
                raise TypeError(
                    f"effects[{name!r}] must be twiceshy.SAFE, KEYED, UNSAFE or a twiceshy.Guard"
                )

    def declared(self, name: str) -> bool:
        """Whether ``effects=`` names the tool ``name``."""
        return name in self._declared or name in self._effects

    def guard(
        self, name: str, implied: Effect | None, fn: Callable[..., Any] | None
    ) -> Guard | None:
        """The guard of the tool ``name``: the declared one, else one of the effect class
        declared or ``implied`` (by its annotations); ``None`` when nothing gives one.

        ``fn`` is the tool's function, when known: where its effect starts.
        """
        declared = self._declared.get(name)
        if declared is not None:
            return declared
        effect = self._effects.get(name, implied)
        if effect is None:
            return None
        effect_at = effect_at_of(fn)
        guard = self._made.get((name, effect, effect_at))
        if guard is None:
            guard = self._made[(name, effect, effect_at)] = self._ledger.guard(
                name, effect=effect, effect_at=effect_at
            )
        return guard


def _identity(
    meta: Mapping[str, Any] | None, fallback: Callable[[], str | None] | None, tool: str
) -> tuple[str | None, str | None]:
    """The ``(scope, key)`` of a request: an explicit key wins, then the scope, then the fallback.

    Raises:
        MissingScope: none of them names the run; nothing may run.
    """
    meta = meta or {}
    key = meta.get(KEY_META_KEY)
    if key is not None:
        if not isinstance(key, str) or not key:
            raise MissingScope(
                f"_meta[{KEY_META_KEY!r}] must be a non-empty string; the call did not run"
            )
        return None, key
    scope = meta.get(SCOPE_META_KEY)
    if scope is None and fallback is not None:
        scope = fallback()
    if isinstance(scope, str) and scope:
        return scope, None
    raise MissingScope(
        f"the tool {tool!r} is protected by twiceshy and needs the agent's run scope: the client "
        f"must send it in the request's _meta as {SCOPE_META_KEY!r} (a non-empty string, the same "
        "on every retry of the run). The call did not run."
    )


def _text_of(content: object) -> str:
    """The text blocks of a result's content, joined: what an error result says."""
    texts: list[str] = []
    if isinstance(content, list):
        for block in content:
            text = block.get("text") if isinstance(block, dict) else getattr(block, "text", None)
            if isinstance(text, str):
                texts.append(text)
    return "\n".join(texts) or "the tool reported an error"


def _as_dict(result: HandlerResult) -> dict[str, Any]:
    """A handler's result as the wire dict the SDK sends (already one, past the handler)."""
    if result is None:
        return {}
    if isinstance(result, BaseModel):
        return result.model_dump(by_alias=True, mode="json", exclude_none=True)
    return dict(result)


def _shaped(ctx: ServerRequestContext[Any, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """A ``tools/call`` result in the wire shape of the request's protocol version."""
    try:
        return serialize_server_result("tools/call", ctx.protocol_version, data)
    except (KeyError, ValueError):  # an unknown version, or a result of an extension's shape
        return dict(data)


def _marked(
    ctx: ServerRequestContext[Any, Any], data: Mapping[str, Any], error: BaseException | None = None
) -> dict[str, Any]:
    """``data``, the answer to a guarded call, marked as a replay if it is one: its ``_meta``
    entry, and the HTTP request's mark for :class:`ReplayedHeaderMiddleware`."""
    if not _answered_by_replay(error):
        return dict(data)
    _mark_replayed(ctx.request)
    meta = data.get("_meta")
    return {**data, "_meta": _replayed_meta(meta if isinstance(meta, Mapping) else None)}


def _error_result(ctx: ServerRequestContext[Any, Any], text: str) -> dict[str, Any]:
    """An ``isError`` result carrying ``text`` for the model."""
    result = CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)
    return _shaped(ctx, _as_dict(result))


_NO_LOOKUP: Final = object()
"""The server offers no lookup of its tools' registrations."""


def _registered(server: MCPServer[Any] | None, name: str) -> Any:
    """The server's own registration of the tool ``name`` (``None`` for a tool it does not
    know), or :data:`_NO_LOOKUP`.
    """
    # MCPServer has no public per-name tool lookup; the tool manager is feature-detected.
    manager = getattr(server, "_tool_manager", None)
    get_tool = getattr(manager, "get_tool", None)
    if not callable(get_tool):
        return _NO_LOOKUP
    return get_tool(name)


def _intent(tool: Any, arguments: Mapping[str, Any], schema: object) -> dict[str, Any] | None:
    """The arguments that name the intent: those the tool's function receives (docs/design.md §2).

    That is the server's own validation of ``arguments`` (``FuncMetadata.validate_arguments``,
    the very step ``Tool.run`` takes first), bound to the function's signature without the
    context and resolved parameters the SDK injects. Where the server offers no such step, the
    JSON arguments with the input schema's defaults.

    Returns:
        ``None`` when the server will refuse the call before its tool runs (an unknown tool,
        arguments its validator refuses): ``MCPServer`` answers both as ``isError``, which the
        middleware could not tell from a failure of the tool itself.

    Raises:
        ArgumentsDoNotFit: the validated arguments do not fit the function.
    """
    if tool is None:
        return None
    raw = with_schema_defaults(arguments, schema)
    validate = getattr(getattr(tool, "fn_metadata", None), "validate_arguments", None)
    fn = getattr(tool, "fn", None)
    if not callable(validate):
        return raw
    try:
        validated = validate(dict(arguments))
    except ValidationError:
        return None
    except Exception:
        return raw  # a crashing validator is the tool's failure: let the guarded call meet it
    if not callable(fn) or not isinstance(validated, Mapping):
        return raw
    context = getattr(tool, "context_kwarg", None)
    inject = [context] if isinstance(context, str) else []
    inject.extend(name for name in getattr(tool, "resolved_params", None) or () if name)
    # received() binds the whole signature: the injected parameters get a stand-in, left out.
    given = {**validated, **dict.fromkeys(inject)}
    try:
        return received(fn, (), given, inject=inject, sent=arguments)
    except ArgumentsDoNotFit:
        raise  # the call would raise it before the function runs: no intent to claim
    except (TypeError, ValueError):  # a signature the binder cannot read: the JSON it got
        return raw


class TwiceshyMiddleware:
    """An ``MCPServer`` middleware that runs each ``tools/call`` at most once per intent.

    Made by :func:`protect`, which also registers it; construct it yourself to place it in a
    chain of your own (``MCPServer(name, middleware=[...])`` or ``server.middleware``).

    Args:
        ledger: where intents are claimed and outcomes kept.
        effects: declared tools: ``{name: twiceshy.KEYED, ...}``, or a guard made by
            ``ledger.guard(name, effect=..., attempts=..., definite=...)`` for other options. An
            entry wins over the tool's annotations.
        server: the server whose tools' annotations give the effect class of undeclared tools. A
            middleware without a server refuses (as ``isError``) every undeclared tool.
        scope: asked for the run scope of a request whose ``_meta`` names none (it gets the
            request context); by default there is no fallback and such a call does not run.

    Raises:
        TypeError, ValueError: an entry of ``effects`` is not an effect class or a guard of that
            tool, or a tool name cannot be keyed.
    """

    __slots__ = ("_guards", "_scope", "_server")

    def __init__(
        self,
        ledger: Ledger,
        *,
        effects: Effects | None = None,
        server: MCPServer[Any] | None = None,
        scope: ScopeFallback | None = None,
    ) -> None:
        self._guards = _Guards(ledger, effects)
        self._server = server
        self._scope = scope

    def __repr__(self) -> str:
        return f"TwiceshyMiddleware(server={self._server.name if self._server else None!r})"

    async def _guard_for(self, name: str) -> tuple[Guard | str | None, object, Any]:
        """The tool's guard, its input schema (``None`` when unknown), and its registration.

        The guard is ``None`` for a tool the server does not know, or a refusal's text.
        """
        registered = _registered(self._server, name)
        declared = self._guards.declared(name)
        if self._server is None:
            if declared:
                return self._guards.guard(name, None, None), None, registered
            refusal = (
                f"the tool {name!r} has no declared effect class: declare it in effects= of the "
                "twiceshy middleware, or give the middleware the server so that the tool's "
                "annotations can decide. The call did not run."
            )
            return refusal, None, registered
        fn = getattr(registered, "fn", None)
        for tool in await self._server.list_tools():
            if tool.name == name:
                implied = effect_from_annotations(tool.annotations)
                guard = self._guards.guard(name, implied, fn if callable(fn) else None)
                return guard, tool.input_schema, registered
        return self._guards.guard(name, None, None), None, registered

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        """Guard a ``tools/call`` request; pass everything else on."""
        params = ctx.params or {}
        name, arguments = params.get("name"), params.get("arguments") or {}
        if (
            ctx.method != "tools/call"
            or ctx.request_id is None
            or not isinstance(name, str)
            or not isinstance(arguments, Mapping)
        ):
            return await call_next(ctx)  # the SDK answers malformed requests itself
        guard, schema, registered = await self._guard_for(name)
        if guard is None:
            return await call_next(ctx)  # the server refuses it: the tool never runs
        if isinstance(guard, Guard) and guard.recorded:
            fn = getattr(registered, "fn", None)
            try:
                # An async generator's body would never run: the server shows its object.
                refuse_generator(fn if callable(fn) else None, name, consumed="sync")
            except TypeError as exc:
                return _error_result(ctx, f"{exc}. The call did not run.")
        try:
            if registered is _NO_LOOKUP:
                intent: dict[str, Any] | None = with_schema_defaults(arguments, schema)
            else:
                intent = _intent(registered, arguments, schema)
        except ArgumentsDoNotFit as exc:
            # The server's own answer to the TypeError its call of the function would raise.
            log.info("twiceshy: tools/call %r does not fit the function: %s", name, exc)
            return _error_result(ctx, f"Error executing tool {name}: {exc}")
        if intent is None:
            return await call_next(ctx)  # the server refuses it: the tool never runs
        if isinstance(guard, str):
            return _error_result(ctx, guard)
        produced: list[dict[str, Any]] = []

        async def work() -> dict[str, Any]:
            data = _as_dict(await _uncancelled(call_next(ctx)))
            if is_input_required(data):
                raise _Interim(data)
            if data.get("isError"):
                raise ToolFailed(_text_of(data.get("content")), data)
            produced.append(data)
            return data

        scope: str | None = None
        key: str | None = None
        try:
            if guard.recorded:
                fallback = self._scope
                meta = params.get("_meta")
                scope, key = _identity(
                    meta if isinstance(meta, Mapping) else None,
                    (lambda: fallback(ctx)) if fallback is not None else None,
                    name,
                )
            value = await guard.acall(intent, work, scope=scope, key=key)
        except _Interim as exc:
            return cast("dict[str, Any]", exc.result)  # passed on as the server produced it
        except (*ANSWERED, *REFUSALS) as exc:
            log.info("twiceshy: tools/call %r answered by twiceshy: %s", name, exc)
            return _marked(ctx, _error_result(ctx, str(exc)), exc)
        except Exception as exc:
            said = for_the_model(guard, exc, intent, scope=scope, key=key)
            if said is not None:  # a KEYED tool out of attempts: it may have taken effect
                return _marked(ctx, _error_result(ctx, said), exc)
            if isinstance(exc, ToolFailed):
                if isinstance(exc.result, dict):
                    # the server's own answer, as it gave it (to an identical call joined here)
                    return _marked(ctx, exc.result, exc)
                # a failure recorded as definite, replayed
                return _marked(ctx, _error_result(ctx, str(exc)), exc)
            raise  # the ledger failed (loudly, never as a result), or a protocol error
        if produced and value is produced[-1]:
            return value
        # a replay, or the outcome of a call joined in this process
        return _marked(ctx, _shaped(ctx, value))


def protect(
    server: MCPServer[Any],
    ledger: Ledger,
    *,
    effects: Effects | None = None,
    scope: ScopeFallback | None = None,
) -> TwiceshyMiddleware:
    """Protect every tool of ``server``: append a :class:`TwiceshyMiddleware` to its middleware.

    Appended last, the middleware is the innermost one: nearest the tool, inside any middleware
    registered before it.

    Args:
        server: the ``MCPServer`` whose ``tools/call`` requests to guard.
        ledger: where intents are claimed and outcomes kept.
        effects: declared tools (see :class:`TwiceshyMiddleware`); others follow their annotations.
        scope: the fallback for a request whose ``_meta`` names no scope.

    Returns:
        The registered middleware.
    """
    middleware = TwiceshyMiddleware(ledger, effects=effects, server=server, scope=scope)
    server.middleware.append(middleware)
    return middleware
