"""What power-cut durability costs the SQLite ledger, journal mode by journal mode.

    python benchmarks/sqlite_durability.py [--runs 5] [--quick]

apsw is not a dependency of twiceshy: to include its floor, install it beside the project
(``pip install --target /tmp/bundled apsw``, then ``PYTHONPATH=/tmp/bundled``).

A claim survives a power cut in WAL with ``synchronous=FULL``, and in the rollback journal only
with ``synchronous=EXTRA`` (FULL does not sync the directory after the journal's unlink, which is
the commit). On SQLite versions with the WAL-reset bug the store cannot use WAL through the
standard library, so the choice is EXTRA in the rollback journal or a package that bundles a
fixed SQLite and runs WAL. This script times each on the disk under the temporary directory:

- twiceshy's first call and replay (``benchmarks/ledger.py``'s cases) in the rollback journal
  with FULL (the old default, not durable) and EXTRA, and in WAL with FULL (through this
  Python's ``sqlite3``: the cost WAL would have, whatever the library's version);
- the raw ``sqlite3`` floor of each (``benchmarks/ledger.py``'s floor);
- if ``apsw`` is importable (it bundles its own SQLite), the same floor through apsw in WAL and
  in the rollback journal, to show whether a bundled, fixed SQLite is any faster than this one.

Each run opens fresh files and lets the cases take turns; the figures are medians over runs
of each run's median per call, in microseconds.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ledger import Case, floor, floor_on, measure, protected

try:
    import apsw
except ImportError:  # optional: only its floor needs it
    apsw = None

SETTINGS = (("delete", "FULL"), ("delete", "EXTRA"), ("wal", "FULL"))


def apsw_floor(path: Path, journal_mode: str, synchronous: str) -> Case:
    """The raw floor of ``benchmarks/ledger.py``, through apsw and the SQLite it bundles."""
    return floor_on(apsw.Connection(str(path)), journal_mode, synchronous)


def one_run(rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    """One run's medians per case, on fresh files in a fresh temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        cases: dict[str, Case] = {}
        for mode, sync in SETTINGS:
            url = f"sqlite:///{where}/{mode}-{sync}.db?journal_mode={mode}&synchronous={sync}"
            cases[f"twiceshy {mode} {sync}"] = protected(url)
            cases[f"sqlite3 {mode} {sync}"] = floor(where / f"floor-{mode}-{sync}.db", mode, sync)
            if apsw is not None:
                cases[f"apsw {mode} {sync}"] = apsw_floor(
                    where / f"apsw-{mode}-{sync}.db", mode, sync
                )
        return measure(cases, rounds, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="independent runs (default 5)")
    parser.add_argument("--quick", action="store_true", help="fewer calls, for a smoke run")
    args = parser.parse_args()
    rounds, calls = (2, 10) if args.quick else (6, 40)
    runs = [one_run(rounds, calls) for _ in range(args.runs)]
    names = list(runs[0])

    def med(name: str, which: int) -> float:
        return statistics.median(run[name][which] for run in runs)

    print(f"sqlite3 module: SQLite {sqlite3.sqlite_version}", end="")
    print(f"; apsw {apsw.apsw_version()}: SQLite {apsw.sqlite_lib_version()}" if apsw else "")
    print(
        f"median over {args.runs} runs of each run's median per call, in microseconds "
        f"({rounds} rounds of {calls} first calls and {calls * 4} replays per run)"
    )
    header = f"{'case':<24} {'first call':>10} {'ratio':>6} {'replay':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for name in names:
        first, replay = med(name, 0), med(name, 1)
        line = f"{name:<24} {first:>10.1f} {'':>6} {replay:>8.1f}"
        if name.startswith("twiceshy"):
            floor_name = name.replace("twiceshy", "sqlite3")
            line = (
                f"{name:<24} {first:>10.1f} {first / med(floor_name, 0):>6.2f}"
                f" {replay:>8.1f} {replay / med(floor_name, 1):>6.2f}"
            )
        print(line)
    print("ratio: twiceshy against the raw sqlite3 floor with the same settings")
    old, new = med("twiceshy delete FULL", 0), med("twiceshy delete EXTRA", 0)
    wal = med("twiceshy wal FULL", 0)
    print(
        f"EXTRA costs a first call {new - old:+.0f} us ({new / old:.2f}x FULL); "
        f"WAL's first call is {wal / new:.2f}x EXTRA's"
    )


if __name__ == "__main__":
    main()
