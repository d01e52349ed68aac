"""The CrewAI adapter, through real crews driven by a scripted ``BaseLLM`` (scripted_crewai.py).

The incident, re-enacted: a tool takes effect and its answer is lost (it raises after the
effect); CrewAI reruns a text tool call that raised (up to six runs), or the model calls the
tool again under a new call id, or the application runs the crew again - and the effect happens
once. No network: sockets refuse to connect, and CrewAI's telemetry is off.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field
from scripted_crewai import (
    CREWAI_WARNINGS,
    BaseTool,
    ScriptedLLM,
    ToolFailure,
    action,
    calls,
    crew_of,
    tool,
)

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger, State, idempotency_key
from twiceshy.integrations.crewai import protect, protect_tool

CHARGE = {"amount": 4900, "customer": "cus_1"}
SPAWN = multiprocessing.get_context("spawn")

pytestmark = CREWAI_WARNINGS


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a network connection fails the test."""

    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"a test tried to connect to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


class Provider:
    """A payment provider double: deduplicates charges by idempotency key; counts effects."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.charges: dict[str, str] = {}
        self.effects = 0

    def charge(self, key: str | None) -> str:
        """Charge once per key; a repeated key answers the first charge's id."""
        self.keys.append(key)
        if key is not None and key in self.charges:
            return self.charges[key]
        self.effects += 1
        charge_id = f"ch_{self.effects}"
        if key is not None:
            self.charges[key] = charge_id
        return charge_id


def charge_tool(provider: Provider, timeouts: int = 1) -> Any:
    """A charge tool: each of its first ``timeouts`` runs takes effect, then times out."""
    left = [timeouts]

    @tool("charge")
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        charge_id = provider.charge(twiceshy.current_key())
        if left[0] > 0:
            left[0] -= 1
            raise TimeoutError("read timed out")
        return charge_id

    return charge


def kickoff(llm: ScriptedLLM, tools: list[Any], scope: str | None = "order-7") -> str:
    """Run a one-agent crew to its end, inside ``twiceshy.run(scope)`` when a scope is given."""
    crew = crew_of(llm, tools)
    if scope is None:
        return str(crew.kickoff().raw)
    with twiceshy.run(scope):
        return str(crew.kickoff().raw)


def assert_honest(text: str) -> None:
    """The honest answer for an unknown outcome, with no invitation to retry."""
    assert "outcome is unknown" in text
    assert "may or may not have taken effect" in text
    assert "will not be run again" in text
    assert "try again" not in text.lower()
    assert "Error executing tool" not in text


# -- CrewAI's own reruns -------------------------------------------------------------------


def test_an_unsafe_tool_crewai_would_run_six_times_runs_once(ledger: Ledger) -> None:
    """A text tool call that timed out: CrewAI runs it six times; protected, once, honestly."""
    sent: list[int] = []

    @tool("wire")
    def wire(amount: int, iban: str) -> str:
        """Wire money."""
        sent.append(amount)
        raise TimeoutError("the bank did not answer in time")

    args = {"amount": 120, "iban": "DE89370400440532013000"}
    bare = ScriptedLLM(model="scripted", native=False, script=[action("wire", args)])
    kickoff(bare, [wire], scope=None)
    assert len(sent) == 6  # CrewAI's own reruns of a failing tool (1.15)

    sent.clear()
    llm = ScriptedLLM(model="scripted", native=False, script=[action("wire", args)])
    assert kickoff(llm, protect([wire], ledger, effects={"wire": UNSAFE})) == "done"

    assert sent == [120]
    # Returned as the tool's answer, not raised: CrewAI has nothing to rerun.
    (observation,) = llm.observations()
    assert_honest(observation)
    key = idempotency_key("order-7", "wire", args)
    assert ledger.store.get("", key).record.state is State.UNKNOWN  # type: ignore[union-attr]


