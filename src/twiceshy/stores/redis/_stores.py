"""The Redis stores, blocking and async, and :func:`open_redis`: thin loops around the operations.

Each method of :class:`RedisStore` and :class:`AsyncRedisStore` is an operation of ``_ops.py``
carried out by a loop that sends its steps to Redis — through redis-py's blocking client, or
the ``redis.asyncio`` client of the running event loop — and hands back each answer, or throws
in each error. Nothing else differs between the two. The loops serve a cluster's stores
(:class:`RedisClusterStore`, :class:`AsyncRedisClusterStore`) too: a cluster client takes the
same commands, and only a batch that must stay on one connection is sent another way
(``_cluster.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, cast

import redis
import redis.asyncio

from ..._forks import reset_in_children
from ..._records import Snapshot
from . import _ops
from ._cluster import ClusterCore, async_one_node, one_node, split_cluster_url
from ._core import POOL_SIZE, POOL_TIMEOUT, AsyncClient, AsyncGate, Core, SyncClient, split_url
from ._ops import Batch, Command, Op, Pause, Scan, Sleep, Step
from ._subscriber import LoopWatch, ThreadWatch

P = ParamSpec("P")
T = TypeVar("T")
_Outcome = tuple[Any, BaseException | None]


def _signed(method: Callable[..., Any], op: Callable[..., Any], owner: str) -> None:
    """Give ``method`` the name, documentation and signature of ``op``, less its core."""
    signature = inspect.signature(op)
    returns = signature.return_annotation
    if isinstance(returns, str):  # the annotations are text: "Op[Snapshot]" answers a Snapshot
        returns = returns.removeprefix("Op[").removesuffix("]")
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[this, *list(signature.parameters.values())[1:]], return_annotation=returns
    )
    method.__name__ = op.__name__
    method.__qualname__ = f"{owner}.{op.__name__}"
    method.__doc__ = op.__doc__


@dataclass(slots=True)
class _Done(Generic[T]):
    """An operation's result: it has no step left."""

    value: T


def _resume(op: Op[T], outcome: _Outcome | None) -> Step | _Done[T]:
    """``op``'s next step, given the last step's answer or error (``None`` to start it)."""
    try:
        if outcome is None:
            return next(op)
        answer, error = outcome
        return op.send(answer) if error is None else op.throw(error)
    except StopIteration as done:
        return _Done(done.value)


# -- the blocking loop ----------------------------------------------------------------------------


def _blocking_step(core: Core, step: Step) -> _Outcome:
    if isinstance(step, Sleep | Pause):
        return _blocking_pause(step)
    gate = core.gate
    if not gate.enter():
        return None, core.pool_exhausted()
    try:
        return _blocking_command(core.client, step)
    finally:
        gate.leave()


def _blocking_pause(step: Sleep | Pause) -> _Outcome:
    if isinstance(step, Sleep):
        time.sleep(step.seconds)
        return None, None
    # A blocking store's waiters are ThreadWatches: their events are threading.Events.
    return cast(threading.Event, step.event).wait(step.seconds), None


def _blocking_command(client: SyncClient, step: Command | Batch | Scan) -> _Outcome:
    # redis-py leaves some execute_commands untyped (hence the ignores): they answer Any.
    try:
        if isinstance(step, tuple):
            return client.execute_command(*step), None  # type: ignore[no-untyped-call]
        if isinstance(step, Batch):
            if step.one_connection and not isinstance(client, redis.Redis):
                return one_node(client, step.commands), None
            pipe = client.pipeline(transaction=step.transaction)
            for command in step.commands:
                pipe.execute_command(*command)
            return pipe.execute(raise_on_error=step.raise_on_error), None
        return list(client.scan_iter(match=step.pattern, count=step.count)), None
    except BaseException as exc:
        return None, exc


def _run(core: Core, op: Op[T]) -> T:
    """Carry ``op``'s steps to Redis and their answers back, blocking; answer its result.

    A command that finds no place at the gate within ``pool_timeout`` has the store's
    :class:`~twiceshy.StoreUnavailable` thrown into its operation, unsent.
    """
    step = _resume(op, None)
    while not isinstance(step, _Done):
        step = _resume(op, _blocking_step(core, step))
    return step.value


