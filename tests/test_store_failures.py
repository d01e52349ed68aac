"""A ledger that fails around a call: a command refused before it reached the store, a reply
lost after its commit, a write lost before or after the work. A call whose tool never ran is
given back (its retry runs it, never OutcomeUnknown); one whose tool ran says so, and its retry
replays what was recorded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

import twiceshy
from fake_clock import FakeClock as Clock
from twiceshy import Change, Snapshot, State
from twiceshy.errors import StoreError
from twiceshy.stores import ThreadedAsyncStore
from twiceshy.stores.memory import MemoryStore

# -- before the work --------------------------------------------------------------------------


class ClaimFailsBeforeApplying(MemoryStore):
    """The next claim fails before it reaches the ledger."""

    fail = 1

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        if self.fail:
            self.fail -= 1
            raise twiceshy.StoreUnavailable("connection refused")
        return super().claim(namespace, key, **options)


def test_a_claim_that_never_reached_the_ledger_runs_once_on_retry() -> None:
    """A claim refused before it reached the ledger leaves nothing: the retry runs the tool once."""
    store = ClaimFailsBeforeApplying()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send(to: str) -> str:
        runs.append(1)
        return "sent"

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.StoreUnavailable):
            send("ada")
        assert runs == []
        assert send("ada") == "sent"
        assert send("ada") == "sent"
    assert runs == [1]


class LostClaimReply(MemoryStore):
    """The next claim commits, and then its reply is lost (the connection resets)."""

    lose = 1

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        if self.lose:
            self.lose -= 1
            raise twiceshy.StoreUnavailable("connection reset after the commit")
        return snap


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lost_claim_reply_never_parks_an_unsafe_intent_that_never_ran(mode: str) -> None:
    """The ledger failed before the tool ran: a retry runs it, never answers OutcomeUnknown."""
    clock = Clock()
    store = LostClaimReply(clock=clock)
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []

    if mode == "sync":

        @ledger.tool(effect=twiceshy.UNSAFE, lease=30, wait=0.05)
        def send(to: str) -> str:
            runs.append(1)
            return "sent"

        call: Callable[[], Any] = lambda: send("ada")  # noqa: E731
    else:

        @ledger.tool(effect=twiceshy.UNSAFE, lease=30, wait=0.05, name="send")
        async def asend(to: str) -> str:
            runs.append(1)
            return "sent"

        call = lambda: asyncio.run(asend("ada"))  # noqa: E731

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.StoreError):
            call()  # "the ledger failed; nothing ran unprotected"
        assert runs == []
        clock.now += 60  # the retry comes after the lease
        assert call() == "sent"
    assert runs == [1]


class LateClaimThenLostWrite(MemoryStore):
    """The next claim is answered late; the write after it fails (a connection lost)."""

    late = 0.0
    fail_next_write = False

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        late, self.late = self.late, 0.0
        time.sleep(late)
        return snap

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        if self.fail_next_write:
            self.fail_next_write = False
            raise StoreError("connection lost")
        return super().write(namespace, key, change)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_renewal_before_the_work_never_parks_an_unsafe_intent_that_never_ran(
    mode: str,
) -> None:
    """An owner whose pre-work lease renewal fails gives its claim back: the retry runs it."""
    store = LateClaimThenLostWrite()
    ledger = twiceshy.Ledger(
        store=store, async_store=ThreadedAsyncStore(store), counts_interval=None
    )
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, lease=0.2, wait=1.0, name="wire")
    def wire(n: int) -> int:
        runs.append(n)
        return n

    @ledger.tool(effect=twiceshy.UNSAFE, lease=0.2, wait=1.0, name="wire")
    async def awire(n: int) -> int:
        runs.append(n)
        return n

    async def acall() -> int:
        return await awire(1)

    def call() -> int:
        return wire(1) if mode == "sync" else asyncio.run(acall())

    # The claim's answer comes past the owner's trust in its lease (half of it), so the owner
    # renews first; that write is lost. Nothing ran.
    store.late, store.fail_next_write = 0.15, True
    with twiceshy.run("r"):
        with pytest.raises(StoreError):
            call()
        assert runs == []
        assert call() == 1  # the work never ran: the retry runs it, it is not OutcomeUnknown
    assert runs == [1]


# -- after the work ---------------------------------------------------------------------------


class LostOutcomeReply(MemoryStore):
    """The owner's SUCCEEDED write commits, and then its reply is lost."""

    lose = 1

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        snap = super().write(namespace, key, change)
        if change.to is State.SUCCEEDED and self.lose:
            self.lose -= 1
            raise twiceshy.StoreUnavailable("connection reset after the commit")
        return snap


def test_a_lost_reply_on_the_recorded_outcome_replays_without_a_rerun() -> None:
    """G9: the outcome was recorded; the caller is told it ran; the retry replays it."""
    ledger = twiceshy.Ledger(store=LostOutcomeReply(), counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send(to: str) -> str:
        runs.append(1)
        return "sent"

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.OutcomeNotRecorded):
            send("ada")
        assert send("ada") == "sent"
    assert runs == [1]


class RecordingFails(MemoryStore):
    """A store that fails every write once the work has started: the outcome cannot be kept."""

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        raise twiceshy.StoreUnavailable("the ledger went away")


def test_a_ledger_failing_after_the_work_ran_says_the_work_ran() -> None:
    """Not "the ledger is unreachable" (which reads as "nothing happened, try again"): the tool
    ran and may have taken effect, in words for the model."""
    ledger = twiceshy.Ledger(store=RecordingFails(), counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_fax(number: str) -> str:
        runs.append(1)
        return "sent"

    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeNotRecorded) as failed:
        send_fax("+15550100")
    assert runs == [1]
    assert isinstance(failed.value, twiceshy.StoreError)
    assert not isinstance(failed.value, ConnectionError)
    assert isinstance(failed.value.__cause__, twiceshy.StoreUnavailable)
    assert "ran" in str(failed.value)
    assert "try again" not in str(failed.value).lower()
