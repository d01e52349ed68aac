"""Errors of :mod:`sqlite3` as twiceshy's: a file that cannot be reached now, or a ledger fault.

The caller raises what these answer ``from`` the driver's error. Every message names the ledger
file: SQLite's own ("unable to open database file", "file is not a database") name none.

A ledger path whose directory does not exist is refused with :class:`LedgerDirectoryNotFound`,
itself a :class:`~twiceshy.StoreError` and a :class:`FileNotFoundError`::

    StoreError
    └── LedgerDirectoryNotFound (FileNotFoundError)   the ledger file's directory is missing
"""

from __future__ import annotations

import os
import sqlite3
from typing import Final

from ...errors import StoreError, StoreUnavailable

SQLITE_BUSY: Final = 5
SQLITE_LOCKED: Final = 6
SQLITE_NOTADB: Final = 26

# Primary result codes meaning "the file cannot be reached or used now".
_UNAVAILABLE_CODES: Final = frozenset(
    {
        3,  # SQLITE_PERM
        SQLITE_BUSY,  # after the busy timeout
        SQLITE_LOCKED,
        8,  # SQLITE_READONLY
        10,  # SQLITE_IOERR
        13,  # SQLITE_FULL
        14,  # SQLITE_CANTOPEN
    }
)


class LedgerDirectoryNotFound(StoreError, FileNotFoundError):
    """The directory of the ledger file does not exist; nothing was created.

    A mistyped path must not become a second, empty ledger, where no retry finds the first
    one's records: so the store makes no directory, except the default ledger's own
    (``$XDG_STATE_HOME/twiceshy``, else ``~/.local/state/twiceshy``). The message shows the
    absolute path and how a ``sqlite://`` URL spells a relative and an absolute one.

    Args:
        path: the ledger file as given.
        where: the same, absolute.

    Attributes:
        path: the ledger file, absolute.
    """

    def __init__(self, path: str, where: str) -> None:
        self.path = where
        super().__init__(missing_directory_message(path, where, create=True))


def missing_directory_message(path: str, where: str, *, create: bool) -> str:
    """Why a ledger at ``path`` (``where``, absolute) is refused: its directory is missing.

    Args:
        path: the ledger file as given.
        where: the same, absolute.
        create: the store was to make a ledger there (else it opens only one that exists).
    """
    directory = os.path.dirname(where)
    if create:
        message = (
            f"SQLite ledger {where!r}: the directory {directory!r} does not exist, and "
            "twiceshy makes none (a mistyped path would become a second, empty ledger). "
            f"{slash_rule()}. Create the directory first, or fix the path"
        )
    else:
        message = (
            f"no twiceshy ledger at {where!r}: the directory {directory!r} does not exist. "
            f"{slash_rule()}"
        )
    # sqlite:///var/lib/x.db written for /var/lib/x.db: say so when that directory is there.
    meant = os.sep + path
    if not os.path.isabs(path) and os.path.isdir(os.path.dirname(meant)):
        message += f" (for {meant!r}: sqlite:///{meant})"
    return message


def slash_rule() -> str:
    """How a ``sqlite://`` URL names a relative and an absolute file, with the working directory."""
    return (
        "sqlite:///relative/x.db (three slashes) is relative to the working directory "
        f"{os.getcwd()!r}, sqlite:////absolute/x.db (four slashes) is absolute"
    )


def primary_code(exc: sqlite3.Error) -> int:
    """The primary result code of a driver error (0 when it has none)."""
    code: int = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    return code


def store_error(exc: sqlite3.Error, path: str) -> StoreError:
    """The twiceshy error for a driver error (the caller chains it ``from`` ``exc``).

    Args:
        exc: the driver's error.
        path: the ledger file, named in the message.
    """
    code = getattr(exc, "sqlite_errorcode", None)
    message = f"SQLite ledger {path!r}: {exc}"
    if isinstance(code, int) and code & 0xFF in _UNAVAILABLE_CODES:
        return StoreUnavailable(message)
    text = str(exc).lower()
    if isinstance(exc, sqlite3.OperationalError) and any(
        hint in text for hint in ("unable to open", "disk i/o", "database is locked")
    ):
        return StoreUnavailable(message)
    return StoreError(message)


def raise_mapped(exc: BaseException, path: str) -> None:
    """Raise a driver error as :class:`StoreError` naming ``path``; anything else goes on."""
    if isinstance(exc, sqlite3.Error):
        raise store_error(exc, path) from exc
    if isinstance(exc, UnicodeEncodeError):
        # sqlite3 stores text as strict UTF-8: a lone surrogate cannot be written.
        raise StoreError(
            f"SQLite ledger {path!r} cannot store text that is not UTF-8: {exc}"
        ) from exc
