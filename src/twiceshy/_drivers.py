"""The sync and async drivers of the protocol: they carry out a call's commands.

Nothing here decides what happens to a record: :mod:`twiceshy._protocol` does. A driver joins a
call already running in this process, runs the protocol's commands (a store's claims and writes,
the tool's work under a renewed lease, sleeps, a reconciler's answer), gives back a claim an
interruption or a lost reply left it holding, and tells the ledger's observers how the call was
answered. A guard hands it the call as a :class:`Protection`: what the drivers need of it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar, cast

from ._binding import BoundCall
from ._inflight import Flight, Renewal
from ._protocol import (
    CallPlan,
    Claim,
    Command,
    Note,
    Now,
    Policy,
    Protocol,
    Ran,
    Reconcile,
    Run,
    Sleep,
    Wait,
    Write,
    abandoned,
    protect,
    retry_only,
)
from ._reconciling import Reconciler, areconciled, reconciled
from ._records import Effect, Outcome, Snapshot, State
from ._runtime import Around, Runtime
from ._scope import (
    CallTokens,
    Current,
    Deferred,
    reset_call,
    reset_nested,
    set_call,
    set_nested,
)
from .errors import (
    InProgress,
    KeyReuseMismatch,
    MissingScope,
    NotApplied,
    OutcomeNotRecorded,
    OutcomeUnknown,
    StoreError,
    UnkeyableArgument,
)
from .stores import AsyncStore, Store

__all__ = ["Protection", "Work", "aexecute", "execute", "nested_work"]

_T = TypeVar("_T")

log = logging.getLogger("twiceshy")

Work = Callable[[str], Any]
"""The work of one call, given the call's key (the decorator injects it into the tool)."""


@dataclass(frozen=True, slots=True)
class Protection:
    """A guard as its drivers see it: its policy, its ledger's runtime, how it plans a call.

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


class _Seen:
    """What one call's drive learned, for its event: when it began, its key, the last note.

    A call is EXECUTED unless something says otherwise: it joined a flight here, or the
    protocol noted how it answered from the record (it notes only right before that answer).
    """

    __slots__ = ("clock", "interrupted", "key", "outcome", "ran")

    def __init__(self) -> None:
        self.clock = time.perf_counter()
        self.key: str | None = None
        self.outcome = Outcome.EXECUTED
        #: An interruption of the work (a cancelled task, Ctrl-C), which must go on.
        self.interrupted: BaseException | None = None
        #: Whether the work was started (an attempt may have taken effect).
        self.ran = False


def _outcome_of(error: BaseException | None, seen: _Seen) -> Outcome:
    if isinstance(error, OutcomeUnknown):
        return Outcome.UNKNOWN
    if isinstance(error, InProgress):
        return Outcome.IN_PROGRESS
    if isinstance(error, KeyReuseMismatch | MissingScope | UnkeyableArgument):
        return Outcome.REFUSED
    if isinstance(error, StoreError):
        return Outcome.STORE_ERROR
    # A call that ran the tool is EXECUTED, even when its write was then refused and it
    # answered the record's outcome instead (a newer owner's).
    return Outcome.EXECUTED if seen.ran else seen.outcome


class _LeaderInterrupted(Exception):
    """A flight's leader was interrupted: its joined callers go to the ledger themselves."""


_JOINS: Final = 3  # flights a call joins, each ended by an interrupted leader, before InProgress


def _for_joiners(error: BaseException) -> BaseException:
    """What callers joined to a flight get when it ends in ``error``.

    An interruption of the leader (``KeyboardInterrupt``, a cancelled task) is the leader's own
    business: the joined callers are not interrupted, and ask the ledger, which the leader told
    of the doubt before it went on.
    """
    return error if isinstance(error, Exception) else _LeaderInterrupted()


def _answered(p: Protection, seen: _Seen, error: BaseException | None) -> None:
    p.runtime.answered(p.name, p.effect, seen.key, _outcome_of(error, seen), seen.clock, error)


def _join(p: Protection, plan: CallPlan, seen: _Seen) -> tuple[Flight, bool]:
    """This process's flight of the intent, and whether this call leads it."""
    seen.key = plan.key
    flight, leader = p.runtime.flights.join(plan.namespace, plan.key, plan.fingerprint)
    if not leader:
        seen.outcome = Outcome.JOINED
        if flight.fingerprint != plan.fingerprint:
            raise _mismatch(plan)
    return flight, leader


