"""Sequences of events under which a guarantee of DESIGN.md could break: late answers, lost
replies, lapses, interruptions, joins.

Each was found by an adversarial review of the core; those that broke a guarantee were fixed
with the test here, and the probes that found nothing are kept as regression tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import twiceshy
from twiceshy import Change, Snapshot, State
from twiceshy.stores import ThreadedAsyncStore
from twiceshy.stores.memory import MemoryStore


class Clock:
    """A store clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def states(store: Any) -> list[State]:
    return [record.state for record in store.records("", states=list(State))]


# -- UNSAFE run twice ------------------------------------------------------------------------


class PausedAfterClaim(MemoryStore):
    """The next claim commits, then ``pause()`` runs before its answer reaches the caller."""

    pause: Callable[[], None] | None = None

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        pause, self.pause = self.pause, None
        if pause is not None:
            pause()
        return snap


def test_an_unsafe_owner_paused_past_its_lease_never_runs_beside_a_rerun_after_a_release() -> None:
    """An UNSAFE owner resumed past its trust must not run once its intent was released and run."""
    clock = Clock()
    store = PausedAfterClaim(clock=clock)
    paused_ledger = twiceshy.Ledger(store=store, counts_interval=None)
    other_ledger = twiceshy.Ledger(store=store, counts_interval=None)  # another process
    runs: list[str] = []

    @paused_ledger.tool(effect=twiceshy.UNSAFE, lease=0.2, name="wire")
    def wire(amount: int) -> str:
        runs.append("paused owner")
        return "paused owner"

    @other_ledger.tool(effect=twiceshy.UNSAFE, lease=0.2, wait=0.05, name="wire")
    def wire_elsewhere(amount: int) -> str:
        runs.append("other")
        return "other"

    # An operator's reconciler (`twiceshy reconcile`): it looks at the provider, where nothing
    # has happened yet.
    operator = other_ledger.guard(
        "wire",
        effect=twiceshy.UNSAFE,
        reconcile=lambda key, args: twiceshy.DidNotHappen(),
        release_grace=0.0,  # no grace for a paused owner: its renewal is what stops it
    )
    key = twiceshy.idempotency_key("run-1", "wire", {"amount": 5})

    def paused() -> None:
        clock.now += 10  # the process is paused: its lease lapses on the store's clock
        with twiceshy.run("run-1"):
            with pytest.raises(twiceshy.OutcomeUnknown):
                wire_elsewhere(5)  # finds the lapsed lease: UNKNOWN
            assert operator.settle(key) is not None  # nothing happened: RELEASED
            assert wire_elsewhere(5) == "other"  # the intent runs, once
        time.sleep(0.15)  # the paused owner's own clock passes its trust in the lease too

    store.pause = paused
    with twiceshy.run("run-1"):
        wire(5)
    assert runs == ["other"]


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_an_unsafe_intent_reconciled_as_happened_with_no_retention_never_reruns(
    kind: str, tmp_path: Path
) -> None:
    """A reconciler said the UNSAFE intent happened: the same call must not run it again."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}" if kind == "sqlite" else "memory://"
    ledger = twiceshy.Ledger(url, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, ttl=0, reconcile=lambda k, a: twiceshy.Happened("sent"))
    def send(to: str) -> str:
        runs.append(1)
        if len(runs) == 1:
            raise TimeoutError("the provider did not answer")
        return "sent a second time"

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            send("ada")
        assert send("ada") == "sent"  # the reconciler's answer
    assert runs == [1]
    ledger.close()


# -- claims left CLAIMED with nobody renewing them ----------------------------------------------


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


class InterruptedAfterOp(MemoryStore):
    """Ctrl-C lands right after the ``n``-th claim or write of the caller's thread committed."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def _tick(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.n -= 1
            if self.n == 0:
                raise KeyboardInterrupt

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        self._tick()
        return snap

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        snap = super().write(namespace, key, change)
        self._tick()
        return snap


@pytest.mark.parametrize(
    ("effect", "n", "after"),
    [
        (twiceshy.UNSAFE, 1, State.RELEASED),  # right after the claim: the tool never ran
        (twiceshy.KEYED, 2, State.UNKNOWN),  # right after an in-place retry's renewal
    ],
)
def test_ctrl_c_right_after_a_blocking_store_write_leaves_no_claim_unrenewed(
    effect: twiceshy.Effect, n: int, after: State
) -> None:
    """Ctrl-C in a store command of a blocking call is given back, as a cancellation is."""
    store = InterruptedAfterOp(n)
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=effect, wait=0.05, backoff=lambda attempt: 0.0)
    def charge(amount: int) -> str:
        runs.append(amount)
        if effect is twiceshy.KEYED and len(runs) == 1:
            raise TimeoutError("read timed out")
        return "charged"

    with twiceshy.run("run-1"):
        with pytest.raises(KeyboardInterrupt):
            charge(5)
        assert states(store) == [after]
        assert charge(5) == "charged"  # at once, not InProgress until the lease lapses


