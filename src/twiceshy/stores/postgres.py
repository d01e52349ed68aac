"""``postgresql://user@host/db``: a ledger shared by processes and machines, on PostgreSQL.

Uses psycopg 3 and psycopg_pool (the ``postgres`` extra). :class:`PostgresStore` blocks,
:class:`AsyncPostgresStore` awaits; both run the same SQL and turn rows into records with the
same functions. Each operation is written once, as a generator that yields the statements to run
and decides what their rows mean (:func:`_claim_op`, :func:`_write_op`, ...); the two classes
only carry the statements to the server.

What a claim means:
    A claim is one statement (``INSERT … ON CONFLICT (namespace, key) DO UPDATE … WHERE <the
    existing record has expired>``), run in autocommit under READ COMMITTED, so it is its own
    transaction. The primary key admits one row per key and the conflict clause replaces a row
    only when it is past its retention, so two callers can never both win a fence. Every later
    write is one conditional ``UPDATE`` on fence, state, owner and lease. A claim answered
    ``won=True`` has been committed.

Durability, replication and failover:
    With ``synchronous_commit = on`` (PostgreSQL's default) a committed claim is on disk on the
    primary before the store answers, so it survives a crash or power loss of that server.
    With ``synchronous_commit = off`` a server crash can forget the last few hundred
    milliseconds of claims and outcomes, and a retry after the restart may run the work
    again. A claim is on a replica only when the replica is synchronous: with asynchronous
    replication (or ``synchronous_commit = local``) a failover to a replica that had not yet
    received a claim loses it, and a retry on the promoted server runs the work a second time.
    For a ledger that must survive failover, keep ``synchronous_commit = on`` (or
    ``remote_apply``) with ``synchronous_standby_names`` naming the standbys that may be
    promoted.

Clock:
    With ``clock=None`` (the default) every "now" is the server's clock, read once per
    statement inside the statement itself; clients' clocks are never used. A ``clock`` callable
    (tests) is passed to the same statements instead.

Waiting:
    An outcome is announced with ``NOTIFY`` in the transaction that records it, so the
    announcement is sent exactly when the write commits. A waiter registers before it reads the
    record; the store's listener connection wakes every registered waiter once it is
    ``LISTEN``-ing (and again after each reconnect), so every write committed after a waiter's
    last read is either announced to it or followed by a fresh read: no wake-up is lost. The
    blocking store keeps one listener connection and thread per store object; the async store
    one listener task per event loop. The record is also read again every ``wait_recheck``
    seconds, and polled while no listener is connected, so a lost notification cannot strand a
    waiter. Every wait is bounded by its timeout.

Connections:
    A pool per store (per event loop for the async store), connections in autocommit mode at
    READ COMMITTED. A connection lost during a claim or a write is retried once on a healthy
    connection: the claim statement recognises its own owner token, and a write that may have
    committed is recognised by the record it left (or applied again: it is guarded, so it cannot
    apply twice). A renewal or an in-place attempt count is simply applied again, so an
    attempt may be counted twice after such a loss. A second failure raises
    :class:`~twiceshy.StoreUnavailable`. A store used after :func:`os.fork` opens new
    connections in the child and never touches its parent's.

    A server that stops answering mid-statement (a network partition) is given up after about
    30 s: every connection sets libpq's ``keepalives*`` and ``tcp_user_timeout`` parameters,
    unless the URL sets them itself. These act at the TCP level only: a proxy or pooler in
    between that hangs while its own TCP stack still answers is not detected by them. The URL's
    own libpq parameters (``connect_timeout``, ``application_name`` included) always win over
    the store's keyword arguments.

The table (``twiceshy.records`` by default, with ``records_meta`` beside it) is created on first
use, serialized between processes by an advisory lock; its schema version is checked on open.
With ``create=False`` nothing is created: where the schema holds no such tables the store raises
:class:`~twiceshy.LedgerNotFound` having only read the catalogs; a ledger that is there
is checked, and migrated from version 1, as on every open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import selectors
import socket
import threading
import time
import weakref
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Final, TypeVar
from urllib.parse import unquote

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from .._records import (
    FINAL_STATES,
    Change,
    Effect,
    Record,
    Snapshot,
    State,
    guard_holds,
    is_live,
)
from ..errors import LedgerNotFound, StoreError, StoreUnavailable

__all__ = ["AsyncPostgresStore", "PostgresStore", "open_postgres"]

SCHEMA_VERSION: Final = 2
"""The table layout this version reads. Version 1 had the listing index on (namespace,
created_at), which the planner could pick for a key lookup on a young table (scanning the whole
namespace); version 2 lists by (created_at) alone, so only the primary key serves a lookup."""

# --------------------------------------------------------------------------------------------
# SQL. Every statement the stores run is here. Values are always bound; the schema, table and
# channel names are quoted with psycopg.sql.Identifier; only enum values and the fixed column
# list are spliced in, at import time. ``{t}`` is the records table, ``{meta}`` its meta table.
# --------------------------------------------------------------------------------------------

_COLUMNS: Final = (
    "namespace, key, fingerprint, tool, effect, state, fence, owner, lease_deadline, attempts, "
    "result, error, reason, created_at, updated_at, expires_at"
)
_STATE_VALUES: Final = ", ".join(f"'{s.value}'" for s in State)
_EFFECT_VALUES: Final = ", ".join(f"'{e.value}'" for e in Effect)
_FINAL_VALUES: Final = ", ".join(f"'{s.value}'" for s in State if s in FINAL_STATES)
_CLAIMED: Final = f"'{State.CLAIMED.value}'"

# One advisory lock for every twiceshy schema change on a server ("twiceshy" as 8 bytes).
_SCHEMA_LOCK: Final = int.from_bytes(b"twiceshy", "big")

# The store's clock, read once per statement: a MATERIALIZED CTE with a volatile function is
# evaluated exactly once. A bound %(now)s (a test's clock) takes its place when given.
_NOW: Final = (
    "c AS MATERIALIZED (SELECT COALESCE(%(now)s::float8, "
    "extract(epoch FROM clock_timestamp())::float8) AS now)"
)

# Whether the ledger is there (its meta and records tables), and whether it is complete (the
# counts table, which ledgers made before it lack): a read of the catalogs only.
_EXISTS: Final = (
    "SELECT to_regclass(%(meta)s) IS NOT NULL AND to_regclass(%(t)s) IS NOT NULL,"
    " to_regclass(%(counts)s) IS NOT NULL"
)

# One transaction, serialized between processes by the advisory lock: concurrent
# CREATE ... IF NOT EXISTS can otherwise fail on the catalogs' unique indexes. READ COMMITTED
# whatever the server's, role's or URL's default: a stricter level takes its snapshot before
# the lock is granted, and the loser of a race then fails on the winner's rows (a serialization
# failure) instead of seeing them.
_CREATE: Final = f"""
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_advisory_xact_lock({_SCHEMA_LOCK});
CREATE SCHEMA IF NOT EXISTS {{schema}};
CREATE TABLE IF NOT EXISTS {{meta}} (
    name  text PRIMARY KEY,
    value text NOT NULL
);
INSERT INTO {{meta}} (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}')
ON CONFLICT (name) DO NOTHING;
CREATE TABLE IF NOT EXISTS {{t}} (
    namespace      text             NOT NULL,
    key            text             NOT NULL,
    fingerprint    text             NOT NULL,
    tool           text             NOT NULL,
    effect         text             NOT NULL CHECK (effect IN ({_EFFECT_VALUES})),
    state          text             NOT NULL CHECK (state IN ({_STATE_VALUES})),
    fence          bigint           NOT NULL,
    owner          text             NOT NULL,
    lease_deadline double precision,
    attempts       integer          NOT NULL,
    result         text,
    error          text,
    reason         text,
    created_at     double precision NOT NULL,
    updated_at     double precision NOT NULL,
    expires_at     double precision,
    PRIMARY KEY (namespace, key)
);
CREATE INDEX IF NOT EXISTS {{by_time}} ON {{t}} (created_at);
CREATE INDEX IF NOT EXISTS {{by_expiry}} ON {{t}} (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS {{counts}} (
    namespace text   NOT NULL,
    tool      text   NOT NULL,
    outcome   text   NOT NULL,
    count     bigint NOT NULL,
    PRIMARY KEY (namespace, tool, outcome)
);
COMMIT;
"""

_SELECT_VERSION: Final = "SELECT value FROM {meta} WHERE name = 'schema_version'"

# Version 1 to 2: the listing index no longer leads with the namespace (see SCHEMA_VERSION), and
# the call counts table (created by _CREATE's IF NOT EXISTS before this runs). READ COMMITTED
# as _CREATE is.
_MIGRATE_1_2: Final = f"""
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_advisory_xact_lock({_SCHEMA_LOCK});
DROP INDEX IF EXISTS {{old_by_created}};
CREATE INDEX IF NOT EXISTS {{by_time}} ON {{t}} (created_at);
UPDATE {{meta}} SET value = '2' WHERE name = 'schema_version' AND value = '1';
COMMIT;
"""

# Claim in one statement. ``cur`` reads the key's record in the statement's snapshot; only when
# it shows no live record is the INSERT attempted, so a replay is a plain read (no row lock, no
# transaction id, no WAL). The conflict clause replaces a record only when it is past its
# retention, with fence + 1. When the INSERT meets a row committed after the snapshot (a racing
# claimer), neither part answers a live record; the caller then runs the statement again.
_CLAIM: Final = f"""
WITH {_NOW},
cur AS (
    SELECT {_COLUMNS} FROM {{t}} WHERE namespace = %(namespace)s AND key = %(key)s
),
ins AS (
    INSERT INTO {{t}} AS t ({_COLUMNS})
    SELECT %(namespace)s, %(key)s, %(fingerprint)s, %(tool)s, %(effect)s, {_CLAIMED}, 1,
           %(owner)s, c.now + %(lease)s::float8, 1, NULL, NULL, NULL, c.now, c.now, NULL
    FROM c
    WHERE NOT EXISTS (SELECT FROM cur WHERE cur.expires_at IS NULL OR cur.expires_at > c.now)
    ON CONFLICT (namespace, key) DO UPDATE SET
        fingerprint    = excluded.fingerprint,
        tool           = excluded.tool,
        effect         = excluded.effect,
        state          = excluded.state,
        fence          = t.fence + 1,
        owner          = excluded.owner,
        lease_deadline = excluded.lease_deadline,
        attempts       = excluded.attempts,
        result         = NULL,
        error          = NULL,
        reason         = NULL,
        created_at     = excluded.created_at,
        updated_at     = excluded.updated_at,
        expires_at     = NULL
    WHERE t.expires_at IS NOT NULL AND t.expires_at <= excluded.created_at
    RETURNING {_COLUMNS}
)
SELECT c.now, x.* FROM c LEFT JOIN (
    SELECT true AS won, {_COLUMNS} FROM ins
    UNION ALL
    SELECT false, {_COLUMNS} FROM cur WHERE NOT EXISTS (SELECT FROM ins)
) AS x ON true
"""

# One guarded compare-and-set, setting exactly what ``apply_change`` sets; values that depend
# only on the change are computed in Python (_write_params). When it applies and the record
# leaves "CLAIMED under this fence", pg_notify wakes the waiters when the write commits. When it
# does not apply, the record is answered as the statement's snapshot shows it.
_WRITE: Final = f"""
WITH {_NOW},
w AS (
    UPDATE {{t}} AS t SET
        state          = %(to)s,
        fence          = t.fence + %(bump)s,
        owner          = COALESCE(%(new_owner)s::text, t.owner),
        lease_deadline = CASE WHEN %(to_claimed)s
                              THEN COALESCE(c.now + %(lease)s::float8, t.lease_deadline) END,
        attempts       = t.attempts + %(add_attempts)s,
        result         = %(result)s::text,
        error          = %(error)s::text,
        reason         = %(reason)s::text,
        updated_at     = c.now,
        expires_at     = c.now + %(ttl)s::float8
    FROM c
    WHERE t.namespace = %(namespace)s
      AND t.key = %(key)s
      AND t.fence = %(fence)s
      AND t.state = ANY(%(states)s::text[])
      AND (%(owner)s::text IS NULL OR t.owner = %(owner)s::text)
      AND (NOT %(lapsed)s OR t.lease_deadline <= c.now)
      AND (t.expires_at IS NULL OR t.expires_at > c.now)
    RETURNING {", ".join(f"t.{name}" for name in _COLUMNS.split(", "))},
        CASE WHEN %(wake)s THEN pg_notify(%(channel)s, %(payload)s) END AS notified
)
SELECT c.now, x.* FROM c LEFT JOIN (
    SELECT true AS won, {_COLUMNS} FROM w
    UNION ALL
    SELECT false, {_COLUMNS} FROM {{t}}
    WHERE namespace = %(namespace)s AND key = %(key)s AND NOT EXISTS (SELECT FROM w)
) AS x ON true
"""

_GET: Final = f"""
WITH {_NOW}
SELECT c.now, x.* FROM c LEFT JOIN (
    SELECT {_COLUMNS} FROM {{t}} WHERE namespace = %(namespace)s AND key = %(key)s
) AS x ON true
"""

_RECORDS: Final = f"""
WITH {_NOW}
SELECT {_COLUMNS} FROM {{t}}, c
WHERE namespace = %(namespace)s
  AND (expires_at IS NULL OR expires_at > c.now)
  AND (%(states)s::text[] IS NULL OR state = ANY(%(states)s::text[]))
  AND (%(tool)s::text IS NULL OR tool = %(tool)s::text)
ORDER BY created_at DESC, key
LIMIT %(limit)s::bigint
"""

_PURGE: Final = f"""
WITH {_NOW},
d AS (
    DELETE FROM {{t}} AS t USING c
    WHERE t.expires_at IS NOT NULL
      AND t.expires_at <= c.now
      AND t.state IN ({_FINAL_VALUES})
      AND (%(namespace)s::text IS NULL OR t.namespace = %(namespace)s::text)
    RETURNING 1
)
SELECT count(*) FROM d
"""

# Call counts: one statement adds every (tool, outcome) count of a flush, or none.
_ADD_COUNTS: Final = """
INSERT INTO {counts} AS c (namespace, tool, outcome, count)
SELECT %(namespace)s, t, o, n
FROM unnest(%(tools)s::text[], %(outcomes)s::text[], %(counts)s::bigint[]) AS x (t, o, n)
ON CONFLICT (namespace, tool, outcome) DO UPDATE SET count = c.count + excluded.count
"""

_COUNTS: Final = "SELECT tool, outcome, count FROM {counts} WHERE namespace = %(namespace)s"

_LISTEN: Final = "LISTEN {channel}"

# The statements above rely on READ COMMITTED (a conflicting row is re-checked at its latest
# version); a server whose default is stricter would answer serialization failures instead.
_CONFIGURE: Final = "SET default_transaction_isolation TO 'read committed'"

# --------------------------------------------------------------------------------------------

log = logging.getLogger("twiceshy")

_T = TypeVar("_T")
_Rows = list[tuple[Any, ...]]

_NCOLS: Final = 16
_ROUNDS: Final = 3  # a claim or write: at most one lost connection and one fresh look
_MAX_STEPS: Final = 8
_MAX_WAIT_ROUNDS: Final = 100_000
_POLL_FIRST: Final = 0.005  # polling while no listener is connected: 5 ms doubling to 250 ms
_POLL_CAP: Final = 0.25
_RECONNECT_FIRST: Final = 0.05  # the listener reconnects after 50 ms doubling to 2 s
_RECONNECT_CAP: Final = 2.0
_MAX_TABLE_NAME: Final = 48  # leaves room for the index and meta names within 63 bytes

_EFFECTS: Final = {e.value: e for e in Effect}
_STATES: Final = {s.value: s for s in State}

# libpq's TCP settings for every connection whose URL does not set its own. Without them a
# server that silently stops answering (a network partition, a host gone) blocks a claim, a
# write or the listener forever. With them a statement whose bytes go unacknowledged fails
# after tcp_user_timeout (ms), and a connection waiting for an answer over a silent network
# after keepalives_idle + keepalives_count * keepalives_interval seconds: about 30 s either way.
_TCP_DEFAULTS: Final[Mapping[str, int]] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 4,
    "tcp_user_timeout": 30_000,
}

_URL_OPTIONS: Final = {
    "schema": str,
    "table": str,
    "min_size": int,
    "max_size": int,
    "connect_timeout": float,
    "application_name": str,
    "wait_recheck": float,
}


@dataclass(frozen=True, slots=True)
class _Statements:
    """The statements of one table, rendered once (schema and table names quoted)."""

    exists: bytes
    create: bytes
    version: bytes
    migrate_1_2: bytes
    claim: bytes
    write: bytes
    get: bytes
    records: bytes
    purge: bytes
    listen: bytes
    configure: bytes
    add_counts: bytes
    counts: bytes
    channel: str
    names: dict[str, str]

    @classmethod
    def build(cls, schema: str, table: str) -> _Statements:
        """Render every statement for ``schema.table``."""
        if not schema or not table:
            raise ValueError("schema= and table= must not be empty")
        if len(schema.encode()) > 63 or len(table.encode()) > _MAX_TABLE_NAME:
            raise ValueError(
                f"schema= must be at most 63 bytes and table= at most {_MAX_TABLE_NAME}"
            )
        digest = hashlib.blake2b(f"{schema}\0{table}".encode(), digest_size=12).hexdigest()
        channel = f"twiceshy_{digest}"
        names = {
            "schema": sql.Identifier(schema),
            "t": sql.Identifier(schema, table),
            "meta": sql.Identifier(schema, f"{table}_meta"),
            "counts": sql.Identifier(schema, f"{table}_counts"),
            "by_time": sql.Identifier(f"{table}_by_time"),
            "old_by_created": sql.Identifier(schema, f"{table}_by_created"),
            "by_expiry": sql.Identifier(f"{table}_by_expiry"),
            "channel": sql.Identifier(channel),
        }

        def render(template: str, *, bound: bool = True) -> bytes:
            used: dict[str, sql.Composable] = {}
            for name, ident in names.items():
                if "{" + name + "}" in template:
                    text = ident.as_string(None)
                    # In a statement with bound values a literal % must be doubled.
                    used[name] = sql.SQL(text.replace("%", "%%") if bound else text)
            return sql.SQL(template).format(**used).as_bytes(None)

        return cls(
            exists=render(_EXISTS),
            create=render(_CREATE, bound=False),
            version=render(_SELECT_VERSION, bound=False),
            migrate_1_2=render(_MIGRATE_1_2, bound=False),
            claim=render(_CLAIM),
            write=render(_WRITE),
            get=render(_GET),
            records=render(_RECORDS),
            purge=render(_PURGE),
            listen=render(_LISTEN, bound=False),
            configure=render(_CONFIGURE, bound=False),
            add_counts=render(_ADD_COUNTS),
            counts=render(_COUNTS),
            channel=channel,
            names={
                "t": names["t"].as_string(None),
                "meta": names["meta"].as_string(None),
                "counts": names["counts"].as_string(None),
            },
        )


# -- rows and records, shared by both stores -------------------------------------------------


def _record(cols: Sequence[Any]) -> Record | None:
    """A record from the 16 columns in Record's field order; ``None`` for an absent row."""
    if cols[0] is None:
        return None
    try:
        return Record(
            cols[0],
            cols[1],
            cols[2],
            cols[3],
            _EFFECTS[cols[4]],
            _STATES[cols[5]],
            cols[6],
            cols[7],
            cols[8],
            cols[9],
            cols[10],
            cols[11],
            cols[12],
            cols[13],
            cols[14],
            cols[15],
        )
    except (KeyError, TypeError) as exc:
        raise StoreError(
            f"PostgreSQL ledger: unreadable record {cols[0]!r}/{cols[1]!r}: {exc}"
        ) from exc


def _answer(rows: _Rows) -> tuple[float, bool, Record | None]:
    """The (now, applied, record) row of a claim or a write."""
    if len(rows) != 1 or len(rows[0]) != 2 + _NCOLS:
        raise StoreError(f"PostgreSQL ledger: unexpected answer shape {len(rows)} rows")
    row = rows[0]
    return float(row[0]), bool(row[1]), _record(row[2:])


def _payload(namespace: str, key: str) -> str:
    """The NOTIFY payload naming one record: short and fixed-size, whatever the key."""
    text = f"{len(namespace)}:{namespace}:{key}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def _write_params(
    namespace: str, key: str, change: Change, channel: str, payload: str
) -> dict[str, Any]:
    to = change.to
    bump = change.new_owner is not None
    return {
        "namespace": namespace,
        "key": key,
        "fence": change.fence,
        "states": sorted(s.value for s in change.from_states),
        "owner": change.owner,
        "lapsed": change.lapsed,
        "to": to.value,
        "bump": 1 if bump else 0,
        "new_owner": change.new_owner,
        "to_claimed": to is State.CLAIMED,
        "lease": float(change.lease) if change.lease is not None else None,
        "add_attempts": 1 if bump or change.count_attempt else 0,
        "result": change.result if to is State.SUCCEEDED else None,
        "error": change.error if to in (State.FAILED, State.UNKNOWN) else None,
        "reason": change.reason if to is State.UNKNOWN else None,
        "ttl": float(change.ttl) if to in FINAL_STATES and change.ttl is not None else None,
        # Waiters wait for a record to leave "CLAIMED under its fence"; a renewal does not.
        "wake": to is not State.CLAIMED or bump,
        "channel": channel,
        "payload": payload,
    }


