"""Every statement the SQLite store runs, the values each one binds, and rows read back as records.

Values are always bound, never formatted in. Only enum values, the fixed column list and settings
the store has already checked (a journal mode, a ``synchronous`` level, a timeout) are spliced in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from ..._records import CLOCK_TOLERANCE, FINAL_STATES, Change, Effect, Record, State, make_record
from ...errors import StoreError

SCHEMA_VERSION: Final = 2

# -- the schema -----------------------------------------------------------------------------

COLUMNS: Final = (
    "namespace, key, fingerprint, tool, effect, state, fence, owner, lease_deadline, attempts, "
    "result, error, reason, created_at, updated_at, expires_at, args"
)

SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS twiceshy_meta (
        name  TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID
    """,
    f"""
    INSERT INTO twiceshy_meta (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}')
    ON CONFLICT (name) DO NOTHING
    """,
    """
    CREATE TABLE IF NOT EXISTS twiceshy_records (
        namespace      TEXT    NOT NULL,
        key            TEXT    NOT NULL,
        fingerprint    TEXT    NOT NULL,
        tool           TEXT    NOT NULL,
        effect         TEXT    NOT NULL,
        state          TEXT    NOT NULL,
        fence          INTEGER NOT NULL,
        owner          TEXT    NOT NULL,
        lease_deadline REAL,
        attempts       INTEGER NOT NULL,
        result         TEXT,
        error          TEXT,
        reason         TEXT,
        created_at     REAL    NOT NULL,
        updated_at     REAL    NOT NULL,
        expires_at     REAL,
        args           TEXT,
        PRIMARY KEY (namespace, key)
    ) WITHOUT ROWID
    """,
    # records(): one namespace, newest first.
    """
    CREATE INDEX IF NOT EXISTS twiceshy_records_by_created
    ON twiceshy_records (namespace, created_at)
    """,
    # purge_expired(): only rows that can expire at all.
    """
    CREATE INDEX IF NOT EXISTS twiceshy_records_by_expiry
    ON twiceshy_records (expires_at) WHERE expires_at IS NOT NULL
    """,
    # Call counts by tool and outcome, summed over every process (added after version 1's
    # first release: IF NOT EXISTS brings older files up to date).
    """
    CREATE TABLE IF NOT EXISTS twiceshy_counts (
        namespace TEXT    NOT NULL,
        tool      TEXT    NOT NULL,
        outcome   TEXT    NOT NULL,
        count     INTEGER NOT NULL,
        PRIMARY KEY (namespace, tool, outcome)
    ) WITHOUT ROWID
    """,
)

# Version 1 to 2: the column of each call's arguments (NULL in the records made before).
MIGRATE_1_2: Final = (
    "ALTER TABLE twiceshy_records ADD COLUMN args TEXT",
    "UPDATE twiceshy_meta SET value = '2' WHERE name = 'schema_version'",
)

SELECT_SCHEMA_VERSION: Final = "SELECT value FROM twiceshy_meta WHERE name = 'schema_version'"

# A real (if idempotent) write: it makes a read-only file fail at construction, not at a claim.
TOUCH_SCHEMA_VERSION: Final = "UPDATE twiceshy_meta SET value = value WHERE name = 'schema_version'"

# Which of the ledger's tables a file holds: a plain read of the schema, before anything is
# written (the journal mode included).
LEDGER_TABLES: Final = """
    SELECT name FROM sqlite_master
    WHERE type = 'table' AND name IN ('twiceshy_meta', 'twiceshy_records', 'twiceshy_counts')
"""
# Without these two a file is no ledger; the call counts table is added where it is missing.
CORE_TABLES: Final = frozenset({"twiceshy_meta", "twiceshy_records"})
ALL_TABLES: Final = CORE_TABLES | {"twiceshy_counts"}

# -- transactions and settings --------------------------------------------------------------

# A write transaction takes the one writer's lock up front.
BEGIN: Final = "BEGIN IMMEDIATE"
COMMIT: Final = "COMMIT"
ROLLBACK: Final = "ROLLBACK"
JOURNAL_MODE: Final = "PRAGMA journal_mode"


def set_journal_mode(mode: str) -> str:
    """The statement that puts the file in ``mode`` (one of the checked journal modes)."""
    return f"PRAGMA journal_mode = {mode}"


def set_busy_timeout(seconds: float) -> str:
    """The statement that makes a connection wait ``seconds`` for another writer."""
    return f"PRAGMA busy_timeout = {round(seconds * 1000)}"


def set_synchronous(level: str) -> str:
    """The statement that sets a connection's ``synchronous`` (one of the checked levels)."""
    return f"PRAGMA synchronous = {level}"


# -- records --------------------------------------------------------------------------------

