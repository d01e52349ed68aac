"""The drivers: they carry one call's commands to the rooms that serve them.

A call is one generator (:func:`twiceshy._call.called`), which decides everything; a driver
sends it each command's answer, or throws in the failure of the room that served it, until the
call returns its result. The loop that does so is written once, as a coroutine: the async driver
awaits it, and the blocking driver runs it to its end with no event loop, since no blocking room
ever suspends it. Only the rooms that do I/O come twice, as a blocking and an async function.

The rooms: the store (with this process's remembered outcomes in front of it), the work (run
under a renewed lease, as the current call), the flights of this process, the clock and sleeps,
the reconciler, the observers.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Final, TypeVar

from ._binding import BoundCall
from ._call import AwaitFlight, Call, Look, Protection, Work, called
from ._commands import Claim, Note, Now, Ran, Reconcile, Run, Sleep, Wait, Write
from ._reconciling import areconciled, reconciled
from ._records import Snapshot
from ._scope import Current, Deferred, reset_call, reset_nested, set_call, set_nested
from .errors import NotApplied
from .stores import AsyncStore, Store

__all__ = ["aexecute", "execute", "nested_work"]

_T = TypeVar("_T")

Room = Callable[[Any, Call], Any]
"""What serves one kind of command: ``room(command, call)``, its answer (async: an awaitable)."""


def execute(p: Protection, bound: BoundCall, work: Work, scope: str | None) -> Any:
    """Run one call of a guard's tool, blocking: its result, or the error its caller gets."""
    call = Call(p, bound, work, scope)
    driving = _carry(called(call), call, _BLOCKING, _NOTHING)
    try:
        driving.send(None)
    except StopIteration as done:
        return done.value
    driving.close()  # pragma: no cover - a blocking room never suspends the loop
    raise AssertionError("a blocking call was suspended")  # pragma: no cover


async def aexecute(p: Protection, bound: BoundCall, work: Work, scope: str | None) -> Any:
    """Run one call of a guard's tool, for async code: its result, or its caller's error."""
    call = Call(p, bound, work, scope)
    return await _carry(called(call), call, _ASYNC, _AWAITED)


async def _carry(
    calling: Generator[Any, Any, Any],
    call: Call,
    rooms: dict[type, Room],
    awaited: frozenset[type],
) -> Any:
    """The one loop of both drivers: each command to its room, each answer (or failure) back."""
    answer: Any = None
    failure: BaseException | None = None
    while True:
        try:
            command = calling.send(answer) if failure is None else calling.throw(failure)
        except StopIteration as done:
            return done.value
        kind = type(command)
        failure = None
        try:
            answer = rooms[kind](command, call)
            if kind in awaited:
                answer = await answer
        except BaseException as exc:  # thrown into the call, which decides what follows
            call.cut, failure = command, exc


# -- rooms without I/O, shared -----------------------------------------------------------------


def _now(command: Now, call: Call) -> float:
    return time.monotonic()


def _note(command: Note, call: Call) -> None:
    call.outcome = command.outcome


# -- the store ---------------------------------------------------------------------------------


def _recalled(command: Claim | Write | Wait | Look, call: Call) -> Snapshot | None:
    """A claim answered by the settled record of its key this process kept (``remember=``):
    such a record changes only by expiring."""
    memo = call.protection.runtime.memo
    if memo is None or type(command) is not Claim:
        return None
    assert call.plan is not None
    return memo.recall(call.plan)


def _kept(call: Call, answer: Snapshot, sent: float) -> Snapshot:
    """A store's answer, kept when it is a settled record and outcomes are remembered."""
    memo = call.protection.runtime.memo
    if memo is not None:
        assert call.plan is not None
        memo.keep(call.plan, answer, sent)
    return answer


def _stored(command: Claim | Write | Wait | Look, call: Call) -> Snapshot:
    runtime = call.protection.runtime
    if runtime.memo is None:
        return _store_op(runtime.store, command, call)  # type: ignore[no-any-return]
    recalled = _recalled(command, call)
    if recalled is not None:
        return recalled
    sent = time.monotonic()
    return _kept(call, _store_op(call.protection.runtime.store, command, call), sent)


async def _astored(command: Claim | Write | Wait | Look, call: Call) -> Snapshot:
    recalled = _recalled(command, call)
    if recalled is not None:
        return recalled
    sent = time.monotonic()
    pending = _store_op(call.protection.runtime.async_store, command, call)
    return _kept(call, await _carried(pending, command, call), sent)


