"""``sqlite:///path/ledger.db``: the embedded ledger, one file shared by processes and threads.

Only the standard library's :mod:`sqlite3` is used. Every claim and every guarded write is one
``BEGIN IMMEDIATE`` transaction holding one conditional statement, so two callers never both win.
The design (durability by journal mode, the WAL-reset fallback, file modes, waiting, forks, and a
ledger file deleted or replaced under running processes) is in docs/stores/sqlite.md. The
statements are in ``_sql``, a new connection's setup in ``_setup``, the file following and the
pool in ``_files``, and the store's operations in ``_store``.
"""

from ._errors import LedgerDirectoryNotFound
from ._setup import has_wal_reset_bug as has_wal_reset_bug
from ._sql import SCHEMA as _SCHEMA  # noqa: F401 (benchmarks/ledger.py builds its floor on it)
from ._sql import SCHEMA_VERSION as SCHEMA_VERSION
from ._store import SQLiteStore

__all__ = ["LedgerDirectoryNotFound", "SQLiteStore"]
