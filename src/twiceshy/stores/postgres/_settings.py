"""What a PostgreSQL store is made of: its checked settings, its statements and its clock.

:class:`Configured` takes the constructor's arguments for both store classes (they are
documented on :class:`~twiceshy.stores.postgres.PostgresStore`), so that the blocking and the
async store are configured by one piece of code; each then opens what it needs in ``_start``.
:class:`Settings` turns those arguments into psycopg's connection and pool parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ._ops import Now
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
    recheck: float
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
        application_name: str,
        wait_recheck: float,
    ) -> Settings:
        """Check the arguments and derive the connection parameters."""
        if min_size < 0 or max_size < max(min_size, 1):
            raise ValueError("need 0 <= min_size <= max_size and max_size >= 1")
        if connect_timeout <= 0 or wait_recheck <= 0:
            raise ValueError("connect_timeout= and wait_recheck= must be positive")
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
            recheck=float(wait_recheck),
            where=where,
        )

    def pool_options(self) -> dict[str, Any]:
        """The arguments of a connection pool (blocking or async), but ``configure``."""
        return {
            "kwargs": self.kwargs,
            "min_size": self.min_size,
            "max_size": self.max_size,
            "open": False,
            "timeout": self.connect_timeout,
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
        max_size: int = 10,
        connect_timeout: float = 5.0,
        application_name: str = "twiceshy",
        wait_recheck: float = 1.0,
        create: bool = True,
    ) -> None:
        self._settings = Settings.make(
            url,
            schema=schema,
            table=table,
            min_size=min_size,
            max_size=max_size,
            connect_timeout=connect_timeout,
            application_name=application_name,
            wait_recheck=wait_recheck,
        )
        self._st = Statements.build(schema, table)
        self._now = clock_fn(clock)
        self._closed = False
        self._start(create=create)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._settings.where!r}, table={self._st.names['t']!r})"

    def _start(self, *, create: bool) -> None:
        """Open what the store needs; ``create`` as in the constructor."""
        raise NotImplementedError
