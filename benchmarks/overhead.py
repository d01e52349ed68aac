"""twiceshy's own CPU per protected call, beside the least Python doing the same essential work.

    python benchmarks/overhead.py [--rounds 7] [--calls 2000] [--instructions]

On ``memory://`` (no store to wait for) a KEYED tool that does nothing is called inside one
``twiceshy.run``: a *first call* with new arguments each time (claim, run, record), a *replay*
with the same arguments again (the recorded outcome, decoded). The *floor* is the least Python
that does the essential work of each: bind the arguments to their names, write the canonical
text of the intent and of the arguments (``json.dumps(sort_keys=True)``), two SHA-256, one dict
lookup, and then decode the stored result (replay) or encode the result and store a record
(first call). Each case runs ``--calls`` calls per round, the cases taking turns; the figure is
the median over rounds of the process's CPU time per call (``time.process_time_ns``, which
counts the heartbeat's thread too).

``--instructions`` also counts CPU instructions per call with valgrind's callgrind, which the
neighbours on a shared machine cannot move: each case is run in a child under callgrind twice,
with N and 2N calls, and the difference divided by N is what one call costs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import twiceshy

RESULT = {"id": "ch_1", "amount": 4900, "customer": "cus_1"}
"""What the benchmarked tool returns."""

SCOPE = "bench-overhead"
NAMES = ("amount", "customer")
Case = Callable[[int], object]


def twiceshy_cases() -> dict[str, Case]:
    """The first call and the replay of a KEYED tool on a fresh ``memory://`` ledger."""
    ledger = twiceshy.Ledger("memory://")

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int, customer: str) -> dict[str, object]:
        return dict(RESULT)

    charge(4900, "cus_replayed")  # the outcome every replay reads

    def first(i: int) -> object:
        return charge(i, "cus_1")

    def replay(i: int) -> object:
        return charge(4900, "cus_replayed")

    return {"first call": first, "replay": replay}


def floor_cases() -> dict[str, Case]:
    """The same two calls done with the least Python: no protocol, no join, no lease."""
    table: dict[str, tuple[str, str]] = {}

    def canonical(value: object) -> bytes:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return text.encode()

    def call(amount: int, customer: str) -> object:
        bound = dict(zip(NAMES, (amount, customer), strict=True))
        key = hashlib.sha256(canonical([SCOPE, "charge", bound])).hexdigest()
        fingerprint = hashlib.sha256(canonical(bound)).hexdigest()
        found = table.get(key)
        if found is not None and found[0] == fingerprint:
            return json.loads(found[1])
        result = dict(RESULT)
        table[key] = (fingerprint, json.dumps(result, separators=(",", ":")))
        return result

    call(4900, "cus_replayed")

    def first(i: int) -> object:
        return call(i, "cus_1")

    def replay(i: int) -> object:
        return call(4900, "cus_replayed")

    return {"first call": first, "replay": replay}


def cases() -> dict[str, dict[str, Case]]:
    """Every implementation's cases, by implementation name."""
    return {"twiceshy": twiceshy_cases(), "floor": floor_cases()}


def cpu_per_call(fn: Case, start: int, calls: int) -> float:
    """Nanoseconds of the process's CPU per call over ``calls`` calls of ``fn``."""
    begin = time.process_time_ns()
    for i in range(start, start + calls):
        fn(i)
    return (time.process_time_ns() - begin) / calls


def measure(rounds: int, calls: int) -> dict[tuple[str, str], float]:
    """Median CPU ns per call of every (implementation, call) case, taking turns by round."""
    with twiceshy.run(SCOPE):
        made = cases()
        for impl in made.values():  # warm up
            for fn in impl.values():
                cpu_per_call(fn, 10**8, 200)
        samples: dict[tuple[str, str], list[float]] = {
            (name, call): [] for name, impl in made.items() for call in impl
        }
        for r in range(rounds):
            for name, impl in made.items():
                for call, fn in impl.items():
                    samples[name, call].append(cpu_per_call(fn, r * calls, calls))
    return {case: statistics.median(times) for case, times in samples.items()}


def run_child(impl: str, call: str, calls: int) -> None:
    """The body callgrind counts: ``calls`` calls of one case, after a warm-up of the same."""
    with twiceshy.run(SCOPE):
        fn = cases()[impl][call]
        for i in range(10**8, 10**8 + 200):
            fn(i)
        for i in range(calls):
            fn(i)


def instructions(impl: str, call: str, calls: int) -> float:
    """Instructions per call of one case, from two callgrind runs of a child (N and 2N calls)."""
    counts = []
    for n in (calls, 2 * calls):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "callgrind.out")
            subprocess.run(
                [
                    "valgrind",
                    "--tool=callgrind",
                    f"--callgrind-out-file={out}",
                    sys.executable,
                    __file__,
                    "--child",
                    impl,
                    call,
                    str(n),
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "PYTHONHASHSEED": "0"},
            )
            with open(out, encoding="utf-8") as f:
                summary = re.search(r"^summary:\s+(\d+)", f.read(), re.MULTILINE)
            if summary is None:
                raise RuntimeError("callgrind wrote no summary")
            counts.append(int(summary.group(1)))
    return (counts[1] - counts[0]) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of calls (default 7)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count instructions per call with valgrind's callgrind (takes minutes)",
    )
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "CALL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, call, n = args.child
        run_child(impl, call, int(n))
        return
    if not 1 <= args.rounds <= 101 or not 100 <= args.calls <= 100_000:
        parser.error("--rounds must be 1..101 and --calls 100..100000")

    medians = measure(args.rounds, args.calls)
    goals = {"first call": 2.5, "replay": 2.0}
    print(
        f"own CPU per call on memory://, median of {args.rounds} rounds of {args.calls} calls "
        f"(Python {sys.version.split()[0]})"
    )
    print(f"{'call':<11} {'twiceshy µs':>12} {'floor µs':>9} {'ratio':>6} {'goal':>5}")
    for call, goal in goals.items():
        ours, floor = medians["twiceshy", call], medians["floor", call]
        print(
            f"{call:<11} {ours / 1000:>12.2f} {floor / 1000:>9.2f} {ours / floor:>6.2f}"
            f" {goal:>5.1f}  {'met' if ours / floor <= goal else 'not met'}"
        )
    if not args.instructions:
        return
    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind on the PATH")
    n = 1000
    print(f"\ninstructions per call (callgrind, {n} vs {2 * n} calls, PYTHONHASHSEED=0)")
    print(f"{'call':<11} {'twiceshy':>10} {'floor':>9} {'ratio':>6} {'goal':>5}")
    for call, goal in goals.items():
        counted = {impl: instructions(impl, call, n) for impl in ("twiceshy", "floor")}
        ours, floor = counted["twiceshy"], counted["floor"]
        print(
            f"{call:<11} {ours:>10,.0f} {floor:>9,.0f} {ours / floor:>6.2f} {goal:>5.1f}"
            f"  {'met' if ours / floor <= goal else 'not met'}"
        )


if __name__ == "__main__":
    main()