def _blocking(
    op: Callable[Concatenate[Core, P], Op[T]],
) -> Callable[Concatenate[RedisStore, P], T]:
    """The method of :class:`RedisStore` that is ``op``, run by the blocking loop."""

    def method(self: RedisStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return _run(self._core, op(self._core, *args, **kwargs))

    _signed(method, op, "RedisStore")
    return method


# -- the async loop -------------------------------------------------------------------------------


async def _pause(event: asyncio.Event, seconds: float) -> bool:
    if not event.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()


async def _async_step(core: Core, client: _LoopClient, step: Step) -> _Outcome:
    if isinstance(step, Sleep):
        await asyncio.sleep(step.seconds)
        return None, None
    if isinstance(step, Pause):
        # An async store's waiters are LoopWatches: their events are asyncio.Events.
        return await _pause(cast(asyncio.Event, step.event), step.seconds), None
    gate = client.gate
    if not await gate.enter():
        return None, core.pool_exhausted()
    try:
        return await _async_command(client.client, step)
    finally:
        gate.leave()


async def _async_command(client: AsyncClient, step: Command | Batch | Scan) -> _Outcome:
    try:
        if isinstance(step, tuple):
            return await client.execute_command(*step), None
        if isinstance(step, Batch):
            if step.one_connection and not isinstance(client, redis.asyncio.Redis):
                return await async_one_node(client, step.commands), None
            pipe = client.pipeline(transaction=step.transaction)
            for command in step.commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=step.raise_on_error), None
        if isinstance(step, Scan):
            names = client.scan_iter(match=step.pattern, count=step.count)
            return [name async for name in names], None
    except BaseException as exc:
        return None, exc


async def _arun(core: Core, client: _LoopClient, op: Op[T]) -> T:
    """Carry ``op``'s steps to Redis and their answers back, on the running event loop."""
    step = _resume(op, None)
    while not isinstance(step, _Done):
        step = _resume(op, await _async_step(core, client, step))
    return step.value


def _awaiting(
    op: Callable[Concatenate[Core, P], Op[T]],
) -> Callable[Concatenate[AsyncRedisStore, P], Coroutine[Any, Any, T]]:
    """The method of :class:`AsyncRedisStore` that is ``op``, run on the caller's event loop."""

    async def method(self: AsyncRedisStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        client = await self._loop_client()
        return await _arun(self._core, client, op(self._core, *args, **kwargs))

    _signed(method, op, "AsyncRedisStore")
    return method


# -- the stores -----------------------------------------------------------------------------------


class _Opening:
    """How both stores are opened: the settings, checked and applied once, in a :class:`Core`."""

    _core: Core

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "twiceshy",
        clock: Callable[[], float] | None = None,
        socket_timeout: float | timedelta = 5.0,
        wait_replicas: int = 0,
        wait_timeout: float | timedelta = 1.0,
        reread_interval: float | timedelta = 1.0,
        client_name: str | None = None,
        allow_eviction: bool = False,
        pool_size: int = POOL_SIZE,
        pool_timeout: float | timedelta = POOL_TIMEOUT,
    ) -> None:
        core = Core(
            url,
            prefix=prefix,
            clock=clock,
            socket_timeout=socket_timeout,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
            reread_interval=reread_interval,
            client_name=client_name,
            allow_eviction=allow_eviction,
            pool_size=pool_size,
            pool_timeout=pool_timeout,
        )
        self._open(core)

    def _open(self, core: Core) -> None:
        self._core = core

    @classmethod
    def from_url(cls, url: str, *, clock: Callable[[], float] | None = None) -> Self:
        """Open the store a URL names, with twiceshy's options in its query.

        ``prefix``, ``wait_replicas``, ``wait_timeout``, ``reread_interval``, ``pool_size``,
        ``pool_timeout`` and ``allow_eviction`` (``1`` or ``0``) are taken out of the query; the
        rest is redis-py's (e.g. ``client_name``, ``socket_timeout``).

        Raises:
            ValueError: an option has no valid value.
            StoreUnavailable: the server cannot be reached.
            EvictionPolicyRefused: the server may evict records (see "Eviction").
        """
        redis_url, options = split_url(url)
        return cls(redis_url, clock=clock, **options)


