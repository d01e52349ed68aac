"""Loopback scaffolding for the replay-marking tests of the MCP adapters over streamable HTTP.

:func:`serving` runs an ASGI app under uvicorn on a free port of 127.0.0.1 in a thread of its
own; :class:`Wire` is an httpx2 client that keeps the ``Idempotent-Replayed`` header of every
``tools/call`` response, by the call's arguments; :func:`connected` is the SDK's own MCP client
over streamable HTTP on that httpx2 client; :class:`Gate` holds answers in flight (in a server
middleware outside twiceshy's, after twiceshy answered) until the test lets them go.
:func:`check_marks` is the scenario both adapters' tests run.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, cast

import httpx2
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, RequestParamsMeta
from starlette.types import ASGIApp

from twiceshy.integrations.mcp import REPLAYED_HEADER, REPLAYED_META_KEY, twiceshy_meta

HOLD_META_KEY = "example.com/hold"
"""A request ``_meta`` key: the outer middleware holds this call's answer at :class:`Gate`."""

MODES = ("legacy", "2026-07-28")
"""The client's protocol modes: the handshake-era session transport, and the single-exchange one."""


@contextmanager
def serving(app: ASGIApp) -> Iterator[str]:
    """Serve ``app`` on a free loopback port while the block runs; yields the MCP endpoint URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:  # bounded: 30 s at most, or the server thread died
            assert thread.is_alive(), "the server stopped while starting"
            assert time.monotonic() < deadline, "the server did not start in 30 s"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class Wire:
    """What the HTTP responses to ``tools/call`` requests said in their replay header."""

    def __init__(self) -> None:
        self.headers: list[tuple[dict[str, Any], str | None]] = []

    async def _seen(self, response: httpx2.Response) -> None:
        body = json.loads(response.request.content or b"null")
        if isinstance(body, dict) and body.get("method") == "tools/call":
            arguments = body["params"].get("arguments") or {}
            self.headers.append((arguments, response.headers.get(REPLAYED_HEADER)))

    def of(self, arguments: dict[str, Any]) -> list[str | None]:
        """The header of each response to a call with ``arguments``, in order."""
        return [header for sent, header in self.headers if sent == arguments]

    def client(self) -> httpx2.AsyncClient:
        """An httpx2 client that reports each response here."""
        return httpx2.AsyncClient(
            event_hooks={"response": [self._seen]}, timeout=httpx2.Timeout(30, read=60)
        )


@asynccontextmanager
async def connected(url: str, mode: str, wire: Wire) -> AsyncIterator[Client]:
    """The SDK's MCP client over streamable HTTP to ``url``, its responses seen by ``wire``."""
    async with wire.client() as http:
        transport = streamable_http_client(url, http_client=http)
        async with Client(transport, mode=mode, read_timeout_seconds=60) as client:
            yield client


class Gate:
    """Holds answers in flight: each says it is held, then waits to be let go."""

    def __init__(self) -> None:
        self._started = 0
        self._lock = threading.Condition()
        self._open = threading.Event()

    def hold(self) -> None:
        """Called by the server (in a worker thread): held, then wait for :meth:`release`."""
        with self._lock:
            self._started += 1
            self._lock.notify_all()
        assert self._open.wait(60), "the test never let the call go"

    def wait_started(self, count: int) -> None:
        """Wait (60 s at most) until ``count`` answers are held."""
        with self._lock:
            assert self._lock.wait_for(lambda: self._started >= count, 60), "calls never held"

    async def held(self, meta: object) -> None:
        """Hold here if a request's ``_meta`` asks for it (:data:`HOLD_META_KEY`)."""
        if isinstance(meta, dict) and meta.get(HOLD_META_KEY):
            await asyncio.to_thread(self.hold)

    def release(self) -> None:
        self._open.set()


def marked(result: CallToolResult) -> bool:
    """Whether a result's ``_meta`` says it was replayed (and says nothing else of it)."""
    meta = result.meta or {}
    value = meta.get(REPLAYED_META_KEY)
    assert value in (None, True), meta
    return value is True


def text(result: CallToolResult) -> str:
    """What the model reads of a tool result."""
    return "\n".join(getattr(block, "text", "") for block in result.content)


async def check_marks(url: str, mode: str, gate: Gate, executions: list[str]) -> None:
    """The scenario: a first call is not marked, its retry is, another intent is not; answers in
    flight together are marked each by its own; a replayed failure is marked too.

    The server has ``send_mail(to)`` (KEYED; appends ``to`` to ``executions``) and
    ``decline(card)`` (fails, recorded as a definite failure), and a middleware outside
    twiceshy's that holds at ``gate`` the answer of a call whose ``_meta`` asks for it.
    """
    wire = Wire()
    meta = twiceshy_meta(f"run-{mode}")
    hold = cast("RequestParamsMeta", {**meta, HOLD_META_KEY: True})
    ada, bob = {"to": "ada@example.com"}, {"to": "bob@example.com"}
    async with connected(url, mode, wire) as client, connected(url, mode, wire) as other:
        first = await client.call_tool("send_mail", ada, meta=meta)
        retry = await client.call_tool("send_mail", ada, meta=meta)
        fresh = await client.call_tool("send_mail", bob, meta=meta)
        assert not any(result.is_error for result in (first, retry, fresh))
        assert text(retry) == text(first)
        assert executions == ["ada@example.com", "bob@example.com"]
        assert [marked(first), marked(retry), marked(fresh)] == [False, True, False]
        assert wire.of(ada) == [None, "true"]
        assert wire.of(bob) == [None]

        # Answers held after twiceshy gave them - three fresh intents and a retry - while other
        # requests are answered on another client, replays and a fresh intent: a mark kept by
        # the process (the last answer's, or any replay's) would reach a held one's response.
        held = [{"to": f"held-{n}@example.com"} for n in range(3)]
        running = [
            asyncio.create_task(client.call_tool("send_mail", args, meta=hold))
            for args in [*held, bob]
        ]
        await asyncio.to_thread(gate.wait_started, len(running))
        carol = {"to": "carol@example.com"}
        meanwhile = await asyncio.gather(
            *(other.call_tool("send_mail", args, meta=meta) for args in (ada, carol, ada))
        )
        assert [marked(result) for result in meanwhile] == [True, False, True]
        gate.release()
        answers = await asyncio.gather(*running)
        assert [marked(result) for result in answers] == [False, False, False, True]
        assert all(wire.of(args) == [None] for args in held)
        assert wire.of(ada) == [None, "true", "true", "true"]
        assert wire.of(bob) == [None, "true"]
        assert wire.of(carol) == [None]
        assert sorted(executions) == sorted(
            [ada["to"], bob["to"], carol["to"]] + [args["to"] for args in held]
        )

        card = {"card": "4711"}
        declined = await client.call_tool("decline", card, meta=meta)
        again = await other.call_tool("decline", card, meta=meta)
        assert declined.is_error
        assert again.is_error
        assert text(again) == text(declined)
        assert [marked(declined), marked(again)] == [False, True]
        assert wire.of(card) == [None, "true"]
