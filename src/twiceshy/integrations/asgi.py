"""Inbound HTTP: each request runs in the scope its ``Idempotency-Key`` header names.

A sender that retries a request (a client whose answer timed out, a webhook delivered again)
sends it again with the same ``Idempotency-Key``. This ASGI middleware runs each request inside
``twiceshy.run(scope)``, the scope derived from that header, so the agent run a retry starts
names the same intents as the first one did: a charge the first delivery made is replayed, not
made again. For FastAPI, Starlette and any ASGI app; it needs nothing outside the standard
library::

    app.add_middleware(IdempotencyKeyMiddleware)  # FastAPI, Starlette
    app = IdempotencyKeyMiddleware(app)  # any ASGI app

What it does with an HTTP request whose method and path it covers (by default POST, PUT, PATCH
and DELETE, on every path; ``methods=`` and ``paths=`` narrow it):

- **The header** (``header=``, ``Idempotency-Key`` by default): one field, 1 to ``max_length``
  (255) printable ASCII characters, either bare (``Idempotency-Key: 8e03978e-...``) or a quoted
  structured-field string as the IETF draft writes it (``Idempotency-Key: "8e03978e-..."``),
  which names the same key. Missing: the request is refused with ``400 Bad Request`` and an
  ``application/problem+json`` body saying the header is required (the IETF draft's answer),
  and the app never sees it; with ``required=False`` it is passed on without a scope instead, so
  protected tools inside raise :class:`twiceshy.MissingScope` unless something else names their
  scope. Empty, too long, not printable ASCII, a malformed quoted string, or more than one
  field: refused with ``400`` whatever ``required`` says.
- **The scope**: ``scope(request, key)`` when given (``request`` is the ASGI scope, ``key`` the
  header's value), a string or an awaitable of one, used as it is: for example the tenant and
  the key, where several clients may choose the same key. Otherwise the text
  ``http ["idempotency-key","POST","/orders","<key>"]``: the header's name, the method, the
  path and the key, written as JSON so that no two requests' texts meet, and so that no other
  scope of the application (an order id, a thread id) meets them. The same key sent to another
  path, with another method, or in another header, is another run.
- **The whole request** runs inside the scope: the endpoint, a streaming response's body, and
  the background tasks the app runs after its response (Starlette's and FastAPI's
  ``BackgroundTasks``), in the tasks and threads that take the request's context with them
  (asyncio tasks, ``asyncio.to_thread``, Starlette's thread pool, where sync endpoints and
  dependencies run). A bare thread or an executor does not: run its work in
  ``contextvars.copy_context()``. Frameworks whose adapters prefer their own run id to
  ``twiceshy.run(...)`` (a LangGraph thread id, a durable engine's workflow id) keep it: see
  ``docs/scope.md``.
- **Replays marked** (``mark_replays=ledger``, opt-in): the response carries
  ``Idempotent-Replayed: true`` when every call of a KEYED or UNSAFE tool of that ledger the
  request made before its response was complete was answered from an earlier call's outcome
  (replayed, joined, waited for, reconciled), and there was at least one. A call that ran its
  tool, or was refused, or ended unknown, leaves the header out; SAFE calls take no effect and
  count neither way. The header is decided when the response's first body message holds the
  whole body (a ``JSONResponse``, a ``Response``); a response sent in several parts (a
  ``StreamingResponse``, a large file, or any response passed through a
  ``BaseHTTPMiddleware`` inside this one) never carries it, since a call made after its headers
  left could not be told. Background tasks run after the response is sent: their calls never
  decide it.

Other requests (other methods and paths, WebSockets, lifespan) pass untouched. The middleware
does not compare payloads: a request sent again with the same key and other content names other
intents in the same scope (each tool's ``key_args=`` fingerprint still refuses a reuse with other
arguments).
"""

from __future__ import annotations

import contextvars
import inspect
import json
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping
from typing import Any, Final

from .. import CallEvent, Effect, Ledger, run

__all__ = [
    "DEFAULT_METHODS",
    "REPLAYED_HEADER",
    "IdempotencyKeyMiddleware",
]

Scope = MutableMapping[str, Any]
"""An ASGI connection scope."""
Message = MutableMapping[str, Any]
"""An ASGI event."""
Receive = Callable[[], Awaitable[Message]]
"""An ASGI ``receive`` callable."""
Send = Callable[[Message], Awaitable[None]]
"""An ASGI ``send`` callable."""
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
"""An ASGI 3 application (the same shape as Starlette's ``ASGIApp``)."""

ScopeOf = Callable[[Scope, str], str | Awaitable[str]]
"""``scope(request, key)``: the run scope of a request (its ASGI scope) whose header holds
``key``."""

DEFAULT_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
"""The methods covered by default: those that change something (GET, HEAD, OPTIONS and TRACE,
RFC 9110's safe methods, pass untouched)."""

