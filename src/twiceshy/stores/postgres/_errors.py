"""psycopg's failures as twiceshy's errors, for both PostgreSQL stores.

Every error a store raises is a :class:`~twiceshy.StoreError` chained ``from`` the driver's own;
a server that cannot be reached or a connection that broke is a
:class:`~twiceshy.StoreUnavailable`. The callers write the ``raise ... from`` themselves, so that
the traceback shows where the failure met the store.
"""

from __future__ import annotations

import psycopg
from psycopg_pool import PoolClosed

from ...errors import StoreError, StoreUnavailable


def store_error(exc: BaseException) -> StoreError:
    """The twiceshy error for a driver error (the caller chains it ``from`` ``exc``)."""
    if isinstance(exc, PoolClosed):
        return closed()
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return StoreUnavailable(f"PostgreSQL ledger unavailable: {exc}")
    if isinstance(exc, UnicodeError):
        return StoreError(f"PostgreSQL ledger cannot store text that is not UTF-8: {exc}")
    return StoreError(f"PostgreSQL ledger: {exc}")


def unreachable(where: str, exc: psycopg.Error) -> StoreUnavailable:
    """The error for a connection that could not be made to the server at ``where``."""
    return StoreUnavailable(f"PostgreSQL ledger at {where} cannot be reached: {exc}")


def pool_exhausted(where: str, size: int, timeout: float) -> StoreUnavailable:
    """The error for a statement that found no free connection in the pool in time.

    Raised before the statement is sent: nothing was claimed or written.
    """
    return StoreUnavailable(
        f"PostgreSQL ledger at {where}: no connection of the pool was free within "
        f"pool_timeout={timeout:g} s (all pool_size={size} busy, or the server cannot be "
        "reached); nothing was sent. Raise pool_size= in the ledger URL (within the server's "
        "max_connections), or pool_timeout= to let bursts wait longer."
    )


def closed() -> StoreError:
    """The error for a store used after :meth:`close`."""
    return StoreError("PostgreSQL ledger is closed")
