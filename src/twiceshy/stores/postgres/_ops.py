"""The PostgreSQL stores' operations, each written once as a generator of statements.

An operation (:func:`claim_op`, :func:`write_op`, ...) yields the :class:`Step` it needs run and
is sent the rows; it decides what they mean, and whether a statement is run again after a lost
connection (thrown into it as :class:`ConnectionLost`). It does no I/O. :class:`Drive` steps one
operation; the blocking and the async store each carry its steps to the server in a loop of a
few lines (``_sync_store.py``, ``_async_store.py``). A wait is an operation too: besides reads
it yields a :class:`Pause`, which the store spends blocked on the record's notification.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, NotRequired, TypedDict, TypeVar

from ..._records import (
    FINAL_STATES,
    STATE_SETS,
    Change,
    Effect,
    Record,
    Snapshot,
    State,
    guard_holds,
    is_live,
    live_snapshot,
    make_record,
    make_snapshot,
)
from ...errors import LedgerNotFound, StoreError
from ._errors import store_error
from ._sql import COLUMN_COUNT, SCHEMA_VERSION, Statements

_T = TypeVar("_T")
_C = TypeVar("_C")

Rows = list[tuple[Any, ...]]
Now = Callable[[], float | None]
"""The ``now`` a statement binds: ``None`` for the server's clock, or a test clock's time."""

ROUNDS: Final = 3  # a claim or write: at most one lost connection and one fresh look
MAX_STEPS: Final = 8
SCHEMA_STEPS: Final = 16  # opening: a look, the tables, and each migration with its check
MAX_WAIT_ROUNDS: Final = 100_000
WAIT_STEPS: Final = 3 * MAX_WAIT_ROUNDS  # a round of a wait: a read (two steps at most), a pause
POLL_FIRST: Final = 0.005  # polling while no listener is connected: 5 ms doubling to 250 ms
POLL_CAP: Final = 0.25

EFFECTS: Final = {e.value: e for e in Effect}
STATES: Final = {s.value: s for s in State}


class ClaimArgs(TypedDict):
    """The keyword arguments of a claim (see :meth:`twiceshy.stores.Store.claim`)."""

    fingerprint: str
    tool: str
    effect: Effect
    owner: str
    lease: float
    args: NotRequired[str | None]


class RecordsFilter(TypedDict):
    """The keyword arguments of a listing (see :meth:`twiceshy.stores.Store.records`)."""

    states: NotRequired[Iterable[State] | None]
    tool: NotRequired[str | None]
    limit: NotRequired[int | None]


# -- rows and records ------------------------------------------------------------------------


def record_of(cols: Sequence[Any]) -> Record | None:
    """A record from the 17 columns in Record's field order; ``None`` for an absent row."""
    if cols[0] is None:
        return None
    try:
        return make_record(
            cols[0],
            cols[1],
            cols[2],
            cols[3],
            EFFECTS[cols[4]],
            STATES[cols[5]],
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
            cols[16],
        )
    except (KeyError, TypeError) as exc:
        raise StoreError(
            f"PostgreSQL ledger: unreadable record {cols[0]!r}/{cols[1]!r}: {exc}"
        ) from exc


def answer(rows: Rows) -> tuple[float, bool, Record | None]:
    """The (now, applied, record) row of a claim or a write."""
    if len(rows) != 1 or len(rows[0]) != 2 + COLUMN_COUNT:
        raise StoreError(f"PostgreSQL ledger: unexpected answer shape {len(rows)} rows")
    row = rows[0]
    return float(row[0]), bool(row[1]), record_of(row[2:])


def payload_of(namespace: str, key: str) -> str:
    """The NOTIFY payload naming one record: short and fixed-size, whatever the key."""
    text = f"{len(namespace)}:{namespace}:{key}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def write_params(namespace: str, key: str, change: Change, payload: str) -> dict[str, Any]:
    """The bound values of the write statement: what ``change`` sets, computed in Python."""
    to = change.to
    bump = change.new_owner is not None
    return {
        "namespace": namespace,
        "key": key,
        "fence": change.fence,
        "states": _STATES_TEXT[change.from_states],
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
        "payload": payload,
    }


_STATES_TEXT: Final = {
    states: ",".join(sorted(state.value for state in states)) for states in STATE_SETS
}
"""Each set of states a write may start from (none: a write that never applies), as the write
statement takes it: one text, which psycopg binds in a fraction of the time an array takes."""


