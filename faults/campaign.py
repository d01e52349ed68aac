"""A fault campaign against twiceshy's stores, run on demand.

    .venv/bin/python faults/campaign.py [--short] [--stores memory,sqlite,postgres,redis,...]
                                        [--seed N] [--keep]

The stores: memory, sqlite, postgres, pgbouncer, redis, redis-cluster, dynamodb (all by
default). For every store and fault it prints trials, calls checked, duplicate executions (the
provider double taking effect twice for one intent: an UNSAFE tool's effect run twice, or a
KEYED provider, which dedups by key, executing twice), lost outcomes (an acknowledged result
or claim that a later call does not find: another result replayed, or the tool run again),
hung calls (answered after the bound, or never) and wrong errors (an answer the protocol does
not allow in that state). It exits 1 when any of
those is seen, 2 when the campaign itself could not run.

The faults: racing processes at a barrier; SIGKILL of the process running a call at the
protocol's points (after the claim, inside the tool before and after its effect, after
recording) and at random instants, then a restart that retries; SIGSTOP past the lease, then
SIGCONT (with and without ``point_of_no_return()``, and with a reconciler; within and past
``release_grace``); restarts and kills of the campaign's own PostgreSQL, PgBouncer, Redis and
dynalite servers; failovers, a paused primary and killed primaries of its own Redis Cluster; a
loopback proxy that drops, stalls or resets the connection of a forwarded request; a full disk
and power cuts for SQLite, where the machine allows. Every server is the campaign's own, on free
loopback ports, stopped at the end. ``OutcomeUnknown`` is allowed only in rows that say why
(printed under the table). See faults/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from harness import STORE, Tally, verdict  # noqa: E402

import servers  # noqa: E402

CTX = mp.get_context("forkserver")
LEASE = 0.6  # short, so that lapses come quickly; the heartbeat renews it while a tool runs
WAIT = 4 * LEASE + 2  # a retry waits out a dead owner's lease instead of answering InProgress
HUNG = 30.0  # a call answered later than this is hung (every timeout of the stores is shorter)
CHILD_BOUND = 120.0  # a child process still running after this is killed, its calls hung
POINTS = ("after-claim", "before-effect", "after-effect", "after-record")
KINDS = ("UNSAFE", "KEYED")
CONTROL = "server kill -9, no AOF (control)"
CLUSTER_CONTROL = "paused primary, wait_replicas=0 (control)"
STORES = ("memory", "sqlite", "postgres", "pgbouncer", "redis", "redis-cluster", "dynamodb")
RELEASE_GRACE = 2 * LEASE  # twiceshy's default: twice the lease

# Why a row may answer OutcomeUnknown for an UNSAFE tool (every other row allows none).
OWNER_DIED = (
    "the owner was killed after its claim, with no outcome recorded: a retry cannot tell "
    "whether the effect ran"
)
OWNER_PAUSED = (
    "the owner stopped past its lease with no outcome recorded: the next caller marks the "
    "lapse unknown (a reconciler's DidNotHappen() is 'cannot tell' within release_grace)"
)
DISK_FULL = (
    "the disk filled between the claim and the outcome write: the tool ran, its outcome was "
    "not recorded, and a retry past the lease cannot tell"
)
POWER_CUT = (
    "every writer died at the cut, some after a claim and before their outcome: a retry "
    "cannot tell whether the effect ran"
)
WRITE_LOST = (
    "the server or connection went away between the claim and the outcome write: the tool "
    "ran, its outcome was not recorded, and a retry past the lease cannot tell"
)


@dataclass(frozen=True)
class Plan:
    """How many trials of each fault."""

    racers: int
    race_rounds: int
    kills: int
    pauses: int
    server: int
    proxy: int
    disk: int
    cuts: int
    failovers: int  # Redis Cluster failovers, paused primaries, killed primaries


SHORT = Plan(
    racers=4, race_rounds=6, kills=1, pauses=1, server=2, proxy=3, disk=2, cuts=2, failovers=1
)
FULL = Plan(
    racers=6, race_rounds=300, kills=25, pauses=10, server=25, proxy=30, disk=20, cuts=20,
    failovers=10,
)  # fmt: skip


class Child:
    """One child process running :func:`harness.child`, with its two pipes."""

    def __init__(self, spec: dict[str, Any], barrier: Any = None) -> None:
        rx, tx = CTX.Pipe(duplex=False)
        go_rx, self._go = CTX.Pipe(duplex=False)
        self.proc = CTX.Process(target=harness.child, args=(spec, tx, go_rx, barrier), daemon=True)
        self.proc.start()
        tx.close()  # the parent's copies: a dead child's pipe then reads as closed
        go_rx.close()
        self._rx = rx

    def expect(self, kind: str, timeout: float = 60) -> tuple[Any, ...] | None:
        """The next message of this kind, or None (the child died, or the time ran out)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                if not self._rx.poll(left):
                    return None
                message = self._rx.recv()
            except (EOFError, OSError):
                return None
            if message[0] == "failed":
                raise RuntimeError(f"a child could not open its ledger: {message[1]}")
            if message[0] == kind:
                return tuple(message)
        return None

    def go(self) -> None:
        """Let the child go on past where it waits."""
        with contextlib.suppress(OSError):
            self._go.send(("go",))

    def signal(self, sig: int) -> None:
        """Send a signal to the child (by its own pid)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid or 0, sig)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.proc.exitcode is None:
            self.signal(signal.SIGKILL)
        self.proc.join(10)
        self.close()

    def finish(self, timeout: float = CHILD_BOUND) -> bool:
        """Wait for the child to end; one still running then is killed (False)."""
        self.proc.join(timeout)
        ended = self.proc.exitcode is not None
        if not ended:
            self.signal(signal.SIGCONT)
            self.kill()
        self.close()
        return ended

    def close(self) -> None:
        """Close the parent's ends of the pipes."""
        self._rx.close()
        self._go.close()


