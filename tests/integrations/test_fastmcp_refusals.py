"""What twiceshy's FastMCP middleware refuses, through FastMCP's own in-process client: a call
that leaves out a required argument is never claimed (the client reads FastMCP's own error), and
a generator tool, which FastMCP consumes inside the tool's run, runs within its claim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastmcp import Client, FastMCP
from fastmcp.client.client import CallToolResult
from test_fastmcp import ledger as ledger  # the fixture: the alias keeps it exported
from test_fastmcp import run, scoped, text

import twiceshy
from twiceshy.integrations.fastmcp import TwiceshyMiddleware


def records(ledger: twiceshy.Ledger, *states: twiceshy.State) -> list[twiceshy.Record]:
    """The records the ledger holds for any key (in ``states``, if given)."""
    return ledger.store.records(ledger.namespace, states=states or None)


def calls(server: FastMCP[Any], *arguments: dict[str, Any]) -> list[CallToolResult]:
    """Call ``send_fax`` with each of ``arguments`` in turn, in the run ``fax-1``."""

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool(
                    "send_fax", given, meta=scoped("fax-1"), raise_on_error=False
                )
                for given in arguments
            ]

    return run(main)


def fax_server(sent: list[str], fax: Callable[..., Any] | None = None) -> FastMCP[Any]:
    """A server whose ``send_fax`` sends a fax per call (kept in ``sent``)."""
    server: FastMCP[Any] = FastMCP("office")

    def send_fax(to: str, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    server.tool(fax or send_fax, name="send_fax")
    return server


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_call_missing_a_required_argument_is_never_claimed(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """The client leaves out ``to``: it reads FastMCP's own error, as without twiceshy, nothing
    is sent and nothing is recorded; the well-formed call after it sends one fax."""
    [plain] = calls(fax_server([]), {"body": "hello"})

    sent: list[str] = []
    server = fax_server(sent)
    server.add_middleware(TwiceshyMiddleware(ledger, effects={"send_fax": effect}))
    [refused] = calls(server, {"body": "hello"})
    assert refused.is_error
    assert text(refused) == text(plain)
    assert "Missing required argument" in text(refused)
    assert sent == []
    assert records(ledger) == []

    [done] = calls(server, {"to": "555", "body": "hello"})
    assert text(done) == "faxed 555"
    assert sent == ["555"]
    assert len(records(ledger)) == 1


def sent_by_generator(sent: list[str], ledger: twiceshy.Ledger, claimed: list[int]) -> Any:
    """A sync generator ``send_fax``, noting how many intents are claimed as its body runs."""

    def send_fax(to: str) -> Any:
        """Send faxes."""
        claimed.append(len(records(ledger, twiceshy.State.CLAIMED)))
        sent.append(to)
        yield f"faxed {to}"

    return send_fax


def sent_by_async_generator(sent: list[str], ledger: twiceshy.Ledger, claimed: list[int]) -> Any:
    """An async generator ``send_fax``, noting the same."""

    async def send_fax(to: str) -> Any:
        """Send faxes."""
        claimed.append(len(records(ledger, twiceshy.State.CLAIMED)))
        sent.append(to)
        yield f"faxed {to}"

    return send_fax


@pytest.mark.parametrize("make", [sent_by_generator, sent_by_async_generator])
@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_generator_tool_runs_within_its_claim(
    ledger: twiceshy.Ledger, make: Callable[..., Any], effect: twiceshy.Effect
) -> None:
    """FastMCP consumes a generator inside the tool's run: its body runs while the intent is
    claimed, once, and a repeated call replays its result."""
    sent: list[str] = []
    claimed: list[int] = []
    server = fax_server(sent, make(sent, ledger, claimed))
    server.add_middleware(TwiceshyMiddleware(ledger, effects={"send_fax": effect}))
    first, second = calls(server, {"to": "555"}, {"to": "555"})
    assert not first.is_error
    assert text(first) == text(second)
    assert "faxed 555" in text(first)
    assert sent == ["555"]
    assert claimed == [1]
    assert len(records(ledger, twiceshy.State.SUCCEEDED)) == 1