class RedisStore(_Opening):
    """A :class:`~twiceshy.stores.Store` on a Redis server (redis-py, blocking).

    Thread-safe: one store serves every thread of a process (a pool of connections).

    Args:
        url: ``redis://host:port/db``, ``rediss://...`` or ``unix:///path.sock`` (redis-py's
            query options allowed; twiceshy's own go through :meth:`from_url`).
        prefix: the first part of every key; it must not contain braces.
        clock: the store's clock (seconds since the epoch); ``None`` uses the server's ``TIME``.
        socket_timeout: how long to wait to connect, and for any answer.
        wait_replicas: after each claim and write that took effect, and before answering
            with a settled record read, wait until this many replicas have it (``WAIT``), else
            raise :class:`~twiceshy.StoreError` (0 by default on one server, 1 on a cluster).
        wait_timeout: how long ``WAIT`` may take; shorter than ``socket_timeout`` when
            ``wait_replicas`` is set.
        reread_interval: how often a waiter re-reads the record when no wake-up arrives.
        client_name: the name of every connection (``CLIENT SETNAME``), for operators.
        allow_eviction: open even where the server's ``maxmemory-policy`` may evict records
            (or cannot be read), logging a WARNING: an evicted claim or outcome lets a retry
            run the work again (see "Eviction" in docs/stores/redis.md).
        pool_size: the most commands in flight at once (100 by default: per event loop for the
            async store), so the most connections; a call past them waits for a free one.
        pool_timeout: how long a command waits for a free connection (10 s by default) before
            the call raises :class:`~twiceshy.StoreUnavailable`, the command unsent.

    Raises:
        StoreUnavailable: the server does not answer ``PING`` within ``socket_timeout``.
        EvictionPolicyRefused: the server may evict records, and ``allow_eviction`` is not set.
        StoreError: the server answers, but refuses (authentication, scripts disabled...).
        ValueError: a setting is out of range, or the URL carries twiceshy options.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.safe_url!r}, prefix={self._core.prefix!r})"

    @property
    def prefix(self) -> str:
        """The first part of every key of this store."""
        return self._core.prefix

    def key_names(self, namespace: str, key: str) -> tuple[str, str]:
        """The Redis names of a record: its hash and its wake-up channel."""
        return self._core.names(namespace, key)

    claim = _blocking(_ops.claim)
    write = _blocking(_ops.write)
    get = _blocking(_ops.get)
    records = _blocking(_ops.records)
    purge_expired = _blocking(_ops.purge_expired)
    expired = _blocking(_ops.expired)
    add_counts = _blocking(_ops.add_counts)
    counts = _blocking(_ops.counts)

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`: woken by the record's channel, re-reading
        every ``reread_interval`` meanwhile."""
        op = _ops.wait(self._core, namespace, key, fence, timeout, ThreadWatch(), time.monotonic)
        return _run(self._core, op)

    def close(self) -> None:
        """Stop the subscriber and close every connection (idempotent).

        An :class:`AsyncRedisStore` opened with it by :func:`open_redis` closes with it.
        """
        self._core.close()


class _LoopClient:
    """The ``redis.asyncio`` client of one event loop and its gate; closed when that loop shuts
    down."""

    __slots__ = ("client", "gate", "guard")

    def __init__(self, client: AsyncClient, gate: AsyncGate) -> None:
        self.client = client
        self.gate = gate
        self.guard: AsyncGenerator[None, None] | None = None


async def _close_with_loop(client: AsyncClient) -> AsyncGenerator[None, None]:
    """An async generator whose end closes ``client``.

    Event loops close the async generators started on them when they shut down
    (``asyncio.run`` does), so a client left open by its user is closed on its own loop, where
    its connections live, instead of leaking them when the loop goes away.
    """
    try:
        yield
    finally:
        await client.aclose()