REPLAYED_HEADER: Final = "Idempotent-Replayed"
"""The response header (``true``) of a request whose effects were all replayed."""

_REPLAYED_LINE: Final = (REPLAYED_HEADER.lower().encode(), b"true")

# A header's name (and a method) is an HTTP token (RFC 9110 §5.6.2).
_TOKEN: Final = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


class _Tally:
    """What one request's calls were answered: whether one was replayed, whether one was not."""

    __slots__ = ("fresh", "replayed")

    def __init__(self) -> None:
        self.replayed = False
        self.fresh = False

    def all_replayed(self) -> bool:
        return self.replayed and not self.fresh


# The tally of the request whose context this is. The object is shared by every task and thread
# that copies the context, so what a call tells it in any of them reaches the middleware.
_tally: contextvars.ContextVar[_Tally | None] = contextvars.ContextVar(
    "twiceshy_asgi_tally", default=None
)


def _observe(event: CallEvent) -> None:
    """The observer given to ``mark_replays=`` ledgers: notes each call in its request's tally."""
    tally = _tally.get()
    if tally is None or event.effect is Effect.SAFE:
        return
    if event.outcome.replayed:
        tally.replayed = True
    else:
        tally.fresh = True


class _Refused(Exception):
    """The request's header cannot name a key: why, for the client."""


class IdempotencyKeyMiddleware:
    """An ASGI middleware: each request runs in ``twiceshy.run(scope)``, the scope named by its
    ``Idempotency-Key`` header, so a retried request names the same intents.

    Args:
        app: the ASGI app.
        header: the request header that carries the key (``"X-GitHub-Delivery"``, say). Case
            does not matter.
        required: refuse a covered request without the header (``400``); ``False`` passes it
            on without a scope.
        methods: the methods covered (:data:`DEFAULT_METHODS` by default); ``None`` covers
            every method.
        paths: the path prefixes covered, each matched whole segments at a time (``"/hooks"``
            covers ``/hooks`` and ``/hooks/stripe``, not ``/hookshot``); ``None`` (the default)
            covers every path.
        scope: ``scope(request, key)``, the run scope of a request, instead of the default
            text of header, method, path and key: a function of the ASGI scope and the header's
            value, answering a non-empty string (or an awaitable of one), used as it is.
        max_length: the longest key accepted, in characters.
        mark_replays: a ledger (or several) whose calls decide the response header
            ``Idempotent-Replayed: true``; see the module's text. Nothing is marked by default.

    Raises:
        TypeError, ValueError: an argument is of the wrong kind or out of range.
    """

    __slots__ = (
        "_header",
        "_marking",
        "_max",
        "_methods",
        "_name",
        "_paths",
        "_scope",
        "app",
        "required",
    )

    def __init__(
        self,
        app: ASGIApp,
        *,
        header: str = "Idempotency-Key",
        required: bool = True,
        methods: Collection[str] | None = DEFAULT_METHODS,
        paths: Collection[str] | None = None,
        scope: ScopeOf | None = None,
        max_length: int = 255,
        mark_replays: Ledger | Iterable[Ledger] = (),
    ) -> None:
        if not isinstance(header, str) or not header or not set(header) <= _TOKEN:
            raise ValueError(f"header= must be an HTTP header name, not {header!r}")
        if not isinstance(required, bool):
            raise TypeError(f"required= must be True or False, not {required!r}")
        if scope is not None and not callable(scope):
            raise TypeError(f"scope= must be a function of (request, key), not {scope!r}")
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ValueError(
                f"max_length= must be a whole number of at least 1, not {max_length!r}"
            )
        self.app = app
        self.required = required
        self._name = header
        self._header = header.lower().encode("ascii")
        self._methods = None if methods is None else _methods_of(methods)
        self._paths = None if paths is None else _paths_of(paths)
        self._scope = scope
        self._max = max_length
        ledgers = [mark_replays] if isinstance(mark_replays, Ledger) else list(mark_replays)
        for ledger in ledgers:
            if not isinstance(ledger, Ledger):
                raise TypeError(f"mark_replays= takes ledgers, not {ledger!r}")
            # One observer per ledger, however many middlewares (or rebuilt app stacks) share it.
            if _observe not in ledger.runtime.observers:
                ledger.observe(_observe)
        self._marking = bool(ledgers)

    def __repr__(self) -> str:
        return f"IdempotencyKeyMiddleware({self.app!r}, header={self._name!r})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._covers(scope):
            await self.app(scope, receive, send)
            return
        values = [
            value for field, value in scope.get("headers", ()) if field.lower() == self._header
        ]
        if not values and not self.required:
            await self.app(scope, receive, send)  # no scope: protected tools refuse to run
            return
        try:
            if not values:
                raise _Refused(f"This request needs the {self._name} header.")
            key = _key_of(values, self._name, self._max)
        except _Refused as refused:
            await _refuse(send, self._max, str(refused))
            return
        text = await self._scope_of(scope, key)
        if not self._marking:
            with run(text):
                await self.app(scope, receive, send)
            return
        tally = _Tally()
        with run(text):
            token = _tally.set(tally)
            try:
                await self._marked(scope, receive, send, tally)
            finally:
                _tally.reset(token)

    def _covers(self, scope: Scope) -> bool:
        """Whether the request's method and path are the middleware's to scope."""
        if self._methods is not None and scope.get("method") not in self._methods:
            return False
        if self._paths is None:
            return True
        path = scope.get("path", "")
        return any(path == p or path.startswith(p if p == "/" else f"{p}/") for p in self._paths)

    async def _scope_of(self, request: Scope, key: str) -> str:
        """The run scope of a request whose header says ``key``."""
        if self._scope is None:
            parts = [self._header.decode(), request.get("method", ""), request.get("path", ""), key]
            return "http " + json.dumps(parts, separators=(",", ":"))
        text = self._scope(request, key)
        if inspect.isawaitable(text):
            text = await text
        if not isinstance(text, str) or not text:
            raise TypeError(
                f"the scope= function of IdempotencyKeyMiddleware must answer a non-empty "
                f"string, not {text!r}; the request was not run"
            )
        return text

    async def _marked(self, scope: Scope, receive: Receive, send: Send, tally: _Tally) -> None:
        """Run the app, holding its response's start until the first part of the body: with a
        whole body in that part, and every call told so far replayed, the start is marked."""
        held: list[Message] = []
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if not started and message["type"] == "http.response.start":
                started = True
                held.append(message)
                return
            if held:
                whole = message["type"] == "http.response.body" and not message.get("more_body")
                start = held.pop()
                await send(_with_mark(start) if whole and tally.all_replayed() else start)
            await send(message)

        await self.app(scope, receive, sending)
        if held:  # a response without a body message: every call has been told by now
            start = held.pop()
            await send(_with_mark(start) if tally.all_replayed() else start)


