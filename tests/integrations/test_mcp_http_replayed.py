"""Replays marked by the ``mcp`` SDK adapter, over real streamable HTTP on loopback.

A replayed ``tools/call`` answer carries ``_meta["dev.twiceshy/replayed"] = true`` on every
transport, and, through :class:`~twiceshy.integrations.mcp.ReplayedHeaderMiddleware`, the HTTP
response header ``Idempotent-Replayed: true``; nothing else does. The SDK's own client talks to
the server under uvicorn, in the handshake-era session transport and the 2026-07-28 one, with
JSON and event-stream responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent
from replay_http import MODES, Gate, Wire, check_marks, connected, marked, serving

import twiceshy
from twiceshy.integrations.mcp import (
    REPLAYED_META_KEY,
    ReplayedHeaderMiddleware,
    ToolFailed,
    protect,
    twiceshy_meta,
)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    with twiceshy.Ledger("sqlite:///" + str(tmp_path / "ledger.db")) as opened:
        yield opened


def build(ledger: twiceshy.Ledger, gate: Gate, executions: list[str]) -> MCPServer[Any]:
    """The server of :func:`replay_http.check_marks`, protected by twiceshy."""

    async def holding(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        """Outside twiceshy's middleware: hold an answer where the request asks for it."""
        answer = await call_next(ctx)
        await gate.held((ctx.params or {}).get("_meta"))
        return answer

    server: MCPServer[Any] = MCPServer("mail", log_level="WARNING", middleware=[holding])

    @server.tool()
    def send_mail(to: str) -> str:
        """Send a mail."""
        executions.append(to)
        return f"sent to {to} (key {twiceshy.current_key()})"

    @server.tool()
    def decline(card: str) -> str:
        """Charge a card that is declined."""
        raise ToolError(f"card {card} declined")

    @server.tool()
    def labelled(to: str) -> CallToolResult:
        """Send a mail; the result carries a _meta entry of its own."""
        executions.append(to)
        return CallToolResult(
            content=[TextContent(type="text", text=f"sent to {to}")],
            _meta={"example.com/label": "first"},
        )

    keyed = twiceshy.KEYED
    definite = ledger.guard("decline", effect=twiceshy.UNSAFE, definite=[ToolFailed])
    effects: dict[str, twiceshy.Effect | twiceshy.Guard] = {
        "send_mail": keyed,
        "labelled": keyed,
        "decline": definite,
    }
    protect(server, ledger, effects=effects)
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
    app = ReplayedHeaderMiddleware(server.streamable_http_app(json_response=json_response))
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

    with serving(server.streamable_http_app(json_response=True)) as url:
        run(main())
    assert executions == ["ada@example.com"]


def test_a_replay_over_a_transport_without_http_is_marked_in_meta(
    ledger: twiceshy.Ledger,
) -> None:
    """In memory (as over stdio) there is no header; ``_meta`` marks the replay, and keeps the
    first answer's own ``_meta`` entries."""
    executions: list[str] = []
    server = build(ledger, Gate(), executions)

    async def main() -> list[Any]:
        async with Client(server) as client:
            meta = twiceshy_meta("run-1")
            return [
                await client.call_tool(name, {"to": "ada@example.com"}, meta=meta)
                for name in ("send_mail", "send_mail", "labelled", "labelled")
            ]

    first, retry, own, own_retry = asyncio.run(asyncio.wait_for(main(), 60))
    assert [marked(first), marked(retry)] == [False, True]
    assert retry.meta == {**(first.meta or {}), REPLAYED_META_KEY: True}
    assert (own.meta or {}).get("example.com/label") == "first"
    assert own_retry.meta == {**(own.meta or {}), REPLAYED_META_KEY: True}
    assert executions == ["ada@example.com", "ada@example.com"]  # send_mail, then labelled