def _joined(plan: CallPlan, seen: _Seen, flight: Flight, landed: bool) -> tuple[bool, Any]:
    """A joined call's answer once its flight landed: ``(True, outcome)``, or ``(False,
    None)`` when the leader was interrupted and this call must go to the ledger itself."""
    if not landed:
        raise InProgress(plan.policy.tool, plan.key, here=True)
    try:
        return True, flight.outcome()
    except _LeaderInterrupted:
        seen.outcome = Outcome.EXECUTED  # a call of its own from now on
        return False, None


def _recalled(p: Protection, plan: CallPlan) -> Snapshot | None:
    """The settled record of the plan's key this process kept, if any (``remember=``)."""
    memo = p.runtime.memo
    return memo.recall(plan) if memo is not None else None


def _failed(
    p: Protection, plan: CallPlan, seen: _Seen, flight: Flight, error: BaseException
) -> BaseException:
    """A led call ended in ``error``: land its flight; what its caller gets (``error``, or
    an error raised from it).

    A store error after the work started says the work ran (:class:`OutcomeNotRecorded`);
    an interruption of the work goes on whatever followed it.
    """
    if seen.ran and isinstance(error, StoreError) and not isinstance(error, OutcomeNotRecorded):
        cause = error
        error = OutcomeNotRecorded(plan.policy.tool, plan.key, str(cause))
        error.__cause__ = cause
    p.runtime.flights.land(plan.namespace, plan.key, flight, None, _for_joiners(error))
    interrupted = seen.interrupted
    if interrupted is not None and error is not interrupted:
        raise interrupted from error
    return error


def _enter(p: Protection, plan: CallPlan, command: Run) -> tuple[Renewal, Current, CallTokens]:
    """Start renewing the lease and make the call current, before the work runs."""
    heartbeat, policy = p.runtime.heartbeat, plan.policy
    job = heartbeat.start(
        plan.namespace, plan.key, command.fence, plan.owner, policy.lease, command.trusted_until
    )
    try:
        current = Current(
            plan.key,
            policy.tool,
            policy.effect,
            effect_at=policy.effect_at,
            confirm=functools.partial(heartbeat.confirm, job, policy.effect, policy.tool),
        )
        return job, current, set_call(current)
    except BaseException:  # Ctrl-C right here: no renewal may outlive the call
        heartbeat.stop(job)
        raise


def _leave(p: Protection, job: Renewal, tokens: CallTokens) -> None:
    reset_call(tokens)
    p.runtime.heartbeat.stop(job)


# -- the blocking driver ---------------------------------------------------------------


def execute(p: Protection, bound: BoundCall, work: Work, scope: str | None) -> Any:
    arounds = p.runtime.arounds
    if arounds:
        with Around(arounds, p.name, p.effect):
            return _execute_told(p, bound, work, scope)
    return _execute_told(p, bound, work, scope)


def _execute_told(p: Protection, bound: BoundCall, work: Work, scope: str | None) -> Any:
    seen = _Seen()
    try:
        value = _execute_once(p, bound, work, scope, seen)
    except BaseException as exc:
        _answered(p, seen, exc)
        raise
    _answered(p, seen, None)
    return value


def _execute_once(
    p: Protection, bound: BoundCall, work: Work, scope: str | None, seen: _Seen
) -> Any:
    if not p.recorded:
        nested = p.nesting(work, bound, scope)
        return _drive(p, retry_only(p.policy), nested, None, bound, seen)
    plan = p.plan(bound, scope)
    flights = p.runtime.flights
    wait_until = time.monotonic() + p.policy.wait  # one wait= for the whole call
    for _ in range(_JOINS):
        flight, leader = _join(p, plan, seen)
        if leader:
            break
        landed = flight.wait(max(wait_until - time.monotonic(), 0.0))
        done, value = _joined(plan, seen, flight, landed)
        if done:
            return value
    else:
        raise InProgress(plan.policy.tool, plan.key, here=True)
    try:
        protocol = protect(plan, _recalled(p, plan), wait_until)
        value = _drive(p, protocol, work, plan, bound, seen)
    except BaseException as exc:
        raise _failed(p, plan, seen, flight, exc)  # noqa: B904 - it is exc, or from it
    flights.land(plan.namespace, plan.key, flight, value, None)
    return value


