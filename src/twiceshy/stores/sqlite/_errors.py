"""Errors of :mod:`sqlite3` as twiceshy's: a file that cannot be reached now, or a ledger fault.

The caller raises what these answer ``from`` the driver's error.
"""

from __future__ import annotations

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


def primary_code(exc: sqlite3.Error) -> int:
    """The primary result code of a driver error (0 when it has none)."""
    code: int = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    return code


def store_error(exc: sqlite3.Error) -> StoreError:
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


def raise_mapped(exc: BaseException) -> None:
    """Raise a driver error as :class:`StoreError`; anything else goes on as it is."""
    if isinstance(exc, sqlite3.Error):
        raise store_error(exc) from exc
    if isinstance(exc, UnicodeEncodeError):
        # sqlite3 stores text as strict UTF-8: a lone surrogate cannot be written.
        raise StoreError(f"SQLite ledger cannot store text that is not UTF-8: {exc}") from exc
