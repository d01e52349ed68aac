"""``sqlite:///path/ledger.db``: the embedded ledger, one file shared by processes and threads.

Only the standard library's :mod:`sqlite3` is used. Every claim and every guarded write is one
``BEGIN IMMEDIATE`` transaction holding one conditional statement, so two callers can never both
win: SQLite admits one writer at a time, and the statement itself checks the guard.

Journal mode and durability:
    A claim is acknowledged only once it would survive a power cut. In WAL that takes
    ``synchronous=FULL`` (the log is synced at every commit). In the rollback journal a commit
    is the journal's unlink, which FULL leaves unsynced, so a power cut can bring the journal
    back and undo an acknowledged claim: there the store runs ``synchronous=EXTRA``, which
    syncs the directory after the unlink. Those are the defaults, chosen for the mode in
    effect; a ``synchronous`` set explicitly wins, and one below them is accepted with a
    logged warning.

    The default mode is WAL. SQLite releases before 3.44.6, 3.45.0 to 3.50.6, and 3.51.0 to
    3.51.2 carry the WAL-reset bug: a WAL reset racing a concurrent writer may lose committed
    transactions, which for a ledger means a lost claim and a double run. On those versions
    the store falls back to the rollback journal (``DELETE``, with EXTRA): slower, always
    correct, and the core stays on the standard library. The alternative, a package bundling
    a fixed SQLite (apsw; pysqlite3-binary and sqlean.py bundle buggy releases), was measured
    (``benchmarks/sqlite_durability.py``) and not taken, so the core needs no third-party
    package. ``journal_mode="wal"`` forces WAL anyway; :attr:`SQLiteStore.journal_mode`
    tells which mode is in effect.

Clock:
    SQLite has no server clock. Lease deadlines and expiry use the store's ``clock``, by default
    the machine's wall clock, which every process on one machine shares. Processes on several
    machines sharing one file over a network file system are not supported (SQLite's locking is
    not reliable there, and their clocks differ).

Waiting:
    Within one process a waiter wakes on a condition that this store's own writes notify;
    writes by other processes (or other store objects) are seen by polling with backoff, from
    1 ms doubling to 25 ms. Every wait is bounded by its timeout.

Connections:
    A small pool of idle connections (autocommit, explicit transactions), taken for one
    operation and given back. After :func:`os.fork` the child never touches its parent's
    connections: it notices the new process id and starts an empty pool. The path is made
    absolute when the store is opened, so a process that changes its working directory (a
    daemon's ``chdir("/")``) keeps using the same file.

A file replaced or deleted under the store:
    SQLite's locks belong to the file a connection opened. If the ledger file is deleted or
    replaced (by a restore, or ``rm``) while processes hold it open, they would go on claiming
    in the old, unlinked file while new processes claim in the new one, and one intent could
    run once in each. Before every operation the store compares the path's file with the one
    its connections opened; when they differ it logs a warning, drops its connections to the
    old file, and opens the file now at the path (creating a ledger there if there is none),
    as every new process does. Every new connection also looks for the ledger's tables in the
    file it opened and makes them where they are missing: a file system may give a new file
    the number of a deleted one, so the comparison alone cannot see every new file. A call
    whose file is deleted while it runs fails with :class:`~twiceshy.StoreUnavailable` saying
    so; the next call follows the new file.

Files:
    A ledger file the store creates is private to its user (``0600``), as are the directories
    it creates (``0700``): results may carry personal data. SQLite gives journals the mode of
    their database. Files and directories that exist keep their modes.

Opening without creating:
    With ``create=False`` no connection creates the file (they open it with ``mode=rw``), and
    before anything is written, the journal mode included, the file is read to find
    twiceshy's tables: a missing file, a file of another application, or one that is no
    database raises :class:`~twiceshy.LedgerNotFound`, as does a write once the file is
    deleted or replaced by one that is no ledger. A ledger that is there opens as it always
    does (a missing call counts table is added).
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

from .._records import (
    FINAL_STATES,
    Change,
    Effect,
    Record,
    Snapshot,
    State,
    is_live,
    new_claim,
)
from ..errors import LedgerNotFound, StoreError, StoreUnavailable

__all__ = ["SQLiteStore"]

SCHEMA_VERSION: Final = 1

# --------------------------------------------------------------------------------------------
# SQL. Every statement the store runs is here; values are always bound, never formatted in.
# Only enum values and the fixed column list are spliced in, at import time.
# --------------------------------------------------------------------------------------------

_COLUMNS: Final = (
    "namespace, key, fingerprint, tool, effect, state, fence, owner, lease_deadline, attempts, "
    "result, error, reason, created_at, updated_at, expires_at"
)

_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS twiceshy_meta (
        name  TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID
    """,
    f"""
    INSERT INTO twiceshy_meta (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}')
    ON CONFLICT (name) DO NOTHING
    """,
    """
    CREATE TABLE IF NOT EXISTS twiceshy_records (
        namespace      TEXT    NOT NULL,
        key            TEXT    NOT NULL,
        fingerprint    TEXT    NOT NULL,
        tool           TEXT    NOT NULL,
        effect         TEXT    NOT NULL,
        state          TEXT    NOT NULL,
        fence          INTEGER NOT NULL,
        owner          TEXT    NOT NULL,
        lease_deadline REAL,
        attempts       INTEGER NOT NULL,
        result         TEXT,
        error          TEXT,
        reason         TEXT,
        created_at     REAL    NOT NULL,
        updated_at     REAL    NOT NULL,
        expires_at     REAL,
        PRIMARY KEY (namespace, key)
    ) WITHOUT ROWID
    """,
    # records(): one namespace, newest first.
    """
    CREATE INDEX IF NOT EXISTS twiceshy_records_by_created
    ON twiceshy_records (namespace, created_at)
    """,
    # purge_expired(): only rows that can expire at all.
    """
    CREATE INDEX IF NOT EXISTS twiceshy_records_by_expiry
    ON twiceshy_records (expires_at) WHERE expires_at IS NOT NULL
    """,
    # Call counts by tool and outcome, summed over every process (added after version 1's
    # first release: IF NOT EXISTS brings older files up to date).
    """
    CREATE TABLE IF NOT EXISTS twiceshy_counts (
        namespace TEXT    NOT NULL,
        tool      TEXT    NOT NULL,
        outcome   TEXT    NOT NULL,
        count     INTEGER NOT NULL,
        PRIMARY KEY (namespace, tool, outcome)
    ) WITHOUT ROWID
    """,
)

