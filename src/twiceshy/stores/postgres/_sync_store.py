"""The blocking PostgreSQL store: a connection pool, a listener thread, and a loop of I/O.

:class:`PostgresStore` carries the operations of ``_ops.py`` to the server: each statement on a
connection from its pool, each pause of a wait on the record's notification (``_listener.py``).
What the statements are and what their rows mean is decided there, not here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import TypeVar

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ..._records import Change, Effect, Record, Snapshot, State
from . import _ops
from ._errors import closed, pool_exhausted, store_error, unreachable
from ._listener import Listener
from ._ops import MAX_STEPS, SCHEMA_STEPS, WAIT_STEPS, Drive, Pause, Rows, Step
from ._settings import Configured

log = logging.getLogger("twiceshy")

_T = TypeVar("_T")
_C = TypeVar("_C")

_Pool = ConnectionPool[psycopg.Connection[TupleRow]]
_Answer = Rows | psycopg.OperationalError


def _drive(
    op: Generator[_C, Rows, _T], execute: Callable[[_C], _Answer], limit: int = MAX_STEPS
) -> _T:
    """Carry out an operation's commands one by one; its answer."""
    drive = Drive(op, limit)
    try:
        while drive.pending:
            drive.send(execute(drive.command))
    finally:
        op.close()
    return drive.result


def _fetch(conn: psycopg.Connection[TupleRow], step: Step) -> _Answer:
    """Run one statement: its rows, or the error that lost the connection."""
    try:
        cur = conn.execute(step.query, step.params)
        return cur.fetchall() if step.rows else []
    except psycopg.OperationalError as exc:
        return exc
    except (psycopg.Error, UnicodeError) as exc:
        raise store_error(exc) from exc


