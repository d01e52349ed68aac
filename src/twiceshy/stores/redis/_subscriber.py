"""Wake-ups for the Redis ledger's waiters: one pub/sub connection and its reader thread.

A guarded write that settles a record publishes on the record's wake channel; a
:class:`Subscriber` hears it and wakes every waiter of that channel, blocking ones
(:class:`ThreadWatch`) and async ones (:class:`LoopWatch`, woken on their own event loop) alike.
A waiter reads the record only once its subscription is confirmed, so no wake-up is lost; a
lost connection wakes every waiter to read again, and is made again with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from ...errors import StoreError

log = logging.getLogger("twiceshy")

_IDLE_SUBSCRIBER: Final = 10.0  # seconds without waiters before the reader thread ends
_READ_POLL: Final = 0.5  # the reader thread's longest sleep between checks of its state
_BACKOFF_FIRST: Final = 0.05
_BACKOFF_CAP: Final = 1.0


class Watch(Protocol):
    """A waiter, as the subscriber sees it; called from the reader thread."""

    def ready(self) -> None:
        """The channel's subscription is confirmed: wake-ups from now on arrive."""

    def wake(self) -> None:
        """A message arrived on the channel."""

    def lost(self) -> None:
        """The subscription was lost: look again now, and wait for it to be back."""


class PubSubConnection(Protocol):
    """The part of a redis-py connection the subscriber uses."""

    def connect(self) -> None: ...
    def disconnect(self) -> None: ...
    def send_command(self, *args: bytes) -> None: ...
    def can_read(self, timeout: float = 0) -> bool: ...
    def read_response(
        self, *, disconnect_on_error: bool = True, push_request: bool = False
    ) -> object: ...


class _Channel:
    __slots__ = ("confirmed", "watches")

    def __init__(self) -> None:
        self.watches: set[Watch] = set()
        self.confirmed = False