_SELECT_SCHEMA_VERSION: Final = "SELECT value FROM twiceshy_meta WHERE name = 'schema_version'"

# Which of the ledger's tables a file holds: a plain read of the schema, before anything is
# written (the journal mode included).
_LEDGER_TABLES: Final = """
    SELECT name FROM sqlite_master
    WHERE type = 'table' AND name IN ('twiceshy_meta', 'twiceshy_records', 'twiceshy_counts')
"""
# Without these two a file is no ledger; the call counts table is added where it is missing.
_CORE_TABLES: Final = frozenset({"twiceshy_meta", "twiceshy_records"})
_ALL_TABLES: Final = _CORE_TABLES | {"twiceshy_counts"}

# A real (if idempotent) write: it makes a read-only file fail at construction, not at a claim.
_TOUCH_SCHEMA_VERSION: Final = (
    "UPDATE twiceshy_meta SET value = value WHERE name = 'schema_version'"
)

_SELECT_RECORD: Final = f"""
    SELECT {_COLUMNS} FROM twiceshy_records WHERE namespace = :namespace AND key = :key
"""

# Insert a fresh claim, or replace a record past its retention with fence + 1, answering the
# record written. A live record (any state) is left alone and nothing is answered; the caller
# then reads it in the same transaction.
_CLAIM: Final = f"""
    INSERT INTO twiceshy_records ({_COLUMNS})
    VALUES (:namespace, :key, :fingerprint, :tool, :effect, :state, :fence, :owner,
            :lease_deadline, :attempts, NULL, NULL, NULL, :now, :now, NULL)
    ON CONFLICT (namespace, key) DO UPDATE SET
        fingerprint    = excluded.fingerprint,
        tool           = excluded.tool,
        effect         = excluded.effect,
        state          = excluded.state,
        fence          = twiceshy_records.fence + 1,
        owner          = excluded.owner,
        lease_deadline = excluded.lease_deadline,
        attempts       = excluded.attempts,
        result         = NULL,
        error          = NULL,
        reason         = NULL,
        created_at     = excluded.created_at,
        updated_at     = excluded.updated_at,
        expires_at     = NULL
    WHERE twiceshy_records.expires_at IS NOT NULL
      AND twiceshy_records.expires_at <= excluded.created_at
    RETURNING {_COLUMNS}
"""

# The five ``:sN`` slots hold the allowed states, padded with NULL (``x IN (NULL)`` is never
# true), so one constant statement serves every ``from_states``.
_STATE_SLOTS: Final = tuple(f"s{i}" for i in range(len(State)))
_STATES_IN: Final = "state IN (" + ", ".join(f":{slot}" for slot in _STATE_SLOTS) + ")"

