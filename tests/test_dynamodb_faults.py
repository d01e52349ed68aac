"""The guarantees on a DynamoDB ledger, under faults, against a real DynamoDB-protocol server
(dynalite): racing processes, kill -9 after the claim, after the effect and after recording, an
owner stopped past its lease, answers lost and connections cut around a write, a server gone.

Effects are counted in a file each process appends to (one line per effect), so a process killed
with SIGKILL cannot hide one. Every test works under a key prefix of its own in the shared test
table; proxies listen on 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import servers
import twiceshy
from fake_clock import FakeClock
from twiceshy import Change, Effect, State
from twiceshy.stores.dynamodb import DynamoDBStore

pytestmark = [pytest.mark.dynamodb, pytest.mark.slow]

CTX = mp.get_context("spawn")
NS = "tenant"
CLAIMED = frozenset({State.CLAIMED})


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own in the shared table; its items are deleted afterwards."""
    with servers.dynamodb_prefix() as name:
        yield name


def effects(path: Path) -> list[dict[str, Any]]:
    """The effects tools recorded, one JSON object a line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def record_effect(path: Path, **fields: Any) -> None:
    """Append one effect; O_APPEND writes of one line are atomic between processes."""
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of the test server, to lose answers and cut connections.

    ``cut_reply()`` arms it to swallow the next answer the server sends and close that
    connection, as a network failure after the server applied a request would: the client sees
    a dropped connection and cannot know whether its request took effect. ``drop_all()`` closes
    every open connection; ``close()`` stops it, so nothing answers any more.
    """

    def __init__(self, on_cut: Callable[[], None] = lambda: None) -> None:
        parts = urlsplit(servers.DYNAMODB_URL)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.on_cut = on_cut  # run once an answer is swallowed, before its connection closes
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cuts = 0
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def cut_reply(self) -> None:
        """Swallow the next answer from the server and close its connection."""
        self._armed.set()

    def drop_all(self) -> int:
        """Close every connection open now (new ones are made as usual); how many there were."""
        with self._lock:
            dropped, self._open = self._open, set()
        for sock in dropped:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return len(dropped)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=5)
            pump = threading.Thread(target=self._pump, args=(client, server), daemon=True)
            self._threads.append(pump)
            pump.start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        with self._lock:
            self._open.add(client)
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.05)
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
            with self._lock:
                self._open.discard(client)
            client.close()
            server.close()

    def close(self) -> None:
        """Stop every thread and close every socket: the endpoint answers no more."""
        self._stop.set()
        self.listener.close()
        for thread in self._threads:
            thread.join(5)


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    """A proxy of this test's own, stopped afterwards."""
    servers.require("dynamodb")
    made = Proxy()
    yield made
    made.close()


def through(proxy: Proxy, prefix: str, **options: Any) -> DynamoDBStore:
    """A store of the shared table under ``prefix``, whose requests pass through ``proxy``."""
    settings = {**servers.DYNAMODB_OPTIONS, "prefix": prefix, **options}
    return DynamoDBStore(servers.DYNAMODB_TABLE, endpoint_url=proxy.url, **settings)


# -- G9: answers lost and connections cut ------------------------------------------------------


def test_lost_answers_are_recognised_not_applied_twice(proxy: Proxy, prefix: str) -> None:
    """G9: a claim, a takeover, an in-place attempt and an outcome whose answers are lost are
    sent again (by the SDK) and recognised: each applied once."""
    clock = FakeClock()
    store = through(proxy, prefix, clock=clock)
    try:
        proxy.cut_reply()
        first = store.claim(
            NS, "k", fingerprint="fp", tool="t", effect=Effect.KEYED, owner="alice", lease=5
        )
        assert proxy.cuts == 1
        assert first.won
        assert first.record is not None
        assert (first.record.fence, first.record.owner) == (1, "alice")
        clock.advance(6)  # the lease lapses; bob takes over, and that answer is lost too
        proxy.cut_reply()
        takeover = Change(1, CLAIMED, State.CLAIMED, lapsed=True, new_owner="bob", lease=30)
        snap = store.write(NS, "k", takeover)
        assert proxy.cuts == 2
        assert snap.won
        assert snap.record is not None
        assert (snap.record.fence, snap.record.owner, snap.record.attempts) == (2, "bob", 2)
        proxy.cut_reply()
        again = Change(2, CLAIMED, State.CLAIMED, owner="bob", count_attempt=True)
        counted = store.write(NS, "k", again)
        assert proxy.cuts == 3
        assert counted.won
        assert counted.record is not None
        assert counted.record.attempts == 3  # not 4: the second sending applied nothing
        proxy.cut_reply()
        done = store.write(NS, "k", Change(2, CLAIMED, State.SUCCEEDED, owner="bob", result="1"))
        assert proxy.cuts == 4
        assert done.won
        assert done.record is not None
        assert (done.record.state, done.record.fence, done.record.attempts) == (
            State.SUCCEEDED,
            2,
            3,
        )
    finally:
        store.close()


