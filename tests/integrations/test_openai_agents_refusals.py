"""What a protected OpenAI Agents SDK tool refuses, through the real ``Runner`` and a scripted
model: a call the SDK refuses before its function runs never meets the ledger, and a recorded
generator tool is refused where it is protected.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from agents import Agent, function_tool
from test_openai_agents import calls, received, run, script
from test_openai_agents import ledger as ledger  # fixtures: the aliases keep them exported
from test_openai_agents import offline as offline  # autouse: no network, no tracing

import twiceshy
from twiceshy.integrations.openai_agents import protect


def fax_tool(sent: list[str]) -> Any:
    """``send_fax(to, body)``: each call sends a fax (kept in ``sent``)."""

    @function_tool
    async def send_fax(to: str, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    return send_fax


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_call_missing_a_required_argument_never_meets_the_ledger(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """The model leaves out ``to``: it reads the SDK's own answer, word for word, nothing is
    sent and nothing is recorded; the well-formed call after it sends one fax."""
    missing = {"body": "hello"}
    plain = script(calls("c1", name="send_fax", args=missing))
    run(Agent(name="office", model=plain, tools=[fax_tool([])]), group_id="plain")

    sent: list[str] = []
    tools = protect([fax_tool(sent)], ledger, effects={"send_fax": effect})
    model = script(calls("c1", name="send_fax", args=missing))
    run(Agent(name="office", model=model, tools=tools), group_id="fax-1")

    assert received(model) == received(plain)
    assert "error occurred" in received(model)["c1"]
    assert sent == []
    assert ledger.store.records(ledger.namespace) == []

    model = script(calls("c2", name="send_fax", args={"to": "555", "body": "hello"}))
    run(Agent(name="office", model=model, tools=tools), group_id="fax-1")
    assert received(model) == {"c2": "faxed 555"}
    assert sent == ["555"]
    assert len(ledger.store.records(ledger.namespace)) == 1


def collect(to: str) -> Iterator[str]:
    """A generator tool: its body runs only as its result is consumed."""
    yield f"faxed {to}"


async def stream(to: str) -> AsyncIterator[str]:
    """An async generator tool."""
    yield f"faxed {to}"


@pytest.mark.parametrize("function", [collect, stream])
@pytest.mark.parametrize("effect", [twiceshy.KEYED, twiceshy.UNSAFE])
def test_a_recorded_generator_tool_is_refused_when_protected(
    ledger: twiceshy.Ledger, function: Any, effect: twiceshy.Effect
) -> None:
    """A generator function cannot be a KEYED or UNSAFE tool: ``protect`` says what to do."""
    tool = function_tool(function)
    with pytest.raises(TypeError, match=r"is a generator function.*Return a list"):
        protect([tool], ledger, default=effect)
    recorded = ledger.guard(tool.name, effect=twiceshy.SAFE, record=True)
    with pytest.raises(TypeError, match="generator"):
        protect([tool], ledger, effects={tool.name: recorded})


def test_a_safe_generator_tool_keeping_no_record_is_protected(ledger: twiceshy.Ledger) -> None:
    """A SAFE tool keeps no record: a generator there is no risk, and it is protected."""
    assert len(protect([function_tool(collect)], ledger, default=twiceshy.SAFE)) == 1
