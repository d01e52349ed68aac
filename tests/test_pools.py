"""Server stores under bursts: more callers than connections wait for one, never fail at once.

Each store's pool size and wait are URL options (``pool_size=``, ``pool_timeout=``), alike on
PostgreSQL and Redis. Every caller of a burst past the pool gets its answer and every tool runs
once; a wait that ends without a free connection raises ``StoreUnavailable`` naming the option
to raise, before anything is claimed. Against the real servers, in a schema or key prefix of
each test's own.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import servers
import twiceshy
from twiceshy.errors import StoreUnavailable
from twiceshy.stores.postgres import AsyncPostgresStore, PostgresStore, open_postgres
from twiceshy.stores.redis import AsyncRedisStore, RedisStore, split_url

THREADS = 24
TASKS = 40


def burst_threads(tool: Any, count: int) -> list[Any]:
    """Call ``tool(i)`` from ``count`` threads started together; their answers, in order."""
    answers: list[Any] = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def one(i: int) -> None:
        barrier.wait(10)
        try:
            with twiceshy.run("burst"):
                answers[i] = tool(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[0]
    return answers


async def burst_tasks(tool: Any, count: int) -> list[Any]:
    """Await ``tool(i)`` in ``count`` tasks at once; their answers, in order."""
    with twiceshy.run("burst"):
        return list(await asyncio.gather(*(tool(i) for i in range(count))))


def counted(ledger: twiceshy.Ledger, runs: list[int]) -> tuple[Any, Any]:
    """A blocking and an async KEYED tool of ``ledger``, each run appending its argument."""
    lock = threading.Lock()

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(n: int) -> str:
        with lock:
            runs.append(n)
        return f"ch_{n}"

    @ledger.tool(effect=twiceshy.KEYED)
    async def acharge(n: int) -> str:
        runs.append(n)
        await asyncio.sleep(0)
        return f"ch_{n}"

    return charge, acharge


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A ledger URL in a schema of this test's own, dropped afterwards."""
    url = servers.require("postgres")
    schema = f"twiceshy_test_{secrets.token_hex(6)}"
    yield f"{url}?schema={schema}"
    servers.drop_schema(url, schema)


@pytest.mark.postgres
def test_postgres_threads_past_the_pool_wait_and_run_once(pg_url: str) -> None:
    """24 threads on a pool of 2 connections (pool_size=2): every call answers, each tool once."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{pg_url}&pool_size=2&pool_timeout=30", counts_interval=None)
    try:
        assert isinstance(ledger.store, PostgresStore)
        charge, _ = counted(ledger, runs)
        assert burst_threads(charge, THREADS) == [f"ch_{i}" for i in range(THREADS)]
        assert sorted(runs) == list(range(THREADS))
        assert ledger.store._pool.max_size == 2
        assert ledger.store._pool.get_stats()["pool_size"] <= 2
    finally:
        ledger.close()


@pytest.mark.postgres
def test_postgres_tasks_past_the_pool_wait_and_run_once(pg_url: str) -> None:
    """40 async tasks on one loop's pool of 2 connections: every call answers, each tool once."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{pg_url}&pool_size=2", counts_interval=None)

    async def main() -> list[Any]:
        try:
            answers = await burst_tasks(acharge, TASKS)
            store = ledger.async_store
            assert isinstance(store, AsyncPostgresStore)
            [state] = store._states.values()
            assert state.pool.max_size == 2
            assert state.pool.get_stats()["pool_size"] <= 2
            return answers
        finally:
            await ledger.async_store.close()

    try:
        _, acharge = counted(ledger, runs)
        assert asyncio.run(main()) == [f"ch_{i}" for i in range(TASKS)]
        assert sorted(runs) == list(range(TASKS))
    finally:
        ledger.close()


