"""Counting how this process's calls were answered, and adding the counts to the ledger.

Every protected call adds one to its ``(tool, outcome)`` count in memory, which costs no I/O, and
a call that ran the tool one to its ``(tool, "ran")`` count: how a call was answered is not
whether it ran (a call that ran and then lost its reply answers ``unknown``). A
thread adds the counts to the store every ``interval`` seconds, and :meth:`Tally.close` once
more, so ``twiceshy stats`` sums what every process sharing the ledger did: how many retries
were answered by a replay or a join instead of a second run.

The counts are for operators, not for the protocol: a process that dies loses the counts of its
last interval, a flush whose reply was lost (the store may have applied it) is counted again at
the next one, and after three failed flushes in a row the pending counts are dropped (with a
warning) rather than kept and retried forever.
"""

from __future__ import annotations

import logging
import threading
from typing import Final

from ._forks import reset_in_children
from ._records import Outcome
from .errors import StoreError
from .stores import CallCounts

__all__ = ["RAN", "Tally"]

log = logging.getLogger("twiceshy")

RAN: Final = "ran"
"""The counted name, beside the outcomes' values, of the calls that ran the tool."""

_IDLE_ROUNDS = 3  # intervals without a call before the flushing thread ends
_FAILURES = 3  # failed flushes in a row before the pending counts are dropped


class Tally:
    """One ledger's call counts, flushed to its store.

    Args:
        store: where the counts are summed.
        namespace: the ledger's namespace.
        interval: seconds between flushes.
    """

    def __init__(self, store: CallCounts, namespace: str, interval: float) -> None:
        self._store = store
        self._namespace = namespace
        self._interval = interval
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._counts: dict[tuple[str, str], int] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        reset_in_children(self)

    def add(self, tool: str, outcome: Outcome, ran: bool = False) -> None:
        """Count one call; ``ran``: it ran the tool (counted beside its outcome)."""
        key = (tool, outcome._value_)  # (``.value`` is a descriptor, slower)
        with self._lock:
            counts = self._counts  # (flushing swaps it, under the lock)
            counts[key] = counts.get(key, 0) + 1
            if ran:
                counts[tool, RAN] = counts.get((tool, RAN), 0) + 1
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._loop, name="twiceshy-counts", daemon=True
                )
                self._thread.start()

    def _after_fork_in_child(self) -> None:
        # A forked child: the counts it inherited are its parent's to flush (by any path: a
        # call, flush_counts() or close()), and the parent's lock may have been held by a
        # thread that does not exist here.
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._counts, self._thread = {}, None

    def pending(self) -> dict[tuple[str, str], int]:
        """The counts not yet added to the store (a copy)."""
        with self._lock:
            return dict(self._counts)

    def flush(self) -> None:
        """Add the pending counts to the store now.

        Raises:
            StoreError: the store failed; the counts stay pending for the next flush.
        """
        with self._lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return
        try:
            self._store.add_counts(self._namespace, counts)
        except BaseException:
            with self._lock:
                for key, n in counts.items():
                    self._counts[key] = self._counts.get(key, 0) + n
            raise

    def close(self) -> None:
        """Stop the thread and flush what is pending (a store error is logged)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._interval + 5.0)
        self._flush_logged()

    def _flush_logged(self) -> bool:
        """Flush; a store error is logged. Answers whether the flush went through."""
        try:
            self.flush()
        except StoreError:
            log.warning("twiceshy: could not add call counts to the ledger", exc_info=True)
            return False
        return True

    def _drop(self) -> None:
        with self._lock:
            dropped = sum(n for (_, name), n in self._counts.items() if name != RAN)
            self._counts = {}
        log.warning(
            "twiceshy: dropped the counts of %d calls after %d failed flushes", dropped, _FAILURES
        )

    def _loop(self) -> None:
        idle = failed = 0
        while not self._wake.wait(self._interval):
            with self._lock:
                if not self._counts:
                    idle += 1
                    if idle >= _IDLE_ROUNDS:
                        # No calls for a while: end the thread; the next call starts another.
                        if self._thread is threading.current_thread():
                            self._thread = None
                        return
                    continue
            idle = 0
            if self._flush_logged():
                failed = 0
                continue
            failed += 1
            if failed >= _FAILURES:
                # Counts are for operators: a store that keeps failing (or was closed under the
                # ledger) must not make this thread warn forever.
                self._drop()
                failed = 0