def test_crewai_reruns_of_a_keyed_tool_carry_one_key(ledger: Ledger) -> None:
    """A KEYED charge refused before it took effect is rerun by CrewAI: every run, one key."""
    provider = Provider()
    refusals = [2]

    @tool("charge")
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        provider.keys.append(twiceshy.current_key())
        if refusals[0] > 0:
            refusals[0] -= 1
            raise ConnectionRefusedError("the provider refused the connection")
        return provider.charge(twiceshy.current_key())

    guard = ledger.guard("charge", effect=KEYED, not_applied=[ConnectionRefusedError])
    llm = ScriptedLLM(model="scripted", native=False, script=[action("charge", CHARGE)])
    kickoff(llm, protect([charge], ledger, effects={"charge": guard}))

    assert llm.observations() == ["ch_1"]
    key = idempotency_key("order-7", "charge", CHARGE)
    # Two refused runs (each released, CrewAI reran it), then the charge: four keys, one value.
    assert provider.keys == [key, key, key, key]
    assert provider.effects == 1


def test_crewai_reruns_of_a_certain_failure_are_replayed(ledger: Ledger) -> None:
    """A definite failure is recorded: CrewAI's reruns get it replayed, the tool runs once."""
    runs: list[int] = []

    @tool("charge")
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        runs.append(amount)
        raise ValueError("card declined")

    guard = ledger.guard("charge", effect=KEYED, definite=[ValueError])
    llm = ScriptedLLM(model="scripted", native=False, script=[action("charge", CHARGE)])
    kickoff(llm, protect([charge], ledger, effects={"charge": guard}))

    assert runs == [4900]
    (observation,) = llm.observations()
    assert "card declined" in observation


# -- the model's re-call -------------------------------------------------------------------


def test_a_keyed_charge_recalled_by_the_model_takes_effect_once(ledger: Ledger) -> None:
    """A KEYED charge timed out on its one attempt; the model re-calls: same key, one charge."""
    provider = Provider()
    guard = ledger.guard("charge", effect=KEYED, attempts=1)
    tools = protect([charge_tool(provider)], ledger, effects={"charge": guard})
    llm = ScriptedLLM(
        model="scripted",
        script=[
            calls("charge", CHARGE, "call_1"),
            calls("charge", CHARGE, "call_2"),
            calls("charge", CHARGE, "call_3"),
        ],
    )

    kickoff(llm, tools)

    read = llm.results()
    assert read["call_1"].startswith(
        "The tool 'charge' did not finish on its one attempt (the last: TimeoutError: read timed "
        "out): it may have taken effect. It was sent with an idempotency key that stays the same "
        "for these arguments, so the provider applies it at most once"
    )
    assert "try again" not in read["call_1"].lower()
    assert read["call_2"] == read["call_3"] == "ch_1"
    key = idempotency_key("order-7", "charge", CHARGE)
    assert provider.keys == [key, key]  # call_3 was replayed from the ledger
    assert provider.effects == 1


def test_a_keyed_charge_is_retried_in_place_with_its_key(ledger: Ledger) -> None:
    """With the default attempts a timeout is retried inside the call: the model sees ch_1."""
    provider = Provider()
    tools = protect([charge_tool(provider)], ledger, effects={"charge": KEYED})
    llm = ScriptedLLM(
        model="scripted",
        script=[calls("charge", CHARGE, "call_1"), calls("charge", CHARGE, "call_2")],
    )

    kickoff(llm, tools)

    assert llm.results() == {"call_1": "ch_1", "call_2": "ch_1"}
    assert len(provider.keys) == 2
    assert len(set(provider.keys)) == 1
    assert provider.effects == 1


def test_an_unsafe_tool_recalled_by_the_model_reads_the_honest_text(ledger: Ledger) -> None:
    """An UNSAFE tool timed out after its effect: both calls read why; it ran once."""
    sent: list[str] = []

    @tool("notify")
    def notify(to: str, text: str) -> str:
        """Text the customer."""
        sent.append(text)
        raise TimeoutError("read timed out")

    args = {"to": "+15550100", "text": "Your order shipped"}
    llm = ScriptedLLM(
        model="scripted",
        script=[calls("notify", args, "call_1"), calls("notify", args, "call_2")],
    )

    kickoff(llm, protect([notify], ledger, effects={"notify": UNSAFE}))

    read = llm.results()
    assert_honest(read["call_1"])
    assert read["call_2"] == read["call_1"]
    assert sent == ["Your order shipped"]