class Trial:
    """One trial's events file and scope, and the specs of its children."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.scope = secrets.token_hex(6)
        self.log = str(store.work / f"{name}-{self.scope}.jsonl")
        self.name = name
        self.unanswered = 0

    def spec(self, phase: str, calls: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        """A child's spec on this trial's ledger and events file."""
        base = {"url": self.store.url, "log": self.log, "phase": phase, "lease": LEASE}
        return {**base, "wait": WAIT, "calls": calls, **more}

    def calls(self, count: int, kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
        """``count`` intents of this trial, the kinds taking turns."""
        return [{"scope": self.scope, "kind": kinds[n % len(kinds)], "n": n} for n in range(count)]

    def retry(self, calls: list[dict[str, Any]], times: int = 2, **more: Any) -> bool:
        """The restart: a fresh process retries every intent ``times`` times (phase "final")."""
        child = Child(self.spec("final", calls * times, **more))
        done = child.expect("done", CHILD_BOUND) is not None
        self.unanswered += not done
        return child.finish(10) and done

    def judge(self, hung: int = 0, **options: Any) -> Tally:
        """The verdict on this trial (plus calls that never answered)."""
        tally = verdict(
            self.log, hung_after=HUNG, trial=f"{self.store.name}/{self.name}", **options
        )
        tally.trials = 1
        hung += self.unanswered
        tally.hung += hung
        if tally.calls == 0:  # the trial itself went wrong: never a silent pass
            tally.wrong += 1
            tally.notes.append(f"{self.store.name}/{self.name}: no call answered")
        if hung:
            tally.notes.append(f"{self.store.name}/{self.name}: {hung} call(s) never answered")
        return tally


class Store:
    """A store under test: its name, URL, and the servers and proxies the faults use."""

    def __init__(self, name: str, url: str, work: Path, server: Any = None) -> None:
        self.name, self.url, self.work, self.server = name, url, work, server


# -- the faults ----------------------------------------------------------------------------------


def race(store: Store, plan: Plan, rng: random.Random) -> Tally:
    """Racing processes (threads, for memory) at a barrier, every round on new intents."""
    trial = Trial(store, "race")
    rounds = [
        [{"scope": f"{trial.scope}-{r}", "kind": kind, "n": r} for kind in KINDS]
        for r in range(plan.race_rounds)
    ]
    spec = trial.spec("race", [], rounds=rounds, lease=5.0, wait=60.0)
    hung = 0
    if store.name == "memory":
        spec["threads"] = plan.racers
        hung += not Child(spec).finish()
    else:
        barrier = CTX.Barrier(plan.racers)
        racers = [Child(spec, barrier) for _ in range(plan.racers)]
        # One bound for the whole race, which grows with its rounds (a slow server takes
        # seconds a round when every store runs at once: 300 rounds are not hung at 120 s).
        deadline = time.monotonic() + CHILD_BOUND + plan.race_rounds
        hung += sum(not racer.finish(max(1.0, deadline - time.monotonic())) for racer in racers)
        trial.retry([call for calls in rounds for call in calls], times=1, lease=5.0)
    tally = trial.judge(hung=hung)
    tally.trials = plan.race_rounds * len(KINDS)
    expected = tally.trials * (plan.racers + (store.name != "memory"))
    if tally.calls < expected:
        tally.hung += expected - tally.calls
        tally.notes.append(f"{store.name}/race: {expected - tally.calls} calls never answered")
    return tally


def kill(store: Store, plan: Plan, rng: random.Random, point: str) -> Tally:
    """SIGKILL the process running a call at ``point`` (or at a random instant), then retry."""
    total = Tally()
    for _ in range(plan.kills):
        for kind in KINDS:
            trial = Trial(store, f"kill-{point}")
            if point == "random":
                calls = trial.calls(6)
                child = Child(trial.spec("fault", calls, hold=True))
                child.expect("ready")
                child.go()
                time.sleep(rng.uniform(0, 0.12))
            else:
                calls = trial.calls(1, (kind,))
                child = Child(trial.spec("fault", calls, stops=[[0, point]]))
                if child.expect("at") is None:
                    total.wrong += 1
                    total.notes.append(f"{store.name}/kill-{point}: never reached {point}")
            child.kill()
            trial.retry(calls)
            # Killed after recording, an intent has its outcome: no doubt is left to answer.
            total.add(trial.judge(unknown=None if point == "after-record" else OWNER_DIED))
            if point == "random":
                break
    return total


def pause(store: Store, plan: Plan, rng: random.Random, variant: str, past: bool = False) -> Tally:
    """SIGSTOP the owner inside its tool past the lease; another caller comes; SIGCONT.

    ``ponr``: stopped before ``point_of_no_return()``, which must then refuse the effect;
    ``no-ponr``: stopped right before the effect, which it takes on resuming; ``reconcile``:
    as ``no-ponr``, and every caller has a reconciler that asks the provider double;
    ``ponr-reconcile``: as ``ponr``, with the reconciler. ``past``: the owner stays stopped
    past ``release_grace`` after the lapse was marked, and a third caller comes then: its
    reconciler's ``DidNotHappen()`` now releases the intent and it runs the tool, beside an
    owner that may still act (the documented limit of ``release_grace``; only
    ``point_of_no_return()`` stops the resumed owner).
    """
    total = Tally()
    ponr = variant in ("ponr", "ponr-reconcile")
    reconcile = variant in ("reconcile", "ponr-reconcile")
    for _ in range(plan.pauses):
        for kind in KINDS:
            trial = Trial(store, f"pause-{variant}{'-past' if past else ''}")
            calls = trial.calls(1, (kind,))
            more = {"ponr": ponr, "reconcile": reconcile}
            stop_at = "after-claim" if ponr else "before-effect"
            owner = Child(trial.spec("fault", calls, stops=[[0, stop_at]], **more))
            if owner.expect("at") is None:
                total.wrong += 1
                total.notes.append(f"{store.name}/pause-{variant}: the owner never got going")
            owner.signal(signal.SIGSTOP)
            try:
                time.sleep(LEASE * 1.6)
                hung: int = not Child(trial.spec("fault", calls, **more)).finish()
                if past:  # the lapse was marked by the caller above: wait out release_grace
                    time.sleep(RELEASE_GRACE + 0.3)
                    hung += not Child(trial.spec("fault", calls, **more)).finish()
            finally:
                owner.signal(signal.SIGCONT)
            owner.go()
            hung += not owner.finish()
            trial.retry(calls, **more)
            allows = frozenset({"FencedOut"})
            total.add(
                trial.judge(
                    hung=hung, fault_allows=allows, releases=reconcile, unknown=OWNER_PAUSED
                )
            )
    return total


def server_fault(
    store: Store, plan: Plan, rng: random.Random, action: str, target: Any = None
) -> Tally:
    """Restart (clean) or kill -9 a server (the store's own, or ``target``: the PostgreSQL
    behind a PgBouncer) while a process makes calls."""
    total = Tally()
    target = store.server if target is None else target
    for _ in range(plan.server):
        trial = Trial(store, f"server-{action}")
        calls = trial.calls(10)
        child = Child(trial.spec("fault", calls, hold=True, pause=0.03))
        child.expect("ready")
        child.go()
        time.sleep(rng.uniform(0, 0.3))
        getattr(target, action)(down=rng.uniform(0, 0.8))  # calls meanwhile fail
        hung: int = not child.finish()
        trial.retry(calls)
        total.add(trial.judge(hung=hung, fault_allows=frozenset({STORE}), unknown=WRITE_LOST))
    return total


def proxy_fault(store: Store, plan: Plan, rng: random.Random, mode: str) -> Tally:
    """Through a loopback proxy that loses (``drop``) or holds (``stall``) one reply."""
    total = Tally()
    proxy = servers.Proxy(store.server.port)
    # Past the URL's timeouts: Redis socket_timeout=1, DynamoDB read_timeout=2.
    stall = {"redis": 2.5, "dynamodb": 2.5}.get(store.name, 3.0)
    try:
        for _ in range(plan.proxy):
            trial = Trial(store, f"proxy-{mode}")
            calls = trial.calls(8)
            spec = trial.spec("fault", calls, hold=True)
            spec["url"] = proxy.url(store.url)
            child = Child(spec)
            child.expect("ready")
            fired = proxy.fired
            proxy.arm(mode, rng.randint(1, 14), stall)
            child.go()
            hung: int = not child.finish()
            proxy.disarm()
            trial.retry(calls)
            tally = trial.judge(hung=hung, fault_allows=frozenset({STORE}), unknown=WRITE_LOST)
            tally.trials = proxy.fired - fired  # an arm that found no request is no trial
            total.add(tally)
    finally:
        proxy.close()
    if mode == "reset" and not store.server.alive():
        raise RuntimeError(f"the {store.name} server died of a reset connection")
    return total


# -- a Redis Cluster of the campaign's own ------------------------------------------------------


def _until(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not happen within {timeout:g} s")


def _is_primary(cluster: servers.RedisCluster, port: int) -> bool:
    return bool(cluster.command(port, "ROLE", timeout=1.0)[0] == b"master")


def _cluster_fault(
    store: Store,
    plan: Plan,
    rng: random.Random,
    name: str,
    pause: float,
    fault: Callable[[servers.RedisCluster, int, int], None],
) -> Tally:
    """``plan.failovers`` trials: a process makes ten calls while ``fault(cluster, primary,
    replica)`` strikes a shard chosen at random; then a fresh process retries every intent."""
    total = Tally()
    cluster: servers.RedisCluster = store.server
    for _ in range(plan.failovers):
        cluster.wait_healthy()
        primary, replica = rng.choice(cluster.shards())
        trial = Trial(store, name)
        calls = trial.calls(10)
        child = Child(trial.spec("fault", calls, hold=True, pause=pause))
        child.expect("ready")
        child.go()
        time.sleep(rng.uniform(0, 0.3))
        fault(cluster, primary, replica)
        hung: int = not child.finish()
        cluster.wait_healthy()
        trial.retry(calls)
        total.add(trial.judge(hung=hung, fault_allows=frozenset({STORE}), unknown=WRITE_LOST))
    return total


def failover(store: Store, plan: Plan, rng: random.Random) -> Tally:
    """A manual failover (``CLUSTER FAILOVER`` on a replica) while a process makes calls."""

    def promote(cluster: servers.RedisCluster, _: int, replica: int) -> None:
        cluster.command(replica, "CLUSTER", "FAILOVER")
        _until(f"replica {replica} promoted", partial(_is_primary, cluster, replica))

    return _cluster_fault(store, plan, rng, "failover", 0.05, promote)


def primary_killed(store: Store, plan: Plan, rng: random.Random) -> Tally:
    """SIGKILL a primary while a process makes calls; up to 3 s later (its replica may have
    been promoted meanwhile: cluster-node-timeout is 1 s) start it again from its AOF."""

    def kill(cluster: servers.RedisCluster, primary: int, _: int) -> None:
        cluster.kill_node(primary)
        time.sleep(rng.uniform(0, 3.0))
        cluster.start_node(primary)

    return _cluster_fault(store, plan, rng, "primary-killed", 0.1, kill)


def paused_primary(store: Store, plan: Plan, rng: random.Random) -> Tally:
    """A claim queued on a paused primary, its replica promoted, a second caller, the old
    primary resumed.

    The primary serving the intent's record is stopped (SIGSTOP: a GC pause, a VM stall), the
    owner's call sends its claim there and waits (its socket_timeout is 10 s); the replica is
    promoted (``CLUSTER FAILOVER TAKEOVER``); a second caller, whose ledger does not know the
    stopped node, claims the intent at the new primary; then the old primary resumes, runs the
    queued claim on its stale data (no record: "won"), and learns it was replaced. With
    ``wait_replicas=1`` the claim's ``WAIT`` finds no replica and the owner is not told it won
    (nor is the second caller, until the new primary has a replica again); with 0 the tool runs
    twice (the control row).
    """
    import twiceshy

    total = Tally()
    cluster: servers.RedisCluster = store.server
    namer = twiceshy.Ledger(store.url, counts_interval=None)  # only for the records' names
    try:
        for _ in range(plan.failovers):
            for kind in KINDS:
                cluster.wait_healthy()
                trial = Trial(store, "paused-primary")
                calls = trial.calls(1, (kind,))
                args = {"n": 0, "scope": trial.scope, "kind": kind}  # the tool's arguments
                key = twiceshy.idempotency_key(trial.scope, f"charge_{kind.lower()}", args)
                record = namer.store.key_names("", key)[0]  # type: ignore[attr-defined]
                primary = _primary_of(cluster, record)
                replica = dict(cluster.shards())[primary]
                owner_url = _with(store.url, socket_timeout="10")
                owner = Child(trial.spec("fault", calls, hold=True, url=owner_url, lease=5.0))
                owner.expect("ready")
                cluster.pause(primary)
                try:
                    owner.go()
                    _until("the owner's claim queued", partial(_unread, primary), 10)
                    cluster.command(replica, "CLUSTER", "FAILOVER", "TAKEOVER")
                    others = [p for p in cluster.ports if p != primary]
                    _until("the promotion seen", partial(_seen, cluster, others, replica))
                    seeds = ",".join(f"127.0.0.1:{p}" for p in others)
                    quick = {"socket_timeout": "1", "wait_timeout": "0.5", "failover_wait": "0"}
                    url = _with(f"redis+cluster://{seeds}?{urlsplit(store.url).query}", **quick)
                    second = Child(trial.spec("fault", calls, url=url, lease=5.0))
                    hung: int = not second.finish()
                finally:
                    cluster.resume(primary)
                hung += not owner.finish()
                cluster.wait_healthy()
                trial.retry(calls)
                tally = trial.judge(hung=hung, fault_allows=frozenset({STORE}), unknown=WRITE_LOST)
                starts = [e for e in harness.events(trial.log) if e["ev"] == "start"]
                if any(e["key"] != key for e in starts):
                    tally.wrong += 1  # the record paused above was not the intent's
                    tally.notes.append(f"{store.name}/paused-primary: the intent's key differs")
                total.add(tally)
    finally:
        namer.close()
    return total


def _primary_of(cluster: servers.RedisCluster, name: str, asked: int = 0) -> int:
    """The port of the primary serving the slot of the Redis key ``name`` (as node ``asked``,
    or the first node, sees it)."""
    asked = asked or cluster.ports[0]
    slot = int(cluster.command(asked, "CLUSTER", "KEYSLOT", name))
    for first, last, primary, *_ in cluster.command(asked, "CLUSTER", "SLOTS"):
        if int(first) <= slot <= int(last):
            return int(primary[1])
    raise RuntimeError(f"no primary serves slot {slot}")


def _unread(port: int) -> bool:
    """Whether bytes sent to the node on ``port`` wait unread (a stopped node's queue)."""
    lines = servers.sh("ss", "-tnH", "state", "established", f"( sport = :{port} )")
    return any(int(line.split()[0]) > 0 for line in lines.splitlines() if line.strip())


def _with(url: str, **params: str) -> str:
    """``url`` with these query parameters set."""
    parts = urlsplit(url)
    query = {**dict(parse_qsl(parts.query)), **params}
    return urlunsplit(parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())))


