"""Clocks that disagree, on the stores that judge leases and retention on their callers' clocks
(SQLite, DynamoDB).

Each test runs two "processes" of one deployment: two ledgers, each on its own store object over
the same ledger (one file; one table under one prefix), each store on its own clock, one of them
days off. An UNSAFE tool counts its effects. Whatever the clocks say, an outcome is never found
expired before it was written, a running claim is never found lapsed because its record lies in
the reader's future, the tool never runs a second time, and the skew is logged.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import servers
import twiceshy
from fake_clock import FakeClock
from twiceshy.stores import Store
from twiceshy.stores.sqlite import SQLiteStore

DAY = 86_400.0
SKEW = 3 * DAY
SCOPE = "run-1"

#: Opens a store on the test's one ledger with the clock given: another process.
Opener = Callable[[Callable[[], float]], Store]


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("dynamodb", id="dynamodb", marks=pytest.mark.dynamodb),
    ]
)
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Each store kind in turn: opens stores of one ledger, each on a clock of its own."""
    opened: list[Store] = []
    if request.param == "sqlite":

        def make(clock: Callable[[], float]) -> Store:
            store = SQLiteStore(tmp_path / "ledger.db", clock=clock)
            opened.append(store)
            return store

        yield make
        for store in opened:
            store.close()
        return
    endpoint = servers.require("dynamodb")
    from twiceshy.stores.dynamodb import DynamoDBStore

    prefix = f"twiceshy-test-{secrets.token_hex(6)}"

    def make_dynamodb(clock: Callable[[], float]) -> Store:
        store = DynamoDBStore(
            servers.DYNAMODB_TABLE,
            endpoint_url=endpoint,
            prefix=prefix,
            clock=clock,
            **servers.DYNAMODB_OPTIONS,
        )
        opened.append(store)
        return store

    yield make_dynamodb
    for store in opened:
        store.close()
    servers.delete_dynamodb_prefix(prefix)


def _ledger(open_store: Opener, clock: Callable[[], float]) -> twiceshy.Ledger:
    """A process of the deployment, on ``clock``."""
    return twiceshy.Ledger(store=open_store(clock), counts_interval=None)


def _skews(caplog: pytest.LogCaptureFixture, what: str) -> list[float]:
    """The skews (seconds) of the warnings logged that a record was written ahead of this
    process's clock (``what="read"``), or that an expiry was counted from a time ahead of it
    (``what="written"``)."""
    pattern = (
        r"written ([\d.]+) s ahead of this process's clock"
        if what == "read"
        else r"had already written a time ([\d.]+) s ahead of this process's clock"
    )
    return [
        float(m.group(1))
        for r in caplog.records
        if r.name == "twiceshy" and r.levelno == logging.WARNING
        for m in [re.search(pattern, r.getMessage())]
        if m is not None
    ]


def test_an_outcome_settled_by_a_clock_days_behind_replays_to_a_correct_clock(
    open_store: Opener, caplog: pytest.LogCaptureFixture
) -> None:
    """An UNSAFE outcome a reconciler days behind recorded replays on a correct clock, unrun."""
    clock = FakeClock()
    right = _ledger(open_store, clock)
    behind = _ledger(open_store, clock.shifted(-SKEW))
    effects: list[int] = []

    @right.tool(effect=twiceshy.UNSAFE, name="wire")
    def wire(amount: int) -> str:
        effects.append(amount)
        if len(effects) == 1:
            raise TimeoutError("the bank did not answer")  # after the money left
        return "wired a second time"

    # The bank, asked by the other process's reconciler: the transfer is there.
    @behind.tool(
        effect=twiceshy.UNSAFE, name="wire", reconcile=lambda key, args: twiceshy.Happened("wired")
    )
    def wire_behind(amount: int) -> str:
        effects.append(amount)
        return "wired a second time"

    with twiceshy.run(SCOPE), pytest.raises(twiceshy.OutcomeUnknown):
        wire(4900)
    clock.advance(60)
    with caplog.at_level(logging.WARNING, logger="twiceshy"), twiceshy.run(SCOPE):
        assert wire_behind(4900) == "wired"
    clock.advance(60)
    with twiceshy.run(SCOPE):
        assert wire(4900) == "wired"  # replayed: the outcome is kept for its ttl, a day
    assert effects == [4900]
    assert _skews(caplog, "read") + _skews(caplog, "written") == [SKEW - 60]


@pytest.mark.parametrize("open_store", ["sqlite"], indirect=True)
def test_an_outcome_written_alone_by_a_clock_days_behind_replays_on_sqlite(
    open_store: Opener, caplog: pytest.LogCaptureFixture
) -> None:
    """An UNSAFE call a process days behind ran alone replays on a correct clock (SQLite)."""
    clock = FakeClock()
    right = _ledger(open_store, clock)
    behind = _ledger(open_store, clock.shifted(-SKEW))
    effects: list[int] = []

    def make(ledger: twiceshy.Ledger) -> Callable[[int], str]:
        @ledger.tool(effect=twiceshy.UNSAFE, name="wire")
        def wire(amount: int) -> str:
            effects.append(amount)
            return f"wired {amount}"

        return wire

    wire, wire_behind = make(right), make(behind)
    with twiceshy.run(SCOPE):
        assert wire(100) == "wired 100"  # the ledger is in use on the right time
    clock.advance(60)
    with caplog.at_level(logging.WARNING, logger="twiceshy"), twiceshy.run(SCOPE):
        assert wire_behind(4900) == "wired 4900"
    clock.advance(60)
    with twiceshy.run(SCOPE):
        assert wire(4900) == "wired 4900"  # replayed, not run again
    assert effects == [100, 4900]
    assert _skews(caplog, "written") == [SKEW - 60]