def _drive(
    p: Protection,
    protocol: Protocol,
    work: Work,
    plan: CallPlan | None,
    bound: BoundCall,
    seen: _Seen,
) -> Any:
    store, memo = p.runtime.store, p.runtime.memo
    answer: Any = None
    while True:
        try:
            command = protocol.send(answer)
        except StopIteration as stop:
            return stop.value
        kind = type(command)
        if kind is Claim or kind is Write or kind is Wait:
            assert plan is not None  # an unrecorded call only runs and sleeps
            sent = time.monotonic()
            try:
                answer = _store_op(store, command, plan)
            except BaseException as exc:
                if _may_have_made_owner(command, exc):
                    _give_back(store, plan, seen, exc)
                raise
            if memo is not None:
                memo.keep(plan, answer, sent)
        elif kind is Run:
            try:
                answer = _run(p, work, plan, cast("Run", command), seen)
            except BaseException as exc:  # only before the work started: nothing ran
                if plan is not None:
                    _give_back(store, plan, seen, exc)
                raise
        elif kind is Note:
            seen.outcome = cast("Note", command).outcome
            answer = None
        elif kind is Now:
            answer = time.monotonic()
        elif kind is Sleep:
            try:
                time.sleep(cast("Sleep", command).seconds)
                answer = None
            except BaseException as exc:  # Ctrl-C: the protocol records it, then raises it
                answer = seen.interrupted = exc
        elif kind is Reconcile and plan is not None:
            assert p.reconcile is not None
            answer = reconciled(p.reconcile, plan.key, bound.arguments)
            if inspect.isawaitable(answer):
                close = getattr(answer, "close", None)
                if callable(close):
                    close()
                raise TypeError("a blocking call needs a blocking reconcile= function")
        else:  # pragma: no cover - the protocol yields nothing else
            raise AssertionError(command)


def _run(p: Protection, work: Work, plan: CallPlan | None, command: Run, seen: _Seen) -> Ran:
    if plan is None:
        try:
            return Ran(value=work(""))
        except Exception as exc:
            return Ran(error=exc)
    job, current, tokens = _enter(p, plan, command)  # interrupted here: it never ran
    seen.ran = True
    try:
        value = work(plan.key)
    except Exception as exc:
        return Ran(error=exc, marked=current.marked)
    except BaseException as exc:  # the protocol records the doubt, then raises it again
        seen.interrupted = exc
        return Ran(error=exc, marked=current.marked)
    finally:
        _leave(p, job, tokens)
    if inspect.isawaitable(value):
        # An async tool protected as a blocking one (a plain decorator around an async def):
        # nothing has run yet, and nothing will. Released, with an error that says why.
        close = getattr(value, "close", None)
        if callable(close):
            close()
        return Ran(error=_ReturnedAwaitable(plan.policy.tool))
    return Ran(value=value)


def _give_back(store: Store, plan: CallPlan, seen: _Seen, why: BaseException) -> None:
    """A claim, a write or the work's start was cut short (an interruption, or a store
    failure that may have lost the reply): what the store holds is looked at, and a claim
    this call owns but will never use is given back (:func:`abandoned`), so no retry waits
    out its lease. Best effort: ``why`` goes on."""
    try:
        snap = _as_read_by(plan, store.get(plan.namespace, plan.key))
        change = abandoned(plan, snap, seen.ran, why)
        if change is not None:
            store.write(plan.namespace, plan.key, change)
    except Exception:
        _could_not_give_back(plan, why)


# -- the async driver ------------------------------------------------------------------


async def aexecute(p: Protection, bound: BoundCall, work: Work, scope: str | None) -> Any:
    arounds = p.runtime.arounds
    if arounds:
        with Around(arounds, p.name, p.effect):
            return await _aexecute_told(p, bound, work, scope)
    return await _aexecute_told(p, bound, work, scope)


async def _aexecute_told(p: Protection, bound: BoundCall, work: Work, scope: str | None) -> Any:
    seen = _Seen()
    try:
        value = await _aexecute_once(p, bound, work, scope, seen)
    except BaseException as exc:
        _answered(p, seen, exc)
        raise
    _answered(p, seen, None)
    return value


