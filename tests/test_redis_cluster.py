"""The Redis store on a real Redis Cluster: three masters and three replicas on loopback.

The cluster is ``.ci/servers/redis-cluster.sh``'s (``TWICESHY_TEST_REDIS_CLUSTER``). What the
contract suite and the ledger tests show on every store runs on it too (the ``redis-cluster``
store of ``conftest.py``); these tests show what a cluster adds: a URL of several seeds, one
record in one slot, wake-ups from another node, failovers during calls, and the guarantees
with real processes (racing, kill -9, an owner stopped past its lease). A test that kills a
node starts it again and waits until the cluster is whole before it ends. Every wait is
bounded.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from redis.cluster import RedisCluster

import servers
import twiceshy
from twiceshy._records import Change, Effect, Snapshot, State
from twiceshy.errors import StoreError, StoreUnavailable
from twiceshy.stores import open_store
from twiceshy.stores.redis import (
    AsyncRedisClusterStore,
    EvictionPolicyRefused,
    RedisClusterStore,
    RedisStore,
)

pytestmark = pytest.mark.redis

CTX = mp.get_context("spawn")
NS = "tenant"
CLAIMED = frozenset({State.CLAIMED})


# -- helpers --------------------------------------------------------------------------------


@pytest.fixture
def url() -> str:
    """The test cluster's URL (skips, or fails in CI, without one)."""
    return servers.require("redis-cluster")


def seed(url: str) -> str:
    """The first node of a cluster URL, as a plain ``redis://`` URL."""
    return "redis://" + url.split("://", 1)[1].split(",", 1)[0].split("/", 1)[0]


@pytest.fixture
def admin(url: str) -> Iterator[RedisCluster]:
    """A plain cluster client for looking at the cluster behind the store's back."""
    client = RedisCluster.from_url(seed(url), decode_responses=True, socket_timeout=10)
    yield client
    client.close()


@pytest.fixture
def prefix(url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    name = f"twiceshy-test:{secrets.token_hex(6)}"
    yield name
    servers.delete_prefix(url, name)


def ledger_url(url: str, prefix: str, **options: str) -> str:
    """A ledger URL with twiceshy's options in its query."""
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in {"prefix": prefix, **options}.items())
    return f"{url}?{query}"


def node(address: str) -> redis.Redis:
    """A plain client of one node (``host:port``)."""
    host, port = address.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port), decode_responses=True, socket_timeout=5)


def addresses(admin: RedisCluster) -> list[str]:
    """Every node's ``host:port``, as the seed node knows them."""
    return sorted(admin.cluster_nodes())


_KNOWN: list[str] = []  # every node's address, once a node told them


def answering(url: str) -> redis.Redis:
    """A client of a node that answers: the seed, or another node the cluster had (a test may
    have killed the seed)."""
    if not _KNOWN:
        with node(seed(url).removeprefix("redis://")) as client:
            _KNOWN.extend(sorted(client.execute_command("CLUSTER NODES")))
    for address in _KNOWN:
        client = node(address)
        try:
            client.ping()
            return client
        except redis.RedisError:
            client.close()
    raise AssertionError("no node of the cluster answers")


def primary_of(url: str, name: str) -> str:
    """``host:port`` of the primary serving ``name``'s slot, asked of the cluster now."""
    with answering(url) as client:
        slot = client.execute_command("CLUSTER KEYSLOT", name)
        for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                return f"{primary[0]}:{primary[1]}"
    raise AssertionError(f"no node serves slot {slot}")


def replica_of(url: str, primary: str) -> str:
    """``host:port`` of a replica of ``primary``."""
    with node(primary) as client:
        info = client.info("replication")
    return f"{info['slave0']['ip']}:{info['slave0']['port']}"


