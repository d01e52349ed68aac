"""Shared fixtures: a fake clock and a store of every kind, built on that clock, blocking or
async."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import servers
from awaited_store import AwaitedStore
from fake_clock import FakeClock
from twiceshy.stores import AsyncStore, Store, ThreadedAsyncStore
from twiceshy.stores.memory import MemoryStore
from twiceshy.stores.sqlite import SQLiteStore

SERVERS = ("postgres", "redis", "dynamodb")
#: The marker of each server store's tests: a cluster's are Redis tests, a pooler's PostgreSQL's.
SERVER_MARKS = {"redis-cluster": "redis", "pgbouncer": "postgres"}

#: A store opened for a test: the blocking store, its async twin (as ``open_store`` pairs them),
#: and how to clean up after both.
Opened = tuple[Store, AsyncStore, Callable[[], None]]
Factory = Callable[[FakeClock, Path], Opened]


def _memory(clock: FakeClock, tmp_path: Path) -> Opened:
    store = MemoryStore(clock=clock)
    return store, ThreadedAsyncStore(store, threaded=False), store.close


def _sqlite(clock: FakeClock, tmp_path: Path) -> Opened:
    store = SQLiteStore(tmp_path / "ledger.db", clock=clock)
    return store, ThreadedAsyncStore(store), store.close


def _postgres(clock: FakeClock, tmp_path: Path) -> Opened:
    """A PostgreSQL store in a schema of its own, dropped afterwards."""
    url = servers.require("postgres")

    from twiceshy.stores.postgres import AsyncPostgresStore, PostgresStore

    schema = f"twiceshy_test_{secrets.token_hex(6)}"
    store = PostgresStore(url, schema=schema, clock=clock)
    twin = AsyncPostgresStore(url, schema=schema, clock=clock)  # connects on first use

    def cleanup() -> None:
        store.close()
        servers.drop_schema(url, schema)

    return store, twin, cleanup


def _redis(clock: FakeClock, tmp_path: Path) -> Opened:
    """A Redis store under a key prefix of its own, whose keys are deleted afterwards."""
    url = servers.require("redis")

    from twiceshy.stores.redis import AsyncRedisStore, RedisStore

    prefix = f"twiceshy-test:{secrets.token_hex(6)}"
    store = RedisStore(url, prefix=prefix, clock=clock)

    def cleanup() -> None:
        store.close()  # and its twin's subscriber with it
        servers.delete_prefix(url, prefix)

    return store, AsyncRedisStore.twin(store), cleanup


def _pgbouncer(clock: FakeClock, tmp_path: Path) -> Opened:
    """A PostgreSQL store through PgBouncer (transaction pooling), in a schema of its own."""
    url = servers.require("pgbouncer")

    from twiceshy.stores.postgres import AsyncPostgresStore, PostgresStore

    schema = f"twiceshy_test_{secrets.token_hex(6)}"
    store = PostgresStore(url, schema=schema, clock=clock, wakeups="poll")
    twin = AsyncPostgresStore(url, schema=schema, clock=clock, wakeups="poll")

    def cleanup() -> None:
        store.close()
        servers.drop_schema(url, schema)

    return store, twin, cleanup


def _redis_cluster(clock: FakeClock, tmp_path: Path) -> Opened:
    """A Redis Cluster store under a key prefix of its own, whose keys are deleted afterwards."""
    url = servers.require("redis-cluster")

    from twiceshy.stores.redis import AsyncRedisClusterStore, RedisClusterStore

    prefix = f"twiceshy-test:{secrets.token_hex(6)}"
    store = RedisClusterStore(url, prefix=prefix, clock=clock)

    def cleanup() -> None:
        store.close()
        servers.delete_prefix(url, prefix)

    return store, AsyncRedisClusterStore.twin(store), cleanup


def _dynamodb(clock: FakeClock, tmp_path: Path) -> Opened:
    """A DynamoDB store in the shared test table under a key prefix of its own, whose items
    are deleted afterwards."""
    endpoint = servers.require("dynamodb")

    from twiceshy.stores.dynamodb import AsyncDynamoDBStore, DynamoDBStore

    prefix = f"twiceshy-test-{secrets.token_hex(6)}"
    store = DynamoDBStore(
        servers.DYNAMODB_TABLE,
        endpoint_url=endpoint,
        prefix=prefix,
        clock=clock,
        **servers.DYNAMODB_OPTIONS,
    )

    def cleanup() -> None:
        store.close()  # and its twin with it
        servers.delete_dynamodb_prefix(prefix)

    return store, AsyncDynamoDBStore.twin(store), cleanup


#: Every store the contract suite runs against: name -> factory(clock, tmp_path), which answers
#: the store, its async twin and how to clean up after them. The server stores skip (fail in
#: CI) without a server.
STORE_FACTORIES: dict[str, Factory] = {
    "memory": _memory,
    "sqlite": _sqlite,
    "postgres": _postgres,
    "redis": _redis,
    "redis-cluster": _redis_cluster,
    "pgbouncer": _pgbouncer,
    "dynamodb": _dynamodb,
}


def _marks(name: str) -> list[pytest.MarkDecorator]:
    name = SERVER_MARKS.get(name, name)
    return [getattr(pytest.mark, name)] if name in SERVERS else []


STORE_PARAMS = [pytest.param(name, id=name, marks=_marks(name)) for name in STORE_FACTORIES]

#: Each store kind blocking (``memory``, ...) and then its async twin (``memory-async``, ...).
TWIN_PARAMS = [
    pytest.param((name, twin), id=f"{name}-async" if twin else name, marks=_marks(name))
    for twin in (False, True)
    for name in STORE_FACTORIES
]


@pytest.fixture
def clock() -> FakeClock:
    """A fake store clock, starting at a fixed instant."""
    return FakeClock()


@pytest.fixture(params=STORE_PARAMS)
def store(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[Store]:
    """Each store kind in turn, on the fake clock; cleaned up afterwards."""
    opened, _, cleanup = STORE_FACTORIES[request.param](clock, tmp_path)
    yield opened
    cleanup()


@pytest.fixture(params=TWIN_PARAMS)
def store_or_twin(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[Store]:
    """Each store kind in turn, blocking and then its async twin behind :class:`AwaitedStore`
    (the store contract suite's stores), on the fake clock; cleaned up afterwards."""
    name, twin = request.param
    opened, async_twin, cleanup = STORE_FACTORIES[name](clock, tmp_path)
    try:
        if not twin:
            yield opened
            return
        awaited = AwaitedStore(async_twin, opened)
        try:
            yield awaited
        finally:
            awaited.close()
    finally:
        cleanup()


@pytest.fixture
def pg() -> Iterator[tuple[str, str]]:
    """The PostgreSQL server's URL and a fresh schema name; the schema is dropped afterwards."""
    url = servers.require("postgres")
    schema = f"twiceshy_test_{secrets.token_hex(6)}"
    yield url, schema
    servers.drop_schema(url, schema)


# With `pytest -n 2 --dist loadscope` (the README's test command), every test that uses the shared
# Redis or Redis Cluster runs in one scope, in order, in one worker: some of them kill a cluster
# node or lower the server's maxmemory, which another test of those servers must never meet. Every
# other module is a scope of its own, sent to whichever worker is free: those tests use SQLite
# files, tables, key prefixes and engine servers of their own.
_REDIS_MODULES = frozenset(
    f"tests/{name}.py"
    for name in (
        "test_cli",
        "test_concurrency",
        "test_pools",
        "test_reconcile",
        "test_redis_cluster",
        "test_redis_faults",
        "test_redis_store",
        "test_secrets",
    )
)
"""Modules whose tests use Redis directly, not only through a parametrized store."""


@pytest.hookimpl(optionalhook=True)  # an xdist hook: no such hook where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByServers(LoadScopeScheduling):
        """One scope for every test of the shared Redis servers; a scope per module else."""

        def _split_scope(self, nodeid: str) -> str:
            module, _, rest = nodeid.partition("::")
            if module in _REDIS_MODULES or "redis" in rest.partition("[")[2]:
                return "redis"
            return module

    return ByServers(config, log)