def _methods_of(methods: Collection[str]) -> frozenset[str]:
    """The methods of ``methods=``, upper-cased; a lone string is refused (not its letters)."""
    if isinstance(methods, str | bytes) or not isinstance(methods, Collection):
        raise TypeError(f"methods= must be a collection of method names, not {methods!r}")
    for method in methods:
        if not isinstance(method, str) or not method or not set(method) <= _TOKEN:
            raise ValueError(f"methods= must hold HTTP method names, not {method!r}")
    return frozenset(method.upper() for method in methods)


def _paths_of(paths: Collection[str]) -> tuple[str, ...]:
    """The path prefixes of ``paths=``, without a trailing slash; a lone string is refused."""
    if isinstance(paths, str | bytes) or not isinstance(paths, Collection):
        raise TypeError(f"paths= must be a collection of path prefixes, not {paths!r}")
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"paths= must hold paths starting with '/', not {path!r}")
    return tuple(path.rstrip("/") or "/" for path in paths)


def _key_of(values: list[bytes], header: str, longest: int) -> str:
    """The key the header's fields give.

    Raises:
        _Refused: not exactly one field, or its value is no key.
    """
    if len(values) > 1:
        raise _Refused(f"This request has {len(values)} {header} headers; send one.")
    text = values[0].decode("latin-1").strip(" \t")
    key = _unquoted(text, header) if text.startswith('"') else text
    if not key:
        raise _Refused(f"The {header} header is empty.")
    if not all(" " <= c <= "~" for c in key):
        raise _Refused(f"The {header} header holds characters other than printable ASCII.")
    if len(key) > longest:
        raise _Refused(f"The {header} header is longer than {longest} characters.")
    return key


def _unquoted(text: str, header: str) -> str:
    """The content of a structured-field string (RFC 8941 §3.3.3): ``"a\\"b"`` is ``a"b``.

    Raises:
        _Refused: ``text`` is not one such string.
    """
    content: list[str] = []
    escaped = False
    for at, char in enumerate(text[1:], start=1):
        if escaped:
            if char not in '"\\':
                break
            content.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            if at == len(text) - 1:
                return "".join(content)
            break
        else:
            content.append(char)
    raise _Refused(f"The {header} header starts with a quote but is not one quoted string.")


async def _refuse(send: Send, longest: int, reason: str) -> None:
    """Answer ``400 Bad Request`` with a problem document (RFC 9457) saying what is wrong."""
    detail = (
        f"{reason} It must carry one value of 1 to {longest} printable ASCII characters that "
        "names this request, the same on every retry of it (a UUID, say). The request was not run."
    )
    body = json.dumps(
        {"type": "about:blank", "title": "Bad Request", "status": 400, "detail": detail}
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", b"%d" % len(body)),
    ]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _with_mark(start: Message) -> Message:
    """The response's start with ``Idempotent-Replayed: true`` (any such header replaced)."""
    headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != _REPLAYED_LINE[0]]
    return {**start, "headers": [*headers, _REPLAYED_LINE]}