@pytest.mark.postgres
def test_postgres_pool_timeout_fails_before_the_claim(pg_url: str) -> None:
    """With the one connection held elsewhere, a call waits pool_timeout, then raises
    StoreUnavailable naming pool_size=, its tool not run."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{pg_url}&pool_size=1&pool_timeout=0.2", counts_interval=None)
    try:
        store = ledger.store
        assert isinstance(store, PostgresStore)
        charge, _ = counted(ledger, runs)
        held = store._pool.getconn()
        try:
            with twiceshy.run("held"), pytest.raises(StoreUnavailable, match="pool_size="):
                charge(1)
        finally:
            store._pool.putconn(held)
        assert runs == []
        with twiceshy.run("held"):
            assert charge(1) == "ch_1"
        assert runs == [1]
    finally:
        ledger.close()


@pytest.mark.postgres
def test_async_postgres_pool_timeout_fails_before_the_claim(pg_url: str) -> None:
    """The async store's pool of one loop, held: StoreUnavailable naming pool_size=, no run."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{pg_url}&pool_size=1&pool_timeout=0.2", counts_interval=None)
    _, acharge = counted(ledger, runs)

    async def main() -> None:
        store = ledger.async_store
        assert isinstance(store, AsyncPostgresStore)
        try:
            state = await store._state()
            held = await state.pool.getconn()
            try:
                with twiceshy.run("held"), pytest.raises(StoreUnavailable, match="pool_size="):
                    await acharge(1)
            finally:
                await state.pool.putconn(held)
            assert runs == []
        finally:
            await store.close()

    try:
        asyncio.run(main())
    finally:
        ledger.close()


@pytest.mark.postgres
def test_postgres_pool_options_are_checked(pg_url: str) -> None:
    """pool_size= and pool_timeout= are checked, and the size is the pool's."""
    with pytest.raises(ValueError, match="pool_size"):
        open_postgres(f"{pg_url}&pool_size=0")
    with pytest.raises(ValueError, match="pool_timeout"):
        open_postgres(f"{pg_url}&pool_timeout=0")
    with pytest.raises(ValueError, match="pool_timeout"):
        open_postgres(f"{pg_url}&pool_timeout=soon")
    store, twin = open_postgres(f"{pg_url}&pool_size=3")
    try:
        assert store._settings.max_size == twin._settings.max_size == 3
        assert store._settings.pool_timeout == 10.0
    finally:
        store.close()


# -- Redis -----------------------------------------------------------------------------------


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A ledger URL under a key prefix of this test's own, whose keys are deleted afterwards."""
    url = servers.require("redis")
    prefix = f"twiceshy-test:{secrets.token_hex(6)}"
    yield f"{url}?prefix={prefix}"
    servers.delete_prefix(url, prefix)


def pool_of(client: Any) -> Any:
    """The connection pool of a single server's client (a cluster's has one per node)."""
    return client.connection_pool


def connections_of(pool: Any) -> int:
    """How many connections a redis-py pool (blocking or asyncio) has made and kept."""
    return len(pool._available_connections) + len(pool._in_use_connections)


@pytest.mark.redis
def test_redis_async_burst_past_the_default_pool_waits(redis_url: str) -> None:
    """150 async tasks at once, past redis-py's 100 connections: all answer, none raises
    "Too many connections", each tool runs once, and the loop's pool stays within 100."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(redis_url, counts_interval=None)
    _, acharge = counted(ledger, runs)

    async def main() -> list[Any]:
        store = ledger.async_store
        assert isinstance(store, AsyncRedisStore)
        try:
            answers = await burst_tasks(acharge, 150)
            [entry] = store._clients.values()
            assert connections_of(pool_of(entry.client)) <= 100
            return answers
        finally:
            await store.close()

    try:
        assert asyncio.run(main()) == [f"ch_{i}" for i in range(150)]
        assert sorted(runs) == list(range(150))
    finally:
        ledger.close()


@pytest.mark.redis
def test_redis_threads_past_the_pool_wait_and_run_once(redis_url: str) -> None:
    """24 threads on pool_size=2: every call answers, each tool once, two connections at most."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{redis_url}&pool_size=2&pool_timeout=30", counts_interval=None)
    try:
        store = ledger.store
        assert isinstance(store, RedisStore)
        charge, _ = counted(ledger, runs)
        assert burst_threads(charge, THREADS) == [f"ch_{i}" for i in range(THREADS)]
        assert sorted(runs) == list(range(THREADS))
        assert store._core.pool.max_connections == 2
        assert connections_of(store._core.pool) <= 2
    finally:
        ledger.close()


