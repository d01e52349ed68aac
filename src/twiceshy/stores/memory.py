"""``memory://``: a store inside one process, for tests and single-process agents.

Records live in a dict guarded by one condition variable; waiters wake on every write. Writes
apply the reference semantics of ``twiceshy._records`` directly. The clock is injectable so tests
can travel in time. Retention, waiting and forks are described in docs/stores/memory.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

from .._forks import reset_in_children
from .._records import (
    Change,
    Effect,
    Record,
    Snapshot,
    State,
    apply_change,
    guard_holds,
    is_live,
    make_snapshot,
    new_claim,
)

__all__ = ["MemoryStore"]


class MemoryStore:
    """A :class:`~twiceshy.stores.Store` in a dict.

    Args:
        clock: the store's clock, seconds since the epoch.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._records: dict[tuple[str, str], Record] = {}
        self._counts: dict[tuple[str, str, str], int] = {}
        self._lock = threading.Lock()
        # Waiters sleep on the condition; the writers wake them only when there are any.
        self._changed = threading.Condition(self._lock)
        self._waiting = 0
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        # The child keeps a copy of the records (a ledger of its own from now on); the lock
        # may have been held by a parent's thread at the fork, and that thread is not here.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting = 0

    def _live(self, namespace: str, key: str, now: float) -> Record | None:
        record = self._records.get((namespace, key))
        if record is not None and not is_live(record, now):
            return None
        return record

    def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
        args: str | None = None,
    ) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`."""
        with self._lock:
            now = self._clock()
            existing = self._records.get((namespace, key))
            if existing is not None and is_live(existing, now):
                won = existing.state is State.CLAIMED and existing.owner == owner
                return make_snapshot(existing, now, won)
            fence = existing.fence + 1 if existing is not None else 1
            record = new_claim(
                namespace,
                key,
                fingerprint=fingerprint,
                tool=tool,
                effect=effect,
                owner=owner,
                lease=lease,
                now=now,
                fence=fence,
                args=args,
            )
            self._records[(namespace, key)] = record
            if self._waiting:
                self._changed.notify_all()
            return make_snapshot(record, now, True)

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`."""
        with self._lock:
            now = self._clock()
            record = self._live(namespace, key, now)
            if record is None or not guard_holds(record, change, now):
                return make_snapshot(record, now, False)
            record = apply_change(record, change, now)
            self._records[(namespace, key)] = record
            if self._waiting:
                self._changed.notify_all()
            return make_snapshot(record, now, True)

    def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        with self._lock:
            now = self._clock()
            return make_snapshot(self._live(namespace, key, now), now, False)

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._lock:
            while True:
                now = self._clock()
                record = self._live(namespace, key, now)
                if record is None or record.state is not State.CLAIMED or record.fence != fence:
                    return make_snapshot(record, now, False)
                left = deadline - time.monotonic()
                if left <= 0:
                    return make_snapshot(record, now, False)
                self._waiting += 1
                try:
                    self._changed.wait(left)
                finally:
                    self._waiting -= 1

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        wanted = frozenset(states) if states is not None else None
        with self._lock:
            now = self._clock()
            found = [
                r
                for (ns, _), r in self._records.items()
                if ns == namespace
                and is_live(r, now)
                and (wanted is None or r.state in wanted)
                and (tool is None or r.tool == tool)
            ]
        found.sort(key=lambda r: r.created_at, reverse=True)
        return found[:limit] if limit is not None else found

    def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        with self._lock:
            now = self._clock()
            dead = [
                k
                for k, r in self._records.items()
                if (namespace is None or k[0] == namespace) and not is_live(r, now)
            ]
            for k in dead:
                del self._records[k]
            return len(dead)

    def expired(self, namespace: str | None = None) -> list[Record]:
        """See :meth:`twiceshy.stores.ExpiredOutcomes.expired`."""
        with self._lock:
            now = self._clock()
            return [
                r
                for (ns, _), r in self._records.items()
                if (namespace is None or ns == namespace) and not is_live(r, now)
            ]

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """See :meth:`twiceshy.stores.CallCounts.add_counts`."""
        with self._lock:
            for (tool, outcome), n in counts.items():
                key = (namespace, tool, outcome)
                self._counts[key] = self._counts.get(key, 0) + n

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """See :meth:`twiceshy.stores.CallCounts.counts`."""
        with self._lock:
            return {(t, o): n for (ns, t, o), n in self._counts.items() if ns == namespace}

    def close(self) -> None:
        """Nothing to release."""
