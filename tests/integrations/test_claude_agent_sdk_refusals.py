"""What protected Claude Agent SDK and ``anthropic`` runner tools refuse, through a real session
(the SDK's bundled CLI and in-process MCP server) and the real tool runner, both answered by the
scripted model: a call the SDK refuses before the tool runs never meets the ledger, and a
recorded generator tool is refused where it is protected.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from anthropic import beta_async_tool, beta_tool
from claude_agent_sdk import tool
from scripted_messages_api import MessagesAPI, tool_use
from test_claude_agent_sdk import CLI, calls, session, text
from test_claude_agent_sdk_runner import run

import twiceshy
from twiceshy.integrations.claude_agent_sdk import protect


@pytest.fixture
def ledger() -> Iterator[twiceshy.Ledger]:
    """An in-memory ledger."""
    with twiceshy.Ledger("memory://") as opened:
        yield opened


def records(ledger: twiceshy.Ledger) -> list[twiceshy.Record]:
    """Every record the ledger holds, for any key."""
    return ledger.store.records(ledger.namespace)


@pytest.mark.skipif(not CLI.exists(), reason="the SDK's bundled claude CLI is not installed")
def test_a_session_call_missing_a_required_argument_never_meets_the_ledger(
    ledger: twiceshy.Ledger, tmp_path: Path
) -> None:
    """The model leaves out ``to``: it reads the SDK's own validation error, as without
    twiceshy, nothing is sent and nothing is recorded; its well-formed call after that sends
    one fax, and meets a ledger that holds no other record."""
    sent: list[str] = []
    seen: list[list[twiceshy.State]] = []

    @tool("send_fax", "Send a fax.", {"to": str, "body": str})
    async def send_fax(args: dict[str, Any]) -> dict[str, Any]:
        seen.append([record.state for record in records(ledger)])
        sent.append(args["to"])
        return text(f"faxed {args['to']}")

    missing = {"body": "hello"}
    for home in ("plain", "protected"):
        (tmp_path / home).mkdir()
    plain = MessagesAPI(*calls("send_fax", missing, "toolu_1"))
    session(plain, [send_fax], tmp_path / "plain")
    assert sent == []

    api = MessagesAPI(
        *calls("send_fax", missing, "toolu_1"),
        *calls("send_fax", {"to": "555", "body": "hello"}, "toolu_2"),
    )
    tools = protect([send_fax], ledger, effects={"send_fax": twiceshy.UNSAFE})
    session(api, tools, tmp_path / "protected", session_id=str(uuid.uuid4()))

    read = api.results()
    assert read["toolu_1"] == plain.results()["toolu_1"]
    assert read["toolu_1"][1]  # an error
    assert read["toolu_2"] == ("faxed 555", False)
    assert seen == [[twiceshy.State.CLAIMED]]  # the well-formed call's own claim, alone
    assert sent == ["555"]
    assert len(records(ledger)) == 1


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_runner_call_missing_a_required_argument_never_meets_the_ledger(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """The tool runner's own validation refuses the call: the model reads its error, as
    without twiceshy, nothing is sent or recorded; the well-formed call after it runs once."""
    sent: list[str] = []

    @beta_tool
    def send_fax(to: str, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    missing = {"body": "hello"}
    plain = MessagesAPI(tool_use("send_fax", missing, "toolu_1"))
    run(plain, [send_fax])

    tools = protect([send_fax], ledger, effects={"send_fax": effect})
    api = MessagesAPI(tool_use("send_fax", missing, "toolu_1"))
    run(api, tools, scope="fax-1")
    assert api.results() == plain.results()
    assert api.results()["toolu_1"][1]  # an error
    assert sent == []
    assert records(ledger) == []

    api = MessagesAPI(tool_use("send_fax", {"to": "555", "body": "hello"}, "toolu_2"))
    run(api, tools, scope="fax-1")
    assert api.results() == {"toolu_2": ("faxed 555", False)}
    assert sent == ["555"]
    assert len(records(ledger)) == 1


@tool("send_faxes", "Send faxes.", {"to": str})
async def agent_faxes(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """An Agent SDK tool whose handler is an async generator."""
    yield text(f"faxed {args['to']}")


@beta_tool
def runner_faxes(to: str) -> Iterator[str]:
    """A runner tool whose function is a generator."""
    yield f"faxed {to}"


@beta_async_tool
async def runner_async_faxes(to: str) -> AsyncIterator[str]:
    """An async runner tool whose function is an async generator."""
    yield f"faxed {to}"


@pytest.mark.parametrize(
    "fax", [agent_faxes, runner_faxes, runner_async_faxes], ids=["agent", "runner", "async"]
)
@pytest.mark.parametrize("effect", [twiceshy.KEYED, twiceshy.UNSAFE])
def test_a_recorded_generator_tool_is_refused_when_protected(
    ledger: twiceshy.Ledger, fax: Any, effect: twiceshy.Effect
) -> None:
    """A generator cannot be a KEYED or UNSAFE tool: ``protect`` says what to do."""
    with pytest.raises(TypeError, match=r"is a generator function.*Return a list"):
        protect([fax], ledger, default=effect)
    recorded = ledger.guard(fax.name, effect=twiceshy.SAFE, record=True)
    with pytest.raises(TypeError, match="generator"):
        protect([fax], ledger, effects={fax.name: recorded})


def test_a_safe_generator_tool_keeping_no_record_is_protected(ledger: twiceshy.Ledger) -> None:
    """A SAFE tool keeps no record: a generator there is no risk, and it is protected."""
    assert len(protect([runner_faxes], ledger, default=twiceshy.SAFE)) == 1