def test_a_write_sent_again_past_its_ttl_recognises_itself(proxy: Proxy, prefix: str) -> None:
    """G10: an outcome whose answer is lost, sent again once its short ttl has passed, answers
    won with what it wrote (the write stands), not "no record"; readers then see none."""
    clock = FakeClock()
    proxy.on_cut = lambda: clock.advance(10)
    store = through(proxy, prefix, clock=clock)
    try:
        assert store.claim(
            NS, "k", fingerprint="fp", tool="t", effect=Effect.UNSAFE, owner="alice", lease=30
        ).won
        proxy.cut_reply()
        change = Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result='"once"', ttl=1.0)
        snap = store.write(NS, "k", change)
        assert proxy.cuts == 1
        assert snap.won
        assert snap.record is not None
        assert (snap.record.state, snap.record.result) == (State.SUCCEEDED, '"once"')
        assert store.get(NS, "k").record is None
    finally:
        store.close()


def test_a_lost_final_answer_retried_past_the_ttl_replays_the_owners_value(
    proxy: Proxy, prefix: str
) -> None:
    """G9/G10: the outcome's answer is lost and its second sending comes after the ttl: the
    owner returns its own value and the tool ran once (an expired record taken for a write that
    never happened would claim the key afresh and run it again)."""
    clock = FakeClock()
    proxy.on_cut = lambda: clock.advance(10)
    ledger = twiceshy.Ledger(store=through(proxy, prefix, clock=clock), counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, ttl=1.0)
    def charge(amount: int) -> str:
        runs.append(amount)
        if len(runs) == 1:
            proxy.cut_reply()  # the next answer is the outcome's
        return "charged"

    try:
        with twiceshy.run("run-1"):
            assert charge(5) == "charged"
        assert proxy.cuts == 1
        assert runs == [5]
    finally:
        ledger.close()


def test_connections_cut_between_claim_and_record(
    proxy: Proxy, prefix: str, tmp_path: Path
) -> None:
    """G9: every connection of the ledger cut inside the tool: one run, the outcome recorded."""
    log = tmp_path / "effects.jsonl"
    url = servers.dynamodb_url(prefix=prefix, endpoint_url=proxy.url)
    ledger = twiceshy.Ledger(url, counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge")
    def charge(amount: int) -> dict[str, int]:
        record_effect(log, amount=amount)
        assert proxy.drop_all() >= 1  # between the claim and the record
        return {"charged": amount}

    try:
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


def test_a_ledger_whose_server_went_away_never_runs_the_tool(proxy: Proxy, prefix: str) -> None:
    """The endpoint stops answering: the call raises StoreUnavailable, the tool never runs."""
    url = servers.dynamodb_url(
        prefix=prefix, endpoint_url=proxy.url, max_attempts="2", connect_timeout="1"
    )
    ledger = twiceshy.Ledger(url, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(amount: int) -> str:
        runs.append(amount)
        return "charged"

    try:
        proxy.close()
        started = time.monotonic()
        with twiceshy.run("down"), pytest.raises(twiceshy.StoreUnavailable, match="endpoint_url"):
            charge(5)
        assert time.monotonic() - started < 10
        assert runs == []
    finally:
        ledger.close()


# -- G1 / G8: processes racing one intent ------------------------------------------------------

PROCESSES = 8
TRIALS = 4


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


def test_processes_racing_one_intent_run_it_once(prefix: str, tmp_path: Path) -> None:
    """G1/G8: 8 processes released together, 4 trials: one execution, one shared result."""
    log = tmp_path / "effects.jsonl"
    barrier = CTX.Barrier(PROCESSES)
    out = CTX.Queue()
    url = servers.dynamodb_url(prefix=prefix)
    procs = [
        CTX.Process(target=_racer, args=(url, log, barrier, out, TRIALS)) for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    results: list[Any] = []
    deadline = time.monotonic() + 180
    try:
        while len(results) < PROCESSES * TRIALS:
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
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    seen = effects(log)
    assert sorted(e["trial"] for e in seen) == list(range(TRIALS))
    by_trial: dict[int, list[Any]] = {}
    for trial, result in results:
        by_trial.setdefault(trial, []).append(result)
    for trial, answers in by_trial.items():
        winner = next(e["pid"] for e in seen if e["trial"] == trial)
        assert answers == [{"trial": trial, "by": winner}] * PROCESSES


# -- G2 / G3 / G5 / G6: kill -9 at each point of a call -----------------------------------------


def _crasher(url: str, log: Path, effect: str, when: str, lease: float) -> None:
    """Call a tool and die by SIGKILL at the named moment."""
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.Effect(effect), name="charge", lease=lease)
    def charge(amount: int) -> str:
        if when == "after-claim":
            os.kill(os.getpid(), signal.SIGKILL)
        record_effect(log, key=twiceshy.current_key(), who="crasher")
        if when == "after-effect":
            os.kill(os.getpid(), signal.SIGKILL)
        return "ch_crasher"

    with twiceshy.run("crash-run"):
        charge(100)
    if when == "after-record":
        os.kill(os.getpid(), signal.SIGKILL)


def _crash(url: str, log: Path, effect: twiceshy.Effect, when: str, lease: float) -> None:
    proc = CTX.Process(target=_crasher, args=(url, log, effect.value, when, lease))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL


def _retry(url: str, log: Path, effect: twiceshy.Effect, lease: float, wait: float) -> Any:
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=effect, name="charge", lease=lease, wait=wait)
    def charge(amount: int) -> str:
        key = twiceshy.current_key()
        # A provider that deduplicates by key: a key it has seen makes no new effect.
        if effect is twiceshy.KEYED and any(e["key"] == key for e in effects(log)):
            return "ch_crasher"
        record_effect(log, key=key, who="retry")
        return "ch_retry"

    try:
        with twiceshy.run("crash-run"):
            return charge(100)
    finally:
        ledger.close()


def test_unsafe_killed_after_claim_is_never_run_again(prefix: str, tmp_path: Path) -> None:
    """G2/G6: an UNSAFE call killed right after its claim: retries wait, then OutcomeUnknown."""
    url, log = servers.dynamodb_url(prefix=prefix), tmp_path / "effects.jsonl"
    # A lease long enough that the first retry (a ledger opened afresh, on a busy machine) still
    # finds the claim live.
    _crash(url, log, twiceshy.UNSAFE, "after-claim", lease=4.0)
    with pytest.raises(twiceshy.InProgress):
        _retry(url, log, twiceshy.UNSAFE, lease=4.0, wait=0.05)
    time.sleep(4.1)
    for _ in range(2):
        with pytest.raises(twiceshy.OutcomeUnknown):
            _retry(url, log, twiceshy.UNSAFE, lease=4.0, wait=0.05)
    assert effects(log) == []


def test_unsafe_killed_after_effect_is_never_run_again(prefix: str, tmp_path: Path) -> None:
    """G6: an UNSAFE call killed after its effect, before recording: UNKNOWN, no extra effect."""
    url, log = servers.dynamodb_url(prefix=prefix), tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.UNSAFE, "after-effect", lease=0.5)
    with pytest.raises(twiceshy.OutcomeUnknown):
        _retry(url, log, twiceshy.UNSAFE, lease=0.5, wait=3)
    assert [e["who"] for e in effects(log)] == ["crasher"]


