"""What a Redis store and its async twin share: settings, key layout, the checks made on opening,
the blocking client and the subscriber.

:class:`Core` names every record's hash and channel and builds every script's arguments (no
I/O); its constructor opens the ledger (``PING``, the eviction policy, the scripts loaded) and
fails fast when the server cannot be used safely. How the clients are made — for one server
here, for a Redis Cluster in ``_cluster.py`` — is the part a subclass replaces.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Final, TypeAlias, cast
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from ..._forks import reset_in_children
from ..._records import Change
from ...errors import EvictionPolicyRefused, StoreError, StoreUnavailable
from .. import redacted_url
from ._lua import SCRIPTS
from ._replies import decoded, store_error
from ._subscriber import PubSubConnection, Subscriber

log = logging.getLogger("twiceshy")

_URL_OPTIONS: Final = frozenset(
    {
        "prefix",
        "wait_replicas",
        "wait_timeout",
        "reread_interval",
        "allow_eviction",
        "pool_size",
        "pool_timeout",
    }
)
_SECONDS: Final = frozenset({"wait_timeout", "reread_interval", "failover_wait", "pool_timeout"})
_COUNTS: Final = frozenset({"wait_replicas", "pool_size"})

#: The most commands a store sends at once on one client (``pool_size=``; so the most
#: connections of its pool), and how long a command waits for one of them to end when all are
#: in flight (``pool_timeout=``, seconds) before the call fails.
POOL_SIZE: Final = 100
POOL_TIMEOUT: Final = 10.0
_BOOLEANS: Final = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_SAFE_POLICY: Final = "noeviction"
_GLOB_SPECIAL: Final = frozenset("*?[]\\")


def _seconds(value: float | timedelta, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds >= 0:
        raise ValueError(f"{name}= must be a non-negative number of seconds")
    return seconds


def _quote(text: str) -> str:
    # Keys are hex digests: letters and digits are never quoted, and the check is much cheaper.
    if text.isascii() and text.isalnum():
        return text
    return quote(text, safe="")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in text)


def _opt(value: str | None) -> str:
    """An optional text for a script: "" for none, "=" + the text otherwise."""
    return "" if value is None else "=" + value


def _num(value: float | None) -> str:
    return "" if value is None else "=" + repr(float(value))


class NotReplicated(StoreError):
    """Fewer replicas than ``wait_replicas`` acknowledged a claim, a write, or a record read.

    On a cluster the operation is sent again (it recognises itself) until ``failover_wait``
    passes: a replica that is catching up, or a restarted primary rejoining as one, then
    acknowledges it.
    """


class Gate:
    """Admits at most ``pool_size`` commands of one client at once; the others wait their turn.

    redis-py's own pool raises "Too many connections" past its size instead of waiting. With
    the gate in front, the pool never reaches that: a command waits for a free place up to
    ``pool_timeout``, then fails before it is sent (:meth:`Core.pool_exhausted`). A blocking
    store has one gate for every thread; an async store one per event loop (:class:`AsyncGate`).
    """

    __slots__ = ("_free", "timeout")

    def __init__(self, size: int, timeout: float) -> None:
        self._free = threading.Semaphore(size)
        self.timeout = timeout

    def enter(self) -> bool:
        """Take a place; ``False`` when none was free within the timeout."""
        return self._free.acquire(timeout=self.timeout)

    def leave(self) -> None:
        """Give the place back."""
        self._free.release()


class AsyncGate:
    """:class:`Gate` for the commands of one event loop."""

    __slots__ = ("_free", "timeout")

    def __init__(self, size: int, timeout: float) -> None:
        self._free = asyncio.Semaphore(size)
        self.timeout = timeout

    async def enter(self) -> bool:
        """Take a place; ``False`` when none was free within the timeout."""
        free = self._free
        if not free.locked():
            await free.acquire()  # a free place: taken without suspending
            return True
        try:
            async with asyncio.timeout(self.timeout):
                await free.acquire()
        except TimeoutError:
            return False
        return True

    def leave(self) -> None:
        """Give the place back."""
        self._free.release()


class _BoundedWrites:
    """An async connection whose writes are bounded by ``asyncio.timeout`` (Python 3.11).

    redis-py bounds each write by ``socket_timeout`` through ``asyncio.wait_for``, which on
    Python 3.11 wraps the write in a task of its own: a task and more turns of the event loop
    for every command, CPU that a busy event loop misses. ``asyncio.timeout`` bounds the same
    write in the calling task. A write past the bound fails as redis-py's own does: the
    connection is dropped and a ``redis.exceptions.TimeoutError`` raised. (From Python 3.12,
    ``wait_for`` needs no task, and the connection is redis-py's own.)
    """

    socket_timeout: float | None

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        limit = self.socket_timeout
        send = super().send_packed_command  # type: ignore[misc]
        if not limit:
            await send(command, check_health)
            return
        self.socket_timeout = None  # redis-py writes with no wait_for of its own
        try:
            async with asyncio.timeout(limit):
                await send(command, check_health)
        except TimeoutError as exc:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise redis.exceptions.TimeoutError("Timeout writing to socket") from exc
        finally:
            self.socket_timeout = limit


def bounded_writes(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` with its writes bounded as :class:`_BoundedWrites` bounds them."""
    return type(f"Bounded{connection_class.__name__}", (_BoundedWrites, connection_class), {})


SyncClient: TypeAlias = redis.Redis | RedisCluster
"""A blocking client: of one server, or of a cluster."""

AsyncClient: TypeAlias = redis.asyncio.Redis | redis.asyncio.RedisCluster
"""An async client: of one server, or of a cluster."""


def split_url(url: str, names: frozenset[str] = _URL_OPTIONS) -> tuple[str, dict[str, Any]]:
    """Take twiceshy's own options out of a Redis URL.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL.
        names: the options to take out (a cluster's URL has one more).

    Returns:
        The URL redis-py is given, and the options as keyword arguments of :class:`RedisStore`.

    Raises:
        ValueError: an option has no valid value, or is repeated.
    """
    # Only the query is rebuilt: urlunsplit would turn "unix:///path" into "unix:/path".
    base, _, rest = url.partition("?")
    query, hash_sign, fragment = rest.partition("#")
    kept: list[tuple[str, str]] = []
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in names:
            kept.append((name, value))
            continue
        if name in options:
            raise ValueError(f"Redis ledger URL repeats {name!r}")
        if name == "allow_eviction":
            if value.lower() not in _BOOLEANS:
                raise ValueError(
                    f"Redis ledger URL option allow_eviction={value!r}: expected 1 (accept a "
                    "server that may evict records) or 0"
                )
            options[name] = _BOOLEANS[value.lower()]
            continue
        try:
            options[name] = int(value) if name in _COUNTS else value
            if name in _SECONDS:
                options[name] = float(value)
        except ValueError:
            raise ValueError(f"Redis ledger URL option {name}={value!r} is not a number") from None
    kept_query = urlencode(kept, quote_via=quote)
    plain = base + ("?" + kept_query if kept_query else "") + hash_sign + fragment
    return plain, options


def _eviction_policy(client: redis.Redis) -> tuple[str | None, str]:
    """The server's ``maxmemory-policy``, or ``None`` and why it could not be read."""
    why: list[str] = []
    try:
        reply = cast(Mapping[Any, Any], client.config_get("maxmemory-policy"))
        found = {decoded(k): decoded(v) for k, v in reply.items()}
    except ResponseError as exc:  # disabled or renamed (managed Redis), or not granted (ACL)
        why.append(f"CONFIG GET: {exc}")
    else:
        if found.get("maxmemory-policy"):
            return found["maxmemory-policy"].lower(), ""
        why.append("CONFIG GET answered no maxmemory-policy")
    try:
        policy = client.info("memory").get("maxmemory_policy")
    except ResponseError as exc:
        why.append(f"INFO: {exc}")
    else:
        if policy:
            return str(policy).lower(), ""
        why.append("INFO memory shows no maxmemory_policy")
    return None, "; ".join(why)


class Core:
    """What a store and its twin share: settings, key layout, the sync client, the subscriber.

    The clients are made by :meth:`open_client`, :meth:`async_client` and
    :meth:`pubsub_connection`, and the servers to check by :meth:`servers`: those of one server
    here; ``ClusterCore`` makes a cluster's.
    """

    #: The query options of a URL of this kind that are twiceshy's.
    url_options: ClassVar[frozenset[str]] = _URL_OPTIONS
    #: How a URL with twiceshy's options in it is opened (for the error saying so).
    opener: ClassVar[str] = "RedisStore.from_url() or open_redis()"

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        clock: Callable[[], float] | None,
        socket_timeout: float | timedelta,
        wait_replicas: int,
        wait_timeout: float | timedelta,
        reread_interval: float | timedelta,
        client_name: str | None,
        allow_eviction: bool,
        failover_wait: float | timedelta = 0.0,
        pool_size: int = POOL_SIZE,
        pool_timeout: float | timedelta = POOL_TIMEOUT,
    ) -> None:
        if set(dict(parse_qsl(urlsplit(url).query))) & self.url_options:
            raise ValueError(
                f"{redacted_url(url)!r} carries twiceshy options: open it with "
                f"{self.opener}, or pass them as keyword arguments"
            )
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a Redis ledger prefix must not contain braces: {prefix!r}")
        if wait_replicas < 0:
            raise ValueError("wait_replicas= must not be negative")
        if pool_size < 1:
            raise ValueError("pool_size= must be at least 1")
        self.url = url
        self.prefix = prefix
        self.clock = clock
        self.socket_timeout = _seconds(socket_timeout, "socket_timeout")
        self.wait_replicas = wait_replicas
        self.wait_ms = max(1, round(_seconds(wait_timeout, "wait_timeout") * 1000))
        self.reread = _seconds(reread_interval, "reread_interval")
        if self.reread <= 0:
            raise ValueError("reread_interval= must be positive")
        if wait_replicas > 0 and self.wait_ms / 1000 >= self.socket_timeout:
            # The reply to the pipelined WAIT comes only after wait_timeout: on a socket that
            # gives up first, every write with a lagging replica would end as a lost reply.
            raise ValueError(
                f"wait_timeout= ({self.wait_ms / 1000:g} s) must be shorter than socket_timeout= "
                f"({self.socket_timeout:g} s) when wait_replicas= is above 0 (a redis+cluster:// "
                "ledger waits for 1 replica unless its URL says wait_replicas=0)"
            )
        # How long a call goes on trying while a cluster fails over (0: once more, at once).
        self.failover_wait = _seconds(failover_wait, "failover_wait")
        # How long Redis keeps an outcome's hash past its expires_at: the last attempt of a
        # write whose reply was lost comes at most one socket_timeout (the lost answer) plus one
        # (a new connection) after the first — plus failover_wait on a cluster — and must still
        # find the write it recognises.
        self.expiry_grace = 2 * self.socket_timeout + 1.0 + self.failover_wait
        self.client_name = client_name
        self.allow_eviction = allow_eviction
        self.pool_size = pool_size
        self.pool_timeout = _seconds(pool_timeout, "pool_timeout")
        if self.pool_timeout <= 0:
            raise ValueError("pool_timeout= must be positive")
        self.gate = Gate(pool_size, self.pool_timeout)
        self.closed = False
        self._lock = threading.Lock()
        self._subscriber: Subscriber | None = None
        reset_in_children(self)
        try:
            self.client: SyncClient = self.open_client()
            self.client.ping()
            for node, server in self.servers():
                self._check_eviction(node, *_eviction_policy(server))
            self.load_scripts()
        except EvictionPolicyRefused:
            self.disconnect()
            raise
        except (RedisError, RedisClusterException, OSError) as exc:
            self.disconnect()
            raise store_error(f"open {self.safe_url}", exc) from exc
        except TypeError as exc:
            # redis-py hands a query parameter it does not know to its connection class, which
            # refuses it when the first connection is made.
            self.disconnect()
            raise ValueError(f"Redis ledger URL {self.safe_url}: {exc}") from None

    # -- the clients (ClusterCore makes a cluster's) ---------------------------------------------

    def open_client(self) -> SyncClient:
        """The blocking client every store call goes through."""
        if "max_connections" in dict(parse_qsl(urlsplit(self.url).query)):
            # redis-py's limit fails a command past it, where pool_size makes it wait.
            raise ValueError(
                f"Redis ledger URL {self.safe_url}: give the pool's size as pool_size=, "
                "not max_connections="
            )
        self.pool = redis.ConnectionPool.from_url(
            self.url, max_connections=self.pool_size, **self.connection_options(Retry)
        )
        return redis.Redis(connection_pool=self.pool)

    def servers(self) -> list[tuple[str, redis.Redis]]:
        """Every server whose eviction policy is checked, each with its name for messages."""
        return [("", cast(redis.Redis, self.client))]

    def load_scripts(self) -> None:
        """Load every script, so that a first call pays no ``NOSCRIPT`` detour."""
        for lua in SCRIPTS:
            self.client.script_load(lua.text)

    def pubsub_connection(self) -> PubSubConnection:
        """A new connection for the subscriber (not yet connected)."""
        pool = self.pool
        return cast(PubSubConnection, pool.connection_class(**pool.connection_kwargs))

    def async_client(self) -> AsyncClient:
        """A new async client, for one event loop."""
        pool = redis.asyncio.ConnectionPool.from_url(
            self.url, max_connections=self.pool_size, **self.connection_options(AsyncRetry)
        )
        if sys.version_info < (3, 12):
            pool.connection_class = bounded_writes(pool.connection_class)
        return redis.asyncio.Redis.from_pool(pool)

    def disconnect(self) -> None:
        """Close the blocking client's connections."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.disconnect()

    def _check_eviction(self, node: str, policy: str | None, why: str) -> None:
        """Refuse a server that may evict records, unless ``allow_eviction`` accepts it.

        ``node`` names the server among a cluster's ("" for the only one).
        """
        if policy == _SAFE_POLICY:
            return
        consequence = (
            "an evicted claim or outcome lets a retry run the work again, an UNSAFE tool included"
        )
        if policy is None:
            risk = f"its maxmemory-policy cannot be read ({why})"
            remedy = "Let the ledger's user read it (ACL: +info), and make sure it is noeviction"
        else:
            risk = f"maxmemory-policy is {policy}, which lets Redis evict the ledger's records"
            remedy = (
                "Set it to noeviction: CONFIG SET maxmemory-policy noeviction, and "
                "maxmemory-policy noeviction in redis.conf to keep it across restarts (on "
                "managed Redis, in the server's parameters)"
            )
        where = self.safe_url + (f" (node {node})" if node else "")
        if self.allow_eviction:
            log.warning(
                "Redis ledger %s: %s, and allow_eviction=1 accepts it: %s.",
                where,
                risk,
                consequence,
            )
            return
        raise EvictionPolicyRefused(
            f"Redis ledger {where}: {risk}; {consequence}. {remedy}; or add "
            "allow_eviction=1 to the ledger URL to accept the risk."
        )

    def connection_options(self, retry: type[Retry] | type[AsyncRetry]) -> dict[str, Any]:
        options: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "health_check_interval": 0,
            # The store decides what is sent again after a lost connection: never redis-py.
            "retry": retry(NoBackoff(), 0),
        }
        if not self.url.lower().startswith("unix:"):
            options["socket_keepalive"] = True  # a TCP option: a Unix socket refuses it
        if self.client_name is not None:
            options["client_name"] = self.client_name
        return options

    @property
    def safe_url(self) -> str:
        """The URL with its secrets shown as ``***`` (see :func:`twiceshy.stores.redacted_url`)."""
        return redacted_url(self.url)

    # -- names and arguments (no I/O) -------------------------------------------------------

    def names(self, namespace: str, key: str) -> tuple[str, str]:
        """The record's hash and its wake channel."""
        tag = f"{self.prefix}:{{{_quote(namespace)}:{_quote(key)}}}"
        return f"{tag}:rec", f"{tag}:wake"

    def channel(self, namespace: str, key: str) -> bytes:
        """The record's wake channel, as the subscriber matches it."""
        try:
            return self.names(namespace, key)[1].encode()
        except UnicodeError as exc:
            raise store_error("wait", exc) from exc

    def counts_name(self, namespace: str) -> str:
        """The hash of a namespace's call counts (outside every record's pattern)."""
        return f"{self.prefix}:counts:{{{_quote(namespace)}}}"

    def pattern(self, namespace: str | None) -> str:
        """A SCAN pattern for the records of one namespace, or of every namespace."""
        inner = "*" if namespace is None else f"{_quote(namespace)}:*"
        return f"{_glob_escape(self.prefix)}:{{{inner}}}:rec"

    def now_arg(self) -> str:
        """A script's ``ARGV[1]``: ``""`` for the server's ``TIME``, else the caller's clock."""
        return "" if self.clock is None else repr(float(self.clock()))

    def write_args(self, channel: str, change: Change, write_id: str) -> list[str]:
        """The ``ARGV`` of :data:`~twiceshy.stores.redis.WRITE_SCRIPT` for one change."""
        states = "," + ",".join(sorted(s.value for s in change.from_states)) + ","
        return [
            self.now_arg(),
            write_id,
            channel,
            str(int(change.fence)),
            states,
            change.to.value,
            _opt(change.owner),
            "1" if change.lapsed else "0",
            _opt(change.new_owner),
            _num(change.lease),
            "1" if change.count_attempt else "0",
            _opt(change.result),
            _opt(change.error),
            _opt(change.reason),
            _num(change.ttl),
            _num(self.expiry_grace) if self.clock is None else "",
        ]

    def scan_now(self, server_time: tuple[int, int] | None) -> float:
        if server_time is None:
            return float(cast(Callable[[], float], self.clock)())
        seconds, micros = server_time
        return seconds + micros / 1_000_000

    def check_replicas(self, what: str, acked: object, *, found: bool = False) -> None:
        """Raise :class:`NotReplicated` unless ``wait_replicas`` replicas acknowledged.

        ``found``: the record was read, not written (a replay, or an outcome a waiter found).
        """
        if isinstance(acked, int) and acked >= self.wait_replicas:
            return
        done = "was found" if found else "took effect"
        raise NotReplicated(
            f"Redis ledger: the {what} {done} on the primary, but only {acked} of "
            f"{self.wait_replicas} replicas acknowledged it within {self.wait_ms} ms; a failover "
            "now could lose it, so it is not answered (nothing ran). Every primary needs "
            f"{self.wait_replicas} replica(s) in sync; wait_replicas=0 in the ledger URL "
            "accepts losing claims and outcomes at a failover instead"
        )

    # -- open or closed, and the subscriber ----------------------------------------------------

    def async_gate(self) -> AsyncGate:
        """A new gate, for the client of one event loop."""
        return AsyncGate(self.pool_size, self.pool_timeout)

    def pool_exhausted(self) -> StoreUnavailable:
        """The error for a command that found no free place within ``pool_timeout``.

        Raised before the command is sent: nothing was claimed or written.
        """
        return StoreUnavailable(
            f"Redis ledger {self.safe_url}: all pool_size={self.pool_size} connections stayed "
            f"busy for pool_timeout={self.pool_timeout:g} s; nothing was sent. Raise pool_size= "
            "in the ledger URL, or pool_timeout= to let bursts wait longer."
        )

    def check_open(self) -> None:
        if self.closed:
            raise StoreError(f"Redis ledger {self.safe_url} is closed")

    def _after_fork_in_child(self) -> None:
        """In a forked child: a lock no parent thread holds, and no parent's subscriber.

        The parent's reader thread does not exist here, and its lock may have been held at the
        fork. Its connection is left alone, never closed from here (redis-py shuts down no
        socket of another process); the child's first waiter starts a subscriber of its own.
        """
        self._lock = threading.Lock()
        self._subscriber = None
        self.gate = Gate(self.pool_size, self.pool_timeout)  # a parent's thread may hold places

    def subscriber(self) -> Subscriber:
        with self._lock:
            self.check_open()
            if self._subscriber is None:
                connect = self.pubsub_connection
                self._subscriber = Subscriber(connect, "twiceshy-redis-subscriber")
            return self._subscriber

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            subscriber.close(self.socket_timeout + 1.0)
        self.client.close()
        self.disconnect()
