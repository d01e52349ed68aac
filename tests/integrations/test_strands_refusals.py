"""What the Strands plugin refuses, through a real ``Agent`` and a scripted model: a call the tool
never runs never meets the ledger (the model reads Strands' own error), a recorded sync generator
tool is refused, and an async generator tool, which Strands streams inside the call, runs within
its claim.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from scripted_strands import ScriptedModel
from strands import Agent, tool

import twiceshy
from twiceshy.integrations.strands import TwiceshyPlugin


@pytest.fixture
def ledger() -> Iterator[twiceshy.Ledger]:
    """An in-memory ledger."""
    with twiceshy.Ledger("memory://") as opened:
        yield opened


def records(ledger: twiceshy.Ledger, *states: twiceshy.State) -> list[twiceshy.Record]:
    """The records the ledger holds for any key (in ``states``, if given)."""
    return ledger.store.records(ledger.namespace, states=states or None)


def fax_tool(sent: list[str]) -> Any:
    """``send_fax(to, body)``: each call sends a fax (kept in ``sent``)."""

    @tool
    def send_fax(to: str, body: str) -> str:
        """Send a fax.

        Args:
            to: the number.
            body: the text.
        """
        sent.append(to)
        return f"faxed {to}"

    return send_fax


def ask(model: ScriptedModel, tools: list[Any], *plugins: TwiceshyPlugin) -> None:
    """Run an agent with ``tools`` (and ``plugins``) once, on ``model``'s script."""
    Agent(model=model, tools=tools, callback_handler=None, plugins=list(plugins))("go")


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_call_missing_a_required_argument_never_meets_the_ledger(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """The model leaves out ``to``: it reads Strands' own error, as without twiceshy, nothing is
    sent and nothing is recorded; the well-formed call after it sends one fax."""
    plain = ScriptedModel([("t1", "send_fax", {"body": "hello"})])
    ask(plain, [fax_tool([])])

    sent: list[str] = []
    fax = fax_tool(sent)
    plugin = TwiceshyPlugin(ledger, {"send_fax": effect})
    with twiceshy.run("fax-1"):
        model = ScriptedModel([("t1", "send_fax", {"body": "hello"})])
        ask(model, [fax], plugin)
        assert model.results()["t1"] == plain.results()["t1"]
        assert model.results()["t1"]["status"] == "error"
        assert "Validation failed" in model.texts()["t1"]
        assert sent == []
        assert records(ledger) == []

        model = ScriptedModel([("t2", "send_fax", {"to": "555", "body": "hello"})])
        ask(model, [fax], plugin)
    assert model.texts() == {"t2": "faxed 555"}
    assert sent == ["555"]
    assert len(records(ledger)) == 1


def test_an_input_the_function_cannot_take_gets_strands_error_unclaimed(
    ledger: twiceshy.Ledger,
) -> None:
    """A positional-only parameter, which Strands passes by name: the call cannot bind, so the
    model reads Strands' error for the ``TypeError``, never "outcome unknown", and nothing is
    recorded."""
    sent: list[str] = []

    @tool
    def send_fax(to: str, /, body: str) -> str:
        """Send a fax.

        Args:
            to: the number.
            body: the text.
        """
        sent.append(to)
        return f"faxed {to}"

    args = {"to": "555", "body": "hello"}
    plain = ScriptedModel([("t1", "send_fax", args)])
    ask(plain, [send_fax])
    assert plain.texts()["t1"].startswith("Error: TypeError - ")  # Strands cannot call it

    with twiceshy.run("fax-2"):
        model = ScriptedModel([("t1", "send_fax", args)])
        ask(model, [send_fax], TwiceshyPlugin(ledger, {"send_fax": twiceshy.UNSAFE}))
    said = model.texts()["t1"]
    assert said.startswith("Error: TypeError - ")
    assert "positional only" in said
    assert model.results()["t1"]["status"] == "error"
    assert sent == []
    assert records(ledger) == []


@tool
def send_faxes(to: str) -> Any:
    """Send faxes.

    Args:
        to: the number.
    """
    yield f"faxed {to}"


@pytest.mark.parametrize("effect", [twiceshy.KEYED, twiceshy.UNSAFE])
def test_a_recorded_sync_generator_tool_is_refused_when_the_plugin_is_attached(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """Strands makes a sync generator's object its result, the body never run: a recorded such
    tool is refused as the agent is made, naming what to do."""
    with pytest.raises(TypeError, match=r"is a generator function.*Return a list"):
        Agent(
            model=ScriptedModel(),
            tools=[send_faxes],
            callback_handler=None,
            plugins=[TwiceshyPlugin(ledger, {"send_faxes": effect})],
        )


def test_a_sync_generator_tool_added_later_is_refused_when_called(
    ledger: twiceshy.Ledger,
) -> None:
    """A recorded sync generator tool added to the agent after the plugin is refused at its
    first call: the model reads the refusal, and nothing is recorded."""
    model = ScriptedModel([("t1", "send_faxes", {"to": "555"})])
    agent = Agent(
        model=model,
        tools=[],
        callback_handler=None,
        plugins=[TwiceshyPlugin(ledger, default=twiceshy.UNSAFE)],
    )
    agent.tool_registry.register_tool(send_faxes)
    with twiceshy.run("fax-3"):
        agent("go")
    assert model.results()["t1"]["status"] == "error"
    assert "is a generator function" in model.texts()["t1"]
    assert records(ledger) == []


@pytest.mark.parametrize("effect", [twiceshy.KEYED, twiceshy.UNSAFE])
def test_an_async_generator_tool_runs_within_its_claim(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """Strands streams an async generator inside the call the ledger wraps: its body runs while
    the intent is claimed, once, and the model's repeated call replays its result."""
    sent: list[str] = []
    claimed: list[int] = []

    @tool
    async def stream_fax(to: str) -> Any:
        """Send a fax, reporting progress.

        Args:
            to: the number.
        """
        claimed.append(len(records(ledger, twiceshy.State.CLAIMED)))
        yield "dialling"
        sent.append(to)
        yield f"faxed {to}"

    model = ScriptedModel(
        [("t1", "stream_fax", {"to": "555"})], [("t2", "stream_fax", {"to": "555"})]
    )
    with twiceshy.run("fax-4"):
        ask(model, [stream_fax], TwiceshyPlugin(ledger, {"stream_fax": effect}))
    assert model.texts() == {"t1": "faxed 555", "t2": "faxed 555"}
    assert sent == ["555"]
    assert claimed == [1]
    assert len(records(ledger, twiceshy.State.SUCCEEDED)) == 1
