"""Records, states and effect classes: the values the protocol and the stores exchange."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

__all__ = [
    "CLOCK_TOLERANCE",
    "FINAL_STATES",
    "STATE_SETS",
    "CallEvent",
    "Change",
    "Effect",
    "Outcome",
    "Record",
    "Snapshot",
    "State",
    "apply_change",
    "guard_holds",
    "is_live",
    "last_written",
    "live_snapshot",
    "make_change",
    "make_record",
    "make_snapshot",
    "new_claim",
]

_V = TypeVar("_V")


class Effect(enum.Enum):
    """What a tool declares about itself (docs/design.md §4)."""

    #: Safe to retry: reads, searches, computations. Not kept in the ledger unless asked.
    SAFE = "safe"
    #: Safe with a key: the provider deduplicates by the idempotency key twiceshy hands the tool.
    KEYED = "keyed"
    #: Never retry blindly: one attempt, then an honest error.
    UNSAFE = "unsafe"

    # Members are singletons: hashing by identity is exact, and much cheaper than Enum's own
    # hash of the name, which every call pays in the protocol's sets and tables.
    __hash__ = object.__hash__


class State(enum.Enum):
    """The state of one key's record (docs/design.md §3)."""

    #: An owner is running the work under a lease.
    CLAIMED = "claimed"
    #: The work ran; its result is stored and replayed.
    SUCCEEDED = "succeeded"
    #: The work ran and failed for certain; the error is stored and replayed.
    FAILED = "failed"
    #: The work certainly did not take effect; the next call claims the key again.
    RELEASED = "released"
    #: The work may or may not have taken effect.
    UNKNOWN = "unknown"

    __hash__ = object.__hash__  # as Effect's


class Outcome(enum.Enum):
    """How a protected call was answered."""

    #: This call ran the tool (whatever the tool then did).
    EXECUTED = "executed"
    #: The outcome recorded by an earlier call was replayed.
    REPLAYED = "replayed"
    #: The call joined an identical call running in this process and shares its outcome.
    JOINED = "joined"
    #: The call waited for an identical call running elsewhere and replays its outcome.
    WAITED = "waited"
    #: A reconciler settled an unknown outcome, and the call answers with it.
    RECONCILED = "reconciled"
    #: The call was refused before anything ran (no scope, arguments without a key, key reuse).
    REFUSED = "refused"
    #: The tool may or may not have taken effect: ``OutcomeUnknown``.
    UNKNOWN = "unknown"
    #: An identical call is still running: ``InProgress``.
    IN_PROGRESS = "in_progress"
    #: The ledger failed (``StoreError``); the error says whether the tool had run.
    STORE_ERROR = "store_error"

    __hash__ = object.__hash__  # as Effect's

    @property
    def replayed(self) -> bool:
        """Whether the call was answered without running the tool itself: an earlier call's
        outcome, replayed, joined or waited for, or a reconciler's answer."""
        return self in _REPLAYS


_REPLAYS: Final = frozenset({Outcome.REPLAYED, Outcome.JOINED, Outcome.WAITED, Outcome.RECONCILED})


@dataclass(frozen=True, slots=True)
class CallEvent:
    """What one protected call did, for observers (metrics, traces, logs).

    Attributes:
        tool: the tool's name.
        effect: its effect class.
        outcome: how the call was answered.
        key: the intent's key (``None`` when refused before one was made, or for a SAFE tool kept
            out of the ledger).
        error: the exception the caller got, if any.
        started: when the call began (seconds since the epoch).
        duration: how long it took (seconds).
    """

    tool: str
    effect: Effect
    outcome: Outcome
    key: str | None
    error: BaseException | None
    started: float
    duration: float

    @property
    def replayed(self) -> bool:
        """Whether the caller got an earlier outcome rather than one of this call's own run."""
        return self.outcome.replayed


