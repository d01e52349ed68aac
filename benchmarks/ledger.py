"""Per-call cost of a protected call on the memory and SQLite ledgers, beside the floor.

    python benchmarks/ledger.py [--quick] [--synchronous EXTRA|FULL|NORMAL|OFF]

A *first call* claims the key, runs the tool and records the outcome; a *replay* is a retry of an
intent already recorded. The floor is raw ``sqlite3`` doing the same transactions on the same
kind of file, with the ledger's own table and indexes and the same durability settings (journal
mode and ``synchronous``), writing the same rows (SHA-256 keys and fingerprints, owner tokens, the
result's JSON): two write transactions (insert the claim; update it with the outcome) for a first
call, one read by primary key for a replay. The tool itself does nothing, so what is measured is
twiceshy's own cost. Medians of per-call times; the machine is shared, so compare ratios within
one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import twiceshy
from twiceshy.stores.sqlite import _SCHEMA as SCHEMA
from twiceshy.stores.sqlite import SQLiteStore


def timed(fn: Callable[[int], object], calls: int, into: list[int]) -> None:
    """Time ``calls`` calls of ``fn`` one by one, appending nanoseconds to ``into``."""
    for i in range(calls):
        start = time.perf_counter_ns()
        fn(i)
        into.append(time.perf_counter_ns() - start)


def median_us(times: list[int]) -> float:
    """The median of nanosecond timings, in microseconds."""
    return statistics.median(times) / 1000


RESULT = {"id": "ch_1", "amount": 4900, "customer": "cus_1"}
"""What the benchmarked tool returns, and what the floor stores as its result."""

Case = tuple[Callable[[int], object] | None, Callable[[int], object], Callable[[], None]]


def protected(url: str, remember: int = 0) -> Case:
    """(first call, replay, close) of a KEYED tool on the ledger at ``url``."""
    ledger = twiceshy.Ledger(url, remember=remember)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int, customer: str) -> dict[str, object]:
        return dict(RESULT)

    prefix = f"bench-{time.time_ns()}"
    counter = iter(range(10**9))

    def first(i: int) -> object:
        with twiceshy.run(f"{prefix}-{next(counter)}"):
            return charge(4900, "cus_1")

    with twiceshy.run("bench-replay"):
        charge(4900, "cus_1")
    scope = twiceshy.run("bench-replay")

    def replay(i: int) -> object:
        with scope:
            return charge(4900, "cus_1")

    return first, replay, ledger.close


def floor(path: Path, journal_mode: str, synchronous: str) -> Case:
    """(two write transactions, one read, close) of raw sqlite3 at the same settings."""
    return floor_on(sqlite3.connect(path, isolation_level=None), journal_mode, synchronous)


def floor_on(conn: Any, journal_mode: str, synchronous: str) -> Case:
    """The floor's case on an open connection of a DB-API-like driver (``sqlite3``, ``apsw``)
    that runs statements with ``execute`` and leaves transactions to them."""
    conn.execute(f"PRAGMA journal_mode = {journal_mode}")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    for statement in SCHEMA:  # the ledger's own table and indexes
        conn.execute(statement)
    insert = (
        "INSERT INTO twiceshy_records VALUES (?, ?, ?, 'charge', 'keyed', 'claimed', 1, ?, ?, 1, "
        "NULL, NULL, NULL, ?, ?, NULL, NULL)"
    )
    update = (
        "UPDATE twiceshy_records SET state = 'succeeded', result = ?, updated_at = ?, "
        "expires_at = ? "
        "WHERE namespace = '' AND key = ? AND fence = 1 AND state = 'claimed'"
    )
    read = "SELECT * FROM twiceshy_records WHERE namespace = '' AND key = ?"
    prefix = f"{time.time_ns()}"
    counter = iter(range(10**9))
    result = json.dumps(RESULT, separators=(",", ":"))

    def two_transactions(i: int) -> None:
        # The rows the ledger writes: a SHA-256 key and fingerprint (keys land all over the
        # table, as real intents do), an owner token of the ledger's shape, the result's JSON.
        n = next(counter)
        key = hashlib.sha256(f"{prefix}:charge:{n}".encode()).hexdigest()
        fingerprint = hashlib.sha256(key.encode()).hexdigest()
        owner = f"{prefix[:16]}.{os.getpid()}.{n}"
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(insert, ("", key, fingerprint, owner, now + 30, now, now))
        conn.execute(read, (key,)).fetchall()
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(update, (result, now, now + 86400, key))
        conn.execute(read, (key,)).fetchall()
        conn.execute("COMMIT")

    conn.execute("BEGIN IMMEDIATE")
    conn.execute(insert, ("", "replayed", "f", "o", 0, 0, 0))
    conn.execute("COMMIT")

    def one_read(i: int) -> object:
        return conn.execute(read, ("replayed",)).fetchall()

    return two_transactions, one_read, conn.close


def by_hand(path: Path) -> Case:
    """(no first call, the least a replay can do in Python, close), on a file like the floor's.

    The replay names the intent with ``json.dumps(sort_keys=True)`` and SHA-256 (cheaper than
    any canonical form), reads the result column by primary key and decodes it: what a hand-written
    replay needs at the very least, without binding, fingerprints, states or leases.
    """
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in SCHEMA:
        conn.execute(statement)
    arguments = {"amount": 4900, "customer": "cus_1"}

    def name(scope: str) -> str:
        text = json.dumps(arguments, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(f"{scope}:charge:{text}".encode()).hexdigest()

    conn.execute(
        "INSERT INTO twiceshy_records VALUES ('', ?, 'f', 'charge', 'keyed', 'succeeded', 1, 'o',"
        " NULL, 1, ?, NULL, NULL, 0, 0, NULL, NULL)",
        (name("bench-replay"), json.dumps(RESULT)),
    )
    read = "SELECT result FROM twiceshy_records WHERE namespace = '' AND key = ?"

    def replay(i: int) -> object:
        row = conn.execute(read, (name("bench-replay"),)).fetchone()
        return json.loads(row[0])

    return None, replay, conn.close


def measure(cases: dict[str, Case], rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    """Median (first call, replay) per case, the cases taking turns round by round."""
    firsts: dict[str, list[int]] = {name: [] for name in cases}
    replays: dict[str, list[int]] = {name: [] for name in cases}
    for first, replay, _ in cases.values():  # warm up
        if first is not None:
            timed(first, 5, [])
        timed(replay, 20, [])
    for _ in range(rounds):
        for name, (first, replay, _) in cases.items():
            if first is not None:
                timed(first, calls, firsts[name])
            timed(replay, calls * 4, replays[name])
    for _, _, close in cases.values():
        close()
    return {
        name: (median_us(firsts[name]) if firsts[name] else 0.0, median_us(replays[name]))
        for name in cases
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, for a smoke run")
    parser.add_argument(
        "--synchronous",
        default=None,
        choices=["EXTRA", "FULL", "NORMAL", "OFF"],
        help="SQLite's synchronous setting for the ledger and the floor (default: the store's "
        "own, EXTRA in the rollback journal and FULL in WAL)",
    )
    args = parser.parse_args()
    quick = args.quick
    rounds, calls = (2, 20) if quick else (8, 50)
    with tempfile.TemporaryDirectory() as tmp:
        mode = SQLiteStore(Path(tmp) / "probe.db").journal_mode
        sync = args.synchronous or ("FULL" if mode == "wal" else "EXTRA")
        results = measure(
            {
                "memory": protected("memory://"),
                "sqlite": protected(f"sqlite:///{tmp}/ledger.db?synchronous={sync}"),
                "floor": floor(Path(tmp) / "floor.db", mode, sync),
                "by hand": by_hand(Path(tmp) / "by_hand.db"),
                # Its replays only: its first calls are the sqlite case's.
                "remembered": (None, *protected(f"sqlite:///{tmp}/kept.db", remember=256)[1:]),
            },
            rounds,
            calls,
        )
    floor_first, floor_read = results["floor"]
    _, hand_read = results["by hand"]
    print(
        f"median per call in microseconds; {rounds} rounds of {calls} first calls and "
        f"{calls * 4} replays, the cases taking turns"
    )
    header = (
        f"{'store':<36} {'first call':>10} {'floor':>8} {'ratio':>6}"
        f" {'replay':>8} {'raw read':>8} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    first, replay = results["memory"]
    print(f"{'memory://':<36} {first:>10.1f} {'':>8} {'':>6} {replay:>8.1f}")
    first, replay = results["sqlite"]
    print(
        f"{f'sqlite:/// ({mode} journal, synchronous={sync})':<36} {first:>10.1f}"
        f" {floor_first:>8.1f} {first / floor_first:>6.2f}"
        f" {replay:>8.1f} {floor_read:>8.1f} {replay / floor_read:>6.2f}"
    )
    print(
        f"\nreplay by hand (json.dumps + SHA-256, one SELECT of the result, json.loads):"
        f" {hand_read:.1f}; twiceshy's SQLite replay is {replay / hand_read:.2f}x that"
    )
    _, remembered = results["remembered"]
    print(
        f"remembered replay (Ledger(remember=256), no read): {remembered:.1f};"
        f" {remembered / floor_read:.2f}x the raw read, {remembered / hand_read:.2f}x by hand"
    )
    _, no_store = results["memory"]
    print(
        f"a replay within 1.2x of the raw read leaves {floor_read * 0.2:.1f} for twiceshy's"
        f" work; that work alone, with no store (memory://), takes {no_store:.1f}"
    )


if __name__ == "__main__":
    main()
