"""A new connection to the ledger file, set up: busy timeout, journal mode, durability, tables.

The durability defaults are chosen here: WAL, or the rollback journal on an SQLite with the
WAL-reset bug; ``synchronous`` FULL in WAL and EXTRA in the rollback journal, the weakest levels
that keep an acknowledged claim through a power cut (see docs/stores/sqlite.md).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ...errors import LedgerNotFound, StoreError, StoreUnavailable
from . import _sql
from ._errors import SQLITE_BUSY, SQLITE_LOCKED, SQLITE_NOTADB, primary_code, store_error

SYNCHRONOUS: Final = ("OFF", "NORMAL", "FULL", "EXTRA")  # weakest first
# The weakest setting whose acknowledged commits survive a power cut, by journal mode. DELETE
# commits by unlinking the journal, and only EXTRA syncs the directory after the unlink;
# TRUNCATE and PERSIST commit by a change to the journal that FULL syncs; WAL by a frame of the
# log that FULL syncs.
DURABLE: Final = {"wal": "FULL", "delete": "EXTRA", "truncate": "FULL", "persist": "FULL"}
JOURNAL_MODES: Final = frozenset({"wal", "delete", "truncate", "persist"})
# Backoff of every retry the store makes itself (a journal mode switch, a wait): 1 ms doubling
# to 25 ms.
POLL_FIRST: Final = 0.001
POLL_CAP: Final = 0.025

# A file as the operating system names it: (device, inode).
FileId = tuple[int, int]


def has_wal_reset_bug(version: Sequence[int]) -> bool:
    """Whether an SQLite version carries the WAL-reset bug (fixed in 3.44.6, 3.50.7, 3.51.3).

    Args:
        version: the version as a tuple, e.g. :data:`sqlite3.sqlite_version_info`.
    """
    v = tuple(version[:3])
    return v < (3, 44, 6) or (3, 45, 0) <= v < (3, 50, 7) or (3, 51, 0) <= v < (3, 51, 3)


def default_journal_mode() -> str:
    """WAL, unless this Python's SQLite carries the WAL-reset bug: then the rollback journal."""
    return "delete" if has_wal_reset_bug(sqlite3.sqlite_version_info) else "wal"


class Connection(sqlite3.Connection):
    """A connection that remembers which file it opened, and whether it made the ledger there."""

    file: FileId | None = None
    made_ledger: bool = False


def rollback_quietly(conn: sqlite3.Connection) -> None:
    """Roll back what ``conn`` has begun, on the way up with another error."""
    try:
        if conn.in_transaction:
            conn.execute(_sql.ROLLBACK)
    except sqlite3.Error:
        # The original error is already on its way up, and this connection is discarded
        # (closing it rolls back whatever is left).
        pass


