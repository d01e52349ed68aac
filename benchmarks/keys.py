"""Keys per second: twiceshy's idempotency_key against json.dumps and rfc8785.

Run from the repository root::

    .venv/bin/python benchmarks/keys.py           # under a minute
    .venv/bin/python benchmarks/keys.py --quick   # a few seconds, for a smoke test

Three argument sets of realistic agent-tool arguments (about 100 bytes, 2 KB and 100 KB of
canonical JSON) are keyed by each implementation, side by side in one run:

- ``twiceshy``: ``twiceshy._canonical.idempotency_key``, and once more as ``twiceshy (cold)``
  with its memo of dict shapes emptied before every call (as for a shape never seen before);
- ``json.dumps``: ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` and
  SHA-256, the C encoder of the standard library: the yardstick, though not a canonical form (it
  writes ``1.0`` where JavaScript writes ``1`` and sorts keys by code point);
- ``rfc8785``: ``rfc8785.dumps`` (JCS, RFC 8785) and SHA-256, the pure-Python peer; for these
  arguments its text is byte for byte twiceshy's (checked before timing).

Each measurement is repeated, interleaving the implementations so that a noisy neighbour hurts all
of them alike, and the median is reported.

A second table keys hostile values once each (median of three): an integer of a million digits,
which twiceshy writes exactly, beside Python's own ``str()`` of it (the floor, quadratic on
CPython 3.11), and one of thirty million digits, which it refuses by its size alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from twiceshy import _canonical
from twiceshy._canonical import canonical_json, idempotency_key

try:
    import rfc8785
except ImportError:  # pragma: no cover - the bench extra is not installed
    rfc8785 = None  # type: ignore[assignment]

SCOPE = "thread-7f3a9c"
TOOL = "create_order"

_WORD_TEXT = (
    "order shipment invoice customer refund priority express standard note gift wrap "
    "Zürich café naïve façade Ærøskøbing São Paulo Kraków Øresund 東京 größe déjà vu "
    "please deliver before noon leave at the door call on arrival fragile"
)
WORDS = _WORD_TEXT.split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def small_args() -> dict[str, Any]:
    """About 100 bytes: one e-mail to send."""
    return {
        "to": "ana.garcia@example.com",
        "subject": "Réunion lundi",
        "body": "Hi Ana, see you at 10:30.",
        "priority": 2,
        "urgent": False,
    }


def _item(rng: random.Random, n: int) -> dict[str, Any]:
    return {
        "sku": f"SKU-{rng.randrange(10**6):06d}",
        "name": _text(rng, 3),
        "qty": rng.randint(1, 12),
        "unit_price": round(rng.uniform(0.5, 500), 2),
        "discount": rng.choice([0, 0.05, 0.1, 0.15]),
        "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 3))],
        "line": n,
    }


def medium_args() -> dict[str, Any]:
    """About 2 KB: an order with a customer, a few line items and metadata."""
    rng = random.Random(2)
    return {
        "customer": {
            "id": 918273,
            "name": "Zoë Müller-Łukasiewicz",
            "email": "zoe@example.org",
            "address": {
                "street": "Bahnhofstrasse 12",
                "city": "Zürich",
                "zip": "8001",
                "country": "CH",
                "geo": {"lat": 47.3769, "lon": 8.5417},
            },
            "vip": True,
        },
        "items": [_item(rng, n) for n in range(12)],
        "currency": "CHF",
        "shipping": {"method": "express", "cost": 12.5, "insured": True, "window": [9, 12]},
        "notes": _text(rng, 12),
        "coupon": None,
        "total": 1234.56,
    }


def large_args() -> dict[str, Any]:
    """About 100 KB: a batch of rows to insert, each a small nested record."""
    rng = random.Random(3)
    rows = [
        {
            "id": 100000 + n,
            "title": _text(rng, 6),
            "score": rng.random() * 100,
            "views": rng.randrange(10**7),
            "published": rng.random() < 0.8,
            "tags": [rng.choice(WORDS) for _ in range(rng.randint(1, 4))],
            "author": {
                "id": rng.randrange(10**5),
                "name": _text(rng, 2),
                "karma": rng.randrange(999),
            },
            "created": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T12:00:00Z",
            "ratio": rng.choice([0.25, 0.5, 1.0, 1e-3, 3.75]),
        }
        for n in range(360)
    ]
    return {"table": "articles", "upsert": True, "rows": rows, "batch": 17}


def _json_key(args: object) -> str:
    text = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{SCOPE}:{TOOL}:{text}".encode()).hexdigest()


def _rfc8785_key(args: object) -> str:
    assert rfc8785 is not None
    digest = hashlib.sha256(f"{SCOPE}:{TOOL}:".encode())
    digest.update(rfc8785.dumps(args))  # type: ignore[arg-type]
    return digest.hexdigest()


def _twiceshy_key(args: object) -> str:
    return idempotency_key(SCOPE, TOOL, args)


def _twiceshy_cold_key(args: object) -> str:
    _canonical._SHAPES.clear()  # as if every shape of dict keys were new
    return idempotency_key(SCOPE, TOOL, args)


def _calibrate(fn: Callable[[object], str], args: object, target: float) -> int:
    """How many calls take about `target` seconds."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn(args)
        elapsed = time.perf_counter() - start
        if elapsed >= target / 4:
            return max(1, round(number * target / elapsed))
        number *= 4