SELECT_RECORD: Final = f"""
    SELECT {COLUMNS} FROM twiceshy_records WHERE namespace = :namespace AND key = :key
"""

# Whether a row is past its retention at ``:now``: expired, and not last written after
# ``:soon`` (now plus the clock tolerance), which only a clock ahead of this one can have done
# (is_live with a tolerance). One text, so that every statement judges alike.
_EXPIRED: Final = (
    "({t}expires_at IS NOT NULL AND {t}expires_at <= :now "
    "AND max({t}created_at, {t}updated_at) <= :soon)"
)
EXPIRED_ROW: Final = _EXPIRED.format(t="")

# Insert a fresh claim, or replace a record past its retention with fence + 1, answering the
# record written. A live record (any state) is left alone and nothing is answered; the caller
# then reads it in the same transaction.
CLAIM: Final = f"""
    INSERT INTO twiceshy_records ({COLUMNS})
    VALUES (:namespace, :key, :fingerprint, :tool, :effect, :state, :fence, :owner,
            :lease_deadline, :attempts, NULL, NULL, NULL, :now, :now, NULL, :args)
    ON CONFLICT (namespace, key) DO UPDATE SET
        fingerprint    = excluded.fingerprint,
        tool           = excluded.tool,
        effect         = excluded.effect,
        state          = excluded.state,
        fence          = twiceshy_records.fence + 1,
        owner          = excluded.owner,
        lease_deadline = excluded.lease_deadline,
        attempts       = excluded.attempts,
        result         = NULL,
        error          = NULL,
        reason         = NULL,
        created_at     = excluded.created_at,
        updated_at     = excluded.updated_at,
        expires_at     = NULL,
        args           = excluded.args
    WHERE {_EXPIRED.format(t="twiceshy_records.")}
    RETURNING {COLUMNS}
"""

# The five ``:sN`` slots hold the allowed states, padded with NULL (``x IN (NULL)`` is never
# true), so one constant statement serves every ``from_states``.
_STATE_SLOTS: Final = tuple(f"s{i}" for i in range(len(State)))
_STATES_IN: Final = "state IN (" + ", ".join(f":{slot}" for slot in _STATE_SLOTS) + ")"

# The latest time the ledger has written for a namespace: its newest claim, read from the end
# of the index by namespace and creation (no write, no row shared by every claim).
LATEST_CLAIM: Final = """
    (SELECT max(created_at) FROM twiceshy_records WHERE namespace = :namespace)
"""

# One guarded compare-and-set; it sets what ``apply_change`` sets, and answers the record written
# (nothing when a guard fails). Values that depend only on the change and the clock are computed
# in Python and bound (write_params). An expiry is counted from the writer's clock, or from the
# latest time the ledger had written for the record or its namespace when that is later: a writer
# whose clock is behind must not write an outcome that the others find expired before it was
# written. SET reads the row as it was before the statement; CASE reads the newest claim only
# for a write that sets an expiry.
WRITE: Final = f"""
    UPDATE twiceshy_records SET
        state          = :to,
        fence          = fence + :bump,
        owner          = COALESCE(:new_owner, owner),
        lease_deadline = CASE WHEN :keep_deadline THEN lease_deadline ELSE :lease_deadline END,
        attempts       = attempts + :add_attempts,
        result         = :result,
        error          = :error,
        reason         = :reason,
        updated_at     = :now,
        expires_at     = CASE WHEN :ttl IS NULL THEN NULL
                         ELSE max(:now, created_at, updated_at, {LATEST_CLAIM.strip()}) + :ttl
                         END
    WHERE namespace = :namespace
      AND key = :key
      AND fence = :fence
      AND {_STATES_IN}
      AND (:owner IS NULL OR owner = :owner)
      AND (NOT :lapsed OR (lease_deadline IS NOT NULL AND lease_deadline <= :now))
      AND NOT {EXPIRED_ROW}
    RETURNING {COLUMNS}
"""

RECORDS: Final = f"""
    SELECT {COLUMNS} FROM twiceshy_records
    WHERE namespace = :namespace
      AND NOT {EXPIRED_ROW}
      AND (:all_states OR {_STATES_IN})
      AND (:tool IS NULL OR tool = :tool)
    ORDER BY created_at DESC
    LIMIT :limit
"""

_FINAL_VALUES: Final = ", ".join(f"'{s.value}'" for s in State if s in FINAL_STATES)

PURGE: Final = f"""
    DELETE FROM twiceshy_records
    WHERE {EXPIRED_ROW}
      AND state IN ({_FINAL_VALUES})
      AND (:namespace IS NULL OR namespace = :namespace)
"""

# What PURGE would delete, read only (``gc --dry-run``).
EXPIRED: Final = f"""
    SELECT {COLUMNS} FROM twiceshy_records
    WHERE {EXPIRED_ROW}
      AND state IN ({_FINAL_VALUES})
      AND (:namespace IS NULL OR namespace = :namespace)
    ORDER BY namespace, expires_at, key
"""