@dataclass(frozen=True, slots=True)
class Record:
    """One key's row in the ledger.

    Times are seconds since the epoch on the store's clock. ``args`` is the canonical JSON text
    of the arguments that name the intent, as the claim kept it (``None`` when the tool keeps
    none); set by the claim that made the record, never changed by a write.
    """

    namespace: str
    key: str
    fingerprint: str
    tool: str
    effect: Effect
    state: State
    fence: int
    owner: str
    lease_deadline: float | None
    attempts: int
    result: str | None
    error: str | None
    reason: str | None
    created_at: float
    updated_at: float
    expires_at: float | None
    args: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a store answers to every command: the record as it now is.

    Attributes:
        record: the record after the command, or ``None`` when there is none.
        now: the store's clock when it answered (seconds since the epoch).
        won: whether the command's write took effect (a claim won, a guarded write applied).
    """

    record: Record | None
    now: float
    won: bool = False


@dataclass(frozen=True, slots=True)
class Change:
    """One guarded write to an existing record: a compare-and-set on fence and state.

    The store applies it only when the record's fence equals ``fence``, its state is one of
    ``from_states``, its owner equals ``owner`` (when given), and, with ``lapsed``, its lease
    deadline has passed on the store's clock. Otherwise it changes nothing and answers the record
    as it is, with ``won=False``.

    Attributes:
        fence: the fence the writer believes current.
        from_states: the states the write may start from.
        to: the state to write.
        owner: when given, the record's owner token must equal it.
        lapsed: the record's lease must have lapsed on the store's clock.
        new_owner: when given, a new authorised attempt: the fence goes up by one, the owner
            becomes ``new_owner`` and ``attempts`` goes up by one.
        lease: when given, the new lease deadline is the store's now plus this many seconds;
            a write to any state but CLAIMED clears the lease.
        count_attempt: add one to ``attempts`` (an in-place retry under the same fence).
        result: the JSON text of the result (SUCCEEDED).
        error: the JSON text of the error (FAILED, UNKNOWN).
        reason: why the outcome is unknown (UNKNOWN).
        ttl: for a final state, how long the record is kept (seconds); ``None`` keeps it forever.
    """

    fence: int
    from_states: frozenset[State]
    to: State
    owner: str | None = None
    lapsed: bool = False
    new_owner: str | None = None
    lease: float | None = None
    count_attempt: bool = False
    result: str | None = None
    error: str | None = None
    reason: str | None = None
    ttl: float | None = None

    def __post_init__(self) -> None:
        if self.new_owner is not None and (self.to is not State.CLAIMED or self.lease is None):
            # A new owner without a deadline could never lapse, nor be taken over.
            raise ValueError("a new owner takes a CLAIMED record with lease=")


FINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.RELEASED})
"""States whose records expire after their retention; CLAIMED and UNKNOWN never expire."""

STATE_SETS: Final = tuple(
    frozenset(states) for n in range(len(State) + 1) for states in itertools.combinations(State, n)
)
"""Every set of states, the empty one included: what a change's ``from_states`` may be."""


def _positional(cls: type[_V]) -> Callable[..., _V]:
    """A constructor of the frozen slotted dataclass ``cls`` taking every field positionally,
    for the values every call makes (a record, a change, a snapshot).

    The object is one ``cls(...)`` would make: as frozen, equal, hashed and printed the same.
    A frozen dataclass sets each field through ``object.__setattr__``, and keywords cost more
    still: a 17-field record took about 2.6 µs. Here a plain slotted twin with the same fields
    (so the same layout) sets them, and the object then takes ``cls`` as its class: 0.4 µs.
    ``__post_init__`` is not run: a caller checks what it would.
    """
    twin: Any = dataclasses.make_dataclass(
        f"_{cls.__name__}Fields",
        [(f.name, Any) for f in dataclasses.fields(cls)],  # type: ignore[arg-type]
        slots=True,
        eq=False,
        repr=False,
    )
    if twin.__slots__ != cls.__slots__:  # type: ignore[attr-defined]  # pragma: no cover
        raise TypeError(f"{cls.__name__} has slots its fields do not name")

    def make(*values: Any) -> _V:
        made = twin(*values)
        made.__class__ = cls
        return made  # type: ignore[no-any-return]

    make.__doc__ = f"A {cls.__name__} from all its fields, in order (see :func:`_positional`)."
    return make


