"""Distinct first calls under load on PostgreSQL and Redis, beside the raw client, in one run.

    python benchmarks/load.py [--quick] [--calls N] [--rounds R]

Each case makes distinct first calls of a KEYED tool that does nothing (claim, run, record), so
what is measured is the ledger's cost when many calls are in flight at once: 16 and 64
concurrent async tasks on one event loop, and 16 threads. Beside each, the *raw* client doing
the same essential round trips at the same concurrency, measured in the same run, the two
taking turns round by round:

- PostgreSQL: one ``INSERT ... ON CONFLICT DO NOTHING`` of the claim and one guarded ``UPDATE``
  to the outcome, each its own committed transaction (autocommit, the server's
  ``synchronous_commit``), in a table of the ledger's own shape, through psycopg's pool; both
  sides have pools of ``POOL`` connections.
- Redis: one ``HSET`` of the claim's fields and one of the outcome's, through redis-py's client
  with its default pool (as twiceshy's: up to 100 connections).

Printed for each: calls a second, the median and 99th percentile of one call's time, and the
ratio of twiceshy's calls a second to the raw client's (the goal: at least 0.8). A last table
shows what ``PUBLISH`` in a Redis write costs: a raw script that writes a hash, with and without
a ``PUBLISH`` nobody hears, at 16 tasks.

Every case is bounded in calls and in time (``LIMIT`` seconds). Only 127.0.0.1 is used; the
run's schema and key prefix are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import redis
import redis.asyncio
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from rich.console import Console
from rich.table import Table

import twiceshy
from servers import POSTGRES, REDIS, RESULT_TEXT, same_fields, same_row

POOL = 16  # connections of each PostgreSQL pool, twiceshy's and the raw client's
LIMIT = 30.0  # seconds: a case stops early past this
MODES = (("async", 16), ("async", 64), ("threads", 16))

Call = Callable[[int], Awaitable[object]]
BlockingCall = Callable[[int], object]


@dataclass
class Sample:
    """One case's calls: their count, the wall time they took, and each call's nanoseconds."""

    calls: int = 0
    seconds: float = 0.0
    times: list[int] | None = None

    def add(self, calls: int, seconds: float, times: list[int]) -> None:
        self.calls += calls
        self.seconds += seconds
        self.times = (self.times or []) + times

    @property
    def rate(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of one call's time, in ms."""
        times = sorted(self.times or [0])
        return times[min(len(times) - 1, int(q * len(times)))] / 1e6

    @property
    def p50(self) -> float:
        return statistics.median(self.times or [0]) / 1e6


async def run_tasks(call: Call, tasks: int, calls: int) -> tuple[int, float, list[int]]:
    """``calls`` calls shared by ``tasks`` tasks; (calls made, seconds, each call's ns)."""
    counter = iter(range(calls))
    times: list[int] = []
    stop_at = time.monotonic() + LIMIT

    async def worker() -> None:
        for i in counter:
            start = time.perf_counter_ns()
            await call(i)
            times.append(time.perf_counter_ns() - start)
            if time.monotonic() > stop_at:
                return

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return len(times), time.perf_counter() - start, times


def run_threads(call: BlockingCall, threads: int, calls: int) -> tuple[int, float, list[int]]:
    """``calls`` calls shared by ``threads`` threads; (calls made, seconds, each call's ns)."""
    lock = threading.Lock()
    counter = iter(range(calls))
    times: list[int] = []
    stop_at = time.monotonic() + LIMIT
    barrier = threading.Barrier(threads + 1)

    def next_index() -> int | None:
        with lock:
            return next(counter, None)

    def worker() -> None:
        barrier.wait(30)
        mine: list[int] = []
        while (i := next_index()) is not None:
            start = time.perf_counter_ns()
            call(i)
            mine.append(time.perf_counter_ns() - start)
            if time.monotonic() > stop_at:
                break
        with lock:
            times.extend(mine)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait(30)
    start = time.perf_counter()
    for thread in pool:
        thread.join(LIMIT + 30)
    return len(times), time.perf_counter() - start, times


