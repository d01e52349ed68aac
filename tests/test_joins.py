"""Duplicates of a running call, joined in this process or waiting on the store: each answers
within its ``wait=`` whatever its leader does, and none stops or fails the leader."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import twiceshy
from twiceshy import Snapshot
from twiceshy.stores.memory import MemoryStore


def test_a_joined_call_whose_leader_is_cancelled_answers_within_its_wait() -> None:
    """A duplicate joined in this process answers within its wait=, whatever its leader does."""
    store = MemoryStore()
    here = twiceshy.Ledger(store=store, counts_interval=None)
    elsewhere = twiceshy.Ledger(store=store, counts_interval=None)  # another process
    release = threading.Event()

    @elsewhere.tool(effect=twiceshy.KEYED, name="charge")
    def charge_elsewhere(amount: int) -> str:
        release.wait(10)
        return "elsewhere"

    @here.tool(effect=twiceshy.KEYED, wait=1.0, name="charge")
    async def charge(amount: int) -> str:
        raise AssertionError("the intent runs elsewhere")

    def other() -> None:
        with twiceshy.run("run-1"):
            charge_elsewhere(5)

    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.1)

    async def main() -> float:
        with twiceshy.run("run-1"):
            leader = asyncio.create_task(charge(5))
            await asyncio.sleep(0.01)
            started = time.monotonic()
            joined = asyncio.create_task(charge(5))
            await asyncio.sleep(0.7)
            leader.cancel()
            with pytest.raises(twiceshy.InProgress):
                await joined
            return time.monotonic() - started

    try:
        took = asyncio.run(main())
    finally:
        release.set()
        thread.join(10)
    assert took < 1.0 + 0.4  # not 0.7 + a fresh 1.0


def test_a_joined_caller_whose_loop_is_gone_does_not_fail_the_leader() -> None:
    """An async duplicate gave up (InProgress) and its event loop closed: the leader's own call
    still answers its result."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    answers: dict[str, Any] = {}

    @ledger.tool(effect=twiceshy.KEYED, wait=0.2)
    def pay(x: int) -> str:
        time.sleep(0.8)
        return "paid"

    def leader() -> None:
        with twiceshy.run("run-1"):
            try:
                answers["leader"] = pay(1)
            except BaseException as exc:  # what the leader's caller would get
                answers["leader"] = exc

    thread = threading.Thread(target=leader)
    thread.start()
    time.sleep(0.2)

    async def joined() -> Any:
        with twiceshy.run("run-1"):
            return await pay.twiceshy.acall({"x": 1}, lambda: asyncio.sleep(0))  # type: ignore[attr-defined]

    with pytest.raises(twiceshy.InProgress):
        asyncio.run(joined())  # the loop is closed once this returns
    thread.join(10)
    assert answers["leader"] == "paid"


def test_a_blocking_duplicate_on_the_leaders_event_loop_does_not_stop_it() -> None:
    """A blocking call made from async code, joining an async call of the same intent on that
    loop, would stop the loop the leader needs: it is answered InProgress at once."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    guard = ledger.guard("lookup", effect=twiceshy.KEYED, wait=3)

    async def work() -> str:
        await asyncio.sleep(0.05)
        return "done"

    async def main() -> str:
        with twiceshy.run("run-1"):
            leader = asyncio.create_task(guard.acall({"q": 1}, work))
            await asyncio.sleep(0.01)
            started = time.monotonic()
            with pytest.raises(twiceshy.InProgress):
                guard.call({"q": 1}, lambda: "blocking")
            assert time.monotonic() - started < 1
            return await leader

    assert asyncio.run(main()) == "done"


class WakesAtOnce(MemoryStore):
    """A store whose waits return at once, as a wait may (a spurious wake-up)."""

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        time.sleep(0.001)
        return self.get(namespace, key)


def test_a_duplicate_woken_often_waits_its_whole_wait() -> None:
    """However many times its waits end early, a duplicate waits ``wait=``, then InProgress:
    never a store error for "too many rounds"."""
    store = WakesAtOnce()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    other = twiceshy.Ledger(store=store, counts_interval=None)
    release = threading.Event()

    @ledger.tool(effect=twiceshy.KEYED, name="job")
    def job(x: int) -> int:
        release.wait(10)
        return x

    @other.tool(effect=twiceshy.KEYED, wait=0.6, name="job")
    def job_elsewhere(x: int) -> int:
        raise AssertionError("the intent is running elsewhere")

    def owner() -> None:
        with twiceshy.run("run-1"):
            job(1)

    thread = threading.Thread(target=owner)
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress):
        job_elsewhere(1)  # some hundreds of early wake-ups
    assert time.monotonic() - started >= 0.55
    release.set()
    thread.join(10)
