"""Call counts: every call is counted by how it was answered, and the counts reach the store."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

import twiceshy
from twiceshy.stores import CallCounts, Store
from twiceshy.stores.memory import MemoryStore


def shop(
    ledger: twiceshy.Ledger,
    gate: threading.Event | None = None,
    started: threading.Event | None = None,
) -> Any:
    """A KEYED charge tool that says when it started and waits for ``gate`` when given them."""

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> dict[str, int]:
        if started is not None:
            started.set()
        if gate is not None:
            gate.wait(10)
        return {"amount": amount}

    return charge


def test_a_flush_adds_the_calls_to_the_store(store: Store) -> None:
    """A first call, its replays and a joined duplicate are in the store after a flush."""
    assert isinstance(store, CallCounts)
    ledger = twiceshy.Ledger(store=store, namespace="shop")
    gate, started = threading.Event(), threading.Event()
    charge = shop(ledger, gate, started)

    def call() -> None:
        with twiceshy.run("run-1"):
            charge(100)

    first = threading.Thread(target=call)
    first.start()
    assert started.wait(10)  # the first call is running
    joined = threading.Thread(target=call)
    joined.start()
    time.sleep(0.05)
    gate.set()
    first.join(10)
    joined.join(10)
    call()
    call()
    assert store.counts("shop") == {}  # nothing flushed before the interval or a flush
    ledger.flush_counts()  # as close() does; close() would also close the test's store
    assert store.counts("shop") == {
        ("charge", "executed"): 1,
        ("charge", "ran"): 1,
        ("charge", "joined"): 1,
        ("charge", "replayed"): 2,
    }
    assert ledger.counts() == {}


def test_counts_are_flushed_every_interval(store: Store) -> None:
    """Without a close, the counts reach the store within the interval."""
    assert isinstance(store, CallCounts)
    ledger = twiceshy.Ledger(store=store, namespace="shop", counts_interval=0.05)
    charge = shop(ledger)
    with twiceshy.run("run-2"):
        charge(1)
        charge(1)
    deadline = time.monotonic() + 10
    while store.counts("shop") != {
        ("charge", "executed"): 1,
        ("charge", "ran"): 1,
        ("charge", "replayed"): 1,
    }:
        assert time.monotonic() < deadline, store.counts("shop")
        time.sleep(0.02)


def test_refusals_and_unknown_outcomes_are_counted(store: Store) -> None:
    """A call refused before running and an UNSAFE call whose outcome is unknown are counted."""
    ledger = twiceshy.Ledger(store=store, namespace="shop")

    @ledger.tool(effect=twiceshy.UNSAFE)
    def fax(text: str) -> None:
        raise TimeoutError("no answer")

    with pytest.raises(twiceshy.MissingScope):
        fax("hello")
    with twiceshy.run("run-3"), pytest.raises(twiceshy.OutcomeUnknown):
        fax("hello")
    with twiceshy.run("run-3"), pytest.raises(twiceshy.OutcomeUnknown):
        fax("hello")
    assert ledger.counts() == {("fax", "refused"): 1, ("fax", "unknown"): 2, ("fax", "ran"): 1}


def test_counts_interval_none_keeps_the_counts_in_the_process() -> None:
    """With counts_interval=None nothing is written to the store, even at close."""
    store = MemoryStore()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    charge = shop(ledger)
    with twiceshy.run("run-4"):
        charge(1)
    ledger.close()
    assert store.counts("") == {}
    assert ledger.counts() == {}


def test_counts_interval_must_be_positive() -> None:
    """A zero or negative interval is refused when the ledger is made."""
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="counts_interval"):
            twiceshy.Ledger("memory://", counts_interval=bad)


class FailingCounts(MemoryStore):
    """A memory store whose call counts cannot be written."""

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        raise twiceshy.StoreUnavailable("the counts table is gone")


def test_a_failed_flush_keeps_the_counts_for_the_next() -> None:
    """A store error on flush is raised to the caller, and no count is lost."""
    ledger = twiceshy.Ledger(store=FailingCounts())
    charge = shop(ledger)
    with twiceshy.run("run-5"):
        charge(1)
        charge(1)
    with pytest.raises(twiceshy.StoreUnavailable):
        ledger.flush_counts()
    assert ledger.counts() == {
        ("charge", "executed"): 1,
        ("charge", "ran"): 1,
        ("charge", "replayed"): 1,
    }


def test_a_failed_flush_at_close_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """Closing a ledger whose counts cannot be written still closes it, with a warning."""
    ledger = twiceshy.Ledger(store=FailingCounts())
    with twiceshy.run("run-6"):
        shop(ledger)(1)
    ledger.close()
    assert "could not add call counts" in caplog.text


def test_the_flushing_thread_ends_when_idle_and_starts_again() -> None:
    """With no calls for a few intervals the thread ends; the next call starts one again."""
    store = MemoryStore()
    ledger = twiceshy.Ledger(store=store, counts_interval=0.02)
    charge = shop(ledger)

    def flushers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "twiceshy-counts" and t.is_alive()]

    before = len(flushers())
    with twiceshy.run("run-7"):
        charge(1)
    deadline = time.monotonic() + 10
    while (
        store.counts("") != {("charge", "executed"): 1, ("charge", "ran"): 1}
        or len(flushers()) > before
    ):
        assert time.monotonic() < deadline, (store.counts(""), flushers())
        time.sleep(0.01)
    with twiceshy.run("run-7"):
        charge(1)
    while store.counts("") != {
        ("charge", "executed"): 1,
        ("charge", "ran"): 1,
        ("charge", "replayed"): 1,
    }:
        assert time.monotonic() < deadline, store.counts("")
        time.sleep(0.01)


def test_counts_a_store_keeps_refusing_are_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After three failed flushes in a row the pending counts go, and the thread can end."""
    ledger = twiceshy.Ledger(store=FailingCounts(), counts_interval=0.02)
    with twiceshy.run("run-8"):
        shop(ledger)(1)
    # The warning is the promise: wait for it (the pending counts are already gone when the
    # thread logs it, and they are out of sight while a flush is under way).
    deadline = time.monotonic() + 10
    while "dropped the counts" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.01)
    assert "dropped the counts of 1 calls after 3 failed flushes" in caplog.text
    assert ledger.counts() == {}
    assert caplog.text.count("could not add call counts") >= 3