def _quiet(log: str, still: float = 0.4, bound: float = 5.0) -> None:
    """Wait until the events file has not grown for ``still`` s (at most ``bound`` s)."""
    deadline = time.monotonic() + bound
    size, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = os.path.getsize(log) if os.path.exists(log) else 0
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= still:
            return
        time.sleep(0.05)


def _seen(cluster: servers.RedisCluster, asking: list[int], port: int) -> bool:
    """Whether every node of ``asking`` lists node ``port`` as a primary."""
    return all(_sees_primary(cluster, asked, port) for asked in asking)


def _sees_primary(cluster: servers.RedisCluster, asked: int, port: int) -> bool:
    """Whether node ``asked`` lists node ``port`` as a primary."""
    text = cluster.command(asked, "CLUSTER", "NODES", timeout=1.0)
    for line in servers._nodes_text(text).splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1].split("@")[0].endswith(f":{port}"):
            return "master" in fields[2]
    return False


# -- disks (SQLite, root only) ---------------------------------------------------------------------


def _sh(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(args, check=True, timeout=timeout, capture_output=True, text=True)
    return done.stdout.strip()


def disk_full(store: Store, plan: Plan, rng: random.Random) -> Tally:
    """A full disk: the ledger on a small tmpfs, filled up while a process makes calls."""
    total = Tally()
    mount = store.work / "full"
    mount.mkdir()
    _sh("mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount))
    try:
        for t in range(plan.disk):
            here = mount / f"t{t}"
            here.mkdir()
            trial = Trial(store, "disk-full")
            trial.store = Store("sqlite", f"sqlite:///{here / 'ledger.db'}", store.work)
            calls = trial.calls(40)
            child = Child(trial.spec("fault", calls, hold=True, result_bytes=4096))
            child.expect("ready")
            filler = mount / "filler"
            with open(filler, "wb") as f, contextlib.suppress(OSError):
                for _ in range(10_000):
                    f.write(b"\0" * 65536)
                    f.flush()
            size = filler.stat().st_size
            os.truncate(filler, max(0, size - rng.randint(0, 160_000)))
            child.go()
            hung: int = not child.finish()
            filler.unlink()
            trial.retry(calls)
            tally = trial.judge(hung=hung, fault_allows=frozenset({STORE}), unknown=DISK_FULL)
            total.add(tally)
            shutil.rmtree(here)
    finally:
        _sh("umount", str(mount))
    return total


def power_cut(store: Store, plan: Plan, rng: random.Random, query: str = "") -> Tally:
    """Power cuts: the ledger on ext4 on a loop device; at the cut every writer is SIGKILLed
    and the loop device's backing image is copied as it is (what reached the device); the copy
    is then mounted (ext4 replays its journal) and every intent retried on it.

    Mounted with ``commit=60`` so that no periodic journal commit runs while the image is copied.
    """
    total = Tally()
    for t in range(plan.cuts):
        with contextlib.ExitStack() as undo:
            tally = _one_cut(store, rng, query, store.work / f"cut{t}", undo)
        tally.notes = [f"{note} (cut {t})" for note in tally.notes]
        total.add(tally)
    return total


def _one_cut(
    store: Store, rng: random.Random, query: str, here: Path, undo: contextlib.ExitStack
) -> Tally:
    image, cut, live, after = here / "ext4.img", here / "cut.img", here / "live", here / "after"
    live.mkdir(parents=True)
    after.mkdir()
    undo.callback(shutil.rmtree, here, True)
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    _sh("mkfs.ext4", "-q", "-F", str(image))
    loop = _sh("losetup", "-f", "--show", str(image))
    undo.callback(_sh, "losetup", "-d", loop)
    _sh("mount", "-o", "commit=60", loop, str(live))
    mounted = undo.enter_context(contextlib.ExitStack())
    mounted.callback(_sh, "umount", str(live))
    trial = Trial(store, f"power-cut{query}")
    trial.store = Store("sqlite", f"sqlite:///{live / 'ledger.db'}{query}", store.work)
    writers = []
    for w in range(2):
        # Calls come with pauses, as an agent's do: the cut mostly finds a ledger at rest.
        scope = f"{trial.scope}w{w}"
        spec = trial.spec("race", [], hold=True, forever=20.0, scope=scope, pause=0.02)
        writers.append(Child(spec))
    for writer in writers:
        writer.expect("ready")
    for writer in writers:
        writer.go()
    time.sleep(rng.uniform(0.3, 1.2))
    for writer in writers:
        writer.signal(signal.SIGKILL)  # the cut: every writer at once
    for writer in writers:
        writer.kill()
    time.sleep(0.05)  # I/O already submitted completes, as on a device that had taken it
    shutil.copyfile(image, cut)
    mounted.close()
    loop2 = _sh("losetup", "-f", "--show", str(cut))
    undo.callback(_sh, "losetup", "-d", loop2)
    _sh("mount", loop2, str(after))
    undo.callback(_sh, "umount", str(after))
    seen = {e["intent"] for e in harness.events(trial.log) if "intent" in e}
    calls = []
    for intent in sorted(seen):
        scope, kind, n = intent.split("/")
        calls.append({"scope": scope, "kind": kind, "n": int(n)})
    trial.store = Store("sqlite", f"sqlite:///{after / 'ledger.db'}{query}", store.work)
    trial.retry(calls, times=1)
    return trial.judge(unknown=POWER_CUT)


def disk_support(work: Path) -> tuple[str | None, str | None]:
    """Why the disk faults cannot run here (None where they can): (full disk, power cut)."""
    if os.getuid() != 0:
        why = "not running as root (mounting a tmpfs and loop devices needs it)"
        return why, why
    full = None
    probe = work / "probe"
    probe.mkdir()
    try:
        _sh("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
        _sh("umount", str(probe))
    except (subprocess.SubprocessError, OSError) as exc:
        full = f"cannot mount a tmpfs ({exc})"
    cut = None
    for tool in ("losetup", "mkfs.ext4", "mount"):
        if shutil.which(tool) is None:
            cut = f"{tool} is not installed"
    if cut is None:
        try:
            image = work / "probe.img"
            with open(image, "wb") as f:
                f.truncate(8 << 20)
            _sh("mkfs.ext4", "-q", "-F", str(image))
            loop = _sh("losetup", "-f", "--show", str(image))
            try:
                _sh("mount", loop, str(probe))
                _sh("umount", str(probe))
            finally:
                _sh("losetup", "-d", loop)
            image.unlink()
        except (subprocess.SubprocessError, OSError) as exc:
            cut = f"cannot mount ext4 on a loop device ({exc})"
    probe.rmdir()
    return full, cut


def device_mapper() -> str:
    """What the kernel offers for dm-flakey / dm-log-writes (said beside the power cut rows).

    Read from sysfs: ``dmsetup`` itself would create /dev/mapper/control as a side effect.
    """
    if not Path("/sys/class/misc/device-mapper").exists():
        modules = Path("/lib/modules") / os.uname().release
        loadable = "" if modules.exists() else f", and no modules to load ({modules} is missing)"
        return (
            f"the kernel has no device-mapper (/sys/class/misc/device-mapper is missing{loadable})"
        )
    targets = Path("/proc/device-mapper-targets")  # not a real file on every kernel
    return "device-mapper is there" + (f": {targets.read_text()}" if targets.exists() else "")


def eio_support() -> str:
    """Why the campaign has no EIO fault here."""
    offered = [
        name
        for name, path in (
            ("device-mapper", "/sys/class/misc/device-mapper"),
            ("fail_make_request", "/sys/block/loop0/make-it-fail"),
        )
        if Path(path).exists()
    ]
    if offered:
        return f"the kernel offers {' and '.join(offered)}, which the campaign does not use yet"
    return (
        "this kernel has neither device-mapper (dm-error, dm-flakey) nor fail_make_request, and "
        "a loop device set read-only still takes writes (the kernel only warns)"
    )


# -- running it --------------------------------------------------------------------------------


Fault = tuple[str, Callable[[], Tally]]


def faults_of(store: Store, plan: Plan, rng: random.Random, disks: tuple[str | None, ...]) -> list:  # type: ignore[type-arg]
    """The faults that apply to a store, each as (name, run), and skip lines."""
    out: list[Fault] = []
    skips: list[str] = []

    def add(name: str, fn: Callable[..., Tally], *args: Any) -> None:
        out.append((name, lambda: fn(store, plan, rng, *args)))

    racers = f"{plan.racers} {'threads' if store.name == 'memory' else 'processes'}"
    add(f"race ({racers})", race)
    if store.name == "memory":
        skips.append(
            "memory: kill, pause, server and disk faults do not apply: the ledger lives "
            "and dies with its one process"
        )
        return [out, skips]
    for point in (*POINTS, "random"):
        add(f"kill -9 {point}", kill, point)
    for variant in ("ponr", "no-ponr", "reconcile"):
        add(f"SIGSTOP past lease, {variant}", pause, variant)
    add("SIGSTOP past release_grace, ponr+reconcile", pause, "ponr-reconcile", True)
    # Past release_grace a reconciler's DidNotHappen() releases the intent beside an owner
    # that may still act: the documented limit, measured here, not counted.
    add("SIGSTOP past release_grace, reconcile (measured)", pause, "reconcile", True)
    if store.name in ("postgres", "redis"):
        add("server restart", server_fault, "restart")
        add("server kill -9", server_fault, "kill")
        add("proxy drops reply", proxy_fault, "drop")
        add("proxy stalls reply", proxy_fault, "stall")
    if store.name == "pgbouncer":
        add("PgBouncer kill -9", server_fault, "kill")
        add("PgBouncer restart", server_fault, "restart")
        add("its PostgreSQL restart", server_fault, "restart", store.server.postgres)
    if store.name == "dynamodb":
        add("proxy drops reply", proxy_fault, "drop")
        add("proxy stalls reply", proxy_fault, "stall")
        add("proxy resets connections", proxy_fault, "reset")
        # dynalite keeps its tables in memory: a restart loses acknowledged outcomes.
        add("server kill -9, in memory (control)", server_fault, "kill")
    if store.name == "redis-cluster":
        add("manual failover", failover)
        add("paused primary, claim queued, takeover", paused_primary)
        add("primary kill -9, restart from AOF", primary_killed)
        skips.append(
            "redis-cluster: no proxy rows: a cluster client follows the nodes' own addresses "
            "(MOVED, CLUSTER SLOTS), so a proxy in front of one node sees little of its traffic"
        )
    if store.name == "sqlite":
        full, cut = disks
        if full is None:
            add("disk full (tmpfs)", disk_full)
        else:
            skips.append(f"sqlite: disk full skipped: {full}")
        if cut is None:
            add("power cut (default URL)", power_cut)
            if plan is FULL:  # the old default, which loses the last commit: the cut bites
                add("power cut, synchronous=FULL (control)", power_cut, "?synchronous=FULL")
        else:
            skips.append(f"sqlite: power cut skipped: {cut}")
        skips.append(f"sqlite: a failing disk (EIO) is not tried: {eio_support()}")
        skips.append(
            f"sqlite: power cuts copy the loop device's image at the cut: {device_mapper()}, so "
            "dm-flakey / dm-log-writes cannot be used; writes the device had accepted survive "
            "the cut (no volatile device cache is modelled)"
        )
    return [out, skips]


def run_store(store: Store, faults: list[Fault], results: dict[tuple[str, str], Tally]) -> None:
    """Run a store's faults one after another, recording each tally (or the error that ended it)."""
    for name, fn in faults:
        started = time.monotonic()
        try:
            tally = fn()
        except Exception as exc:  # the campaign's own trouble: reported, and the exit code says so
            tally = Tally(notes=[f"{store.name}/{name}: the campaign failed: {exc!r}"])
            tally.wrong = -1
        tally.seconds = time.monotonic() - started
        results[(store.name, name)] = tally
        print(f"  done: {store.name:13} {name:50} {tally.seconds:6.1f} s", file=sys.stderr)


@contextlib.contextmanager
def own_servers(names: list[str], work: Path) -> Iterator[dict[str, Any]]:
    """Start the campaign's own servers, and always stop them."""
    started: dict[str, Any] = {}
    later: list[Any] = []  # started after the others (PgBouncer, after its PostgreSQL)
    try:
        if "postgres" in names:
            started["postgres"] = servers.PostgresServer(work)
        if "pgbouncer" in names:
            behind = servers.PostgresServer(work, "server-postgres-pgbouncer")
            started["pgbouncer-postgres"] = behind
            started["pgbouncer"] = servers.PgBouncerServer(work, behind)
            later.append(started["pgbouncer"])
        if "redis" in names:
            started["redis"] = servers.RedisServer(work, appendonly=True)
            started["redis-noaof"] = servers.RedisServer(work, appendonly=False)
        if "redis-cluster" in names:
            started["redis-cluster"] = servers.RedisCluster(work)
        if "dynamodb" in names:
            started["dynamodb"] = servers.DynaliteServer(work)
        with ThreadPoolExecutor() as pool:  # initdb takes seconds: start them side by side
            first = [s for s in started.values() if s not in later]
            for future in [pool.submit(server.start) for server in first]:
                future.result(180)
            for future in [pool.submit(server.start) for server in later]:
                future.result(60)
        yield started
    finally:
        for server in started.values():
            with contextlib.suppress(Exception):
                server.stop()


def store_url(name: str, work: Path, own: dict[str, Any]) -> str:
    """The ledger URL the campaign gives a store."""
    if name == "memory":
        return "memory://"
    if name == "sqlite":
        return f"sqlite:///{work / name / 'ledger.db'}"
    if name == "postgres":
        return f"{own['postgres'].url}?connect_timeout=2"
    if name == "pgbouncer":
        return f"{own['pgbouncer'].url}?connect_timeout=2&wakeups=poll"
    if name == "redis":
        return f"{own['redis'].url}?socket_timeout=1"
    if name == "redis-cluster":
        # wait_replicas=1 is to become the default of redis+cluster://; said here all the same.
        return f"{own['redis-cluster'].url}?wait_replicas=1&socket_timeout=2&failover_wait=3"
    return (  # dynamodb; read_timeout=2: a stalled reply (2.5 s) is given up and retried
        f"dynamodb://twiceshy_faults?endpoint_url={own['dynamodb'].endpoint}&region=us-east-1"
        "&aws_access_key_id=faults&aws_secret_access_key=faults"
        "&read_timeout=2&connect_timeout=2"
    )


def counted(fault: str) -> bool:
    """Whether a row counts in the exit code (controls and measured limits do not)."""
    return not fault.endswith(("(control)", "(measured)"))


def table(results: dict[tuple[str, str], Tally], order: list[str]) -> str:
    """The campaign's table."""
    head = f"{'store':14}{'fault':50}{'trials':>7}{'calls':>7}{'dup':>5}{'lost':>6}{'hung':>6}"
    lines = [head + f"{'wrong':>7}{'unk':>6}{'secs':>7}", "-" * (len(head) + 20)]
    for store in order:
        for (name, fault), t in results.items():
            if name == store:
                wrong = "ERROR" if t.wrong < 0 else str(t.wrong)
                counts = f"{t.trials:>7}{t.calls:>7}{t.duplicates:>5}{t.lost:>6}{t.hung:>6}"
                unk = str(t.unknowns) if t.allowance else "-"
                lines.append(f"{name:14}{fault:50}{counts}{wrong:>7}{unk:>6}{t.seconds:>7.1f}")
    return "\n".join(lines)


def allowances(results: dict[tuple[str, str], Tally]) -> list[str]:
    """Which rows allowed OutcomeUnknown, and why (the other rows counted it as wrong)."""
    by_reason: dict[str, list[str]] = {}
    for (name, fault), t in results.items():
        if t.allowance:
            by_reason.setdefault(t.allowance, []).append(f"{name}/{fault}")
    return [
        f"OutcomeUnknown allowed ('unk') where {reason}: {len(rows)} rows ({', '.join(rows[:4])}"
        + (", ...)" if len(rows) > 4 else ")")
        for reason, rows in by_reason.items()
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; 0 when nothing the protocol forbids was seen."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a few trials per fault (for CI)")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--seed", type=int, default=None, help="the random seed (default: new)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--only", default="", help="run only the faults whose name holds this text (e.g. primary)"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.stores.split(",") if n.strip()]
    unknown = set(names) - set(STORES)
    if unknown:
        parser.error(f"unknown stores {sorted(unknown)}: choose from {','.join(STORES)}")
    seed = args.seed if args.seed is not None else secrets.randbelow(1 << 30)
    plan = SHORT if args.short else FULL
    print(f"fault campaign: {'short' if args.short else 'full'}, seed {seed}", file=sys.stderr)
    CTX.set_forkserver_preload(
        ["harness", "twiceshy.stores.postgres", "twiceshy.stores.redis", "twiceshy.stores.dynamodb"]
    )
    work = Path(tempfile.mkdtemp(prefix="twiceshy-faults-"))
    os.chmod(work, 0o755)  # the PostgreSQL clusters below run as their own user
    blind = harness.self_check(work)
    if blind:
        shutil.rmtree(work, ignore_errors=True)
        print(f"the campaign's checks pass what they must fail: {blind}", file=sys.stderr)
        return 2
    started = time.monotonic()
    results: dict[tuple[str, str], Tally] = {}
    skips: list[str] = []
    try:
        disks = disk_support(work) if "sqlite" in names else (None, None)
        with own_servers(names, work) as own:
            stores = []
            for name in names:
                (work / name).mkdir()
                stores.append(Store(name, store_url(name, work, own), work / name, own.get(name)))
            threads = []
            for i, store in enumerate(stores):
                rng = random.Random(seed + i)
                faults, why = faults_of(store, plan, rng, disks)
                skips += why
                if store.name == "redis":
                    noaof = own["redis-noaof"]
                    control = Store("redis", f"{noaof.url}?socket_timeout=1", store.work, noaof)
                    faults.append((CONTROL, partial(server_fault, control, plan, rng, "kill")))
                if store.name == "redis-cluster":
                    url = _with(store.url, wait_replicas="0")
                    control = Store(store.name, url, store.work, store.server)
                    faults.append((CLUSTER_CONTROL, partial(paused_primary, control, plan, rng)))
                faults = [fault for fault in faults if args.only in fault[0]]
                thread = threading.Thread(target=run_store, args=(store, faults, results))
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results, names))
    for line in skips:
        print(f"skipped: {line}")
    for line in allowances(results):
        print(line)
    seen = results.get(("redis", CONTROL))
    if seen is not None:
        print(
            "control: Redis without persistence loses acknowledged claims when killed, as the "
            f"README says ({seen.lost} lost): the campaign sees a loss where one happens"
        )
    seen = results.get(("redis-cluster", CLUSTER_CONTROL))
    if seen is not None:
        print(
            "control: a Redis Cluster with wait_replicas=0 lets a paused primary's queued claim "
            f"win after its replacement did ({seen.duplicates} duplicates in {seen.trials} "
            "trials)"
        )
    seen = results.get(("dynamodb", "server kill -9, in memory (control)"))
    if seen is not None:
        print(
            "control: dynalite keeps nothing on disk; killed, it loses every acknowledged "
            f"outcome ({seen.lost} lost, {seen.duplicates} duplicates)"
        )
    measured = [(n, t) for (n, f), t in results.items() if f.endswith("(measured)")]
    if measured:
        dups = sum(t.duplicates for _, t in measured)
        trials = sum(t.trials for _, t in measured)
        print(
            "measured: an UNSAFE owner stopped past release_grace, without point_of_no_return(),"
            f" runs beside the caller its reconciler released: {dups} duplicates in {trials} "
            "trials (the documented limit of release_grace)"
        )
    failed = False
    for (_, fault), tally in results.items():
        if not counted(fault):
            continue
        if tally.failed:
            failed = True
            for note in tally.notes:
                print(f"FOUND {note}")
    verdict_line = "FAILURES SEEN" if failed else "nothing the protocol forbids was seen"
    print(f"seed {seed}; {time.monotonic() - started:.0f} s; {verdict_line}")
    if any(t.wrong < 0 for t in results.values()):
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
