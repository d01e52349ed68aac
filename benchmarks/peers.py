"""twiceshy beside its peers, on every store they share, at the same durability, in one run.

    python benchmarks/peers.py [--quick] [--rounds N] [--calls N] [--budget SECONDS] [--pin]
                               [--json PATH]

Each library protects the same tool the way its own documentation shows, with its own defaults:
a function ``charge(amount, customer)`` returning a small dict, keyed by its arguments within a
scope (a run). A *first call* is a new intent (claim, run, record the outcome); a *replay* is a
retry of an intent already settled. The tool does nothing, so what is measured is each library's
own cost on the store.

- **twiceshy**: ``@ledger.tool(effect=KEYED)``, the scope from ``twiceshy.run(...)``.
- **agent-once** (``once``): ``@once.tool``, the scope from ``once.scope(...)``; SQLite
  (``Once(path)``: WAL, which it sets, and SQLite's default ``synchronous``, FULL) and
  PostgreSQL (``PostgresStore``, autocommit). Synchronous only (its async path runs the same
  store calls in worker threads).
- **idemkit**: ``idempotent_sync`` (the sync facade: the async core on a shared background loop)
  and ``idempotent`` (async), ``MethodConfig(scope=...)`` with an ambient scope read from a
  context variable; ``RedisBackend`` (Lua scripts on redis.asyncio) and ``PostgresBackend``
  (asyncpg, its table made by ``init_pg``).
- **Powertools** for AWS Lambda: ``idempotent_function`` with its Redis persistence layer,
  outside Lambda (``ssl=False``, boto3 importable); it keys one keyword argument, so the scope
  travels inside the data.

Durability is the same within each comparison, and printed: on PostgreSQL every library commits
with the server's ``synchronous_commit`` (none of them changes it); on Redis every library writes
to the same server, whose persistence settings are printed; on SQLite agent-once runs WAL with
``synchronous=FULL``, so twiceshy runs twice: with its default on this SQLite (the rollback
journal with EXTRA where the SQLite has the WAL-reset bug, see docs/stores/sqlite.md) and with
``?journal_mode=wal`` (WAL with FULL, agent-once's durability), and agent-once is compared with
the second. Every ratio is peer / twiceshy in the same group: above 1, twiceshy is faster.

The cases take turns, round by round (the order rotated each round); every loop is bounded in
count and by ``--budget`` seconds. Only 127.0.0.1 is used; everything the run creates (a
PostgreSQL schema, Redis key prefixes, a temporary directory) is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psycopg
import redis

import twiceshy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import POSTGRES, REDIS, Placement, powertools, protected, scoped_calls

SyncCall = Callable[[int], object]
AsyncCall = Callable[[int], Awaitable[object]]


@dataclass
class Case:
    """One library on one store through one API: its first call and its replay."""

    store: str
    api: str  # "sync" or "async"
    durability: str
    impl: str
    first: Any  # SyncCall or AsyncCall
    replay: Any
    times: dict[str, list[int]] = field(default_factory=lambda: {"first": [], "replay": []})
    commands: tuple[float, float] | None = None  # Redis commands per call (first, replay)

    @property
    def group(self) -> tuple[str, str, str]:
        return (self.store, self.api, self.durability)


# ---------------------------------------------------------------------------------------------
# The libraries, each used as its documentation shows.


def twiceshy_cases(url: str) -> tuple[twiceshy.Ledger, SyncCall, SyncCall, AsyncCall, AsyncCall]:
    """(ledger, sync first, sync replay, async first, async replay) on the ledger at ``url``."""
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.KEYED)
    async def acharge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    first, replay = protected(ledger)
    return ledger, first, replay, *ascoped_calls(twiceshy.run, acharge)


def ascoped_calls(
    scope: Callable[[str], contextlib.AbstractContextManager[object]],
    charge: Callable[[int, str], Awaitable[object]],
) -> tuple[AsyncCall, AsyncCall]:
    """:func:`servers.scoped_calls` for an async ``charge`` (its replay's run has its outcome
    from the warm-up of :func:`measure`)."""
    tag = secrets.token_hex(4)
    counter = iter(range(10**9))

    async def first(i: int) -> object:
        with scope(f"{tag}-{next(counter)}"):
            return await charge(4900, "cus_1")

    async def replay(i: int) -> object:
        with scope(f"{tag}-replay"):
            return await charge(4900, "cus_1")

    return first, replay


def agent_once_cases(target: Any) -> tuple[Any, SyncCall, SyncCall]:
    """(Once, first, replay) of agent-once on a SQLite path or a PostgresStore."""
    from once import Once

    once = Once(target) if isinstance(target, str) else Once(store=target)

    @once.tool
    def charge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    first, replay = scoped_calls(once.scope, charge)
    return once, first, replay


_IDEMKIT_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar("idemkit_scope")


def _ambient_scope() -> str:
    return _IDEMKIT_SCOPE.get()


# idemkit documents an ambient scope as a zero-argument callable (it checks the arity); its
# MethodConfig annotation (1.0.2) names only the one-argument form.
IDEMKIT_SCOPE = cast("Callable[[Any], Any]", _ambient_scope)


@contextlib.contextmanager
def idemkit_scope(value: str) -> Iterator[None]:
    token = _IDEMKIT_SCOPE.set(value)
    try:
        yield
    finally:
        _IDEMKIT_SCOPE.reset(token)


def idemkit_sync_cases(backend: Any) -> tuple[SyncCall, SyncCall]:
    """(first, replay) of idemkit's ``idempotent_sync`` on ``backend``."""
    from idemkit import MethodConfig, idempotent_sync

    config = MethodConfig(scope=IDEMKIT_SCOPE)

    @idempotent_sync(backend=backend, config=config)  # type: ignore[untyped-decorator]
    def charge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    return scoped_calls(idemkit_scope, charge)


