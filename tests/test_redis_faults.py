"""The Redis store under faults of its surroundings, against a real Redis server.

An ACL user without pub/sub rights, a lost reply whose retry comes after a short retention, a
fork while another thread holds the store's locks, and settings that could never work. Every
test works under a key prefix (and, where it needs one, an ACL user) of its own and removes
them afterwards; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import servers
import twiceshy
from twiceshy._records import Change, Effect, Snapshot, State
from twiceshy.stores.redis import WRITE_SCRIPT, AsyncRedisStore, RedisStore
from twiceshy.stores.redis._replies import snapshot as _snapshot

pytestmark = pytest.mark.redis

NS = "tenant"
CLAIMED = frozenset({State.CLAIMED})
FORK = (
    multiprocessing.get_context("fork")
    if "fork" in multiprocessing.get_all_start_methods()
    else None
)


@pytest.fixture
def url() -> str:
    """The test server's URL (skips, or fails in CI, without a server)."""
    return servers.require("redis")


@pytest.fixture
def admin(url: str) -> Iterator[redis.Redis]:
    """A plain client for looking at (and setting up) the server behind the store's back."""
    client = redis.Redis.from_url(url, protocol=2, socket_timeout=10, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def prefix(url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    name = f"twiceshy-test:{secrets.token_hex(6)}"
    yield name
    servers.delete_prefix(url, name)


@pytest.fixture
def acl_url(url: str, admin: redis.Redis, prefix: str) -> Iterator[str]:
    """The URL of an ACL user of this test's own: its prefix's keys, every safe command, INFO
    (for the store's check of the eviction policy), and no pub/sub channel (Redis 7's default
    for a new user); deleted afterwards."""
    user = f"twiceshy-test-{secrets.token_hex(6)}"
    admin.execute_command(
        "ACL", "SETUSER", user, "reset", "on", "nopass", f"~{prefix}*", "resetchannels",
        "+@all", "-@dangerous", "+info",
    )  # fmt: skip
    try:
        host_port = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
        yield f"redis://{user}:unused@{host_port}/0"
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def claim(store: RedisStore, key: str = "k", owner: str = "alice") -> Snapshot:
    """Claim a key with fixed test values."""
    return store.claim(
        NS, key, fingerprint="fp", tool="charge", effect=Effect.UNSAFE, owner=owner, lease=30
    )


def subscribe_refusals(admin: redis.Redis, username: str) -> int:
    """How many SUBSCRIBEs the server refused to ``username`` (``ACL LOG`` counts; the
    scripts' refused PUBLISHes are logged in the "lua" context)."""
    return sum(
        int(entry["count"])
        for entry in admin.acl_log()
        if entry["username"] == username
        and entry["reason"] == "channel"
        and entry["context"] == "toplevel"
    )


# -- a user without pub/sub rights -----------------------------------------------------------


def test_a_user_without_channels_gets_its_writes_answered(acl_url: str, prefix: str) -> None:
    """The write's PUBLISH is refused, yet the write answers won: applied, and known to be."""
    store = RedisStore(acl_url, prefix=prefix)
    try:
        snap = claim(store)
        assert snap.won
        assert snap.record is not None
        done = store.write(NS, "k", Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result="1"))
        assert done.won
        assert done.record is not None
        assert done.record.state is State.SUCCEEDED
    finally:
        store.close()


def test_a_user_without_channels_runs_a_call_once_and_replays_it(acl_url: str, prefix: str) -> None:
    """Through a Ledger: the call completes, its retry replays, the tool ran once."""
    ledger = twiceshy.Ledger(store=RedisStore(acl_url, prefix=prefix), counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(amount: int) -> str:
        runs.append(amount)
        return "charged"

    try:
        with twiceshy.run("scope-1"):
            assert charge(5) == "charged"
            assert charge(5) == "charged"
        assert runs == [5]
    finally:
        ledger.close()


def test_a_refused_subscription_is_logged_once_and_waiters_re_read(
    acl_url: str, admin: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Waiters see the outcome at a re-read; one warning; SUBSCRIBE is not retried in a loop."""
    user = acl_url.split("://", 1)[1].split(":", 1)[0]
    store = RedisStore(acl_url, prefix=prefix, reread_interval=0.2)
    try:
        claimed = claim(store)
        assert claimed.won
        before = subscribe_refusals(admin, user)

        def finish() -> None:
            time.sleep(0.5)
            change = Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result="1")
            assert store.write(NS, "k", change).won

        finisher = threading.Thread(target=finish)
        with caplog.at_level(logging.WARNING, logger="twiceshy"):
            finisher.start()
            started = time.monotonic()
            snap = store.wait(NS, "k", 1, 5.0)
            finisher.join(5)
            assert snap.record is not None
            assert snap.record.state is State.SUCCEEDED
            assert time.monotonic() - started < 2.0  # a re-read found it, not the timeout
            claim(store, "other")
            assert store.wait(NS, "other", 1, 0.5).record is not None  # a second channel
            time.sleep(0.5)  # a reader that reconnected in a loop would be refused meanwhile
        # One refusal per subscription asked for: the waiter's, the second waiter's.
        assert subscribe_refusals(admin, user) - before == 2
        refusals = [r for r in caplog.records if "SUBSCRIBE" in r.getMessage()]
        assert len(refusals) == 1
    finally:
        store.close()


# -- a lost reply, retried after a short retention -------------------------------------------


def _final_write_twice(store: RedisStore, between: Callable[[], None]) -> tuple[Snapshot, Snapshot]:
    """Send one final write (ttl 0.05 s) twice with one write id, as the store does after a
    lost reply, with ``between`` run between the two attempts."""
    core = store._core
    write = core.client.register_script(WRITE_SCRIPT)
    rec, channel = core.names(NS, "k")
    change = Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result='"once"', ttl=0.05)
    write_id = secrets.token_hex(12)
    first = _snapshot(write(keys=[rec], args=core.write_args(channel, change, write_id)))
    between()
    second = _snapshot(write(keys=[rec], args=core.write_args(channel, change, write_id)))
    return first, second


def test_a_write_retried_past_its_ttl_on_a_caller_clock_recognises_itself(
    url: str, prefix: str
) -> None:
    """The retry after the ttl answers won (the write stands), not "no record"."""
    now = [1_700_000_000.0]
    store = RedisStore(url, prefix=prefix, clock=lambda: now[0])
    try:
        assert claim(store).won

        def later() -> None:
            now[0] += 10

        first, second = _final_write_twice(store, later)
        assert first.won
        assert second.won
        assert second.record is not None  # what the write wrote, answered to its writer
        assert second.record.result == '"once"'
        assert store.get(NS, "k").record is None  # past its retention, as every reader sees it
    finally:
        store.close()


def test_a_write_retried_past_its_ttl_on_the_server_clock_recognises_itself(
    url: str, prefix: str
) -> None:
    """On Redis's clock the hash outlives the ttl by a grace, so the retry still finds it."""
    store = RedisStore(url, prefix=prefix, socket_timeout=1.0)
    try:
        assert claim(store).won
        first, second = _final_write_twice(store, lambda: time.sleep(0.2))
        assert first.won
        assert second.won
        assert second.record is not None
        assert second.record.result == '"once"'
        assert store.get(NS, "k").record is None
    finally:
        store.close()


# -- fork ------------------------------------------------------------------------------------


def _forked_child_closes(hold: Any, use: Callable[[], None]) -> int | None:
    """Hold a lock in a thread, fork, and in the child ``use`` the store; the child's exit code.

    The child is given 5 seconds; one that hangs on the inherited lock is killed (None).
    """
    assert FORK is not None
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with hold:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    assert held.wait(5)
    try:
        child = FORK.Process(target=use)
        child.start()
        child.join(5)
        if child.exitcode is None:
            child.kill()
            child.join(5)
            return None
        return child.exitcode
    finally:
        done.set()
        thread.join(5)


@pytest.mark.skipif(FORK is None, reason="needs the fork start method")
def test_a_forked_child_closes_a_store_whose_locks_a_parent_thread_held(
    url: str, prefix: str
) -> None:
    """The core's and the subscriber's locks, held at the fork: the child waits, and closes."""
    store = RedisStore(url, prefix=prefix, reread_interval=30)
    try:
        store.wait(NS, "absent", 1, 0.2)  # the subscriber exists (no record: it returns at once)
        subscriber = store._core._subscriber
        assert subscriber is not None

        def child() -> None:
            assert store.wait(NS, "absent", 1, 0.2).record is None  # a subscriber of its own
            store.close()

        assert _forked_child_closes(subscriber._lock, child) == 0
        assert _forked_child_closes(store._core._lock, child) == 0
    finally:
        store.close()


@pytest.mark.skipif(FORK is None, reason="needs the fork start method")
def test_a_forked_child_uses_an_async_store_whose_lock_a_parent_thread_held(
    url: str, prefix: str
) -> None:
    """AsyncRedisStore's lock of its per-loop clients, held at the fork: the child goes on."""
    store = AsyncRedisStore(url, prefix=prefix)

    async def read_and_close() -> None:
        assert (await store.get(NS, "absent")).record is None
        await store.close()

    try:
        asyncio.run(store.get(NS, "absent"))  # a client of the parent's (its loop is gone)

        def child() -> None:
            asyncio.run(read_and_close())

        assert _forked_child_closes(store._clients_lock, child) == 0
    finally:
        asyncio.run(store.close())


# -- settings ---------------------------------------------------------------------------------


def test_wait_timeout_must_be_shorter_than_the_socket_timeout(url: str, prefix: str) -> None:
    """A WAIT that outlasts the socket would make every write a lost reply: refused at once."""
    for make in (RedisStore, AsyncRedisStore):
        with pytest.raises(ValueError, match="wait_timeout"):
            make(url, prefix=prefix, wait_replicas=1, wait_timeout=2.0, socket_timeout=2.0)
    with pytest.raises(ValueError, match="wait_timeout"):
        RedisStore.from_url(f"{url}?prefix={prefix}&wait_replicas=1&wait_timeout=6")
    RedisStore(url, prefix=prefix, wait_replicas=0, wait_timeout=9, socket_timeout=1).close()
    RedisStore(url, prefix=prefix, wait_replicas=1, wait_timeout=0.5, socket_timeout=1).close()
