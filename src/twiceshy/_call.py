"""One protected call, as one generator (docs/design.md §8, "the path of one call").

:func:`called` makes every decision of one call. It plans the call (key, fingerprint: every
refusal comes first), joins a call of the same intent already running in this process, runs the
record's protocol (:func:`twiceshy._protocol.protect`), gives back a claim that an interruption
or a lost reply left it holding, lands its flight for the callers that joined it, and tells the
observers how the call was answered. It does no I/O and waits for nothing: it yields commands,
and a driver (:mod:`twiceshy._drivers`) carries each to the one room that serves it (the store,
the work, the flights, the clock, the observers), sending back the answer or throwing in the
room's failure.

What one call learns on its way lives in one per-call object, :class:`Call`; what a guard gives
every call of its tool, in :class:`Protection`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Final, cast

from ._binding import BoundCall
from ._commands import Claim, Run, Write
from ._inflight import Flight
from ._protocol import MARK_THE_EFFECT, CallPlan, Policy, abandoned, protect, retry_only
from ._reconciling import Reconciler
from ._records import Effect, Outcome, Snapshot, State, make_snapshot
from ._runtime import Around, Runtime
from ._scope import told
from .errors import (
    InProgress,
    KeyReuseMismatch,
    MissingScope,
    OutcomeNotRecorded,
    OutcomeUnknown,
    StoreError,
    UnkeyableArgument,
)

__all__ = [
    "AwaitFlight",
    "Call",
    "Look",
    "Protection",
    "Work",
    "called",
]

log = logging.getLogger("twiceshy")

Work = Callable[[str], Any]
"""The work of one call, given the call's key (the decorator injects it into the tool)."""


@dataclass(frozen=True, slots=True)
class Protection:
    """A guard as its calls see it: its policy, its ledger's runtime, how it plans a call.

    Attributes:
        name: the tool's name; ``effect`` its effect class.
        policy: how the tool is protected.
        recorded: whether its calls are kept in the ledger.
        reconcile: its reconciler, if any.
        runtime: what its ledger shares.
        plan: keys and plans one call (``plan(bound, scope)``): every refusal happens there.
        nesting: a SAFE call's work, giving the runs inside it their nested scope.
    """

    name: str
    effect: Effect
    policy: Policy
    recorded: bool
    reconcile: Reconciler | None
    runtime: Runtime
    plan: Callable[[BoundCall, str | None], CallPlan]
    nesting: Callable[[Work, BoundCall, str | None], Work]


class Call:
    """One call on its way: what it was given, and what it has learned (per call, never shared).

    A call is EXECUTED unless something says otherwise: it joined a flight here, or the protocol
    noted how it answered from the record (it notes only right before that answer).

    Attributes:
        protection: the guard's side; ``bound``, ``work``, ``scope``: the call as given.
        plan: its plan, once made; ``key`` its key.
        clock: when it began (``time.perf_counter()``), inside the observers' contexts.
        outcome: how it is being answered, for its event.
        ran: whether its work was started (an attempt may have taken effect).
        handed: whether every attempt that ended handed its key on (see ``Current.handed``).
        interrupted: an interruption (a cancelled task, Ctrl-C) that must go on.
        cut: the command a room failed on, if any; ``cut_answer``: what a claim or write cut
            off by a cancellation answered when carried to its end (or its failure).
        attempt: the running attempt's lease renewal, current call and context tokens.
    """

    __slots__ = (
        "attempt",
        "bound",
        "clock",
        "cut",
        "cut_answer",
        "handed",
        "interrupted",
        "key",
        "outcome",
        "plan",
        "protection",
        "ran",
        "scope",
        "work",
    )

    def __init__(self, protection: Protection, bound: BoundCall, work: Work, scope: str | None):
        self.protection = protection
        self.bound = bound
        self.work = work
        self.scope = scope
        self.clock = 0.0
        self.plan: CallPlan | None = None
        self.key: str | None = None
        self.outcome = Outcome.EXECUTED
        self.ran = False
        self.handed = True
        self.interrupted: BaseException | None = None
        self.cut: object = None
        self.cut_answer: Snapshot | BaseException | None = None
        self.attempt: Any = None


