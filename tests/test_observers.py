"""Observers and logs: every protected call reports how it was answered."""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import pytest

import twiceshy
from twiceshy import Outcome


def recording_ledger(**kwargs: object) -> tuple[twiceshy.Ledger, list[twiceshy.CallEvent]]:
    """A memory ledger with an observer that keeps every event."""
    events: list[twiceshy.CallEvent] = []
    ledger = twiceshy.Ledger("memory://", observers=[events.append], **kwargs)  # type: ignore[arg-type]
    return ledger, events


def test_executed_then_replayed() -> None:
    """The first call reports EXECUTED with its key, a retry REPLAYED, with timings."""
    ledger, events = recording_ledger()

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        return amount

    with twiceshy.run("obs-1"):
        charge(1)
        charge(1)
    key = twiceshy.idempotency_key("obs-1", "charge", {"amount": 1})
    assert [(e.outcome, e.key, e.tool, e.effect) for e in events] == [
        (Outcome.EXECUTED, key, "charge", twiceshy.KEYED),
        (Outcome.REPLAYED, key, "charge", twiceshy.KEYED),
    ]
    assert all(e.error is None and e.duration >= 0 and e.started > 0 for e in events)


def test_refused_unknown_and_failed_calls() -> None:
    """Refusals, unknown outcomes and a tool's own failure are told with their errors."""
    ledger, events = recording_ledger()

    class Declined(Exception):
        pass

    @ledger.tool(effect=twiceshy.UNSAFE)
    def wire(amount: int) -> None:
        raise TimeoutError

    @ledger.tool(effect=twiceshy.UNSAFE, definite=[Declined])
    def charge(amount: int) -> None:
        raise Declined("no")

    with pytest.raises(twiceshy.MissingScope):
        wire(1)
    with twiceshy.run("obs-2"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(1)
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(1)
        with pytest.raises(Declined):
            charge(1)
        with pytest.raises(Declined):
            charge(1)
    assert [e.outcome for e in events] == [
        Outcome.REFUSED,
        Outcome.UNKNOWN,
        Outcome.UNKNOWN,
        Outcome.EXECUTED,
        Outcome.REPLAYED,
    ]
    assert events[0].key is None
    assert isinstance(events[1].error, twiceshy.OutcomeUnknown)
    assert isinstance(events[3].error, Declined)


def test_joined_and_waited_calls() -> None:
    """A duplicate in this process reports JOINED; one through another ledger reports WAITED."""
    store_ledger, events = recording_ledger()
    other = twiceshy.Ledger(store=store_ledger.store, observers=[events.append])
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(5)
        return "done"

    first = store_ledger.tool(effect=twiceshy.UNSAFE, name="slow")(slow)
    second = other.tool(effect=twiceshy.UNSAFE, name="slow")(slow)

    def call(fn: object) -> None:
        with twiceshy.run("obs-3"):
            fn()  # type: ignore[operator]

    leader = threading.Thread(target=call, args=(first,))
    leader.start()
    assert started.wait(5)
    joiner = threading.Thread(target=call, args=(first,))
    joiner.start()
    waiter = threading.Thread(target=call, args=(second,))
    waiter.start()
    time.sleep(0.1)
    release.set()
    for t in (leader, joiner, waiter):
        t.join(5)
    assert sorted(e.outcome.value for e in events) == sorted(
        [Outcome.EXECUTED.value, Outcome.JOINED.value, Outcome.WAITED.value]
    )


def test_reconciled_and_in_progress() -> None:
    """A reconciler's answer reports RECONCILED; a duplicate that outwaits reports IN_PROGRESS."""
    ledger, events = recording_ledger()

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=lambda key, args: twiceshy.Happened("found"))
    def wire(amount: int) -> str:
        raise TimeoutError

    with twiceshy.run("obs-4"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(1)
        assert wire(1) == "found"
    other = twiceshy.Ledger(store=ledger.store, observers=[events.append])
    key = twiceshy.idempotency_key("obs-5", "slow", {})
    fingerprint = hashlib.sha256(f"slow:{twiceshy.canonical_json({})}".encode()).hexdigest()
    ledger.store.claim(
        "", key, fingerprint=fingerprint, tool="slow", effect=twiceshy.UNSAFE, owner="o", lease=30
    )
    slow = other.tool(effect=twiceshy.UNSAFE, name="slow", wait=0.05)(lambda: None)
    with twiceshy.run("obs-5"), pytest.raises(twiceshy.InProgress):
        slow()
    assert [e.outcome for e in events] == [
        Outcome.UNKNOWN,
        Outcome.RECONCILED,
        Outcome.IN_PROGRESS,
    ]


def test_a_failing_observer_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """An observer that raises is logged; the call's result stands."""

    def broken(event: twiceshy.CallEvent) -> None:
        raise RuntimeError("metrics backend down")

    ledger = twiceshy.Ledger("memory://", observers=[broken])
    tool = ledger.tool(effect=twiceshy.KEYED, name="t")(lambda: 42)
    with twiceshy.run("obs-6"), caplog.at_level(logging.ERROR, logger="twiceshy"):
        assert tool() == 42
    assert "observer failed" in caplog.text


def test_calls_are_logged_with_their_fields(caplog: pytest.LogCaptureFixture) -> None:
    """With DEBUG on, each call is one log record carrying tool, key, effect and outcome."""
    ledger = twiceshy.Ledger("memory://")
    tool = ledger.tool(effect=twiceshy.KEYED, name="t")(lambda: 1)
    with twiceshy.run("obs-7"), caplog.at_level(logging.DEBUG, logger="twiceshy"):
        tool()
        tool()
    records = [r for r in caplog.records if hasattr(r, "twiceshy_outcome")]
    assert [r.twiceshy_outcome for r in records] == ["executed", "replayed"]  # type: ignore[attr-defined]
    assert all(r.twiceshy_tool == "t" for r in records)  # type: ignore[attr-defined]
    assert records[0].twiceshy_key == twiceshy.idempotency_key("obs-7", "t", {})  # type: ignore[attr-defined]


def test_unknown_outcome_warns_without_observers(caplog: pytest.LogCaptureFixture) -> None:
    """With no observer and only warnings shown, an unknown outcome is still logged as a warning."""
    ledger = twiceshy.Ledger("memory://")

    @ledger.tool(effect=twiceshy.UNSAFE)
    def wire() -> None:
        raise TimeoutError

    with (
        twiceshy.run("obs-8"),
        caplog.at_level(logging.WARNING, logger="twiceshy"),
        pytest.raises(twiceshy.OutcomeUnknown),
    ):
        wire()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].twiceshy_outcome == "unknown"  # type: ignore[attr-defined]
