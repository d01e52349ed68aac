"""The async PostgreSQL store: a pool and a listener task per event loop, and a loop of I/O.

:class:`AsyncPostgresStore` carries the operations of ``_ops.py`` to the server as the blocking
store does, awaiting instead of blocking. psycopg's async pool lives in one event loop, so each
loop that uses the store gets its own :class:`_LoopState` (pool, listener task, waiters), closed
when that loop shuts down or by :meth:`AsyncPostgresStore.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Final, TypeVar, Unpack

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from ..._records import Change, Record, Snapshot
from ...errors import StoreError
from . import _ops
from ._errors import closed, pool_exhausted, store_error, unreachable
from ._listener import Waiters, listen
from ._ops import (
    MAX_STEPS,
    SCHEMA_STEPS,
    WAIT_STEPS,
    ClaimArgs,
    Drive,
    Pause,
    RecordsFilter,
    Rows,
    Step,
)
from ._settings import Configured

log = logging.getLogger("twiceshy")

_T = TypeVar("_T")
_C = TypeVar("_C")

_Conn = psycopg.AsyncConnection[TupleRow]
_Pool = AsyncConnectionPool[_Conn]
_Answer = Rows | psycopg.OperationalError

_OPEN_ROUNDS: Final = 3  # opening a loop's pool: looks at a replaced state, then gives up


async def _drive(
    op: Generator[_C, Rows, _T],
    execute: Callable[[_C], Awaitable[_Answer]],
    limit: int = MAX_STEPS,
) -> _T:
    """Carry out an operation's commands one by one, awaiting each; its answer."""
    drive = Drive(op, limit)
    try:
        while drive.pending:
            drive.send(await execute(drive.command))
    finally:
        op.close()
    return drive.result


async def _fetch(conn: _Conn, step: Step) -> _Answer:
    """Run one statement: its rows, or the error that lost the connection."""
    try:
        cur = await conn.execute(step.query, step.params)
        return await cur.fetchall() if step.rows else []
    except psycopg.OperationalError as exc:
        return exc
    except (psycopg.Error, UnicodeError) as exc:
        raise store_error(exc) from exc


