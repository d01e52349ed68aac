"""The PostgreSQL store through PgBouncer in transaction mode, against real servers on loopback.

PgBouncer is ``.ci/servers/pgbouncer.sh``'s (``TWICESHY_TEST_PGBOUNCER``): transaction pooling
with 8 server connections in front of the test PostgreSQL server. What the contract suite and the
ledger tests show on every store runs through it too (the ``pgbouncer`` store of
``conftest.py``); these tests show what a pooler changes: LISTEN refused unless the URL says how
waiters wake, waiters woken by re-reads, more callers than the pooler has connections, and the
guarantees with real processes. Every test works in a schema of its own, dropped afterwards
(through the server itself); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import servers
import twiceshy
from twiceshy import Change, Effect, State
from twiceshy.errors import StoreError
from twiceshy.stores.postgres import AsyncPostgresStore, PostgresStore, open_postgres

pytestmark = pytest.mark.postgres

CTX = mp.get_context("spawn")
NS = "tenant"
CLAIMED = frozenset({State.CLAIMED})
POOL_SIZE = 8  # the server connections .ci/servers/pgbouncer.sh gives database "test"


@pytest.fixture
def bouncer() -> Iterator[tuple[str, str]]:
    """PgBouncer's URL and a fresh schema name; the schema is dropped afterwards."""
    url = servers.require("pgbouncer")
    schema = f"twiceshy_test_{secrets.token_hex(6)}"
    yield url, schema
    servers.drop_schema(servers.POSTGRES_URL, schema)


def ledger_url(url: str, schema: str, **params: str) -> str:
    """The ledger URL of a schema, with extra twiceshy parameters."""
    extra = "".join(f"&{name}={value}" for name, value in params.items())
    return f"{url}?schema={schema}{extra}"


