"""What twiceshy's HTTP transports do to a request sent inside a protected call.

Three things, each decided here once for ``httpx`` and its fork ``httpx2`` (which the openai,
anthropic and mcp SDKs use); the transports of both modules are made from one definition, for
each module's own base classes:

- **KEYED: the header.** Each request that changes something gets an ``Idempotency-Key`` derived
  from the call's key **and the request's content** (method, URL, body). An SDK's own retry of
  one request sends the same content, so it carries the same header and the provider
  deduplicates it; two different requests of one call (create a customer, then charge it) get
  different headers. A counter would not do: it gives an SDK's retry of one request a new
  header. A multipart body is hashed without its boundary: httpx draws a new random one each
  time a request is built, so every retry of an upload would otherwise carry a new header.
- **UNSAFE: no second send.** An UNSAFE tool runs once because its provider cannot deduplicate;
  an SDK retrying a request underneath it (its answer lost to a timeout, a dropped connection, a
  5xx) would apply the effect twice. So the same request (same content, as above) is sent at
  most once per attempt: the second send raises :class:`~twiceshy.RepeatedRequest` and never
  leaves. A request that carries its own idempotency key (the transport's header, set by the
  caller or the SDK) may be repeated: its provider deduplicates it.
- **``effect_at="http"``: the point of no return.** Right before the first request of an attempt
  leaves (any method), :func:`twiceshy.point_of_no_return` is called: an exception raised before
  it means nothing happened (the intent is released), and a lost lease
  (:class:`~twiceshy.FencedOut`) stops the request.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Collection
from email.message import Message
from typing import Any

from .. import Effect, point_of_no_return
from ..errors import FencedOut, RepeatedRequest
from ._core import Current, current_call, reset_in_children

__all__ = ["DEFAULT_METHODS", "header_value", "make_transports", "request_content"]

DEFAULT_METHODS: frozenset[str] = frozenset({"POST", "PUT", "PATCH", "DELETE"})
"""The methods that get a header, and whose repeats are refused, by default: those that change
something."""


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


class _Once:
    """Makes "not sent yet in this attempt? then it is now" one step.

    Two threads of one tool (``asyncio.to_thread``, a copied context) may send the same request
    at once; each must not see the other's as unsent. The lock is replaced in a forked child,
    where a thread of the parent may have held it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def first(self, call: Current, digest: str) -> bool:
        """Note ``digest`` as sent by ``call``; whether it was not already."""
        with self._lock:
            if digest in call.sent:
                return False
            call.sent.add(digest)
            return True


_ONCE = _Once()


def _shown(url: Any) -> str:
    """The URL as an error shows it: without its query or credentials (they may hold secrets)."""
    return str(url.copy_with(query=None, fragment=None, username=None, password=None))


class _Rule:
    """Which requests get a header and under which name, and what a protected call allows."""

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

    def reads(self, call: Current, request: Any) -> bool:
        """Whether ``request`` must be hashed (its body read first) before it is sent."""
        if request.method.upper() not in self.methods:
            return False
        if self.header not in request.headers:
            return call.effect is Effect.UNSAFE or call.effect in self.effects
        # A header is there: the caller's own (left alone), or, on a request object sent again,
        # the one this transport set on an UNSAFE call (which is no key of the caller's).
        return call.effect is Effect.UNSAFE and call.effect in self.effects

    def before_send(self, call: Current, request: Any, body: bytes | None) -> None:
        """Ready ``request`` (its body read as ``body`` when :meth:`reads` said so) to leave.

        Raises:
            RepeatedRequest: an UNSAFE call sent it already; it must not leave.
            FencedOut: the call's lease is lost (``effect_at="http"``), or its attempt has ended
                (an UNSAFE call's, or a marking one's); it must not leave.
            StoreError: the lease could not be confirmed; it must not leave.
        """
        if call.closed and (call.effect is Effect.UNSAFE or call.effect_at is not None):
            # Sent from a thread or task the attempt left behind: the intent may have been run
            # again since, so its effect must not start.
            raise FencedOut(call.tool, call.key)
        digest = None
        if body is not None:
            content = request_content(request.headers.get("Content-Type"), body)
            digest = header_value(call.key, request.method, str(request.url), content)
        if call.effect_at == "http" and not call.marked:
            # The first request of the attempt: a repeat of it would find the attempt marked.
            point_of_no_return()
        given = request.headers.get(self.header)
        # What an UNSAFE call sends at most once: a request with no idempotency key of its own.
        once = call.effect is Effect.UNSAFE and given in (None, digest)
        if once and digest is not None and not _ONCE.first(call, digest):
            raise RepeatedRequest(call.tool, request.method.upper(), _shown(request.url))
        if digest is not None and given is None and call.effect in self.effects:
            request.headers[self.header] = digest
        if call.effect is Effect.KEYED and self.header in request.headers:
            call.handed = True  # the provider can recognise a second run of this request


def make_transports(module: Any) -> tuple[type[Any], type[Any]]:
    """The sync and async transports for ``module`` (``httpx`` or ``httpx2``)."""

    class IdempotencyKeyTransport(module.BaseTransport):  # type: ignore[misc]
        """Makes requests sent inside protected calls safe to retry, or refuses them.

        Inside a KEYED call a request gets an ``Idempotency-Key`` derived from the call's key and
        the request; inside an UNSAFE call the same request is never sent twice
        (:class:`~twiceshy.RepeatedRequest`); for a tool declared ``effect_at="http"`` the
        first request marks the point of no return. Requests sent outside protected calls pass
        untouched.

        Args:
            transport: the transport that sends the request (default: the module's own).
            header: the header's name (also how a caller's own idempotency key is recognised).
            methods: the methods that get it, and whose repeats an UNSAFE call refuses.
            effects: the effect classes whose calls get it (KEYED by default). The refusal of
                repeats applies to UNSAFE calls whatever this says.
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
            call = current_call()
            if call is not None:
                body = request.read() if self._rule.reads(call, request) else None
                self._rule.before_send(call, request, body)
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
            call = current_call()
            if call is not None:
                body = await request.aread() if self._rule.reads(call, request) else None
                self._rule.before_send(call, request, body)
            return await self._transport.handle_async_request(request)

        async def aclose(self) -> None:
            await self._transport.aclose()

    IdempotencyKeyTransport.__module__ = AsyncIdempotencyKeyTransport.__module__ = (
        f"twiceshy.integrations.{module.__name__}"
    )
    return IdempotencyKeyTransport, AsyncIdempotencyKeyTransport