make_record: Final = _positional(Record)
make_change: Final = _positional(Change)
make_snapshot: Final = _positional(Snapshot)


CLOCK_TOLERANCE: Final = 1.0
"""How far (seconds) a record's times may lie ahead of the clock that reads them before a store
that judges on its callers' clocks (SQLite, DynamoDB) takes it that two clocks disagree: such a
record counts as live whatever its expiry says, and the skew is logged. Clocks kept by NTP
differ by milliseconds."""


def last_written(record: Record) -> float:
    """The latest time written on ``record`` (its claim's, or its last write's), on the clocks
    of the processes that wrote them."""
    created, updated = record.created_at, record.updated_at
    return created if created > updated else updated


def is_live(record: Record, now: float, tolerance: float | None = None) -> bool:
    """Whether a record still counts: not past its retention on the store's clock.

    ``tolerance`` is for stores that judge on their callers' clocks: a record last written more
    than ``tolerance`` seconds after ``now`` also counts, whatever its expiry says. A clock ahead
    wrote it, or the reader's is behind; either way the reader's clock cannot tell that its
    retention has passed.
    """
    return (
        record.expires_at is None
        or record.expires_at > now
        or (tolerance is not None and last_written(record) > now + tolerance)
    )


def live_snapshot(record: Record | None, now: float, tolerance: float | None = None) -> Snapshot:
    """What a read answers at store time ``now``: ``record``, unless it is past its retention
    (``tolerance`` as for :func:`is_live`)."""
    live = record if record is not None and is_live(record, now, tolerance) else None
    return make_snapshot(live, now, False)


def new_claim(
    namespace: str,
    key: str,
    *,
    fingerprint: str,
    tool: str,
    effect: Effect,
    owner: str,
    lease: float,
    now: float,
    fence: int = 1,
    args: str | None = None,
) -> Record:
    """The record a winning claim inserts (reference semantics for stores)."""
    return make_record(
        namespace,
        key,
        fingerprint,
        tool,
        effect,
        State.CLAIMED,
        fence,
        owner,
        now + lease,  # lease_deadline
        1,  # attempts
        None,  # result
        None,  # error
        None,  # reason
        now,  # created_at
        now,  # updated_at
        None,  # expires_at
        args,
    )


def guard_holds(record: Record, change: Change, now: float) -> bool:
    """Whether ``change`` may be applied to ``record`` at store time ``now``."""
    if record.fence != change.fence or record.state not in change.from_states:
        return False
    if change.owner is not None and record.owner != change.owner:
        return False
    if change.lapsed:
        return record.lease_deadline is not None and record.lease_deadline <= now
    return True


def apply_change(record: Record, change: Change, now: float) -> Record:
    """The record after ``change`` (reference semantics for stores); guards are not checked."""
    bump = change.new_owner is not None
    to = change.to
    claimed = to is State.CLAIMED
    return make_record(
        record.namespace,
        record.key,
        record.fingerprint,
        record.tool,
        record.effect,
        to,
        record.fence + 1 if bump else record.fence,
        change.new_owner if bump else record.owner,
        # lease_deadline: only a claimed record has one
        (now + change.lease if change.lease is not None else record.lease_deadline)
        if claimed
        else None,
        record.attempts + (1 if bump or change.count_attempt else 0),
        change.result if to is State.SUCCEEDED else None,
        change.error if to is State.FAILED or to is State.UNKNOWN else None,
        change.reason if to is State.UNKNOWN else None,
        record.created_at,
        now,  # updated_at
        now + change.ttl if to in FINAL_STATES and change.ttl is not None else None,
        record.args,
    )
