"""The warnings of a store that judges leases and retention on its callers' clocks (SQLite,
DynamoDB), when two of those clocks disagree."""

from __future__ import annotations

import logging
import math
import time

from .._records import CLOCK_TOLERANCE, Record, last_written

__all__ = ["ClockSkew"]

log = logging.getLogger("twiceshy")


class ClockSkew:
    """The warnings of a store that judges on its callers' clocks, when two of them disagree.

    Two things show it: a record written ahead of the reader's clock (:meth:`saw`), and a write
    whose expiry the store counted from a time later than the writer's clock (:meth:`moved`).
    Each is a WARNING on the ``twiceshy`` logger, at most one per ``every`` seconds for one
    store, so that a busy process does not flood its log; the next one says how many were left
    out meanwhile. Unlocked: two threads at the same moment may both log, one line too many.
    """

    __slots__ = ("_every", "_largest", "_left_out", "_next", "_where")

    def __init__(self, where: str, *, every: float = 60.0) -> None:
        self._where = where
        self._every = every
        self._next = -math.inf  # the monotonic time from which the next warning may be logged
        self._left_out = 0
        self._largest = 0.0

    def saw(self, record: Record, now: float) -> None:
        """Warn when ``record`` was written more than :data:`CLOCK_TOLERANCE` after ``now``."""
        ahead = last_written(record) - now
        if ahead > CLOCK_TOLERANCE:
            self._warn(
                ahead,
                f"a record (key {record.key}) was written {ahead:.1f} s ahead of this process's "
                "clock: this clock is behind, or its writer's was ahead. The record counts as "
                "live, and its lease as running, until this clock passes the times its writer "
                "gave them",
            )

    def moved(self, record: Record, seconds: float) -> None:
        """Warn when the expiry written on ``record`` was counted from ``seconds`` past the
        writer's clock (more than :data:`CLOCK_TOLERANCE`): the ledger had seen a later time."""
        if seconds > CLOCK_TOLERANCE:
            self._warn(
                seconds,
                f"the ledger had already written a time {seconds:.1f} s ahead of this "
                "process's clock (this clock is behind, or another writer's was ahead), so the "
                f"outcome of key {record.key} is kept for its ttl from that time, not from this "
                "clock's: counted from this clock, a process on the later time would find it "
                "expired before it was written",
            )

    def _warn(self, seconds: float, what: str) -> None:
        at = time.monotonic()
        if at < self._next:
            self._left_out += 1
            self._largest = max(self._largest, seconds)
            return
        self._next = at + self._every
        more = ""
        if self._left_out:
            more = (
                f" ({self._left_out} more such since the last warning, the largest "
                f"{self._largest:.1f} s)"
            )
            self._left_out, self._largest = 0, 0.0
        log.warning(
            "twiceshy: %s: %s. Keep the clocks of every process using the ledger in sync (NTP), "
            "much closer than the lease and the ttl; see 'Clocks' in the store's docs.%s",
            self._where,
            what,
            more,
        )