# One guarded compare-and-set; it sets exactly what ``apply_change`` sets, and answers the record
# written (nothing when a guard fails). Values that depend only on the change and the clock are
# computed in Python and bound.
_WRITE: Final = f"""
    UPDATE twiceshy_records SET
        state          = :to,
        fence          = fence + :bump,
        owner          = COALESCE(:new_owner, owner),
        lease_deadline = CASE WHEN :keep_deadline THEN lease_deadline ELSE :lease_deadline END,
        attempts       = attempts + :add_attempts,
        result         = :result,
        error          = :error,
        reason         = :reason,
        updated_at     = :now,
        expires_at     = :expires_at
    WHERE namespace = :namespace
      AND key = :key
      AND fence = :fence
      AND {_STATES_IN}
      AND (:owner IS NULL OR owner = :owner)
      AND (NOT :lapsed OR (lease_deadline IS NOT NULL AND lease_deadline <= :now))
      AND (expires_at IS NULL OR expires_at > :now)
    RETURNING {_COLUMNS}
"""

_RECORDS: Final = f"""
    SELECT {_COLUMNS} FROM twiceshy_records
    WHERE namespace = :namespace
      AND (expires_at IS NULL OR expires_at > :now)
      AND (:all_states OR {_STATES_IN})
      AND (:tool IS NULL OR tool = :tool)
    ORDER BY created_at DESC
    LIMIT :limit
"""

_ADD_COUNT: Final = """
    INSERT INTO twiceshy_counts (namespace, tool, outcome, count) VALUES (?, ?, ?, ?)
    ON CONFLICT (namespace, tool, outcome) DO UPDATE SET count = count + excluded.count
"""

_COUNTS: Final = "SELECT tool, outcome, count FROM twiceshy_counts WHERE namespace = ?"

_FINAL_VALUES: Final = ", ".join(f"'{s.value}'" for s in State if s in FINAL_STATES)

_PURGE: Final = f"""
    DELETE FROM twiceshy_records
    WHERE expires_at IS NOT NULL
      AND expires_at <= :now
      AND state IN ({_FINAL_VALUES})
      AND (:namespace IS NULL OR namespace = :namespace)
"""

# --------------------------------------------------------------------------------------------

_SYNCHRONOUS: Final = ("OFF", "NORMAL", "FULL", "EXTRA")  # weakest first
# The weakest setting whose acknowledged commits survive a power cut, by journal mode. DELETE
# commits by unlinking the journal, and only EXTRA syncs the directory after the unlink;
# TRUNCATE and PERSIST commit by a change to the journal that FULL syncs; WAL by a frame of the
# log that FULL syncs.
_DURABLE: Final = {"wal": "FULL", "delete": "EXTRA", "truncate": "FULL", "persist": "FULL"}
# SQLite holds the busy timeout as a 32-bit int of milliseconds.
_MAX_BUSY_TIMEOUT: Final = 2_147_483
_FILE_MODE: Final = 0o600
_DIRECTORY_MODE: Final = 0o700
# How often opening a connection is tried again when the file at the path is replaced while
# it is opened, before the store gives up with StoreUnavailable.
_OPEN_ATTEMPTS: Final = 5
_JOURNAL_MODES: Final = frozenset({"wal", "delete", "truncate", "persist"})
_MIN_VERSION: Final = (3, 35, 0)  # INSERT ... ON CONFLICT DO UPDATE ... RETURNING
_IDLE_CONNECTIONS: Final = 4
_SQLITE_BUSY: Final = 5
_SQLITE_LOCKED: Final = 6
_SQLITE_NOTADB: Final = 26
_DELETED_CODES: Final = frozenset(
    {
        5898,  # SQLITE_IOERR_DELETE_NOENT: the journal was gone at the commit
        1032,  # SQLITE_READONLY_DBMOVED: the file was unlinked since it was opened
        1802,  # SQLITE_IOERR_FSTAT: no file at the path to give a new journal its mode
    }
)
_POLL_FIRST: Final = 0.001
_POLL_CAP: Final = 0.025

log = logging.getLogger("twiceshy")

# A file as the operating system names it: (device, inode).
_FileId = tuple[int, int]


class _Connection(sqlite3.Connection):
    """A connection that remembers which file it opened, and whether it made the ledger there."""

    file: _FileId | None = None
    made_ledger: bool = False


# Primary result codes meaning "the file cannot be reached or used now".
_UNAVAILABLE_CODES: Final = frozenset(
    {
        3,  # SQLITE_PERM
        _SQLITE_BUSY,  # after the busy timeout
        _SQLITE_LOCKED,
        8,  # SQLITE_READONLY
        10,  # SQLITE_IOERR
        13,  # SQLITE_FULL
        14,  # SQLITE_CANTOPEN
    }
)


