"""A process forked while calls run in its parent's threads starts with none of them.

The child inherits the ledger's in-process state as it was at the fork: the flights of calls
running in other threads (which never land in the child) and the leases the heartbeat renews for
them (which the child must not renew: those calls are not running there).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import twiceshy
from twiceshy.stores.memory import MemoryStore

pytestmark = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)

FORK = (
    multiprocessing.get_context("fork")
    if "fork" in multiprocessing.get_all_start_methods()
    else None
)


def test_a_forked_child_does_not_join_a_call_running_in_its_parent(tmp_path: Path) -> None:
    """The child's duplicate asks the ledger: it waits for the parent's outcome, then replays."""
    assert FORK is not None
    ledger = twiceshy.Ledger(f"sqlite:///{tmp_path / 'ledger.db'}", counts_interval=None)
    started, gate = threading.Event(), threading.Event()
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, wait=8)
    def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        started.set()
        gate.wait(10)
        return {"amount": amount}

    def call() -> Any:
        with twiceshy.run("run-1"):
            return charge(5)

    answers: Any = FORK.SimpleQueue()

    def child() -> None:
        try:
            answers.put(("answered", call(), len(runs)))
        except Exception as exc:
            answers.put(("raised", repr(exc), len(runs)))

    owner = threading.Thread(target=call)
    owner.start()
    assert started.wait(10)
    forked = FORK.Process(target=child)
    forked.start()
    time.sleep(0.3)  # the child is waiting on the intent
    gate.set()
    owner.join(10)
    forked.join(30)
    # The child replayed the parent's outcome; its runs are the parent's, copied at the fork.
    assert answers.get() == ("answered", {"amount": 5}, 1)
    assert runs == [5]
    ledger.close()


def _owner_dies_mid_call(url: str, ready: Any) -> None:
    """A process whose call is running when it forks a child and then dies.

    The child makes a call of its own (which starts its heartbeat), says so, and lives on for a
    while; it must not keep renewing the lease of the call that died with its parent.
    """
    ledger = twiceshy.Ledger(url, counts_interval=None)
    started = threading.Event()

    @ledger.tool(effect=twiceshy.KEYED, lease=0.6)
    def charge(amount: int) -> dict[str, int]:
        started.set()
        time.sleep(30)
        return {"amount": amount}

    def call(amount: int) -> None:
        with twiceshy.run("run-1"):
            charge(amount)

    threading.Thread(target=call, args=(5,), daemon=True).start()
    started.wait(10)
    called_r, called_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own call, then a life longer than the parent's lease
        try:
            with twiceshy.run("run-2"):
                ledger.guard("other", effect=twiceshy.KEYED).call({}, lambda: 1)
            os.write(called_w, b"x")
            time.sleep(4)
        finally:
            os._exit(0)
    ready.send(pid)
    os.read(called_r, 1)  # the child's call is done (never, if it hangs: the test then fails)
    os._exit(0)  # the owner dies mid-call


def test_a_forked_child_does_not_renew_its_parents_leases(tmp_path: Path) -> None:
    """The child's own call runs; the dead owner's lease lapses and a retry takes it over."""
    assert FORK is not None
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ready, told = FORK.Pipe(duplex=False)
    owner = FORK.Process(target=_owner_dies_mid_call, args=(url, told))
    owner.start()
    assert ready.poll(20), "the owner did not fork"
    child = ready.recv()
    try:
        # Not owner.join(): the child holds the owner's sentinel open as long as it lives.
        deadline = time.monotonic() + 10
        while owner.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert owner.exitcode == 0, "the forked child's own call did not finish"
        ledger = twiceshy.Ledger(url, counts_interval=None)

        @ledger.tool(effect=twiceshy.KEYED, lease=0.6, wait=3)
        def charge(amount: int) -> dict[str, int]:
            return {"amount": amount, "taken over": 1}

        with twiceshy.run("run-1"):
            assert charge(5) == {"amount": 5, "taken over": 1}
        ledger.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        owner.kill()


def test_a_forked_child_that_only_flushes_sends_none_of_its_parents_counts(tmp_path: Path) -> None:
    """The child's first act is flush_counts() and close(): the parent's pending counts stay the
    parent's, to be added once, by the parent."""
    assert FORK is not None
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        return amount

    with twiceshy.run("run-1"):
        charge(1)  # counted in the parent, not yet added to the store

    def child() -> None:
        ledger.flush_counts()
        ledger.close()

    forked = FORK.Process(target=child)
    forked.start()
    forked.join(30)
    assert forked.exitcode == 0
    ledger.close()
    with twiceshy.Ledger(url, counts_interval=None) as reader:
        counted = reader.store.counts("")  # type: ignore[attr-defined]
        assert counted == {("charge", "executed"): 1, ("charge", "ran"): 1}


def test_a_forked_child_can_use_a_memory_ledger_its_parent_was_using() -> None:
    """Forked while a parent's thread holds the memory store's lock, the child's call finishes."""
    assert FORK is not None
    inside, gate = threading.Event(), threading.Event()
    hold = threading.Event()

    def clock() -> float:
        # The store reads its clock with its lock held: the parent's thread stays in here.
        if hold.is_set():
            inside.set()
            gate.wait(10)
        return time.time()

    ledger = twiceshy.Ledger(store=MemoryStore(clock=clock), counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> dict[str, int]:
        return {"amount": amount}

    def call(amount: int) -> Any:
        with twiceshy.run("run-1"):
            return charge(amount)

    answers: Any = FORK.SimpleQueue()

    def child() -> None:
        answers.put(call(7))

    hold.set()
    busy = threading.Thread(target=call, args=(5,))
    busy.start()
    try:
        assert inside.wait(10)
        hold.clear()
        forked = FORK.Process(target=child)
        forked.start()
        forked.join(20)
        if forked.exitcode is None:
            forked.kill()
        assert forked.exitcode == 0, "the child hung on the lock its parent's thread held"
        assert answers.get() == {"amount": 7}
    finally:
        gate.set()
        busy.join(10)
    ledger.close()


# Python 3.12 warns of fork() in a process with threads (the heartbeat's is one).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_call_that_forks_inside_its_tool_ends_in_the_child_too() -> None:
    """A tool that forks: the child goes on with the call it was forked in, and that call ends
    there as in the parent (its lease is in no heap of the child's heartbeat)."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    forked: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> dict[str, int]:
        pid = os.fork()
        forked.append(pid)
        return {"amount": amount, "in_child": int(pid == 0)}

    try:
        with twiceshy.run("run-1"):
            answer = charge(5)
    except BaseException:
        if forked and forked[-1] == 0:
            os._exit(1)  # the child: its call failed
        raise
    if forked[-1] == 0:
        os._exit(0 if answer == {"amount": 5, "in_child": 1} else 2)
    _, status = os.waitpid(forked[-1], 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the call did not end well in the child"
    assert answer == {"amount": 5, "in_child": 0}
    ledger.close()