def test_a_call_claimed_by_a_clock_days_ahead_is_waited_for_never_taken_over(
    open_store: Opener, caplog: pytest.LogCaptureFixture
) -> None:
    """A call a process days ahead runs is InProgress on a correct clock, never taken over."""
    clock = FakeClock()
    ahead = _ledger(open_store, clock.shifted(SKEW))
    right = _ledger(open_store, clock)
    effects: list[int] = []
    started, release = threading.Event(), threading.Event()

    @ahead.tool(effect=twiceshy.UNSAFE, name="wire")
    def wire_ahead(amount: int) -> str:
        effects.append(amount)
        started.set()
        release.wait(30)
        return "wired"

    @right.tool(effect=twiceshy.UNSAFE, name="wire", wait=0.05)
    def wire(amount: int) -> str:
        effects.append(amount)
        return "wired a second time"

    answers: list[str] = []

    def run_ahead() -> None:
        with twiceshy.run(SCOPE):
            answers.append(wire_ahead(4900))

    thread = threading.Thread(target=run_ahead)
    thread.start()
    try:
        assert started.wait(30)
        with caplog.at_level(logging.WARNING, logger="twiceshy"), twiceshy.run(SCOPE):
            with pytest.raises(twiceshy.InProgress):
                wire(4900)
            clock.advance(DAY)  # a day on, the lease of the running call still holds
            with pytest.raises(twiceshy.InProgress):
                wire(4900)
    finally:
        release.set()
        thread.join(30)
    assert answers == ["wired"]
    with twiceshy.run(SCOPE):
        assert wire(4900) == "wired"
    assert effects == [4900]
    (logged,) = _skews(caplog, "read")  # one warning: the second is within the minute
    assert SKEW - DAY <= logged <= SKEW


def test_replays_on_a_clock_behind_warn_once_not_at_every_call(
    open_store: Opener, caplog: pytest.LogCaptureFixture
) -> None:
    """Many replays on a clock days behind log one warning about the skew, not one each."""
    clock = FakeClock()
    right = _ledger(open_store, clock)
    behind = _ledger(open_store, clock.shifted(-SKEW))
    effects: list[int] = []

    def make(ledger: twiceshy.Ledger) -> Callable[[int], str]:
        @ledger.tool(effect=twiceshy.UNSAFE, name="wire")
        def wire(amount: int) -> str:
            effects.append(amount)
            return f"wired {amount}"

        return wire

    wire, wire_behind = make(right), make(behind)
    with twiceshy.run(SCOPE):
        assert wire(4900) == "wired 4900"
    with caplog.at_level(logging.WARNING, logger="twiceshy"), twiceshy.run(SCOPE):
        for _ in range(20):
            assert wire_behind(4900) == "wired 4900"
    assert effects == [4900]
    assert _skews(caplog, "read") == [SKEW]


def test_a_call_claimed_by_a_clock_days_behind_runs_once_and_replays_after(
    open_store: Opener, caplog: pytest.LogCaptureFixture
) -> None:
    """An UNSAFE call a process days behind runs is never rerun on a correct clock; it replays."""
    clock = FakeClock()
    behind = _ledger(open_store, clock.shifted(-SKEW))
    right = _ledger(open_store, clock)
    effects: list[int] = []
    started, release = threading.Event(), threading.Event()

    @behind.tool(effect=twiceshy.UNSAFE, name="wire")
    def wire_behind(amount: int) -> str:
        effects.append(amount)
        started.set()
        release.wait(30)
        return "wired"

    @right.tool(effect=twiceshy.UNSAFE, name="wire", wait=0.05)
    def wire(amount: int) -> str:
        effects.append(amount)
        return "wired a second time"

    answers: list[str] = []

    def run_behind() -> None:
        with twiceshy.run(SCOPE):
            answers.append(wire_behind(4900))

    thread = threading.Thread(target=run_behind)
    thread.start()
    try:
        assert started.wait(30)
        with twiceshy.run(SCOPE), pytest.raises((twiceshy.InProgress, twiceshy.OutcomeUnknown)):
            wire(4900)
    finally:
        with caplog.at_level(logging.WARNING, logger="twiceshy"):
            release.set()
            thread.join(30)
    assert answers == ["wired"]
    clock.advance(60)
    with twiceshy.run(SCOPE):
        assert wire(4900) == "wired"
    assert effects == [4900]
    assert _skews(caplog, "read") + _skews(caplog, "written") == [SKEW]
