"""From a ``postgresql://`` URL to the two stores it names (:func:`open_postgres`)."""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import unquote

from ._async_store import AsyncPostgresStore
from ._sync_store import PostgresStore

# twiceshy's own URL parameters, and how each is read; every other parameter is libpq's.
_URL_OPTIONS: Final = {
    "schema": str,
    "table": str,
    "min_size": int,
    "pool_size": int,
    "pool_timeout": float,
    "connect_timeout": float,
    "application_name": str,
    "wait_recheck": float,
    "wakeups": str,
}


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """Separate twiceshy's own URL parameters from psycopg's, which are kept byte for byte."""
    base, _, query = url.partition("?")
    options: dict[str, Any] = {}
    kept: list[str] = []
    for item in query.split("&") if query else []:
        raw_name, _, raw_value = item.partition("=")
        name = unquote(raw_name)
        convert = _URL_OPTIONS.get(name)
        if convert is None:
            kept.append(item)
            continue
        if name in options:
            raise ValueError(f"PostgreSQL ledger URL repeats {name!r}")
        value = unquote(raw_value)
        try:
            options[name] = convert(value)
        except ValueError:
            raise ValueError(f"PostgreSQL ledger URL: bad value for {name!r}: {value!r}") from None
    return (f"{base}?{'&'.join(kept)}" if kept else base), options


def open_postgres(url: str, *, create: bool = True) -> tuple[PostgresStore, AsyncPostgresStore]:
    """Open the stores a ``postgresql://`` (or ``postgres://``) URL names.

    Besides psycopg's own parameters the URL may carry ``schema``, ``table``, ``pool_size``,
    ``pool_timeout``, ``min_size``, ``connect_timeout``, ``application_name``,
    ``wait_recheck`` and ``wakeups``, e.g.
    ``postgresql://app@db.internal/agents?schema=ledger&table=records&pool_size=20``, or through
    PgBouncer ``postgresql://app@pgbouncer:6432/agents?wakeups=poll``.

    Args:
        url: the ledger URL.
        create: see :class:`PostgresStore`.

    Returns:
        The blocking store (connected, its table checked) and its async twin.

    Raises:
        StoreUnavailable: the server cannot be reached.
        LedgerNotFound: with ``create=False``, the schema holds no such ledger.
        StoreError: the table is not a twiceshy ledger this version can use.
        ValueError: a parameter is malformed.
    """
    conninfo, options = split_url(url)
    store = PostgresStore(conninfo, create=create, **options)
    twin = AsyncPostgresStore(conninfo, create=create, **options)
    twin._schema_ready = True  # the blocking store has just checked the table
    twin._pooled = store._pooled  # and what answers
    return store, twin