def shows(record: Record, change: Change) -> bool:
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


@dataclass(frozen=True, slots=True)
class Step:
    """One statement to run, and whether it answers rows.

    Without ``params`` it is sent with the simple query protocol (a script may hold several
    statements, and a ``%`` in a name needs no doubling).
    """

    query: bytes
    params: Mapping[str, Any] | None = None
    rows: bool = True


class ConnectionLost(Exception):
    """Thrown into an operation: the connection broke while its statement ran."""


@dataclass(frozen=True, slots=True)
class Pause:
    """Block until the record's notification arrives, or ``seconds`` pass (waits only)."""

    seconds: float


Op = Generator[Step, Rows, _T]
"""An operation: yields statements, is sent their rows, returns its answer."""

WaitOp = Generator[Step | Pause, Rows, _T]
"""An operation that may also yield pauses (a wait)."""


# -- operations ------------------------------------------------------------------------------


def retrying(make: Callable[[], Step]) -> Generator[Step, Rows, Rows]:
    """Run a statement that is safe to repeat; once more on a fresh connection if lost."""
    try:
        return (yield make())
    except ConnectionLost:
        return (yield make())


@dataclass(frozen=True, slots=True)
class Server:
    """What a store learns of the server when it opens (see :func:`inspect_op`)."""

    #: A connection pooler answers in the server's place (PgBouncer or another).
    pooled: bool
    #: The isolation level of a statement that sets none (``default_transaction_isolation``).
    isolation: str


def inspect_op(st: Statements, given_pid: int) -> Op[Server]:
    """Ask who answers: ``given_pid`` is the backend pid the connection was given at its start.

    PostgreSQL gives a connection its own process's pid; a pooler gives its own made-up one,
    which no server process has.
    """
    rows = yield Step(st.inspect)
    pid, isolation = rows[0]
    return Server(pooled=int(pid) != given_pid, isolation=str(isolation))


def schema_op(st: Statements, where: str, *, create: bool, configure: bool = True) -> Op[None]:
    """Check the ledger's tables (creating or migrating them as needed) on a fresh connection."""
    if configure:
        # The probe connection is configured as the pooled ones are.
        yield Step(st.configure, rows=False)
    names = st.names
    rows = yield Step(
        st.exists, {"meta": names["meta"], "t": names["t"], "counts": names["counts"]}
    )
    there, complete = rows[0]
    if not there and not create:
        raise LedgerNotFound(
            f"no twiceshy ledger at {where}: there is no table {names['t']} with its "
            f"{names['meta']} (a schema or table name mistyped?)"
        )
    if not (there and complete):
        yield Step(st.create, rows=False)
    rows = yield Step(st.version)
    found = rows[0][0] if rows else None
    if found == "1":
        yield Step(st.migrate_1_2, rows=False)
        rows = yield Step(st.version)
        found = rows[0][0] if rows else None
    if found == "2":
        yield Step(st.migrate_2_3, rows=False)
        rows = yield Step(st.version)
        found = rows[0][0] if rows else None
    if found == "3":
        yield Step(st.migrate_3_4, rows=False)
        rows = yield Step(st.version)
        found = rows[0][0] if rows else None
    if found != str(SCHEMA_VERSION):
        raise StoreError(
            f"PostgreSQL ledger {st.names['t']} has schema version {found!r}; this twiceshy "
            f"reads version {SCHEMA_VERSION}"
        )


def claim_op(
    st: Statements,
    now: Now,
    namespace: str,
    key: str,
    *,
    fingerprint: str,
    tool: str,
    effect: Effect,
    owner: str,
    lease: float,
    args: str | None = None,
) -> Op[Snapshot]:
    """Claim in one statement; run it again when a racing claimer or a lost reply leaves doubt."""
    params = {
        "namespace": namespace,
        "key": key,
        "fingerprint": fingerprint,
        "tool": tool,
        "effect": effect.value,
        "owner": owner,
        "lease": float(lease),
        "args": args,
    }
    lost = False
    for _ in range(ROUNDS):
        try:
            rows = yield Step(st.claim, {**params, "now": now()})
        except ConnectionLost:
            if lost:
                raise
            # The claim may have committed: running it again recognises its own owner token.
            lost = True
            continue
        at, inserted, record = answer(rows)
        if inserted:
            return make_snapshot(record, at, True)
        if record is not None and is_live(record, at):
            return make_snapshot(
                record, at, record.state is State.CLAIMED and record.owner == owner
            )
        # The INSERT met a row committed after this statement's snapshot: look again.
    raise StoreError(f"PostgreSQL ledger could not settle the claim of {namespace!r}/{key!r}")