# -- call counts ----------------------------------------------------------------------------

ADD_COUNT: Final = """
    INSERT INTO twiceshy_counts (namespace, tool, outcome, count) VALUES (?, ?, ?, ?)
    ON CONFLICT (namespace, tool, outcome) DO UPDATE SET count = count + excluded.count
"""

COUNTS: Final = "SELECT tool, outcome, count FROM twiceshy_counts WHERE namespace = ?"

# -- what the statements bind ---------------------------------------------------------------


def claim_params(fresh: Record, now: float) -> dict[str, object]:
    """What :data:`CLAIM` binds to insert ``fresh``, the record a winning claim writes."""
    return {
        "namespace": fresh.namespace,
        "key": fresh.key,
        "fingerprint": fresh.fingerprint,
        "tool": fresh.tool,
        "effect": fresh.effect.value,
        "state": fresh.state.value,
        "fence": fresh.fence,
        "owner": fresh.owner,
        "lease_deadline": fresh.lease_deadline,
        "attempts": fresh.attempts,
        "now": now,
        "soon": now + CLOCK_TOLERANCE,
        "args": fresh.args,
    }


def write_params(namespace: str, key: str, change: Change, now: float) -> dict[str, object]:
    """What :data:`WRITE` binds: the guard of ``change`` and what it sets, at ``now``."""
    to = change.to
    return {
        "namespace": namespace,
        "key": key,
        "fence": change.fence,
        "owner": change.owner,
        "lapsed": change.lapsed,
        "now": now,
        "to": to.value,
        "bump": 1 if change.new_owner is not None else 0,
        "new_owner": change.new_owner,
        "keep_deadline": to is State.CLAIMED and change.lease is None,
        "lease_deadline": (
            now + change.lease if to is State.CLAIMED and change.lease is not None else None
        ),
        "add_attempts": 1 if change.new_owner is not None or change.count_attempt else 0,
        "result": change.result if to is State.SUCCEEDED else None,
        "error": change.error if to in (State.FAILED, State.UNKNOWN) else None,
        "reason": change.reason if to is State.UNKNOWN else None,
        # NULL keeps no expiry; the statement counts it from now or the ledger's latest time.
        "ttl": change.ttl if to in FINAL_STATES else None,
        "soon": now + CLOCK_TOLERANCE,
        **state_slots(change.from_states),
    }


def expired_params(namespace: str | None, now: float) -> dict[str, object]:
    """What :data:`PURGE` and :data:`EXPIRED` bind: ``None`` is every namespace."""
    return {"namespace": namespace, "now": now, "soon": now + CLOCK_TOLERANCE}


def records_params(
    namespace: str, now: float, states: Iterable[State] | None, tool: str | None, limit: int | None
) -> dict[str, object]:
    """What :data:`RECORDS` binds: ``None`` is every state, any tool, no limit."""
    return {
        "namespace": namespace,
        "now": now,
        "soon": now + CLOCK_TOLERANCE,
        "all_states": states is None,
        "tool": tool,
        "limit": -1 if limit is None else max(limit, 0),
        **state_slots(states if states is not None else ()),
    }


def state_slots(states: Iterable[State]) -> dict[str, str | None]:
    """The ``:sN`` slots that stand for ``states``."""
    states = frozenset(states)
    slots = _SLOTS.get(states)
    if slots is None:
        values: list[str | None] = [s.value for s in sorted(states, key=lambda s: s.value)]
        values += [None] * (len(_STATE_SLOTS) - len(values))
        slots = _SLOTS[states] = dict(zip(_STATE_SLOTS, values, strict=True))
    return slots


# The slots of each set of states, made once: a write binds them on every call. There are at
# most 2**5 sets.
_SLOTS: dict[frozenset[State], dict[str, str | None]] = {}

# -- rows read back -------------------------------------------------------------------------

_EFFECTS: Final = {e.value: e for e in Effect}
_STATES: Final = {s.value: s for s in State}


def to_record(row: Sequence[Any]) -> Record:
    """The record a row of :data:`COLUMNS` holds.

    Raises:
        StoreError: the row holds an unknown state or effect, or a value of the wrong type.
    """
    # Columns are in Record's field order (COLUMNS); only the two enums need converting.
    try:
        return make_record(
            row[0],
            row[1],
            row[2],
            row[3],
            _EFFECTS[row[4]],
            _STATES[row[5]],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            row[13],
            row[14],
            row[15],
            row[16],
        )
    except (KeyError, TypeError) as exc:
        raise StoreError(f"SQLite ledger: unreadable record {row[0]!r}/{row[1]!r}: {exc}") from exc