def idemkit_async_cases(
    backend: Any, loop: asyncio.AbstractEventLoop
) -> tuple[AsyncCall, AsyncCall]:
    """(first, replay) of idemkit's async ``idempotent`` on ``backend`` (bound to ``loop``)."""
    from idemkit import MethodConfig, idempotent

    config = MethodConfig(scope=IDEMKIT_SCOPE)

    @idempotent(backend=backend, config=config)  # type: ignore[untyped-decorator]
    async def charge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    first, replay = ascoped_calls(idemkit_scope, charge)
    loop.run_until_complete(replay(0))
    return first, replay


# ---------------------------------------------------------------------------------------------
# Durability, as each store runs it.


def postgres_settings() -> str:
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        commit = conn.execute("SHOW synchronous_commit").fetchone()
        fsync = conn.execute("SHOW fsync").fetchone()
    assert commit is not None
    assert fsync is not None
    return f"synchronous_commit={commit[0]}, fsync={fsync[0]}"


def redis_settings() -> str:
    client = redis.Redis.from_url(REDIS)
    try:
        aof = client.config_get("appendonly")["appendonly"]
        fsync = client.config_get("appendfsync")["appendfsync"]
        save = client.config_get("save")["save"]
    finally:
        client.close()
    return f"appendonly={aof} (appendfsync={fsync}), save='{save}'"


def redis_commands(
    client: redis.Redis,
    fn: SyncCall | None,
    afn: AsyncCall | None,
    loop: asyncio.AbstractEventLoop,
    calls: int = 10,
) -> float:
    """Commands the Redis server processed per call of ``fn`` (or ``afn``), this run's only
    client being quiet meanwhile (other sessions may add a few)."""
    before = int(client.info("stats")["total_commands_processed"])
    for i in range(calls):
        if fn is not None:
            fn(i)
        else:
            assert afn is not None
            loop.run_until_complete(afn(i))
    after = int(client.info("stats")["total_commands_processed"])
    return (after - before - 1) / calls  # the first INFO counts itself after it is read


def closing(
    run: Callable[[Any], object], make: Callable[[], Awaitable[object]]
) -> Callable[[], object]:
    """A closer that runs ``make()`` with ``run`` (a loop's ``run_until_complete``, say)."""
    return lambda: run(make())


# ---------------------------------------------------------------------------------------------
# Timing.


def timed(fn: SyncCall, calls: int, into: list[int]) -> None:
    for i in range(calls):
        start = time.perf_counter_ns()
        fn(i)
        into.append(time.perf_counter_ns() - start)


async def atimed(fn: AsyncCall, calls: int, into: list[int]) -> None:
    for i in range(calls):
        start = time.perf_counter_ns()
        await fn(i)
        into.append(time.perf_counter_ns() - start)