@pytest.mark.redis
def test_redis_tasks_past_the_pool_wait_and_run_once(redis_url: str) -> None:
    """40 async tasks on pool_size=3: every call answers, each tool once, three connections."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{redis_url}&pool_size=3", counts_interval=None)
    _, acharge = counted(ledger, runs)

    async def main() -> list[Any]:
        store = ledger.async_store
        assert isinstance(store, AsyncRedisStore)
        try:
            answers = await burst_tasks(acharge, TASKS)
            [entry] = store._clients.values()
            assert connections_of(pool_of(entry.client)) <= 3
            return answers
        finally:
            await store.close()

    try:
        assert asyncio.run(main()) == [f"ch_{i}" for i in range(TASKS)]
        assert sorted(runs) == list(range(TASKS))
    finally:
        ledger.close()


@pytest.mark.redis
def test_redis_pool_timeout_fails_before_the_claim(redis_url: str) -> None:
    """Every place of the pool taken: the call raises StoreUnavailable naming pool_size= after
    pool_timeout, its tool not run; once a place is free the same call runs."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{redis_url}&pool_size=1&pool_timeout=0.2", counts_interval=None)
    try:
        store = ledger.store
        assert isinstance(store, RedisStore)
        charge, _ = counted(ledger, runs)
        assert store._core.gate.enter()
        try:
            with twiceshy.run("held"), pytest.raises(StoreUnavailable, match="pool_size="):
                charge(1)
        finally:
            store._core.gate.leave()
        assert runs == []
        with twiceshy.run("held"):
            assert charge(1) == "ch_1"
        assert runs == [1]
    finally:
        ledger.close()


@pytest.mark.redis
def test_async_redis_pool_timeout_fails_before_the_claim(redis_url: str) -> None:
    """The same for an async store's loop: StoreUnavailable naming pool_size=, no run."""
    runs: list[int] = []
    ledger = twiceshy.Ledger(f"{redis_url}&pool_size=1&pool_timeout=0.2", counts_interval=None)
    _, acharge = counted(ledger, runs)

    async def main() -> None:
        store = ledger.async_store
        assert isinstance(store, AsyncRedisStore)
        try:
            entry = await store._loop_client()
            assert await entry.gate.enter()
            try:
                with twiceshy.run("held"), pytest.raises(StoreUnavailable, match="pool_size="):
                    await acharge(1)
            finally:
                entry.gate.leave()
            assert runs == []
            with twiceshy.run("held"):
                assert await acharge(1) == "ch_1"
        finally:
            await store.close()

    try:
        asyncio.run(main())
        assert runs == [1]
    finally:
        ledger.close()


@pytest.mark.redis
def test_redis_pool_options_are_parsed_and_checked(redis_url: str) -> None:
    """pool_size= and pool_timeout= are twiceshy's; redis-py's max_connections= is refused."""
    plain, options = split_url(f"{redis_url}&pool_size=7&pool_timeout=2.5&client_name=x")
    assert options["pool_size"] == 7
    assert options["pool_timeout"] == 2.5
    assert "pool_" not in plain
    with pytest.raises(ValueError, match="pool_size"):
        RedisStore.from_url(f"{redis_url}&pool_size=0")
    with pytest.raises(ValueError, match="pool_timeout"):
        RedisStore.from_url(f"{redis_url}&pool_timeout=0")
    with pytest.raises(ValueError, match="pool_size"):
        RedisStore.from_url(f"{redis_url}&max_connections=5")
    with pytest.raises(ValueError, match="not a number"):
        split_url(f"{redis_url}&pool_size=many")