# -- the commands of a call, beside the protocol's ---------------------------------------------


@dataclass(frozen=True, slots=True)
class AwaitFlight:
    """Wait until ``flight`` lands, at most ``timeout`` seconds (answer: whether it landed)."""

    flight: Flight
    timeout: float


@dataclass(frozen=True, slots=True)
class Look:
    """Read the call's record, carried to its end (answer: a :class:`Snapshot`)."""


_LOOK: Final = Look()
_JOINS: Final = 3  # flights a call joins, each ended by an interrupted leader, before InProgress


class _LeaderInterrupted(Exception):
    """A flight's leader was interrupted: its joined callers go to the ledger themselves."""


def called(call: Call) -> Generator[Any, Any, Any]:
    """The generator of one call: its result, or the error its caller gets."""
    p = call.protection
    runtime = p.runtime
    around = Around(runtime.arounds, p.name, p.effect) if runtime.arounds else None
    call.clock = time.perf_counter()  # inside the observers' spans
    try:
        if not p.recorded:
            call.work = p.nesting(call.work, call.bound, call.scope)
            value = yield from retry_only(p.policy)
        else:
            plan = call.plan = p.plan(call.bound, call.scope)
            call.key = plan.key
            wait_until = time.monotonic() + p.policy.wait  # one wait= for the whole call
            led: Flight | None
            led, leads = runtime.flights.join(plan.namespace, plan.key, plan.fingerprint)
            if not leads:
                led, value = yield from _joined(call, plan, led, wait_until)
            if led is not None:  # this call leads the intent's flight here
                try:
                    value = yield from protect(plan, None, wait_until)
                except BaseException as exc:
                    raise (yield from _failed(call, plan, led, exc))  # noqa: B904 - exc, or from it
                runtime.flights.land(plan.namespace, plan.key, led, value, None)
    except BaseException as exc:
        outcome = _outcome_of(exc, call)
        told(outcome)
        hint = _way_out(p.policy, exc) if outcome is Outcome.UNKNOWN else ""
        runtime.answered(p.name, p.effect, call.key, outcome, call.clock, exc, call.ran, hint)
        if around is not None:
            around.__exit__(type(exc), exc, exc.__traceback__)
        raise
    # A call that ran the tool is EXECUTED, even when its write was then refused and it
    # answered the record's outcome instead (a newer owner's).
    outcome = Outcome.EXECUTED if call.ran else call.outcome
    told(outcome)
    runtime.answered(p.name, p.effect, call.key, outcome, call.clock, None, call.ran)
    if around is not None:
        around.__exit__(None, None, None)
    return value


def _joined(
    call: Call, plan: CallPlan, flight: Flight, wait_until: float
) -> Generator[Any, Any, tuple[Flight | None, Any]]:
    """A call of an intent already running in this process waits for its flight to land:
    ``(None, outcome)``; or, its leader interrupted, goes to the ledger itself and leads:
    ``(flight, None)``."""
    flights = call.protection.runtime.flights
    for joins in range(1, _JOINS + 1):
        call.outcome = Outcome.JOINED
        if flight.fingerprint != plan.fingerprint:
            raise _mismatch(plan)
        if not (yield AwaitFlight(flight, max(wait_until - time.monotonic(), 0.0))):
            raise InProgress(plan.policy.tool, plan.key, here=True)
        try:
            return None, flight.outcome()
        except _LeaderInterrupted:
            call.outcome = Outcome.EXECUTED  # a call of its own from now on
        if joins == _JOINS:
            break
        flight, leads = flights.join(plan.namespace, plan.key, plan.fingerprint)
        if leads:
            return flight, None
    raise InProgress(plan.policy.tool, plan.key, here=True)