async def _aexecute_once(
    p: Protection, bound: BoundCall, work: Work, scope: str | None, seen: _Seen
) -> Any:
    if not p.recorded:
        nested = p.nesting(work, bound, scope)
        return await _adrive(p, retry_only(p.policy), nested, None, bound, seen)
    plan = p.plan(bound, scope)
    flights = p.runtime.flights
    wait_until = time.monotonic() + p.policy.wait  # one wait= for the whole call
    for _ in range(_JOINS):
        flight, leader = _join(p, plan, seen)
        if leader:
            break
        landed = await flight.wait_async(max(wait_until - time.monotonic(), 0.0))
        done, value = _joined(plan, seen, flight, landed)
        if done:
            return value
    else:
        raise InProgress(plan.policy.tool, plan.key, here=True)
    try:
        protocol = protect(plan, _recalled(p, plan), wait_until)
        value = await _adrive(p, protocol, work, plan, bound, seen)
    except BaseException as exc:
        raise _failed(p, plan, seen, flight, exc)  # noqa: B904 - it is exc, or from it
    flights.land(plan.namespace, plan.key, flight, value, None)
    return value


async def _adrive(
    p: Protection,
    protocol: Protocol,
    work: Work,
    plan: CallPlan | None,
    bound: BoundCall,
    seen: _Seen,
) -> Any:
    store, memo = p.runtime.async_store, p.runtime.memo
    answer: Any = None
    while True:
        try:
            command = protocol.send(answer)
        except StopIteration as stop:
            return stop.value
        kind = type(command)
        if kind is Claim or kind is Write or kind is Wait:
            assert plan is not None  # an unrecorded call only runs and sleeps
            sent = time.monotonic()
            answer = await _astore_op(store, command, plan, seen)
            if memo is not None:
                memo.keep(plan, answer, sent)
        elif kind is Run:
            try:
                answer = await _arun(p, work, plan, cast("Run", command), seen)
            except BaseException as exc:  # only before the work started: nothing ran
                if plan is not None:
                    await _agive_back(store, plan, seen, exc)
                raise
        elif kind is Note:
            seen.outcome = cast("Note", command).outcome
            answer = None
        elif kind is Now:
            answer = time.monotonic()
        elif kind is Sleep:
            try:
                await asyncio.sleep(cast("Sleep", command).seconds)
                answer = None
            except BaseException as exc:  # cancelled: the protocol records it, raises it
                answer = seen.interrupted = exc
        elif kind is Reconcile and plan is not None:
            assert p.reconcile is not None
            answer = await areconciled(p.reconcile, plan.key, bound.arguments)
        else:  # pragma: no cover - the protocol yields nothing else
            raise AssertionError(command)


async def _astore_op(store: AsyncStore, command: Command, plan: CallPlan, seen: _Seen) -> Snapshot:
    """Carry out a store command; a cancellation lets a claim or a write finish first.

    A claim or write cut off half-way may still commit (in the store's thread, on the
    server): it could leave this call the owner of work it will never run, or leave an
    outcome unrecorded. So it runs to its end, shielded, and what it left is then given
    back (:func:`abandoned`) before the cancellation goes on.
    """
    pending = _store_op(store, command, plan)
    if type(command) is Wait:  # an interrupted wait owns nothing: it just stops waiting
        return cast(Snapshot, await pending)
    task = asyncio.ensure_future(pending)
    try:
        return cast(Snapshot, await asyncio.shield(task))
    except asyncio.CancelledError as cancelled:
        # Cancelled again meanwhile (a task group shutting down), it still runs to its end.
        await _agive_back(store, plan, seen, cancelled, task)
        raise cancelled from None
    except Exception as exc:
        if _may_have_made_owner(command, exc):
            await _agive_back(store, plan, seen, exc)
        raise


async def _agive_back(
    store: AsyncStore,
    plan: CallPlan,
    seen: _Seen,
    why: BaseException,
    command: Awaitable[Snapshot] | None = None,
) -> None:
    """What :meth:`_give_back` does, for the async driver; ``command``: the interrupted
    claim or write, whose answer shows what the store holds (else it is read)."""
    try:
        if command is not None:
            snap = await _to_the_end(command)
        else:
            snap = _as_read_by(plan, await _to_the_end(store.get(plan.namespace, plan.key)))
        change = abandoned(plan, snap, seen.ran, why)
        if change is not None:
            await _to_the_end(store.write(plan.namespace, plan.key, change))
    except Exception:
        _could_not_give_back(plan, why)


