"""The heartbeat frees a call's lease entry when the call ends, not when the entry comes due.

Most calls end long before their first renewal (a third of the lease): their entries must not
pile up in the heartbeat's heap for that long under load. Counted through
``Heartbeat.leases``, never timed.
"""

from __future__ import annotations

import asyncio
import threading

import twiceshy
from twiceshy._inflight import Heartbeat
from twiceshy.stores.memory import MemoryStore


def test_ended_calls_leave_no_lease_entry() -> None:
    """Calls from threads and tasks, ended: the heartbeat holds no lease; a running call's is
    held while it runs."""
    ledger = twiceshy.Ledger(store=MemoryStore(), counts_interval=None)
    heartbeat = ledger.runtime.heartbeat
    seen: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(n: int) -> str:
        seen.append(heartbeat.leases)
        return f"ch_{n}"

    @ledger.tool(effect=twiceshy.KEYED)
    async def acharge(n: int) -> str:
        await asyncio.sleep(0)
        return f"ch_{n}"

    def calls(first: int) -> None:
        with twiceshy.run("beats"):
            for n in range(first, first + 200):
                charge(n)

    async def tasks() -> list[str]:
        with twiceshy.run("beats"):
            return await asyncio.gather(*(acharge(n) for n in range(1000, 1300)))

    try:
        threads = [threading.Thread(target=calls, args=(i * 200,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(seen) == 800
        assert min(seen) >= 1  # its own lease, at least, while a call runs
        assert asyncio.run(tasks()) == [f"ch_{n}" for n in range(1000, 1300)]
        assert heartbeat.leases == 0
    finally:
        ledger.close()


def test_ended_leases_are_at_most_half_the_heap() -> None:
    """While some calls run, the entries of those that ended never outnumber theirs."""
    heartbeat = Heartbeat(MemoryStore())
    running = [heartbeat.start("ns", f"run-{i}", 1, "o", 30.0) for i in range(10)]
    for i in range(1000):
        heartbeat.stop(heartbeat.start("ns", f"k-{i}", 1, "o", 30.0))
        assert heartbeat.leases <= 2 * len(running)
    for job in running:
        heartbeat.stop(job)
    assert heartbeat.leases == 0