# -- scopes, async tools, tool classes ---------------------------------------------------------


def test_two_scopes_both_run_and_a_rerun_of_one_replays(ledger: Ledger) -> None:
    """Two orders both charge; the first order run again replays its charge."""
    provider = Provider()
    tools = protect([charge_tool(provider, timeouts=0)], ledger, effects={"charge": KEYED})

    def charge_in(scope: str) -> str:
        llm = ScriptedLLM(model="scripted", script=[calls("charge", CHARGE, "call_1")])
        kickoff(llm, tools, scope=scope)
        return llm.results()["call_1"]

    assert [charge_in("order-1"), charge_in("order-2"), charge_in("order-1")] == [
        "ch_1",
        "ch_2",
        "ch_1",
    ]
    assert provider.effects == 2


@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
def test_an_async_tool_in_an_async_kickoff_runs_once(ledger: Ledger, native: bool) -> None:
    """An async UNSAFE tool under kickoff_async: one effect, the honest text on the re-call."""
    sent: list[str] = []

    @tool("notify")
    async def notify(to: str, text: str) -> str:
        """Text the customer."""
        sent.append(text)
        await asyncio.sleep(0)
        raise TimeoutError("read timed out")

    args = {"to": "+15550100", "text": "Your order shipped"}
    # A repeated text action is refused by CrewAI itself: the model re-calls natively only.
    turns = [calls("notify", args, "call_1"), calls("notify", args, "call_2")]
    llm = ScriptedLLM(
        model="scripted", native=native, script=turns if native else [action("notify", args)]
    )
    tools = protect([notify], ledger, effects={"notify": UNSAFE})

    async def go() -> Any:
        async with twiceshy.run("order-7"):
            return await crew_of(llm, tools).kickoff_async()

    asyncio.run(go())

    read = list(llm.results().values()) if native else llm.observations()
    assert len(read) == (2 if native else 1)
    assert_honest(read[0])
    assert read[-1] == read[0]
    assert sent == ["Your order shipped"]


class Refund(BaseTool):
    """A tool written as a BaseTool subclass."""

    name: str = "refund"
    description: str = "Refund a charge."
    done: list[str] = Field(default_factory=list)

    def _run(self, charge_id: str, amount: int) -> str:
        assert twiceshy.current_key() is not None  # the key the provider deduplicates by
        self.done.append(charge_id)
        if len(self.done) == 1:
            raise TimeoutError("read timed out")
        return f"refunded {amount} of {charge_id}"


def test_a_base_tool_subclass_is_protected_and_left_unchanged(ledger: Ledger) -> None:
    """A BaseTool subclass's _run goes through the ledger; the original tool is untouched."""
    original = Refund(done=[])
    (protected,) = protect([original], ledger, effects={"refund": KEYED})
    args = {"charge_id": "ch_1", "amount": "500"}
    llm = ScriptedLLM(
        model="scripted", script=[calls("refund", args, "call_1"), calls("refund", args, "call_2")]
    )

    kickoff(llm, [protected])

    # KEYED: retried in place with the same key; the re-call was replayed.
    assert llm.results() == {"call_1": "refunded 500 of ch_1", "call_2": "refunded 500 of ch_1"}
    assert original.done == ["ch_1", "ch_1"]
    assert type(original) is Refund
    assert isinstance(protected, Refund)
    assert (protected.name, protected.args_schema) == (original.name, original.args_schema)