async def _arun(p: Protection, work: Work, plan: CallPlan | None, command: Run, seen: _Seen) -> Ran:
    if plan is None:
        try:
            return Ran(value=await work(""))
        except Exception as exc:
            return Ran(error=exc)
    job, current, tokens = _enter(p, plan, command)  # interrupted here: it never ran
    seen.ran = True
    try:
        value = await work(plan.key)
    except Exception as exc:
        return Ran(error=exc, marked=current.marked)
    except BaseException as exc:  # the protocol records the doubt, then raises it again
        seen.interrupted = exc
        return Ran(error=exc, marked=current.marked)
    finally:
        _leave(p, job, tokens)
    return Ran(value=value)


def nested_work(work: Work, deferred: Deferred) -> Work:
    """``work`` run with ``deferred`` as the scope of the runs started inside it; an awaitable
    it answers is awaited inside it too."""

    def run(key: str) -> Any:
        token = set_nested(deferred)
        try:
            value = work(key)
        finally:
            reset_nested(token)
        if inspect.isawaitable(value):
            return _awaited_nested(value, deferred)
        return value

    return run


async def _awaited_nested(awaitable: Awaitable[Any], deferred: Deferred) -> Any:
    token = set_nested(deferred)
    try:
        return await awaitable
    finally:
        reset_nested(token)


def _could_not_give_back(plan: CallPlan, why: BaseException) -> None:
    # After a store failure the store is likely still failing, and the caller has its error.
    level = logging.DEBUG if isinstance(why, StoreError) else logging.WARNING
    log.log(level, "twiceshy: could not give back key %s", plan.key, exc_info=True)


def _may_have_made_owner(command: Command, exc: BaseException) -> bool:
    """Whether a store command cut short by ``exc`` may have left this call the owner of a
    claim it will not use: any claim or write an interruption cut short (it may have committed
    all the same), and a failed claim or write to CLAIMED (a take-over, a take-back, a renewal
    before the work or between attempts: its reply may be what was lost). Whatever is found is
    given back (:func:`abandoned`); a failed outcome write is not: its error says the outcome
    was not recorded."""
    kind = type(command)
    if kind is Claim:
        return True
    if kind is not Write:
        return False
    return not isinstance(exc, Exception) or cast(Write, command).change.to is State.CLAIMED


def _as_read_by(plan: CallPlan, snap: Snapshot) -> Snapshot:
    """A record read back, as its claim would have answered this call: won when this call's
    owner token holds it (no other call has that token)."""
    record = snap.record
    if record is not None and record.state is State.CLAIMED and record.owner == plan.owner:
        return Snapshot(record, snap.now, True)
    return snap


async def _to_the_end(awaitable: Awaitable[_T]) -> _T:
    """Await to its end however often the awaiting task is cancelled meanwhile."""
    task = asyncio.ensure_future(awaitable)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                return task.result()


def _store_op(store: Store | AsyncStore, command: Command, plan: CallPlan) -> Any:
    """Carry out a store command: the store's answer, or for an async store its awaitable."""
    if type(command) is Write:
        return store.write(plan.namespace, plan.key, command.change)
    if type(command) is Claim:
        policy = plan.policy
        return store.claim(
            plan.namespace,
            plan.key,
            fingerprint=plan.fingerprint,
            tool=policy.tool,
            effect=policy.effect,
            owner=plan.owner,
            lease=policy.lease,
        )
    assert type(command) is Wait
    return store.wait(plan.namespace, plan.key, command.fence, command.timeout)


class _ReturnedAwaitable(NotApplied, TypeError):
    """A blocking tool answered an awaitable: it did not run; the intent is released."""

    def __init__(self, tool: str) -> None:
        super().__init__(
            f"the tool {tool!r} returned an awaitable instead of running: it is async but was "
            "protected as a blocking tool; protect the async function itself (an async def, or "
            "a wrapper that is one)"
        )


def _mismatch(plan: CallPlan) -> KeyReuseMismatch:
    return KeyReuseMismatch(
        f"the key {plan.key} is in use by a running call of {plan.policy.tool!r} with other "
        "arguments; this call did not run"
    )
