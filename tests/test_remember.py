"""Remembered outcomes: ``Ledger(remember=N)`` answers a process's retries of settled outcomes
without a round trip, and never where the store would answer otherwise: not for a doubt a
reconciler settles later, not for other arguments under the same key."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

import twiceshy
from twiceshy import Change, Effect, Outcome, State
from twiceshy._memo import Remembered
from twiceshy._protocol import CallPlan
from twiceshy.stores import Store
from twiceshy.stores.memory import MemoryStore
from twiceshy.stores.sqlite import SQLiteStore


class Counting:
    """A store that counts the claims it carries to the store beneath it."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.claims = 0

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.claims += 1
        return self.inner.claim(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def charging(ledger: twiceshy.Ledger, runs: list[int], **options: Any) -> Any:
    @ledger.tool(effect=twiceshy.KEYED, **options)
    def charge(amount: int, note: str = "") -> dict[str, int]:
        runs.append(amount)
        return {"amount": amount, "charge": len(runs)}

    return charge


def test_a_settled_outcome_answers_retries_without_the_store(store: Store) -> None:
    """Every store: the first call and its recording reach the store; retries do not."""
    counting = Counting(store)
    ledger = twiceshy.Ledger(store=counting, counts_interval=None, remember=8)  # type: ignore[arg-type]
    runs: list[int] = []
    charge = charging(ledger, runs)
    with twiceshy.run("run-1"):
        first = charge(4900)
        claims = counting.claims
        assert [charge(4900) for _ in range(3)] == [first] * 3
    assert runs == [4900]
    assert counting.claims == claims  # no retry asked the store


def test_without_remember_every_retry_asks_the_store(store: Store) -> None:
    counting = Counting(store)
    ledger = twiceshy.Ledger(store=counting, counts_interval=None)  # type: ignore[arg-type]
    runs: list[int] = []
    charge = charging(ledger, runs)
    with twiceshy.run("run-1"):
        charge(4900)
        claims = counting.claims
        charge(4900)
        charge(4900)
    assert runs == [4900]
    assert counting.claims == claims + 2


def test_an_outcome_another_ledger_recorded_is_read_once(tmp_path: Path) -> None:
    """An outcome found in the store (another process's) is kept from its first replay on."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    runs: list[int] = []
    with twiceshy.Ledger(url, counts_interval=None) as other, twiceshy.run("run-1"):
        recorded = charging(other, runs)(4900)
    counting = Counting(SQLiteStore(tmp_path / "ledger.db"))
    ledger = twiceshy.Ledger(store=counting, counts_interval=None, remember=8)  # type: ignore[arg-type]
    charge = charging(ledger, runs)
    with twiceshy.run("run-1"):
        assert charge(4900) == recorded
        assert charge(4900) == recorded
    assert runs == [4900]
    assert counting.claims == 1
    ledger.close()


def test_a_kept_outcome_is_dropped_when_the_store_lets_it_expire(tmp_path: Path) -> None:
    """Real clocks: once the retention has passed, the retry runs, as it would without memory."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = twiceshy.Ledger(url, counts_interval=None, remember=8)
    runs: list[int] = []
    charge = charging(ledger, runs, ttl=0.3)
    with twiceshy.run("run-1"):
        charge(4900)
        charge(4900)
        assert runs == [4900]
        time.sleep(0.45)
        assert charge(4900) == {"amount": 4900, "charge": 2}
    assert runs == [4900, 4900]
    ledger.close()


def plan(key: str) -> CallPlan:
    policy: Any = None  # recall and keep read only the namespace and the key
    return CallPlan(policy, "", key, "fingerprint", "owner")


def settled(now: float, expires_at: float | None) -> twiceshy.Snapshot:
    record = twiceshy.Record(
        namespace="",
        key="k",
        fingerprint="fingerprint",
        tool="charge",
        effect=Effect.KEYED,
        state=State.SUCCEEDED,
        fence=1,
        owner="owner",
        lease_deadline=None,
        attempts=1,
        result="1",
        error=None,
        reason=None,
        created_at=now - 1,
        updated_at=now,
        expires_at=expires_at,
    )
    return twiceshy.Snapshot(record, now)


def test_the_deadline_counts_from_when_the_command_was_sent() -> None:
    """10 s of retention left when the store answered, the command sent 10 s ago: gone."""
    memo = Remembered(8)
    store_now = 1_800_000_000.0
    memo.keep(plan("late"), settled(store_now, store_now + 10), sent=time.monotonic() - 10)
    memo.keep(plan("on time"), settled(store_now, store_now + 10), sent=time.monotonic() - 5)
    assert memo.recall(plan("late")) is None
    kept = memo.recall(plan("on time"))
    assert kept is not None
    assert kept.record is not None
    assert not kept.won
    assert kept.record.state is State.SUCCEEDED
    # The store's clock as the answer's: its reading plus what passed since the command left.
    assert store_now + 5 <= kept.now < store_now + 6


def test_an_outcome_kept_forever_in_the_store_is_kept_until_evicted() -> None:
    memo = Remembered(2)
    for key in ("a", "b"):
        memo.keep(plan(key), settled(1.0, None), sent=time.monotonic() - 10**6)
    assert memo.recall(plan("a")) is not None  # "a" is now the most recently used
    memo.keep(plan("c"), settled(1.0, None), sent=time.monotonic())
    assert memo.recall(plan("b")) is None
    assert memo.recall(plan("a")) is not None
    assert memo.recall(plan("c")) is not None
    assert len(memo) == 2


def test_the_least_recently_used_outcome_goes_first(tmp_path: Path) -> None:
    counting = Counting(SQLiteStore(tmp_path / "ledger.db"))
    ledger = twiceshy.Ledger(store=counting, counts_interval=None, remember=2)  # type: ignore[arg-type]
    runs: list[int] = []
    charge = charging(ledger, runs)
    with twiceshy.run("run-1"):
        charge(1)
        charge(2)
        charge(1)  # remembered: 1 is now used more recently than 2
        charge(3)  # evicts 2
        claims = counting.claims
        charge(1)
        charge(3)
        assert counting.claims == claims
        charge(2)
        assert counting.claims == claims + 1
    assert runs == [1, 2, 3]
    ledger.close()


def test_a_kept_key_with_other_arguments_is_refused(tmp_path: Path) -> None:
    counting = Counting(SQLiteStore(tmp_path / "ledger.db"))
    ledger = twiceshy.Ledger(store=counting, counts_interval=None, remember=8)  # type: ignore[arg-type]
    runs: list[int] = []
    charge = charging(ledger, runs, key_args=("amount",))
    with twiceshy.run("run-1"):
        charge(4900, note="first")
        claims = counting.claims
        with pytest.raises(twiceshy.KeyReuseMismatch):
            charge(4900, note="other")
    assert runs == [4900]
    assert counting.claims == claims  # refused from the kept record, as the store's would be
    ledger.close()


def test_a_failure_is_replayed_from_memory(tmp_path: Path) -> None:
    counting = Counting(SQLiteStore(tmp_path / "ledger.db"))
    ledger = twiceshy.Ledger(store=counting, counts_interval=None, remember=8)  # type: ignore[arg-type]
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, definite=(LookupError,))
    def refund(charge_id: str) -> None:
        runs.append(1)
        raise LookupError(f"no charge {charge_id}")

    with twiceshy.run("run-1"):
        with pytest.raises(LookupError, match="no charge ch_9"):
            refund("ch_9")
        claims = counting.claims
        with pytest.raises(LookupError, match="no charge ch_9"):
            refund("ch_9")
    assert runs == [1]
    assert counting.claims == claims
    ledger.close()