def test_killed_after_recording_replays(prefix: str, tmp_path: Path) -> None:
    """G3: a process killed right after recording: every retry replays, nothing reruns."""
    url, log = servers.dynamodb_url(prefix=prefix), tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.UNSAFE, "after-record", lease=0.5)
    for _ in range(3):
        assert _retry(url, log, twiceshy.UNSAFE, lease=0.5, wait=0.05) == "ch_crasher"
    assert [e["who"] for e in effects(log)] == ["crasher"]


def test_keyed_killed_after_effect_is_taken_over_with_the_same_key(
    prefix: str, tmp_path: Path
) -> None:
    """G5: a KEYED call killed after its effect is taken over with the same key: one effect."""
    url, log = servers.dynamodb_url(prefix=prefix), tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.KEYED, "after-effect", lease=0.5)
    assert _retry(url, log, twiceshy.KEYED, lease=0.5, wait=3) == "ch_crasher"
    assert _retry(url, log, twiceshy.KEYED, lease=0.5, wait=3) == "ch_crasher"
    seen = effects(log)
    assert len(seen) == 1
    assert seen[0]["key"] == twiceshy.idempotency_key("crash-run", "charge", {"amount": 100})


def test_keyed_killed_after_claim_runs_once_after_the_lease(prefix: str, tmp_path: Path) -> None:
    """G2: a KEYED call killed after its claim, before any effect, runs once after the lease."""
    url, log = servers.dynamodb_url(prefix=prefix), tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.KEYED, "after-claim", lease=0.5)
    assert _retry(url, log, twiceshy.KEYED, lease=0.5, wait=3) == "ch_retry"
    assert _retry(url, log, twiceshy.KEYED, lease=0.5, wait=3) == "ch_retry"
    assert [e["who"] for e in effects(log)] == ["retry"]


# -- G4: an owner stopped past its lease --------------------------------------------------------


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


def test_owner_paused_past_its_lease_cannot_record(prefix: str, tmp_path: Path) -> None:
    """G4: an owner stopped past its lease is fenced out and returns the new owner's result."""
    url, log = servers.dynamodb_url(prefix=prefix), tmp_path / "effects.jsonl"
    started, out = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=_paused_owner, args=(url, log, started, out))
    proc.start()
    ledger = twiceshy.Ledger(url)
    try:
        assert started.wait(60)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.0)  # past the 0.5 s lease; no heartbeat while stopped

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
