"""A small MCP server and client for the cross-process tests of ``twiceshy.integrations.mcp``.

Run as a script, it serves one slow UNSAFE tool, ``book_room``, guarded by twiceshy with a SQLite
ledger, which appends a line to a file on every execution::

    python mcp_server_app.py --ledger sqlite:////tmp/x/ledger.db --effects /tmp/x/effects \
        (--port-file /tmp/x/port | --stdio)

Over streamable HTTP it binds 127.0.0.1 on a port the system picks and writes that port to
``--port-file``; with ``--stdio`` it serves one client on its standard streams.
:func:`race_client` is the body of a client process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from importlib import metadata
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.server.mcpserver import MCPServer

import twiceshy
from twiceshy.integrations.mcp import protect, twiceshy_meta

TOOL_SECONDS = 0.3
"""How long one execution of ``book_room`` takes: long enough for racers to overlap."""


def build(ledger_url: str, effects: Path) -> MCPServer[Any]:
    """The server: ``book_room`` (no annotations, so UNSAFE) behind twiceshy."""
    server: MCPServer[Any] = MCPServer("hotel", log_level="WARNING")

    @server.tool()
    async def book_room(room: str, night: str) -> str:
        """Book a room for a night (slowly)."""
        await asyncio.sleep(TOOL_SECONDS)
        with effects.open("a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {room} {night}\n")
        executions = len(effects.read_text(encoding="utf-8").splitlines())
        return f"booked {room} for {night} (execution {executions})"

    protect(server, twiceshy.Ledger(ledger_url))
    return server


async def _serve_http(server: MCPServer[Any], port_file: Path) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = server.streamable_http_app(host="127.0.0.1")
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    scratch = port_file.with_suffix(".tmp")
    scratch.write_text(str(port), encoding="utf-8")
    scratch.replace(port_file)  # the port appears whole, never half-written
    await uvicorn.Server(config).serve(sockets=[sock])


def main() -> None:
    """Serve ``book_room`` over streamable HTTP or stdio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--effects", required=True, type=Path)
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--stdio", action="store_true")
    options = parser.parse_args()
    server = build(options.ledger, options.effects)
    if options.stdio:
        server.run("stdio")
    else:
        asyncio.run(_serve_http(server, options.port_file))


def stdio_target(ledger_url: str, effects: Path) -> StdioServerParameters:
    """How a client launches its own stdio server process on the shared ledger."""
    return StdioServerParameters(
        command=sys.executable,
        args=[__file__, "--ledger", ledger_url, "--effects", str(effects), "--stdio"],
        env=dict(os.environ),
    )


async def _call(target: str | StdioServerParameters, barrier: Barrier, scope: str) -> Any:
    # mcp 2.0's Client takes a transport for a stdio server; 2.1 added taking its parameters.
    if isinstance(target, StdioServerParameters) and metadata.version("mcp").startswith("2.0."):
        target = stdio_client(target)  # type: ignore[assignment]
    async with Client(target, read_timeout_seconds=30) as client:
        # Connected first, so the barrier releases two ready calls at once.
        await asyncio.to_thread(barrier.wait, 60)
        result = await client.call_tool(
            "book_room", {"room": "101", "night": "2026-07-28"}, meta=twiceshy_meta(scope)
        )
        return result.model_dump(mode="json", exclude={"meta"})


def race_client(
    target: str | StdioServerParameters, barrier: Barrier, results: Queue[Any], scope: str
) -> None:
    """A client process: connect, wait for the other racer, call ``book_room``, report."""
    try:
        results.put(("ok", asyncio.run(asyncio.wait_for(_call(target, barrier, scope), 90))))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    main()