def test_a_returned_tool_failure_is_recorded_and_replayed(ledger: Ledger) -> None:
    """A ToolFailure the tool returns is a certain failure: the re-call reads it, no rerun."""
    runs: list[int] = []

    @tool("charge")
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        runs.append(amount)
        return ToolFailure(message="card declined", code="card_declined")  # type: ignore[return-value]

    llm = ScriptedLLM(
        model="scripted",
        script=[calls("charge", CHARGE, "call_1"), calls("charge", CHARGE, "call_2")],
    )
    kickoff(llm, protect([charge], ledger, effects={"charge": KEYED}))

    assert llm.results() == {
        "call_1": "card declined (code: card_declined)",
        "call_2": "card declined (code: card_declined)",
    }
    assert runs == [4900]


def test_a_run_without_scope_does_not_run_the_tool(ledger: Ledger) -> None:
    """No twiceshy.run and no scope: MissingScope reaches CrewAI, and nothing is charged."""
    provider = Provider()
    tools = protect([charge_tool(provider)], ledger, effects={"charge": KEYED})
    llm = ScriptedLLM(model="scripted", script=[calls("charge", CHARGE, "call_1")])

    kickoff(llm, tools, scope=None)

    assert "twiceshy.run" in llm.results()["call_1"]
    assert provider.keys == []


def test_a_safe_tool_runs_without_a_scope(ledger: Ledger) -> None:
    """A SAFE tool keeps no record: a run with no scope still gets its answer."""

    @tool("lookup")
    def lookup(customer: str) -> str:
        """Look a customer up."""
        return f"{customer} is in good standing"

    llm = ScriptedLLM(model="scripted", script=[calls("lookup", {"customer": "cus_1"}, "c1")])
    kickoff(llm, protect([lookup], ledger, default=SAFE), scope=None)

    assert llm.results() == {"c1": "cus_1 is in good standing"}


class Receipt(BaseModel):
    """A typed result."""

    charge_id: str
    amount: int


def test_a_typed_result_reads_the_same_on_the_first_call_and_a_replay(ledger: Ledger) -> None:
    """A pydantic result is stored and rebuilt: the model reads one text both times."""
    runs: list[int] = []

    @tool("charge")
    def charge(amount: int, customer: str) -> Receipt:
        """Charge the customer, in cents."""
        runs.append(amount)
        return Receipt(charge_id="ch_1", amount=amount)

    llm = ScriptedLLM(
        model="scripted",
        script=[calls("charge", CHARGE, "call_1"), calls("charge", CHARGE, "call_2")],
    )
    kickoff(llm, protect([charge], ledger, effects={"charge": KEYED}))

    read = llm.results()
    assert read["call_1"] == read["call_2"]
    assert json.loads(read["call_1"]) == {"charge_id": "ch_1", "amount": 4900}
    assert runs == [4900]


