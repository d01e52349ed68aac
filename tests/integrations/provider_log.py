"""A payment provider double for the framework tests, which counts effects in a file: usable
from every framework's tests and from the processes they start (no framework imported here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CHARGE = {"amount": 4900, "customer": "cus_1"}
"""The arguments of the charge every incident re-enacts."""


class Provider:
    """A payment provider double that deduplicates charges by idempotency key, as Stripe does,
    and counts what it was asked in a file (one JSON line per request), so that a process
    killed with SIGKILL cannot hide a charge."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def charge(self, key: str | None, amount: int, customer: str) -> str:
        """Record the request; answer the charge of its key (a new one without a key)."""
        with self.log.open("a", encoding="utf-8") as out:
            out.write(json.dumps({"key": key, "amount": amount, "pid": os.getpid()}) + "\n")
            out.flush()
            os.fsync(out.fileno())
        requests = self.requests()
        keys = [r["key"] for r in requests]
        if key is None:
            return f"ch_{len(requests)}"
        return f"ch_{_distinct(keys).index(key) + 1}"

    def requests(self) -> list[dict[str, Any]]:
        """Every request the provider got, in order."""
        if not self.log.exists():
            return []
        lines = self.log.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    @property
    def keys(self) -> list[str | None]:
        """The idempotency key of every request, in order."""
        return [r["key"] for r in self.requests()]

    @property
    def effects(self) -> int:
        """How many charges took effect: one per key, one per request without a key."""
        keys = self.keys
        return len(_distinct([k for k in keys if k is not None])) + keys.count(None)


def _distinct(keys: list[Any]) -> list[Any]:
    return list(dict.fromkeys(keys))