def _failed(
    call: Call, plan: CallPlan, flight: Flight, error: BaseException
) -> Generator[Any, Any, BaseException]:
    """A led call ended in ``error``: give back what it holds and will not use, land its flight;
    what its caller gets (``error``, or an error raised from it).

    A store error after the work started says the work ran (:class:`OutcomeNotRecorded`); an
    interruption goes on whatever followed it.
    """
    if call.cut is not None and _may_have_made_owner(call.cut, error):
        yield from _give_back(call, plan, error)
    if call.ran and isinstance(error, StoreError) and not isinstance(error, OutcomeNotRecorded):
        cause = error
        error = OutcomeNotRecorded(plan.policy.tool, plan.key, str(cause))
        error.__cause__ = cause
    joiners = error if isinstance(error, Exception) else _LeaderInterrupted()
    call.protection.runtime.flights.land(plan.namespace, plan.key, flight, None, joiners)
    interrupted = call.interrupted
    if interrupted is not None and error is not interrupted:
        raise interrupted from error
    return error


def _give_back(call: Call, plan: CallPlan, why: BaseException) -> Generator[Any, Any, None]:
    """A claim, a write or the work's start was cut short (an interruption, or a store failure
    that may have lost the reply): what the store holds is looked at, and a claim this call
    owns but will never use is given back (:func:`abandoned`), so no retry waits out its lease.
    Best effort: ``why`` goes on."""
    try:
        answer = call.cut_answer
        if isinstance(answer, BaseException):
            raise answer
        snap = answer if answer is not None else _as_read_by(plan, (yield _LOOK))
        change = abandoned(plan, snap, call.ran, why, handed=call.handed)
        if change is not None:
            yield Write(change, finish=True)
    except Exception:
        # After a store failure the store is likely still failing, and the caller has its error.
        level = logging.DEBUG if isinstance(why, StoreError) else logging.WARNING
        log.log(level, "twiceshy: could not give back key %s", plan.key, exc_info=True)


def _may_have_made_owner(command: object, exc: BaseException) -> bool:
    """Whether a command cut short by ``exc`` may have left this call the owner of a claim it
    will not use: any claim or write an interruption cut short (it may have committed all the
    same), a failed claim or write to CLAIMED (a take-over, a take-back, a renewal before the
    work or between attempts: its reply may be what was lost), and the work's start. A failed
    outcome write is not given back: its error says the outcome was not recorded."""
    kind = type(command)
    if kind is Claim or kind is Run:
        return True
    if kind is not Write:
        return False
    return not isinstance(exc, Exception) or cast(Write, command).change.to is State.CLAIMED


def _as_read_by(plan: CallPlan, snap: Snapshot) -> Snapshot:
    """A record read back, as its claim would have answered this call: won when this call's
    owner token holds it (no other call has that token)."""
    record = snap.record
    if record is not None and record.state is State.CLAIMED and record.owner == plan.owner:
        return make_snapshot(record, snap.now, True)
    return snap


def _outcome_of(error: BaseException, call: Call) -> Outcome:
    """How a call that raised ``error`` was answered, for its event."""
    if isinstance(error, OutcomeUnknown):
        return Outcome.UNKNOWN
    if isinstance(error, InProgress):
        return Outcome.IN_PROGRESS
    if isinstance(error, KeyReuseMismatch | MissingScope | UnkeyableArgument):
        return Outcome.REFUSED
    if isinstance(error, StoreError):
        return Outcome.STORE_ERROR
    return Outcome.EXECUTED if call.ran else call.outcome


def _way_out(policy: Policy, error: BaseException) -> str:
    """For the log: how an UNSAFE tool whose own error left its outcome unknown can say where
    its effect starts, so that an error before it releases the intent (docs/design.md §4)."""
    if policy.effect is not Effect.UNSAFE or policy.effect_at is not None:
        return ""
    cause = error.__cause__ if isinstance(error, OutcomeUnknown) else None
    return f"Next time: {MARK_THE_EFFECT}." if isinstance(cause, Exception) else ""


def _mismatch(plan: CallPlan) -> KeyReuseMismatch:
    return KeyReuseMismatch(
        f"the key {plan.key} is in use by a running call of {plan.policy.tool!r} with other "
        "arguments; this call did not run"
    )
