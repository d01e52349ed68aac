"""Replays marked: whoever sees a call's answer can tell an earlier outcome from a fresh run."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

import twiceshy
from twiceshy import CallEvent, Outcome


def test_the_last_call_says_whether_it_was_replayed() -> None:
    """``was_replayed()`` and ``last_outcome()`` follow each call made in this context."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> str:
        return f"ch_{amount}"

    def calls() -> None:
        assert twiceshy.last_outcome() is None
        assert not twiceshy.was_replayed()
        with twiceshy.run("run-1"):
            charge(1)
            assert twiceshy.last_outcome() is Outcome.EXECUTED
            assert not twiceshy.was_replayed()
            charge(1)
            assert twiceshy.last_outcome() is Outcome.REPLAYED
            assert twiceshy.was_replayed()
            charge(2)
            assert not twiceshy.was_replayed()

    contextvars.Context().run(calls)  # a context no earlier call was made in


def test_a_refused_or_unknown_call_is_not_a_replay() -> None:
    """An honest error is no replayed answer: refused and unknown calls say so."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def wire(amount: int) -> str:
        raise TimeoutError("the bank did not answer")

    with pytest.raises(twiceshy.MissingScope):
        wire(1)
    assert twiceshy.last_outcome() is Outcome.REFUSED
    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(1)
        assert twiceshy.last_outcome() is Outcome.UNKNOWN
        assert not twiceshy.was_replayed()


def test_each_task_sees_its_own_last_call() -> None:
    """Concurrent tasks each read the answer of their own last call."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    async def charge(amount: int) -> str:
        await asyncio.sleep(0.01)
        return f"ch_{amount}"

    async def one(amount: int) -> bool:
        with twiceshy.run("run-1"):
            await charge(amount)
            return twiceshy.was_replayed()

    async def main() -> list[bool]:
        await one(1)  # the first run of intent 1
        return list(await asyncio.gather(one(1), one(2)))

    assert asyncio.run(main()) == [True, False]


def test_a_joined_call_is_a_replay_for_its_event() -> None:
    """A call that joined a running duplicate got that call's outcome: its event is marked."""
    events: list[CallEvent] = []
    ledger = twiceshy.Ledger("memory://", counts_interval=None, observers=[events.append])
    started, release = threading.Event(), threading.Event()

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> str:
        started.set()
        release.wait(5)
        return f"ch_{amount}"

    def leader() -> None:
        with twiceshy.run("run-1"):
            charge(1)

    thread = threading.Thread(target=leader)
    thread.start()
    assert started.wait(5)
    threading.Timer(0.05, release.set).start()
    with twiceshy.run("run-1"):
        assert charge(1) == "ch_1"
        assert twiceshy.was_replayed()
    thread.join(5)
    assert {(event.outcome, event.replayed) for event in events} == {
        (Outcome.EXECUTED, False),
        (Outcome.JOINED, True),
    }


def test_which_outcomes_are_replays() -> None:
    """Replayed, joined, waited for and reconciled answers are earlier outcomes; the rest not."""
    assert {outcome for outcome in Outcome if outcome.replayed} == {
        Outcome.REPLAYED,
        Outcome.JOINED,
        Outcome.WAITED,
        Outcome.RECONCILED,
    }