def _shows(record: Record, change: Change) -> bool:
    """Whether ``record`` is what ``change`` leaves behind (a write that may have committed)."""
    bump = change.new_owner is not None
    if change.to is State.CLAIMED and not bump:
        # A renewal or an in-place attempt leaves a record its guard still accepts: it is
        # applied again rather than recognised.
        return False
    if record.state is not change.to or record.fence != change.fence + (1 if bump else 0):
        return False
    owner = change.new_owner if bump else change.owner
    if owner is not None and record.owner != owner:
        return False
    to = change.to
    return (record.result, record.error, record.reason) == (
        change.result if to is State.SUCCEEDED else None,
        change.error if to in (State.FAILED, State.UNKNOWN) else None,
        change.reason if to is State.UNKNOWN else None,
    )


# -- operations, written once as generators of statements ------------------------------------


@dataclass(frozen=True, slots=True)
class _Step:
    """One statement to run, and whether it answers rows.

    Without ``params`` it is sent with the simple query protocol (a script may hold several
    statements, and a ``%`` in a name needs no doubling).
    """

    query: bytes
    params: Mapping[str, Any] | None = None
    rows: bool = True


class _ConnectionLost(Exception):
    """Thrown into an operation: the connection broke while its statement ran."""


_Op = Generator[_Step, _Rows, _T]
_Now = Callable[[], float | None]


