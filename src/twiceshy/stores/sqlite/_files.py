"""Following the ledger's path: every operation gets a connection to the file now at that path.

SQLite's locks belong to the file a connection opened. A ledger file deleted or replaced while
processes hold it open would leave them claiming in the old, unlinked file while new processes
claim in the new one. So before every operation the file at the path is compared with the one
the connections opened, and followed when they differ; a new connection makes the ledger's
tables in a file that lacks them; an operation whose file goes while it runs fails with
:class:`~twiceshy.StoreUnavailable`. All of that is here, with the pool of idle connections it
lends from (see docs/stores/sqlite.md, "A file deleted or replaced under running processes").
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Final

from ...errors import LedgerNotFound, StoreError, StoreUnavailable
from . import _sql
from ._errors import (
    LedgerDirectoryNotFound,
    missing_directory_message,
    raise_mapped,
    store_error,
)
from ._setup import Connection, FileId, Setup, rollback_quietly

FILE_MODE: Final = 0o600
DIRECTORY_MODE: Final = 0o700
# How often opening a connection is tried again when the file at the path is replaced while
# it is opened, before the store gives up with StoreUnavailable.
OPEN_ATTEMPTS: Final = 5
IDLE_CONNECTIONS: Final = 4
_DELETED_CODES: Final = frozenset(
    {
        5898,  # SQLITE_IOERR_DELETE_NOENT: the journal was gone at the commit
        1032,  # SQLITE_READONLY_DBMOVED: the file was unlinked since it was opened
        1802,  # SQLITE_IOERR_FSTAT: no file at the path to give a new journal its mode
    }
)

log = logging.getLogger("twiceshy")


class LedgerFile:
    """The ledger file as one process holds it: the file at the path, and idle connections to it.

    Args:
        setup: how connections are opened and set up.
        on_fork: called in a forked child before it lends anything, to re-make what else the
            store keeps per process.

    Attributes:
        where: the absolute path followed.
        file: the file the connections open, ``None`` before :meth:`open`.
        pid: the process the idle connections belong to.
    """

    def __init__(self, setup: Setup, *, on_fork: Callable[[], None]) -> None:
        self.setup = setup
        self.closed = False
        self.pid = os.getpid()
        self.file: FileId | None = None
        self.where = setup.where
        self._on_fork = on_fork
        self._idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._reopening = threading.Lock()

    # -- the file at the path ---------------------------------------------------------------

    def check_directory(self) -> None:
        """Refuse a path whose directory is missing, unless it is the default ledger's.

        A mistyped path must not become a second, empty ledger; the default ledger's own
        directory (:func:`default_directory`) is made, with its missing parents.

        Raises:
            LedgerDirectoryNotFound: the directory is missing (and the store was to create).
            LedgerNotFound: the directory is missing, with ``create=False``; nothing is made.
            StoreUnavailable: the default ledger's directory cannot be made.
        """
        directory = os.path.dirname(self.where)
        try:
            os.stat(directory)
        except FileNotFoundError:
            pass
        except OSError:
            return  # a file in the way, no permission: opening the file says what is wrong
        else:
            return
        if not self.setup.create:
            raise LedgerNotFound(
                missing_directory_message(self.setup.path, self.where, create=False)
            )
        if directory != default_directory():
            raise LedgerDirectoryNotFound(self.setup.path, self.where)
        self._make_directories()

    def _make_directories(self) -> None:
        """Make the file's directory and its missing parents, each private to the user.

        ``os.makedirs`` gives its mode to the last directory only.

        Raises:
            StoreUnavailable: a directory cannot be made.
        """
        path = os.path.dirname(self.where)
        top = path
        missing: list[str] = []
        try:
            while not os.path.isdir(path):
                missing.append(path)
                parent = os.path.dirname(path)
                if parent == path:
                    break
                path = parent
            for directory in reversed(missing):
                try:
                    os.mkdir(directory, DIRECTORY_MODE)
                except FileExistsError:
                    if not os.path.isdir(directory):
                        raise
        except OSError as exc:
            raise StoreUnavailable(
                f"SQLite ledger {self.where!r}: cannot create the directory {top!r}: {exc}"
            ) from exc

    def at_path(self) -> FileId | None:
        """The file now at the store's path; ``None`` when there is none."""
        try:
            st = os.stat(self.where)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"SQLite ledger: cannot look at {self.where!r}: {exc}") from exc
        return st.st_dev, st.st_ino

    def open(self) -> None:
        """Open the file at the path, make its tables, and lend from it from now on."""
        conn = self.connect(opening=True)
        self.file = conn.file
        # Connections to a file that was there before are closed, idle or when given back.
        _drain(self.pool())
        self.give_back(conn)

    def follow(self) -> None:
        """Follow the path to a new file if the one the connections opened was replaced."""
        if self.at_path() == self.file:
            return
        with self._reopening:
            if self.at_path() == self.file:  # another thread followed it meanwhile
                return
            self._warn_replaced()
            self.open()

    def connect(self, *, opening: bool) -> Connection:
        """A new connection to the file now at the path, which it names (``conn.file``).

        A file deleted or replaced while it is opened is not an error: the file then at the
        path is opened instead, up to :data:`OPEN_ATTEMPTS` times.

        Args:
            opening: see :meth:`Setup.prepare`.
        """
        for _ in range(OPEN_ATTEMPTS):
            before = self.at_path()
            if before is None:
                if not self.setup.create:
                    raise LedgerNotFound(
                        f"no twiceshy ledger at {self.where!r}: there is no such file"
                    )
                self._make_file()
                before = self.at_path()
                if before is None:
                    continue  # deleted as soon as it was made
            try:
                conn = self.setup.connect()
            except sqlite3.Error as exc:
                if self.at_path() != before:
                    continue  # deleted or replaced before SQLite opened it
                raise store_error(exc, self.where) from exc
            try:
                # SQLite cannot say which file a connection opened: it is the one at the path
                # both before and after opening, else the path changed meanwhile and this
                # connection is not used.
                if self.at_path() != before:
                    conn.close()
                    continue
                conn.file = before
                self.setup.prepare(conn, opening=opening)
            except StoreError as exc:
                conn.close()
                if deleted_under(exc.__cause__) or self.at_path() != before:
                    continue  # the file went while it was being opened
                raise
            except BaseException:
                conn.close()
                raise
            return conn
        raise self._kept_moving()

    def _make_file(self) -> None:
        """Create the empty ledger file, private to its user, unless another process just did.

        SQLite would create it with the umask's mode (usually world-readable); it gives its
        journals the mode of the file.
        """
        try:
            fd = os.open(self.where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            return
        except OSError as exc:
            raise StoreUnavailable(
                f"SQLite ledger {self.where!r}: cannot create it: {exc}"
            ) from exc
        os.close(fd)

    def _warn_replaced(self) -> None:
        log.warning(
            "twiceshy: SQLite ledger %r was deleted or replaced while open; its records "
            "are not in the file now at that path, which this process uses from now on",
            self.where,
        )

    def _kept_moving(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"SQLite ledger {self.where!r}: the file at that path was deleted or replaced "
            f"each of the {OPEN_ATTEMPTS} times it was opened"
        )

    # -- lending ------------------------------------------------------------------------------

    def pool(self) -> queue.SimpleQueue[Connection]:
        """This process's idle connections (none yet in a forked child)."""
        pid = os.getpid()
        if pid != self.pid:
            # A forked child: the parent's connections must never be used here (nor what
            # on_fork makes anew). They are dropped, and the child opens its own connections.
            self.pid = pid
            self._idle = queue.SimpleQueue()
            self._on_fork()
        return self._idle

    def lend(self, *, write: bool = False) -> Lent:
        """Lend a connection to the file at the path for one operation.

        With ``write``, the operation is a write transaction: ``BEGIN IMMEDIATE`` takes the one
        writer's lock up front. On any error the connection is rolled back and discarded. A
        failed ``COMMIT`` leaves the outcome unknown to us; a claim retried with the same owner
        token recognises itself. Driver errors are mapped to :class:`StoreError` when the
        operation ends.
        """
        if self.closed:
            raise StoreError(f"SQLite ledger {self.setup.path!r} is closed")
        for _ in range(OPEN_ATTEMPTS):
            # Reads follow the path too: a record in an unlinked file is no answer.
            self.follow()
            idle = self.pool()
            while True:
                try:
                    conn = idle.get_nowait()
                except queue.Empty:
                    break
                if conn.file == self.file:
                    return Lent(self, conn, write=write)
                conn.close()  # opened the file that was at the path before it was replaced
            conn = self.connect(opening=False)
            if conn.file == self.file:
                if conn.made_ledger:
                    # A new file that got the deleted one's number, so follow() saw none.
                    self._warn_replaced()
                return Lent(self, conn, write=write)
            conn.close()  # the path changed since follow(): follow it first
        raise self._kept_moving()

    def give_back(self, conn: Connection) -> None:
        """Keep a connection for the next operation, or close it."""
        idle = self.pool()
        if self.closed or idle.qsize() >= IDLE_CONNECTIONS or conn.file != self.file:
            conn.close()
            return
        idle.put(conn)
        if self.closed:  # close() ran meanwhile and may have missed this one
            _drain(idle)

    def close(self) -> None:
        """Close the idle connections; connections in use close when given back."""
        self.closed = True
        _drain(self.pool())


class Lent:
    """One operation's connection: lent from the pool, given back or discarded on an error.

    A plain class rather than a generator-based context manager: every call of the ledger passes
    through here two or three times.
    """

    __slots__ = ("conn", "files", "write")

    def __init__(self, files: LedgerFile, conn: Connection, *, write: bool) -> None:
        self.files, self.conn, self.write = files, conn, write

    def __enter__(self) -> sqlite3.Connection:
        if self.write:
            try:
                self.conn.execute(_sql.BEGIN)
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
                    conn.execute(_sql.COMMIT)
            except BaseException as failure:
                self._discard()
                self._raise_mapped(failure)
                raise
            self.files.give_back(conn)
            return
        self._discard()
        self._raise_mapped(exc)

    def _discard(self) -> None:
        rollback_quietly(self.conn)
        self.conn.close()

    def _raise_mapped(self, exc: BaseException) -> None:
        """Raise a driver error as :class:`StoreError`; anything else goes on as it is."""
        files = self.files
        if isinstance(exc, sqlite3.Error) and (
            deleted_under(exc) or files.at_path() != self.conn.file
        ):
            # Deleted or replaced under the operation, whose error is then only a symptom. A
            # file deleted during another process's write can also lose its tables to that
            # process's journal, which SQLite plays back into the new file at the path.
            raise StoreUnavailable(
                f"SQLite ledger {files.where!r} was deleted or replaced while this call "
                "used it, and the call failed; the next call uses the file now at that path, "
                "making a ledger there if it holds none"
            ) from exc
        raise_mapped(exc, files.where)


def default_directory() -> str:
    """The default ledger's directory, which the store makes when it is missing.

    The directory of :func:`twiceshy.stores.default_url`'s file when ``TWICESHY_LEDGER`` is
    unset: ``$XDG_STATE_HOME/twiceshy``, else ``~/.local/state/twiceshy`` (the two must agree,
    which ``tests/test_first_meeting.py`` checks).
    """
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.abspath(os.path.join(state_home, "twiceshy"))


def deleted_under(exc: BaseException | None) -> bool:
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


def _drain(idle: queue.SimpleQueue[Connection]) -> None:
    while True:
        try:
            conn = idle.get_nowait()
        except queue.Empty:
            return
        conn.close()