async def _carried(
    pending: Awaitable[Snapshot], command: Claim | Write | Wait | Look, call: Call
) -> Snapshot:
    """An async store command awaited; a cancellation lets a claim or a write finish first.

    A claim or write cut off half-way may still commit (in the store's thread, on the server):
    it could leave this call the owner of work it will never run, or leave an outcome
    unrecorded. So it runs to its end, shielded, and its answer is kept for the call, which gives
    back what it left before the cancellation goes on. A give-back's own read and write run to
    their end however often the call is cancelled; an interrupted wait owns nothing.
    """
    kind = type(command)
    if kind is Wait:
        return await pending
    if kind is Look or (kind is Write and command.finish):  # type: ignore[union-attr]
        return await _to_the_end(pending)
    task = asyncio.ensure_future(pending)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            call.cut_answer = await _to_the_end(task)
        except Exception as failed:
            call.cut_answer = failed
        raise


async def _to_the_end(awaitable: Awaitable[_T]) -> _T:
    """Await to its end however often the awaiting task is cancelled meanwhile."""
    task = asyncio.ensure_future(awaitable)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                return task.result()


def _store_op(store: Store | AsyncStore, command: Claim | Write | Wait | Look, call: Call) -> Any:
    """Carry out a store command: the store's answer, or for an async store its awaitable."""
    plan = call.plan
    assert plan is not None  # an unrecorded call only runs and sleeps
    kind = type(command)
    if kind is Write:
        return store.write(plan.namespace, plan.key, command.change)  # type: ignore[union-attr]
    if kind is Claim:
        policy = plan.policy
        if plan.args is None:  # a tool that keeps no arguments works with any store
            return store.claim(
                plan.namespace,
                plan.key,
                fingerprint=plan.fingerprint,
                tool=policy.tool,
                effect=policy.effect,
                owner=plan.owner,
                lease=policy.lease,
            )
        return store.claim(
            plan.namespace,
            plan.key,
            fingerprint=plan.fingerprint,
            tool=policy.tool,
            effect=policy.effect,
            owner=plan.owner,
            lease=policy.lease,
            args=plan.args,
        )
    if kind is Wait:
        return store.wait(plan.namespace, plan.key, command.fence, command.timeout)  # type: ignore[union-attr]
    return store.get(plan.namespace, plan.key)


# -- the work ----------------------------------------------------------------------------------


def _run(command: Run, call: Call) -> Ran:
    key = _begin(command, call)  # interrupted here: it never ran
    try:
        value = call.work(key)
    except BaseException as exc:
        return _raised(call, exc)
    return _returned(call, value, blocking=True)


async def _arun(command: Run, call: Call) -> Ran:
    key = _begin(command, call)  # interrupted here: it never ran
    try:
        value = await call.work(key)
    except BaseException as exc:
        return _raised(call, exc)
    return _returned(call, value, blocking=False)


def _begin(command: Run, call: Call) -> str:
    """Start an attempt: renew its lease, make it the current call; the key the work gets."""
    plan = call.plan
    if plan is None:
        return ""  # a SAFE call kept out of the ledger has no key
    heartbeat, policy = call.protection.runtime.heartbeat, plan.policy
    job = heartbeat.start(
        plan.namespace, plan.key, command.fence, plan.owner, policy.lease, command.trusted_until
    )
    try:
        current = Current(
            plan.key,
            policy.tool,
            policy.effect,
            policy.effect_at,
            functools.partial(heartbeat.confirm, job, policy.effect, policy.tool),
        )
        call.attempt = (job, current, set_call(current))
    except BaseException:  # Ctrl-C right here: no renewal may outlive the call
        heartbeat.stop(job)
        raise
    call.ran = True
    return plan.key


def _ended(call: Call) -> Current:
    """End the attempt: no more renewals, no longer current; what it did (marked, handed)."""
    job, current, tokens = call.attempt
    call.attempt = None
    reset_call(tokens)
    call.protection.runtime.heartbeat.stop(job)
    if not (current.handed or current.sent):
        call.handed = False
    return current  # type: ignore[no-any-return]


def _raised(call: Call, error: BaseException) -> Ran:
    if call.plan is None:
        if isinstance(error, Exception):
            return Ran(error=error)
        raise error  # a call kept out of the ledger leaves no doubt to record
    if not isinstance(error, Exception):  # the protocol records the doubt, then raises it
        call.interrupted = error
    current = _ended(call)
    return Ran(error=error, marked=current.marked, handed=current.handed or bool(current.sent))


