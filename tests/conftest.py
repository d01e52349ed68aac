"""Shared fixtures: a fake clock and a store of every kind, built on that clock."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import servers
from twiceshy.stores import Store
from twiceshy.stores.memory import MemoryStore
from twiceshy.stores.sqlite import SQLiteStore


class FakeClock:
    """A store clock that moves only when told to (seconds since the epoch)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds


SERVERS = ("postgres", "redis")

Factory = Callable[[FakeClock, Path], tuple[Store, Callable[[], None]]]


def _memory(clock: FakeClock, tmp_path: Path) -> tuple[Store, Callable[[], None]]:
    store = MemoryStore(clock=clock)
    return store, store.close


def _sqlite(clock: FakeClock, tmp_path: Path) -> tuple[Store, Callable[[], None]]:
    store = SQLiteStore(tmp_path / "ledger.db", clock=clock)
    return store, store.close


def _postgres(clock: FakeClock, tmp_path: Path) -> tuple[Store, Callable[[], None]]:
    """A PostgreSQL store in a schema of its own, dropped afterwards."""
    url = servers.require("postgres")

    from twiceshy.stores.postgres import PostgresStore

    schema = f"twiceshy_test_{secrets.token_hex(6)}"
    store = PostgresStore(url, schema=schema, clock=clock)

    def cleanup() -> None:
        store.close()
        servers.drop_schema(url, schema)

    return store, cleanup


def _redis(clock: FakeClock, tmp_path: Path) -> tuple[Store, Callable[[], None]]:
    """A Redis store under a key prefix of its own, whose keys are deleted afterwards."""
    url = servers.require("redis")

    from twiceshy.stores.redis import RedisStore

    prefix = f"twiceshy-test:{secrets.token_hex(6)}"
    store = RedisStore(url, prefix=prefix, clock=clock)

    def cleanup() -> None:
        store.close()
        servers.delete_prefix(url, prefix)

    return store, cleanup


#: Every store the contract suite runs against: name -> factory(clock, tmp_path), which answers
#: the store and how to clean up after it. The server stores skip (fail in CI) without a server.
STORE_FACTORIES: dict[str, Factory] = {
    "memory": _memory,
    "sqlite": _sqlite,
    "postgres": _postgres,
    "redis": _redis,
}

STORE_PARAMS = [
    pytest.param(name, id=name, marks=[getattr(pytest.mark, name)] if name in SERVERS else [])
    for name in STORE_FACTORIES
]


@pytest.fixture
def clock() -> FakeClock:
    """A fake store clock, starting at a fixed instant."""
    return FakeClock()


@pytest.fixture(params=STORE_PARAMS)
def store(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[Store]:
    """Each store kind in turn, on the fake clock; cleaned up afterwards."""
    opened, cleanup = STORE_FACTORIES[request.param](clock, tmp_path)
    yield opened
    cleanup()


@pytest.fixture
def pg() -> Iterator[tuple[str, str]]:
    """The PostgreSQL server's URL and a fresh schema name; the schema is dropped afterwards."""
    url = servers.require("postgres")
    schema = f"twiceshy_test_{secrets.token_hex(6)}"
    yield url, schema
    servers.drop_schema(url, schema)