class _LoopState:
    """An async store's pool, listener task and waiters in one event loop."""

    def __init__(self, pool: _Pool, conns: weakref.WeakSet[_Conn]) -> None:
        self.pool = pool
        #: Every connection the pool has opened and not yet dropped, so that they can be closed
        #: even when the pool can no longer close them itself (see release).
        self.conns = conns
        self.opened = False
        self.lock = asyncio.Lock()
        self.waiters: Waiters[asyncio.Event] = Waiters()
        self.ready = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        #: Why opening failed: the calls that waited for that open fail alike.
        self.failure: StoreError | None = None
        #: Closes this state when its loop shuts down (see _close_with_loop).
        self.guard: AsyncGenerator[None, None] | None = None

    async def aclose(self) -> None:
        """Release this state now, ending its guard (idempotent)."""
        guard, self.guard = self.guard, None
        if guard is not None:
            await guard.aclose()
        await self.release()

    async def release(self) -> None:
        """Stop the listener task, close the pool and its connections (idempotent)."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.waiters.wake_all()
        try:
            await self.pool.close()
        except asyncio.CancelledError:
            # When a loop shuts down, asyncio.run has cancelled every task, the pool's workers
            # included, before it ends async generators (_close_with_loop): close() then fails
            # waiting for those workers, before it closes a single connection.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        finally:
            for conn in list(self.conns):
                await conn.close()


async def _close_with_loop(state: _LoopState) -> AsyncGenerator[None, None]:
    """An async generator whose end closes ``state``.

    Event loops close the async generators started on them when they shut down
    (``asyncio.run`` does), so a pool left open by its user is closed on its own loop, where its
    connections live. Dropped with its loop instead, its connections would stay open on the
    server until collected: one more with every ``asyncio.run``.
    """
    try:
        yield
    finally:
        await state.release()


class AsyncPostgresStore(Configured):
    """A :class:`~twiceshy.stores.AsyncStore` in a PostgreSQL table; see :class:`PostgresStore`.

    Takes the same arguments. Nothing connects in the constructor: each event loop gets its own
    pool and listener task on first use (psycopg's async pool lives in one loop), closed when
    that loop shuts down (``asyncio.run`` does this) or by :meth:`close`. The server is
    first reached, and the table created, on the first call; an unreachable server then raises
    :class:`~twiceshy.StoreUnavailable`.
    """

    def _start(self, *, create: bool) -> None:
        self._create = create
        self._schema_ready = False
        # Not a WeakKeyDictionary: a state holds its loop through its tasks and locks, so its
        # entry would never go. States of closed loops are dropped when a new loop comes.
        self._states: dict[asyncio.AbstractEventLoop, _LoopState] = {}

    async def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        for _ in range(_OPEN_ROUNDS):
            if self._closed:
                raise closed()
            state = self._states.get(loop)
            if state is None:
                for gone in [other for other in self._states if other.is_closed()]:
                    # Closed when its loop shut down (see _close_with_loop).
                    del self._states[gone]
                conns: weakref.WeakSet[_Conn] = weakref.WeakSet()
                state = self._states[loop] = _LoopState(self._new_pool(conns), conns)
                guard = _close_with_loop(state)
                await anext(guard)  # runs to its yield without suspending
                state.guard = guard
            if state.opened:
                return state
            async with state.lock:
                if state.failure is not None:
                    # The open this call waited for failed: its pool is closed. Fail alike
                    # (a fresh error: one exception object is not raised in many tasks).
                    failure = state.failure
                    raise type(failure)(str(failure)) from failure
                if self._states.get(loop) is not state:
                    continue  # replaced meanwhile: start afresh
                if not state.opened:
                    try:
                        await self._open(state)
                    except Exception as exc:
                        mapped = exc if isinstance(exc, StoreError) else store_error(exc)
                        state.failure = mapped
                        # The next call in this loop starts afresh.
                        if self._states.get(loop) is state:
                            del self._states[loop]
                        await state.aclose()
                        if mapped is exc:
                            raise
                        raise mapped from exc
                    state.opened = True
            return state
        raise StoreError("PostgreSQL ledger could not open its pool")

    async def _open(self, state: _LoopState) -> None:
        """Check the table (once per store) and open this loop's pool."""
        if not self._schema_ready:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._settings.conninfo, **self._settings.kwargs
                )
            except psycopg.Error as exc:
                raise unreachable(self._settings.where, exc) from exc
            async with conn:
                # A lost probe connection is not retried: the error goes up.
                server = await _drive(
                    _ops.inspect_op(self._st, conn.info.backend_pid),
                    lambda step: _fetch(conn, step),
                )
                self._judge(server)
                await _drive(
                    _ops.schema_op(
                        self._st,
                        self._settings.where,
                        create=self._create,
                        configure=not self._pooled,
                    ),
                    lambda step: _fetch(conn, step),
                    SCHEMA_STEPS,
                )
            self._schema_ready = True
        # On a timeout psycopg closes the pool.
        await state.pool.open(wait=True, timeout=self._settings.connect_timeout)

    def _new_pool(self, conns: weakref.WeakSet[_Conn]) -> _Pool:
        configure = self._st.configure

        async def setup(conn: _Conn) -> None:
            conns.add(conn)
            if self._pooled:  # read when the connection is made: after the first look
                conn.prepare_threshold = None  # see PostgresStore._new_pool
            else:
                await conn.execute(configure)

        s = self._settings
        pool: _Pool = AsyncConnectionPool(s.conninfo, configure=setup, **s.pool_options())
        return pool

    async def _execute(self, pool: _Pool, step: Step) -> _Answer:
        # As in the blocking store: getconn/putconn, autocommit, so no commit-on-exit.
        try:
            conn = await pool.getconn(timeout=self._settings.pool_timeout)
        except PoolTimeout as exc:
            s = self._settings
            raise pool_exhausted(s.where, s.max_size, s.pool_timeout) from exc
        except PoolClosed as exc:
            raise store_error(exc) from exc
        try:
            answer = await _fetch(conn, step)
        finally:
            await pool.putconn(conn)
        if isinstance(answer, psycopg.OperationalError):
            try:
                await pool.check()
            except Exception:
                log.debug("twiceshy: PostgreSQL pool check failed", exc_info=True)
        return answer

    async def _run(self, op: Generator[Step, Rows, _T]) -> _T:
        try:
            state = await self._state()
        except BaseException:
            op.close()
            raise
        pool = state.pool
        return await _drive(op, lambda step: self._execute(pool, step))

    # -- the AsyncStore protocol ------------------------------------------------------------

    async def claim(self, namespace: str, key: str, **args: Unpack[ClaimArgs]) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`. One round trip, a replay included."""
        # The keyword arguments as a typed dict, not spelled out again (PostgresStore does).
        return await self._run(_ops.claim_op(self._st, self._now, namespace, key, **args))

    async def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`. One round trip."""
        snap = await self._run(_ops.write_op(self._st, self._now, namespace, key, change))
        if snap.won:
            state = self._states.get(asyncio.get_running_loop())
            if state is not None:
                state.waiters.wake(_ops.payload_of(namespace, key))
        return snap

    async def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        return await self._run(_ops.get_op(self._st, self._now, namespace, key))

    async def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`PostgresStore.wait`."""
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout <= 0:
            return await self.get(namespace, key)
        state = await self._state()
        payload = _ops.payload_of(namespace, key)
        event = asyncio.Event()
        state.waiters.add(payload, event)

        async def execute(command: Step | Pause) -> _Answer:
            if isinstance(command, Pause):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(command.seconds):
                        await event.wait()
                return []
            event.clear()
            return await self._execute(state.pool, command)

        try:
            if self._listens and (state.task is None or state.task.done()):
                state.task = asyncio.get_running_loop().create_task(
                    listen(
                        self._settings,
                        self._st.listen,
                        state.waiters,
                        state.ready,
                        lambda: self._closed,
                    )
                )
            recheck, listening = self._settings.recheck, state.ready.is_set
            waiting = _ops.wait_op(
                self._st,
                self._now,
                namespace,
                key,
                fence,
                deadline,
                recheck,
                listening,
                mark=self._listens,
            )
            return await _drive(waiting, execute, WAIT_STEPS)
        finally:
            state.waiters.discard(payload, event)

    async def records(self, namespace: str, **filters: Unpack[RecordsFilter]) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        return await self._run(_ops.records_op(self._st, self._now, namespace, **filters))

    async def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        return await self._run(_ops.purge_op(self._st, self._now, namespace))

    async def expired(self, namespace: str | None = None) -> list[Record]:
        """See :meth:`twiceshy.stores.ExpiredOutcomes.expired`."""
        return await self._run(_ops.expired_op(self._st, self._now, namespace))

    async def close(self) -> None:
        """Close this loop's pool and listener (idempotent).

        Pools of event loops that have since closed were closed with them; those of loops still
        running in other threads are closed there.
        """
        self._closed = True
        current = asyncio.get_running_loop()
        states = list(self._states.items())
        self._states.clear()
        for loop, state in states:
            if loop is current:
                await state.aclose()
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(state.aclose(), loop)