def _retrying(make: Callable[[], _Step]) -> Generator[_Step, _Rows, _Rows]:
    """Run a statement that is safe to repeat; once more on a fresh connection if lost."""
    try:
        return (yield make())
    except _ConnectionLost:
        return (yield make())


def _schema_op(st: _Statements, where: str, *, create: bool) -> _Op[None]:
    # The probe connection is configured as the pooled ones are.
    yield _Step(st.configure, rows=False)
    names = st.names
    rows = yield _Step(
        st.exists, {"meta": names["meta"], "t": names["t"], "counts": names["counts"]}
    )
    there, complete = rows[0]
    if not there and not create:
        raise LedgerNotFound(
            f"no twiceshy ledger at {where}: there is no table {names['t']} with its "
            f"{names['meta']} (a schema or table name mistyped?)"
        )
    if not (there and complete):
        yield _Step(st.create, rows=False)
    rows = yield _Step(st.version)
    found = rows[0][0] if rows else None
    if found == "1":
        yield _Step(st.migrate_1_2, rows=False)
        rows = yield _Step(st.version)
        found = rows[0][0] if rows else None
    if found != str(SCHEMA_VERSION):
        raise StoreError(
            f"PostgreSQL ledger {st.names['t']} has schema version {found!r}; this twiceshy "
            f"reads version {SCHEMA_VERSION}"
        )


