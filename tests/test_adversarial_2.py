"""More sequences of events under which a guarantee of DESIGN.md could break: async stores,
many loops and threads, the heartbeat under a slow store, give-backs.

Found by a second adversarial review; those that broke a guarantee were fixed with the test
here, and the probes that found nothing are kept as regression tests.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import twiceshy
from twiceshy import Change, Snapshot, State
from twiceshy.errors import StoreError
from twiceshy.stores import ThreadedAsyncStore
from twiceshy.stores.memory import MemoryStore

PG = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"


def _is_renewal(change: Change) -> bool:
    return (
        change.to is State.CLAIMED
        and change.new_owner is None
        and not change.count_attempt
        and change.lease is not None
    )


# -- the heartbeat under a slow store --------------------------------------------------------


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


# -- give-backs -----------------------------------------------------------------------------


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


# -- async stores, loops and threads (probes) -----------------------------------------------


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    tag = f"adv2_{uuid.uuid4().hex[:10]}"
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
    elif request.param == "postgres":
        yield f"{PG}?schema={tag}"
        import psycopg

        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{tag}" CASCADE')
    else:
        yield f"{REDIS}?prefix={tag}"
        import redis

        client = redis.Redis.from_url(REDIS)
        names = list(client.scan_iter(match=f"{tag}:*"))
        if names:
            client.delete(*names)
        client.close()


def test_one_ledger_serves_repeated_asyncio_runs_and_threads_with_their_own_loops(
    url: str,
) -> None:
    """Many loops (asyncio.run again and again, in threads) on one ledger: one execution."""
    ledger = twiceshy.Ledger(url, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, name="pay", lease=5.0, wait=5.0)
    async def pay(n: int) -> int:
        runs.append(n)
        await asyncio.sleep(0.2)
        return n

    async def once(run_id: str) -> int:
        with twiceshy.run(run_id):
            return await pay(1)

    answers: list[Any] = []

    def in_a_thread() -> None:
        try:
            answers.append(asyncio.run(once("fresh")))
        except Exception as exc:  # reported below
            answers.append(exc)

    threads = [threading.Thread(target=in_a_thread) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert answers == [1] * 6
    assert [asyncio.run(once("fresh")) for _ in range(3)] == [1, 1, 1]
    assert runs == [1]
    asyncio.run(ledger.aclose())


def test_a_ledger_used_after_aclose_refuses_and_runs_nothing(url: str) -> None:
    """After aclose() a call fails with StoreError within bounded time and nothing runs."""
    ledger = twiceshy.Ledger(url, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, name="pay")
    async def pay(n: int) -> int:
        runs.append(n)
        return n

    async def main() -> None:
        with twiceshy.run("r"):
            assert await pay(1) == 1
        await ledger.aclose()
        with twiceshy.run("r"):
            if url != "memory://":
                with pytest.raises(StoreError):
                    await asyncio.wait_for(pay(2), 10)

    asyncio.run(main())
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