class AsyncRedisStore(_Opening):
    """An :class:`~twiceshy.stores.AsyncStore` on a Redis server (``redis.asyncio``).

    The arguments are those of :class:`RedisStore`; the constructor blocks (at most
    ``socket_timeout``) to check that the server answers. Each event loop gets its own
    connection pool, closed when that loop shuts down (``asyncio.run`` does this) or by
    :meth:`close`. Waiters share one subscriber thread with the store's other waiters.

    Raises:
        StoreUnavailable: the server does not answer ``PING`` within ``socket_timeout``.
        EvictionPolicyRefused: the server may evict records, and ``allow_eviction`` is not set.
        ValueError: a setting is out of range.
    """

    def _open(self, core: Core, *, owns_core: bool = True) -> None:
        self._core = core
        self._owns_core = owns_core
        self._clients: dict[asyncio.AbstractEventLoop, _LoopClient] = {}
        self._clients_lock = threading.Lock()
        self._inherited: list[_LoopClient] = []
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        """In a forked child: a lock no parent thread holds, and none of the parent's clients.

        redis.asyncio does not tell processes apart, so a child on a loop of its parent's would
        share the parent's sockets. They are kept, unused and never closed: closing them from
        here (their loop's async generators would, once collected) could end the parent's
        sessions (a TLS close).
        """
        self._clients_lock = threading.Lock()
        self._inherited += self._clients.values()
        self._clients = {}

    @classmethod
    def twin(cls, store: RedisStore) -> Self:
        """An async store sharing ``store``'s settings and subscriber; closed with it."""
        twin = cls.__new__(cls)
        twin._open(store._core, owns_core=False)
        return twin

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.safe_url!r}, prefix={self._core.prefix!r})"

    async def _loop_client(self) -> _LoopClient:
        self._core.check_open()
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            entry = self._clients.get(loop)
            if entry is not None:
                return entry
            for old in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[old]
            core = self._core
            entry = self._clients[loop] = _LoopClient(core.async_client(), core.async_gate())
        guard = _close_with_loop(entry.client)
        await anext(guard)
        entry.guard = guard
        return entry

    claim = _awaiting(_ops.claim)
    write = _awaiting(_ops.write)
    get = _awaiting(_ops.get)
    records = _awaiting(_ops.records)
    purge_expired = _awaiting(_ops.purge_expired)
    expired = _awaiting(_ops.expired)

    async def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`RedisStore.wait`."""
        loop = asyncio.get_running_loop()
        op = _ops.wait(self._core, namespace, key, fence, timeout, LoopWatch(loop), loop.time)
        return await _arun(self._core, await self._loop_client(), op)

    async def close(self) -> None:
        """Close this loop's connections; a store opened on its own also stops its subscriber.

        Pools of other event loops close when their loops shut down.
        """
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            entry = self._clients.pop(loop, None)
        if entry is not None and entry.guard is not None:
            await entry.guard.aclose()
        if self._owns_core:
            await asyncio.to_thread(self._core.close)


def open_redis(url: str) -> tuple[RedisStore, AsyncRedisStore]:
    """Open the blocking and async stores a ``redis://`` URL names, sharing one subscriber.

    Closing the blocking store closes the pair.

    Raises:
        ValueError: a twiceshy option in the URL has no valid value.
        StoreUnavailable: the server does not answer.
        EvictionPolicyRefused: the server may evict records, and the URL does not accept it.
    """
    store = RedisStore.from_url(url)
    return store, AsyncRedisStore.twin(store)


# -- a cluster's stores ---------------------------------------------------------------------------


class _ClusterOpening(_Opening):
    """How a cluster's stores are opened: the settings in a :class:`ClusterCore`."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "twiceshy",
        clock: Callable[[], float] | None = None,
        socket_timeout: float | timedelta = 5.0,
        wait_replicas: int = 1,
        wait_timeout: float | timedelta = 1.0,
        reread_interval: float | timedelta = 1.0,
        client_name: str | None = None,
        allow_eviction: bool = False,
        failover_wait: float | timedelta = 20.0,
        pool_size: int = POOL_SIZE,
        pool_timeout: float | timedelta = POOL_TIMEOUT,
    ) -> None:
        core = ClusterCore(
            url,
            prefix=prefix,
            clock=clock,
            socket_timeout=socket_timeout,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
            reread_interval=reread_interval,
            client_name=client_name,
            allow_eviction=allow_eviction,
            failover_wait=failover_wait,
            pool_size=pool_size,
            pool_timeout=pool_timeout,
        )
        self._open(core)

    @classmethod
    def from_url(cls, url: str, *, clock: Callable[[], float] | None = None) -> Self:
        """Open the store a ``redis+cluster://`` URL names, with twiceshy's options in its query.

        The options of :meth:`RedisStore.from_url`, and ``failover_wait``; the rest is
        redis-py's (``client_name``, ``socket_timeout``, ``socket_connect_timeout``,
        ``max_connections``, ``protocol``).

        Raises:
            ValueError: an option has no valid value, or the URL names no node.
            StoreUnavailable: no node named can be reached.
            EvictionPolicyRefused: a node may evict records (see "Eviction").
        """
        cluster_url, options = split_cluster_url(url)
        return cls(cluster_url, clock=clock, **options)