def _claim_op(
    st: _Statements,
    now: _Now,
    namespace: str,
    key: str,
    *,
    fingerprint: str,
    tool: str,
    effect: Effect,
    owner: str,
    lease: float,
) -> _Op[Snapshot]:
    params = {
        "namespace": namespace,
        "key": key,
        "fingerprint": fingerprint,
        "tool": tool,
        "effect": effect.value,
        "owner": owner,
        "lease": float(lease),
    }
    lost = False
    for _ in range(_ROUNDS):
        try:
            rows = yield _Step(st.claim, {**params, "now": now()})
        except _ConnectionLost:
            if lost:
                raise
            # The claim may have committed: running it again recognises its own owner token.
            lost = True
            continue
        at, inserted, record = _answer(rows)
        if inserted:
            return Snapshot(record, at, True)
        if record is not None and is_live(record, at):
            return Snapshot(record, at, record.state is State.CLAIMED and record.owner == owner)
        # The INSERT met a row committed after this statement's snapshot: look again.
    raise StoreError(f"PostgreSQL ledger could not settle the claim of {namespace!r}/{key!r}")


def _write_op(
    st: _Statements, now: _Now, namespace: str, key: str, change: Change
) -> _Op[Snapshot]:
    params = _write_params(namespace, key, change, st.channel, _payload(namespace, key))
    lost = looked_again = False
    for _ in range(_ROUNDS):
        try:
            rows = yield _Step(st.write, {**params, "now": now()})
        except _ConnectionLost:
            if lost:
                raise
            # The write may have committed: the next round recognises it, or applies it.
            lost = True
            continue
        at, applied, record = _answer(rows)
        if applied:
            return Snapshot(record, at, True)
        if lost and record is not None and _shows(record, change):
            # Our write committed before the connection broke. It is ours even if its record
            # has expired since (a retention near 0): answered as gone, the caller would claim
            # afresh and run the work a second time.
            return Snapshot(record, at, True)
        live = record if record is not None and is_live(record, at) else None
        if live is None:
            return Snapshot(None, at, False)
        if guard_holds(live, change, at) and not looked_again:
            # The snapshot shows a version the UPDATE did not meet: it waited for a concurrent
            # writer and found the record changed. Look again with a fresh snapshot.
            looked_again = True
            continue
        return Snapshot(live, at, False)
    raise StoreError(f"PostgreSQL ledger could not settle a write of {namespace!r}/{key!r}")


def _get_op(st: _Statements, now: _Now, namespace: str, key: str) -> _Op[Snapshot]:
    rows = yield from _retrying(
        lambda: _Step(st.get, {"namespace": namespace, "key": key, "now": now()})
    )
    if len(rows) != 1 or len(rows[0]) != 1 + _NCOLS:
        raise StoreError("PostgreSQL ledger: unexpected answer to a read")
    at = float(rows[0][0])
    record = _record(rows[0][1:])
    return Snapshot(record if record is not None and is_live(record, at) else None, at)