class PostgresStore(Configured):
    """A :class:`~twiceshy.stores.Store` in a PostgreSQL table, blocking.

    Args:
        url: a libpq connection string or ``postgresql://`` URL (psycopg's parameters only;
            :func:`open_postgres` reads twiceshy's own URL parameters).
        schema: the schema holding the table; created on first use.
        table: the records table; ``<table>_meta`` holds its schema version.
        clock: the store's clock for tests; ``None`` uses the server's clock.
        min_size: connections the pool keeps open.
        pool_size: the most connections the pool opens (10 by default); a statement finding
            them all busy waits for one to be free.
        pool_timeout: how long a statement waits for a free connection (10 s by default)
            before the call raises :class:`~twiceshy.StoreUnavailable`, nothing sent.
        connect_timeout: seconds to wait for a connection (libpq rounds the connect itself up to
            whole seconds, at least 2; a ``connect_timeout`` in ``url`` sets libpq's instead).
        application_name: the ``application_name`` of every connection of this store, unless
            ``url`` names its own.
        wait_recheck: how often a waiter reads the record again even without a notification.
        wakeups: how waiters learn that a record settled: ``"auto"`` (``LISTEN``, refused
            behind a connection pooler), ``"poll"`` (no ``LISTEN`` connection: waiters re-read
            with backoff, as behind PgBouncer in transaction mode) or ``"listen"`` (``LISTEN``
            even behind a pooler, for one in session mode).
        create: create the schema and tables where there are none; ``False`` to open only a
            ledger that exists (a version 1 ledger is still migrated, as on every open).

    Raises:
        StoreUnavailable: the server cannot be reached.
        LedgerNotFound: with ``create=False``, the schema holds no such ledger.
        StoreError: the table is not a twiceshy ledger this version can use; or a pooler
            answers and ``wakeups`` does not say how waiters are woken (see
            "Connection poolers" in docs/stores/postgres.md).
        ValueError: a setting is out of range.
    """

    def _start(self, *, create: bool) -> None:
        self._lock = threading.Lock()
        self._abandoned: list[object] = []
        # Fail fast: a ledger that cannot be reached must not let a tool run unprotected.
        try:
            probe = psycopg.connect(self._settings.conninfo, **self._settings.kwargs)
        except psycopg.Error as exc:
            raise unreachable(self._settings.where, exc) from exc
        with probe:
            # A lost probe connection is not retried: the error goes up.
            server = _drive(
                _ops.inspect_op(self._st, probe.info.backend_pid), lambda step: _fetch(probe, step)
            )
            self._judge(server)
            _drive(
                _ops.schema_op(
                    self._st, self._settings.where, create=create, configure=not self._pooled
                ),
                lambda step: _fetch(probe, step),
                SCHEMA_STEPS,
            )
        self._pid = os.getpid()
        self._pool = self._new_pool()
        self._listener = Listener(self._settings, self._st.listen, listening=self._listens)

    def _new_pool(self) -> _Pool:
        configure = self._st.configure
        pooled = self._pooled

        def setup(conn: psycopg.Connection[TupleRow]) -> None:
            if pooled:
                # Behind a pooler the next statement may meet another server connection,
                # which has none of this one's prepared statements.
                conn.prepare_threshold = None
            else:
                conn.execute(configure)

        s = self._settings
        pool: _Pool = ConnectionPool(s.conninfo, configure=setup, **s.pool_options())
        # Waiting here means the pool's workers are idle when the store is handed out: they
        # draw from the global random module, which tests (hypothesis) watch.
        try:
            pool.open(wait=True, timeout=s.connect_timeout)
        except PoolTimeout as exc:
            raise store_error(exc) from exc
        return pool

    def _live(self) -> tuple[_Pool, Listener]:
        if self._closed:
            raise closed()
        if os.getpid() != self._pid:
            with self._lock:
                if os.getpid() != self._pid:
                    # A forked child never uses (nor closes) its parent's connections; they
                    # are kept referenced so that collecting them does nothing either.
                    self._abandoned += [self._pool, self._listener]
                    self._pool = self._new_pool()
                    self._listener = Listener(
                        self._settings, self._st.listen, listening=self._listens
                    )
                    self._pid = os.getpid()
        return self._pool, self._listener

    def _execute(self, step: Step) -> _Answer:
        """Run one statement on a connection of the pool (after :meth:`_live`)."""
        pool = self._pool
        # getconn/putconn rather than pool.connection(): every statement runs in autocommit,
        # so the connection's own commit-on-exit has nothing to do, and costs ~10 us.
        # putconn() discards a connection left broken or inside a transaction.
        try:
            conn = pool.getconn(timeout=self._settings.pool_timeout)
        except PoolTimeout as exc:
            s = self._settings
            raise pool_exhausted(s.where, s.max_size, s.pool_timeout) from exc
        except PoolClosed as exc:
            raise store_error(exc) from exc
        try:
            answer = _fetch(conn, step)
        finally:
            pool.putconn(conn)
        if isinstance(answer, psycopg.OperationalError):
            # Replace the pool's broken connections before the operation's one retry.
            try:
                pool.check()
            except Exception:
                log.debug("twiceshy: PostgreSQL pool check failed", exc_info=True)
        return answer

    def _run(self, op: Generator[Step, Rows, _T]) -> _T:
        self._live()
        return _drive(op, self._execute)

    # -- the Store protocol -----------------------------------------------------------------

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
        """See :meth:`twiceshy.stores.Store.claim`. One round trip, a replay included."""
        # Spelled out, not ``**args: Unpack[ClaimArgs]`` as in the async store: on this hot
        # path, binding keywords saves packing and unpacking them (about 0.4 us a claim).
        return self._run(
            _ops.claim_op(
                self._st,
                self._now,
                namespace,
                key,
                fingerprint=fingerprint,
                tool=tool,
                effect=effect,
                owner=owner,
                lease=lease,
                args=args,
            )
        )

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`. One round trip."""
        snap = self._run(_ops.write_op(self._st, self._now, namespace, key, change))
        if snap.won:
            # Our own waiters need not wait for the server to echo the notification.
            self._listener.dispatch(_ops.payload_of(namespace, key))
        return snap

    def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        return self._run(_ops.get_op(self._st, self._now, namespace, key))

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`.

        Wakes on the ``NOTIFY`` of the write that settles the record; reads it again every
        ``wait_recheck`` seconds regardless, and polls while no listener is connected (always,
        with ``wakeups="poll"``; a write of this process wakes its waiters at once).
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout <= 0:
            return self.get(namespace, key)
        _, listener = self._live()
        payload = _ops.payload_of(namespace, key)
        # Registered before reading: once the listener is LISTEN-ing (it wakes every waiter
        # when it is), a write committed after a read is announced to this waiter.
        event = listener.watch(payload)

        def execute(command: Step | Pause) -> _Answer:
            if isinstance(command, Pause):
                event.wait(command.seconds)
                return []
            event.clear()
            return self._execute(command)

        recheck, listening = self._settings.recheck, listener.ready.is_set
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
        try:
            return _drive(waiting, execute, WAIT_STEPS)
        finally:
            listener.unwatch(payload, event)

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        op = _ops.records_op(self._st, self._now, namespace, states=states, tool=tool, limit=limit)
        return self._run(op)

    def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        return self._run(_ops.purge_op(self._st, self._now, namespace))

    def expired(self, namespace: str | None = None) -> list[Record]:
        """See :meth:`twiceshy.stores.ExpiredOutcomes.expired`."""
        return self._run(_ops.expired_op(self._st, self._now, namespace))

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """See :meth:`twiceshy.stores.CallCounts.add_counts`: one statement."""
        self._run(_ops.add_counts_op(self._st, namespace, counts))

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """See :meth:`twiceshy.stores.CallCounts.counts`."""
        return self._run(_ops.counts_op(self._st, namespace))

    def close(self) -> None:
        """Close the pool and the listener (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return  # the connections are the parent's
        self._listener.close()
        self._pool.close()
