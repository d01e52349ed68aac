"""The guarantees of DESIGN.md §7 shown with real processes on one SQLite ledger file.

Effects are counted in a file each process appends to (one line per effect), so a process killed
with SIGKILL cannot hide one. Every wait here is bounded.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import twiceshy

pytestmark = pytest.mark.slow

CTX = mp.get_context("spawn")
PROCESSES = 8
TRIALS = 12


def effects(path: Path) -> list[dict[str, Any]]:
    """The effects a provider double saw, one JSON object a line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def record_effect(path: Path, **fields: Any) -> None:
    """Append one effect; O_APPEND writes of one line are atomic between processes."""
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def _racer(url: str, log: Path, barrier: Any, out: Any, trials: int) -> None:
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.UNSAFE, name="charge", wait=30)
    def charge(trial: int) -> dict[str, Any]:
        record_effect(log, trial=trial, pid=os.getpid())
        time.sleep(0.02)
        return {"trial": trial, "by": os.getpid()}

    for trial in range(trials):
        barrier.wait(30)
        with twiceshy.run(f"race-{trial}"):
            out.put((trial, charge(trial)))
    ledger.close()


def test_processes_racing_one_intent_run_it_once(tmp_path: Path) -> None:
    """8 processes released together on one intent, many trials: one run, one shared result."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    log = tmp_path / "effects.jsonl"
    barrier = CTX.Barrier(PROCESSES)
    out = CTX.Queue()
    procs = [
        CTX.Process(target=_racer, args=(url, log, barrier, out, TRIALS)) for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in range(PROCESSES * TRIALS)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    seen = effects(log)
    assert sorted(e["trial"] for e in seen) == list(range(TRIALS))
    by_trial: dict[int, list[Any]] = {}
    for trial, result in results:
        by_trial.setdefault(trial, []).append(result)
    for trial, answers in by_trial.items():
        assert len(answers) == PROCESSES
        winner = next(e["pid"] for e in seen if e["trial"] == trial)
        assert answers == [{"trial": trial, "by": winner}] * PROCESSES


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
    proc.join(30)
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


def test_unsafe_killed_after_claim_is_never_run_again(tmp_path: Path) -> None:
    """G2/G6: an UNSAFE call killed right after its claim: retries wait, then OutcomeUnknown."""
    url, log = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.UNSAFE, "after-claim", lease=0.5)
    with pytest.raises(twiceshy.InProgress):
        _retry(url, log, twiceshy.UNSAFE, lease=0.5, wait=0.05)
    time.sleep(0.6)
    for _ in range(2):
        with pytest.raises(twiceshy.OutcomeUnknown):
            _retry(url, log, twiceshy.UNSAFE, lease=0.5, wait=0.05)
    assert effects(log) == []


def test_unsafe_killed_after_effect_is_never_run_again(tmp_path: Path) -> None:
    """G6: an UNSAFE call killed after its effect, before recording: UNKNOWN, zero extra effects."""
    url, log = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.UNSAFE, "after-effect", lease=0.3)
    with pytest.raises(twiceshy.OutcomeUnknown):
        _retry(url, log, twiceshy.UNSAFE, lease=0.3, wait=2)
    assert [e["who"] for e in effects(log)] == ["crasher"]


def test_killed_after_recording_replays(tmp_path: Path) -> None:
    """G3: a process killed right after recording: every retry replays, nothing reruns."""
    url, log = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.UNSAFE, "after-record", lease=0.3)
    for _ in range(3):
        assert _retry(url, log, twiceshy.UNSAFE, lease=0.3, wait=0.05) == "ch_crasher"
    assert [e["who"] for e in effects(log)] == ["crasher"]


def test_keyed_takeover_after_a_crash_hands_the_provider_the_same_key(tmp_path: Path) -> None:
    """G5: a KEYED call killed after its effect is taken over with the same key: one effect."""
    url, log = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.KEYED, "after-effect", lease=0.3)
    assert _retry(url, log, twiceshy.KEYED, lease=0.3, wait=2) == "ch_crasher"
    assert _retry(url, log, twiceshy.KEYED, lease=0.3, wait=2) == "ch_crasher"
    seen = effects(log)
    assert len(seen) == 1
    expected = twiceshy.idempotency_key("crash-run", "charge", {"amount": 100})
    assert seen[0]["key"] == expected


def test_keyed_killed_after_claim_runs_once_after_the_lease(tmp_path: Path) -> None:
    """G2: a KEYED call killed after its claim, before any effect, runs once after the lease."""
    url, log = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "effects.jsonl"
    _crash(url, log, twiceshy.KEYED, "after-claim", lease=0.3)
    assert _retry(url, log, twiceshy.KEYED, lease=0.3, wait=2) == "ch_retry"
    assert _retry(url, log, twiceshy.KEYED, lease=0.3, wait=2) == "ch_retry"
    assert [e["who"] for e in effects(log)] == ["retry"]


def _paused_owner(url: str, log: Path, started: Any, out: Any) -> None:
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.KEYED, name="charge", lease=0.4)
    def charge(amount: int) -> str:
        record_effect(log, key=twiceshy.current_key(), who="stale")
        started.set()
        time.sleep(0.3)  # SIGSTOP lands here; the lease lapses while the process is stopped
        return "ch_stale"

    with twiceshy.run("pause-run"):
        out.put(charge(5))


def test_owner_paused_past_its_lease_cannot_record(tmp_path: Path) -> None:
    """G4: an owner stopped past its lease is fenced out and returns the new owner's result."""
    url, log = f"sqlite:///{tmp_path / 'l.db'}", tmp_path / "effects.jsonl"
    started, out = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=_paused_owner, args=(url, log, started, out))
    proc.start()
    try:
        assert started.wait(30)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.6)
        ledger = twiceshy.Ledger(url)

        @ledger.tool(effect=twiceshy.KEYED, name="charge", lease=5, wait=2)
        def charge(amount: int) -> str:
            record_effect(log, key=twiceshy.current_key(), who="fresh")
            return "ch_fresh"

        with twiceshy.run("pause-run"):
            assert charge(5) == "ch_fresh"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert out.get(timeout=30) == "ch_fresh"
    proc.join(30)
    assert proc.exitcode == 0
    with twiceshy.run("pause-run"):
        assert charge(5) == "ch_fresh"
    seen = effects(log)
    assert [e["who"] for e in seen] == ["stale", "fresh"]
    assert len({e["key"] for e in seen}) == 1
    ledger.close()


def test_unreachable_ledger_path_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """A ledger file that cannot be opened raises StoreUnavailable; no tool is ever called."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(twiceshy.StoreUnavailable):
        twiceshy.Ledger(f"sqlite:///{blocker / 'ledger.db'}")