def whole(url: str) -> bool:
    """Six nodes answer, every one says cluster_state:ok, three primaries have a linked replica."""
    try:
        with answering(url) as client:
            known = client.execute_command("CLUSTER NODES")
        if len(known) != 6:
            return False
        linked = 0
        for address in known:
            with node(address) as client:
                if client.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                    return False
                info = client.info("replication")
                linked += info["role"] == "slave" and info["master_link_status"] == "up"
        return linked == 3
    except redis.RedisError:
        return False


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` every 50 ms until it holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not in {timeout} s: {what or condition}"
        time.sleep(0.05)


_STOPPED: list[tuple[str, list[str]]] = []  # nodes a test killed: address, how to start it


def stop_node(address: str) -> Callable[[], None]:
    """SIGKILL the node at ``address``; answer how to start it again as it was started."""
    with node(address) as client:
        info = client.info("server")
    pid, executable, config = info["process_id"], info["executable"], info["config_file"]
    if not config:
        pytest.skip(f"node {address} was not started from a config file: cannot restart it")
    if not os.path.exists(executable):  # argv[0] made absolute against the node's directory
        executable = shutil.which("redis-server") or executable
    _STOPPED.append((address, [executable, config]))
    os.kill(int(pid), signal.SIGKILL)
    return lambda: start_stopped(address)


def start_stopped(address: str | None = None) -> None:
    """Start again the nodes a test killed (``address``, or all of them) that do not answer."""
    for stopped, command in list(_STOPPED):
        if address not in (None, stopped):
            continue
        _STOPPED.remove((stopped, command))
        try:
            with node(stopped) as client:
                client.ping()
        except redis.RedisError:
            subprocess.run(command, check=True, timeout=30, stdout=subprocess.DEVNULL)


@pytest.fixture
def healed(url: str) -> Iterator[None]:
    """After the test, the cluster is whole again (six nodes, three linked replicas)."""
    yield
    start_stopped()
    wait_until(lambda: whole(url), 60, "the cluster whole again")


def effects(path: Path) -> list[dict[str, Any]]:
    """The effects tools recorded, one JSON object a line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def record_effect(path: Path, **fields: Any) -> None:
    """Append one effect; O_APPEND writes of one line are atomic between processes."""
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def claim(store: RedisStore, key: str = "k", owner: str = "alice", lease: float = 30) -> Snapshot:
    """Claim a key with fixed test values."""
    return store.claim(
        NS, key, fingerprint="fp", tool="charge", effect=Effect.KEYED, owner=owner, lease=lease
    )


# -- the URL --------------------------------------------------------------------------------


def test_a_url_of_several_seeds_opens_the_cluster(url: str, prefix: str) -> None:
    """Seeds that do not answer are passed over; open_store gives the cluster's pair."""
    first = url.split("://", 1)[1].split("/", 1)[0].split(",", 1)[0]
    several = f"redis+cluster://127.0.0.1:1,{first},[::1]:2/?prefix={prefix}&client_name=t"
    store, twin = open_store(several)
    try:
        assert type(store) is RedisClusterStore
        assert type(twin) is AsyncRedisClusterStore
        assert store.prefix == prefix
        assert claim(store).won
        assert not claim(store, owner="bob").won
    finally:
        store.close()


def test_a_bad_cluster_url_is_refused_before_anything_runs(url: str, admin: RedisCluster) -> None:
    """No node, a database, an unknown parameter, twiceshy's options in the constructor's URL:
    a ValueError saying what is wrong; nothing is written."""
    prefix = f"twiceshy-test:{secrets.token_hex(6)}"
    first = url.split("://", 1)[1].split("/", 1)[0]
    for bad, match in [
        (f"redis+cluster:///?prefix={prefix}", "names no node"),
        (f"redis+cluster://{first}/3?prefix={prefix}", "only database 0"),
        (f"redis+cluster://{first}/?prefix={prefix}&bogus=1", "bogus"),
        (f"redis+cluster://{first}:x/?prefix={prefix}", "bad port"),
        (f"redis+cluster://{first}/?prefix={prefix}&failover_wait=soon", "failover_wait"),
    ]:
        with pytest.raises(ValueError, match=match):
            twiceshy.Ledger(bad)
    with pytest.raises(ValueError, match="from_url"):
        RedisClusterStore(f"redis+cluster://{first}/?prefix={prefix}")
    assert list(admin.scan_iter(match=f"{prefix}*")) == []


def test_an_unreachable_cluster_fails_fast_and_never_shows_a_password() -> None:
    """Nothing listening at any seed: StoreUnavailable at once, the password shown as ***."""
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as refused:
        twiceshy.Ledger("redis+cluster://u:s3cret@127.0.0.1:1,127.0.0.1:2/")
    assert time.monotonic() - started < 5.0
    assert "s3cret" not in str(refused.value)
    assert "***" in str(refused.value)


# -- the layout -----------------------------------------------------------------------------


def test_the_names_of_one_record_lie_in_one_slot_as_on_one_server(
    url: str, prefix: str, admin: RedisCluster
) -> None:
    """Hash and wake channel share a slot (the server's CLUSTER KEYSLOT says so); the names are
    those of the single-server store; the record lives on its slot's primary; records spread
    over every primary."""
    store = RedisClusterStore(url, prefix=prefix)
    single = RedisStore(servers.REDIS_URL, prefix=prefix) if _single_answers() else None
    try:
        owners: set[str] = set()
        for i, (namespace, key) in enumerate(
            [("a{b}:c", "k}*?{"), ("", "plain"), ("租户", "ключ")]
            + [(NS, f"k{n}") for n in range(30)]
        ):
            rec, channel = store.key_names(namespace, key)
            assert admin.cluster_keyslot(rec) == admin.cluster_keyslot(channel)
            if single is not None:
                assert single.key_names(namespace, key) == (rec, channel)
            snap = store.claim(
                namespace, key, fingerprint="f", tool="t", effect=Effect.SAFE, owner="o", lease=5
            )
            assert snap.won, i
            owner = primary_of(url, rec)
            with node(owner) as client:
                assert client.exists(rec) == 1
            owners.add(owner)
        assert len(owners) == 3
        assert sorted(r.key for r in store.records(NS)) == sorted(f"k{n}" for n in range(30))
    finally:
        store.close()
        if single is not None:
            single.close()


def _single_answers() -> bool:
    try:
        client = redis.Redis.from_url(servers.REDIS_URL, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def test_a_node_that_lost_the_scripts_is_sent_their_text(
    url: str, prefix: str, admin: RedisCluster
) -> None:
    """SCRIPT FLUSH on every node (a restart, a new replica): claim, write, read, list and purge
    still work, WAIT for the one replica included, and the scripts are cached again; WAIT for
    two replicas, which no primary has, refuses the claim."""
    store = RedisClusterStore(url, prefix=prefix, wait_replicas=1, wait_timeout=0.5)
    try:
        for address in addresses(admin):
            with node(address) as client:
                client.script_flush()
        snap = claim(store)
        assert snap.won
        done = store.write(
            NS, "k", Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result="1", ttl=0)
        )
        assert done.won
        assert store.get(NS, "k").record is None  # past its retention (ttl 0)
        assert store.records(NS) == []
        assert store.purge_expired(NS) == 1
        with node(primary_of(url, store.key_names(NS, "k")[0])) as client:
            assert all(client.script_exists(*[lua.sha for lua in _scripts()]))
    finally:
        store.close()
    greedy = RedisClusterStore(url, prefix=prefix, wait_replicas=2, wait_timeout=0.1)
    try:
        with pytest.raises(StoreError, match="only 1 of 2 replicas"):
            claim(greedy, "other")
    finally:
        greedy.close()


def test_wait_counts_the_replicas_of_the_records_own_primary(url: str, prefix: str) -> None:
    """wait_replicas=1 with every replica stopped (SIGSTOP, shorter than a failover): the claim
    is refused, "0 of 1" (a WAIT on any other connection would count a replica that acknowledged
    nothing of it); with the replicas back it is acknowledged."""
    store = RedisClusterStore(url, prefix=prefix, wait_replicas=1, wait_timeout=0.3)
    pids = []
    try:
        for address, info in _nodes(url).items():
            if "slave" in info["flags"]:
                with node(address) as client:
                    pids.append(int(client.info("server")["process_id"]))
        assert len(pids) == 3
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreError, match="only 0 of 1 replicas"):
                claim(store, "stopped")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert claim(store, "running").won
    finally:
        store.close()


def _nodes(url: str) -> dict[str, Any]:
    with answering(url) as client:
        return dict(client.execute_command("CLUSTER NODES"))


def _scripts() -> list[Any]:
    from twiceshy.stores.redis._lua import SCRIPTS

    return list(SCRIPTS)


# -- eviction, on every node ----------------------------------------------------------------


@contextmanager
def policy_on(address: str, policy: str) -> Iterator[None]:
    """``maxmemory-policy`` of one node, for a ``with`` block, and back to noeviction."""
    with node(address) as client:
        client.config_set("maxmemory-policy", policy)
        try:
            yield
        finally:
            client.config_set("maxmemory-policy", "noeviction")


def test_a_replica_that_may_evict_records_is_refused(
    url: str, prefix: str, admin: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """One replica under allkeys-lru (a primary once it fails over): refused, naming that node;
    allow_eviction=1 opens with one WARNING naming it."""
    replica = next(a for a, n in admin.cluster_nodes().items() if "slave" in n["flags"])
    with policy_on(replica, "allkeys-lru"):
        with pytest.raises(EvictionPolicyRefused) as refused:
            twiceshy.Ledger(ledger_url(url, prefix))
        message = str(refused.value)
        assert f"node {replica}" in message
        assert "maxmemory-policy is allkeys-lru" in message
        assert "allow_eviction=1" in message
        caplog.set_level(logging.WARNING, logger="twiceshy")
        store = RedisClusterStore.from_url(ledger_url(url, prefix, allow_eviction="1"))
        store.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "twiceshy"]
    assert len(warnings) == 1
    assert replica in warnings[0]
    assert list(admin.scan_iter(match=f"{prefix}*")) == []


# -- wake-ups -------------------------------------------------------------------------------


def _subscriber_node(admin: RedisCluster, name: str) -> str:
    """The node holding the subscriber's connection, named ``name``: the connection whose last
    command was a (UN)SUBSCRIBE, the only commands it sends."""
    for address in addresses(admin):
        with node(address) as client:
            for c in client.client_list():
                if c["name"] == name and c["cmd"] in ("subscribe", "unsubscribe"):
                    return address
    raise AssertionError("no subscriber connection found")


def test_a_waiter_is_woken_from_another_node(url: str, prefix: str, admin: RedisCluster) -> None:
    """The record's primary is not the node the subscriber listens on; the PUBLISH of the write
    crosses the cluster and wakes a blocking and an async waiter within a second (they would
    otherwise re-read only after 30 s)."""
    import asyncio

    name = f"twiceshy-wake-{secrets.token_hex(4)}"
    store = RedisClusterStore(url, prefix=prefix, reread_interval=30, client_name=name)
    twin = AsyncRedisClusterStore.twin(store)
    writer = RedisClusterStore(url, prefix=prefix)
    try:
        store.wait(NS, "absent", 1, 0.5)  # the subscriber connects (no record: returns at once)
        listening = _subscriber_node(admin, name)
        key = next(
            f"k{n}"
            for n in range(200)
            if primary_of(url, store.key_names(NS, f"k{n}")[0]) != listening
        )
        assert claim(writer, key).won

        def finish() -> None:
            time.sleep(0.3)
            assert writer.write(NS, key, Change(1, CLAIMED, State.SUCCEEDED, owner="alice")).won

        async def both() -> list[Snapshot]:
            blocking = asyncio.to_thread(store.wait, NS, key, 1, 10.0)
            return list(await asyncio.gather(blocking, twin.wait(NS, key, 1, 10.0)))

        finisher = threading.Thread(target=finish)
        started = time.monotonic()
        finisher.start()
        woken = asyncio.run(both())
        finisher.join(10)
        assert time.monotonic() - started < 1.5
        assert [snap.record.state for snap in woken if snap.record] == [State.SUCCEEDED] * 2
    finally:
        writer.close()
        store.close()


# -- failover during calls ------------------------------------------------------------------


class Calls:
    """Threads calling an UNSAFE tool of one ledger, each call a new intent, until stopped.

    Every run of the tool is counted by intent; every call's answer (its result, or the error
    it raised) is kept with the times it was asked and answered.
    """

    def __init__(self, ledger: twiceshy.Ledger, threads: int = 4) -> None:
        self.runs: Counter[int] = Counter()
        self.answers: dict[int, tuple[float, float, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

        @ledger.tool(effect=twiceshy.UNSAFE, name="charge", wait=0.5, lease=2)
        def charge(n: int) -> int:
            with self._lock:
                self.runs[n] += 1
            return 2 * n

        self.charge = charge
        self._threads = [
            threading.Thread(target=self._loop, args=(t, threads), daemon=True)
            for t in range(threads)
        ]

    def _loop(self, first: int, step: int) -> None:
        n = first
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                with twiceshy.run("failover"):
                    answer: Any = self.charge(n)
            except twiceshy.TwiceshyError as exc:
                answer = exc
            self.answers[n] = (asked, time.monotonic(), answer)
            n += step

    def __enter__(self) -> Calls:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def after(self, moment: float) -> list[int]:
        """The intents answered after ``moment``."""
        return [n for n, (_, at, _) in self.answers.items() if at > moment]

    def wrong(self) -> dict[int, Any]:
        """The calls that did not answer their result."""
        return {n: a for n, (_, _, a) in self.answers.items() if a != 2 * n}


def _key_name(store: RedisStore, tool: str, n: int) -> str:
    """The hash of the intent of ``tool`` with ``n`` in run "failover"."""
    return store.key_names("", twiceshy.idempotency_key("failover", tool, {"n": n}))[0]


def test_calls_during_a_manual_failover_complete_once(url: str, prefix: str, healed: None) -> None:
    """CLUSTER FAILOVER on a replica while four threads call: every call completes, no intent
    runs twice, the calls of the moved slots go on at the new primary, and every retry replays.
    A store that still takes the old primary for the slot's is sent on (MOVED), its claim and
    WAIT on one connection included."""
    ledger = twiceshy.Ledger(ledger_url(url, prefix), counts_interval=None)
    stale = RedisClusterStore(url, prefix=prefix, wait_replicas=1, wait_timeout=1.0)
    try:
        store = ledger.store
        assert isinstance(store, RedisClusterStore)
        old = primary_of(url, _key_name(store, "charge", 0))
        new = replica_of(url, old)
        moved_key = next(
            f"k{n}" for n in range(300) if primary_of(url, stale.key_names(NS, f"k{n}")[0]) == old
        )
        with Calls(ledger) as calls:
            wait_until(lambda: len(calls.answers) > 40, what="calls before the failover")
            with node(new) as client:
                client.execute_command("CLUSTER FAILOVER")
            wait_until(lambda: primary_of(url, _key_name(store, "charge", 0)) == new, what="it")
            moved = time.monotonic()
            wait_until(lambda: len(calls.after(moved)) > 40, what="calls after the failover")
        assert calls.wrong() == {}
        assert set(calls.runs.values()) == {1}
        assert any(
            primary_of(url, _key_name(store, "charge", n)) == new for n in calls.after(moved)
        )
        with twiceshy.run("failover"):
            assert all(calls.charge(n) == 2 * n for n in list(calls.answers)[:50])
        assert set(calls.runs.values()) == {1}
        wait_until(lambda: whole(url), 30, "the old primary a replica, in sync")
        assert claim(stale, moved_key).won
    finally:
        stale.close()
        ledger.close()


def test_a_master_killed_during_calls_completes_them_once(
    url: str, prefix: str, healed: None
) -> None:
    """SIGKILL of a primary while calls run: a call whose outcome is due there, and one whose
    claim is, go on trying through the failover; with the default wait_replicas=1 neither is
    answered while its replica, promoted, has no replica of its own, and both complete once
    the killed node is back as one. No call of four busy threads fails, no intent runs twice,
    every retry replays. A store whose failover_wait is shorter than the failover answers
    StoreUnavailable and runs nothing."""
    ledger = twiceshy.Ledger(ledger_url(url, prefix), counts_interval=None)
    impatient = twiceshy.Ledger(ledger_url(url, prefix, failover_wait="0.3"), counts_interval=None)
    wires: Counter[int] = Counter()
    started = threading.Event()
    wire, impatient_wire = (lg.guard("wire", effect=twiceshy.UNSAFE) for lg in (ledger, impatient))

    def work(n: int) -> Callable[[], int]:
        def run() -> int:
            wires[n] += 1
            started.set()
            time.sleep(0.5)  # the kill lands here, between the claim and the outcome
            return n

        return run

    def wire_in_run(n: int, out: list[Any]) -> None:
        with twiceshy.run("failover"):
            out.append(wire.call({"n": n}, work(n)))
        out.append(time.monotonic())

    try:
        store = ledger.store
        assert isinstance(store, RedisClusterStore)
        doomed = primary_of(url, _key_name(store, "charge", 0))
        heir = replica_of(url, doomed)
        # Intents of the doomed primary's slots.
        held, late, lost = [
            n for n in range(300) if primary_of(url, _key_name(store, "wire", n)) == doomed
        ][:3]
        with Calls(ledger) as calls:
            wait_until(lambda: len(calls.answers) > 40, what="calls before the kill")
            outcome_due: list[Any] = []
            claim_due: list[Any] = []
            holder = threading.Thread(target=wire_in_run, args=(held, outcome_due))
            holder.start()
            assert started.wait(10)
            restart = stop_node(doomed)
            killed = time.monotonic()
            claimer = threading.Thread(target=wire_in_run, args=(late, claim_due))
            claimer.start()
            with twiceshy.run("failover"), pytest.raises(StoreUnavailable):
                impatient_wire.call({"n": lost}, work(lost))
            assert lost not in wires
            wait_until(lambda: primary_of(url, _key_name(store, "wire", held)) == heir, 30, "it")
            promoted = time.monotonic()
            # The heir has no replica until the killed node rejoins: nothing due there is
            # acknowledged, neither the outcome nor the claim (each would be lost with the heir).
            assert holder.is_alive()
            assert claimer.is_alive()
            restart()
            holder.join(30)
            claimer.join(30)
            wait_until(lambda: len(calls.after(promoted)) > 40, what="calls after the failover")
        assert outcome_due[0] == held
        assert claim_due[0] == late
        # Both were due at the killed primary after the kill, and answered: so through its heir.
        # (Not "after the test saw the promotion": the nodes learn of it at different moments,
        # and the client may hear of it from one before the node the test asks.)
        assert outcome_due[1] > killed
        assert claim_due[1] > killed
        assert wires == Counter({held: 1, late: 1})
        assert calls.wrong() == {}
        assert set(calls.runs.values()) == {1}
        assert any(a < killed < b for a, b, _ in calls.answers.values())  # calls in flight
        around = [n for n, (a, b, _) in calls.answers.items() if a < promoted and b > killed]
        with twiceshy.run("failover"):
            assert all(calls.charge(n) == 2 * n for n in around + list(calls.answers)[:50])
            assert wire.call({"n": held}, work(held)) == held
        assert set(calls.runs.values()) == {1}
        assert wires == Counter({held: 1, late: 1})
    finally:
        impatient.close()
        ledger.close()


def _unread(address: str) -> int:
    """Bytes sent to the node at ``address`` that it has not read yet (a stopped node's queue)."""
    port = address.rsplit(":", 1)[1]
    lines = subprocess.run(
        ["ss", "-tnH", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout.splitlines()
    return sum(int(line.split()[0]) for line in lines if line.strip())


def _paused_primary_takeover(url: str, prefix: str, **options: str) -> tuple[Counter[int], Any]:
    """Caller A's claim queued on a paused (SIGSTOPped) primary; its replica takes over; caller
    B claims the same intent at the new primary; the old primary resumes. Answers how often
    the tool ran and what each caller answered."""
    slow = twiceshy.Ledger(ledger_url(url, prefix, socket_timeout="10", **options))
    quick = twiceshy.Ledger(
        ledger_url(url, prefix, socket_timeout="1", wait_timeout="0.5", **options)
    )
    runs: Counter[int] = Counter()
    answers: dict[str, Any] = {}

    def wire(n: int) -> dict[str, int]:
        runs[n] += 1
        return {"wired": n}

    tools = {
        who: lg.tool(effect=twiceshy.UNSAFE, name="wire", wait=30)(wire)
        for who, lg in (("a", slow), ("b", quick))
    }

    def call(who: str, n: int) -> None:
        try:
            with twiceshy.run("paused"):
                answers[who] = tools[who](n)
        except twiceshy.TwiceshyError as exc:
            answers[who] = exc

    try:
        store = slow.store
        assert isinstance(store, RedisClusterStore)
        n = 7
        rec = store.key_names("", twiceshy.idempotency_key("paused", "wire", {"n": n}))[0]
        old = primary_of(url, rec)
        new = replica_of(url, old)
        with node(old) as client:
            pid = int(client.info("server")["process_id"])
        os.kill(pid, signal.SIGSTOP)
        try:
            a = threading.Thread(target=call, args=("a", n))
            a.start()
            wait_until(lambda: _unread(old) > 0, 10, "A's claim queued on the paused primary")
            with node(new) as client:
                client.execute_command("CLUSTER FAILOVER", "TAKEOVER")
                wait_until(lambda: client.info("replication")["role"] == "master", 10, "it")
            b = threading.Thread(target=call, args=("b", n))
            b.start()
            with node(new) as client:
                wait_until(lambda: client.hget(rec, "state") is not None, 30, "B's claim")
            if options.get("wait_replicas") != "0":
                assert not runs  # the new primary has no replica yet: B's claim is not acked
        finally:
            os.kill(pid, signal.SIGCONT)
        a.join(60)
        b.join(60)
        assert not a.is_alive()
        assert not b.is_alive()
        return runs, answers
    finally:
        quick.close()
        slow.close()


def test_a_claim_queued_on_a_paused_primary_runs_nothing_twice(
    url: str, prefix: str, healed: None
) -> None:
    """A primary paused (a GC pause, a VM stall) while caller A's claim waits on it; its replica
    is promoted and caller B claims the intent there; the old primary wakes and runs A's claim
    on a record it no longer serves. With the default wait_replicas=1 neither claim counts until
    a replica has it: the old primary's is never acknowledged (it rejoins as a replica and is
    overwritten), B's is once it has, and the UNSAFE tool runs once; A replays B's result."""
    runs, answers = _paused_primary_takeover(url, prefix)
    assert runs == Counter({7: 1})
    assert answers == {"a": {"wired": 7}, "b": {"wired": 7}}


def test_with_wait_replicas_0_the_paused_primary_runs_it_twice(
    url: str, prefix: str, healed: None
) -> None:
    """The same steps with wait_replicas=0, what the docs say it accepts: the old primary
    acknowledges A's claim on waking, after B's ran the tool at the new one, so the tool runs
    twice and both callers answer "ok" (the re-enactment above is real)."""
    runs, answers = _paused_primary_takeover(url, prefix, wait_replicas="0")
    assert runs == Counter({7: 2})
    assert answers == {"a": {"wired": 7}, "b": {"wired": 7}}


def test_a_replay_waits_for_a_replica_of_the_outcome(url: str, prefix: str) -> None:
    """An outcome that no replica acknowledged (its replica stopped) is answered
    OutcomeNotRecorded to its owner; a retry that finds it on the primary, or a waiter that
    reads it, is not answered "ok" with it either (a failover now would lose it: a StoreError,
    nothing runs), and the retry replays it once the replica has it."""
    ledger = twiceshy.Ledger(
        ledger_url(url, prefix, wait_timeout="0.3", failover_wait="1"), counts_interval=None
    )
    runs: Counter[int] = Counter()
    store = ledger.store
    assert isinstance(store, RedisClusterStore)
    key = twiceshy.idempotency_key("replay", "charge", {"n": 3})
    rec = store.key_names("", key)[0]
    replica = replica_of(url, primary_of(url, rec))
    with node(replica) as client:
        pid = int(client.info("server")["process_id"])

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge", wait=5)
    def charge(n: int) -> int:
        runs[n] += 1
        os.kill(pid, signal.SIGSTOP)  # the replica stops before the outcome is written
        return 2 * n

    try:
        try:
            with twiceshy.run("replay"), pytest.raises(twiceshy.OutcomeNotRecorded):
                charge(3)
            with twiceshy.run("replay"), pytest.raises(StoreError, match="was found on the"):
                charge(3)
            with pytest.raises(StoreError, match="was found on the"):
                store.get("", key)  # as a waiter reads the outcome it waited for
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: whole(url), 30, "the replica in sync again")
        with twiceshy.run("replay"):
            assert charge(3) == 6
        assert runs == Counter({3: 1})
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


@pytest.mark.slow
def test_processes_racing_one_intent_run_it_once(url: str, prefix: str, tmp_path: Path) -> None:
    """G1/G8: 6 processes released together on intents of several slots: one execution each,
    one shared result."""
    processes, trials = 6, 4
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
    for trial in range(trials):
        winner = next(e["pid"] for e in seen if e["trial"] == trial)
        answers = [result for t, result in results if t == trial]
        assert answers == [{"trial": trial, "by": winner}] * processes


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
    url: str, prefix: str, tmp_path: Path
) -> None:
    """G2/G3/G6: three processes SIGKILLed right after the claim, after the effect, after
    recording: the first two are never run again (OutcomeUnknown once the lease lapsed), the
    third replays."""
    target, log = ledger_url(url, prefix), tmp_path / "effects.jsonl"
    moments = ("after-claim", "after-effect", "after-record")
    procs = [CTX.Process(target=_crasher, args=(target, log, when)) for when in moments]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 3
    ledger = twiceshy.Ledger(target, counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge", lease=0.5, wait=2)
    def charge(amount: int) -> str:
        record_effect(log, when=twiceshy.current_scope(), who="retry")
        return "ch_retry"

    try:
        time.sleep(0.6)  # past the crashed owners' leases, on the cluster's clocks
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


@pytest.mark.slow
def test_owner_paused_past_its_lease_cannot_record(url: str, prefix: str, tmp_path: Path) -> None:
    """G4: an owner stopped past its lease is fenced out and returns the new owner's result."""
    target, log = ledger_url(url, prefix), tmp_path / "effects.jsonl"
    started, out = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=_paused_owner, args=(target, log, started, out))
    proc.start()
    ledger = twiceshy.Ledger(target)
    try:
        assert started.wait(60)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.0)  # past the 0.5 s lease on the cluster's clock; no heartbeat while stopped

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


def test_connections_killed_between_claim_and_record(
    url: str, prefix: str, admin: RedisCluster, tmp_path: Path
) -> None:
    """G9: CLIENT KILL of the ledger's connections on every node inside the tool: one run, the
    result recorded, the retry replays."""
    name = f"twiceshy-g9-{secrets.token_hex(4)}"
    log = tmp_path / "effects.jsonl"
    ledger = twiceshy.Ledger(ledger_url(url, prefix, client_name=name), counts_interval=None)

    def kill_ours() -> int:
        killed = 0
        for address in addresses(admin):
            with node(address) as client:
                for c in client.client_list():
                    if c["name"] == name:
                        client.client_kill_filter(_id=c["id"])
                        killed += 1
        return killed

    try:

        @ledger.tool(effect=twiceshy.UNSAFE, name="charge")
        def charge(amount: int) -> dict[str, int]:
            record_effect(log, amount=amount)
            assert kill_ours() >= 1  # between the claim and the record
            return {"charged": amount}

        with twiceshy.run("g9"):
            assert charge(7) == charge(7) == {"charged": 7}
        assert effects(log) == [{"amount": 7}]
        record = ledger.store.get("", twiceshy.idempotency_key("g9", "charge", {"amount": 7}))
        assert record.record is not None
        assert record.record.state is State.SUCCEEDED
    finally:
        ledger.close()
