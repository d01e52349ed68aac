"""Retry-safe tools on an MCP server built with the official ``mcp`` SDK (2.x, ``MCPServer``).

    protect(server, ledger, effects={"charge_card": twiceshy.KEYED})

That line adds a server middleware that hands every ``tools/call`` to a :class:`twiceshy.Guard`;
every other request passes untouched. Install with ``pip install 'twiceshy[mcp]'``.

- **Intent**: the tool's name and its ``arguments`` as the client sent them (with the input
  schema's defaults filled in for omitted parameters, when the middleware knows the server), in
  the run scope the client names in the request's ``_meta`` under :data:`SCOPE_META_KEY`
  (``"dev.twiceshy/scope"``):
  ``await client.call_tool("charge_card", args, meta=twiceshy_meta(run_id))``. A client
  that derives its own key sends :data:`KEY_META_KEY` (``"dev.twiceshy/key"``) instead. Without
  either, the ``scope=`` callable of the middleware is asked; without that, the call does not run
  and the client gets an ``isError`` result saying it must send the scope.
- **Effect class**: an explicit entry in ``effects=`` wins; otherwise the tool's MCP annotations
  decide (:func:`effect_from_annotations`): ``readOnlyHint`` or ``idempotentHint`` → ``SAFE``,
  anything else → ``UNSAFE``. ``KEYED`` is never guessed: declare it.
- **Honest failures**: ``OutcomeUnknown`` and ``InProgress`` reach the client as a
  ``CallToolResult`` with ``isError: true`` and twiceshy's message for the model. A retry of a
  finished intent gets the first call's result, replayed from the ledger.

The SDK turns a tool's exception into an ``isError`` result before any middleware sees it, so an
``isError`` answer counts as an ambiguous failure (:class:`ToolFailed`): the tool may have taken
effect. Arguments the server's own validator refuses never reach the tool and are passed through
without a claim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, RequestParamsMeta, TextContent, ToolAnnotations
from mcp.types.methods import is_input_required, serialize_server_result
from pydantic import BaseModel, ValidationError

from twiceshy import Effect, Guard, Ledger
from twiceshy.errors import (
    InProgress,
    KeyReuseMismatch,
    MissingScope,
    NotApplied,
    OutcomeUnknown,
    ReplayedError,
    ResultNotStorable,
    UnkeyableArgument,
)

__all__ = [
    "KEY_META_KEY",
    "SCOPE_META_KEY",
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
    """The guard of each tool: declared ones, and ones made from an effect class on first use."""

    __slots__ = ("_declared", "_derived", "_ledger")

    def __init__(self, ledger: Ledger, effects: Effects | None) -> None:
        if not isinstance(ledger, Ledger):
            raise TypeError("the first argument must be a twiceshy.Ledger")
        self._ledger = ledger
        self._declared: dict[str, Guard] = {}
        for name, spec in (effects or {}).items():
            if isinstance(spec, Guard):
                if spec.name != name:
                    raise ValueError(
                        f"effects[{name!r}] is a guard of another tool ({spec.name!r})"
                    )
                self._declared[name] = spec
            elif isinstance(spec, Effect):
                self._declared[name] = ledger.guard(name, effect=spec)
            else:
                raise TypeError(
                    f"effects[{name!r}] must be twiceshy.SAFE, KEYED, UNSAFE or a twiceshy.Guard"
                )
        self._derived: dict[tuple[str, Effect], Guard] = {}

    def declared(self, name: str) -> Guard | None:
        """The guard declared for ``name``, if any."""
        return self._declared.get(name)

    def derived(self, name: str, effect: Effect) -> Guard:
        """A guard for an undeclared tool, from the effect class its annotations imply."""
        guard = self._derived.get((name, effect))
        if guard is None:
            guard = self._derived[(name, effect)] = self._ledger.guard(name, effect=effect)
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


def _with_defaults(arguments: Mapping[str, Any], schema: object) -> dict[str, Any]:
    """``arguments`` with the input schema's defaults for the parameters the client left out.

    A client may leave out an optional parameter once and send its default the next time: one
    intent (DESIGN.md §2). Only the key uses these; the tool gets the arguments as sent.
    """
    filled = dict(arguments)
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if isinstance(properties, Mapping):
        for name, spec in properties.items():
            if name not in filled and isinstance(spec, Mapping) and "default" in spec:
                filled[name] = spec["default"]
    return filled


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


def _error_result(ctx: ServerRequestContext[Any, Any], text: str) -> dict[str, Any]:
    """An ``isError`` result carrying ``text`` for the model."""
    result = CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)
    return _shaped(ctx, _as_dict(result))


def _refused(server: MCPServer[Any] | None, name: str, arguments: Mapping[str, Any]) -> bool:
    """Whether the server will refuse the call before its tool runs: unknown tool, bad arguments.

    ``MCPServer`` answers both as ``isError``, which the middleware could not tell from a failure
    of the tool itself. The check uses the very lookup and validator the server will use; where the
    server offers none, nothing is refused here and an ``isError`` answer stays ambiguous.
    """
    # MCPServer has no public per-name tool lookup; the tool manager is feature-detected.
    manager = getattr(server, "_tool_manager", None)
    get_tool = getattr(manager, "get_tool", None)
    if not callable(get_tool):
        return False
    tool = get_tool(name)
    if tool is None:
        return True
    validate = getattr(getattr(tool, "fn_metadata", None), "validate_arguments", None)
    if not callable(validate):
        return False
    try:
        validate(dict(arguments))
    except ValidationError:
        return True
    except Exception:
        return False  # a crashing validator is the tool's failure: let the guarded call meet it
    return False


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

    async def _guard_for(self, name: str) -> tuple[Guard | str | None, object]:
        """The tool's guard and its input schema (``None`` when unknown).

        The guard is ``None`` for a tool the server does not know, or a refusal's text.
        """
        declared = self._guards.declared(name)
        if self._server is None:
            if declared is not None:
                return declared, None
            return (
                f"the tool {name!r} has no declared effect class: declare it in effects= of the "
                "twiceshy middleware, or give the middleware the server so that the tool's "
                "annotations can decide. The call did not run."
            ), None
        for tool in await self._server.list_tools():
            if tool.name == name:
                guard = declared or self._guards.derived(
                    name, effect_from_annotations(tool.annotations)
                )
                return guard, tool.input_schema
        return declared, None

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
        guard, schema = await self._guard_for(name)
        if guard is None or _refused(self._server, name, arguments):
            return await call_next(ctx)  # the server refuses it: the tool never runs
        if isinstance(guard, str):
            return _error_result(ctx, guard)
        produced: list[dict[str, Any]] = []

        async def work() -> dict[str, Any]:
            data = _as_dict(await call_next(ctx))
            if is_input_required(data):
                raise _Interim(data)
            if data.get("isError"):
                raise ToolFailed(_text_of(data.get("content")), data)
            produced.append(data)
            return data

        try:
            scope, key = None, None
            if guard.recorded:
                fallback = self._scope
                meta = params.get("_meta")
                scope, key = _identity(
                    meta if isinstance(meta, Mapping) else None,
                    (lambda: fallback(ctx)) if fallback is not None else None,
                    name,
                )
            intent = _with_defaults(arguments, schema)
            value = await guard.acall(intent, work, scope=scope, key=key)
        except (_Interim, ToolFailed) as exc:
            if isinstance(exc.result, dict):
                return exc.result
            return _error_result(ctx, str(exc))
        except (OutcomeUnknown, InProgress) as exc:
            return _error_result(ctx, str(exc))
        except REFUSALS as exc:
            log.info("twiceshy: tools/call %r refused: %s", name, exc)
            return _error_result(ctx, str(exc))
        if produced and value is produced[-1]:
            return value
        return _shaped(ctx, value)  # a replay, or the outcome of a call joined in this process


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