class Subscriber:
    """One pub/sub connection and its reader thread, dispatching messages to waiters.

    Waiters subscribe from their own threads (a short send under the lock); only the reader
    thread reads. Replies to SUBSCRIBE and UNSUBSCRIBE come in the order the commands were
    sent, which :attr:`_sent` mirrors, so a confirmation is matched to the subscription it
    confirms even when a channel is unsubscribed and subscribed again in between.
    """

    def __init__(self, connect: Callable[[], PubSubConnection], name: str) -> None:
        self._connect = connect
        self._name = name
        self._lock = threading.Lock()
        self._conn: PubSubConnection | None = None
        self._broken = False
        self._answered = False  # the current connection has answered a command
        self._refusal_logged = False
        self._channels: dict[bytes, _Channel] = {}
        self._sent: deque[tuple[bytes, _Channel | None]] = deque()
        self._thread: threading.Thread | None = None
        self._idle_since: float | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def watching(self, channel: bytes, watch: Watch) -> Iterator[None]:
        """Register a waiter on a channel for the duration of the block."""
        with self._lock:
            if self._stop.is_set():
                raise StoreError("Redis ledger is closed")
            entry = self._channels.get(channel)
            if entry is None:
                entry = self._channels[channel] = _Channel()
                self._send(b"SUBSCRIBE", channel, entry)
            entry.watches.add(watch)
            if entry.confirmed:
                watch.ready()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                entry.watches.discard(watch)
                if not entry.watches and self._channels.get(channel) is entry:
                    del self._channels[channel]
                    self._send(b"UNSUBSCRIBE", channel, None)

    def _send(self, command: bytes, channel: bytes, entry: _Channel | None) -> None:
        """Send one (UN)SUBSCRIBE if connected; called with the lock held."""
        conn = self._conn
        if conn is None or self._broken:
            return  # the reader subscribes every registered channel when it connects
        try:
            conn.send_command(command, channel)
        except Exception:
            # The reader notices at its next look and starts over on a new connection.
            self._broken = True
            return
        self._sent.append((channel, entry))

    def close(self, timeout: float) -> None:
        """Stop the reader thread and close the connection (idempotent)."""
        with self._lock:
            self._stop.set()
            conn, self._conn = self._conn, None
            thread = self._thread
            for entry in self._channels.values():
                for watch in entry.watches:
                    watch.lost()
        if conn is not None:
            conn.disconnect()  # wakes the reader at once
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the reader thread -----------------------------------------------------------------

    def _run(self) -> None:
        delay = _BACKOFF_FIRST
        while not self._stop.is_set():
            if self._retire_if_idle(wait=False):
                return
            conn = self._connect()
            try:
                conn.connect()
                if not self._install(conn):
                    return
                self._read(conn)
                return  # stopped, or idle long enough
            except Exception:
                # The connection failed: the waiters were told (_uninstall); start over after
                # a pause.
                pass
            finally:
                self._uninstall(conn)
            # The pause grows until a connection answers: one that fails before it ever
            # answered (connected, then refused or cut at once) must not be retried at once.
            if self._answered:
                delay = _BACKOFF_FIRST
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, _BACKOFF_CAP)

    def _retire_if_idle(self, *, wait: bool) -> bool:
        """End the thread when no waiter came for a while; a later waiter starts a new one."""
        with self._lock:
            if self._channels or self._sent:
                self._idle_since = None
                return False
            now = time.monotonic()
            if self._idle_since is None:
                self._idle_since = now
            if now - self._idle_since < (_IDLE_SUBSCRIBER if wait else 0.0):
                return False
            self._thread = None
            self._conn = None
            self._idle_since = None
            return True

    def _install(self, conn: PubSubConnection) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._conn, self._broken, self._answered = conn, False, False
            self._sent.clear()
            for channel, entry in self._channels.items():
                entry.confirmed = False
                self._send(b"SUBSCRIBE", channel, entry)
            return True

    def _uninstall(self, conn: PubSubConnection) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
                self._sent.clear()
                for entry in self._channels.values():
                    entry.confirmed = False
                    for watch in entry.watches:
                        watch.lost()
        conn.disconnect()

    def _read(self, conn: PubSubConnection) -> None:
        """Dispatch messages until the connection fails (raises), a stop, or a long idle."""
        while not self._stop.is_set():
            with self._lock:
                if self._broken:
                    raise RedisConnectionError("a subscription could not be sent")
            if self._retire_if_idle(wait=True):
                return
            if not conn.can_read(timeout=_READ_POLL):
                continue
            try:
                # RESP3 (redis-py's default) delivers pub/sub as push frames: ask for them.
                message = conn.read_response(disconnect_on_error=False, push_request=True)
            except ResponseError as exc:
                self._refused(exc)
                continue
            self._dispatch(message)

    def _refused(self, exc: ResponseError) -> None:
        """The server refused the oldest command sent (e.g. ``NOPERM`` for the channel).

        The connection stays: it answers in order, and other channels may be allowed. The
        waiters of a refused channel are let read at once and then every re-read interval,
        since no wake-up will come for them; the channel is asked for again only when a waiter
        comes after they have all left.
        """
        with self._lock:
            if not self._sent:
                raise RedisError(f"pub/sub error with no command waiting: {exc}") from exc
            self._answered = True
            channel, sent_for = self._sent.popleft()
            if sent_for is None or self._channels.get(channel) is not sent_for:
                return  # an UNSUBSCRIBE, or a subscription nobody waits on any more
            sent_for.confirmed = True  # as far as the waiters can go: read, then re-read
            for watch in sent_for.watches:
                watch.ready()
            first, self._refusal_logged = not self._refusal_logged, True
        if first:
            log.warning(
                "Redis ledger: the server refuses to SUBSCRIBE to %s (%s); waiters for a call "
                "running elsewhere will not be woken, and re-read the record every "
                "reread_interval instead. Grant the ledger's user its channels (ACL: "
                "&<prefix>:*) to wake them at once.",
                channel.decode(errors="replace"),
                exc,
            )

    def _dispatch(self, message: object) -> None:
        if not isinstance(message, list) or len(message) < 2:
            return  # not ours (a server notice redis-py's parser already handled)
        # Bytes, unless the URL asked redis-py to decode (decode_responses=true).
        kind, channel = (part.encode() if isinstance(part, str) else part for part in message[:2])
        with self._lock:
            self._answered = True
            if kind == b"message":
                entry = self._channels.get(channel)
                for watch in entry.watches if entry is not None else ():
                    watch.wake()
                return
            if kind not in (b"subscribe", b"unsubscribe"):
                return
            if not self._sent or self._sent[0][0] != channel:
                raise RedisError(f"pub/sub reply out of order: {message!r}")
            _, sent_for = self._sent.popleft()
            if (
                kind == b"subscribe"
                and sent_for is not None
                and (self._channels.get(channel) is sent_for)
            ):
                sent_for.confirmed = True
                for watch in sent_for.watches:
                    watch.ready()


class ThreadWatch:
    """A blocking waiter's events."""

    __slots__ = ("confirmed", "woken")

    def __init__(self) -> None:
        self.confirmed = threading.Event()
        self.woken = threading.Event()

    def ready(self) -> None:
        self.confirmed.set()

    def wake(self) -> None:
        self.woken.set()

    def lost(self) -> None:
        self.confirmed.clear()
        self.woken.set()


class LoopWatch:
    """An async waiter's events, set on its own loop from the reader thread."""

    __slots__ = ("confirmed", "loop", "woken")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.confirmed = asyncio.Event()
        self.woken = asyncio.Event()

    def _soon(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(fn)

    def ready(self) -> None:
        self._soon(self.confirmed.set)

    def wake(self) -> None:
        self._soon(self.woken.set)

    def lost(self) -> None:
        self._soon(self.confirmed.clear)
        self._soon(self.woken.set)