def _records_op(
    st: _Statements,
    now: _Now,
    namespace: str,
    states: Iterable[State] | None,
    tool: str | None,
    limit: int | None,
) -> _Op[list[Record]]:
    params = {
        "namespace": namespace,
        "states": None if states is None else sorted({s.value for s in states}),
        "tool": tool,
        "limit": None if limit is None else max(limit, 0),
    }
    rows = yield from _retrying(lambda: _Step(st.records, {**params, "now": now()}))
    found = [_record(row) for row in rows]
    return [r for r in found if r is not None]


def _purge_op(st: _Statements, now: _Now, namespace: str | None) -> _Op[int]:
    rows = yield from _retrying(lambda: _Step(st.purge, {"namespace": namespace, "now": now()}))
    return int(rows[0][0])


def _add_counts_op(
    st: _Statements, namespace: str, counts: Mapping[tuple[str, str], int]
) -> _Op[None]:
    # Not repeated after a lost connection (the statement may have committed): the error goes
    # up, and whether to send these counts again is the caller's choice.
    if counts:
        items = sorted(counts.items())
        yield _Step(
            st.add_counts,
            {
                "namespace": namespace,
                "tools": [tool for (tool, _), _ in items],
                "outcomes": [outcome for (_, outcome), _ in items],
                "counts": [n for _, n in items],
            },
            rows=False,
        )


def _counts_op(st: _Statements, namespace: str) -> _Op[dict[tuple[str, str], int]]:
    rows = yield from _retrying(lambda: _Step(st.counts, {"namespace": namespace}))
    return {(tool, outcome): int(n) for tool, outcome, n in rows}


_WaitPlan = Generator[float | None, Snapshot | None, Snapshot]


def _wait_plan(
    fence: int, deadline: float, recheck: float, listening: Callable[[], bool]
) -> _WaitPlan:
    """When to read the record (yields ``None``) and how long to block (yields seconds).

    The driver clears its wake-up flag before every read, so a notification that arrives
    after the read ends the next block at once.
    """
    poll = _POLL_FIRST
    snap: Snapshot | None = None
    for _ in range(_MAX_WAIT_ROUNDS):
        snap = yield None
        assert snap is not None
        record = snap.record
        if record is None or record.state is not State.CLAIMED or record.fence != fence:
            return snap
        left = deadline - time.monotonic()
        if left <= 0:
            return snap
        if listening():
            pause = recheck
        else:
            pause, poll = poll, min(poll * 2, _POLL_CAP)
        yield min(pause, left)
    assert snap is not None
    return snap


# -- errors and settings ---------------------------------------------------------------------


def _store_error(exc: BaseException) -> StoreError:
    """The twiceshy error for a driver error (the caller chains it ``from`` ``exc``)."""
    if isinstance(exc, PoolClosed):
        return StoreError("PostgreSQL ledger is closed")
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return StoreUnavailable(f"PostgreSQL ledger unavailable: {exc}")
    if isinstance(exc, UnicodeError):
        return StoreError(f"PostgreSQL ledger cannot store text that is not UTF-8: {exc}")
    return StoreError(f"PostgreSQL ledger: {exc}")


@dataclass(frozen=True, slots=True)
class _Settings:
    conninfo: str
    kwargs: dict[str, Any]
    schema: str
    table: str
    min_size: int
    max_size: int
    connect_timeout: float
    recheck: float
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
    ) -> _Settings:
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
            **_TCP_DEFAULTS,
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


def _clock_fn(clock: Callable[[], float] | None) -> _Now:
    if clock is None:
        return lambda: None
    return lambda: float(clock())


def _settled(op: _Op[_T], value: BaseException | _Rows) -> _Step:
    """Send rows, or throw a lost connection, into an operation; its next step."""
    if isinstance(value, BaseException):
        try:
            return op.throw(_ConnectionLost(str(value)))
        except _ConnectionLost:
            raise _store_error(value) from value
    return op.send(value)


# -- the blocking store ----------------------------------------------------------------------


def _run_sync(op: _Op[_T], execute: Callable[[_Step], _Rows], heal: Callable[[], None]) -> _T:
    """Drive an operation: run each step; a connection lost mid-step is thrown into it."""
    try:
        step = next(op)
        for _ in range(_MAX_STEPS):
            try:
                rows: BaseException | _Rows = execute(step)
            except psycopg.OperationalError as exc:
                heal()
                rows = exc
            step = _settled(op, rows)
    except StopIteration as stop:
        result: _T = stop.value
        return result
    finally:
        op.close()
    raise StoreError("PostgreSQL ledger: an operation did not finish")


def _execute_sync(conn: psycopg.Connection[TupleRow], step: _Step) -> _Rows:
    """Run one step; OperationalError passes up (the driver retries), others become StoreError."""
    try:
        cur = conn.execute(step.query, step.params)
        return cur.fetchall() if step.rows else []
    except psycopg.OperationalError:
        raise
    except (psycopg.Error, UnicodeError) as exc:
        raise _store_error(exc) from exc


