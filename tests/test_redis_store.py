"""What the Redis store promises beyond the contract, shown against a real Redis server.

Every test works under a key prefix of its own and deletes its keys afterwards. Connections are
named (``CLIENT SETNAME``) where a test must find them again, to count their commands (MONITOR)
or to cut them (``CLIENT KILL``); only this test's own connections are ever killed. Every wait
is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import queue
import secrets
import select
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
import redis
from click.testing import CliRunner

import servers
import twiceshy
from twiceshy._records import Change, Effect, Snapshot, State
from twiceshy.cli import main
from twiceshy.errors import StoreError, StoreUnavailable
from twiceshy.stores import open_store
from twiceshy.stores.redis import AsyncRedisStore, EvictionPolicyRefused, RedisStore, split_url
from twiceshy.stores.redis._core import bounded_writes

pytestmark = pytest.mark.redis

CTX = mp.get_context("spawn")
NS = "tenant"
CLAIMED = frozenset({State.CLAIMED})


# -- helpers --------------------------------------------------------------------------------


@pytest.fixture
def url() -> str:
    """The test server's URL (skips, or fails in CI, without a server)."""
    return servers.require("redis")


@pytest.fixture
def prefix(url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    name = f"twiceshy-test:{secrets.token_hex(6)}"
    yield name
    servers.delete_prefix(url, name)


@pytest.fixture
def admin(url: str) -> Iterator[redis.Redis]:
    """A plain client for looking at the server behind the store's back."""
    client = redis.Redis.from_url(url, protocol=2, socket_timeout=10, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def stores(url: str, prefix: str) -> Iterator[Callable[..., RedisStore]]:
    """Opens stores under the test's prefix; closes them afterwards."""
    opened: list[RedisStore] = []

    def open_one(**kwargs: Any) -> RedisStore:
        store = RedisStore(url, prefix=prefix, **kwargs)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


def ledger_url(url: str, prefix: str, **options: str) -> str:
    """A ledger URL with twiceshy's options in its query."""
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in {"prefix": prefix, **options}.items())
    return f"{url}?{query}"


def claim(store: RedisStore, key: str = "k", owner: str = "alice", lease: float = 30) -> Snapshot:
    """Claim a key with fixed test values."""
    return store.claim(
        NS, key, fingerprint="fp", tool="charge", effect=Effect.KEYED, owner=owner, lease=lease
    )


def settle(store: RedisStore, snap: Snapshot, to: State, **kwargs: Any) -> Snapshot:
    """Record an outcome as the owner of the claimed record in ``snap``."""
    record = snap.record
    assert record is not None
    change = Change(record.fence, CLAIMED, to, owner=record.owner, **kwargs)
    return store.write(record.namespace, record.key, change)


def server_now(admin: redis.Redis) -> float:
    """Redis's clock."""
    seconds, micros = admin.time()
    return seconds + micros / 1_000_000


def kill_clients(admin: redis.Redis, name: str) -> int:
    """``CLIENT KILL`` every connection named ``name``; answer how many."""
    ids = [c["id"] for c in admin.client_list() if c["name"] == name]
    for client_id in ids:
        admin.client_kill_filter(_id=client_id)
    return len(ids)


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` every 5 ms until it holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def subscribed(admin: redis.Redis, channel: str, count: int = 1) -> Callable[[], bool]:
    """Whether ``channel`` has ``count`` subscribers."""
    return lambda: dict(admin.pubsub_numsub(channel)).get(channel) == count


@contextmanager
def commands_from(url: str, admin: redis.Redis, client_name: str) -> Iterator[list[str]]:
    """Collect, through MONITOR, the commands the connections named ``client_name`` send.

    Commands that scripts run inside the server are not counted: they are no round trips.
    """
    seen: list[str] = []
    marker = f"twiceshy-marker-{secrets.token_hex(4)}"
    with admin.monitor() as monitor:
        yield seen
        other = redis.Redis.from_url(url, protocol=2)
        try:
            other.echo(marker)
        finally:
            other.close()
        entries = []
        for _ in range(10_000):
            entry = monitor.next_command()
            if marker in entry["command"]:
                break
            entries.append(entry)
        else:
            pytest.fail("MONITOR never showed the marker")
    ours = {c["addr"] for c in admin.client_list() if c["name"] == client_name}
    for entry in entries:
        if f"{entry['client_address']}:{entry['client_port']}" in ours:
            seen.append(entry["command"].split(" ", 1)[0].upper())


def effects(path: Path) -> list[dict[str, Any]]:
    """The effects tools recorded, one JSON object a line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def record_effect(path: Path, **fields: Any) -> None:
    """Append one effect; O_APPEND writes of one line are atomic between processes."""
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


class CuttingProxy:
    """A TCP proxy in front of Redis that can cut a connection at a chosen moment.

    ``cut_reply()`` arms it to swallow the next reply the server sends and close that
    connection, as a network failure after the server executed a command would; the client sees
    a dropped connection and does not know whether its command ran.
    """

    def __init__(self, target: tuple[str, int], on_cut: Callable[[], None] = lambda: None) -> None:
        self.target = target
        self.on_cut = on_cut  # run after a reply is swallowed, before its connection closes
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.cuts = 0
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def cut_reply(self) -> None:
        """Swallow the next reply from the server and close its connection."""
        self._armed.set()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            server = socket.create_connection(self.target, timeout=5)
            pump = threading.Thread(target=self._pump, args=(client, server), daemon=True)
            self._threads.append(pump)
            pump.start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.1)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is server and self._armed.is_set():
                        self._armed.clear()
                        self.cuts += 1
                        self.on_cut()
                        return
                    (server if sock is client else client).sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        """Stop every thread and close every socket."""
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self.listener.close()


# -- URLs, layout, clock, retention ---------------------------------------------------------


def test_url_options_are_taken_out_for_redis_py(url: str) -> None:
    """prefix and the other twiceshy options leave the URL; redis-py's own stay in it."""
    plain, options = split_url(f"{url}?prefix=a:b&client_name=x&wait_replicas=2&wait_timeout=0.5")
    assert plain == f"{url}?client_name=x"
    assert options == {"prefix": "a:b", "wait_replicas": 2, "wait_timeout": 0.5}
    assert split_url("unix:///run/redis.sock?db=1&prefix=p&reread_interval=2") == (
        "unix:///run/redis.sock?db=1",
        {"prefix": "p", "reread_interval": 2.0},
    )
    with pytest.raises(ValueError, match="from_url"):
        RedisStore(f"{url}?prefix=a")
    with pytest.raises(ValueError, match="braces"):
        RedisStore(url, prefix="a{b}")


def test_an_unknown_url_parameter_is_refused_before_anything_runs(
    url: str, prefix: str, admin: redis.Redis
) -> None:
    """A query parameter neither twiceshy nor redis-py knows: a ValueError naming it, at once."""
    with pytest.raises(ValueError, match="bogus"):
        twiceshy.Ledger(ledger_url(url, prefix, bogus="1"))
    assert list(admin.scan_iter(match=f"{prefix}*")) == []


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    """A Redis server of this test's own, listening on a Unix socket only; stopped afterwards."""
    import shutil
    import subprocess

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server needed to serve a Unix socket: not on PATH")
    path = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        [server, "--port", "0", "--unixsocket", str(path), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert path.exists(), "redis-server did not open its socket"
        yield path
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_unix_socket_url_names_a_ledger(unix_socket: Path) -> None:
    """``unix:///path.sock`` opens a ledger, sync and async: a call runs once, its retry replays."""
    ledger = twiceshy.Ledger(f"unix://{unix_socket}?prefix=t", counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(amount: int) -> int:
        runs.append(amount)
        return amount

    @ledger.tool(effect=twiceshy.UNSAFE)
    async def refund(amount: int) -> int:
        runs.append(-amount)
        return -amount

    async def refund_twice() -> list[int]:
        with twiceshy.run("run-1"):
            return [await refund(3), await refund(3)]

    try:
        with twiceshy.run("run-1"):
            assert [charge(5), charge(5)] == [5, 5]
        assert asyncio.run(refund_twice()) == [-3, -3]
        assert runs == [5, -3]
    finally:
        ledger.close()


def test_open_store_gives_a_redis_pair_under_the_prefix(url: str, prefix: str) -> None:
    """open_store on a redis:// URL gives both stores, keyed under the URL's prefix."""
    store, async_store = open_store(ledger_url(url, prefix))
    try:
        assert isinstance(store, RedisStore)
        assert isinstance(async_store, AsyncRedisStore)
        assert store.prefix == prefix
        assert claim(store).won
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            assert list(client.scan_iter(match=f"{prefix}*")) == [f"{prefix}:{{{NS}:k}}:rec"]
        finally:
            client.close()
    finally:
        store.close()


def test_every_name_of_a_record_shares_one_hash_tag(
    stores: Callable[..., RedisStore], admin: redis.Redis, prefix: str
) -> None:
    """Hash and channel share one hash tag; braces and colons in names cannot break it."""
    store = stores()
    for namespace, key in [("a{b}:c", "k}*?{"), ("", "plain"), ("租户", "ключ")]:
        rec, channel = store.key_names(namespace, key)
        for name in (rec, channel):
            assert name.count("{") == 1
            assert name.count("}") == 1
        tag = rec[rec.index("{") : rec.index("}") + 1]
        assert channel[channel.index("{") : channel.index("}") + 1] == tag
        assert rec.startswith(prefix + ":")
        snap = store.claim(
            namespace, key, fingerprint="f", tool="t", effect=Effect.SAFE, owner="o", lease=5
        )
        assert snap.won
        assert admin.exists(rec) == 1
        assert [r.key for r in store.records(namespace)] == [key]
    assert store.records("a") == []


def test_server_clock_sets_the_lease(stores: Callable[..., RedisStore], admin: redis.Redis) -> None:
    """With clock=None the lease deadline is on Redis TIME: within a second of it."""
    store = stores()
    before = server_now(admin)
    snap = claim(store, lease=30)
    after = server_now(admin)
    record = snap.record
    assert record is not None
    assert before - 1 <= snap.now <= after + 1
    assert record.lease_deadline is not None
    assert abs(record.lease_deadline - (server_now(admin) + 30)) < 1.0
    assert record.created_at == snap.now


def test_outcomes_expire_on_the_server_claims_and_unknowns_never(
    stores: Callable[..., RedisStore], admin: redis.Redis
) -> None:
    """On the server clock a SUCCEEDED record with a ttl has a real PTTL; CLAIMED/UNKNOWN none.

    The real TTL lasts a grace (2 * socket_timeout + 1 s) past the logical expiry, for the
    second attempt of a write whose reply was lost.
    """
    store = stores(socket_timeout=0.5)
    rec, _ = store.key_names(NS, "done")
    claimed = claim(store, "done")
    assert admin.pttl(rec) == -1
    done = settle(store, claimed, State.SUCCEEDED, result='"ok"', ttl=60)
    assert done.won
    assert 61_000 < admin.pttl(rec) <= 62_001  # PEXPIREAT rounds up to the millisecond
    assert done.record is not None
    assert done.record.expires_at == pytest.approx(done.now + 60)

    unknown_rec, _ = store.key_names(NS, "unknown")
    unknown = settle(store, claim(store, "unknown"), State.UNKNOWN, reason="t/o", ttl=60)
    assert unknown.won
    assert admin.pttl(unknown_rec) == -1

    short_rec, _ = store.key_names(NS, "short")
    short = settle(store, claim(store, "short"), State.FAILED, error='"no"', ttl=0.2)
    assert short.won
    wait_until(lambda: store.get(NS, "short").record is None, timeout=2)  # logically gone
    assert admin.exists(short_rec) == 1  # the grace: a lost reply's retry still finds it
    wait_until(lambda: admin.exists(short_rec) == 0, timeout=5)  # Redis expired it itself
    again = claim(store, "short", owner="bob")
    assert again.won
    assert again.record is not None
    assert again.record.owner == "bob"
    assert admin.pttl(short_rec) == -1


def test_caller_clock_keeps_retention_logical(
    stores: Callable[..., RedisStore], admin: redis.Redis
) -> None:
    """With a caller's clock no real TTL is set; expiry is logical and purge_expired reclaims."""
    now = [1_700_000_000.0]
    store = stores(clock=lambda: now[0])
    rec, _ = store.key_names(NS, "k")
    done = settle(store, claim(store), State.SUCCEEDED, result="1", ttl=10)
    assert done.won
    assert admin.pttl(rec) == -1
    now[0] += 11
    assert store.get(NS, "k").record is None
    assert admin.exists(rec) == 1
    assert store.purge_expired(NS) == 1
    assert admin.exists(rec) == 0


# -- round trips ----------------------------------------------------------------------------


def test_claim_replay_and_write_are_one_round_trip_each(
    url: str, prefix: str, admin: redis.Redis
) -> None:
    """MONITOR sees one command per first claim, per replay and per write: one EVALSHA each."""
    name = f"twiceshy-rt-{secrets.token_hex(4)}"
    store = RedisStore(url, prefix=prefix, client_name=name)
    try:
        with commands_from(url, admin, name) as first:
            snap = claim(store)
        assert first == ["EVALSHA"]
        with commands_from(url, admin, name) as write:
            assert settle(store, snap, State.SUCCEEDED, result='"r"', ttl=60).won
        assert write == ["EVALSHA"]
        with commands_from(url, admin, name) as replay:
            again = claim(store, owner="bob")
        assert replay == ["EVALSHA"]
        assert not again.won
        assert again.record is not None
        assert again.record.result == '"r"'
    finally:
        store.close()


# -- waiting --------------------------------------------------------------------------------


def test_waiter_wakes_through_pubsub_within_milliseconds(
    stores: Callable[..., RedisStore], admin: redis.Redis
) -> None:
    """With the safety re-read at 10 s, a waiter on another store wakes ms after the write."""
    owner, waiter = stores(), stores(reread_interval=10.0)
    latencies: list[float] = []
    for i in range(25):
        key = f"wake-{i}"
        snap = claim(owner, key)
        woke: list[float] = []

        def wait_for_it(key: str = key, woke: list[float] = woke) -> None:
            got = waiter.wait(NS, key, 1, timeout=5.0)
            woke.append(time.perf_counter())
            assert got.record is not None
            assert got.record.state is State.SUCCEEDED

        thread = threading.Thread(target=wait_for_it)
        thread.start()
        _, channel = waiter.key_names(NS, key)
        wait_until(subscribed(admin, channel))
        time.sleep(0.01)  # the waiter's re-read after subscribing is done by now
        assert settle(owner, snap, State.SUCCEEDED, result="1").won
        written = time.perf_counter()
        thread.join(5)
        assert woke, "the waiter did not return"
        latencies.append(woke[0] - written)
    assert max(latencies) < 1.0  # far below the 10 s re-read: the wake-up came by pub/sub
    assert statistics.median(latencies) <= 0.005


def test_many_waiters_share_one_subscriber_and_all_wake(
    stores: Callable[..., RedisStore], admin: redis.Redis
) -> None:
    """30 threads on 10 keys through one store: each wakes with its key's outcome by pub/sub."""
    owner, waiter = stores(), stores(reread_interval=10.0)
    keys = [f"many-{i}" for i in range(10)]
    snaps = {key: claim(owner, key) for key in keys}
    results: dict[tuple[str, int], tuple[Snapshot, float]] = {}

    def wait_on(key: str, n: int) -> None:
        results[(key, n)] = (waiter.wait(NS, key, 1, 8.0), time.monotonic())

    threads = [threading.Thread(target=wait_on, args=(k, n)) for k in keys for n in range(3)]
    for thread in threads:
        thread.start()
    channels = [waiter.key_names(NS, key)[1] for key in keys]
    for channel in channels:
        wait_until(subscribed(admin, channel))  # one subscription per channel, shared
    time.sleep(0.02)
    written = time.monotonic()
    for key in keys:
        assert settle(owner, snaps[key], State.SUCCEEDED, result=json.dumps(key)).won
    for thread in threads:
        thread.join(8)
    assert len(results) == 30
    for (key, _), (snap, woke) in results.items():
        assert snap.record is not None
        assert snap.record.result == json.dumps(key)
        assert woke - written < 1.0
    for channel in channels:
        wait_until(subscribed(admin, channel, 0))  # unsubscribed after its last waiter


def test_waiter_survives_its_subscriber_connection_being_killed(
    url: str, prefix: str, admin: redis.Redis
) -> None:
    """A killed subscriber connection is re-established and the waiter still wakes by pub/sub."""
    name = f"twiceshy-sub-{secrets.token_hex(4)}"
    owner = RedisStore(url, prefix=prefix)
    waiter = RedisStore(url, prefix=prefix, client_name=name, reread_interval=10.0)
    try:
        snap = claim(owner)
        _, channel = waiter.key_names(NS, "k")
        result: list[Snapshot] = []
        thread = threading.Thread(target=lambda: result.append(waiter.wait(NS, "k", 1, 8.0)))
        started = time.monotonic()
        thread.start()
        wait_until(subscribed(admin, channel))
        assert kill_clients(admin, name) >= 1
        wait_until(subscribed(admin, channel))  # subscribed again on a new connection
        time.sleep(0.01)
        assert settle(owner, snap, State.SUCCEEDED, result="1").won
        thread.join(8)
        assert result
        assert result[0].record is not None
        assert result[0].record.state is State.SUCCEEDED
        assert time.monotonic() - started < 5.0
    finally:
        owner.close()
        waiter.close()


# -- failures -------------------------------------------------------------------------------


def test_unreachable_server_fails_fast() -> None:
    """Nothing listening: the stores and a Ledger raise StoreUnavailable at once."""
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        RedisStore("redis://127.0.0.1:1/0")
    with pytest.raises(StoreUnavailable):
        AsyncRedisStore("redis://127.0.0.1:1/0")
    with pytest.raises(twiceshy.StoreUnavailable):
        twiceshy.Ledger("redis://127.0.0.1:1/0")
    assert time.monotonic() - started < 3.0


# redis-py 8 deprecates lib_name= for driver_info=, which older releases lack; either skips the
# CLIENT SETINFO that the silent peer below would never answer.
@pytest.mark.filterwarnings("ignore:Call to '__init__' function with deprecated usage")
def test_an_async_write_the_server_never_reads_fails_as_redis_py_fails_it() -> None:
    """An async command whose bytes a server stops taking fails once ``socket_timeout`` has
    passed, as redis-py's own connection fails it: a ``redis.exceptions.TimeoutError`` (a store
    error to the call), the connection dropped. On Python 3.11 the async store bounds its
    writes itself (``bounded_writes``); here a loopback peer accepts and never reads."""
    peer = socket.create_server(("127.0.0.1", 0))
    port = peer.getsockname()[1]
    accepted: list[socket.socket] = []
    taker = threading.Thread(target=lambda: accepted.append(peer.accept()[0]), daemon=True)
    taker.start()
    connection = bounded_writes(redis.asyncio.Connection)(
        host="127.0.0.1",
        port=port,
        socket_timeout=0.3,
        socket_connect_timeout=2.0,
        protocol=2,  # no HELLO on connecting, and no CLIENT SETINFO: the peer answers nothing
        lib_name=None,
        lib_version=None,
    )

    failed: list[BaseException] = []

    async def send_until_stuck() -> None:
        await connection.connect()
        try:
            # More than any socket buffer holds: the write waits for a reader that never comes.
            await connection.send_packed_command([b"x" * (64 << 20)], check_health=False)
        except redis.exceptions.TimeoutError as exc:
            failed.append(exc)
        taker.join(5)
        for conn in accepted:  # the peer goes, so the dropped transport can finish closing
            conn.close()
        await asyncio.sleep(0.1)

    try:
        asyncio.run(asyncio.wait_for(send_until_stuck(), 10.0))
        assert len(failed) == 1
        assert "writing" in str(failed[0])
        assert not connection.is_connected
    finally:
        peer.close()


def test_closed_store_refuses_calls(stores: Callable[..., RedisStore]) -> None:
    """close() is idempotent; later calls raise StoreError instead of touching the server."""
    store = stores()
    claim(store)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get(NS, "k")
    with pytest.raises(StoreError, match="closed"):
        store.wait(NS, "k", 1, 1.0)


def test_wait_replicas_refuses_an_unreplicated_claim(
    stores: Callable[..., RedisStore], admin: redis.Redis
) -> None:
    """wait_replicas=1 on a server without replicas: the claim raises StoreError, nothing runs."""
    store = stores(wait_replicas=1, wait_timeout=0.05)
    started = time.monotonic()
    with pytest.raises(StoreError, match="replicas"):
        claim(store)
    assert time.monotonic() - started < 2.0
    record = store.get(NS, "k").record  # the claim stands on the primary: nobody else runs it
    assert record is not None
    assert record.state is State.CLAIMED
    assert not claim(store, owner="bob").won  # a lost claim wrote nothing: no WAIT, no error


def test_lost_replies_are_recognised_not_applied_twice(url: str, prefix: str) -> None:
    """G9: a claim or write whose reply is lost is sent again and recognises itself."""
    proxy = CuttingProxy(("127.0.0.1", 6379))
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix)
    try:
        proxy.cut_reply()
        first = claim(store, lease=0.2)
        assert proxy.cuts == 1
        assert first.won
        assert first.record is not None
        assert first.record.fence == 1
        time.sleep(0.25)  # the lease lapses; bob takes over, and that reply is lost too
        takeover = Change(1, CLAIMED, State.CLAIMED, lapsed=True, new_owner="bob", lease=30)
        proxy.cut_reply()
        snap = store.write(NS, "k", takeover)
        assert proxy.cuts == 2
        assert snap.won
        assert snap.record is not None
        assert (snap.record.fence, snap.record.owner, snap.record.attempts) == (2, "bob", 2)
        proxy.cut_reply()
        done = settle(store, snap, State.SUCCEEDED, result='"once"')
        assert proxy.cuts == 3
        assert done.won
        assert done.record is not None
        assert (done.record.state, done.record.fence) == (State.SUCCEEDED, 2)
    finally:
        store.close()
        proxy.close()


def test_a_lost_final_reply_retried_past_the_ttl_replays_the_owners_value(prefix: str) -> None:
    """G9/G10: the completion's reply is lost and its retry comes after the ttl: no second run.

    The retry recognises its write, so the owner returns its own value; taking the expired
    record for a write that never happened would claim the key afresh and run the tool again.
    """
    now = [1_700_000_000.0]

    def later() -> None:
        now[0] += 10  # the store's clock passes the ttl between the two attempts

    proxy = CuttingProxy(("127.0.0.1", 6379), on_cut=later)
    store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix, clock=lambda: now[0])
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, ttl=1.0)
    def charge(amount: int) -> str:
        runs.append(amount)
        if len(runs) == 1:
            proxy.cut_reply()  # the next reply is the completion's
        return "charged"

    try:
        with twiceshy.run("run-1"):
            assert charge(5) == "charged"
        assert proxy.cuts == 1
        assert runs == [5]
    finally:
        ledger.close()
        proxy.close()


def test_connections_killed_between_claim_and_record(
    url: str, prefix: str, admin: redis.Redis, tmp_path: Path
) -> None:
    """G9: CLIENT KILL of the ledger's connections inside the tool: one run, result recorded."""
    name = f"twiceshy-g9-{secrets.token_hex(4)}"
    log = tmp_path / "effects.jsonl"
    ledger = twiceshy.Ledger(ledger_url(url, prefix, client_name=name))
    try:

        @ledger.tool(effect=twiceshy.UNSAFE, name="charge")
        def charge(amount: int) -> dict[str, int]:
            record_effect(log, amount=amount)
            assert kill_clients(admin, name) >= 1  # between the claim and the record
            return {"charged": amount}

        with twiceshy.run("g9"):
            first = charge(7)
            again = charge(7)
        assert first == again == {"charged": 7}
        assert effects(log) == [{"amount": 7}]
        key = twiceshy.idempotency_key("g9", "charge", {"amount": 7})
        record = ledger.store.get("", key).record
        assert record is not None
        assert record.state is State.SUCCEEDED
    finally:
        ledger.close()


# -- processes ------------------------------------------------------------------------------


def _racer(url: str, log: Path, barrier: Any, out: Any, trials: int) -> None:
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge", wait=20)
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


def test_processes_racing_one_intent_run_it_once(url: str, prefix: str, tmp_path: Path) -> None:
    """G1/G8: 16 processes released together, 5 trials: one execution, one shared result."""
    processes, trials = 16, 5
    log = tmp_path / "effects.jsonl"
    barrier = CTX.Barrier(processes)
    out = CTX.Queue()
    target = ledger_url(url, prefix)
    procs = [
        CTX.Process(target=_racer, args=(target, log, barrier, out, trials))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    results: list[Any] = []
    deadline = time.monotonic() + 180
    try:
        while len(results) < processes * trials:
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                assert time.monotonic() < deadline, "the racers did not answer in time"
                assert any(p.is_alive() for p in procs), "every racer ended without answering"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == [0] * processes
    seen = effects(log)
    assert sorted(e["trial"] for e in seen) == list(range(trials))
    by_trial: dict[int, list[Any]] = {}
    for trial, result in results:
        by_trial.setdefault(trial, []).append(result)
    for trial, answers in by_trial.items():
        winner = next(e["pid"] for e in seen if e["trial"] == trial)
        assert answers == [{"trial": trial, "by": winner}] * processes


def _paused_owner(url: str, log: Path, started: Any, out: Any) -> None:
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.KEYED, name="charge", lease=0.5)
    def charge(amount: int) -> str:
        record_effect(log, key=twiceshy.current_key(), who="stale")
        started.set()
        time.sleep(0.3)  # SIGSTOP lands here; the lease lapses while the process is stopped
        return "ch_stale"

    try:
        with twiceshy.run("pause-run"):
            out.put(charge(5))
    finally:
        ledger.close()


def test_owner_paused_past_its_lease_cannot_record(url: str, prefix: str, tmp_path: Path) -> None:
    """G4: an owner stopped past its lease is fenced out and returns the new owner's result."""
    target, log = ledger_url(url, prefix), tmp_path / "effects.jsonl"
    started, out = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=_paused_owner, args=(target, log, started, out))
    proc.start()
    ledger = twiceshy.Ledger(target)
    try:
        assert started.wait(30)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.0)  # past the 0.5 s lease on Redis's clock; no heartbeat while stopped

        @ledger.tool(effect=twiceshy.KEYED, name="charge", lease=5, wait=2)
        def charge(amount: int) -> str:
            record_effect(log, key=twiceshy.current_key(), who="fresh")
            return "ch_fresh"

        with twiceshy.run("pause-run"):
            assert charge(5) == "ch_fresh"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    try:
        assert out.get(timeout=30) == "ch_fresh"
        proc.join(30)
        assert proc.exitcode == 0
        with twiceshy.run("pause-run"):
            assert charge(5) == "ch_fresh"
        seen = effects(log)
        assert [e["who"] for e in seen] == ["stale", "fresh"]
        assert len({e["key"] for e in seen}) == 1
        key = twiceshy.idempotency_key("pause-run", "charge", {"amount": 5})
        record = ledger.store.get("", key).record
        assert record is not None
        assert (record.state, record.fence, record.result) == (State.SUCCEEDED, 2, '"ch_fresh"')
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        ledger.close()


# -- async ----------------------------------------------------------------------------------


def test_async_store_claims_writes_and_wakes_a_waiter(url: str, prefix: str) -> None:
    """The async store: claim, a waiter woken by another task's write, close."""

    async def scenario() -> None:
        store = AsyncRedisStore(url, prefix=prefix, reread_interval=10.0)
        try:
            snap = await store.claim(
                NS, "k", fingerprint="fp", tool="t", effect=Effect.UNSAFE, owner="a", lease=30
            )
            assert snap.won
            assert not (
                await store.claim(
                    NS, "k", fingerprint="fp", tool="t", effect=Effect.UNSAFE, owner="b", lease=30
                )
            ).won
            waiter = asyncio.create_task(store.wait(NS, "k", 1, timeout=5.0))
            await asyncio.sleep(0.05)
            change = Change(1, CLAIMED, State.SUCCEEDED, owner="a", result='"async"')
            written = await store.write(NS, "k", change)
            assert written.won
            done_at = time.monotonic()
            got = await asyncio.wait_for(waiter, 5.0)
            assert time.monotonic() - done_at < 0.5  # pub/sub, not the 10 s re-read
            assert got.record is not None
            assert got.record.result == '"async"'
            assert [r.key for r in await store.records(NS)] == ["k"]
            assert await store.purge_expired(NS) == 0
        finally:
            await store.close()

    asyncio.run(scenario())


def test_async_keyed_tool_through_a_ledger_replays(url: str, prefix: str) -> None:
    """An async KEYED tool through Ledger(redis://...) runs once and replays, across loops."""
    ledger = twiceshy.Ledger(ledger_url(url, prefix))
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED)
    async def send_mail(to: str, idempotency_key: str | None = None) -> dict[str, str]:
        assert idempotency_key is not None
        runs.append(idempotency_key)
        await asyncio.sleep(0.01)
        return {"id": f"m_{len(runs)}", "to": to}

    async def call() -> dict[str, str]:
        with twiceshy.run("async-run"):
            return await send_mail("a@example.com")

    try:
        first = asyncio.run(call())
        assert asyncio.run(call()) == first == {"id": "m_1", "to": "a@example.com"}
        assert len(runs) == 1
        assert runs[0] == twiceshy.idempotency_key(
            "async-run", "send_mail", {"to": "a@example.com"}
        )
    finally:
        ledger.close()


# -- eviction -------------------------------------------------------------------------------

EVICTING = (
    "volatile-lru", "allkeys-lru", "volatile-lfu", "allkeys-lfu", "volatile-random",
    "allkeys-random", "volatile-ttl",
)  # fmt: skip


@pytest.fixture
def eviction_policy(admin: redis.Redis) -> Iterator[Callable[[str], AbstractContextManager[None]]]:
    """Sets the shared server's maxmemory-policy for a ``with`` block, and back afterwards.

    The server is shared by other tests: the original policy (noeviction) is restored when the
    block ends and again when the test ends, whatever happened.
    """
    original = admin.config_get("maxmemory-policy")["maxmemory-policy"]

    @contextmanager
    def policy(name: str) -> Iterator[None]:
        admin.config_set("maxmemory-policy", name)
        try:
            yield
        finally:
            admin.config_set("maxmemory-policy", original)

    try:
        yield policy
    finally:
        admin.config_set("maxmemory-policy", original)


@pytest.fixture
def acl_user(url: str, admin: redis.Redis, prefix: str) -> Iterator[Callable[..., str]]:
    """Makes ACL users of this test's own on the test's prefix; answers each one's URL.

    ``acl_user(*rules, password=None)`` adds the rules to ``~<prefix>*`` and every channel; the
    users are deleted afterwards.
    """
    made: list[str] = []
    host_port = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]

    def make(*rules: str, password: str | None = None) -> str:
        user = f"twiceshy-test-{secrets.token_hex(6)}"
        secret = [f">{password}"] if password is not None else ["nopass"]
        admin.execute_command(
            "ACL", "SETUSER", user, "reset", "on", *secret, f"~{prefix}*", "allchannels", *rules
        )
        made.append(user)
        return f"redis://{user}:{password or 'unused'}@{host_port}/0"

    yield make
    for user in made:
        admin.execute_command("ACL", "DELUSER", user)


def twiceshy_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The WARNING lines of the twiceshy logger."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "twiceshy" and r.levelno == logging.WARNING
    ]


def test_a_server_that_may_evict_records_is_refused_at_open(
    url: str,
    prefix: str,
    admin: redis.Redis,
    eviction_policy: Callable[[str], AbstractContextManager[None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every policy but noeviction: EvictionPolicyRefused naming it and the fix; nothing written.

    noeviction (the shared server's) opens, and logs no warning.
    """
    for policy in EVICTING:
        with eviction_policy(policy):
            for opener in (
                lambda: RedisStore(url, prefix=prefix),
                lambda: AsyncRedisStore(url, prefix=prefix),
                lambda: twiceshy.Ledger(ledger_url(url, prefix)),
                lambda: twiceshy.Ledger(ledger_url(url, prefix, allow_eviction="0")),
            ):
                with pytest.raises(EvictionPolicyRefused) as refused:
                    opener()
                message = str(refused.value)
                assert f"maxmemory-policy is {policy}" in message
                assert "CONFIG SET maxmemory-policy noeviction" in message
                assert "maxmemory-policy noeviction in redis.conf" in message
                assert "allow_eviction=1" in message
                assert isinstance(refused.value, twiceshy.StoreError)
    assert list(admin.scan_iter(match=f"{prefix}*")) == []
    caplog.set_level(logging.WARNING, logger="twiceshy")
    store = RedisStore(url, prefix=prefix)
    try:
        assert claim(store).won
    finally:
        store.close()
    assert twiceshy_warnings(caplog) == []


def test_allow_eviction_opens_such_a_server_with_a_warning(
    url: str,
    prefix: str,
    eviction_policy: Callable[[str], AbstractContextManager[None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """allow_eviction=1 (or allow_eviction=True) opens it, and logs a WARNING naming the risk.

    On a noeviction server the option changes nothing, and nothing is logged.
    """
    caplog.set_level(logging.WARNING, logger="twiceshy")
    with eviction_policy("volatile-lru"):
        store = RedisStore.from_url(ledger_url(url, prefix, allow_eviction="1"))
        async_store = AsyncRedisStore(url, prefix=prefix, allow_eviction=True)
    try:
        assert claim(store).won
        warnings = twiceshy_warnings(caplog)
        assert len(warnings) == 2
        for line in warnings:
            assert "maxmemory-policy is volatile-lru" in line
            assert "allow_eviction=1 accepts it" in line
            assert "run the work again" in line
    finally:
        store.close()
        asyncio.run(async_store.close())
    caplog.clear()
    RedisStore.from_url(ledger_url(url, prefix, allow_eviction="1")).close()
    assert twiceshy_warnings(caplog) == []
    with pytest.raises(ValueError, match="allow_eviction='maybe'"):
        split_url(f"{url}?allow_eviction=maybe")


def test_the_policy_is_read_through_info_where_config_is_not_granted(
    url: str,
    prefix: str,
    acl_user: Callable[..., str],
    eviction_policy: Callable[[str], AbstractContextManager[None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CONFIG refused (as on managed Redis): INFO tells the policy; neither: refused, say how."""
    with_info = acl_user("+@all", "-@dangerous", "+info")
    store = RedisStore(with_info, prefix=prefix)  # noeviction, read through INFO
    store.close()
    with eviction_policy("allkeys-lru"), pytest.raises(EvictionPolicyRefused, match="allkeys-lru"):
        RedisStore(with_info, prefix=prefix)

    blind = acl_user("+@all", "-@dangerous")
    with pytest.raises(EvictionPolicyRefused) as refused:
        RedisStore(blind, prefix=prefix)
    message = str(refused.value)
    assert "maxmemory-policy cannot be read" in message
    assert "+info" in message
    assert "allow_eviction=1" in message
    caplog.set_level(logging.WARNING, logger="twiceshy")
    store = RedisStore(blind, prefix=prefix, allow_eviction=True)
    try:
        assert claim(store).won
        (warning,) = twiceshy_warnings(caplog)
        assert "cannot be read" in warning
    finally:
        store.close()


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test's own on a free loopback port, no persistence; stopped after."""
    import shutil
    import subprocess

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server needed for a server of the test's own: not on PATH")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    target = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(target, socket_timeout=1)
        try:
            wait_until(lambda: proc.poll() is None and _pings(client), timeout=10)
        finally:
            client.close()
        yield target
    finally:
        proc.terminate()
        proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_an_evicting_server_reruns_unsafe_tools_and_noeviction_does_not(small_server: str) -> None:
    """What the refusal prevents: 300 UNSAFE calls on a full volatile-lru server run again on retry.

    Settled outcomes carry a TTL, so volatile-lru evicts them; with noeviction the full server
    refuses new calls (StoreError, nothing runs) and every recorded outcome still replays.
    """
    admin = redis.Redis.from_url(small_server, decode_responses=True)

    def rerun_count(policy: str, query: str) -> tuple[int, int]:
        admin.flushall()
        admin.config_set("maxmemory", 0)
        admin.config_set("maxmemory-policy", policy)
        ledger = twiceshy.Ledger(f"{small_server}?prefix=small{query}", counts_interval=None)
        # Room for about 50 outcomes of 10 kB, past what the server uses now.
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 512 * 1024)
        runs: dict[int, int] = {}
        refused = 0

        @ledger.tool(effect=twiceshy.UNSAFE, wait=0)
        def charge(n: int) -> str:
            runs[n] = runs.get(n, 0) + 1
            return "x" * 10_000

        try:
            for _ in range(2):  # every call, then every call again: each retry must replay
                for n in range(300):
                    try:
                        with twiceshy.run(f"order-{n}"):
                            charge(n)
                    except twiceshy.TwiceshyError:
                        refused += 1
        finally:
            ledger.close()
        return sum(1 for count in runs.values() if count > 1), refused

    try:
        admin.config_set("maxmemory-policy", "volatile-lru")
        with pytest.raises(EvictionPolicyRefused, match="volatile-lru"):
            twiceshy.Ledger(f"{small_server}?prefix=small")
        reruns, _ = rerun_count("volatile-lru", "&allow_eviction=1")
        assert reruns > 200  # nearly every UNSAFE charge ran a second time
        reruns, refused = rerun_count("noeviction", "")
        assert reruns == 0
        assert refused > 0  # the server was full: calls failed instead of forgetting
    finally:
        admin.close()


# -- keys that are not records --------------------------------------------------------------


def test_keys_under_the_prefix_that_are_not_records_are_skipped(
    url: str, prefix: str, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A string, list, set or foreign hash named like a record: listing, ls and purge skip it."""
    now = [1_700_000_000.0]
    store = RedisStore(url, prefix=prefix, clock=lambda: now[0])
    try:
        assert settle(store, claim(store, "kept"), State.SUCCEEDED, result="1").won
        assert settle(store, claim(store, "old"), State.SUCCEEDED, result="2", ttl=5).won
        foreign = {name: store.key_names(NS, name)[0] for name in ("str", "list", "set", "hash")}
        admin.set(foreign["str"], "someone else's")
        admin.rpush(foreign["list"], "a", "b")
        admin.sadd(foreign["set"], "a")
        admin.hset(foreign["hash"], mapping={"x": "1"})
        caplog.set_level(logging.DEBUG, logger="twiceshy")

        assert sorted(r.key for r in store.records(NS)) == ["kept", "old"]
        assert [r.key for r in store.records(NS, states=[State.SUCCEEDED], limit=1)]
        assert (
            sorted(r.key for r in asyncio.run(_async_records(url, prefix, now[0])))
            == ["kept", "old"]
        )  # fmt: skip
        skipped = [r.getMessage() for r in caplog.records if "not records" in r.getMessage()]
        assert skipped
        assert "skipped 4 key(s)" in skipped[0]

        listed = CliRunner().invoke(
            main, ["ls", "--ledger", ledger_url(url, prefix), "--namespace", NS]
        )
        assert listed.exit_code == 0, listed.output
        assert "kept" in listed.output

        now[0] += 10
        assert store.purge_expired() == 1  # "old", and none of the foreign keys
        assert all(admin.exists(name) == 1 for name in foreign.values())
        with pytest.raises(StoreError):
            store.get(NS, "str")  # read by its name, a foreign key is an error, never "none"
    finally:
        store.close()


async def _async_records(url: str, prefix: str, now: float) -> list[twiceshy.Record]:
    store = AsyncRedisStore(url, prefix=prefix, clock=lambda: now)
    try:
        return await store.records(NS)
    finally:
        await store.close()


# -- secrets --------------------------------------------------------------------------------


def error_text(exc: BaseException) -> str:
    """str() and repr() of an exception and of every exception it was raised from or during."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None:
        parts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def test_reprs_and_errors_never_show_the_password(
    url: str, prefix: str, acl_user: Callable[..., str]
) -> None:
    """repr() shows redis://user:***@host; no error (refused, failed, closed) shows the password."""
    secret = f"pw-{secrets.token_hex(8)}"
    target = acl_user("+@all", password=secret)
    user = urlsplit(target).username
    host_port = urlsplit(target).netloc.rsplit("@", 1)[-1]
    store = RedisStore(target, prefix=prefix)
    async_store = AsyncRedisStore.twin(store)
    in_query = RedisStore(f"redis://{user}@{host_port}/0?password={secret}", prefix=prefix)
    try:
        assert repr(store) == f"RedisStore('redis://{user}:***@{host_port}/0', prefix={prefix!r})"
        assert repr(async_store) == repr(store).replace("RedisStore", "AsyncRedisStore", 1)
        assert secret not in repr(in_query)
        assert "password=***" in repr(in_query)
    finally:
        in_query.close()
        store.close()
    with pytest.raises(StoreError) as closed:
        store.get(NS, "k")
    failures = [closed.value]
    for attempt in (
        lambda: RedisStore(f"redis://{user}:{secret}@127.0.0.1:1/0"),  # connection refused
        lambda: RedisStore(f"redis://{user}:{secret}x@{host_port}/0"),  # authentication fails
        lambda: RedisStore(f"redis://{user}:{secret}@{host_port}/0?prefix=p"),  # misused option
        lambda: RedisStore(f"redis://{user}:{secret}@{host_port}/0?bogus=1"),  # unknown option
    ):
        with pytest.raises((StoreError, ValueError)) as failed:
            attempt()
        failures.append(failed.value)
    for failure in failures:
        text = error_text(failure)
        assert secret not in text
    assert f"{user}:***@" in str(failures[1])
