"""One ledger and one scope shared by concurrent tasks, event loops and threads, on every store:
one execution, each caller its own answer; and a ledger after ``aclose()`` runs nothing."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import servers
import twiceshy
from twiceshy.errors import StoreError

PG = servers.POSTGRES_URL


REDIS = servers.REDIS_URL


def test_one_run_object_serves_concurrent_tasks() -> None:
    """A scope made once and entered by parallel tool calls gives each its scope back."""
    scope = twiceshy.run("run-1")

    async def call(delay: float) -> str | None:
        async with scope:
            await asyncio.sleep(delay)
            inside = twiceshy.current_scope()
        assert twiceshy.current_scope() is None
        return inside

    async def main() -> list[str | None]:
        return await asyncio.gather(call(0.05), call(0.1))

    assert asyncio.run(main()) == ["run-1", "run-1"]
    with scope, twiceshy.run("inner"):
        assert twiceshy.current_scope() == "inner"
    assert twiceshy.current_scope() is None


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    tag = f"adv2_{uuid.uuid4().hex[:10]}"
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
    elif request.param == "postgres":
        yield f"{PG}?schema={tag}"
        import psycopg

        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{tag}" CASCADE')
    else:
        yield f"{REDIS}?prefix={tag}"
        import redis

        client = redis.Redis.from_url(REDIS)
        names = list(client.scan_iter(match=f"{tag}:*"))
        if names:
            client.delete(*names)
        client.close()


def test_one_ledger_serves_repeated_asyncio_runs_and_threads_with_their_own_loops(
    url: str,
) -> None:
    """Many loops (asyncio.run again and again, in threads) on one ledger: one execution."""
    ledger = twiceshy.Ledger(url, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, name="pay", lease=5.0, wait=5.0)
    async def pay(n: int) -> int:
        runs.append(n)
        await asyncio.sleep(0.2)
        return n

    async def once(run_id: str) -> int:
        with twiceshy.run(run_id):
            return await pay(1)

    answers: list[Any] = []

    def in_a_thread() -> None:
        try:
            answers.append(asyncio.run(once("fresh")))
        except Exception as exc:  # reported below
            answers.append(exc)

    threads = [threading.Thread(target=in_a_thread) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert answers == [1] * 6
    assert [asyncio.run(once("fresh")) for _ in range(3)] == [1, 1, 1]
    assert runs == [1]
    asyncio.run(ledger.aclose())


def test_a_ledger_used_after_aclose_refuses_and_runs_nothing(url: str) -> None:
    """After aclose() a call fails with StoreError within bounded time and nothing runs."""
    ledger = twiceshy.Ledger(url, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, name="pay")
    async def pay(n: int) -> int:
        runs.append(n)
        return n

    async def main() -> None:
        with twiceshy.run("r"):
            assert await pay(1) == 1
        await ledger.aclose()
        with twiceshy.run("r"):
            if url != "memory://":
                with pytest.raises(StoreError):
                    await asyncio.wait_for(pay(2), 10)

    asyncio.run(main())
    assert runs == [1]