def keyed_tools(ledger: twiceshy.Ledger, tag: str) -> tuple[Call, BlockingCall]:
    """An async and a blocking distinct first call of a KEYED tool on ``ledger``."""

    @ledger.tool(effect=twiceshy.KEYED, name="charge")
    async def acharge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    @ledger.tool(effect=twiceshy.KEYED, name="charge")
    def charge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    prefix = f"load-{tag}-{secrets.token_hex(4)}"

    async def afirst(i: int) -> object:
        with twiceshy.run(f"{prefix}-a{i}"):
            return await acharge(4900, "cus_1")

    def first(i: int) -> object:
        with twiceshy.run(f"{prefix}-t{i}"):
            return charge(4900, "cus_1")

    return afirst, first


# -- PostgreSQL -------------------------------------------------------------------------------


class RawPostgres:
    """The floor on PostgreSQL: a claim INSERT and an outcome UPDATE, autocommit, pooled."""

    def __init__(self, schema: str) -> None:
        self.insert = (
            f"INSERT INTO {schema}.floor VALUES ({', '.join(['%s'] * len(same_row('', 0)))})"
            " ON CONFLICT (namespace, key) DO NOTHING"
        )
        self.update = (
            f"UPDATE {schema}.floor SET state = 'succeeded', result = %s, lease_deadline = NULL,"
            " updated_at = %s, expires_at = %s"
            " WHERE namespace = '' AND key = %s AND fence = 1 AND state = 'claimed'"
        )
        self.prefix = secrets.token_hex(8)
        self.pool: ConnectionPool[Any] = ConnectionPool(
            POSTGRES, min_size=POOL, max_size=POOL, kwargs={"autocommit": True}, open=False
        )
        self.pool.open(wait=True, timeout=30)

    def blocking(self, tag: str) -> BlockingCall:
        def first(i: int) -> None:
            row = same_row(f"{self.prefix}-{tag}", i)
            conn = self.pool.getconn()
            try:
                conn.execute(self.insert, row)
                conn.execute(self.update, (RESULT_TEXT, row[14], row[14] + 86400, row[1]))
            finally:
                self.pool.putconn(conn)

        return first

    async def open_async(self) -> AsyncConnectionPool[Any]:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            POSTGRES, min_size=POOL, max_size=POOL, kwargs={"autocommit": True}, open=False
        )
        await pool.open(wait=True, timeout=30)
        return pool

    def awaiting(self, pool: AsyncConnectionPool[Any], tag: str) -> Call:
        async def first(i: int) -> None:
            row = same_row(f"{self.prefix}-{tag}", i)
            conn = await pool.getconn()
            try:
                await conn.execute(self.insert, row)
                await conn.execute(self.update, (RESULT_TEXT, row[14], row[14] + 86400, row[1]))
            finally:
                await pool.putconn(conn)

        return first

    def close(self) -> None:
        self.pool.close()


# -- Redis -------------------------------------------------------------------------------------


