"""Joining calls already running in this process, and renewing the leases of running calls."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ._forks import reset_in_children
from ._protocol import LEASE_TRUST, renewal
from ._records import Effect
from .errors import FencedOut
from .stores import Store

__all__ = ["Flight", "Flights", "Heartbeat", "Renewal"]

_IDLE = 5.0  # seconds without leases to renew before the heartbeat thread ends

log = logging.getLogger("twiceshy")


class Flight:
    """One execution of an intent in this process, which duplicates join (threads and tasks).

    Most flights land with no caller joined: what a waiter needs (the lock a blocking waiter
    sleeps on, the list of async waiters) is made only when one comes. A flight shares the lock
    of its :class:`Flights`, held only for a few attribute moves.
    """

    __slots__ = (
        "_done",
        "_error",
        "_landed",
        "_lock",
        "_loop",
        "_value",
        "_waiters",
        "fingerprint",
    )

    def __init__(self, fingerprint: str, lock: threading.Lock) -> None:
        self.fingerprint = fingerprint
        # The event loop running where the flight began, if any: the leader may need it.
        self._loop = asyncio._get_running_loop()
        self._lock = lock
        # Held until the flight lands, once a blocking waiter made it: each waiter acquires it
        # and passes it on at once.
        self._done: threading.Lock | None = None
        self._landed = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] | None = None

    def _settle(self, value: Any, error: BaseException | None) -> None:
        """Record the outcome (under the lock); :meth:`_wake` follows, outside it."""
        self._value, self._error = value, error
        self._landed = True

    def _wake(self) -> None:
        """Wake every joined caller of a settled flight."""
        with self._lock:
            done, waiters, self._waiters = self._done, self._waiters, None
        if done is not None:
            done.release()
        for loop, future in waiters or ():
            # A waiter's loop may be closed by now: nobody is left to wake there.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    def land(self, value: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake every joined caller."""
        with self._lock:
            self._settle(value, error)
        self._wake()

    def wait(self, timeout: float) -> bool:
        """Block until the flight lands; ``False`` on timeout.

        A blocking wait on the thread of the event loop the flight began on would stop that
        loop, and with it the leader: it answers ``False`` at once instead.
        """
        if self._landed:
            return True
        if self._loop is not None and self._loop is asyncio._get_running_loop():
            return False
        with self._lock:
            if self._landed:
                return True
            done = self._done
            if done is None:
                done = self._done = threading.Lock()
                done.acquire()
        if not done.acquire(timeout=max(timeout, 0.0)):
            return False
        done.release()
        return True

    async def wait_async(self, timeout: float) -> bool:
        """Await the flight's landing; ``False`` on timeout."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiter = (loop, future)
        with self._lock:
            if self._landed:
                return True
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(future, max(timeout, 0.0))
        except TimeoutError:
            return False
        finally:
            with self._lock:  # timed out or cancelled: the flight must not wake this loop later
                if self._waiters is not None and waiter in self._waiters:
                    self._waiters.remove(waiter)
        return True

    def outcome(self) -> Any:
        """The landed outcome: the value, or the error raised again."""
        if self._error is not None:
            raise self._error
        return self._value


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Flights:
    """The flights of one ledger, by namespace and key."""

    __slots__ = ("__weakref__", "_flights", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[tuple[str, str], Flight] = {}
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        # The calls running in the parent's other threads do not run here: a duplicate in the
        # child goes to the ledger, which knows their outcome.
        self._lock = threading.Lock()
        self._flights = {}

    def join(self, namespace: str, key: str, fingerprint: str) -> tuple[Flight, bool]:
        """The flight of a key, and whether this caller leads it (runs the protocol)."""
        name = (namespace, key)
        with self._lock:
            flight = self._flights.get(name)
            if flight is not None:
                return flight, False
            flight = self._flights[name] = Flight(fingerprint, self._lock)
            return flight, True

    def land(
        self, namespace: str, key: str, flight: Flight, value: Any, error: BaseException | None
    ) -> None:
        """Finish a flight: later callers go to the ledger again."""
        name = (namespace, key)
        with self._lock:
            if self._flights.get(name) is flight:
                del self._flights[name]
            flight._value, flight._error = value, error  # flight._settle(), written out
            flight._landed = True
            if flight._done is None and flight._waiters is None:
                return  # nobody joined: nobody to wake
        flight._wake()


@dataclass(eq=False, slots=True)
class Renewal:
    """The lease of one running call, renewed by the heartbeat until stopped.

    ``trusted_until`` (monotonic) is when the owner stops trusting the lease: part of it from
    when the last renewal that took effect was sent.
    """

    namespace: str
    key: str
    fence: int
    owner: str
    lease: float
    due: float
    trusted_until: float = math.inf
    lost: bool = False
    stopped: bool = False
    seq: int = field(default=0)
    #: How many entries of the heartbeat's heap are this lease's (0 while it is being renewed).
    queued: int = 0


class Heartbeat:
    """One thread per ledger timing the renewals of running calls' leases, started on first use.

    A call whose work outlasts a third of its lease has its lease renewed on the store's clock, so
    no other caller takes over while it still runs. Each renewal is written from a thread of its
    own, so a slow or hung store write delays only its own lease, never the other calls'. A
    renewal refused by the store (a newer fence) marks the call as fenced out; a store error is
    logged and retried at the next beat.

    A call that ends drops its entry at once when it is the next one due (as it is when calls
    run one at a time). Otherwise the entry stays only while the entries of ended calls are at
    most half of the heap: past that they are all dropped at once, so a burst of calls leaves
    nothing behind when it ends, and each end costs O(log n) on average.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        # Calls take the condition's lock directly (``Condition.__enter__`` is Python code).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Renewal]] = []
        self._ended = 0  # entries of the heap whose call has ended
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        # When the loop wakes by itself next (monotonic); -inf while it is awake. A new lease
        # due later than that needs no wake-up: most calls end long before their first renewal,
        # and waking the thread for each of them costs a thread switch per call.
        self._wake_at = -math.inf
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        # The leases of calls running in the parent are not the child's to renew: were the
        # parent to die mid-call, a child renewing them would keep its intents claimed forever.
        # The condition's lock may be held by the parent's heartbeat thread, absent here.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap = []
        self._ended = 0
        self._thread = None
        self._wake_at = -math.inf

    def start(
        self,
        namespace: str,
        key: str,
        fence: int,
        owner: str,
        lease: float,
        trusted_until: float = math.inf,
    ) -> Renewal:
        """Begin renewing a lease: first a third of it from now, or when the owner's trust in it
        ends (``trusted_until``, monotonic) if that is sooner."""
        due = min(time.monotonic() + lease / 3, trusted_until)
        job = Renewal(namespace, key, fence, owner, lease, due, trusted_until)
        self._schedule(job)
        return job

    def confirm(self, job: Renewal, effect: Effect, tool: str) -> None:
        """Make sure ``job``'s call still holds its lease before its effect starts.

        Within the owner's trust nothing is asked; past it, the lease is renewed under the
        call's fence now (an UNSAFE owner also takes back its own record marked UNKNOWN by a
        lapse).

        Raises:
            FencedOut: the lease was lost: another caller may own the intent.
            StoreError: the store could not be asked.
        """
        take_back = effect is Effect.UNSAFE
        if job.stopped or (job.lost and not take_back):
            raise FencedOut(tool, job.key)
        if not job.lost and time.monotonic() < job.trusted_until:
            return
        # An UNSAFE owner's renewal may have been refused only because a duplicate marked its
        # own fence UNKNOWN when the lease lapsed: taking it back is then still the owner's.
        sent = time.monotonic()
        change = renewal(job.fence, job.owner, job.lease, take_back=take_back)
        if not self._store.write(job.namespace, job.key, change).won:
            job.lost = True
            raise FencedOut(tool, job.key)
        job.trusted_until = max(job.trusted_until, sent + LEASE_TRUST * job.lease)
        if job.lost:  # the heartbeat gave it up: renew it again from now on
            job.lost = False
            job.due = time.monotonic() + job.lease / 3
            self._schedule(job)

    @property
    def leases(self) -> int:
        """How many leases the heartbeat holds: the running calls', and as many ended at most."""
        with self._lock:
            return len(self._heap)

    def _schedule(self, job: Renewal) -> None:
        """Put ``job`` on the heap for its ``due`` time; start or wake the thread if needed."""
        with self._lock:
            if job.stopped:
                return  # ended while it was being renewed
            job.queued += 1
            job.seq = next(self._seq)
            heapq.heappush(self._heap, (job.due, job.seq, job))
            if self._thread is None:  # the loop clears it whenever it ends
                thread = threading.Thread(target=self._loop, name="twiceshy-heartbeat", daemon=True)
                thread.start()
                self._thread = thread
            elif job.due < self._wake_at:
                self._cond.notify()

    def stop(self, job: Renewal) -> None:
        """Stop renewing a lease; its entry goes at the latest once ended ones are half the heap."""
        with self._lock:
            if job.stopped:
                return
            job.stopped = True
            heap = self._heap
            # The next one due is dropped now. (A lease started before a fork, ended in the
            # child, has entries in no heap of the child's.)
            if job.queued and heap and heap[0][2] is job:
                heapq.heappop(heap)
                job.queued -= 1
            self._ended += job.queued
            if 2 * self._ended > len(heap):
                for _, _, ended in self._heap:
                    if ended.stopped:
                        ended.queued = 0
                self._heap = [entry for entry in self._heap if not entry[2].stopped]
                heapq.heapify(self._heap)
                self._ended = 0

    def _loop(self) -> None:
        try:
            self._beating()
        except BaseException:  # (it cannot start a renewal's thread): the next lease starts one
            with self._lock:
                self._thread = None
            raise

    def _beating(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].stopped:
                    heapq.heappop(self._heap)[2].queued -= 1
                    self._ended -= 1
                if not self._heap:
                    # Idle: wait a while for work, then let the thread end.
                    self._wake_at = time.monotonic() + _IDLE
                    woken = self._cond.wait(_IDLE)
                    self._wake_at = -math.inf
                    if not woken and not self._heap:
                        self._thread = None
                        return
                    continue
                due, _, job = self._heap[0]
                left = due - time.monotonic()
                if left > 0:
                    self._wake_at = due
                    self._cond.wait(left)
                    self._wake_at = -math.inf
                    continue
                heapq.heappop(self._heap)
                job.queued -= 1
            # Off this thread: the next due lease must not wait for this one's round trip.
            threading.Thread(
                target=self._beat, args=(job,), name="twiceshy-renewal", daemon=True
            ).start()

    def _beat(self, job: Renewal) -> None:
        """Renew one lease, then schedule its next renewal (unless it ended or was lost)."""
        self._renew(job)
        if not job.stopped and not job.lost:
            job.due = time.monotonic() + job.lease / 3
            self._schedule(job)

    def _renew(self, job: Renewal) -> None:
        sent = time.monotonic()
        try:
            snap = self._store.write(
                job.namespace, job.key, renewal(job.fence, job.owner, job.lease)
            )
        except Exception:
            # A StoreError, or anything a custom store raises: the thread must live on to renew
            # this lease at the next beat, and every other call's.
            log.warning("twiceshy: could not renew the lease of key %s", job.key, exc_info=True)
            return
        if not snap.won:
            job.lost = True
            log.warning(
                "twiceshy: the lease of key %s was taken over (fence %d)", job.key, job.fence
            )
            return
        job.trusted_until = max(job.trusted_until, sent + LEASE_TRUST * job.lease)
