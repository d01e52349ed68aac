"""The ``Idempotency-Key`` header of an outbound request, derived from the intent and the request.

A KEYED tool makes HTTP requests inside a protected call; each one gets a header derived from the
call's key **and the request's content** (method, URL, body). An SDK's own retry of one request
sends the same content, so it carries the same header and the provider deduplicates it; two
different requests of one call (create a customer, then charge it) get different headers. A
counter would not do: it gives an SDK's retry of one request a new header. A multipart body is
hashed without its boundary: httpx draws a new random one each time a request is built, so
every retry of an upload would otherwise carry a new header.

The transports for ``httpx`` and its fork ``httpx2`` (which the openai, anthropic and mcp SDKs
use) are made here from one definition, for each module's own base classes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from email.message import Message
from typing import Any

from .._records import Effect
from .._scope import current_call

__all__ = ["DEFAULT_METHODS", "header_value", "make_transports", "request_content"]

DEFAULT_METHODS: frozenset[str] = frozenset({"POST", "PUT", "PATCH", "DELETE"})
"""The methods that get a header by default: those that change something."""


def header_value(key: str, method: str, url: str, body: bytes) -> str:
    """The header for one request of the call ``key``: 64 hex digits (Stripe takes up to 255)."""
    digest = hashlib.sha256()
    for part in (key.encode(), method.upper().encode(), url.encode()):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    digest.update(hashlib.sha256(body).digest())
    return digest.hexdigest()


def request_content(content_type: str | None, body: bytes) -> bytes:
    """The body as the header sees it: a multipart body's random boundary made a fixed one."""
    if not content_type or not content_type.lower().startswith("multipart/"):
        return body
    parsed = Message()
    parsed["Content-Type"] = content_type
    boundary = parsed.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        return body
    return body.replace(b"--" + boundary.encode("latin-1"), b"--twiceshy-boundary")


class _Rule:
    """Which requests get a header, and under which name."""

    __slots__ = ("effects", "header", "methods")

    def __init__(self, header: str, methods: Collection[str], effects: Collection[Effect]) -> None:
        # A lone string is a collection too, of letters: methods="POST" would match no request.
        if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
            raise TypeError(f"methods= must be a collection of method names, not {methods!r}")
        if isinstance(effects, Effect) or not all(isinstance(e, Effect) for e in effects):
            raise TypeError(f"effects= must be a collection of twiceshy effects, not {effects!r}")
        self.header = header
        self.methods = frozenset(m.upper() for m in methods)
        self.effects = frozenset(effects)

    def value(self, key: str, request: Any, body: bytes) -> str:
        """The header for ``request`` (its body read as ``body``) inside the call ``key``."""
        content = request_content(request.headers.get("Content-Type"), body)
        return header_value(key, request.method, str(request.url), content)

    def applies(self, request: Any) -> str | None:
        """The call's key when ``request`` should get a header, else ``None``."""
        call = current_call()
        if call is None or call.effect not in self.effects:
            return None
        if request.method.upper() not in self.methods or self.header in request.headers:
            return None
        return call.key


def make_transports(module: Any) -> tuple[type[Any], type[Any]]:
    """The sync and async transports for ``module`` (``httpx`` or ``httpx2``)."""

    class IdempotencyKeyTransport(module.BaseTransport):  # type: ignore[misc]
        """Adds ``Idempotency-Key`` to requests made inside a protected KEYED call.

        Args:
            transport: the transport that sends the request (default: the module's own).
            header: the header's name.
            methods: the methods that get it.
            effects: the effect classes whose calls get it (KEYED by default).
        """

        def __init__(
            self,
            transport: Any = None,
            *,
            header: str = "Idempotency-Key",
            methods: Collection[str] = DEFAULT_METHODS,
            effects: Collection[Effect] = (Effect.KEYED,),
        ) -> None:
            self._transport = transport if transport is not None else module.HTTPTransport()
            self._rule = _Rule(header, methods, effects)

        def handle_request(self, request: Any) -> Any:
            key = self._rule.applies(request)
            if key is not None:
                body = request.read()
                request.headers[self._rule.header] = self._rule.value(key, request, body)
            return self._transport.handle_request(request)

        def close(self) -> None:
            self._transport.close()

    class AsyncIdempotencyKeyTransport(module.AsyncBaseTransport):  # type: ignore[misc]
        """The async twin of :class:`IdempotencyKeyTransport`."""

        def __init__(
            self,
            transport: Any = None,
            *,
            header: str = "Idempotency-Key",
            methods: Collection[str] = DEFAULT_METHODS,
            effects: Collection[Effect] = (Effect.KEYED,),
        ) -> None:
            self._transport = transport if transport is not None else module.AsyncHTTPTransport()
            self._rule = _Rule(header, methods, effects)

        async def handle_async_request(self, request: Any) -> Any:
            key = self._rule.applies(request)
            if key is not None:
                body = await request.aread()
                request.headers[self._rule.header] = self._rule.value(key, request, body)
            return await self._transport.handle_async_request(request)

        async def aclose(self) -> None:
            await self._transport.aclose()

    IdempotencyKeyTransport.__module__ = AsyncIdempotencyKeyTransport.__module__ = (
        f"twiceshy.integrations.{module.__name__}"
    )
    return IdempotencyKeyTransport, AsyncIdempotencyKeyTransport
