"""LISTEN/NOTIFY: how a waiter learns that a record it waits for has been settled.

A write that settles a record sends ``NOTIFY`` in its own statement, so the notification leaves
when the write commits. Each store keeps one connection ``LISTEN``-ing on its table's channel:
the blocking store in a :class:`Listener` thread, the async store in a task per event loop
(:func:`listen`). Both dispatch a notification's payload to the :class:`Waiters` of that
record, and follow one :class:`Rhythm`: once listening, and again whenever the connection is
lost, every waiter is woken to read its record again (notifications sent while nobody listened
are lost), and a lost connection is made again after 50 ms doubling to 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Collection
from typing import Final, Generic, Protocol, TypeVar

import psycopg
from psycopg import pq

from ._errors import closed
from ._settings import Settings

log = logging.getLogger("twiceshy")

RECONNECT_FIRST: Final = 0.05  # the listener reconnects after 50 ms doubling to 2 s
RECONNECT_CAP: Final = 2.0


class _Event(Protocol):
    """What a waiter blocks on: a :class:`threading.Event` or an :class:`asyncio.Event`."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...


_E = TypeVar("_E", bound=_Event)


class Waiters(Generic[_E]):
    """Who waits for which record: events by NOTIFY payload. Not locked; callers lock."""

    __slots__ = ("_by_payload",)

    def __init__(self) -> None:
        self._by_payload: dict[str, set[_E]] = {}

    def add(self, payload: str, event: _E) -> None:
        """Register ``event`` for the record named by ``payload``."""
        self._by_payload.setdefault(payload, set()).add(event)

    def discard(self, payload: str, event: _E) -> None:
        """Forget ``event``."""
        events = self._by_payload.get(payload)
        if events is not None:
            events.discard(event)
            if not events:
                del self._by_payload[payload]

    def of(self, payload: str) -> Collection[_E]:
        """The events waiting for one record (the registry's own set: copy it to keep it)."""
        return self._by_payload.get(payload, ())

    def everyone(self) -> list[_E]:
        """Every waiting event."""
        return [event for events in self._by_payload.values() for event in events]

    def wake(self, payload: str) -> None:
        """Wake the waiters of one record (where nothing else touches the registry meanwhile)."""
        for event in self.of(payload):
            event.set()

    def wake_all(self) -> None:
        """Wake every waiter (where nothing else touches the registry meanwhile)."""
        for events in self._by_payload.values():
            for event in events:
                event.set()


class Rhythm:
    """When a listener wakes every waiter, and how long it pauses before reconnecting."""

    __slots__ = ("_delay", "_ready", "_wake_all")

    def __init__(self, ready: _Event, wake_all: Callable[[], None]) -> None:
        self._ready = ready
        self._wake_all = wake_all
        self._delay = RECONNECT_FIRST

    def listening(self) -> None:
        """The connection is LISTEN-ing: say so, and have every waiter read again."""
        self._ready.set()
        # Notifications sent while nobody listened are lost: look again.
        self._wake_all()
        self._delay = RECONNECT_FIRST

    def failed(self, what: str) -> None:
        """The connection could not be made, or broke (its error is being handled)."""
        log.debug("twiceshy: PostgreSQL listener %s", what, exc_info=True)

    def pause(self) -> float:
        """No connection: have every waiter read again; the seconds to wait before the next."""
        self._wake_all()
        delay, self._delay = self._delay, min(self._delay * 2, RECONNECT_CAP)
        return delay


class Listener:
    """The blocking store's LISTEN connection and thread, waking the store's waiters."""

    def __init__(self, settings: Settings, listen: bytes, *, listening: bool = True) -> None:
        self._settings = settings
        self._listen = listen
        #: Whether to LISTEN at all: without it the registry only serves this process's writes.
        self._listening = listening
        self._lock = threading.Lock()
        self._waiters: Waiters[threading.Event] = Waiters()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        #: Set while the connection is LISTEN-ing.
        self.ready = threading.Event()

    def watch(self, payload: str) -> threading.Event:
        """Register a waiter for one record; start the listener thread if needed."""
        event = threading.Event()
        with self._lock:
            if self._closed:
                raise closed()
            self._waiters.add(payload, event)
            if self._listening and (self._thread is None or not self._thread.is_alive()):
                self._wake_r, self._wake_w = socket.socketpair()
                self._thread = threading.Thread(
                    target=self._run, name="twiceshy-postgres-listener", daemon=True
                )
                self._thread.start()
        return event

    def unwatch(self, payload: str, event: threading.Event) -> None:
        """Forget a waiter."""
        with self._lock:
            self._waiters.discard(payload, event)

    def dispatch(self, payload: str) -> None:
        """Wake the waiters of one record."""
        with self._lock:
            events = list(self._waiters.of(payload))
        for event in events:
            event.set()

    def _wake_all(self) -> None:
        with self._lock:
            events = self._waiters.everyone()
        for event in events:
            event.set()

    def close(self) -> None:
        """Stop the thread and close its connection; wake every waiter (idempotent)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if self._wake_w is not None:
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"\0")
        self._wake_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._settings.connect_timeout + 5.0)

    def _run(self) -> None:
        wake = self._wake_r
        assert wake is not None
        rhythm = Rhythm(self.ready, self._wake_all)
        try:
            # Runs for the store's lifetime; every round is bounded by a connect timeout or a
            # pause, and close() ends it.
            while not self._closed:
                try:
                    conn = psycopg.connect(self._settings.conninfo, **self._settings.kwargs)
                except psycopg.Error:
                    rhythm.failed("cannot connect")
                else:
                    try:
                        conn.execute(self._listen)
                        rhythm.listening()
                        self._pump(conn.pgconn, wake)
                    except psycopg.Error:
                        rhythm.failed("lost")
                    finally:
                        self.ready.clear()
                        conn.close()
                if self._closed:
                    return
                pause = rhythm.pause()
                with selectors.DefaultSelector() as sel:
                    sel.register(wake, selectors.EVENT_READ)
                    sel.select(pause)
        finally:
            with self._lock:
                for sock in (self._wake_r, self._wake_w):
                    if sock is not None:
                        sock.close()
                self._wake_r = self._wake_w = None

    def _pump(self, pgconn: pq.abc.PGconn, wake: socket.socket) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(pgconn.socket, selectors.EVENT_READ, "pg")
            sel.register(wake, selectors.EVENT_READ, "wake")
            while not self._closed:
                events = sel.select(60.0)
                if any(key.data == "wake" for key, _ in events):
                    return
                if not events:
                    continue
                pgconn.consume_input()
                while (notify := pgconn.notifies()) is not None:
                    self.dispatch(notify.extra.decode())
                if pgconn.status != pq.ConnStatus.OK:
                    raise psycopg.OperationalError("listener connection lost")


async def listen(
    settings: Settings,
    statement: bytes,
    waiters: Waiters[asyncio.Event],
    ready: asyncio.Event,
    stopped: Callable[[], bool],
) -> None:
    """An async store's listener task in one event loop; runs until cancelled or ``stopped()``."""
    rhythm = Rhythm(ready, waiters.wake_all)
    while not stopped():
        try:
            conn = await psycopg.AsyncConnection.connect(settings.conninfo, **settings.kwargs)
        except psycopg.Error:
            rhythm.failed("cannot connect")
        else:
            try:
                await conn.execute(statement)
                rhythm.listening()
                async for notify in conn.notifies():
                    waiters.wake(notify.payload)
            except psycopg.Error:
                rhythm.failed("lost")
            finally:
                ready.clear()
                await conn.close()
        await asyncio.sleep(rhythm.pause())