def measure(
    cases: list[Case],
    loop: asyncio.AbstractEventLoop,
    rounds: int,
    calls: int,
    budget: float,
    placement: Placement,
) -> int:
    """Time every case, round by round; answer the rounds run (at least one)."""
    for case in cases:  # warm up: every pool has its connections, every script is loaded
        for op in ("first", "replay"):
            if case.api == "sync":
                timed(getattr(case, op), 5, [])
            else:
                loop.run_until_complete(atimed(getattr(case, op), 5, []))
    placement.pin()
    deadline = time.monotonic() + budget
    done = 0
    for r in range(rounds):
        if done and time.monotonic() > deadline:
            break
        shift = r % len(cases)
        for case in cases[shift:] + cases[:shift]:
            for op in ("first", "replay"):
                fn, into = getattr(case, op), case.times[op]
                if case.api == "sync":
                    timed(fn, calls, into)
                else:
                    loop.run_until_complete(atimed(fn, calls, into))
        done += 1
    return done


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 calls: a smoke run")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (default 15)")
    parser.add_argument(
        "--calls", type=int, default=30, help="calls per case per round (default 30)"
    )
    parser.add_argument(
        "--budget", type=float, default=240.0, help="stop starting rounds after this many seconds"
    )
    parser.add_argument(
        "--pin", action="store_true", help="this process on one CPU, the servers on the others"
    )
    parser.add_argument("--json", type=Path, help="also write the medians to this file")
    args = parser.parse_args()
    rounds, calls = (2, 10) if args.quick else (max(1, args.rounds), max(1, min(args.calls, 1000)))

    tag = secrets.token_hex(4)
    schema = f"twiceshy_peers_{tag}"
    prefix = f"twiceshy-peers-{tag}"
    workdir = tempfile.mkdtemp(prefix="twiceshy-peers-")
    loop = asyncio.new_event_loop()
    placement = Placement(args.pin)
    admin = psycopg.connect(POSTGRES, autocommit=True)
    client = redis.Redis.from_url(REDIS)
    closers: list[Callable[[], object]] = []
    cases: list[Case] = []
    try:
        from idemkit.backends.postgres import PostgresBackend, init_pg
        from idemkit.backends.redis import RedisBackend
        from idemkit.core.sync_bridge import run_sync
        from once.postgres import PostgresStore

        # SQLite: twiceshy's default here, twiceshy in WAL, agent-once (WAL, its own setting).
        default_path = os.path.join(workdir, "twiceshy-default.db")
        wal_path = os.path.join(workdir, "twiceshy-wal.db")
        once_path = os.path.join(workdir, "once.db")
        for _path, url in (
            (default_path, f"sqlite:///{default_path}"),
            (wal_path, f"sqlite:///{wal_path}?journal_mode=wal"),
        ):
            ledger, first, replay, _, _ = twiceshy_cases(url)
            closers.append(ledger.close)
            store: Any = ledger.store
            durability = f"{store.journal_mode}, synchronous={store.synchronous}"
            cases.append(Case("sqlite", "sync", durability, "twiceshy", first, replay))
        once, first, replay = agent_once_cases(once_path)
        closers.append(once.close)
        # agent-once sets no synchronous level: its connections run SQLite's default.
        conn = once.store._conn()
        level = ("OFF", "NORMAL", "FULL", "EXTRA")[conn.execute("PRAGMA synchronous").fetchone()[0]]
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        cases.append(
            Case("sqlite", "sync", f"{mode}, synchronous={level}", "agent-once", first, replay)
        )

        # PostgreSQL: one schema holds every library's table.
        pg = postgres_settings()
        admin.execute(f"CREATE SCHEMA {schema}")
        ledger, first, replay, afirst, areplay = twiceshy_cases(f"{POSTGRES}?schema={schema}")
        closers.append(closing(loop.run_until_complete, ledger.aclose))
        cases.append(Case("postgres", "sync", pg, "twiceshy", first, replay))
        cases.append(Case("postgres", "async", pg, "twiceshy", afirst, areplay))
        once, first, replay = agent_once_cases(PostgresStore(POSTGRES, table=f"{schema}.effects"))
        closers.append(once.close)
        cases.append(Case("postgres", "sync", pg, "agent-once", first, replay))
        idemkit_url = f"{POSTGRES}?search_path={schema}"  # asyncpg: a server setting
        loop.run_until_complete(init_pg(idemkit_url))
        sync_pg = PostgresBackend.from_url(idemkit_url)
        first, replay = idemkit_sync_cases(sync_pg)
        closers.append(closing(run_sync, sync_pg.aclose))
        cases.append(Case("postgres", "sync", pg, "idemkit", first, replay))
        async_pg = PostgresBackend.from_url(idemkit_url)
        afirst, areplay = idemkit_async_cases(async_pg, loop)
        closers.append(closing(loop.run_until_complete, async_pg.aclose))
        cases.append(Case("postgres", "async", pg, "idemkit", afirst, areplay))

        # Redis: every library on the same server, each under a prefix of this run's.
        rd = redis_settings()
        ledger, first, replay, afirst, areplay = twiceshy_cases(f"{REDIS}?prefix={prefix}")
        closers.append(closing(loop.run_until_complete, ledger.aclose))
        cases.append(Case("redis", "sync", rd, "twiceshy", first, replay))
        cases.append(Case("redis", "async", rd, "twiceshy", afirst, areplay))
        _, first, replay = powertools(local_cache=False, prefix=f"{prefix}-powertools")
        cases.append(Case("redis", "sync", rd, "Powertools", first, replay))
        sync_redis = RedisBackend.from_url(REDIS, namespace=f"{prefix}-idemkit")
        first, replay = idemkit_sync_cases(sync_redis)
        closers.append(closing(run_sync, sync_redis.aclose))
        cases.append(Case("redis", "sync", rd, "idemkit", first, replay))
        async_redis = RedisBackend.from_url(REDIS, namespace=f"{prefix}-idemkit-async")
        afirst, areplay = idemkit_async_cases(async_redis, loop)
        closers.append(closing(loop.run_until_complete, async_redis.aclose))
        cases.append(Case("redis", "async", rd, "idemkit", afirst, areplay))

        for case in cases:
            if case.store == "redis":
                sync = case.api == "sync"
                case.commands = (
                    redis_commands(
                        client, case.first if sync else None, None if sync else case.first, loop
                    ),
                    redis_commands(
                        client, case.replay if sync else None, None if sync else case.replay, loop
                    ),
                )
        load = os.getloadavg()[0]
        started = time.monotonic()
        done = measure(cases, loop, rounds, calls, args.budget, placement)
        elapsed = time.monotonic() - started
    finally:
        placement.restore()
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()
        loop.close()
        admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.close()
        for key in list(client.scan_iter(match=f"{prefix}*", count=1000)):
            client.delete(key)
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report(cases, done, calls, load, os.getloadavg()[0], elapsed, args.json)


