"""Shared fixtures: a fake clock and a store of every kind, built on that clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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


def _memory(clock: FakeClock, tmp_path: Path) -> Store:
    return MemoryStore(clock=clock)


def _sqlite(clock: FakeClock, tmp_path: Path) -> Store:
    return SQLiteStore(tmp_path / "ledger.db", clock=clock)


#: Every store the contract suite runs against: name -> factory(clock, tmp_path).
#: A new store adds itself here (with marks, e.g. ``pytest.mark.postgres``, via STORE_PARAMS).
STORE_FACTORIES: dict[str, Callable[[FakeClock, Path], Store]] = {
    "memory": _memory,
    "sqlite": _sqlite,
}

STORE_PARAMS = [pytest.param(name, id=name) for name in STORE_FACTORIES]


@pytest.fixture
def clock() -> FakeClock:
    """A fake store clock, starting at a fixed instant."""
    return FakeClock()


@pytest.fixture(params=STORE_PARAMS)
def store(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[Store]:
    """Each store kind in turn, on the fake clock; closed afterwards."""
    opened = STORE_FACTORIES[request.param](clock, tmp_path)
    yield opened
    opened.close()
