"""Every statement the PostgreSQL stores run, and their rendering for one table.

Values are always bound; the schema, table and channel names are quoted with
:class:`psycopg.sql.Identifier` when a store renders its :class:`Statements`; only enum values and
the fixed column list are spliced into the templates, at import time. In a template ``{t}`` is
the records table, ``{meta}`` its meta table and ``{counts}`` its call counts table. Why each
statement is shaped as it is: ``docs/stores/postgres.md``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from psycopg import sql

from ..._records import FINAL_STATES, Effect, State

SCHEMA_VERSION: Final = 4
"""The table layout this version reads. Version 1 had the listing index on (namespace,
created_at), which the planner could pick for a key lookup on a young table (scanning the whole
namespace); version 2 lists by (created_at) alone, so only the primary key serves a lookup;
version 3 adds the column of each call's arguments (``args``); version 4 the flag a waiter sets
on a claim it waits for (``watched``), so that only a write someone waits for notifies."""

_COLUMNS: Final = (
    "namespace, key, fingerprint, tool, effect, state, fence, owner, lease_deadline, attempts, "
    "result, error, reason, created_at, updated_at, expires_at, args"
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
    args           text,
    watched        boolean          NOT NULL DEFAULT false,
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

# Version 2 to 3: the column of each call's arguments, NULL in the records made before (adding
# a nullable column without a default rewrites nothing).
_MIGRATE_2_3: Final = f"""
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_advisory_xact_lock({_SCHEMA_LOCK});
ALTER TABLE {{t}} ADD COLUMN IF NOT EXISTS args text;
UPDATE {{meta}} SET value = '3' WHERE name = 'schema_version' AND value = '2';
COMMIT;
"""

# Version 3 to 4: the flag of a watched claim. A constant default is kept in the catalog
# (PostgreSQL 11 and later): the table is not rewritten.
_MIGRATE_3_4: Final = f"""
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT pg_advisory_xact_lock({_SCHEMA_LOCK});
ALTER TABLE {{t}} ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false;
UPDATE {{meta}} SET value = '4' WHERE name = 'schema_version' AND value = '3';
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
           %(owner)s, c.now + %(lease)s::float8, 1, NULL, NULL, NULL, c.now, c.now, NULL,
           %(args)s::text
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
        expires_at     = NULL,
        args           = excluded.args,
        watched        = false
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
# only on the change are computed in Python (_ops.write_params). When it applies, the record
# leaves "CLAIMED under this fence" and a waiter has marked it (_MARK), pg_notify wakes the
# waiters when the write commits. Only then: a notifying transaction takes a lock on the whole
# database's notification queue at commit, which would serialize every outcome write. The
# UPDATE reads ``watched`` in the row version it locks, so a mark committed before this write
# is seen; a mark that comes after it finds the record settled. When the write does not apply,
# the record is answered as the statement's snapshot shows it.
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
      AND t.state = ANY(string_to_array(%(states)s::text, ','))
      AND (%(owner)s::text IS NULL OR t.owner = %(owner)s::text)
      AND (NOT %(lapsed)s OR t.lease_deadline <= c.now)
      AND (t.expires_at IS NULL OR t.expires_at > c.now)
    RETURNING {", ".join(f"t.{name}" for name in _COLUMNS.split(", "))},
        CASE WHEN %(wake)s AND t.watched
             THEN pg_notify({{channel_text}}, %(payload)s) END AS notified
)
SELECT c.now, x.* FROM c LEFT JOIN (
    SELECT true AS won, {_COLUMNS} FROM w
    UNION ALL
    SELECT false, {_COLUMNS} FROM {{t}}
    WHERE namespace = %(namespace)s AND key = %(key)s AND NOT EXISTS (SELECT FROM w)
) AS x ON true
"""

# A waiter marks the claim it waits for, once it listens and before it reads: the owner's
# outcome write then notifies. The mark applies only to the record still CLAIMED under the
# waiter's fence and not marked yet (a second waiter writes nothing). The answer: whether it
# applied, the flag and the record, as written, or else as the statement's snapshot shows them
# (a write that settled the record while the mark waited for its row lock is not in that
# snapshot: the waiter then reads again).
_MARK: Final = f"""
WITH {_NOW},
m AS (
    UPDATE {{t}} AS t SET watched = true
    WHERE t.namespace = %(namespace)s
      AND t.key = %(key)s
      AND t.state = {_CLAIMED}
      AND t.fence = %(fence)s
      AND NOT t.watched
    RETURNING {", ".join(f"t.{name}" for name in _COLUMNS.split(", "))}
)
SELECT c.now, x.* FROM c LEFT JOIN (
    SELECT true AS won, true AS watched, {_COLUMNS} FROM m
    UNION ALL
    SELECT false, watched, {_COLUMNS} FROM {{t}}
    WHERE namespace = %(namespace)s AND key = %(key)s AND NOT EXISTS (SELECT FROM m)
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

# What _PURGE would delete, read only (``gc --dry-run``).
_EXPIRED: Final = f"""
WITH {_NOW}
SELECT {_COLUMNS} FROM {{t}}, c
WHERE expires_at IS NOT NULL
  AND expires_at <= c.now
  AND state IN ({_FINAL_VALUES})
  AND (%(namespace)s::text IS NULL OR namespace = %(namespace)s::text)
ORDER BY namespace, expires_at, key
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

# Who answers, asked once when a store opens: the pid of the server process behind this
# statement (a pooler hands out its own pid when the connection starts, so the two differ
# behind one), and the isolation level the statements get when they set none.
_INSPECT: Final = "SELECT pg_backend_pid(), current_setting('default_transaction_isolation')"

# The statements above rely on READ COMMITTED (a conflicting row is re-checked at its latest
# version); a server whose default is stricter would answer serialization failures instead.
# A session setting: never sent through a pooler (another client's transactions would get it,
# and the next statement may run on a server connection that never had it).
_CONFIGURE: Final = "SET default_transaction_isolation TO 'read committed'"


COLUMN_COUNT: Final = len(_COLUMNS.split(", "))
"""How many columns a record has (Record's fields, in their order)."""

_MAX_TABLE_NAME: Final = 48  # leaves room for the index and meta names within 63 bytes


@dataclass(frozen=True, slots=True)
class Statements:
    """The statements of one table, rendered once (schema and table names quoted)."""

    exists: bytes
    create: bytes
    version: bytes
    migrate_1_2: bytes
    migrate_2_3: bytes
    migrate_3_4: bytes
    claim: bytes
    write: bytes
    mark: bytes
    get: bytes
    records: bytes
    purge: bytes
    expired: bytes
    listen: bytes
    configure: bytes
    inspect: bytes
    add_counts: bytes
    counts: bytes
    channel: str
    names: dict[str, str]

    @classmethod
    def build(cls, schema: str, table: str) -> Statements:
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
            "channel_text": sql.Literal(channel),
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
            migrate_2_3=render(_MIGRATE_2_3, bound=False),
            migrate_3_4=render(_MIGRATE_3_4, bound=False),
            claim=render(_CLAIM),
            write=render(_WRITE),
            mark=render(_MARK),
            get=render(_GET),
            records=render(_RECORDS),
            purge=render(_PURGE),
            expired=render(_EXPIRED),
            listen=render(_LISTEN, bound=False),
            configure=render(_CONFIGURE, bound=False),
            inspect=render(_INSPECT, bound=False),
            add_counts=render(_ADD_COUNTS),
            counts=render(_COUNTS),
            channel=channel,
            names={
                "t": names["t"].as_string(None),
                "meta": names["meta"].as_string(None),
                "counts": names["counts"].as_string(None),
            },
        )