def test_close_adds_the_pending_counts() -> None:
    """Closing a ledger adds what it counted since the last flush, before the store closes."""
    ledger = twiceshy.Ledger(store=MemoryStore(), namespace="shop")
    with twiceshy.run("run-9"):
        shop(ledger)(5)
    inner = ledger.store
    ledger.close()
    assert isinstance(inner, CallCounts)
    assert inner.counts("shop") == {("charge", "executed"): 1, ("charge", "ran"): 1}


def _child_calls() -> None:
    """In a forked child: one replay on the inherited ledger, then close (flush)."""
    ledger = _INHERITED[0]
    with twiceshy.run("run-10"):
        shop(ledger)(1)
    ledger.close()


_INHERITED: list[twiceshy.Ledger] = []


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_a_forked_child_counts_only_its_own_calls(tmp_path: Any) -> None:
    """A child forked with pending counts flushes its own calls, never its parent's again."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = twiceshy.Ledger(url)
    with twiceshy.run("run-10"):
        shop(ledger)(1)  # executed, pending in the parent
    _INHERITED[:] = [ledger]
    child = multiprocessing.get_context("fork").Process(target=_child_calls)
    child.start()
    child.join(30)
    assert child.exitcode == 0
    ledger.close()
    reader = twiceshy.Ledger(url, counts_interval=None)
    store = reader.store
    assert isinstance(store, CallCounts)
    assert store.counts("") == {
        ("charge", "executed"): 1,
        ("charge", "ran"): 1,
        ("charge", "replayed"): 1,
    }
    reader.close()
