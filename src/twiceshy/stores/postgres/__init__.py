"""``postgresql://user@host/db``: a ledger shared by processes and machines, on PostgreSQL.

Uses psycopg 3 and psycopg_pool (the ``postgres`` extra). :class:`PostgresStore` blocks,
:class:`AsyncPostgresStore` awaits; a claim is one statement in autocommit, every later write
one guarded ``UPDATE``, and waiters wake on ``LISTEN``/``NOTIFY``. Every statement is in
``_sql.py``; each operation is written once, as a generator of statements, in ``_ops.py``; the
two store classes (``_sync_store.py``, ``_async_store.py``) only carry those statements to the
server, and ``_listener.py`` wakes their waiters. What a claim means, durability and failover,
the clock, waiting, connections and the schema: ``docs/stores/postgres.md``.
"""

from ._async_store import AsyncPostgresStore
from ._sql import SCHEMA_VERSION as SCHEMA_VERSION  # the table layout this version reads
from ._sync_store import PostgresStore
from ._url import open_postgres

__all__ = ["AsyncPostgresStore", "PostgresStore", "open_postgres"]
