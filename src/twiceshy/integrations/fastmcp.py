"""Retry-safe tools on a FastMCP server (FastMCP 4.x).

    server.add_middleware(TwiceshyMiddleware(ledger, effects={"charge_card": twiceshy.KEYED}))

That line adds a middleware whose ``on_call_tool`` hands every tool call to a
:class:`twiceshy.Guard`; nothing else is touched. Install with ``pip install 'twiceshy[fastmcp]'``.
The rules are those of :mod:`twiceshy.integrations.mcp`:

- **Intent**: the tool's name and its ``arguments`` as the client sent them (with the tool's
  parameter defaults filled in for omitted ones), in the run scope the client names in the
  request's ``_meta`` under ``"dev.twiceshy/scope"`` (or an explicit key under
  ``"dev.twiceshy/key"``); without either, the ``scope=`` fallback, else the call does not run
  and the client reads an ``isError`` result saying it must send the scope. (FastMCP leaves
  ``context.message.meta`` empty; the client's ``_meta`` is read from the request context.)
- **Effect class**: an entry in ``effects=`` wins; otherwise the tool's annotations decide:
  ``readOnlyHint`` or ``idempotentHint`` → ``SAFE``, anything else → ``UNSAFE``.
- **Honest failures**: ``OutcomeUnknown`` and ``InProgress`` come back as a ``ToolResult`` with
  ``is_error=True`` (an ordinary result: ``RetryMiddleware`` does not retry it), and a retry of a
  finished intent gets the first call's result, replayed from the ledger.
- **Order**: middleware added first is outermost. Add ``RetryMiddleware`` (and any other
  middleware that retries) *before* this one, so every retry passes through the ledger.

A tool's exception reaches the guard unwrapped from FastMCP's ``ToolError`` so that ``definite=``
and ``not_applied=`` of a declared guard match the tool's own types; FastMCP's ``ValidationError``
(arguments refused before the tool ran) and an unknown tool release the claim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import fastmcp
from fastmcp.exceptions import DisabledError, NotFoundError, ToolError, ValidationError
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import InputRequiredToolResult, RawStructuredToolResult, ToolResult
from mcp.types import CallToolRequestParams, ContentBlock, TextContent
from pydantic import TypeAdapter

from twiceshy import Guard, Ledger
from twiceshy.errors import InProgress, NotApplied, OutcomeUnknown, TwiceshyError
from twiceshy.integrations.mcp import (
    REFUSALS,
    Effects,
    ToolFailed,
    _Guards,
    _identity,
    _Interim,
    _text_of,
    _with_defaults,
    effect_from_annotations,
)

__all__ = ["TwiceshyMiddleware"]

log = logging.getLogger("twiceshy")

ScopeFallback = Callable[[MiddlewareContext[CallToolRequestParams]], str | None]
"""Asked for the scope of a call whose ``_meta`` names none; ``None`` means there is none."""

_BLOCKS: Final = TypeAdapter(list[ContentBlock])


class _NotRun(NotApplied):
    """FastMCP refused the call before the tool ran (bad arguments, unknown or disabled tool)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _stored(result: ToolResult) -> dict[str, Any]:
    """A tool result as JSON the ledger keeps: content blocks as dicts, structured content, meta."""
    return {
        "content": [
            block.model_dump(mode="json", by_alias=True, exclude_none=True)
            for block in result.content
        ],
        "structuredContent": result.structured_content,
        "meta": result.meta,
        "raw": isinstance(result, RawStructuredToolResult),
    }


def _rebuilt(data: Mapping[str, Any]) -> ToolResult:
    """The tool result :func:`_stored` kept."""
    blocks = _BLOCKS.validate_python(data.get("content") or [])
    structured, meta = data.get("structuredContent"), data.get("meta")
    if data.get("raw"):
        return RawStructuredToolResult(content=blocks, structured_content=structured, meta=meta)
    return ToolResult(content=blocks, structured_content=structured, meta=meta)


def _error_result(text: str) -> ToolResult:
    """An ``isError`` result carrying ``text`` for the model."""
    return ToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _root(error: Exception) -> Exception:
    """The tool's own exception, where FastMCP wrapped it as ``ToolError(...) from error``."""
    cause = error.__cause__
    if isinstance(error, ToolError) and isinstance(cause, Exception):
        return cause
    return error