def has_wal_reset_bug(version: Sequence[int]) -> bool:
    """Whether an SQLite version carries the WAL-reset bug (fixed in 3.44.6, 3.50.7, 3.51.3).

    Args:
        version: the version as a tuple, e.g. :data:`sqlite3.sqlite_version_info`.
    """
    v = tuple(version[:3])
    return v < (3, 44, 6) or (3, 45, 0) <= v < (3, 50, 7) or (3, 51, 0) <= v < (3, 51, 3)


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


def _make_directories(path: str) -> None:
    """Make ``path`` and its missing parents, each private to the user.

    ``os.makedirs`` gives its mode to the last directory only.
    """
    missing: list[str] = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, _DIRECTORY_MODE)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise


def _store_error(exc: sqlite3.Error) -> StoreError:
    """The twiceshy error for a driver error (the caller chains it ``from`` ``exc``)."""
    code = getattr(exc, "sqlite_errorcode", None)
    message = f"SQLite ledger: {exc}"
    if isinstance(code, int) and code & 0xFF in _UNAVAILABLE_CODES:
        return StoreUnavailable(message)
    text = str(exc).lower()
    if isinstance(exc, sqlite3.OperationalError) and any(
        hint in text for hint in ("unable to open", "disk i/o", "database is locked")
    ):
        return StoreUnavailable(message)
    return StoreError(message)


_EFFECTS: Final = {e.value: e for e in Effect}
_STATES: Final = {s.value: s for s in State}


def _record(row: Sequence[Any]) -> Record:
    # Columns are in Record's field order (_COLUMNS); only the two enums need converting.
    try:
        return Record(
            row[0],
            row[1],
            row[2],
            row[3],
            _EFFECTS[row[4]],
            _STATES[row[5]],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            row[13],
            row[14],
            row[15],
        )
    except (KeyError, TypeError) as exc:
        raise StoreError(f"SQLite ledger: unreadable record {row[0]!r}/{row[1]!r}: {exc}") from exc


def _state_slots(states: Iterable[State]) -> dict[str, str | None]:
    states = frozenset(states)
    slots = _SLOTS.get(states)
    if slots is None:
        values: list[str | None] = [s.value for s in sorted(states, key=lambda s: s.value)]
        values += [None] * (len(_STATE_SLOTS) - len(values))
        slots = _SLOTS[states] = dict(zip(_STATE_SLOTS, values, strict=True))
    return slots


# The slots of each set of states, made once: a write binds them on every call. There are at
# most 2**5 sets.
_SLOTS: dict[frozenset[State], dict[str, str | None]] = {}


def _drain(idle: queue.SimpleQueue[_Connection]) -> None:
    while True:
        try:
            conn = idle.get_nowait()
        except queue.Empty:
            return
        conn.close()


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        # The original error is already on its way up, and this connection is discarded
        # (closing it rolls back whatever is left).
        pass


class _Lent:
    """One operation's connection: lent from the pool, given back or discarded on an error.

    A plain class rather than a generator-based context manager: every call of the ledger passes
    through here two or three times.
    """

    __slots__ = ("conn", "store", "write")

    def __init__(self, store: SQLiteStore, conn: _Connection, *, write: bool) -> None:
        self.store, self.conn, self.write = store, conn, write

    def __enter__(self) -> sqlite3.Connection:
        if self.write:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except BaseException as exc:
                self.__exit__(type(exc), exc, None)
                raise
        return self.conn

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn = self.conn
        if exc is None:
            try:
                if self.write:
                    conn.execute("COMMIT")
            except BaseException as failure:
                self._discard()
                self._raise_mapped(failure)
                raise
            self.store._give_back(conn)
            return
        self._discard()
        self._raise_mapped(exc)

    def _discard(self) -> None:
        _rollback_quietly(self.conn)
        self.conn.close()

    def _raise_mapped(self, exc: BaseException) -> None:
        """Raise a driver error as :class:`StoreError`; anything else goes on as it is."""
        if isinstance(exc, sqlite3.Error) and (
            _deleted_under(exc) or self.store._file_at_path() != self.conn.file
        ):
            # Deleted or replaced under the operation, whose error is then only a symptom. A
            # file deleted during another process's write can also lose its tables to that
            # process's journal, which SQLite plays back into the new file at the path.
            raise StoreUnavailable(
                f"SQLite ledger {self.store._where!r} was deleted or replaced while this call "
                "used it, and the call failed; the next call uses the file now at that path, "
                "making a ledger there if it holds none"
            ) from exc
        _raise_mapped(exc)


