"""Leases: an owner's claim holds while its heartbeat renews it, even on a slow or failing
store; an owner paused past its lease never runs beside the call that took its intent over, and
a takeover's outcome answers every caller, the stale owner's included."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import twiceshy
from fake_clock import FakeClock as Clock
from twiceshy import Change, Snapshot, State
from twiceshy.stores.memory import MemoryStore

# -- the heartbeat ----------------------------------------------------------------------------


def _is_renewal(change: Change) -> bool:
    return (
        change.to is State.CLAIMED
        and change.new_owner is None
        and not change.count_attempt
        and change.lease is not None
    )


class SlowRenewals(MemoryStore):
    """Every lease renewal takes ``delay`` seconds (a slow or contended store)."""

    delay = 0.4

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        if _is_renewal(change):
            time.sleep(self.delay)
        return super().write(namespace, key, change)


def test_a_slow_store_never_lets_the_heartbeat_lapse_a_running_unsafe_call() -> None:
    """Serial renewals of many leases on a slow store must not lapse a call that still runs."""
    store = SlowRenewals()
    owner_ledger = twiceshy.Ledger(store=store, counts_interval=None)
    other_ledger = twiceshy.Ledger(store=store, counts_interval=None)  # another process
    runs: list[int] = []

    @owner_ledger.tool(effect=twiceshy.UNSAFE, lease=0.9, name="wire")
    def wire(n: int) -> int:
        runs.append(n)
        time.sleep(2.0)
        return n

    @other_ledger.tool(effect=twiceshy.UNSAFE, lease=0.9, wait=4.0, name="wire")
    def wire_elsewhere(n: int) -> int:
        runs.append(-n)
        return n

    answers: dict[int, Any] = {}

    def call(n: int) -> None:
        with twiceshy.run("r"):
            answers[n] = wire(n)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(1.3)  # every call still runs; the last leases wait behind slow renewals
    try:
        with twiceshy.run("r"):
            duplicate: Any = wire_elsewhere(5)
    except twiceshy.OutcomeUnknown as exc:
        duplicate = exc
    for thread in threads:
        thread.join(10)
    assert answers == {n: n for n in range(6)}
    assert sorted(runs) == list(range(6))
    # The duplicate of a call that was running and then succeeded waits for it (G8); it must
    # not tell the model that the action may have happened and needs checking.
    assert duplicate == 5


class FirstRenewalFails(MemoryStore):
    """A store whose first lease renewal raises what no store error is (a custom store's bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals = 0

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        if _is_renewal(change):
            self.renewals += 1
            if self.renewals == 1:
                raise ConnectionError("a network blip the store did not expect")
        return super().write(namespace, key, change)


def test_a_renewal_that_raises_anything_leaves_the_heartbeat_renewing() -> None:
    """The owner's lease is renewed at the next beat: nobody takes over a running call."""
    store = FirstRenewalFails()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    other = twiceshy.Ledger(store=store, counts_interval=None)  # another process, in effect
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, lease=0.3, name="job")
    def job(x: int) -> int:
        runs.append("owner")
        time.sleep(1.2)
        return x

    @other.tool(effect=twiceshy.KEYED, lease=0.3, wait=0.1, name="job")
    def job_elsewhere(x: int) -> int:
        runs.append("other")
        return x

    def owner() -> None:
        with twiceshy.run("run-1"):
            job(1)

    thread = threading.Thread(target=owner)
    thread.start()
    time.sleep(0.7)  # past the lease, had the failed renewal been the last one
    with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress):
        job_elsewhere(1)
    thread.join(10)
    assert runs == ["owner"]
    assert store.renewals >= 2


class LateClaimAnswer(MemoryStore):
    """A store whose answer to one thread's claim arrives late (a slow round trip, a pause)."""

    def claim(self, *args: Any, **kwargs: Any) -> Snapshot:
        snap = super().claim(*args, **kwargs)
        if threading.current_thread().name == "late-owner":
            time.sleep(0.9)
        return snap


def test_an_unsafe_owner_answered_late_renews_its_lease_before_a_duplicate_finds_it_lapsed() -> (
    None
):
    """Most of its 1 s lease was gone when the claim's answer came: it runs anyway (nobody else
    will), and its heartbeat renews at once, so a duplicate finds the call running, not lapsed."""
    store = LateClaimAnswer()
    tools = []
    for _ in range(2):
        ledger = twiceshy.Ledger(store=store, counts_interval=None)

        @ledger.tool(effect=twiceshy.UNSAFE, lease=1.0, wait=0.05, name="charge")
        def charge(amount: int) -> str:
            time.sleep(1.5)
            return "charged"

        tools.append(charge)
    owner_tool, duplicate = tools
    answers: dict[str, Any] = {}

    def owner() -> None:
        with twiceshy.run("run-1"):
            answers["owner"] = owner_tool(1)

    thread = threading.Thread(target=owner, name="late-owner")
    thread.start()
    time.sleep(1.1)  # past the lease granted at the claim, had nobody renewed it
    with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress):
        duplicate(1)
    thread.join(10)
    assert answers["owner"] == "charged"


# -- owners paused past their lease -----------------------------------------------------------


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


# -- takeovers --------------------------------------------------------------------------------


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
