"""The SQLite store: its settings, and each operation of the Store protocol written once.

An operation borrows a connection to the file at the path (:mod:`._files`), runs the statements
of :mod:`._sql` in it, and decides what their rows mean. :mod:`sqlite3` blocks, so there is one
side only; the async store is :class:`~twiceshy.stores.ThreadedAsyncStore` over this one.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

from ..._records import (
    CLOCK_TOLERANCE,
    Change,
    Effect,
    Record,
    Snapshot,
    State,
    is_live,
    make_snapshot,
    new_claim,
)
from ...errors import StoreError
from .._skew import ClockSkew
from . import _sql
from ._files import LedgerFile
from ._setup import (
    DURABLE,
    JOURNAL_MODES,
    POLL_CAP,
    POLL_FIRST,
    SYNCHRONOUS,
    Setup,
    default_journal_mode,
)

_MIN_VERSION: Final = (3, 35, 0)  # INSERT ... ON CONFLICT DO UPDATE ... RETURNING
# SQLite holds the busy timeout as a 32-bit int of milliseconds.
_MAX_BUSY_TIMEOUT: Final = 2_147_483

log = logging.getLogger("twiceshy")


class SQLiteStore:
    """A :class:`~twiceshy.stores.Store` in one SQLite file.

    Args:
        path: the database file. Its directory must exist (a mistyped path must not become a
            second ledger), except the default ledger's (``$XDG_STATE_HOME/twiceshy``, else
            ``~/.local/state/twiceshy``), which is made ``0700``. New files are ``0600``.
        clock: the store's clock, seconds since the epoch (the wall clock by default).
        synchronous: ``PRAGMA synchronous``: ``"EXTRA"``, ``"FULL"``, ``"NORMAL"``, ``"OFF"``.
            ``None`` (the default) chooses the weakest that survives a power cut: FULL in WAL,
            EXTRA in the rollback journal. A weaker one set here is used, with a logged
            warning that a power cut may lose claims.
        journal_mode: ``None`` chooses WAL, or the rollback journal on SQLite versions with the
            WAL-reset bug; ``"wal"``, ``"delete"``, ``"truncate"``, ``"persist"`` force a mode.
        busy_timeout: how long to wait for another writer before failing with
            :class:`~twiceshy.StoreUnavailable`, at most 2,147,483 seconds.
        create: make the file and its tables where there are none; ``False`` to open only a
            ledger that exists, writing nothing (not even the directory) where there is none.

    Attributes:
        path: the database file, as given.

    Raises:
        LedgerDirectoryNotFound: the file's directory does not exist; nothing was created.
        StoreUnavailable: the file cannot be opened, created or written.
        LedgerNotFound: with ``create=False``, the path holds no twiceshy ledger.
        StoreError: the file is not a twiceshy ledger this version can use.
        ValueError: a setting is not one of those above.
        TypeError: ``busy_timeout`` is neither a number nor a timedelta.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        synchronous: str | None = None,
        journal_mode: str | None = None,
        busy_timeout: float | timedelta = 30.0,
        create: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        if self.path in ("", ":memory:") or self.path.startswith("file:"):
            raise ValueError(
                f"SQLite ledger needs a file path, not {self.path!r} (use memory:// for a "
                "ledger inside one process)"
            )
        # None: chosen for the journal mode in effect, connection by connection (Setup).
        asked: str | None = None
        if synchronous is not None:
            if not isinstance(synchronous, str) or synchronous.upper() not in SYNCHRONOUS:
                raise ValueError(
                    f"synchronous must be one of {', '.join(SYNCHRONOUS)}, not {synchronous!r}"
                )
            asked = synchronous.upper()
        if journal_mode is None:
            wanted = default_journal_mode()
        else:
            wanted = journal_mode.lower()
            if wanted not in JOURNAL_MODES:
                raise ValueError(
                    f"journal_mode must be one of {sorted(JOURNAL_MODES)}, not {journal_mode!r}"
                )
        seconds = _busy_timeout(busy_timeout)
        if sqlite3.sqlite_version_info < _MIN_VERSION:
            raise StoreError(
                f"SQLite ledger needs SQLite >= {'.'.join(map(str, _MIN_VERSION))}, "
                f"this Python has {sqlite3.sqlite_version}"
            )
        self._clock = clock
        self._changed = threading.Condition()  # notified by this process's own writes
        self._version = 0
        # Opened by this name whatever the working directory later is.
        where = os.path.abspath(self.path)
        self._skew = ClockSkew(f"SQLite ledger {where!r}")
        self._setup = Setup(
            self.path,
            where,
            create=create,
            busy_timeout=seconds,
            journal_mode=wanted,
            synchronous=asked,
        )
        self._files = LedgerFile(self._setup, on_fork=self._after_fork)
        self._files.check_directory()
        self._files.open()
        durable = DURABLE.get(self.journal_mode, "EXTRA")
        if SYNCHRONOUS.index(self.synchronous) < SYNCHRONOUS.index(durable):
            log.warning(
                "twiceshy: SQLite ledger %r runs with synchronous=%s in journal mode %r: a "
                "power cut may lose claims already acknowledged (and an UNSAFE tool may then "
                "run twice); set %s or stronger, or leave synchronous unset",
                where,
                self.synchronous,
                self.journal_mode,
                durable,
            )

    @property
    def journal_mode(self) -> str:
        """The journal mode in effect (``"wal"`` or ``"delete"``, ...)."""
        return self._setup.journal_mode

    @property
    def synchronous(self) -> str:
        """The ``synchronous`` setting of every connection (``"EXTRA"``, ...)."""
        return self._setup.synchronous

    @classmethod
    def from_url(
        cls, url: str, *, clock: Callable[[], float] = time.time, create: bool = True
    ) -> SQLiteStore:
        """Open the store a ``sqlite://`` URL names.

        ``sqlite:///relative/ledger.db`` is relative to the working directory and
        ``sqlite:////abs/ledger.db`` absolute (the path is what follows the third slash, as in
        SQLAlchemy). Query parameters: ``synchronous=``, ``journal_mode=``, ``busy_timeout=``
        (seconds), e.g. ``sqlite:///ledger.db?journal_mode=wal&busy_timeout=5``.

        Args:
            url: the ledger URL.
            clock: the store's clock.
            create: see :class:`SQLiteStore`.

        Raises:
            ValueError: the URL is not a ``sqlite:///path`` URL, or has unknown parameters.
            LedgerDirectoryNotFound: the file's directory does not exist (``sqlite:///var/x.db``
                written for ``sqlite:////var/x.db``, say); nothing was created.
            StoreUnavailable: the file cannot be opened or created.
            LedgerNotFound: with ``create=False``, the path holds no twiceshy ledger.
        """
        parts = urlsplit(url)
        if parts.scheme.lower() != "sqlite":
            raise ValueError(f"not a sqlite:// URL: {url!r}")
        if parts.netloc:
            raise ValueError(
                f"SQLite ledger URL names a host {parts.netloc!r}: write sqlite:///relative/path "
                "or sqlite:////absolute/path"
            )
        path = unquote(parts.path[1:]) if parts.path.startswith("/") else ""
        if not path:
            raise ValueError(f"SQLite ledger URL names no file: {url!r}")
        params: dict[str, str] = {}
        for name, values in parse_qs(parts.query, keep_blank_values=True).items():
            if len(values) != 1:
                raise ValueError(f"SQLite ledger URL repeats {name!r}: {url!r}")
            params[name] = values[0]
        return cls(path, clock=clock, create=create, **_url_settings(params, url))

    def __repr__(self) -> str:
        return (
            f"SQLiteStore({self.path!r}, journal_mode={self.journal_mode!r}, "
            f"synchronous={self.synchronous!r})"
        )

    def _after_fork(self) -> None:
        # A parent's thread may have held the condition's lock at the fork, and that thread is
        # not in the child.
        self._changed = threading.Condition()

    def _notify(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

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
        """See :meth:`twiceshy.stores.Store.claim`."""
        files = self._files
        with files.lend() as conn:
            now = self._clock()
            existing = _read(conn, namespace, key)
        # Fast path: the claim statement never changes a live record, so a live record is
        # answered from a plain read, without taking the writer's lock.
        if existing is not None and is_live(existing, now, CLOCK_TOLERANCE):
            self._skew.saw(existing, now)
            won = existing.state is State.CLAIMED and existing.owner == owner
            return make_snapshot(existing, now, won)

        with files.lend(write=True) as conn:
            # Read the clock once the lock is held: waiting for it must not shorten the lease.
            now = self._clock()
            fresh = new_claim(
                namespace,
                key,
                fingerprint=fingerprint,
                tool=tool,
                effect=effect,
                owner=owner,
                lease=lease,
                now=now,
                args=args,
            )
            rows = conn.execute(_sql.CLAIM, _sql.claim_params(fresh, now)).fetchall()
            inserted = bool(rows)
            record = _sql.to_record(rows[0]) if rows else _read(conn, namespace, key)
        if inserted:
            self._notify()
        # Cannot happen: the row was just written, or judged live by the statement.
        if record is None or not is_live(record, now, CLOCK_TOLERANCE):
            raise StoreError(f"SQLite ledger lost the claim of {namespace!r}/{key!r}")
        self._skew.saw(record, now)
        won = inserted or (record.state is State.CLAIMED and record.owner == owner)
        return make_snapshot(record, now, won)

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`."""
        with self._files.lend(write=True) as conn:
            now = self._clock()
            params = _sql.write_params(namespace, key, change, now)
            rows = conn.execute(_sql.WRITE, params).fetchall()
            won = bool(rows)
            record = _sql.to_record(rows[0]) if rows else _read(conn, namespace, key)
        if won:
            self._notify()
            assert record is not None
            if record.expires_at is not None and change.ttl is not None:
                self._skew.moved(record, record.expires_at - now - change.ttl)
        elif record is not None and not is_live(record, now, CLOCK_TOLERANCE):
            record = None  # a record past its retention is no record; one just written is
        if record is not None:
            self._skew.saw(record, now)
        return make_snapshot(record, now, won)

    def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        with self._files.lend() as conn:
            now = self._clock()
            record = _read(conn, namespace, key)
        if record is not None:
            if not is_live(record, now, CLOCK_TOLERANCE):
                record = None
            else:
                self._skew.saw(record, now)
        return make_snapshot(record, now, False)

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`.

        Wakes at once on this store's own writes; polls with backoff (1 ms doubling to 25 ms)
        for writes by other processes.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        delay = POLL_FIRST
        while True:
            self._files.pool()  # a forked child gets its own condition before using it
            changed = self._changed
            with changed:
                seen = self._version
            snap = self.get(namespace, key)
            record = snap.record
            if record is None or record.state is not State.CLAIMED or record.fence != fence:
                return snap
            left = deadline - time.monotonic()
            if left <= 0:
                return snap
            with changed:
                # Our own write may have landed since the read: then look again at once.
                if self._version == seen:
                    changed.wait(min(delay, left))
            delay = min(delay * 2, POLL_CAP)

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        with self._files.lend() as conn:
            now = self._clock()
            params = _sql.records_params(namespace, now, states, tool, limit)
            rows = conn.execute(_sql.RECORDS, params).fetchall()
        return [_sql.to_record(row) for row in rows]

    def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        with self._files.lend() as conn:
            now = self._clock()
            # One statement in autocommit mode is its own transaction.
            count: int = conn.execute(_sql.PURGE, _sql.expired_params(namespace, now)).rowcount
        return count

    def expired(self, namespace: str | None = None) -> list[Record]:
        """See :meth:`twiceshy.stores.ExpiredOutcomes.expired`."""
        with self._files.lend() as conn:
            now = self._clock()
            rows = conn.execute(_sql.EXPIRED, _sql.expired_params(namespace, now)).fetchall()
        return [_sql.to_record(row) for row in rows]

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """See :meth:`twiceshy.stores.CallCounts.add_counts`: one write transaction."""
        rows = [(namespace, tool, outcome, n) for (tool, outcome), n in counts.items()]
        if rows:
            with self._files.lend(write=True) as conn:
                conn.executemany(_sql.ADD_COUNT, rows)

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """See :meth:`twiceshy.stores.CallCounts.counts`."""
        with self._files.lend() as conn:
            rows = conn.execute(_sql.COUNTS, (namespace,)).fetchall()
        return {(tool, outcome): int(n) for tool, outcome, n in rows}

    def close(self) -> None:
        """Close the idle connections; connections in use close when given back."""
        self._files.close()


def _read(conn: sqlite3.Connection, namespace: str, key: str) -> Record | None:
    row = conn.execute(_sql.SELECT_RECORD, {"namespace": namespace, "key": key}).fetchone()
    return _sql.to_record(row) if row is not None else None


def _busy_timeout(value: object) -> float:
    """The busy timeout in seconds; a clear error naming the option for anything else."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = float("inf")
    else:
        raise TypeError(f"busy_timeout must be seconds or a timedelta, not {value!r}")
    if not 0 <= seconds <= _MAX_BUSY_TIMEOUT:  # NaN fails both
        raise ValueError(
            f"busy_timeout must be from 0 to {_MAX_BUSY_TIMEOUT} seconds (about 24 days, the "
            f"most SQLite can wait), not {value!r}"
        )
    return seconds


def _url_settings(params: Mapping[str, str], url: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for name, value in params.items():
        if name in ("synchronous", "journal_mode"):
            settings[name] = value
        elif name == "busy_timeout":
            try:
                settings[name] = float(value)
            except ValueError:
                raise ValueError(f"busy_timeout must be seconds, not {value!r}") from None
        else:
            raise ValueError(
                f"unknown SQLite ledger URL parameter {name!r} in {url!r} (known: "
                "synchronous, journal_mode, busy_timeout)"
            )
    return settings