class Setup:
    """How the store's connections are opened and set up, and the journal mode they found.

    Args:
        path: the ledger's path as given, for messages.
        where: the same path made absolute, which every connection opens.
        create: make the ledger's tables where there are none; else a file without them raises
            :class:`~twiceshy.LedgerNotFound`.
        busy_timeout: seconds to wait for another writer (checked by the store).
        journal_mode: the journal mode asked for (checked by the store).
        synchronous: the ``synchronous`` level asked for, ``None`` for the durable default.

    Attributes:
        journal_mode: the mode the last connection found in effect (WAL may be refused).
        synchronous: the level every connection runs with, in that mode.
    """

    def __init__(
        self,
        path: str,
        where: str,
        *,
        create: bool,
        busy_timeout: float,
        journal_mode: str,
        synchronous: str | None,
    ) -> None:
        self.path = path
        self.where = where
        self.create = create
        self.busy_timeout = busy_timeout
        self._asked_synchronous = synchronous
        self.journal_mode = journal_mode
        self.synchronous = self.synchronous_for(journal_mode)
        # A URI whose mode=rw never creates the file: with create, the store creates it first,
        # private to the user, as SQLite would not.
        self._target = Path(where).as_uri() + "?mode=rw"

    def synchronous_for(self, journal_mode: str) -> str:
        """The setting asked for, else the weakest that survives a power cut in this mode."""
        if self._asked_synchronous is not None:
            return self._asked_synchronous
        return "FULL" if journal_mode == "wal" else "EXTRA"

    def connect(self) -> Connection:
        """A new connection to whatever file is at the path, not yet set up.

        Raises:
            sqlite3.Error: the file cannot be opened (the caller maps it).
        """
        return sqlite3.connect(
            self._target,
            uri=True,
            timeout=self.busy_timeout,
            isolation_level=None,
            check_same_thread=False,
            factory=Connection,
        )

    def prepare(self, conn: Connection, *, opening: bool) -> None:
        """Set a new connection's pragmas; find (or make) the ledger's tables in its file.

        Args:
            conn: the new connection.
            opening: the store opens (or follows) the file: its schema is checked and brought
                up to date. Else the ledger's tables are made only where the file lacks them (a
                file made at the path since).
        """
        try:
            conn.execute(_sql.set_busy_timeout(self.busy_timeout))
            # Read before anything is written, the journal mode included (create=False).
            tables = self._ledger_tables(conn)
            # What runs, which may differ from what was asked (WAL refused by the file system).
            self.journal_mode = self._set_journal_mode(conn)
            self.synchronous = self.synchronous_for(self.journal_mode)
            conn.execute(_sql.set_synchronous(self.synchronous))
        except sqlite3.Error as exc:
            raise store_error(exc, self.where) from exc
        if opening or tables != _sql.ALL_TABLES:
            # A file made since the store opened gets the ledger's tables here, so no statement
            # ever meets a missing table.
            self._create_schema(conn)
            conn.made_ledger = not opening and not _sql.CORE_TABLES.issubset(tables)

    def _ledger_tables(self, conn: sqlite3.Connection) -> frozenset[str]:
        """Which of the ledger's tables the connection's file holds.

        Raises:
            LedgerNotFound: with ``create=False``, the file is no database or no ledger.
        """
        missing = f"no twiceshy ledger at {self.where!r}"
        try:
            names = frozenset(str(row[0]) for row in conn.execute(_sql.LEDGER_TABLES))
        except sqlite3.Error as exc:
            if not self.create and primary_code(exc) == SQLITE_NOTADB:
                raise LedgerNotFound(f"{missing}: the file is not an SQLite database") from exc
            raise
        if not self.create and not _sql.CORE_TABLES.issubset(names):
            raise LedgerNotFound(f"{missing}: the file holds no twiceshy tables")
        return names

    def _set_journal_mode(self, conn: sqlite3.Connection) -> str:
        """Put the file in the chosen journal mode; answer the mode SQLite reports.

        Switching the mode needs the file to itself, and SQLite answers ``SQLITE_BUSY`` at
        once (no busy handler) when another process opens the file at that moment, so the
        switch is retried with backoff within the busy timeout. A file already in the mode is
        left alone: that is the common case and takes no lock beyond a read.
        """
        deadline = time.monotonic() + self.busy_timeout
        delay = POLL_FIRST
        while True:
            mode = None
            try:
                mode = str(conn.execute(_sql.JOURNAL_MODE).fetchone()[0]).lower()
                if mode != self.journal_mode:
                    # WAL may be refused (a file system without shared memory): the answer
                    # is the mode that runs.
                    query = _sql.set_journal_mode(self.journal_mode)
                    mode = str(conn.execute(query).fetchone()[0]).lower()
                return mode
            except sqlite3.OperationalError as exc:
                if primary_code(exc) not in (SQLITE_BUSY, SQLITE_LOCKED):
                    raise
                if time.monotonic() >= deadline:
                    if mode is None:
                        raise
                    # Still refused after the whole busy timeout: other processes keep the file
                    # open in the mode it is in, which is a setting they disagree on.
                    raise StoreUnavailable(
                        f"SQLite ledger {self.where!r} is in journal mode {mode!r} and open "
                        f"elsewhere in that mode, so this store cannot switch it to "
                        f"{self.journal_mode!r}: every process sharing a ledger file must use "
                        "one journal mode (journal_mode=; by default this SQLite "
                        f"{sqlite3.sqlite_version} uses {default_journal_mode()!r})"
                    ) from exc
            time.sleep(delay)
            delay = min(delay * 2, POLL_CAP)

    def _create_schema(self, conn: sqlite3.Connection) -> None:
        """Make the ledger's tables where they are missing; check the schema's version."""
        try:
            conn.execute(_sql.BEGIN)
            try:
                for statement in _sql.SCHEMA:
                    conn.execute(statement)
                row = conn.execute(_sql.SELECT_SCHEMA_VERSION).fetchone()
                if row is not None and row[0] == "1":
                    # Under the write lock BEGIN took: one opener migrates, the others then
                    # read version 2.
                    for statement in _sql.MIGRATE_1_2:
                        conn.execute(statement)
                    row = (str(_sql.SCHEMA_VERSION),)
                conn.execute(_sql.TOUCH_SCHEMA_VERSION)
                conn.execute(_sql.COMMIT)
            except BaseException:
                rollback_quietly(conn)
                raise
        except sqlite3.Error as exc:
            raise store_error(exc, self.where) from exc
        found = row[0] if row is not None else None
        if found != str(_sql.SCHEMA_VERSION):
            raise StoreError(
                f"SQLite ledger {self.path!r} has schema version {found!r}; this twiceshy "
                f"reads version {_sql.SCHEMA_VERSION}"
            )