def report(
    cases: list[Case],
    rounds: int,
    calls: int,
    load_before: float,
    load_after: float,
    elapsed: float,
    out: Path | None,
) -> None:
    """Print the table: per-call medians and each peer's ratio to twiceshy in its group."""
    import sqlite3 as sqlite_module

    medians = {
        id(case): {op: statistics.median(t) / 1000 for op, t in case.times.items()}
        for case in cases
    }
    ours = {case.group: medians[id(case)] for case in cases if case.impl == "twiceshy"}
    print(
        f"median per call in microseconds; {rounds} rounds of {calls} calls per case, interleaved;"
        f" {elapsed:.0f} s; load average {load_before:.2f} before, {load_after:.2f} after"
    )
    print(f"SQLite {sqlite_module.sqlite_version}; Python {sys.version.split()[0]}")
    header = (
        f"{'store':<9} {'api':<6} {'library':<11} {'first':>7} {'peer/ts':>8} {'replay':>7}"
        f" {'peer/ts':>8} {'cmds':>8}  durability"
    )
    print(header)
    print("-" * (len(header) + 40))
    rows: list[dict[str, Any]] = []
    for case in cases:
        m = medians[id(case)]
        base = ours.get(case.group)
        ratio_first = m["first"] / base["first"] if base and case.impl != "twiceshy" else None
        ratio_replay = m["replay"] / base["replay"] if base and case.impl != "twiceshy" else None
        cmds = f"{case.commands[0]:.0f}/{case.commands[1]:.0f}" if case.commands else ""
        print(
            f"{case.store:<9} {case.api:<6} {case.impl:<11} {m['first']:>7.0f}"
            f" {_ratio(ratio_first):>8} {m['replay']:>7.0f} {_ratio(ratio_replay):>8}"
            f" {cmds:>8}  {case.durability}"
        )
        rows.append(
            {
                "store": case.store,
                "api": case.api,
                "library": case.impl,
                "durability": case.durability,
                "first_us": m["first"],
                "replay_us": m["replay"],
                "first_ratio": ratio_first,
                "replay_ratio": ratio_replay,
                "commands": case.commands,
            }
        )
    print(
        "peer/ts: the peer's median over twiceshy's in the same store, api and durability (above 1:"
        " twiceshy is faster);\ncmds: Redis server commands per first call / replay, those run"
        " inside scripts included (total_commands_processed; other clients may add a few)."
    )
    behind = [
        f"{r['store']} {r['api']} {op} vs {r['library']} ({r[f'{op}_ratio']:.2f})"
        for r in rows
        for op in ("first", "replay")
        if r[f"{op}_ratio"] is not None and r[f"{op}_ratio"] < 1
    ]
    print("twiceshy behind: " + ("; ".join(behind) if behind else "nowhere"))
    if out is not None:
        out.write_text(json.dumps({"rounds": rounds, "calls": calls, "rows": rows}, indent=1))


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
