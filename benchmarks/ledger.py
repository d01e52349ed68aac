"""Per-call cost of a protected call on the memory and SQLite ledgers, beside the floor.

    python benchmarks/ledger.py [--quick]

A *first call* claims the key, runs the tool and records the outcome; a *replay* is a retry of an
intent already recorded. The floor is raw ``sqlite3`` doing the same transactions on the same
kind of file with the same durability settings (journal mode and ``synchronous``): two write
transactions (insert the claim; update it with the outcome) for a first call, one read by primary
key for a replay. The tool itself does nothing, so what is measured is twiceshy's own cost.
Medians of per-call times; the machine is shared, so compare ratios within one run.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import twiceshy
from twiceshy.stores.sqlite import SQLiteStore


def per_call(fn: Callable[[int], object], calls: int) -> float:
    """The median time of one call, in microseconds."""
    times = []
    for i in range(calls):
        start = time.perf_counter_ns()
        fn(i)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def protected(url: str, calls: int) -> tuple[float, float]:
    """(first call, replay) medians of a KEYED tool on the ledger at ``url``."""
    ledger = twiceshy.Ledger(url)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    def first(i: int) -> object:
        with twiceshy.run(f"bench-{time.time_ns()}-{i}"):
            return charge(4900, "cus_1")

    with twiceshy.run("bench-replay"):
        charge(4900, "cus_1")

        def replay(i: int) -> object:
            return charge(4900, "cus_1")

        replay_us = per_call(replay, calls * 4)
    first_us = per_call(first, calls)
    ledger.close()
    return first_us, replay_us


FLOOR_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    namespace TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL, tool TEXT NOT NULL,
    effect TEXT NOT NULL, state TEXT NOT NULL, fence INTEGER NOT NULL, owner TEXT NOT NULL,
    lease_deadline REAL, attempts INTEGER NOT NULL, result TEXT, error TEXT, reason TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, expires_at REAL,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID
"""


def floor(path: Path, journal_mode: str, calls: int) -> tuple[float, float]:
    """(two write transactions, one read) medians of raw sqlite3 at the same settings."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"PRAGMA journal_mode = {journal_mode}")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(FLOOR_SCHEMA)
    insert = (
        "INSERT INTO records VALUES (?, ?, 'f', 't', 'keyed', 'claimed', 1, 'o', ?, 1, "
        "NULL, NULL, NULL, ?, ?, NULL)"
    )
    update = (
        "UPDATE records SET state = 'succeeded', result = ?, updated_at = ?, expires_at = ? "
        "WHERE namespace = '' AND key = ? AND fence = 1 AND state = 'claimed'"
    )
    read = "SELECT * FROM records WHERE namespace = '' AND key = ?"

    def two_transactions(i: int) -> None:
        key = f"{time.time_ns()}-{i}"
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(insert, ("", key, now + 30, now, now))
        conn.execute(read, (key,)).fetchone()
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(update, ('{"id":"ch_1"}', now, now + 86400, key))
        conn.execute(read, (key,)).fetchone()
        conn.execute("COMMIT")

    two_transactions(-1)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(insert, ("", "replayed", 0, 0, 0))
    conn.execute("COMMIT")
    first_us = per_call(two_transactions, calls)
    replay_us = per_call(lambda i: conn.execute(read, ("replayed",)).fetchone(), calls * 4)
    conn.close()
    return first_us, replay_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, for a smoke run")
    calls = 50 if parser.parse_args().quick else 400
    with tempfile.TemporaryDirectory() as tmp:
        mode = SQLiteStore(Path(tmp) / "probe.db").journal_mode
        rows = [
            ("memory://", *protected("memory://", calls), None, None),
            (
                f"sqlite ({mode}, synchronous=FULL)",
                *protected(f"sqlite:///{tmp}/ledger.db", calls),
                *floor(Path(tmp) / "floor.db", mode, calls),
            ),
        ]
    header = (
        f"{'store':<34} {'first call':>11} {'floor':>9} {'ratio':>6}"
        f" {'replay':>9} {'raw read':>9} {'ratio':>6}"
    )
    print(f"median per call, microseconds; {calls} first calls, {calls * 4} replays")
    print(header)
    print("-" * len(header))
    for name, first_us, replay_us, floor_first, floor_read in rows:
        if floor_first is None or floor_read is None:
            print(f"{name:<34} {first_us:>11.1f} {'':>9} {'':>6} {replay_us:>9.1f}")
            continue
        print(
            f"{name:<34} {first_us:>11.1f} {floor_first:>9.1f} {first_us / floor_first:>6.2f}"
            f" {replay_us:>9.1f} {floor_read:>9.1f} {replay_us / floor_read:>6.2f}"
        )


if __name__ == "__main__":
    main()