def write_op(st: Statements, now: Now, namespace: str, key: str, change: Change) -> Op[Snapshot]:
    """Apply one guarded change; recognise it after a lost connection rather than lose it."""
    params = write_params(namespace, key, change, payload_of(namespace, key))
    lost = looked_again = False
    for _ in range(ROUNDS):
        try:
            rows = yield Step(st.write, {**params, "now": now()})
        except ConnectionLost:
            if lost:
                raise
            # The write may have committed: the next round recognises it, or applies it.
            lost = True
            continue
        at, applied, record = answer(rows)
        if applied:
            return make_snapshot(record, at, True)
        if lost and record is not None and shows(record, change):
            # Our write committed before the connection broke. It is ours even if its record
            # has expired since (a retention near 0): answered as gone, the caller would claim
            # afresh and run the work a second time.
            return make_snapshot(record, at, True)
        live = record if record is not None and is_live(record, at) else None
        if live is None:
            return make_snapshot(None, at, False)
        if guard_holds(live, change, at) and not looked_again:
            # The snapshot shows a version the UPDATE did not meet: it waited for a concurrent
            # writer and found the record changed. Look again with a fresh snapshot.
            looked_again = True
            continue
        return make_snapshot(live, at, False)
    raise StoreError(f"PostgreSQL ledger could not settle a write of {namespace!r}/{key!r}")


def get_op(st: Statements, now: Now, namespace: str, key: str) -> Op[Snapshot]:
    """Read the key's live record."""
    rows = yield from retrying(
        lambda: Step(st.get, {"namespace": namespace, "key": key, "now": now()})
    )
    if len(rows) != 1 or len(rows[0]) != 1 + COLUMN_COUNT:
        raise StoreError("PostgreSQL ledger: unexpected answer to a read")
    at = float(rows[0][0])
    record = record_of(rows[0][1:])
    return live_snapshot(record, at)


def records_op(
    st: Statements,
    now: Now,
    namespace: str,
    *,
    states: Iterable[State] | None = None,
    tool: str | None = None,
    limit: int | None = None,
) -> Op[list[Record]]:
    """List live records of a namespace, newest first."""
    params = {
        "namespace": namespace,
        "states": None if states is None else sorted({s.value for s in states}),
        "tool": tool,
        "limit": None if limit is None else max(limit, 0),
    }
    rows = yield from retrying(lambda: Step(st.records, {**params, "now": now()}))
    found = [record_of(row) for row in rows]
    return [r for r in found if r is not None]


def expired_op(st: Statements, now: Now, namespace: str | None) -> Op[list[Record]]:
    """The outcomes past their retention, which ``purge_op`` would delete now."""
    rows = yield from retrying(lambda: Step(st.expired, {"namespace": namespace, "now": now()}))
    found = [record_of(row) for row in rows]
    return [r for r in found if r is not None]


def purge_op(st: Statements, now: Now, namespace: str | None) -> Op[int]:
    """Delete outcomes past their retention; answer how many."""
    rows = yield from retrying(lambda: Step(st.purge, {"namespace": namespace, "now": now()}))
    return int(rows[0][0])


def add_counts_op(
    st: Statements, namespace: str, counts: Mapping[tuple[str, str], int]
) -> Op[None]:
    """Add a flush of call counts in one statement."""
    # Not repeated after a lost connection (the statement may have committed): the error goes
    # up, and whether to send these counts again is the caller's choice.
    if counts:
        items = sorted(counts.items())
        yield Step(
            st.add_counts,
            {
                "namespace": namespace,
                "tools": [tool for (tool, _), _ in items],
                "outcomes": [outcome for (_, outcome), _ in items],
                "counts": [n for _, n in items],
            },
            rows=False,
        )


def counts_op(st: Statements, namespace: str) -> Op[dict[tuple[str, str], int]]:
    """Read a namespace's call counts."""
    rows = yield from retrying(lambda: Step(st.counts, {"namespace": namespace}))
    return {(tool, outcome): int(n) for tool, outcome, n in rows}


