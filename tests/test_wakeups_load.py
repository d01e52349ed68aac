"""PostgreSQL wake-ups that do not serialize commits: only a write someone waits for notifies.

A notifying transaction takes a lock on the server's notification queue at commit, so a
``pg_notify`` in every outcome write would serialize the commits of every writer. A waiter marks
the claim it waits for (``watched``) before it reads; the outcome write notifies only when the
row it locks is marked. Shown against a real server with a listening connection of the test's
own: notifications of one channel arrive in commit order, so a marker sent after a write tells,
without timing, whether the write notified.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from twiceshy import Change, Effect, State
from twiceshy.stores.postgres import PostgresStore
from twiceshy.stores.postgres._ops import payload_of

pytestmark = pytest.mark.postgres

NS = "tenant"
CLAIMED = frozenset({State.CLAIMED})
MARKER = "test-marker"


def claim(store: PostgresStore, key: str, owner: str = "alice") -> Any:
    """Claim ``key`` in the test namespace."""
    return store.claim(
        NS, key, fingerprint="fp", tool="charge", effect=Effect.KEYED, owner=owner, lease=30
    )


def succeed(store: PostgresStore, key: str, result: str = '"ok"') -> Any:
    """Record alice's outcome of ``key`` under fence 1."""
    change = Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result=result, ttl=60)
    return store.write(NS, key, change)


@pytest.fixture
def listening(pg: tuple[str, str]) -> Iterator[tuple[psycopg.Connection[Any], str]]:
    """A connection of the test's own LISTEN-ing on the ledger's channel, and that channel."""
    url, schema = pg
    store = PostgresStore(url, schema=schema)  # makes the tables, names the channel
    channel = store._st.channel
    store.close()
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
    yield conn, channel
    conn.close()


def heard_until_marker(url: str, conn: psycopg.Connection[Any], channel: str) -> list[str]:
    """Send the marker on ``channel``; every payload heard before it, in commit order."""
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, %s)", (channel, MARKER))
    heard: list[str] = []
    for notify in conn.notifies(timeout=10.0, stop_after=None):
        if notify.payload == MARKER:
            return heard
        heard.append(notify.payload)
    raise AssertionError(f"the marker never came; heard {heard}")


def watched(url: str, schema: str, key: str) -> bool:
    """The record's waiters' flag, read behind the store's back."""
    table = sql.Identifier(schema, "records")
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT watched FROM {} WHERE namespace = %s AND key = %s").format(table),
            (NS, key),
        ).fetchone()
    assert row is not None
    return bool(row[0])


def bounded_until(condition: Any, rounds: int = 500) -> None:
    """Poll ``condition`` every 10 ms, at most ``rounds`` times."""
    event = threading.Event()
    for _ in range(rounds):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("condition never held")


def test_an_outcome_nobody_waits_for_notifies_nobody(
    pg: tuple[str, str], listening: tuple[psycopg.Connection[Any], str]
) -> None:
    """Claims and outcomes with no waiter send no NOTIFY: their commits take no queue lock."""
    url, schema = pg
    conn, channel = listening
    store = PostgresStore(url, schema=schema)
    try:
        for i in range(5):
            assert claim(store, f"quiet-{i}").won
            assert succeed(store, f"quiet-{i}").won
        assert heard_until_marker(url, conn, channel) == []
        assert not watched(url, schema, "quiet-0")
    finally:
        store.close()


def test_a_waited_for_outcome_notifies_once_marked(
    pg: tuple[str, str], listening: tuple[psycopg.Connection[Any], str]
) -> None:
    """A waiter marks the claim, and the owner's outcome then notifies and wakes it, long
    before its 60 s re-read."""
    url, schema = pg
    conn, channel = listening
    waiter = PostgresStore(url, schema=schema, wait_recheck=60.0)
    owner = PostgresStore(url, schema=schema)
    got: list[Any] = []
    try:
        assert claim(owner, "loud").won
        thread = threading.Thread(target=lambda: got.append(waiter.wait(NS, "loud", 1, 30.0)))
        thread.start()
        bounded_until(lambda: watched(url, schema, "loud") and waiter._listener.ready.is_set())
        assert succeed(owner, "loud", '"done"').won
        thread.join(30)
        [snap] = got
        assert snap.record.state is State.SUCCEEDED
        assert snap.record.result == '"done"'
        assert heard_until_marker(url, conn, channel) == [payload_of(NS, "loud")]
    finally:
        waiter.close()
        owner.close()