def _deleted_under(exc: BaseException | None) -> bool:
    """Whether a driver error is what a ledger file deleted during an operation causes.

    The journal deleted under a transaction (by ``rm``, or by a process committing in a deleted
    file, since journals are found by name); a write refused because the file was unlinked; a
    table gone, played back to an empty file by another process's journal.
    """
    if not isinstance(exc, sqlite3.Error):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    return code in _DELETED_CODES or (
        isinstance(exc, sqlite3.OperationalError)
        and str(exc).startswith("no such table: twiceshy_")
    )


def _raise_mapped(exc: BaseException) -> None:
    """Raise a driver error as :class:`StoreError`; anything else goes on as it is."""
    if isinstance(exc, sqlite3.Error):
        raise _store_error(exc) from exc
    if isinstance(exc, UnicodeEncodeError):
        # sqlite3 stores text as strict UTF-8: a lone surrogate cannot be written.
        raise StoreError(f"SQLite ledger cannot store text that is not UTF-8: {exc}") from exc


class SQLiteStore:
    """A :class:`~twiceshy.stores.Store` in one SQLite file.

    Args:
        path: the database file; its parent directory is created. New files are ``0600``,
            new directories ``0700``.
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
        path: the database file.
        journal_mode: the journal mode in effect (``"wal"`` or ``"delete"``, ...).
        synchronous: the ``synchronous`` setting of every connection (``"EXTRA"``, ...).

    Raises:
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
        # None: chosen for the journal mode in effect, connection by connection (_connect).
        self._asked_synchronous: str | None = None
        if synchronous is not None:
            if not isinstance(synchronous, str) or synchronous.upper() not in _SYNCHRONOUS:
                raise ValueError(
                    f"synchronous must be one of {', '.join(_SYNCHRONOUS)}, not {synchronous!r}"
                )
            self._asked_synchronous = synchronous.upper()
        if journal_mode is None:
            wanted = self._default_mode()
        else:
            wanted = journal_mode.lower()
            if wanted not in _JOURNAL_MODES:
                raise ValueError(
                    f"journal_mode must be one of {sorted(_JOURNAL_MODES)}, not {journal_mode!r}"
                )
        self.journal_mode = wanted
        self.synchronous = self._synchronous_for(wanted)
        self._busy_timeout = _busy_timeout(busy_timeout)
        if sqlite3.sqlite_version_info < _MIN_VERSION:
            raise StoreError(
                f"SQLite ledger needs SQLite >= {'.'.join(map(str, _MIN_VERSION))}, "
                f"this Python has {sqlite3.sqlite_version}"
            )
        self._clock = clock
        self._closed = False
        self._pid = os.getpid()
        self._idle: queue.SimpleQueue[_Connection] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._version = 0
        # Opened by this name whatever the working directory later is.
        self._where = os.path.abspath(self.path)
        self._create = create
        # What connections open: a URI whose mode=rw never creates the file. With create, the
        # store creates it first (_make_file), private to the user, as SQLite would not.
        self._target = Path(self._where).as_uri() + "?mode=rw"
        # The file the store's connections open; see _check_file().
        self._file: _FileId | None = None
        self._reopening = threading.Lock()

        if create:
            parent = os.path.dirname(self._where)
            try:
                _make_directories(parent)
            except OSError as exc:
                raise StoreUnavailable(f"SQLite ledger: cannot create {parent!r}: {exc}") from exc
        self._open_file()
        durable = _DURABLE.get(self.journal_mode, "EXTRA")
        if _SYNCHRONOUS.index(self.synchronous) < _SYNCHRONOUS.index(durable):
            log.warning(
                "twiceshy: SQLite ledger %r runs with synchronous=%s in journal mode %r: a "
                "power cut may lose claims already acknowledged (and an UNSAFE tool may then "
                "run twice); set %s or stronger, or leave synchronous unset",
                self._where,
                self.synchronous,
                self.journal_mode,
                durable,
            )

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

    # -- connections ------------------------------------------------------------------------

    def _connect(self, *, opening: bool) -> _Connection:
        """A new connection to the file now at the path, which it names (``conn.file``).

        A file deleted or replaced while it is opened is not an error: the file then at the
        path is opened instead, up to :data:`_OPEN_ATTEMPTS` times.

        Args:
            opening: the store opens (or follows) the file: its schema is checked and brought
                up to date. Else the ledger's tables are made only where the file lacks them (a
                file made at the path since).
        """
        for _ in range(_OPEN_ATTEMPTS):
            before = self._file_at_path()
            if before is None:
                if not self._create:
                    raise LedgerNotFound(
                        f"no twiceshy ledger at {self._where!r}: there is no such file"
                    )
                self._make_file()
                before = self._file_at_path()
                if before is None:
                    continue  # deleted as soon as it was made
            try:
                conn = sqlite3.connect(
                    self._target,
                    uri=True,
                    timeout=self._busy_timeout,
                    isolation_level=None,
                    check_same_thread=False,
                    factory=_Connection,
                )
            except sqlite3.Error as exc:
                if self._file_at_path() != before:
                    continue  # deleted or replaced before SQLite opened it
                raise _store_error(exc) from exc
            try:
                # SQLite cannot say which file a connection opened: it is the one at the path
                # both before and after opening, else the path changed meanwhile and this
                # connection is not used.
                if self._file_at_path() != before:
                    conn.close()
                    continue
                conn.file = before
                self._prepare(conn, opening=opening)
            except StoreError as exc:
                conn.close()
                if _deleted_under(exc.__cause__) or self._file_at_path() != before:
                    continue  # the file went while it was being opened
                raise
            except BaseException:
                conn.close()
                raise
            return conn
        raise StoreUnavailable(
            f"SQLite ledger {self._where!r}: the file at that path was deleted or replaced "
            f"each of the {_OPEN_ATTEMPTS} times it was opened"
        )

    def _prepare(self, conn: _Connection, *, opening: bool) -> None:
        """Set a new connection's pragmas; find (or make) the ledger's tables in its file."""
        try:
            conn.execute(f"PRAGMA busy_timeout = {round(self._busy_timeout * 1000)}")
            # Read before anything is written, the journal mode included (create=False).
            tables = self._ledger_tables(conn)
            # What runs, which may differ from what was asked (WAL refused by the file system).
            self.journal_mode = self._set_journal_mode(conn)
            self.synchronous = self._synchronous_for(self.journal_mode)
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
        except sqlite3.Error as exc:
            raise _store_error(exc) from exc
        if opening or tables != _ALL_TABLES:
            # A file made since the store opened gets the ledger's tables here, so no statement
            # ever meets a missing table.
            self._create_schema(conn)
            conn.made_ledger = not opening and not _CORE_TABLES.issubset(tables)

    def _ledger_tables(self, conn: sqlite3.Connection) -> frozenset[str]:
        """Which of the ledger's tables the connection's file holds.

        Raises:
            LedgerNotFound: with ``create=False``, the file is no database or no ledger.
        """
        missing = f"no twiceshy ledger at {self._where!r}"
        try:
            names = frozenset(str(row[0]) for row in conn.execute(_LEDGER_TABLES))
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
            if not self._create and code == _SQLITE_NOTADB:
                raise LedgerNotFound(f"{missing}: the file is not an SQLite database") from exc
            raise
        if not self._create and not _CORE_TABLES.issubset(names):
            raise LedgerNotFound(f"{missing}: the file holds no twiceshy tables")
        return names

    def _synchronous_for(self, journal_mode: str) -> str:
        """The setting asked for, else the weakest that survives a power cut in this mode."""
        if self._asked_synchronous is not None:
            return self._asked_synchronous
        return "FULL" if journal_mode == "wal" else "EXTRA"

    def _make_file(self) -> None:
        """Create the empty ledger file, private to its user, unless another process just did.

        SQLite would create it with the umask's mode (usually world-readable); it gives its
        journals the mode of the file.
        """
        try:
            fd = os.open(self._where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        except FileExistsError:
            return
        except OSError as exc:
            raise StoreUnavailable(f"SQLite ledger: cannot create {self._where!r}: {exc}") from exc
        os.close(fd)

    def _file_at_path(self) -> _FileId | None:
        """The file now at the store's path; ``None`` when there is none."""
        try:
            st = os.stat(self._where)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"SQLite ledger: cannot look at {self._where!r}: {exc}") from exc
        return st.st_dev, st.st_ino

    def _open_file(self) -> None:
        """Open the file at the path, make its tables, and lend from it from now on."""
        conn = self._connect(opening=True)
        self._file = conn.file
        # Connections to a file that was there before are closed, idle or when given back.
        _drain(self._pool())
        self._give_back(conn)

    def _check_file(self) -> None:
        """Follow the path to a new file if the one the connections opened was replaced."""
        if self._file_at_path() == self._file:
            return
        with self._reopening:
            if self._file_at_path() == self._file:  # another thread followed it meanwhile
                return
            self._warn_replaced()
            self._open_file()

    def _warn_replaced(self) -> None:
        log.warning(
            "twiceshy: SQLite ledger %r was deleted or replaced while open; its records "
            "are not in the file now at that path, which this process uses from now on",
            self._where,
        )

    def _set_journal_mode(self, conn: sqlite3.Connection) -> str:
        """Put the file in the chosen journal mode; answer the mode SQLite reports.

        Switching the mode needs the file to itself, and SQLite answers ``SQLITE_BUSY`` at
        once (no busy handler) when another process opens the file at that moment, so the
        switch is retried with backoff within the busy timeout. A file already in the mode is
        left alone: that is the common case and takes no lock beyond a read.
        """
        deadline = time.monotonic() + self._busy_timeout
        delay = _POLL_FIRST
        while True:
            mode = None
            try:
                mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
                if mode != self.journal_mode:
                    query = f"PRAGMA journal_mode = {self.journal_mode}"
                    # WAL may be refused (a file system without shared memory): the answer
                    # is the mode that runs.
                    mode = str(conn.execute(query).fetchone()[0]).lower()
                return mode
            except sqlite3.OperationalError as exc:
                code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
                if code not in (_SQLITE_BUSY, _SQLITE_LOCKED):
                    raise
                if time.monotonic() >= deadline:
                    if mode is None:
                        raise
                    # Still refused after the whole busy timeout: other processes keep the file
                    # open in the mode it is in, which is a setting they disagree on.
                    raise StoreUnavailable(
                        f"SQLite ledger {self._where!r} is in journal mode {mode!r} and open "
                        f"elsewhere in that mode, so this store cannot switch it to "
                        f"{self.journal_mode!r}: every process sharing a ledger file must use "
                        "one journal mode (journal_mode=; by default this SQLite "
                        f"{sqlite3.sqlite_version} uses {self._default_mode()!r})"
                    ) from exc
            time.sleep(delay)
            delay = min(delay * 2, _POLL_CAP)

    @staticmethod
    def _default_mode() -> str:
        return "delete" if has_wal_reset_bug(sqlite3.sqlite_version_info) else "wal"

    def _create_schema(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA:
                    conn.execute(statement)
                row = conn.execute(_SELECT_SCHEMA_VERSION).fetchone()
                conn.execute(_TOUCH_SCHEMA_VERSION)
                conn.execute("COMMIT")
            except BaseException:
                _rollback_quietly(conn)
                raise
        except sqlite3.Error as exc:
            raise _store_error(exc) from exc
        found = row[0] if row is not None else None
        if found != str(SCHEMA_VERSION):
            raise StoreError(
                f"SQLite ledger {self.path!r} has schema version {found!r}; this twiceshy "
                f"reads version {SCHEMA_VERSION}"
            )

    def _pool(self) -> queue.SimpleQueue[_Connection]:
        pid = os.getpid()
        if pid != self._pid:
            # A forked child: the parent's connections, and a condition whose lock a parent
            # thread may have held at the fork, must never be used here. They are dropped, and
            # the child opens its own connections.
            self._pid = pid
            self._idle = queue.SimpleQueue()
            self._changed = threading.Condition()
        return self._idle

    def _give_back(self, conn: _Connection) -> None:
        idle = self._pool()
        if self._closed or idle.qsize() >= _IDLE_CONNECTIONS or conn.file != self._file:
            conn.close()
            return
        idle.put(conn)
        if self._closed:  # close() ran meanwhile and may have missed this one
            _drain(idle)

    def _connection(self, *, write: bool = False) -> _Lent:
        """Lend a connection to the file at the path for one operation.

        Driver errors are mapped to :class:`StoreError` when the operation ends.
        """
        if self._closed:
            raise StoreError(f"SQLite ledger {self.path!r} is closed")
        for _ in range(_OPEN_ATTEMPTS):
            # Reads follow the path too: a record in an unlinked file is no answer.
            self._check_file()
            idle = self._pool()
            while True:
                try:
                    conn = idle.get_nowait()
                except queue.Empty:
                    break
                if conn.file == self._file:
                    return _Lent(self, conn, write=write)
                conn.close()  # opened the file that was at the path before it was replaced
            conn = self._connect(opening=False)
            if conn.file == self._file:
                if conn.made_ledger:
                    # A new file that got the deleted one's number, so _check_file saw none.
                    self._warn_replaced()
                return _Lent(self, conn, write=write)
            conn.close()  # the path changed since _check_file: follow it first
        raise StoreUnavailable(
            f"SQLite ledger {self._where!r}: the file at that path was deleted or replaced "
            f"each of the {_OPEN_ATTEMPTS} times it was opened"
        )

    def _transaction(self) -> _Lent:
        """A write transaction: ``BEGIN IMMEDIATE`` takes the one writer's lock up front.

        On any error the connection is rolled back and discarded. A failed ``COMMIT`` leaves the
        outcome unknown to us; a claim retried with the same owner token recognises itself.
        """
        return self._connection(write=True)

    def _notify(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    @staticmethod
    def _read(conn: sqlite3.Connection, namespace: str, key: str) -> Record | None:
        row = conn.execute(_SELECT_RECORD, {"namespace": namespace, "key": key}).fetchone()
        return _record(row) if row is not None else None

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
    ) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`."""
        with self._connection() as conn:
            now = self._clock()
            existing = self._read(conn, namespace, key)
        # Fast path: the claim statement never changes a live record, so a live record is
        # answered from a plain read, without taking the writer's lock.
        if existing is not None and is_live(existing, now):
            won = existing.state is State.CLAIMED and existing.owner == owner
            return Snapshot(existing, now, won)

        with self._transaction() as conn:
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
            )
            rows = conn.execute(
                _CLAIM,
                {
                    "namespace": namespace,
                    "key": key,
                    "fingerprint": fresh.fingerprint,
                    "tool": fresh.tool,
                    "effect": fresh.effect.value,
                    "state": fresh.state.value,
                    "fence": fresh.fence,
                    "owner": fresh.owner,
                    "lease_deadline": fresh.lease_deadline,
                    "attempts": fresh.attempts,
                    "now": now,
                },
            ).fetchall()
            inserted = bool(rows)
            record = _record(rows[0]) if rows else self._read(conn, namespace, key)
        if inserted:
            self._notify()
        if record is None or not is_live(record, now):  # cannot happen: the row was just read
            raise StoreError(f"SQLite ledger lost the claim of {namespace!r}/{key!r}")
        won = inserted or (record.state is State.CLAIMED and record.owner == owner)
        return Snapshot(record, now, won)

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`."""
        to = change.to
        with self._transaction() as conn:
            now = self._clock()
            params: dict[str, object] = {
                "namespace": namespace,
                "key": key,
                "fence": change.fence,
                "owner": change.owner,
                "lapsed": change.lapsed,
                "now": now,
                "to": to.value,
                "bump": 1 if change.new_owner is not None else 0,
                "new_owner": change.new_owner,
                "keep_deadline": to is State.CLAIMED and change.lease is None,
                "lease_deadline": (
                    now + change.lease if to is State.CLAIMED and change.lease is not None else None
                ),
                "add_attempts": 1 if change.new_owner is not None or change.count_attempt else 0,
                "result": change.result if to is State.SUCCEEDED else None,
                "error": change.error if to in (State.FAILED, State.UNKNOWN) else None,
                "reason": change.reason if to is State.UNKNOWN else None,
                "expires_at": (
                    now + change.ttl if to in FINAL_STATES and change.ttl is not None else None
                ),
                **_state_slots(change.from_states),
            }
            rows = conn.execute(_WRITE, params).fetchall()
            won = bool(rows)
            record = _record(rows[0]) if rows else self._read(conn, namespace, key)
        if won:
            self._notify()
        elif record is not None and not is_live(record, now):
            record = None  # a record past its retention is no record; one just written is
        return Snapshot(record, now, won)

    def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        with self._connection() as conn:
            now = self._clock()
            record = self._read(conn, namespace, key)
        if record is not None and not is_live(record, now):
            record = None
        return Snapshot(record, now)

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`.

        Wakes at once on this store's own writes; polls with backoff (1 ms doubling to 25 ms)
        for writes by other processes.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        delay = _POLL_FIRST
        while True:
            self._pool()  # a forked child gets its own condition before using it
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
            delay = min(delay * 2, _POLL_CAP)

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        with self._connection() as conn:
            now = self._clock()
            rows = conn.execute(
                _RECORDS,
                {
                    "namespace": namespace,
                    "now": now,
                    "all_states": states is None,
                    "tool": tool,
                    "limit": -1 if limit is None else max(limit, 0),
                    **_state_slots(states if states is not None else ()),
                },
            ).fetchall()
        return [_record(row) for row in rows]

    def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        with self._connection() as conn:
            now = self._clock()
            # One statement in autocommit mode is its own transaction.
            count: int = conn.execute(_PURGE, {"now": now, "namespace": namespace}).rowcount
        return count

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """See :meth:`twiceshy.stores.CallCounts.add_counts`: one write transaction."""
        rows = [(namespace, tool, outcome, n) for (tool, outcome), n in counts.items()]
        if rows:
            with self._transaction() as conn:
                conn.executemany(_ADD_COUNT, rows)

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """See :meth:`twiceshy.stores.CallCounts.counts`."""
        with self._connection() as conn:
            rows = conn.execute(_COUNTS, (namespace,)).fetchall()
        return {(tool, outcome): int(n) for tool, outcome, n in rows}

    def close(self) -> None:
        """Close the idle connections; connections in use close when given back."""
        self._closed = True
        _drain(self._pool())


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