class TwiceshyMiddleware(Middleware):
    """A FastMCP middleware that runs each tool call at most once per intent.

    Args:
        ledger: where intents are claimed and outcomes kept.
        effects: declared tools: ``{name: twiceshy.KEYED, ...}``, or a guard made by
            ``ledger.guard(name, effect=..., attempts=..., definite=...)`` for other options. An
            entry wins over the tool's annotations.
        scope: asked for the run scope of a call whose ``_meta`` names none (it gets the
            middleware context); by default there is no fallback and such a call does not run.

    Raises:
        TypeError, ValueError: an entry of ``effects`` is not an effect class or a guard of that
            tool, or a tool name cannot be keyed.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        effects: Effects | None = None,
        scope: ScopeFallback | None = None,
    ) -> None:
        self._guards = _Guards(ledger, effects)
        self._scope = scope

    async def _guard_for(
        self, context: MiddlewareContext[CallToolRequestParams]
    ) -> tuple[Guard | str | None, object]:
        """The tool's guard and its parameters' JSON schema (``None`` when unknown).

        The guard is ``None`` for a tool the server does not know, or a refusal's text.
        """
        name = context.message.name
        declared = self._guards.declared(name)
        if context.fastmcp_context is None:
            if declared is not None:
                return declared, None
            return (
                f"the tool {name!r} has no declared effect class and its annotations cannot be "
                "read here: declare it in effects= of the twiceshy middleware. The call did not "
                "run."
            ), None
        tool = await context.fastmcp_context.fastmcp.get_tool(name)
        if tool is None:
            return declared, None
        guard = declared or self._guards.derived(name, effect_from_annotations(tool.annotations))
        return guard, tool.parameters

    def _honest(self, context: MiddlewareContext[CallToolRequestParams], exc: Exception) -> str:
        """The text the model reads for ``OutcomeUnknown`` / ``InProgress``."""
        if isinstance(exc, OutcomeUnknown) and exc.reason and self._masks(context):
            # The reason quotes the tool's exception, which this server hides from clients.
            return str(OutcomeUnknown(exc.tool, exc.key))
        return str(exc)

    @staticmethod
    def _masks(context: MiddlewareContext[CallToolRequestParams]) -> bool:
        """Whether the server masks error details (then the honest text quotes none)."""
        if context.fastmcp_context is None:
            return True
        server = context.fastmcp_context.fastmcp
        # FastMCP keeps the constructor's mask_error_details= only as a private attribute.
        return bool(getattr(server, "_mask_error_details", fastmcp.settings.mask_error_details))

    async def on_call_tool(
        self,
        context: MiddlewareContext[CallToolRequestParams],
        call_next: CallNext[CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        """Guard one tool call."""
        name, arguments = context.message.name, context.message.arguments or {}
        guard, schema = await self._guard_for(context)
        if guard is None:
            return await call_next(context)  # FastMCP answers an unknown tool; nothing runs
        if isinstance(guard, str):
            return _error_result(guard)
        produced: list[tuple[ToolResult, dict[str, Any]]] = []
        wrapped: list[tuple[Exception, Exception]] = []  # (what the tool raised, FastMCP's error)

        async def work() -> dict[str, Any]:
            try:
                result = await call_next(context)
            except (ValidationError, NotFoundError, DisabledError) as exc:
                raise _NotRun(exc) from exc
            except Exception as exc:
                root = _root(exc)
                if root is exc:
                    raise
                wrapped.append((root, exc))
                raise root from root.__cause__
            if isinstance(result, InputRequiredToolResult) or not isinstance(result, ToolResult):
                # An input_required round, or an extension's handle (a background task): not an
                # outcome to keep; the claim is released and the answer passed on.
                raise _Interim(result)
            if result.is_error:
                raise ToolFailed(_text_of(result.content), result)
            data = _stored(result)
            produced.append((result, data))
            return data

        try:
            scope, key = None, None
            if guard.recorded:
                fallback, fctx = self._scope, context.fastmcp_context
                request = fctx.request_context if fctx is not None else None
                scope, key = _identity(
                    request.meta if request is not None else None,
                    (lambda: fallback(context)) if fallback is not None else None,
                    name,
                )
            intent = _with_defaults(arguments, schema)
            value = await guard.acall(intent, work, scope=scope, key=key)
        except _NotRun as exc:
            raise exc.error from None  # FastMCP's own answer to a call it refused
        except _Interim as exc:
            return cast("ToolResult", exc.result)  # passed on as FastMCP produced it
        except ToolFailed as exc:
            if isinstance(exc.result, ToolResult):
                return exc.result
            return _error_result(str(exc))  # a failure recorded as definite, replayed
        except (OutcomeUnknown, InProgress) as exc:
            return _error_result(self._honest(context, exc))
        except REFUSALS as exc:
            log.info("twiceshy: tools/call %r refused: %s", name, exc)
            return _error_result(str(exc))
        except Exception as exc:
            for root, framework_error in wrapped:
                if root is exc:
                    # FastMCP's own error (masked as the server wants) for a failure twiceshy
                    # lets the caller retry: a KEYED tool out of attempts, a SAFE tool.
                    raise framework_error from exc
            if isinstance(exc, TwiceshyError):
                raise  # the ledger failed: loudly, never as a tool result
            # Not raised by this call's run: a definite failure replayed, or the error of a call
            # joined in this process. FastMCP turns only its tool's own errors into an isError
            # result (anything raised here would reach the client as an internal server
            # error), so this answers as FastMCP answered the first call.
            if self._masks(context):
                raise ToolError(f"Error calling tool {name!r}") from exc
            raise ToolError(f"Error calling tool {name!r}: {exc}") from exc
        for result, data in produced:
            if data is value:
                return result
        return _rebuilt(value)  # a replay, or the outcome of a call joined in this process