def _returned(call: Call, value: object, *, blocking: bool) -> Ran:
    if call.plan is None:
        return Ran(value=value)
    _ended(call)
    kind = type(value)
    if kind in _NEVER_AWAITED:
        return Ran(value=value)
    if kind is types.GeneratorType or kind is types.AsyncGeneratorType:
        # A generator function protected through a guard (the decorator refuses them): its
        # body has not run, and would run as its caller iterates, outside the claim. Released.
        _closed(value)
        return Ran(error=_ReturnedGenerator(call.protection.name))
    if blocking and inspect.isawaitable(value):
        # An async tool protected as a blocking one (a plain decorator around an async def):
        # nothing has run yet, and nothing will. Released, with an error that says why.
        _closed(value)
        return Ran(error=_ReturnedAwaitable(call.protection.name))
    return Ran(value=value)


def _closed(value: object) -> None:
    """Close a coroutine or generator that will never run (no "never awaited" warning)."""
    close = getattr(value, "close", None)
    if callable(close):
        result = close()
        if inspect.isawaitable(result):  # an async generator's aclose(): never started
            _closed(result)


_NEVER_AWAITED: Final = frozenset({dict, list, str, int, float, bool, type(None), tuple, bytes})
"""What tools return most, and no awaitable is (``inspect.isawaitable`` asks an ABC)."""


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


# -- sleeps, reconcilers, flights --------------------------------------------------------------


def _sleep(command: Sleep, call: Call) -> BaseException | None:
    try:
        time.sleep(command.seconds)
    except BaseException as exc:  # Ctrl-C: the protocol records it, then raises it
        return _interruption(call, exc)
    return None


async def _asleep(command: Sleep, call: Call) -> BaseException | None:
    try:
        await asyncio.sleep(command.seconds)
    except BaseException as exc:  # cancelled: the protocol records it, then raises it
        return _interruption(call, exc)
    return None


def _interruption(call: Call, exc: BaseException) -> BaseException:
    call.interrupted = exc
    return exc


def _reconcile(command: Reconcile, call: Call) -> object:
    reconcile, plan = call.protection.reconcile, call.plan
    assert reconcile is not None
    assert plan is not None
    answer = reconciled(reconcile, plan.key, call.bound.arguments)
    if inspect.isawaitable(answer):
        close = getattr(answer, "close", None)
        if callable(close):
            close()
        raise TypeError("a blocking call needs a blocking reconcile= function")
    return answer


def _areconcile(command: Reconcile, call: Call) -> Coroutine[Any, Any, object]:
    reconcile, plan = call.protection.reconcile, call.plan
    assert reconcile is not None
    assert plan is not None
    return areconciled(reconcile, plan.key, call.bound.arguments)


def _await_flight(command: AwaitFlight, call: Call) -> bool:
    return command.flight.wait(command.timeout)


def _aawait_flight(command: AwaitFlight, call: Call) -> Awaitable[bool]:
    return command.flight.wait_async(command.timeout)


_SHARED: Final[dict[type, Room]] = {Now: _now, Note: _note}
_BLOCKING: Final[dict[type, Room]] = {
    **_SHARED,
    Claim: _stored,
    Write: _stored,
    Wait: _stored,
    Look: _stored,
    Run: _run,
    Sleep: _sleep,
    Reconcile: _reconcile,
    AwaitFlight: _await_flight,
}
_ASYNC: Final[dict[type, Room]] = {
    **_SHARED,
    Claim: _astored,
    Write: _astored,
    Wait: _astored,
    Look: _astored,
    Run: _arun,
    Sleep: _asleep,
    Reconcile: _areconcile,
    AwaitFlight: _aawait_flight,
}
_NOTHING: Final[frozenset[type]] = frozenset()
_AWAITED: Final = frozenset(_ASYNC) - frozenset(_SHARED)
"""The commands whose async rooms answer an awaitable."""


class _ReturnedGenerator(NotApplied, TypeError):
    """A tool answered a generator: its body did not run; the intent is released."""

    def __init__(self, tool: str) -> None:
        super().__init__(
            f"the tool {tool!r} returned a generator instead of running: its body would run as "
            "its caller iterates, after the call is recorded, outside any claim; return a list "
            "(collect the items inside the tool) instead"
        )


class _ReturnedAwaitable(NotApplied, TypeError):
    """A blocking tool answered an awaitable: it did not run; the intent is released."""

    def __init__(self, tool: str) -> None:
        super().__init__(
            f"the tool {tool!r} returned an awaitable instead of running: it is async but was "
            "protected as a blocking tool; protect the async function itself (an async def, or "
            "a wrapper that is one)"
        )
