"""The Redis ledger's operations, each written once as a generator of the steps it needs.

An operation yields a step — one command (a tuple, as ``execute_command`` takes it), a
:class:`Batch` of commands sent in one round trip, a :class:`Scan` of the keyspace, a
:class:`Pause` on a waiter's event or a :class:`Sleep` — and is sent the step's answer, or has
the step's error thrown into it. It decides everything else: which script, what to send again
after a lost reply or during a cluster's failover, when a waiter reads and how long it sleeps,
how an error is told. The blocking and async stores only carry the steps to Redis and back
(see ``_stores.py``), to one server or to a cluster alike. The one thing an operation does
itself is register a waiter with the subscriber, a short send on its own connection.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar

from redis.exceptions import (
    AskError,
    ClusterError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._records import FINAL_STATES, Change, Effect, Record, Snapshot, State
from ._core import Core, NotReplicated
from ._lua import CLAIM, PURGE, READ, WRITE, Lua
from ._replies import counts as read_counts
from ._replies import readable, select, settled, snapshot, store_error
from ._subscriber import LoopWatch, ThreadWatch

T = TypeVar("T")

_SCAN_COUNT: Final = 500
_RETRY_FIRST: Final = 0.05  # during a failover: 50 ms between attempts, doubling to 1 s
_RETRY_CAP: Final = 1.0

# A lost connection, and what a cluster answers while it fails over or moves a slot (down,
# try again, a redirection the client could not follow, no node for a slot): none of them says
# the command took effect, and every command sent under _guarded is safe to send again.
_LOST: Final = (RedisConnectionError, RedisTimeoutError)
_FAILING_OVER: Final = (*_LOST, ClusterError, TryAgainError, AskError, RedisClusterException)

Command: TypeAlias = tuple[Any, ...]
"""One Redis command and its arguments: ``("EVALSHA", sha, 1, key, ...)``."""


@dataclass(frozen=True, slots=True)
class Batch:
    """Commands sent in one round trip (a pipeline); answered by the list of their replies.

    On a cluster each command goes to the node of its key, unless ``one_connection``: then all
    of them go, on one connection, to the primary of the first command's key (``WAIT`` counts
    the replicas that have the writes of its own connection).
    """

    commands: tuple[Command, ...]
    transaction: bool = False  # wrapped in MULTI / EXEC
    raise_on_error: bool = True  # else an error is answered in the list, in its command's place
    one_connection: bool = False


@dataclass(frozen=True, slots=True)
class Scan:
    """Every key whose name matches ``pattern``, on every primary; answered by their names."""

    pattern: str
    count: int = _SCAN_COUNT


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` (a cluster failing over); answered by ``None``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Pause:
    """Block until ``event`` is set or ``seconds`` pass; answered by whether it is set."""

    event: threading.Event | asyncio.Event
    seconds: float


Step: TypeAlias = Command | Batch | Scan | Pause | Sleep
Op: TypeAlias = Generator[Step, Any, T]


def _guarded(core: Core, what: str, attempt: Callable[[], Op[T]]) -> Op[T]:
    """Run ``attempt``; after a lost connection, once more on a fresh one.

    On a cluster (``failover_wait`` > 0) the attempts go on, 50 ms apart doubling to 1 s, for
    as long as the cluster is failing over, or fewer replicas than ``wait_replicas`` acknowledge
    (a promoted replica has none until its old primary rejoins), and ``failover_wait`` has not
    passed since the first failure. Every command sent here is safe to send again (see "Lost
    replies" in docs/stores/redis.md); redis-py's own retries are off. redis-py's errors become
    :class:`~twiceshy.StoreError`.
    """
    core.check_open()
    retried = False
    give_up: float | None = None
    delay = _RETRY_FIRST
    while True:
        try:
            return (yield from attempt())
        except (RedisError, UnicodeError, NotReplicated) as exc:
            if not _failing_over(exc):
                raise _told(what, exc) from exc
            if core.failover_wait <= 0:
                if retried or not isinstance(exc, _LOST):
                    raise _told(what, exc) from exc
                retried = True  # the connection was dropped: the next command gets a new one
                continue
            now = time.monotonic()
            give_up = now + core.failover_wait if give_up is None else give_up
            if now >= give_up:
                raise _told(what, exc) from exc
            core.check_open()
            yield Sleep(min(delay, give_up - now))
            delay = min(delay * 2, _RETRY_CAP)


def _failing_over(exc: Exception) -> bool:
    """Whether ``exc`` says the cluster is moving on (see ``_FAILING_OVER``), or that too few
    replicas had an answer yet; or, for a ``WAIT`` whose primary was just made a replica, that
    Redis unblocked it (the operation, sent again, finds the new primary)."""
    if isinstance(exc, (*_FAILING_OVER, NotReplicated)):
        return True
    # A pipeline's error names its command first: "Command # 2 (WAIT ...) ... UNBLOCKED ...".
    return isinstance(exc, ResponseError) and "UNBLOCKED force unblock" in str(exc)


def _told(what: str, exc: Exception) -> Exception:
    """The error a caller gets: twiceshy's own as it is, redis-py's as a StoreError."""
    return exc if isinstance(exc, NotReplicated) else store_error(what, exc)


def _script(lua: Lua, key: str, args: list[str]) -> Op[Any]:
    """One script call; a server that lost the script (a restart, a promoted replica) is sent
    its text (``EVAL``, which also keeps it for the next ``EVALSHA``)."""
    try:
        return (yield ("EVALSHA", lua.sha, 1, key, *args))
    except NoScriptError:
        return (yield ("EVAL", lua.text, 1, key, *args))


def _changing(core: Core, lua: Lua, key: str, args: list[str], what: str) -> Op[Any]:
    """A script that may change the record; ``WAIT`` for replicas, in its round trip, if asked."""
    if core.wait_replicas == 0:
        return (yield from _script(lua, key, args))
    wait = ("WAIT", core.wait_replicas, core.wait_ms)
    try:
        reply, acked = yield Batch((("EVALSHA", lua.sha, 1, key, *args), wait), one_connection=True)
    except NoScriptError:
        reply, acked = yield Batch((("EVAL", lua.text, 1, key, *args), wait), one_connection=True)
    snap = snapshot(reply)
    if snap.won:
        core.check_replicas(what, acked)
    elif _answers_outcome(snap):
        yield from _confirmed(core, key)
    return reply


def _answers_outcome(snap: Snapshot) -> bool:
    """Whether a caller may answer with this record: it is settled, not a claim to join."""
    return snap.record is not None and snap.record.state is not State.CLAIMED


def _confirmed(core: Core, key: str) -> Op[None]:
    """Raise :class:`NotReplicated` unless ``wait_replicas`` replicas have the record ``key``.

    A record read, not written, is no write of this connection for ``WAIT`` to count: a short
    write to a key of the record's slot (``<tag>:ack``, gone after a second) comes first, and
    the replication stream being ordered, a replica that has it has the record as read.
    """
    ack = key.removesuffix(":rec") + ":ack"
    touch = ("SET", ack, "1", "PX", "1000")
    _, acked = yield Batch((touch, ("WAIT", core.wait_replicas, core.wait_ms)), one_connection=True)
    core.check_replicas("record", acked, found=True)


def _batches(names: list[Any]) -> Iterable[list[Any]]:
    return (names[start : start + _SCAN_COUNT] for start in range(0, len(names), _SCAN_COUNT))


# -- the Store protocol -------------------------------------------------------------------------


def claim(
    core: Core,
    namespace: str,
    key: str,
    *,
    fingerprint: str,
    tool: str,
    effect: Effect,
    owner: str,
    lease: float,
    args: str | None = None,
) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.claim`: one ``EVALSHA`` of :data:`CLAIM_SCRIPT`."""
    kept = () if args is None else (args,)

    def attempt() -> Op[Snapshot]:
        rec, _ = core.names(namespace, key)
        now = core.now_arg()
        argv = [now, namespace, key, fingerprint, tool, effect.value, owner, repr(float(lease))]
        return snapshot((yield from _changing(core, CLAIM, rec, [*argv, *kept], "claim")))

    return (yield from _guarded(core, "claim", attempt))


def write(core: Core, namespace: str, key: str, change: Change) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.write`: one ``EVALSHA`` of :data:`WRITE_SCRIPT`."""
    write_id = secrets.token_hex(12)  # the same on the second attempt: it recognises itself

    def attempt() -> Op[Snapshot]:
        rec, channel = core.names(namespace, key)
        args = core.write_args(channel, change, write_id)
        return snapshot((yield from _changing(core, WRITE, rec, args, "write")))

    return (yield from _guarded(core, "write", attempt))


def get(core: Core, namespace: str, key: str) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.get`: one ``EVALSHA`` of :data:`READ_SCRIPT`."""

    def attempt() -> Op[Snapshot]:
        rec, _ = core.names(namespace, key)
        snap = snapshot((yield from _script(READ, rec, [core.now_arg()])))
        if core.wait_replicas and _answers_outcome(snap):
            yield from _confirmed(core, rec)
        return snap

    return (yield from _guarded(core, "read", attempt))


def wait(
    core: Core,
    namespace: str,
    key: str,
    fence: int,
    timeout: float,
    watch: ThreadWatch | LoopWatch,
    clock: Callable[[], float],
) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.wait`.

    Subscribes to the record's wake channel, reads once subscribed, then sleeps until a
    wake-up, the re-read interval, or the timeout (on ``clock``, the driver's monotonic clock).
    """
    deadline = clock() + max(timeout, 0.0)
    if timeout <= 0:
        return (yield from get(core, namespace, key))
    channel = core.channel(namespace, key)
    with core.subscriber().watching(channel, watch):
        while True:
            watch.woken.clear()
            left = deadline - clock()
            # Read only once subscribed (no lost wake-up); unsubscribed, read every interval.
            confirmed = yield Pause(watch.confirmed, max(0.0, min(left, core.reread)))
            snap = yield from get(core, namespace, key)
            left = deadline - clock()
            if settled(snap, fence) or left <= 0:
                return snap
            if confirmed:
                yield Pause(watch.woken, min(left, core.reread))


def records(
    core: Core,
    namespace: str,
    *,
    states: Iterable[State] | None = None,
    tool: str | None = None,
    limit: int | None = None,
) -> Op[list[Record]]:
    """See :meth:`twiceshy.stores.Store.records`.

    A ``SCAN`` over the namespace's keys: meant for operators, its cost grows with the whole
    keyspace of the database.
    """

    def attempt() -> Op[list[Record]]:
        found: list[Record] = []
        for batch in _batches((yield Scan(core.pattern(namespace)))):
            replies = yield Batch(tuple(("HGETALL", name) for name in batch), raise_on_error=False)
            found += readable(batch, replies)
        now = core.scan_now((yield ("TIME",)) if core.clock is None else None)
        return select(found, namespace, now, states, tool, limit)

    return (yield from _guarded(core, "records", attempt))


def purge_expired(core: Core, namespace: str | None = None) -> Op[int]:
    """See :meth:`twiceshy.stores.Store.purge_expired`.

    On the server's clock Redis expires outcomes itself; this finds what a caller's clock has
    expired (and any outcome Redis has not yet reclaimed), a pipeline of
    :data:`PURGE_SCRIPT` calls per batch of names.
    """

    def attempt() -> Op[int]:
        count = 0
        for batch in _batches((yield Scan(core.pattern(namespace)))):
            count += yield from _purge_batch(core, batch)
        return count

    return (yield from _guarded(core, "purge", attempt))


def expired(core: Core, namespace: str | None = None) -> Op[list[Record]]:
    """See :meth:`twiceshy.stores.ExpiredOutcomes.expired`: the outcomes a purge would delete.

    The same ``SCAN`` as :func:`records`; on the server's clock Redis has usually reclaimed
    them already, so there are few.
    """

    def attempt() -> Op[list[Record]]:
        found: list[Record] = []
        for batch in _batches((yield Scan(core.pattern(namespace)))):
            replies = yield Batch(tuple(("HGETALL", name) for name in batch), raise_on_error=False)
            found += readable(batch, replies)
        now = core.scan_now((yield ("TIME",)) if core.clock is None else None)
        chosen = [
            r
            for r in found
            if (namespace is None or r.namespace == namespace)
            and r.state in FINAL_STATES
            and r.expires_at is not None
            and r.expires_at <= now
        ]
        chosen.sort(key=lambda r: (r.namespace, r.expires_at or 0.0, r.key))
        return chosen

    return (yield from _guarded(core, "expired", attempt))


def _purge_batch(core: Core, names: list[Any]) -> Op[int]:
    now = core.now_arg()
    try:
        answers = yield Batch(tuple(("EVALSHA", PURGE.sha, 1, name, now) for name in names))
    except NoScriptError:
        answers = yield Batch(tuple(("EVAL", PURGE.text, 1, name, now) for name in names))
    return sum(int(n) for n in answers)


# -- the CallCounts protocol --------------------------------------------------------------------


def add_counts(core: Core, namespace: str, counts: Mapping[tuple[str, str], int]) -> Op[None]:
    """See :meth:`twiceshy.stores.CallCounts.add_counts`: ``HINCRBY``s in one ``MULTI``.

    Not sent again after a lost connection (it may have been applied): the error is raised,
    and whether to send these counts again is the caller's choice.
    """
    core.check_open()
    if not counts:
        return
    name = core.counts_name(namespace)
    commands = tuple(
        ("HINCRBY", name, json.dumps([tool, outcome]), n) for (tool, outcome), n in counts.items()
    )
    try:
        yield Batch(commands, transaction=True)
    except (RedisError, RedisClusterException, UnicodeError) as exc:
        raise store_error("count", exc) from exc


def counts(core: Core, namespace: str) -> Op[dict[tuple[str, str], int]]:
    """See :meth:`twiceshy.stores.CallCounts.counts`."""

    def attempt() -> Op[dict[tuple[str, str], int]]:
        return read_counts((yield ("HGETALL", core.counts_name(namespace))))

    return (yield from _guarded(core, "counts", attempt))
