"""Retry-safe tools on a FastMCP server (FastMCP 4.x).

    server.add_middleware(TwiceshyMiddleware(ledger, effects={"charge_card": twiceshy.KEYED}))

That line adds a middleware whose ``on_call_tool`` hands every tool call to a
:class:`twiceshy.Guard`; nothing else is touched. Install with ``pip install 'twiceshy[fastmcp]'``.
The rules are those of :mod:`twiceshy.integrations.mcp`:

- **Intent**: the tool's name and the arguments its function receives: the ``arguments`` as
  FastMCP validates them for the function (``"5"`` for an ``int`` is ``5``, an omitted parameter
  is its default, a nested model is the model it becomes; strict when the server validates
  strictly), without the context and dependencies FastMCP injects, which are never resolved for
  the key. A tool with no Python function behind it (a proxied or transformed tool) is named by
  its JSON arguments, with the schema's defaults for omitted ones. The run scope is the one the
  client names in the request's ``_meta`` under ``"dev.twiceshy/scope"`` (or an explicit key
  under ``"dev.twiceshy/key"``); without either, the ``scope=`` fallback, else the call does not
  run and the client reads an ``isError`` result saying it must send the scope. (FastMCP leaves
  ``context.message.meta`` empty; the client's ``_meta`` is read from the request context.)
- **Effect class**: an entry in ``effects=`` wins; otherwise the tool's annotations decide:
  ``readOnlyHint`` or ``idempotentHint`` → ``SAFE``, anything else → ``UNSAFE``. A tool whose
  function calls :func:`twiceshy.point_of_no_return` is guarded with ``effect_at="mark"``.
- **Honest failures**: ``OutcomeUnknown``, ``InProgress`` and twiceshy's other answers come back
  as a ``ToolResult`` with ``is_error=True`` (an ordinary result: ``RetryMiddleware`` does not
  retry it), and a retry of a finished intent gets the first call's result, replayed from the
  ledger as it went on the wire. A KEYED tool out of attempts is answered with twiceshy's text
  as a ``ToolError`` raised from the tool's own error, which ``RetryMiddleware`` may retry (with
  the same key).
- **Replays marked**: a result answered without running the tool (``twiceshy.was_replayed()``)
  carries ``"dev.twiceshy/replayed": true`` in its ``_meta``; a replayed failure is answered as
  the ``isError`` result FastMCP made of the first call's error, marked likewise. Over HTTP,
  ``server.http_app(middleware=[Middleware(ReplayedHeaderMiddleware)])`` (from
  :mod:`twiceshy.integrations.mcp`) also sets the response header ``Idempotent-Replayed: true``.
- **Order**: middleware added first is outermost. Add ``RetryMiddleware`` (and any other
  middleware that retries) *before* this one, so every retry passes through the ledger.

A tool's exception reaches the guard unwrapped from FastMCP's ``ToolError`` so that ``definite=``
and ``not_applied=`` of a declared guard match the tool's own types. A call that leaves out a
required argument is never claimed: FastMCP refuses it whatever its release and settings, so it
is passed on to FastMCP, which answers it as without twiceshy. FastMCP's other refusals of the
arguments (``ValidationError``, refused before the tool ran), whose verdict can hang on the
release and on ``strict_input_validation``, and an unknown tool release the claim.

A generator tool, sync or async, runs within its claim: FastMCP consumes the generator inside
the tool's run, which the ledger wraps.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final, cast, get_type_hints

from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError
from pydantic_core import to_json

try:
    import fastmcp
    from fastmcp.exceptions import DisabledError, NotFoundError, ToolError, ValidationError
    from fastmcp.server.dependencies import get_http_request, without_injected_parameters
    from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
    from fastmcp.server.providers.addressing import parse_hashed_backend_name
    from fastmcp.tools.base import InputRequiredToolResult, Tool, ToolResult
    from fastmcp.tools.function_tool import FunctionTool
    from fastmcp.utilities.types import get_cached_typeadapter
    from mcp.types import CallToolRequestParams, ContentBlock, TextContent
except ImportError as exc:  # pragma: no cover - shown by a test in a process without it
    raise ImportError(
        f"twiceshy.integrations.fastmcp needs FastMCP 4: pip install 'twiceshy[fastmcp]' ({exc})"
    ) from exc
try:  # FastMCP 4.2 added it; before, every tool result is a plain ToolResult
    from fastmcp.tools.base import RawStructuredToolResult

    _RAW: type[ToolResult] | None = RawStructuredToolResult
except ImportError:  # pragma: no cover - run by .ci/frameworks.sh on the oldest release
    _RAW = None

from twiceshy import Guard, Ledger
from twiceshy.errors import InProgress, NotApplied, OutcomeUnknown, TwiceshyError
from twiceshy.integrations._calls import (
    ANSWERED,
    ArgumentsDoNotFit,
    for_the_model,
    keyed_exhausted,
    received,
    with_schema_defaults,
)
from twiceshy.integrations.mcp import (
    REFUSALS,
    Effects,
    ReplayedHeaderMiddleware,
    ToolFailed,
    _answered_by_replay,
    _Guards,
    _identity,
    _Interim,
    _mark_replayed,
    _replayed_meta,
    _text_of,
    _uncancelled,
    effect_from_annotations,
)

__all__ = ["ReplayedHeaderMiddleware", "TwiceshyMiddleware"]

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
        "raw": _RAW is not None and isinstance(result, _RAW),
    }


def _rebuilt(data: Mapping[str, Any]) -> ToolResult:
    """The tool result :func:`_stored` kept."""
    blocks = _BLOCKS.validate_python(data.get("content") or [])
    structured, meta = data.get("structuredContent"), data.get("meta")
    if data.get("raw") and _RAW is not None:
        return _RAW(content=blocks, structured_content=structured, meta=meta)
    return ToolResult(content=blocks, structured_content=structured, meta=meta)


def _error_result(text: str) -> ToolResult:
    """An ``isError`` result carrying ``text`` for the model."""
    return ToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _http_request(context: MiddlewareContext[CallToolRequestParams]) -> object:
    """The HTTP request that carried the call (``None`` on stdio, in memory)."""
    fctx = context.fastmcp_context
    request = fctx.request_context.request if fctx and fctx.request_context else None
    if request is None:
        try:
            request = get_http_request()
        except RuntimeError:  # no HTTP request
            return None
    return request


def _marked(
    context: MiddlewareContext[CallToolRequestParams],
    result: ToolResult,
    error: BaseException | None = None,
) -> ToolResult:
    """``result``, the answer to a guarded call, marked as a replay if it is one: its ``meta``
    (the result's ``_meta``), and the HTTP request's mark for ``ReplayedHeaderMiddleware``."""
    if not _answered_by_replay(error):
        return result
    _mark_replayed(_http_request(context))
    # A copy: a result shared with an identical call joined here is that call's own answer.
    return result.model_copy(update={"meta": _replayed_meta(result.meta)})


def _root(error: Exception) -> Exception:
    """The tool's own exception, where FastMCP wrapped it as ``ToolError(...) from error``."""
    cause = error.__cause__
    if isinstance(error, ToolError) and isinstance(cause, Exception):
        return cause
    return error


async def _lookup(server: fastmcp.FastMCP[Any], name: str) -> Tool | None:
    """The tool FastMCP runs for a call of ``name``, found as ``FastMCP.call_tool`` finds it."""
    tool = await server.get_tool(name)
    if tool is None:
        # A backend tool callable by apps is addressed by a hashed name (as FastMCP's own
        # authorization middleware resolves it): guarded like any other.
        hashed = parse_hashed_backend_name(name)
        if hashed is not None:
            tool = await server.get_tool_by_hash(*hashed)
    return tool


def _function_of(tool: Tool | None) -> Callable[..., Any] | None:
    """The Python function a tool runs, where FastMCP validates its arguments for it."""
    if (
        isinstance(tool, FunctionTool)
        and type(tool).run is FunctionTool.run
        and type(tool)._run is Tool._run
    ):
        return tool.fn
    return None  # a proxy, a transformed or mounted tool: its JSON arguments are all there is


_Validator = tuple[Callable[..., Any], TypeAdapter[Any]]

_VALIDATORS: weakref.WeakKeyDictionary[Callable[..., Any], _Validator] = weakref.WeakKeyDictionary()


def _validator(fn: Callable[..., Any]) -> _Validator:
    """What FastMCP validates the arguments of the tool ``fn`` against, without the tool.

    ``FunctionTool.run`` validates and calls in one step, with a ``TypeAdapter`` over
    ``without_injected_parameters(fn)`` (whose wrapper resolves the injected parameters only
    when called). This adapter is over a stand-in with that wrapper's signature and annotations
    whose body hands back the arguments it gets: FastMCP's validation, with no tool run and no
    dependency resolved. Built once per function.
    """
    try:
        made = _VALIDATORS.get(fn)
    except TypeError:  # a callable that takes no weak reference: built afresh
        made = None
    if made is not None:
        return made
    exposed = without_injected_parameters(fn)
    signature = inspect.signature(exposed)
    try:
        hints = get_type_hints(exposed, include_extras=True)
    except Exception:  # as FastMCP falls back: the signature's own annotations
        hints = {}
    annotations = {
        name: hints.get(name, parameter.annotation)
        for name, parameter in signature.parameters.items()
        if name in hints or parameter.annotation is not inspect.Parameter.empty
    }

    def handed(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    handed.__signature__ = signature.replace(  # type: ignore[attr-defined]
        return_annotation=inspect.Signature.empty
    )
    handed.__annotations__ = annotations
    handed.__name__ = getattr(fn, "__name__", handed.__name__)
    handed.__qualname__ = getattr(fn, "__qualname__", handed.__qualname__)
    handed.__module__ = getattr(fn, "__module__", handed.__module__)
    made = (handed, get_cached_typeadapter(handed))
    with contextlib.suppress(TypeError):  # a callable that takes no weak reference
        _VALIDATORS[fn] = made
    return made


def _is_json(value: Any) -> bool:
    """Whether ``value`` is made only of what a JSON parser produces."""
    if value is None or isinstance(value, (str, int, float)):
        return True
    if isinstance(value, list):
        return all(_is_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def _validated(adapter: TypeAdapter[Any], arguments: dict[str, Any], strict: bool) -> Any:
    """Validate as ``FunctionTool`` does: lax as Python, or, for a server with
    ``strict_input_validation``, JSON arguments strictly in JSON mode (an enum's value, an ISO
    date still validate; ``"5"`` for an ``int`` does not).
    """
    if not strict or not _is_json(arguments):
        return adapter.validate_python(arguments, strict=True if strict else None)
    return adapter.validate_json(to_json(arguments), strict=True)


_LEFT_OUT: Final = frozenset({"missing_argument", "missing"})
"""pydantic's errors for a required argument or field left out: refused in every mode."""


def _intent(
    fn: Callable[..., Any] | None, arguments: Mapping[str, Any], schema: object, strict: bool
) -> tuple[dict[str, Any] | None, bool]:
    """The arguments that name the intent: those the tool's function receives (docs/design.md §2),
    else the JSON arguments with the schema's defaults for omitted ones; and whether the
    arguments were validated here as FastMCP validates them (then a ``ValidationError`` from
    the call is the tool's own, raised by its body).

    ``None`` for a call that leaves out a required argument: FastMCP refuses it before the tool
    runs, whatever its release and its strictness, so it needs no claim.

    Raises:
        ArgumentsDoNotFit: the validated arguments do not fit the function.
    """
    if fn is not None:
        try:
            handed, adapter = _validator(fn)
            args, kwargs = _validated(adapter, dict(arguments), strict)
            return received(handed, args, kwargs, sent=arguments), True
        except PydanticValidationError as exc:
            if all(error["type"] in _LEFT_OUT for error in exc.errors()):
                return None, False
            # Another refusal may hang on how this release validates (lax, strict, JSON):
            # FastMCP's own then releases the claim. The JSON names the intent.
        except ArgumentsDoNotFit:  # pragma: no cover - pydantic called the stand-in with them
            raise
        except Exception:  # pragma: no cover - cannot be read here: the JSON names the intent
            pass
    return with_schema_defaults(arguments, schema), False


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
    ) -> tuple[Guard | str | None, object, Tool | None]:
        """The tool's guard, its parameters' JSON schema (``None`` when unknown), and the tool.

        The guard is ``None`` for a tool the server does not know, or a refusal's text.
        """
        name = context.message.name
        if context.fastmcp_context is None:
            guard = self._guards.guard(name, None, None)
            if guard is not None:
                return guard, None, None
            refusal = (
                f"the tool {name!r} has no declared effect class and its annotations cannot be "
                "read here: declare it in effects= of the twiceshy middleware. The call did not "
                "run."
            )
            return refusal, None, None
        tool = await _lookup(context.fastmcp_context.fastmcp, name)
        if tool is None:
            return self._guards.guard(name, None, None), None, None
        implied = effect_from_annotations(tool.annotations)
        return self._guards.guard(name, implied, _function_of(tool)), tool.parameters, tool

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

    def _exhausted(
        self,
        context: MiddlewareContext[CallToolRequestParams],
        guard: Guard,
        error: Exception,
        intent: Mapping[str, Any],
        scope: str | None,
        key: str | None,
    ) -> str | None:
        """twiceshy's text for a KEYED tool out of attempts (``None`` for any other error)."""
        said = for_the_model(guard, error, intent, scope=scope, key=key)
        if said is None or not self._masks(context):
            return said
        # The text would quote the tool's exception, which this server hides from clients.
        masked = ToolError(f"Error calling tool {guard.name!r}")
        return keyed_exhausted(guard, masked, guard.key_for(intent, scope=scope, key=key))

    async def on_call_tool(
        self,
        context: MiddlewareContext[CallToolRequestParams],
        call_next: CallNext[CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        """Guard one tool call."""
        name, arguments = context.message.name, context.message.arguments or {}
        guard, schema, tool = await self._guard_for(context)
        if guard is None:
            return await call_next(context)  # FastMCP answers an unknown tool; nothing runs
        if isinstance(guard, str):
            return _error_result(guard)
        fctx = context.fastmcp_context
        strict = fctx is not None and bool(fctx.fastmcp.strict_input_validation)
        try:
            intent, validated = _intent(_function_of(tool), arguments, schema, strict)
        except ArgumentsDoNotFit as exc:  # pragma: no cover - see _intent
            # FastMCP's own answer to the TypeError the function's call would raise.
            masked = f"Error calling tool {name!r}"
            raise ToolError(masked if self._masks(context) else f"{masked}: {exc}") from exc
        if intent is None:
            return await call_next(context)  # FastMCP refuses it: the tool never runs
        produced: list[tuple[ToolResult, dict[str, Any]]] = []
        raised: list[tuple[Exception, Exception]] = []  # (what the guard read, what FastMCP raised)

        async def work() -> dict[str, Any]:
            try:
                result = await _uncancelled(call_next(context))
            except (NotFoundError, DisabledError) as exc:
                raise _NotRun(exc) from exc
            except Exception as exc:
                if isinstance(exc, ValidationError) and not validated:
                    # FastMCP refused the arguments before the tool ran. Arguments validated
                    # here passed the same check: such an error is the tool's own, after which
                    # its effect may have happened.
                    raise _NotRun(exc) from exc
                root = _root(exc)
                raised.append((root, exc))
                if root is exc:
                    raise
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

        scope: str | None = None
        key: str | None = None
        try:
            if guard.recorded:
                fallback = self._scope
                request = fctx.request_context if fctx is not None else None
                scope, key = _identity(
                    request.meta if request is not None else None,
                    (lambda: fallback(context)) if fallback is not None else None,
                    name,
                )
            value = await guard.acall(intent, work, scope=scope, key=key)
        except _NotRun as exc:
            raise exc.error from None  # FastMCP's own answer to a call it refused
        except _Interim as exc:
            return cast("ToolResult", exc.result)  # passed on as FastMCP produced it
        except (OutcomeUnknown, InProgress) as exc:
            return _error_result(self._honest(context, exc))
        except (*ANSWERED, *REFUSALS) as exc:
            log.info("twiceshy: tools/call %r answered by twiceshy: %s", name, exc)
            return _marked(context, _error_result(str(exc)), exc)
        except Exception as exc:
            said = self._exhausted(context, guard, exc, intent, scope, key)
            if said is not None:
                # It may have taken effect: twiceshy's words, as FastMCP's own error, raised
                # from the tool's, so that RetryMiddleware outside may retry it (same key). An
                # error has no _meta: a call joined to it gets the HTTP header alone.
                if _answered_by_replay(exc):
                    _mark_replayed(_http_request(context))
                raise ToolError(said) from exc
            if isinstance(exc, ToolFailed):
                if isinstance(exc.result, ToolResult):
                    return _marked(context, exc.result, exc)
                # a failure recorded as definite, replayed
                return _marked(context, _error_result(str(exc)), exc)
            for root, framework_error in raised:
                if root is exc:
                    # FastMCP's own error (masked as the server wants) for a failure after which
                    # twiceshy lets the caller retry: nothing happened, or a SAFE tool.
                    if framework_error is exc:
                        raise
                    raise framework_error from exc
            if isinstance(exc, TwiceshyError):
                raise  # the ledger failed: loudly, never as a tool result
            # Not raised by this call's run: a definite failure replayed, or the error of a call
            # joined in this process. FastMCP turns only its tool's own errors into an isError
            # result (anything raised here would reach the client as an internal server
            # error), so this answers as FastMCP answered the first call: the isError result
            # it makes of a ToolError, here with the replay's _meta.
            if self._masks(context):
                said_first = f"Error calling tool {name!r}"
            else:
                said_first = f"Error calling tool {name!r}: {exc}"
            if _answered_by_replay(exc):
                return _marked(context, _error_result(said_first), exc)
            raise ToolError(said_first) from exc
        for result, data in produced:
            if data is value:
                return result
        # a replay, or the outcome of a call joined in this process
        return _marked(context, _rebuilt(value))