class _Listener:
    """One LISTEN connection and thread, dispatching notifications to the store's waiters."""

    def __init__(self, settings: _Settings, listen: bytes) -> None:
        self._settings = settings
        self._listen = listen
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        #: Set while the connection is LISTEN-ing.
        self.ready = threading.Event()

    def watch(self, payload: str) -> threading.Event:
        """Register a waiter for one record; start the listener thread if needed."""
        event = threading.Event()
        with self._lock:
            if self._closed:
                raise StoreError("PostgreSQL ledger is closed")
            self._waiters.setdefault(payload, set()).add(event)
            if self._thread is None or not self._thread.is_alive():
                self._wake_r, self._wake_w = socket.socketpair()
                self._thread = threading.Thread(
                    target=self._run, name="twiceshy-postgres-listener", daemon=True
                )
                self._thread.start()
        return event

    def unwatch(self, payload: str, event: threading.Event) -> None:
        """Forget a waiter."""
        with self._lock:
            events = self._waiters.get(payload)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[payload]

    def dispatch(self, payload: str) -> None:
        """Wake the waiters of one record."""
        with self._lock:
            events = list(self._waiters.get(payload, ()))
        for event in events:
            event.set()

    def _wake_all(self) -> None:
        with self._lock:
            events = [e for group in self._waiters.values() for e in group]
        for event in events:
            event.set()

    def close(self) -> None:
        """Stop the thread and close its connection; wake every waiter (idempotent)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if self._wake_w is not None:
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"\0")
        self._wake_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._settings.connect_timeout + 5.0)

    def _run(self) -> None:
        wake = self._wake_r
        assert wake is not None
        delay = _RECONNECT_FIRST
        try:
            # Runs for the store's lifetime; every round is bounded by a connect timeout or a
            # pause, and close() ends it.
            while not self._closed:
                try:
                    conn = psycopg.connect(self._settings.conninfo, **self._settings.kwargs)
                except psycopg.Error:
                    log.debug("twiceshy: PostgreSQL listener cannot connect", exc_info=True)
                else:
                    try:
                        conn.execute(self._listen)
                        self.ready.set()
                        # Notifications sent while nobody listened are lost: look again.
                        self._wake_all()
                        delay = _RECONNECT_FIRST
                        self._pump(conn.pgconn, wake)
                    except psycopg.Error:
                        log.debug("twiceshy: PostgreSQL listener lost", exc_info=True)
                    finally:
                        self.ready.clear()
                        conn.close()
                if self._closed:
                    return
                self._wake_all()
                with selectors.DefaultSelector() as sel:
                    sel.register(wake, selectors.EVENT_READ)
                    sel.select(delay)
                delay = min(delay * 2, _RECONNECT_CAP)
        finally:
            with self._lock:
                for sock in (self._wake_r, self._wake_w):
                    if sock is not None:
                        sock.close()
                self._wake_r = self._wake_w = None

    def _pump(self, pgconn: pq.abc.PGconn, wake: socket.socket) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(pgconn.socket, selectors.EVENT_READ, "pg")
            sel.register(wake, selectors.EVENT_READ, "wake")
            while not self._closed:
                events = sel.select(60.0)
                if any(key.data == "wake" for key, _ in events):
                    return
                if not events:
                    continue
                pgconn.consume_input()
                while (notify := pgconn.notifies()) is not None:
                    self.dispatch(notify.extra.decode())
                if pgconn.status != pq.ConnStatus.OK:
                    raise psycopg.OperationalError("listener connection lost")


class PostgresStore:
    """A :class:`~twiceshy.stores.Store` in a PostgreSQL table, blocking.

    Args:
        url: a libpq connection string or ``postgresql://`` URL (psycopg's parameters only;
            :func:`open_postgres` reads twiceshy's own URL parameters).
        schema: the schema holding the table; created on first use.
        table: the records table; ``<table>_meta`` holds its schema version.
        clock: the store's clock for tests; ``None`` uses the server's clock.
        min_size: connections the pool keeps open.
        max_size: the most connections the pool opens.
        connect_timeout: seconds to wait for a connection (libpq rounds the connect itself up to
            whole seconds, at least 2; a ``connect_timeout`` in ``url`` sets libpq's instead).
        application_name: the ``application_name`` of every connection of this store, unless
            ``url`` names its own.
        wait_recheck: how often a waiter reads the record again even without a notification.
        create: create the schema and tables where there are none; ``False`` to open only a
            ledger that exists (a version 1 ledger is still migrated, as on every open).

    Raises:
        StoreUnavailable: the server cannot be reached.
        LedgerNotFound: with ``create=False``, the schema holds no such ledger.
        StoreError: the table is not a twiceshy ledger this version can use.
        ValueError: a setting is out of range.
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
        self._settings = _Settings.make(
            url,
            schema=schema,
            table=table,
            min_size=min_size,
            max_size=max_size,
            connect_timeout=connect_timeout,
            application_name=application_name,
            wait_recheck=wait_recheck,
        )
        self._st = _Statements.build(schema, table)
        self._now = _clock_fn(clock)
        self._closed = False
        self._lock = threading.Lock()
        self._abandoned: list[object] = []
        # Fail fast: a ledger that cannot be reached must not let a tool run unprotected.
        try:
            probe = psycopg.connect(self._settings.conninfo, **self._settings.kwargs)
        except psycopg.Error as exc:
            raise StoreUnavailable(
                f"PostgreSQL ledger at {self._settings.where} cannot be reached: {exc}"
            ) from exc
        schema_op = _schema_op(self._st, self._settings.where, create=create)
        with probe:
            _run_sync(schema_op, lambda step: _execute_sync(probe, step), _no_heal)
        self._pid = os.getpid()
        self._pool = self._new_pool()
        self._listener = _Listener(self._settings, self._st.listen)

    def __repr__(self) -> str:
        return f"PostgresStore({self._settings.where!r}, table={self._st.names['t']!r})"

    def _new_pool(self) -> ConnectionPool[psycopg.Connection[TupleRow]]:
        configure = self._st.configure

        def setup(conn: psycopg.Connection[TupleRow]) -> None:
            conn.execute(configure)

        s = self._settings
        pool: ConnectionPool[psycopg.Connection[TupleRow]] = ConnectionPool(
            s.conninfo,
            kwargs=s.kwargs,
            min_size=s.min_size,
            max_size=s.max_size,
            open=False,
            configure=setup,
            timeout=s.connect_timeout,
            name=f"twiceshy:{s.schema}.{s.table}",
        )
        # Waiting here means the pool's workers are idle when the store is handed out: they
        # draw from the global random module, which tests (hypothesis) watch.
        try:
            pool.open(wait=True, timeout=s.connect_timeout)
        except PoolTimeout as exc:
            raise _store_error(exc) from exc
        return pool

    def _live(self) -> tuple[ConnectionPool[psycopg.Connection[TupleRow]], _Listener]:
        if self._closed:
            raise StoreError("PostgreSQL ledger is closed")
        if os.getpid() != self._pid:
            with self._lock:
                if os.getpid() != self._pid:
                    # A forked child never uses (nor closes) its parent's connections; they
                    # are kept referenced so that collecting them does nothing either.
                    self._abandoned += [self._pool, self._listener]
                    self._pool = self._new_pool()
                    self._listener = _Listener(self._settings, self._st.listen)
                    self._pid = os.getpid()
        return self._pool, self._listener

    def _run(self, op: _Op[_T]) -> _T:
        pool, _ = self._live()

        def execute(step: _Step) -> _Rows:
            # getconn/putconn rather than pool.connection(): every statement runs in autocommit,
            # so the connection's own commit-on-exit has nothing to do, and costs ~10 us.
            # putconn() discards a connection left broken or inside a transaction.
            try:
                conn = pool.getconn(timeout=self._settings.connect_timeout)
            except (PoolTimeout, PoolClosed) as exc:
                raise _store_error(exc) from exc
            try:
                return _execute_sync(conn, step)
            finally:
                pool.putconn(conn)

        def heal() -> None:
            # Replace the pool's broken connections before the one retry.
            try:
                pool.check()
            except Exception:
                log.debug("twiceshy: PostgreSQL pool check failed", exc_info=True)

        return _run_sync(op, execute, heal)

    # -- the Store protocol -----------------------------------------------------------------

    def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
    ) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`. One round trip, a replay included."""
        return self._run(
            _claim_op(
                self._st,
                self._now,
                namespace,
                key,
                fingerprint=fingerprint,
                tool=tool,
                effect=effect,
                owner=owner,
                lease=lease,
            )
        )

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`. One round trip."""
        snap = self._run(_write_op(self._st, self._now, namespace, key, change))
        if snap.won:
            # Our own waiters need not wait for the server to echo the notification.
            self._listener.dispatch(_payload(namespace, key))
        return snap

    def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        return self._run(_get_op(self._st, self._now, namespace, key))

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`.

        Wakes on the ``NOTIFY`` of the write that settles the record; reads it again every
        ``wait_recheck`` seconds regardless, and polls while no listener is connected.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout <= 0:
            return self.get(namespace, key)
        _, listener = self._live()
        payload = _payload(namespace, key)
        event = listener.watch(payload)
        try:
            # Registered before reading: once the listener is LISTEN-ing (it wakes every waiter
            # when it is), a write committed after a read is announced to this waiter.
            plan = _wait_plan(fence, deadline, self._settings.recheck, listener.ready.is_set)
            command = next(plan)
            for _ in range(2 * _MAX_WAIT_ROUNDS):
                if command is None:
                    event.clear()
                    command = plan.send(self.get(namespace, key))
                else:
                    event.wait(command)
                    command = plan.send(None)
        except StopIteration as stop:
            snap: Snapshot = stop.value
            return snap
        finally:
            listener.unwatch(payload, event)
        return self.get(namespace, key)

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        return self._run(_records_op(self._st, self._now, namespace, states, tool, limit))

    def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        return self._run(_purge_op(self._st, self._now, namespace))

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """See :meth:`twiceshy.stores.CallCounts.add_counts`: one statement."""
        self._run(_add_counts_op(self._st, namespace, counts))

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """See :meth:`twiceshy.stores.CallCounts.counts`."""
        return self._run(_counts_op(self._st, namespace))

    def close(self) -> None:
        """Close the pool and the listener (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return  # the connections are the parent's
        self._listener.close()
        self._pool.close()


def _no_heal() -> None:
    """Nothing to repair: a lost probe connection is not retried."""


# -- the async store -------------------------------------------------------------------------


async def _run_async(
    op: _Op[_T],
    execute: Callable[[_Step], Awaitable[_Rows]],
    heal: Callable[[], Awaitable[None]],
) -> _T:
    """The async twin of :func:`_run_sync`."""
    try:
        step = next(op)
        for _ in range(_MAX_STEPS):
            try:
                rows: BaseException | _Rows = await execute(step)
            except psycopg.OperationalError as exc:
                await heal()
                rows = exc
            step = _settled(op, rows)
    except StopIteration as stop:
        result: _T = stop.value
        return result
    finally:
        op.close()
    raise StoreError("PostgreSQL ledger: an operation did not finish")


async def _execute_async(conn: psycopg.AsyncConnection[TupleRow], step: _Step) -> _Rows:
    """The async twin of :func:`_execute_sync`."""
    try:
        cur = await conn.execute(step.query, step.params)
        return await cur.fetchall() if step.rows else []
    except psycopg.OperationalError:
        raise
    except (psycopg.Error, UnicodeError) as exc:
        raise _store_error(exc) from exc


class _LoopState:
    """An async store's pool, listener task and waiters in one event loop."""

    def __init__(
        self,
        pool: AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]],
        conns: weakref.WeakSet[psycopg.AsyncConnection[TupleRow]],
    ) -> None:
        self.pool = pool
        #: Every connection the pool has opened and not yet dropped, so that they can be closed
        #: even when the pool can no longer close them itself (see release).
        self.conns = conns
        self.opened = False
        self.lock = asyncio.Lock()
        self.waiters: dict[str, set[asyncio.Event]] = {}
        self.ready = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        #: Why opening failed: the calls that waited for that open fail alike.
        self.failure: StoreError | None = None
        #: Closes this state when its loop shuts down (see _close_with_loop).
        self.guard: AsyncGenerator[None, None] | None = None

    def watch(self, payload: str) -> asyncio.Event:
        event = asyncio.Event()
        self.waiters.setdefault(payload, set()).add(event)
        return event

    def unwatch(self, payload: str, event: asyncio.Event) -> None:
        events = self.waiters.get(payload)
        if events is not None:
            events.discard(event)
            if not events:
                del self.waiters[payload]

    def dispatch(self, payload: str) -> None:
        for event in self.waiters.get(payload, ()):
            event.set()

    def wake_all(self) -> None:
        for events in self.waiters.values():
            for event in events:
                event.set()

    async def aclose(self) -> None:
        """Release this state now, ending its guard (idempotent)."""
        guard, self.guard = self.guard, None
        if guard is not None:
            await guard.aclose()
        await self.release()

    async def release(self) -> None:
        """Stop the listener task, close the pool and its connections (idempotent)."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.wake_all()
        try:
            await self.pool.close()
        except asyncio.CancelledError:
            # When a loop shuts down, asyncio.run has cancelled every task, the pool's workers
            # included, before it ends async generators (_close_with_loop): close() then fails
            # waiting for those workers, before it closes a single connection.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        finally:
            for conn in list(self.conns):
                await conn.close()


async def _close_with_loop(state: _LoopState) -> AsyncGenerator[None, None]:
    """An async generator whose end closes ``state``.

    Event loops close the async generators started on them when they shut down
    (``asyncio.run`` does), so a pool left open by its user is closed on its own loop, where its
    connections live. Dropped with its loop instead, its connections would stay open on the
    server until collected: one more with every ``asyncio.run``.
    """
    try:
        yield
    finally:
        await state.release()


class AsyncPostgresStore:
    """A :class:`~twiceshy.stores.AsyncStore` in a PostgreSQL table; see :class:`PostgresStore`.

    Takes the same arguments. Nothing connects in the constructor: each event loop gets its own
    pool and listener task on first use (psycopg's async pool lives in one loop), closed when
    that loop shuts down (``asyncio.run`` does this) or by :meth:`close`. The server is
    first reached, and the table created, on the first call; an unreachable server then raises
    :class:`~twiceshy.StoreUnavailable`.
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
        self._settings = _Settings.make(
            url,
            schema=schema,
            table=table,
            min_size=min_size,
            max_size=max_size,
            connect_timeout=connect_timeout,
            application_name=application_name,
            wait_recheck=wait_recheck,
        )
        self._st = _Statements.build(schema, table)
        self._now = _clock_fn(clock)
        self._closed = False
        self._create = create
        self._schema_ready = False
        # Not a WeakKeyDictionary: a state holds its loop through its tasks and locks, so its
        # entry would never go. States of closed loops are dropped when a new loop comes.
        self._states: dict[asyncio.AbstractEventLoop, _LoopState] = {}

    def __repr__(self) -> str:
        return f"AsyncPostgresStore({self._settings.where!r}, table={self._st.names['t']!r})"

    async def _connect(self) -> psycopg.AsyncConnection[TupleRow]:
        try:
            return await psycopg.AsyncConnection.connect(
                self._settings.conninfo, **self._settings.kwargs
            )
        except psycopg.Error as exc:
            raise StoreUnavailable(
                f"PostgreSQL ledger at {self._settings.where} cannot be reached: {exc}"
            ) from exc

    async def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        for _ in range(_ROUNDS):
            if self._closed:
                raise StoreError("PostgreSQL ledger is closed")
            state = self._states.get(loop)
            if state is None:
                for gone in [other for other in self._states if other.is_closed()]:
                    # Closed when its loop shut down (see _close_with_loop).
                    del self._states[gone]
                conns: weakref.WeakSet[psycopg.AsyncConnection[TupleRow]] = weakref.WeakSet()
                state = self._states[loop] = _LoopState(self._new_pool(conns), conns)
                guard = _close_with_loop(state)
                await anext(guard)  # runs to its yield without suspending
                state.guard = guard
            if state.opened:
                return state
            async with state.lock:
                if state.failure is not None:
                    # The open this call waited for failed: its pool is closed. Fail alike
                    # (a fresh error: one exception object is not raised in many tasks).
                    failure = state.failure
                    raise type(failure)(str(failure)) from failure
                if self._states.get(loop) is not state:
                    continue  # replaced meanwhile: start afresh
                if not state.opened:
                    try:
                        await self._open(state)
                    except Exception as exc:
                        mapped = exc if isinstance(exc, StoreError) else _store_error(exc)
                        state.failure = mapped
                        # The next call in this loop starts afresh.
                        if self._states.get(loop) is state:
                            del self._states[loop]
                        await state.aclose()
                        if mapped is exc:
                            raise
                        raise mapped from exc
                    state.opened = True
            return state
        raise StoreError("PostgreSQL ledger could not open its pool")

    async def _open(self, state: _LoopState) -> None:
        """Check the table (once per store) and open this loop's pool."""
        if not self._schema_ready:
            conn = await self._connect()
            async with conn:
                schema_op = _schema_op(self._st, self._settings.where, create=self._create)
                await _run_async(schema_op, lambda step: _execute_async(conn, step), _no_aheal)
            self._schema_ready = True
        # On a timeout psycopg closes the pool.
        await state.pool.open(wait=True, timeout=self._settings.connect_timeout)

    def _new_pool(
        self, conns: weakref.WeakSet[psycopg.AsyncConnection[TupleRow]]
    ) -> AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]]:
        configure = self._st.configure

        async def setup(conn: psycopg.AsyncConnection[TupleRow]) -> None:
            conns.add(conn)
            await conn.execute(configure)

        s = self._settings
        pool: AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]] = AsyncConnectionPool(
            s.conninfo,
            kwargs=s.kwargs,
            min_size=s.min_size,
            max_size=s.max_size,
            open=False,
            configure=setup,
            timeout=s.connect_timeout,
            name=f"twiceshy:{s.schema}.{s.table}",
        )
        return pool

    async def _run(self, op: _Op[_T]) -> _T:
        try:
            state = await self._state()
        except BaseException:
            op.close()
            raise
        pool = state.pool

        async def execute(step: _Step) -> _Rows:
            # As in the blocking store: autocommit, so no commit-on-exit.
            try:
                conn = await pool.getconn(timeout=self._settings.connect_timeout)
            except (PoolTimeout, PoolClosed) as exc:
                raise _store_error(exc) from exc
            try:
                return await _execute_async(conn, step)
            finally:
                await pool.putconn(conn)

        async def heal() -> None:
            try:
                await pool.check()
            except Exception:
                log.debug("twiceshy: PostgreSQL pool check failed", exc_info=True)

        return await _run_async(op, execute, heal)

    async def _listen(self, state: _LoopState) -> None:
        """The loop's listener task: LISTEN, dispatch, reconnect; cancelled by close()."""
        delay = _RECONNECT_FIRST
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._settings.conninfo, **self._settings.kwargs
                )
            except psycopg.Error:
                log.debug("twiceshy: PostgreSQL listener cannot connect", exc_info=True)
            else:
                try:
                    await conn.execute(self._st.listen)
                    state.ready.set()
                    state.wake_all()
                    delay = _RECONNECT_FIRST
                    async for notify in conn.notifies():
                        state.dispatch(notify.payload)
                except psycopg.Error:
                    log.debug("twiceshy: PostgreSQL listener lost", exc_info=True)
                finally:
                    state.ready.clear()
                    await conn.close()
            state.wake_all()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RECONNECT_CAP)

    # -- the AsyncStore protocol ------------------------------------------------------------

    async def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
    ) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`. One round trip, a replay included."""
        return await self._run(
            _claim_op(
                self._st,
                self._now,
                namespace,
                key,
                fingerprint=fingerprint,
                tool=tool,
                effect=effect,
                owner=owner,
                lease=lease,
            )
        )

    async def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`. One round trip."""
        snap = await self._run(_write_op(self._st, self._now, namespace, key, change))
        if snap.won:
            state = self._states.get(asyncio.get_running_loop())
            if state is not None:
                state.dispatch(_payload(namespace, key))
        return snap

    async def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        return await self._run(_get_op(self._st, self._now, namespace, key))

    async def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`PostgresStore.wait`."""
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout <= 0:
            return await self.get(namespace, key)
        state = await self._state()
        payload = _payload(namespace, key)
        event = state.watch(payload)
        try:
            if state.task is None or state.task.done():
                state.task = asyncio.get_running_loop().create_task(self._listen(state))
            plan = _wait_plan(fence, deadline, self._settings.recheck, state.ready.is_set)
            command = next(plan)
            for _ in range(2 * _MAX_WAIT_ROUNDS):
                if command is None:
                    event.clear()
                    command = plan.send(await self.get(namespace, key))
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(command):
                            await event.wait()
                    command = plan.send(None)
        except StopIteration as stop:
            snap: Snapshot = stop.value
            return snap
        finally:
            state.unwatch(payload, event)
        return await self.get(namespace, key)

    async def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        return await self._run(_records_op(self._st, self._now, namespace, states, tool, limit))

    async def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        return await self._run(_purge_op(self._st, self._now, namespace))

    async def close(self) -> None:
        """Close this loop's pool and listener (idempotent).

        Pools of event loops that have since closed were closed with them; those of loops still
        running in other threads are closed there.
        """
        self._closed = True
        current = asyncio.get_running_loop()
        states = list(self._states.items())
        self._states.clear()
        for loop, state in states:
            if loop is current:
                await state.aclose()
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(state.aclose(), loop)


async def _no_aheal() -> None:
    """See :func:`_no_heal`."""


# -- URLs ------------------------------------------------------------------------------------


def _split_url(url: str) -> tuple[str, dict[str, Any]]:
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

    Besides psycopg's own parameters the URL may carry ``schema``, ``table``, ``min_size``,
    ``max_size``, ``connect_timeout``, ``application_name`` and ``wait_recheck``, e.g.
    ``postgresql://app@db.internal/agents?schema=ledger&table=records``.

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
    conninfo, options = _split_url(url)
    store = PostgresStore(conninfo, create=create, **options)
    twin = AsyncPostgresStore(conninfo, create=create, **options)
    twin._schema_ready = True  # the blocking store has just checked the table
    return store, twin
