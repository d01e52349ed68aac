"""Replays marked by the FastMCP adapter, over real streamable HTTP on loopback.

A replayed ``tools/call`` answer carries ``_meta["dev.twiceshy/replayed"] = true`` on every
transport, and, with :class:`~twiceshy.integrations.mcp.ReplayedHeaderMiddleware` among the
app's middleware, the HTTP response header ``Idempotent-Replayed: true``; nothing else does. The
``mcp`` SDK's own client talks to FastMCP's HTTP app under uvicorn, in the handshake-era session
transport and the 2026-07-28 one, with JSON and event-stream responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastmcp
import pytest
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import ToolResult
from mcp.types import CallToolRequestParams, TextContent
from replay_http import MODES, Gate, Wire, check_marks, connected, marked, serving
from starlette.middleware import Middleware as ASGIMiddleware

import twiceshy
from twiceshy.integrations.fastmcp import ReplayedHeaderMiddleware, TwiceshyMiddleware
from twiceshy.integrations.mcp import REPLAYED_META_KEY, SCOPE_META_KEY, twiceshy_meta


class Declined(Exception):
    """The card was declined: nothing was charged (declared definite)."""


class Holding(Middleware):
    """Outside twiceshy's middleware: holds an answer where the request asks for it."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def on_call_tool(
        self,
        context: MiddlewareContext[CallToolRequestParams],
        call_next: CallNext[CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        answer = await call_next(context)
        fctx = context.fastmcp_context
        request = fctx.request_context if fctx is not None else None
        await self.gate.held(request.meta if request is not None else None)
        return answer


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    with twiceshy.Ledger("sqlite:///" + str(tmp_path / "ledger.db")) as opened:
        yield opened


def build(ledger: twiceshy.Ledger, gate: Gate, executions: list[str]) -> fastmcp.FastMCP[Any]:
    """The server of :func:`replay_http.check_marks`, protected by twiceshy."""
    server: fastmcp.FastMCP[Any] = fastmcp.FastMCP("mail")

    @server.tool
    def send_mail(to: str) -> str:
        """Send a mail."""
        executions.append(to)
        return f"sent to {to} (key {twiceshy.current_key()})"

    @server.tool
    def decline(card: str) -> str:
        """Charge a card that is declined."""
        raise Declined(f"card {card} declined by the issuer")

    @server.tool
    def labelled(to: str) -> ToolResult:
        """Send a mail; the result carries a _meta entry of its own."""
        executions.append(to)
        return ToolResult(
            content=[TextContent(type="text", text=f"sent to {to}")],
            meta={"example.com/label": "first"},
        )

    definite = ledger.guard("decline", effect=twiceshy.UNSAFE, definite=(Declined,))
    effects: dict[str, twiceshy.Effect | twiceshy.Guard] = {
        "send_mail": twiceshy.KEYED,
        "labelled": twiceshy.KEYED,
        "decline": definite,
    }
    server.add_middleware(Holding(gate))
    server.add_middleware(TwiceshyMiddleware(ledger, effects=effects))
    return server


def run(body: Any) -> None:
    """Run an async test body, bounded in time."""
    asyncio.run(asyncio.wait_for(body, 120))


@pytest.mark.parametrize("json_response", [True, False], ids=["json", "event-stream"])
@pytest.mark.parametrize("mode", MODES)
def test_a_replay_is_marked_in_its_header_and_meta_alone(
    ledger: twiceshy.Ledger, mode: str, json_response: bool
) -> None:
    """First call unmarked, its retry marked, another intent unmarked; no mark crosses to a
    concurrent request; a replayed failure is marked."""
    gate, executions = Gate(), list[str]()
    server = build(ledger, gate, executions)
    app = server.http_app(
        middleware=[ASGIMiddleware(ReplayedHeaderMiddleware)], json_response=json_response
    )
    with serving(app) as url:
        run(check_marks(url, mode, gate, executions))


@pytest.mark.parametrize("mode", MODES)
def test_without_the_asgi_middleware_only_meta_marks_a_replay(
    ledger: twiceshy.Ledger, mode: str
) -> None:
    """The ``_meta`` entry needs nothing around the app; the header needs the ASGI middleware."""
    executions: list[str] = []
    server = build(ledger, Gate(), executions)

    async def main() -> None:
        wire, args, meta = Wire(), {"to": "ada@example.com"}, twiceshy_meta("run-1")
        async with connected(url, mode, wire) as client:
            first = await client.call_tool("send_mail", args, meta=meta)
            retry = await client.call_tool("send_mail", args, meta=meta)
        assert [marked(first), marked(retry)] == [False, True]
        assert wire.of(args) == [None, None]

    with serving(server.http_app(json_response=True)) as url:
        run(main())
    assert executions == ["ada@example.com"]


def test_a_replay_in_memory_is_marked_in_meta(ledger: twiceshy.Ledger) -> None:
    """Through FastMCP's in-process client there is no header; ``_meta`` marks the replay and
    keeps the first answer's own entries; a replayed failure reads as the first one did."""
    executions: list[str] = []
    server = build(ledger, Gate(), executions)

    async def main() -> list[Any]:
        meta = {SCOPE_META_KEY: "run-1"}
        async with fastmcp.Client(server) as client:
            return [
                await client.call_tool(name, args, meta=meta, raise_on_error=False)
                for name, args in [
                    ("send_mail", {"to": "ada@example.com"}),
                    ("send_mail", {"to": "ada@example.com"}),
                    ("labelled", {"to": "ada@example.com"}),
                    ("labelled", {"to": "ada@example.com"}),
                    ("decline", {"card": "4711"}),
                    ("decline", {"card": "4711"}),
                ]
            ]

    first, retry, own, own_retry, declined, again = asyncio.run(asyncio.wait_for(main(), 60))
    assert not (first.meta or {}).get(REPLAYED_META_KEY)
    assert retry.meta == {**(first.meta or {}), REPLAYED_META_KEY: True}
    assert (own.meta or {}).get("example.com/label") == "first"
    assert not (own.meta or {}).get(REPLAYED_META_KEY)
    assert own_retry.meta == {**(own.meta or {}), REPLAYED_META_KEY: True}
    assert declined.is_error
    assert again.is_error
    assert [block.text for block in again.content] == [block.text for block in declined.content]
    assert not (declined.meta or {}).get(REPLAYED_META_KEY)
    assert (again.meta or {}).get(REPLAYED_META_KEY) is True
    assert executions == ["ada@example.com", "ada@example.com"]  # send_mail, then labelled