def mark_op(st: Statements, now: Now, namespace: str, key: str, fence: int) -> Op[Snapshot | None]:
    """Mark the claim under ``fence`` as waited for, so that its outcome write notifies.

    Answers the record when the answer is current: the mark applied, or the record was marked
    already, or it is settled. ``None`` when the record showed the claim unmarked and the mark
    did not apply: a write settled it meanwhile, which a fresh read shows.
    """
    rows = yield from retrying(
        lambda: Step(st.mark, {"namespace": namespace, "key": key, "fence": fence, "now": now()})
    )
    if len(rows) != 1 or len(rows[0]) != 3 + COLUMN_COUNT:
        raise StoreError("PostgreSQL ledger: unexpected answer to a mark")
    at, marked, watched = float(rows[0][0]), bool(rows[0][1]), bool(rows[0][2])
    record = record_of(rows[0][3:])
    if marked:
        return make_snapshot(record, at, False)
    if record is not None and record.state is State.CLAIMED and record.fence == fence:
        return make_snapshot(record, at, False) if watched else None
    return live_snapshot(record, at)


def wait_op(
    st: Statements,
    now: Now,
    namespace: str,
    key: str,
    fence: int,
    deadline: float,
    recheck: float,
    listening: Callable[[], bool],
    mark: bool = True,
) -> WaitOp[Snapshot]:
    """Read the record until it leaves "CLAIMED under ``fence``" or ``deadline`` passes.

    With ``mark`` (waiters woken by ``LISTEN``) the first read marks the claim (:func:`mark_op`),
    so that the write that settles it notifies; the store registered the waiter first, and a
    listener that was not yet listening wakes every waiter once it is. Between reads it pauses:
    ``recheck`` seconds while ``listening()`` (a notification ends the pause sooner), otherwise
    polling from 5 ms doubling to 250 ms. The store clears its wake-up flag before every
    statement, so a notification that arrives after one ends the next pause at once.
    """
    poll = POLL_FIRST
    snap: Snapshot | None = None
    first = (yield from mark_op(st, now, namespace, key, fence)) if mark else None
    for _ in range(MAX_WAIT_ROUNDS):
        if first is not None:
            snap, first = first, None
        else:
            snap = yield from get_op(st, now, namespace, key)
        record = snap.record
        if record is None or record.state is not State.CLAIMED or record.fence != fence:
            return snap
        left = deadline - time.monotonic()
        if left <= 0:
            return snap
        if listening():
            pause = recheck
        else:
            pause, poll = poll, min(poll * 2, POLL_CAP)
        yield Pause(min(pause, left))
    assert snap is not None
    return snap


# -- driving ---------------------------------------------------------------------------------


class Drive(Generic[_C, _T]):
    """One operation on its way: the command it waits on, fed with what each one answered.

    Made, it runs the operation to its first command. While :attr:`pending`, the loop carries
    out :attr:`command` and answers it with :meth:`send`: the rows, or the ``OperationalError``
    that lost the connection (thrown into the operation as :class:`ConnectionLost`; if the
    operation lets it go, it is raised as a :class:`~twiceshy.StoreUnavailable`). Once it is no
    longer pending, :attr:`result` is the operation's answer. An operation still pending after
    ``limit`` answers is given up. The loop closes the operation however it ends (a
    ``try``/``finally``: cheaper than a ``with`` on every call).
    """

    __slots__ = ("_left", "_op", "command", "pending", "result")

    def __init__(self, op: Generator[_C, Rows, _T], limit: int = MAX_STEPS) -> None:
        self._op = op
        self._left = limit
        self.command: _C
        self.result: _T
        try:
            self.command = next(op)
            self.pending = True
        except StopIteration as stop:
            self.pending = False
            self.result = stop.value

    def send(self, answer: Rows | BaseException) -> None:
        """Answer :attr:`command`: its rows, or the error that lost its connection."""
        try:
            if isinstance(answer, BaseException):
                try:
                    self.command = self._op.throw(ConnectionLost(str(answer)))
                except ConnectionLost:
                    raise store_error(answer) from answer
            else:
                self.command = self._op.send(answer)
        except StopIteration as stop:
            self.pending = False
            self.result = stop.value
            return
        self._left -= 1
        if self._left <= 0:
            raise StoreError("PostgreSQL ledger: an operation did not finish")
