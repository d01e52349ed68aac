"""Key windows: past the time a provider remembers a key, a KEYED intent is not retried blind."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import twiceshy
from fake_clock import FakeClock
from twiceshy import DidNotHappen, Happened, State
from twiceshy.stores import Store
from twiceshy.stores.memory import MemoryStore

DAY = 86_400.0


def no_backoff(attempt: int) -> float:
    """Retry at once."""
    return 0.0


def _left_unknown(store: Store, **options: object) -> tuple[twiceshy.Ledger, list[str], object]:
    """A ledger whose KEYED ``charge`` ran out of attempts once (its record UNKNOWN); the keys
    each run got, and the tool."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    keys: list[str] = []
    fail = [True]

    @ledger.tool(effect=twiceshy.KEYED, attempts=1, **options)  # type: ignore[arg-type]
    def charge(amount: int, idempotency_key: str = "") -> str:
        keys.append(idempotency_key)
        if fail[0]:
            fail[0] = False
            raise TimeoutError("the provider did not answer")
        return f"ch_{amount}"

    with twiceshy.run("run-1"), pytest.raises(TimeoutError):
        charge(4900)
    return ledger, keys, charge


def test_within_the_window_an_unknown_intent_runs_again_with_its_key(
    store: Store, clock: FakeClock
) -> None:
    """Inside its window the provider still deduplicates: the next call runs with the same key."""
    _, keys, charge = _left_unknown(store, key_window=timedelta(hours=24))
    clock.advance(DAY - 60)
    with twiceshy.run("run-1"):
        assert charge(4900) == "ch_4900"  # type: ignore[operator]
    assert len(keys) == 2
    assert keys[0] == keys[1]


def test_past_the_window_an_unknown_intent_answers_outcome_unknown(
    store: Store, clock: FakeClock
) -> None:
    """Past its window the key would not deduplicate: the tool does not run, and the model
    reads why."""
    _, keys, charge = _left_unknown(store, key_window=timedelta(hours=24))
    clock.advance(DAY + 1)
    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown) as raised:
        charge(4900)  # type: ignore[operator]
    assert len(keys) == 1
    assert "window has passed" in str(raised.value)
    record = store.get("", raised.value.key).record
    assert record is not None
    assert record.state is State.UNKNOWN


def test_without_a_window_the_key_is_used_however_late(store: Store, clock: FakeClock) -> None:
    """No window by default: a year later the intent still runs again with its key."""
    _, keys, charge = _left_unknown(store)
    clock.advance(365 * DAY)
    with twiceshy.run("run-1"):
        assert charge(4900) == "ch_4900"  # type: ignore[operator]
    assert keys[0] == keys[1]


def test_past_the_window_the_reconciler_is_asked_first(store: Store, clock: FakeClock) -> None:
    """An intent past its window is reconciled as an UNSAFE one would be."""
    asked: list[str] = []

    def reconcile(key: str, args: object) -> Happened | DidNotHappen | None:
        asked.append(key)
        return Happened("ch_found")

    _, keys, charge = _left_unknown(store, key_window=3600, reconcile=reconcile)
    clock.advance(7200)
    with twiceshy.run("run-1"):
        assert charge(4900) == "ch_found"  # type: ignore[operator]
    assert len(asked) == 1
    assert len(keys) == 1


def test_a_lapsed_lease_past_the_window_is_marked_unknown_not_taken_over(
    store: Store, clock: FakeClock
) -> None:
    """An owner that stopped past the window: its intent is not taken over with the key."""
    first = twiceshy.Ledger(store=store, counts_interval=None)
    second = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[str] = []

    @second.tool(effect=twiceshy.KEYED, lease=1, key_window=60, name="charge")
    def charge_elsewhere(amount: int) -> str:
        runs.append("second")
        return "ch_second"

    @first.tool(effect=twiceshy.KEYED, lease=1, key_window=60, name="charge")
    def charge(amount: int) -> str:
        runs.append("first")
        clock.advance(120)  # stopped past its lease and past the provider's window
        with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown):
            charge_elsewhere(amount)
        raise KeyboardInterrupt  # the owner never records its outcome

    with twiceshy.run("run-1"), pytest.raises(KeyboardInterrupt):
        charge(4900)
    assert runs == ["first"]


def test_in_place_retries_stop_at_the_window() -> None:
    """An owner retrying an ambiguous error in place stops once the window has passed."""
    ledger = twiceshy.Ledger(store=MemoryStore(), counts_interval=None)
    runs: list[float] = []

    @ledger.tool(effect=twiceshy.KEYED, attempts=5, backoff=no_backoff, key_window=0.05)
    def charge(amount: int) -> str:
        runs.append(time.monotonic())
        time.sleep(0.06)  # each attempt outlasts the window
        raise TimeoutError("the provider did not answer")

    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown) as raised:
        charge(4900)
    assert len(runs) == 1
    assert isinstance(raised.value.__cause__, TimeoutError)


def test_within_the_window_in_place_retries_go_on() -> None:
    """Well inside the window, an ambiguous error is retried in place with the same key."""
    ledger = twiceshy.Ledger(store=MemoryStore(), counts_interval=None)
    keys: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, attempts=3, backoff=no_backoff, key_window=3600)
    def charge(amount: int, idempotency_key: str = "") -> str:
        keys.append(idempotency_key)
        if len(keys) < 3:
            raise TimeoutError("the provider did not answer")
        return "ch_1"

    with twiceshy.run("run-1"):
        assert charge(4900) == "ch_1"
    assert len(keys) == 3
    assert len(set(keys)) == 1


@pytest.mark.parametrize("effect", [twiceshy.SAFE, twiceshy.UNSAFE])
def test_a_window_is_only_for_keyed_tools(effect: twiceshy.Effect) -> None:
    """A key window means nothing without a key the provider deduplicates: refused."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    with pytest.raises(ValueError, match="KEYED"):
        ledger.guard("send", effect=effect, key_window=60)


@pytest.mark.parametrize("window", [0, -1, timedelta(0)])
def test_a_window_must_be_positive(window: float | timedelta) -> None:
    """An empty or negative window is refused when the tool is declared."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    with pytest.raises(ValueError, match=r"positive|negative"):

        @ledger.tool(effect=twiceshy.KEYED, key_window=window)
        def charge(amount: int) -> str:
            return "ch"