class SlowClaim(MemoryStore):
    """Every claim commits, and answers 0.3 s later (a slow round trip)."""

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        time.sleep(0.3)
        return snap


def test_a_claim_cancelled_twice_is_given_back() -> None:
    """A second cancellation while a cancelled claim finishes must not leave it CLAIMED."""
    store = SlowClaim()
    ledger = twiceshy.Ledger(
        store=store, async_store=ThreadedAsyncStore(store), counts_interval=None
    )
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, wait=0.05)
    async def send(to: str) -> str:
        runs.append(1)
        return "sent"

    async def main() -> str:
        with twiceshy.run("run-1"):
            task = asyncio.create_task(send("ada"))
            await asyncio.sleep(0.1)
            task.cancel()  # the framework's timeout
            await asyncio.sleep(0.05)
            task.cancel()  # the task group around it, shutting down
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.4)  # the claim has committed in the store's thread
            assert states(store) == [State.RELEASED]
            return await send("ada")

    assert asyncio.run(main()) == "sent"
    assert runs == [1]


def test_ctrl_c_as_the_work_is_about_to_start_leaves_no_heartbeat_renewing_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C between the heartbeat's start and the work: nobody renews the lease forever."""
    import twiceshy._drivers as ledger_module

    store = MemoryStore()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE, lease=0.3, wait=0.05)
    def send(to: str) -> str:
        return "sent"

    real = ledger_module.set_call

    def interrupted(call: Any) -> Any:
        monkeypatch.setattr(ledger_module, "set_call", real)
        raise KeyboardInterrupt  # where a signal may land: the lease is renewed from here on

    monkeypatch.setattr(ledger_module, "set_call", interrupted)
    with twiceshy.run("run-1"):
        with pytest.raises(KeyboardInterrupt):
            send("ada")
        assert states(store) == [State.RELEASED]  # the work never started: given back
        time.sleep(1.0)  # three leases
        assert send("ada") == "sent"  # not InProgress for the process's life


# -- waits past wait= -------------------------------------------------------------------------


def test_a_joined_call_whose_leader_is_cancelled_answers_within_its_wait() -> None:
    """A duplicate joined in this process answers within its wait=, whatever its leader does."""
    store = MemoryStore()
    here = twiceshy.Ledger(store=store, counts_interval=None)
    elsewhere = twiceshy.Ledger(store=store, counts_interval=None)  # another process
    release = threading.Event()

    @elsewhere.tool(effect=twiceshy.KEYED, name="charge")
    def charge_elsewhere(amount: int) -> str:
        release.wait(10)
        return "elsewhere"

    @here.tool(effect=twiceshy.KEYED, wait=1.0, name="charge")
    async def charge(amount: int) -> str:
        raise AssertionError("the intent runs elsewhere")

    def other() -> None:
        with twiceshy.run("run-1"):
            charge_elsewhere(5)

    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.1)

    async def main() -> float:
        with twiceshy.run("run-1"):
            leader = asyncio.create_task(charge(5))
            await asyncio.sleep(0.01)
            started = time.monotonic()
            joined = asyncio.create_task(charge(5))
            await asyncio.sleep(0.7)
            leader.cancel()
            with pytest.raises(twiceshy.InProgress):
                await joined
            return time.monotonic() - started

    try:
        took = asyncio.run(main())
    finally:
        release.set()
        thread.join(10)
    assert took < 1.0 + 0.4  # not 0.7 + a fresh 1.0


# -- answers and counts -----------------------------------------------------------------------


def test_an_owner_fenced_out_after_running_the_tool_is_counted_executed() -> None:
    """A call that ran the tool is EXECUTED, even when a takeover's outcome answers it."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    events: list[twiceshy.CallEvent] = []
    stale = twiceshy.Ledger(store=store, counts_interval=None, observers=[events.append])
    other = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[str] = []

    @other.tool(effect=twiceshy.KEYED, lease=1, name="charge")
    def charge_elsewhere(amount: int) -> str:
        runs.append("takeover")
        return "takeover"

    @stale.tool(effect=twiceshy.KEYED, lease=1, name="charge")
    def charge(amount: int) -> str:
        runs.append("stale")
        clock.now += 5  # paused past the lease; another process takes the intent over
        with twiceshy.run("run-1"):
            assert charge_elsewhere(amount) == "takeover"
        return "stale"

    with twiceshy.run("run-1"):
        assert charge(5) == "takeover"  # the record's real outcome (G4)
    assert runs == ["stale", "takeover"]
    assert [event.outcome for event in events] == [twiceshy.Outcome.EXECUTED]


def test_an_unsafe_owner_whose_tool_did_not_apply_after_a_lapse_is_not_answered_unknown() -> None:
    """The owner learned nothing happened: its caller is not told the outcome is unknown."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    owner = twiceshy.Ledger(store=store, counts_interval=None)
    other = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[str] = []

    @other.tool(effect=twiceshy.UNSAFE, lease=1, name="send")
    def send_elsewhere(to: str) -> str:
        runs.append("other")
        return "other"

    @owner.tool(effect=twiceshy.UNSAFE, lease=1, name="send")
    def send(to: str) -> str:
        runs.append("owner")
        clock.now += 5  # paused past the lease: a duplicate marks the lapse UNKNOWN
        with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown):
            send_elsewhere(to)
        raise twiceshy.NotApplied("the provider refused the request before sending")

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.NotApplied):
            send("ada")
        assert send_elsewhere("ada") == "other"  # nothing happened: it may run
    assert runs == ["owner", "other"]


