"""What twiceshy's middleware on an ``mcp`` SDK ``MCPServer`` refuses, through a real in-process
client: a call the tool never runs is never claimed (the client reads the server's own error),
an async generator tool is refused, and a sync generator tool, which the server consumes inside
the call, runs within its claim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult
from test_mcp import ledger as ledger  # the fixture: the alias keeps it exported
from test_mcp import run, scoped, text

import twiceshy
from twiceshy.integrations.mcp import protect


def records(ledger: twiceshy.Ledger, *states: twiceshy.State) -> list[twiceshy.Record]:
    """The records the ledger holds for any key (in ``states``, if given)."""
    return ledger.store.records(ledger.namespace, states=states or None)


def calls(server: MCPServer[Any], *arguments: dict[str, Any], tool: str) -> list[CallToolResult]:
    """Call ``tool`` with each of ``arguments`` in turn, in the run ``fax-1``."""

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool(tool, given, meta=scoped("fax-1")) for given in arguments
            ]

    return run(main)


def fax_server(sent: list[str], fax: Callable[..., Any] | None = None) -> MCPServer[Any]:
    """A server whose ``send_fax`` sends a fax per call (kept in ``sent``)."""
    server: MCPServer[Any] = MCPServer("office")

    def send_fax(to: str, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    server.tool(name="send_fax")(fax or send_fax)
    return server


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_call_missing_a_required_argument_is_never_claimed(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """The client leaves out ``to``: it reads the server's own error, as without twiceshy,
    nothing is sent and nothing is recorded; the well-formed call after it sends one fax."""
    [plain] = calls(fax_server([]), {"body": "hello"}, tool="send_fax")

    sent: list[str] = []
    server = fax_server(sent)
    protect(server, ledger, effects={"send_fax": effect})
    [refused] = calls(server, {"body": "hello"}, tool="send_fax")
    assert refused.is_error
    assert text(refused) == text(plain)
    assert "validation error" in text(refused)
    assert sent == []
    assert records(ledger) == []

    [done] = calls(server, {"to": "555", "body": "hello"}, tool="send_fax")
    assert text(done) == "faxed 555"
    assert sent == ["555"]
    assert len(records(ledger)) == 1


def test_arguments_the_function_does_not_take_get_the_servers_error_unclaimed(
    ledger: twiceshy.Ledger,
) -> None:
    """A positional-only parameter, which the server passes by name: the call cannot bind, so
    the client reads the server's error for the ``TypeError``, never "outcome unknown", and
    nothing is recorded."""
    sent: list[str] = []

    def send_fax(to: str, /, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    [plain] = calls(fax_server(sent, send_fax), {"to": "555", "body": "hi"}, tool="send_fax")
    assert plain.is_error  # the server cannot call it either

    server = fax_server(sent, send_fax)
    protect(server, ledger, effects={"send_fax": twiceshy.UNSAFE})
    [refused] = calls(server, {"to": "555", "body": "hi"}, tool="send_fax")
    assert refused.is_error
    assert text(refused).startswith("Error executing tool send_fax: ")
    assert "positional only" in text(refused)
    assert "unknown" not in text(refused)
    assert sent == []
    assert records(ledger) == []


def test_a_recorded_async_generator_tool_is_refused(ledger: twiceshy.Ledger) -> None:
    """An async generator tool, whose body the server never runs, is refused for a recorded
    tool: the client reads what to do, and nothing is recorded."""
    sent: list[str] = []

    async def send_fax(to: str) -> Any:  # no output schema for the server to build
        """Send faxes."""
        sent.append(to)
        yield f"faxed {to}"

    server = fax_server(sent, send_fax)
    protect(server, ledger, effects={"send_fax": twiceshy.UNSAFE})
    [refused] = calls(server, {"to": "555"}, tool="send_fax")
    assert refused.is_error
    assert "is a generator function" in text(refused)
    assert "Return a list" in text(refused)
    assert sent == []
    assert records(ledger) == []


def test_a_sync_generator_tool_runs_within_its_claim(ledger: twiceshy.Ledger) -> None:
    """The server consumes a sync generator inside the call the ledger wraps: its body runs
    while the intent is claimed, once, and a repeated call replays its result."""
    sent: list[str] = []
    claimed: list[int] = []

    def send_faxes(to: str) -> Any:  # no output schema for the server to build
        """Send faxes."""
        claimed.append(len(records(ledger, twiceshy.State.CLAIMED)))
        sent.append(to)
        yield f"faxed {to}"

    server = fax_server(sent, send_faxes)
    protect(server, ledger, effects={"send_fax": twiceshy.UNSAFE})
    first, second = calls(server, {"to": "555"}, {"to": "555"}, tool="send_fax")
    assert not first.is_error
    assert text(first) == text(second)
    assert "faxed 555" in text(first)
    assert sent == ["555"]
    assert claimed == [1]
    assert len(records(ledger, twiceshy.State.SUCCEEDED)) == 1