class RedisClusterStore(_ClusterOpening, RedisStore):
    """A :class:`~twiceshy.stores.Store` on a Redis Cluster (redis-py's ``RedisCluster``).

    One record is one slot: its hash and its wake channel share a hash tag, and every script
    touches that one key, so the cluster client sends each call to the record's primary and
    follows ``MOVED`` and ``ASK``. The arguments are those of :class:`RedisStore`, but:

    Args:
        url: ``redis+cluster://[user[:password]@]host:port[,host:port...]``: some nodes of the
            cluster (the client finds the others); no database (a cluster has only 0).
        wait_replicas: 1 by default: a claim, an outcome or a replay counts only once a replica
            of the record's primary has it, so that a failover cannot lose it (see
            "Replication" in docs/stores/redis.md); until then the call goes on trying, up to
            ``failover_wait``. ``0`` accepts that loss for one round trip less.
        failover_wait: how long a call goes on trying, 50 ms apart doubling to 1 s, while the
            cluster fails over or a node does not answer, before it raises
            :class:`~twiceshy.StoreUnavailable` (every command it sends again is one the store
            recognises; see "Failover" in docs/stores/redis.md).

    Raises:
        StoreUnavailable: no node the URL names answers within ``socket_timeout``.
        EvictionPolicyRefused: a node, primary or replica, may evict records, and
            ``allow_eviction`` is not set.
        StoreError: the cluster answers, but refuses (authentication, scripts disabled...).
        ValueError: a setting is out of range, or the URL is not a cluster's.
    """


class AsyncRedisClusterStore(_ClusterOpening, AsyncRedisStore):
    """An :class:`~twiceshy.stores.AsyncStore` on a Redis Cluster (``redis.asyncio``'s cluster
    client, one per event loop); the arguments are those of :class:`RedisClusterStore`."""

    @classmethod
    def twin(cls, store: RedisStore) -> Self:
        """An async store sharing ``store``'s settings and subscriber; closed with it."""
        if not isinstance(store._core, ClusterCore):
            raise TypeError("AsyncRedisClusterStore.twin() takes a RedisClusterStore")
        return super().twin(store)


def open_redis_cluster(url: str) -> tuple[RedisClusterStore, AsyncRedisClusterStore]:
    """Open the blocking and async stores a ``redis+cluster://`` URL names, sharing one
    subscriber; closing the blocking store closes the pair.

    Raises:
        ValueError: the URL names no node, or an option has no valid value.
        StoreUnavailable: no node named answers.
        EvictionPolicyRefused: a node may evict records, and the URL does not accept it.
    """
    store = RedisClusterStore.from_url(url)
    return store, AsyncRedisClusterStore.twin(store)