def test_protection_is_declared_explicitly(ledger: Ledger) -> None:
    """A tool without an effect class, a stray name or a foreign object is refused at once."""
    charge = charge_tool(Provider())
    with pytest.raises(ValueError, match="no effect class"):
        protect([charge], ledger)
    with pytest.raises(ValueError, match="refund"):
        protect([charge], ledger, effects={"charge": KEYED, "refund": KEYED})
    with pytest.raises(TypeError, match="CrewAI"):
        protect([lambda: None], ledger, default=KEYED)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="effect"):
        protect([charge], ledger, effects={"charge": "KEYED"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="is named 'refund'"):
        protect([charge], ledger, effects={"charge": ledger.guard("refund", effect=KEYED)})
    with pytest.raises(TypeError, match="guard"):
        protect_tool(charge, KEYED)  # type: ignore[arg-type]


# -- processes: a race, and a crash --------------------------------------------------------


def _booking_crew(url: str, effects: Path, scope: str, barrier: Any, out: Any) -> None:
    """A process: a crew whose UNSAFE tool books a room slowly, on a shared ledger."""
    # CrewAI keeps each kickoff's task outputs in a SQLite file of its own, which 1.15.9 reads
    # while another process writes it: each racer gets its own (an absolute path is used as is).
    os.environ["CREWAI_STORAGE_DIR"] = str(effects.parent / f"crewai-{os.getpid()}")
    with Ledger(url) as ledger:

        @tool("book_room")
        def book_room(room: str, night: str) -> str:
            """Book a room for a night."""
            time.sleep(0.3)
            with effects.open("a", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
            return f"booked {room} for {night} by {os.getpid()}"

        guard = ledger.guard("book_room", effect=UNSAFE, wait=20)
        args = {"room": "101", "night": "2026-07-28"}
        llm = ScriptedLLM(model="scripted", script=[calls("book_room", args, f"c{os.getpid()}")])
        crew = crew_of(llm, protect([book_room], ledger, effects={"book_room": guard}))
        barrier.wait(60)
        with twiceshy.run(scope):
            crew.kickoff()
        out.put(next(iter(llm.results().values())))


def test_two_processes_racing_one_intent_run_it_once(tmp_path: Path) -> None:
    """Two crews in two processes, released together on one intent: one booking, one answer."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    effects = tmp_path / "effects"
    barrier, out = SPAWN.Barrier(2), SPAWN.Queue()
    racers = [
        SPAWN.Process(target=_booking_crew, args=(url, effects, "race-1", barrier, out))
        for _ in range(2)
    ]
    for racer in racers:
        racer.start()
    try:
        answers = [out.get(timeout=120) for _ in racers]
    finally:
        for racer in racers:
            racer.join(30)
            if racer.is_alive():
                racer.kill()
    assert [racer.exitcode for racer in racers] == [0, 0]
    booker = effects.read_text(encoding="utf-8").split()
    assert len(booker) == 1
    assert answers == [f"booked 101 for 2026-07-28 by {booker[0]}"] * 2


def _charging_crew(url: str, effects: Path, effect: str, crash: bool, out: Any) -> None:
    """A process running the order's crew: its charge tool takes effect, then (when ``crash``)
    the process dies by SIGKILL before the answer is recorded."""
    with Ledger(url) as ledger:

        @tool("charge")
        def charge(amount: int, customer: str) -> str:
            """Charge the customer, in cents."""
            key = twiceshy.current_key()
            seen = effects.read_text(encoding="utf-8").split() if effects.exists() else []
            if key in seen:  # the provider deduplicates by key
                return "ch_1"
            with effects.open("a", encoding="utf-8") as f:
                f.write(f"{key}\n")
            if crash:
                os.kill(os.getpid(), signal.SIGKILL)
            return f"ch_{len(seen) + 1}"

        guard = ledger.guard("charge", effect=twiceshy.Effect(effect), lease=0.5, wait=5)
        llm = ScriptedLLM(model="scripted", script=[calls("charge", CHARGE, f"c{int(crash)}")])
        with twiceshy.run("order-7"):
            crew_of(llm, protect([charge], ledger, effects={"charge": guard})).kickoff()
        out.put(next(iter(llm.results().values())))


@pytest.mark.parametrize("effect", [KEYED, UNSAFE], ids=["keyed", "unsafe"])
def test_a_crew_killed_inside_its_tool_and_run_again(tmp_path: Path, effect: Any) -> None:
    """kill -9 after the charge, then the order's crew run again: KEYED resumes with the same
    key (one charge, its id), UNSAFE reads the honest text (no second charge)."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    effects = tmp_path / "effects"
    out = SPAWN.Queue()
    crashed = SPAWN.Process(target=_charging_crew, args=(url, effects, effect.value, True, out))
    crashed.start()
    crashed.join(120)
    assert crashed.exitcode == -signal.SIGKILL

    again = SPAWN.Process(target=_charging_crew, args=(url, effects, effect.value, False, out))
    again.start()
    try:
        answer = out.get(timeout=120)
    finally:
        again.join(30)
    key = idempotency_key("order-7", "charge", CHARGE)
    assert effects.read_text(encoding="utf-8").split() == [key]
    if effect is KEYED:
        assert answer == "ch_1"
    else:
        assert_honest(answer)
