"""Settled outcomes this process has seen, kept to answer its own retries without the store.

A SUCCEEDED or FAILED record never changes until it expires (docs/design.md §3), so a copy of it
answers a retry exactly as the store would, for as long as the store would still hold it. That
deadline is judged on this process's monotonic clock: the record's remaining retention, as the
store's clock measured it in its answer, counted from when the command was *sent* (never from
when the answer came back), so a copy is dropped no later than the store drops the record.
CLAIMED, RELEASED and UNKNOWN records change, and are never kept.

A copy can only answer "this already happened"; it never makes a call run. Its one cost: a
record deleted from the store by hand is still answered from here until the copy's deadline or
its eviction.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Final

from ._forks import reset_in_children
from ._protocol import CallPlan
from ._records import Record, Snapshot, State, make_snapshot

_SETTLED: Final = frozenset({State.SUCCEEDED, State.FAILED})


class Remembered:
    """Up to ``size`` settled records, the least recently used evicted first; thread-safe."""

    __slots__ = ("__weakref__", "_entries", "_lock", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        # (namespace, key) -> (record, the store's clock in its answer, sent, drop at)
        self._entries: OrderedDict[tuple[str, str], tuple[Record, float, float, float]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        # The kept outcomes stay true in a child; only the lock may be held by a parent's thread.
        self._lock = threading.Lock()

    def recall(self, plan: CallPlan) -> Snapshot | None:
        """The kept record of the plan's key, as the store's answer to its claim; or ``None``."""
        name = (plan.namespace, plan.key)
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            now = time.monotonic()
            record, store_now, sent, until = entry
            if now >= until:
                del self._entries[name]
                return None
            self._entries.move_to_end(name)
        # The store's clock now is at most its reading plus the time since the command was sent.
        return make_snapshot(record, store_now + (now - sent), False)

    def keep(self, plan: CallPlan, snap: Snapshot, sent: float) -> None:
        """Keep the record in a store's answer if it is settled; ``sent``: monotonic, before."""
        record = snap.record
        if record is None or record.state not in _SETTLED:
            return
        until = math.inf if record.expires_at is None else sent + (record.expires_at - snap.now)
        name = (plan.namespace, plan.key)
        with self._lock:
            self._entries[name] = (record, snap.now, sent, until)
            self._entries.move_to_end(name)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