def effects(path: Path) -> list[dict[str, Any]]:
    """The effects seen so far, one JSON object a line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def record_effect(path: Path, **fields: Any) -> None:
    """Append one effect; O_APPEND writes of one line are atomic between processes."""
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def schema_exists(schema: str) -> bool:
    """Whether the schema is there, asked of the server itself."""
    with psycopg.connect(servers.POSTGRES_URL, autocommit=True) as conn:
        row = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", (schema,)).fetchone()
    return bool(row and row[0])


def admin(url: str, command: str) -> list[dict[str, Any]]:
    """A command of PgBouncer's admin console (database ``pgbouncer``), as rows by column."""
    console = url.rsplit("/", 1)[0] + "/pgbouncer"
    with psycopg.connect(console, autocommit=True, prepare_threshold=None) as conn:
        cur = conn.execute(command)
        names = [column.name for column in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def claim(store: PostgresStore, key: str, owner: str = "alice") -> Any:
    """Claim ``key`` in the test namespace."""
    return store.claim(
        NS, key, fingerprint="fp", tool="charge", effect=Effect.KEYED, owner=owner, lease=30
    )


# -- LISTEN through the pooler ----------------------------------------------------------------


def test_listen_through_the_pooler_is_refused_without_the_option(
    bouncer: tuple[str, str],
) -> None:
    """Without wakeups=, a store behind PgBouncer refuses to open (sync, async, through a
    Ledger), saying to add wakeups=poll, before it creates anything; the same server reached
    directly opens and LISTENs; a bad wakeups= value is a ValueError."""
    url, schema = bouncer

    def refused(error: BaseException) -> None:
        assert isinstance(error, StoreError)
        assert "connection pooler" in str(error)
        assert "wakeups=poll" in str(error)

    with pytest.raises(StoreError) as sync_error:
        PostgresStore(url, schema=schema)
    refused(sync_error.value)
    with pytest.raises(StoreError) as ledger_error:
        twiceshy.Ledger(ledger_url(url, schema))
    refused(ledger_error.value)
    twin = AsyncPostgresStore(url, schema=schema)
    with pytest.raises(StoreError) as async_error:
        asyncio.run(twin.get(NS, "k"))
    refused(async_error.value)
    assert not schema_exists(schema)
    with pytest.raises(ValueError, match="wakeups"):
        twiceshy.Ledger(ledger_url(url, schema, wakeups="sometimes"))

    direct = PostgresStore(servers.POSTGRES_URL, schema=schema)  # no pooler: LISTEN as ever
    try:
        assert claim(direct, "k").won
        assert direct.wait(NS, "k", 1, 0.2).record is not None
        assert direct._listener.ready.wait(5)
    finally:
        direct.close()


def test_the_pooler_carries_no_session_state_and_no_prepared_statements(
    bouncer: tuple[str, str],
) -> None:
    """With wakeups=poll, 12 stores (more than the 8 server connections) repeat each statement
    60 times at once (psycopg would prepare a statement after five; the next transaction may
    meet a server connection without it): every call answers, no SET or LISTEN reaches the
    server, and each store holds its pool's one connection and no listener."""
    url, schema = bouncer
    app = f"twiceshy-pooled-{secrets.token_hex(4)}"
    stores = [
        PostgresStore(url, schema=schema, wakeups="poll", application_name=app, pool_size=1)
        for _ in range(12)
    ]
    failures: list[BaseException] = []

    def repeat(index: int, store: PostgresStore) -> None:
        try:
            for n in range(60):
                key = f"k{index}-{n}"
                assert claim(store, key).won
                assert store.write(NS, key, Change(1, CLAIMED, State.SUCCEEDED, owner="alice")).won
                assert store.get(NS, key).record is not None
        except BaseException as exc:
            failures.append(exc)

    try:
        threads = [threading.Thread(target=repeat, args=pair) for pair in enumerate(stores)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert failures == []
        assert claim(stores[0], "held").won
        assert stores[0].wait(NS, "held", 1, 0.5).record is not None  # a listener would be up
        with psycopg.connect(servers.POSTGRES_URL, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT query FROM pg_stat_activity WHERE application_name = %s", (app,)
            ).fetchall()
        assert not [q for (q,) in rows if q.upper().startswith(("SET", "LISTEN"))]
        clients = [c for c in admin(url, "SHOW CLIENTS") if c["application_name"] == app]
        assert len(clients) == len(stores)  # the pools' connections: no listener beside them
    finally:
        for store in stores:
            store.close()


# -- waiters ----------------------------------------------------------------------------------


def test_waiters_wake_by_re_reading_within_a_bounded_time(bouncer: tuple[str, str]) -> None:
    """wakeups=poll: a waiter of another store (as of another process) learns of the write by
    re-reading within half a second, blocking and async, though wait_recheck is 30 s."""
    url, schema = bouncer
    waiter, writer = open_postgres(ledger_url(url, schema, wakeups="poll", wait_recheck="30"))
    other = PostgresStore(url, schema=schema, wakeups="poll")
    try:
        for trial, use_async in enumerate((False, True)):
            key = f"wake-{trial}"
            assert claim(other, key).won
            got: list[Any] = []

            def wait(key: str = key, use_async: bool = use_async, got: list[Any] = got) -> None:
                if use_async:
                    got.append(asyncio.run(writer.wait(NS, key, 1, 10.0)))
                else:
                    got.append(waiter.wait(NS, key, 1, 10.0))
                got.append(time.monotonic())

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(0.6)  # the waiter polls at its longest interval (250 ms) by now
            assert other.write(NS, key, Change(1, CLAIMED, State.SUCCEEDED, owner="alice")).won
            written = time.monotonic()
            thread.join(12)
            snap, woke = got
            assert snap.record is not None
            assert snap.record.state is State.SUCCEEDED
            assert woke - written < 0.5
    finally:
        other.close()
        waiter.close()


# -- more callers than the pooler has connections ---------------------------------------------


def test_more_callers_than_pooler_connections_run_each_intent_once(
    bouncer: tuple[str, str],
) -> None:
    """32 ledgers (each its own pool, as 32 processes would have) call at once through 8 server
    connections: the pooler queues them, every call answers once, no intent runs twice, and
    the server never sees more than 8 connections from the pooler."""
    url, schema = bouncer
    callers, rounds = 32, 3
    target = ledger_url(url, schema, wakeups="poll", pool_size="2")
    twiceshy.Ledger(target).close()  # the table exists before the race
    runs: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()
    answers: list[Any] = []
    barrier = threading.Barrier(callers)
    most: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            servers_now = [s for s in admin(url, "SHOW SERVERS") if s["database"] == "test"]
            clients_now = [c for c in admin(url, "SHOW CLIENTS") if c["database"] == "test"]
            most.append(len(servers_now))
            most.append(-len(clients_now))
            time.sleep(0.02)

    def caller(index: int) -> None:
        ledger = twiceshy.Ledger(target, counts_interval=None)

        @ledger.tool(effect=twiceshy.UNSAFE, name="charge", wait=30)
        def charge(trial: int, intent: int) -> int:
            with lock:
                runs[(trial, intent)] += 1
            time.sleep(0.01)
            return intent

        try:
            barrier.wait(60)
            for trial in range(rounds):
                with twiceshy.run(f"crowd-{trial}"):
                    # Every caller asks for each of 8 intents, in an order of its own.
                    for intent in sorted(range(8), key=lambda i: (i * 7 + index) % 8):
                        answers.append(charge(trial, intent) == intent)
        finally:
            ledger.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    done.set()
    watcher.join(10)
    assert answers == [True] * (callers * rounds * 8)
    assert runs == Counter({(t, i): 1 for t in range(rounds) for i in range(8)})
    assert 0 < max(most) <= POOL_SIZE  # server connections
    assert -min(most) >= callers  # client connections at one time


# -- processes ----------------------------------------------------------------------------------


def _racer(url: str, log: Path, barrier: Any, out: Any, trials: int) -> None:
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge", wait=30)
    def charge(trial: int) -> dict[str, Any]:
        record_effect(log, trial=trial, pid=os.getpid())
        time.sleep(0.05)
        return {"trial": trial, "by": os.getpid()}

    try:
        for trial in range(trials):
            barrier.wait(120 if trial == 0 else 30)  # the first waits for every start-up
            with twiceshy.run(f"race-{trial}"):
                out.put((trial, charge(trial)))
    finally:
        ledger.close()


@pytest.mark.slow
def test_processes_racing_one_intent_through_the_pooler_run_it_once(
    bouncer: tuple[str, str], tmp_path: Path
) -> None:
    """G1/G8: 8 processes released together through PgBouncer, 4 trials: one execution each,
    one shared result (the losers learn it by re-reading)."""
    url, schema = bouncer
    processes, trials = 8, 4
    target = ledger_url(url, schema, wakeups="poll", pool_size="2")
    twiceshy.Ledger(target).close()
    log = tmp_path / "effects.jsonl"
    barrier, out = CTX.Barrier(processes), CTX.Queue()
    procs = [
        CTX.Process(target=_racer, args=(target, log, barrier, out, trials))
        for _ in range(processes)
    ]
    try:
        for proc in procs:
            proc.start()
        results = [out.get(timeout=120) for _ in range(processes * trials)]
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    assert [proc.exitcode for proc in procs] == [0] * processes
    seen = effects(log)
    assert sorted(e["trial"] for e in seen) == list(range(trials))
    for trial in range(trials):
        winner = next(e["pid"] for e in seen if e["trial"] == trial)
        assert [r for t, r in results if t == trial] == [{"trial": trial, "by": winner}] * processes


def _crasher(url: str, log: Path, when: str) -> None:
    """Call an UNSAFE tool and die by SIGKILL at the named moment."""
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge", lease=0.5)
    def charge(amount: int) -> str:
        if when == "after-claim":
            os.kill(os.getpid(), signal.SIGKILL)
        record_effect(log, when=when, who="crasher")
        if when == "after-effect":
            os.kill(os.getpid(), signal.SIGKILL)
        return "ch_crasher"

    with twiceshy.run(when):
        charge(100)
    if when == "after-record":
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_killed_after_claim_after_effect_and_after_recording(
    bouncer: tuple[str, str], tmp_path: Path
) -> None:
    """G2/G3/G6 through the pooler: processes SIGKILLed right after the claim, after the
    effect, after recording: the first two are never run again, the third replays."""
    url, schema = bouncer
    target, log = ledger_url(url, schema, wakeups="poll"), tmp_path / "effects.jsonl"
    twiceshy.Ledger(target).close()
    moments = ("after-claim", "after-effect", "after-record")
    procs = [CTX.Process(target=_crasher, args=(target, log, when)) for when in moments]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [-signal.SIGKILL] * 3
    ledger = twiceshy.Ledger(target, counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge", lease=0.5, wait=2)
    def charge(amount: int) -> str:
        record_effect(log, when=twiceshy.current_scope(), who="retry")
        return "ch_retry"

    try:
        time.sleep(0.6)  # past the crashed owners' leases, on the server's clock
        for _ in range(2):
            for when in ("after-claim", "after-effect"):
                with twiceshy.run(when), pytest.raises(twiceshy.OutcomeUnknown):
                    charge(100)
            with twiceshy.run("after-record"):
                assert charge(100) == "ch_crasher"
    finally:
        ledger.close()
    assert sorted((e["when"], e["who"]) for e in effects(log)) == [
        ("after-effect", "crasher"),
        ("after-record", "crasher"),
    ]