# -- probes that found nothing (regression tests) ---------------------------------------------


def test_a_keyed_owner_fenced_out_between_attempts_does_not_run_again() -> None:
    """A takeover during the backoff: the stale owner's next attempt never runs."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    stale = twiceshy.Ledger(store=store, counts_interval=None)
    other = twiceshy.Ledger(store=store, counts_interval=None)
    keys: list[str | None] = []

    @other.tool(effect=twiceshy.KEYED, lease=1, name="charge")
    def charge_elsewhere(amount: int) -> str:
        keys.append(twiceshy.current_key())
        return "takeover"

    @stale.tool(effect=twiceshy.KEYED, lease=1, name="charge", backoff=lambda attempt: 0.0)
    def charge(amount: int) -> str:
        keys.append(twiceshy.current_key())
        clock.now += 5
        with twiceshy.run("run-1"):
            charge_elsewhere(amount)
        raise TimeoutError("read timed out")

    with twiceshy.run("run-1"):
        assert charge(5) == "takeover"
    assert len(keys) == 2
    assert len(set(keys)) == 1  # G5: one key for the provider


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


class SlowOps(MemoryStore):
    """Every claim and write commits, then answers 20 ms later."""

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        time.sleep(0.02)
        return snap

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        snap = super().write(namespace, key, change)
        time.sleep(0.02)
        return snap


def _cancelled_once(effect: twiceshy.Effect, delay: float) -> tuple[list[State], int]:
    """One call cancelled after ``delay``: the states left, and how often the tool ran."""
    store = SlowOps()
    ledger = twiceshy.Ledger(
        store=store, async_store=ThreadedAsyncStore(store), counts_interval=None
    )
    runs: list[int] = []
    attempts = 1 if effect is twiceshy.UNSAFE else 3

    @ledger.tool(effect=effect, attempts=attempts, backoff=lambda n: 0.01, wait=0.05)
    async def tool(x: int) -> str:
        runs.append(x)
        await asyncio.sleep(0.01)
        if effect is twiceshy.KEYED and len(runs) < 3:
            raise TimeoutError("read timed out")
        return "done"

    async def main() -> list[State]:
        with twiceshy.run("run-1"):
            task = asyncio.create_task(tool(1))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await task
            await asyncio.sleep(0.05)
            found = states(store)
            if effect is twiceshy.UNSAFE:
                with contextlib.suppress(twiceshy.OutcomeUnknown):
                    await tool(1)
            return found

    return asyncio.run(main()), len(runs)


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_one_cancellation_at_any_moment_leaves_no_claim_unrenewed(effect: twiceshy.Effect) -> None:
    """Cancelled at 3 ms steps through claims, runs, backoffs and writes: never left CLAIMED,
    and an UNSAFE tool never runs a second time."""
    for step in range(30):
        found, runs = _cancelled_once(effect, step * 0.003)
        assert State.CLAIMED not in found, (step, found)
        if effect is twiceshy.UNSAFE:
            assert runs <= 1, step


class ClaimFailsBeforeApplying(MemoryStore):
    """The next claim fails before it reaches the ledger."""

    fail = 1

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        if self.fail:
            self.fail -= 1
            raise twiceshy.StoreUnavailable("connection refused")
        return super().claim(namespace, key, **options)


def test_a_claim_that_never_reached_the_ledger_runs_once_on_retry() -> None:
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


def test_remember_never_answers_a_doubt_later_settled_by_a_reconciler() -> None:
    """remember= keeps only settled records: a parked intent reconciled later is answered right."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None, remember=8)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=lambda key, args: None)
    def send(to: str) -> str:
        runs.append(1)
        raise TimeoutError("the provider did not answer")

    settler = ledger.guard(
        "send", effect=twiceshy.UNSAFE, reconcile=lambda key, args: twiceshy.Happened("ok")
    )
    with twiceshy.run("run-1"):
        for _ in range(2):
            with pytest.raises(twiceshy.OutcomeUnknown):
                send("ada")
        key = twiceshy.idempotency_key("run-1", "send", {"to": "ada"})
        record = settler.settle(key)
        assert record is not None
        assert record.state is State.SUCCEEDED
        assert send("ada") == "ok"
        assert send("ada") == "ok"
    assert runs == [1]