def test_an_unknown_outcome_is_never_kept(tmp_path: Path) -> None:
    """UNKNOWN changes (a reconciler resolves it): every retry asks the store, and sees that."""
    store = SQLiteStore(tmp_path / "ledger.db")
    ledger = twiceshy.Ledger(store=store, counts_interval=None, remember=8)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_mail(to: str) -> str:
        runs.append(1)
        raise TimeoutError("the mail server did not answer")

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            send_mail("ada@example.com")
        with pytest.raises(twiceshy.OutcomeUnknown):
            send_mail("ada@example.com")
        (record,) = store.records("")
        assert record.state is State.UNKNOWN
        store.write(
            "",
            record.key,
            Change(
                fence=record.fence,
                from_states=frozenset({State.UNKNOWN}),
                to=State.SUCCEEDED,
                result=json.dumps("sent"),
            ),
        )
        assert send_mail("ada@example.com") == "sent"
    assert runs == [1]
    ledger.close()


def test_replays_from_memory_are_counted_and_observed_as_replays(tmp_path: Path) -> None:
    events: list[Outcome] = []
    ledger = twiceshy.Ledger(
        f"sqlite:///{tmp_path / 'ledger.db'}",
        remember=8,
        observers=[lambda event: events.append(event.outcome)],
    )
    charge = charging(ledger, [])
    with twiceshy.run("run-1"):
        charge(4900)
        charge(4900)
        charge(4900)
    assert events == [Outcome.EXECUTED, Outcome.REPLAYED, Outcome.REPLAYED]
    assert ledger.counts() == {
        ("charge", "executed"): 1,
        ("charge", "ran"): 1,
        ("charge", "replayed"): 2,
    }
    ledger.close()