class RawRedis:
    """The floor on Redis: an HSET of the claim's fields and an HSET of the outcome's."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.client = redis.Redis.from_url(REDIS)

    def _names(self, tag: str, i: int) -> tuple[str, dict[Any, Any], dict[Any, Any]]:
        fields = same_fields(f"{self.prefix}-{tag}", i)
        outcome = {"state": "succeeded", "result": RESULT_TEXT, "updated_at": fields["created_at"]}
        return f"{self.prefix}:floor:{fields['key']}", fields, outcome

    def blocking(self, tag: str) -> BlockingCall:
        def first(i: int) -> None:
            name, fields, outcome = self._names(tag, i)
            self.client.hset(name, mapping=fields)
            self.client.hset(name, mapping=outcome)

        return first

    def awaiting(self, client: redis.asyncio.Redis, tag: str) -> Call:
        async def first(i: int) -> None:
            name, fields, outcome = self._names(tag, i)
            await client.hset(name, mapping=fields)
            await client.hset(name, mapping=outcome)

        return first

    def close(self) -> None:
        self.client.close()


# -- the run -----------------------------------------------------------------------------------


def fresh(call: Any) -> Any:
    """``call`` given a new number each time, whatever it is called with: every call of a case,
    warm-up and rounds alike, is a first call."""
    numbers = itertools.count()
    return lambda i: call(next(numbers))  # next() on a count is atomic under the GIL


async def _async_cases(
    mode_tasks: int,
    cases: dict[str, Call],
    rounds: int,
    calls: int,
) -> dict[str, Sample]:
    out = {name: Sample() for name in cases}
    cases = {name: fresh(call) for name, call in cases.items()}
    for call in cases.values():  # warm up: pools filled, statements prepared
        await run_tasks(call, mode_tasks, mode_tasks * 4)
    for _ in range(rounds):
        for name, call in cases.items():
            out[name].add(*await run_tasks(call, mode_tasks, calls))
    return out


def _thread_cases(
    threads: int, cases: dict[str, BlockingCall], rounds: int, calls: int
) -> dict[str, Sample]:
    out = {name: Sample() for name in cases}
    cases = {name: fresh(call) for name, call in cases.items()}
    for call in cases.values():
        run_threads(call, threads, threads * 4)
    for _ in range(rounds):
        for name, call in cases.items():
            out[name].add(*run_threads(call, threads, calls))
    return out


def measure_postgres(rounds: int, calls: int) -> dict[tuple[str, int], dict[str, Sample]]:
    """Every mode on PostgreSQL: twiceshy and the raw client taking turns."""
    schema = f"twiceshy_load_{secrets.token_hex(4)}"
    ledger = twiceshy.Ledger(f"{POSTGRES}?schema={schema}&pool_size={POOL}", counts_interval=None)
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {schema}.floor (LIKE {schema}.records INCLUDING ALL)")
    raw = RawPostgres(schema)

    async def async_modes() -> dict[tuple[str, int], dict[str, Sample]]:
        pool = await raw.open_async()
        out = {}
        try:
            for mode, width in MODES:
                if mode == "async":
                    tag = f"{mode}{width}"
                    afirst, _ = keyed_tools(ledger, tag)
                    cases = {"twiceshy": afirst, "raw": raw.awaiting(pool, tag)}
                    out[(mode, width)] = await _async_cases(width, cases, rounds, calls)
            return out
        finally:
            await pool.close()
            await ledger.async_store.close()

    try:
        results = asyncio.run(async_modes())
        for mode, width in MODES:
            if mode == "threads":
                tag = f"{mode}{width}"
                _, first = keyed_tools(ledger, tag)
                cases = {"twiceshy": first, "raw": raw.blocking(tag)}
                results[(mode, width)] = _thread_cases(width, cases, rounds, calls)
    finally:
        raw.close()
        ledger.close()
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    return results


def measure_redis(rounds: int, calls: int) -> dict[tuple[str, int], dict[str, Sample]]:
    """Every mode on Redis: twiceshy and the raw client taking turns."""
    prefix = f"twiceshy-load:{secrets.token_hex(4)}"
    ledger = twiceshy.Ledger(f"{REDIS}?prefix={prefix}", counts_interval=None)
    raw = RawRedis(prefix)

    async def async_modes() -> dict[tuple[str, int], dict[str, Sample]]:
        client = redis.asyncio.Redis.from_url(REDIS)
        out = {}
        try:
            for mode, width in MODES:
                if mode == "async":
                    tag = f"{mode}{width}"
                    afirst, _ = keyed_tools(ledger, tag)
                    cases = {"twiceshy": afirst, "raw": raw.awaiting(client, tag)}
                    out[(mode, width)] = await _async_cases(width, cases, rounds, calls)
            out[("publish", 16)] = await publish_cost(client, prefix, rounds, calls)
            return out
        finally:
            await client.aclose()
            await ledger.async_store.close()

    try:
        results = asyncio.run(async_modes())
        for mode, width in MODES:
            if mode == "threads":
                tag = f"{mode}{width}"
                _, first = keyed_tools(ledger, tag)
                cases = {"twiceshy": first, "raw": raw.blocking(tag)}
                results[(mode, width)] = _thread_cases(width, cases, rounds, calls)
    finally:
        raw.close()
        ledger.close()
        delete_prefix(prefix)
    return results


_WRITE = "redis.call('HSET', KEYS[1], 'state', ARGV[1], 'result', ARGV[2])"
_WRITE_PUBLISH = _WRITE + "\nredis.pcall('PUBLISH', KEYS[1] .. ':wake', ARGV[1])"


async def publish_cost(
    client: redis.asyncio.Redis, prefix: str, rounds: int, calls: int
) -> dict[str, Sample]:
    """A raw write script with and without a PUBLISH nobody hears, at 16 tasks."""
    plain = client.register_script(_WRITE)
    publishing = client.register_script(_WRITE_PUBLISH)

    def case(script: Any, tag: str) -> Call:
        async def write(i: int) -> None:
            await script(keys=[f"{prefix}:pub:{tag}:{i}"], args=["succeeded", RESULT_TEXT])

        return write

    cases = {"script": case(plain, "p"), "script + PUBLISH": case(publishing, "q")}
    return await _async_cases(16, cases, rounds, calls)


def delete_prefix(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS)
    try:
        for _ in range(1000):  # bounded: at most a million keys
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))[:1000]
            if not keys:
                return
            client.delete(*keys)
    finally:
        client.close()


def show(console: Console, server: str, results: dict[tuple[str, int], dict[str, Sample]]) -> None:
    table = Table(title=f"{server}: distinct first calls under load")
    for column in ("mode", "case", "calls/s", "p50 ms", "p99 ms", "twiceshy / raw"):
        table.add_column(column, justify="right" if column != "case" else "left")
    for (mode, width), samples in results.items():
        if mode == "publish":
            continue
        ratio = samples["twiceshy"].rate / samples["raw"].rate
        verdict = "met" if ratio >= 0.8 else "NOT met"
        for name, sample in samples.items():
            table.add_row(
                f"{width} {mode}",
                name,
                f"{sample.rate:,.0f}",
                f"{sample.p50:.2f}",
                f"{sample.quantile(0.99):.2f}",
                f"{ratio:.2f} (goal 0.8: {verdict})" if name == "twiceshy" else "",
            )
    console.print(table)
    publish = results.get(("publish", 16))
    if publish:
        table = Table(title="Redis: what PUBLISH adds to a write script, 16 tasks")
        for column in ("case", "calls/s", "p50 ms", "p99 ms"):
            table.add_column(column, justify="right" if column != "case" else "left")
        for name, sample in publish.items():
            table.add_row(
                name, f"{sample.rate:,.0f}", f"{sample.p50:.3f}", f"{sample.quantile(0.99):.3f}"
            )
        console.print(table)
        ratio = publish["script + PUBLISH"].rate / publish["script"].rate
        console.print(f"with PUBLISH / without: {ratio:.2f} times the calls a second")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per case per round")
    parser.add_argument("--rounds", type=int, default=2, help="turns each case takes")
    parser.add_argument("--only", choices=("postgres", "redis"), help="one server")
    args = parser.parse_args()
    calls, rounds = (300, 1) if args.quick else (args.calls, args.rounds)
    console = Console()
    if args.only in (None, "postgres"):
        show(console, "PostgreSQL", measure_postgres(rounds, calls))
    if args.only in (None, "redis"):
        show(console, "Redis", measure_redis(rounds, calls))


if __name__ == "__main__":
    main()