def test_a_mark_that_meets_a_settling_write_reads_again(pg: tuple[str, str]) -> None:
    """The owner's write commits while the waiter's mark waits for the row: the mark finds the
    record settled, and the waiter reads it at once instead of sleeping to its re-read."""
    url, schema = pg
    app = "twiceshy-marker"
    waiter = PostgresStore(url, schema=schema, wait_recheck=60.0, application_name=app)
    owner = PostgresStore(url, schema=schema)
    table = sql.Identifier(schema, "records")
    got: list[Any] = []
    try:
        assert claim(owner, "raced").won
        # The waiter's listener is LISTEN-ing first, so nothing but the mark decides.
        assert waiter.wait(NS, "absent", 1, 1.0).record is None
        bounded_until(waiter._listener.ready.is_set)
        with psycopg.connect(url) as settle:  # a transaction: holds the row until commit
            settle.execute(
                sql.SQL(
                    "UPDATE {} SET state = 'succeeded', result = '\"raced\"', "
                    "expires_at = extract(epoch FROM now()) + 60 "
                    "WHERE namespace = %s AND key = %s AND NOT watched"
                ).format(table),
                (NS, "raced"),
            )
            thread = threading.Thread(target=lambda: got.append(waiter.wait(NS, "raced", 1, 20.0)))
            thread.start()
            bounded_until(lambda: waiting_on_a_lock(url, app))
            settle.commit()
        thread.join(30)
        [snap] = got
        assert snap.record.state is State.SUCCEEDED
        assert snap.record.result == '"raced"'
        assert not watched(url, schema, "raced")
    finally:
        waiter.close()
        owner.close()


def waiting_on_a_lock(url: str, app: str) -> bool:
    """Whether a backend of ``app`` waits for a lock."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND wait_event_type = 'Lock'",
            (app,),
        ).fetchone()
    return row is not None and row[0] > 0


def test_a_waiter_that_comes_after_the_outcome_reads_it(pg: tuple[str, str]) -> None:
    """A waiter arriving after the owner's (unnotified) write finds the outcome on its first
    read, and marks nothing."""
    url, schema = pg
    waiter = PostgresStore(url, schema=schema, wait_recheck=60.0)
    owner = PostgresStore(url, schema=schema)
    try:
        assert claim(owner, "late").won
        assert succeed(owner, "late", '"early"').won
        snap = waiter.wait(NS, "late", 1, 20.0)
        assert snap.record is not None
        assert snap.record.result == '"early"'
        assert not watched(url, schema, "late")
    finally:
        waiter.close()
        owner.close()


def test_polling_waiters_mark_nothing(
    pg: tuple[str, str], listening: tuple[psycopg.Connection[Any], str]
) -> None:
    """With wakeups=poll nobody listens: a waiter leaves the claim unmarked, and the owner's
    write sends no NOTIFY."""
    url, schema = pg
    conn, channel = listening
    waiter = PostgresStore(url, schema=schema, wakeups="poll")
    owner = PostgresStore(url, schema=schema)
    try:
        assert claim(owner, "polled").won
        # A short wait: it reads the claim (more than once) and times out.
        short = waiter.wait(NS, "polled", 1, 0.05).record
        assert short is not None
        assert short.state is State.CLAIMED
        assert not watched(url, schema, "polled")
        assert succeed(owner, "polled").won
        settled = waiter.wait(NS, "polled", 1, 20.0).record
        assert settled is not None
        assert settled.state is State.SUCCEEDED
        assert heard_until_marker(url, conn, channel) == []
    finally:
        waiter.close()
        owner.close()