def test_async_tools_answer_from_memory_too(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = twiceshy.Ledger(url, counts_interval=None, remember=8)
    counting = Counting(ledger.store)
    ledger.async_store = twiceshy.stores.ThreadedAsyncStore(counting)  # type: ignore[arg-type]
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    async def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        return {"amount": amount}

    async def main() -> list[dict[str, int]]:
        with twiceshy.run("run-1"):
            return [await charge(4900) for _ in range(3)]

    assert asyncio.run(main()) == [{"amount": 4900}] * 3
    assert runs == [4900]
    assert counting.claims == 1
    ledger.close()


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), ("8", TypeError), (True, TypeError)]
)
def test_a_bad_remember_is_refused_before_the_store_opens(
    tmp_path: Path, value: Any, error: type[Exception]
) -> None:
    path = tmp_path / "ledger.db"
    with pytest.raises(error, match="remember="):
        twiceshy.Ledger(f"sqlite:///{path}", remember=value)
    assert not path.exists()


# -- what is never remembered, and what a remembered outcome refuses --------------------------


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


def test_remember_replays_a_mismatched_explicit_key_as_a_refusal() -> None:
    """A remembered outcome under an explicit key refuses other arguments, per namespace."""
    store = MemoryStore()
    a = twiceshy.Ledger(store=store, namespace="a", remember=8, counts_interval=None)
    b = twiceshy.Ledger(store=store, namespace="b", remember=8, counts_interval=None)
    runs: list[tuple[str, int]] = []

    @a.tool(effect=twiceshy.UNSAFE, name="send", key_args=["to"])
    def send_a(to: str, n: int) -> int:
        runs.append(("a", n))
        return n

    @b.tool(effect=twiceshy.UNSAFE, name="send", key_args=["to"])
    def send_b(to: str, n: int) -> int:
        runs.append(("b", n))
        return n

    with twiceshy.run("r"):
        assert send_a("x", 1) == 1
        assert send_a("x", 1) == 1  # from memory
        with pytest.raises(twiceshy.KeyReuseMismatch):
            send_a("x", 2)
        assert send_b("x", 3) == 3  # another tenant: its own record
    assert runs == [("a", 1), ("b", 3)]
