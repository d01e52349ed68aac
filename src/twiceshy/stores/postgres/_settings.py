"""What a PostgreSQL store is made of: its checked settings, its statements and its clock.

:class:`Configured` takes the constructor's arguments for both store classes (they are
documented on :class:`~twiceshy.stores.postgres.PostgresStore`), so that the blocking and the
async store are configured by one piece of code; each then opens what it needs in ``_start``,
and both judge alike what they learn of the server (:meth:`Configured._judge`): a connection
pooler in front of it changes how connections are set up and how waiters wake.
:class:`Settings` turns those arguments into psycopg's connection and pool parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ...errors import StoreError
from ._ops import Now, Server
from ._sql import Statements

# libpq's TCP settings for every connection whose URL does not set its own. Without them a
# server that silently stops answering (a network partition, a host gone) blocks a claim, a
# write or the listener forever. With them a statement whose bytes go unacknowledged fails
# after tcp_user_timeout (ms), and a connection waiting for an answer over a silent network
# after keepalives_idle + keepalives_count * keepalives_interval seconds: about 30 s either way.
TCP_DEFAULTS: Final[Mapping[str, int]] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 4,
    "tcp_user_timeout": 30_000,
}

#: How waiters learn that a record settled: ``LISTEN`` (refused behind a pooler unless asked for
#: by name), ``LISTEN`` in any case, or re-reads with backoff only.
WAKEUPS: Final = ("auto", "listen", "poll")

#: The most connections a pool opens (``pool_size=``), and how long a statement waits for one
#: of them to be free when all are in use (``pool_timeout=``, seconds) before the call fails.
POOL_SIZE: Final = 10
POOL_TIMEOUT: Final = 10.0


@dataclass(frozen=True, slots=True)
class Settings:
    """A store's connection settings, checked; the URL's own libpq parameters win."""

    conninfo: str
    #: psycopg's keyword arguments for every connection (autocommit, and the defaults above).
    kwargs: dict[str, Any]
    schema: str
    table: str
    min_size: int
    max_size: int
    connect_timeout: float
    #: How long a statement waits for a free connection of the pool.
    pool_timeout: float
    recheck: float
    wakeups: str
    #: ``host:port/dbname``, for messages (never the password).
    where: str

    @classmethod
    def make(
        cls,
        url: str,
        *,
        schema: str,
        table: str,
        min_size: int,
        max_size: int,
        connect_timeout: float,
        pool_timeout: float,
        application_name: str,
        wait_recheck: float,
        wakeups: str,
    ) -> Settings:
        """Check the arguments and derive the connection parameters."""
        if min_size < 0 or max_size < max(min_size, 1):
            raise ValueError("need 0 <= min_size <= pool_size and pool_size >= 1")
        if wakeups not in WAKEUPS:
            raise ValueError(f"wakeups= must be one of {', '.join(WAKEUPS)}, not {wakeups!r}")
        if not (connect_timeout > 0 and wait_recheck > 0 and pool_timeout > 0):
            raise ValueError("connect_timeout=, pool_timeout= and wait_recheck= must be positive")
        try:
            parts = conninfo_to_dict(url)
        except psycopg.Error as exc:
            raise ValueError(f"not a PostgreSQL connection string: {exc}") from None
        where = "{}:{}/{}".format(
            parts.get("host", "localhost"), parts.get("port", 5432), parts.get("dbname", "")
        )
        defaults = {
            # libpq's own rule: whole seconds, at least 2.
            "connect_timeout": max(2, math.ceil(connect_timeout)),
            "application_name": application_name,
            **TCP_DEFAULTS,
        }
        return cls(
            conninfo=url,
            # psycopg's keyword arguments replace the URL's parameters: a value the URL sets
            # itself is left to it.
            kwargs={"autocommit": True, **{k: v for k, v in defaults.items() if k not in parts}},
            schema=schema,
            table=table,
            min_size=min_size,
            max_size=max_size,
            connect_timeout=float(connect_timeout),
            pool_timeout=float(pool_timeout),
            recheck=float(wait_recheck),
            wakeups=wakeups,
            where=where,
        )

    def pool_options(self) -> dict[str, Any]:
        """The arguments of a connection pool (blocking or async), but ``configure``."""
        return {
            "kwargs": self.kwargs,
            "min_size": self.min_size,
            "max_size": self.max_size,
            "open": False,
            "timeout": self.pool_timeout,
            "name": f"twiceshy:{self.schema}.{self.table}",
        }


def clock_fn(clock: Callable[[], float] | None) -> Now:
    """The ``now`` the statements bind: ``None`` (the server's clock) or the given clock's."""
    if clock is None:
        return lambda: None
    return lambda: float(clock())


class Configured:
    """The part both store classes share: checked settings, rendered statements, the clock.

    The constructor takes the arguments documented on
    :class:`~twiceshy.stores.postgres.PostgresStore`, checks them, and calls ``_start``, where
    each store class opens what it needs (the blocking one connects; the async one waits for
    its first call).
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str = "twiceshy",
        table: str = "records",
        clock: Callable[[], float] | None = None,
        min_size: int = 1,
        pool_size: int | None = None,
        pool_timeout: float = POOL_TIMEOUT,
        connect_timeout: float = 5.0,
        application_name: str = "twiceshy",
        wait_recheck: float = 1.0,
        wakeups: str = "auto",
        create: bool = True,
    ) -> None:
        self._settings = Settings.make(
            url,
            schema=schema,
            table=table,
            min_size=min_size,
            max_size=POOL_SIZE if pool_size is None else pool_size,
            connect_timeout=connect_timeout,
            pool_timeout=pool_timeout,
            application_name=application_name,
            wait_recheck=wait_recheck,
            wakeups=wakeups,
        )
        self._st = Statements.build(schema, table)
        self._now = clock_fn(clock)
        self._closed = False
        #: A pooler answers in the server's place: no session settings, no prepared statements.
        self._pooled = False
        self._start(create=create)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._settings.where!r}, table={self._st.names['t']!r})"

    def _start(self, *, create: bool) -> None:
        """Open what the store needs; ``create`` as in the constructor."""
        raise NotImplementedError

    @property
    def _listens(self) -> bool:
        """Whether waiters are woken by ``LISTEN`` (else they re-read with backoff only)."""
        return self._settings.wakeups != "poll"

    def _judge(self, server: Server) -> None:
        """Take in what the first connection learnt of the server, or refuse to open.

        Behind a pooler in transaction mode each statement may run on another server connection:
        a session's ``LISTEN`` hears nothing (waiters would never be woken), a ``SET`` at connect
        reaches one server connection (and other clients' transactions), and a prepared
        statement is missing on the next. So ``LISTEN`` is refused unless the URL says how to
        wake (``wakeups=poll``, or ``wakeups=listen`` for a pooler in session mode), and the
        isolation level the statements rely on must be the server's default.
        """
        if not server.pooled:
            return
        s = self._settings
        if s.wakeups == "auto":
            raise StoreError(
                f"PostgreSQL ledger at {s.where}: its connections go through a connection "
                "pooler (PgBouncer or another: the server process that answers is not the one "
                "the connection was given), and a pooler in transaction mode does not carry "
                "LISTEN, so waiters would never be woken. Add wakeups=poll to the ledger URL "
                "(waiters then re-read the record with backoff), or wakeups=listen if the "
                "pooler gives each client a server connection of its own (session mode)."
            )
        if server.isolation != "read committed":
            raise StoreError(
                f"PostgreSQL ledger at {s.where}: the server's default_transaction_isolation "
                f"is {server.isolation!r}, and through a connection pooler the ledger cannot "
                "set it per connection. Set it to 'read committed' for the ledger's role "
                "(ALTER ROLE ... SET default_transaction_isolation = 'read committed')."
            )
        self._pooled = True