def _measure(fn: Callable[[object], str], args: object, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(args)
    return time.perf_counter() - start


def main() -> None:
    """Run the benchmark and print a table of keys per second."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer, shorter repeats)")
    options = parser.parse_args()
    repeats, target = (5, 0.03) if options.quick else (15, 0.12)

    impls: dict[str, Callable[[object], str]] = {
        "twiceshy": _twiceshy_key,
        "twiceshy (cold)": _twiceshy_cold_key,
        "json.dumps": _json_key,
    }
    if rfc8785 is not None:
        impls["rfc8785"] = _rfc8785_key
    sizes = {"~100 B": small_args(), "~2 KB": medium_args(), "~100 KB": large_args()}

    rows = []
    for label, args in sizes.items():
        size = len(canonical_json(args).encode())
        if rfc8785 is not None:  # the peer must be doing the same job
            assert rfc8785.dumps(args) == canonical_json(args).encode()
        numbers = {name: _calibrate(fn, args, target) for name, fn in impls.items()}
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(repeats):
            for name, fn in impls.items():
                times[name].append(_measure(fn, args, numbers[name]))
        rates = {name: numbers[name] / statistics.median(times[name]) for name in impls}
        rows.append((label, size, rates))

    headers = ["arguments", "bytes", *impls]
    if rfc8785 is not None:
        headers += ["twiceshy ÷ rfc8785", "cold ÷ rfc8785"]
    table = []
    for label, size, rates in rows:
        cells = [label, f"{size:,}", *(f"{rates[name]:,.0f}" for name in impls)]
        if rfc8785 is not None:
            cells.append(f"{rates['twiceshy'] / rates['rfc8785']:.2f}x")
            cells.append(f"{rates['twiceshy (cold)'] / rates['rfc8785']:.2f}x")
        table.append(cells)

    title = (
        f"Keys per second, median of {repeats} runs "
        f"(Python {sys.version.split()[0]}{', --quick' if options.quick else ''})"
    )
    caption = "cold: twiceshy with its memo of dict shapes emptied before every call"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(row[i]) for row in [headers, *table]) for i in range(len(headers))]
        for row in [headers, *table]:
            print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        print(caption)
    else:
        rich_table = Table(title=title, caption=caption)
        for i, header in enumerate(headers):
            rich_table.add_column(header, justify="left" if i == 0 else "right")
        for row in table:
            rich_table.add_row(*row)
        Console(width=None if sys.stdout.isatty() else 120).print(rich_table)


def _seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _refused(value: object) -> Callable[[], object]:
    def key() -> object:
        try:
            return idempotency_key(SCOPE, TOOL, {"n": value})
        except ValueError:
            return None

    return key


def hostile(quick: bool = False) -> None:
    """Print how long keying hostile integers takes, beside Python's own str() of them.

    ``quick``: an int of about 100,000 digits instead of a million (str() of an int is
    quadratic: the million takes some 17 s here, twice, which a smoke test need not spend).
    """
    million = 7**118_300 if quick else 7**1_183_000  # ~100,000 or 999,751 digits
    huge = 1 << 100_000_000  # about 30 million digits
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        text = str(million)
        assert canonical_json({"n": million}) == '{"n":' + text + "}"
        floor = _seconds(lambda: str(million), repeats=1)
    finally:
        sys.set_int_max_str_digits(old)
    rows = [
        (f"an int of {len(text):,} digits", _seconds(_refused(million)), floor),
        ("an int of ~30,000,000 digits (refused)", _seconds(_refused(huge)), None),
    ]
    print("Hostile values, keyed once (median of 3); floor: Python's own str() of the int")
    for label, took, base in rows:
        shown = f"{label:<40} twiceshy {took * 1000:9.1f} ms"
        if base is not None:
            shown += f"   str() {base * 1000:9.1f} ms   ({base / took:.0f}x faster)"
        print(shown)


if __name__ == "__main__":
    main()
    hostile(quick="--quick" in sys.argv[1:])
