"""The ledger, its guards and its tool decorator: the sync and async drivers of the protocol.

Nothing here decides anything about a call: :mod:`twiceshy._protocol` does. A driver derives the
key, joins a call already running in this process, and carries out the protocol's commands,
blocking or with ``await``.

Layers, from the bottom:

- :class:`Guard` protects one tool given its arguments as a mapping and its work as a callable;
  framework adapters use it, since they see a tool call as a name and a dict of arguments.
- :meth:`Ledger.tool` is a decorator that binds a Python function's arguments by name and hands
  the call to a guard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import itertools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, Literal, ParamSpec, TypeVar, cast

from ._binding import Binder, BoundCall, calls_point_of_no_return
from ._canonical import MAX_BYTES, MAX_DEPTH
from ._codec import MAX_RESULT_BYTES, ResultCodec, ReturnOf
from ._inflight import Flight, Flights, Heartbeat, Renewal
from ._memo import Remembered
from ._protocol import (
    CallPlan,
    Claim,
    Command,
    DidNotHappen,
    Happened,
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
    describe,
    exponential_backoff,
    protect,
    retry_only,
    settle,
)
from ._records import CallEvent, Effect, Outcome, Record, Snapshot, State
from ._scope import (
    CallTokens,
    Current,
    Deferred,
    entered_scope,
    reset_call,
    reset_nested,
    set_call,
    set_nested,
)
from ._tally import Tally
from .errors import (
    InProgress,
    KeyReuseMismatch,
    MissingScope,
    NotApplied,
    OutcomeNotRecorded,
    OutcomeUnknown,
    ResultNotStorable,
    StoreError,
    UnkeyableArgument,
    clearing,
)
from .stores import AsyncStore, CallCounts, Store, default_url, open_store, redacted_url

__all__ = ["Guard", "Ledger"]

P = ParamSpec("P")
R = TypeVar("R")
_T = TypeVar("_T")

log = logging.getLogger("twiceshy")

Duration = float | timedelta
Reconciler = Callable[[str, Mapping[str, Any] | None], Any]
"""``reconcile(key, arguments)``: ``Happened(result)``, ``DidNotHappen()`` or ``None``.

``arguments`` is ``None`` when an operator reconciles a parked record outside any call
(:meth:`Guard.settle`, ``twiceshy reconcile``): the ledger keeps no arguments, only their
fingerprint, so a reconciler that can look the effect up by the key alone serves both cases.
"""

_Work = Callable[[str], Any]
"""The work of one call, given the call's key (the decorator injects it into the tool)."""

Observer = Callable[[CallEvent], None]
"""Told of every protected call once it is answered (metrics, traces).

An observer may also have a method ``around(tool, effect)`` returning a context manager: it is
entered in the caller's context before the call starts and left once the call is answered (after
the observer is told), so what the tool does inside it (a tracer's spans) nests under it.
"""


class _Around:
    """The observers' contexts around one call; an observer that fails is logged and left out."""

    __slots__ = ("_entered", "_tool")

    def __init__(self, arounds: tuple[Callable[[str, Effect], Any], ...], guard: Guard) -> None:
        self._tool = guard.name
        self._entered: list[Any] = []
        for around in arounds:
            try:
                context = around(guard.name, guard.effect)
                context.__enter__()
            except Exception:
                log.exception("twiceshy: an observer failed around %s", guard.name)
                continue
            self._entered.append(context)

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for context in reversed(self._entered):
            try:
                context.__exit__(kind, exc, tb)  # never allowed to swallow the call's error
            except Exception:
                log.exception("twiceshy: an observer failed around %s", self._tool)


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


async def _awaited(answer: Awaitable[Any], key: str) -> Any:
    try:
        return _answer(await answer, key)
    except Exception:
        log.warning("twiceshy: reconcile of key %s failed", key, exc_info=True)
        return None


def _seconds(value: Duration, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        raise ValueError(f"{name}= must not be negative")
    return seconds


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


def _reconciled(reconcile: Reconciler, key: str, arguments: Mapping[str, Any] | None) -> Any:
    """Ask a reconciler; a reconciler that fails cannot tell, and the doubt stands."""
    try:
        return _answer(reconcile(key, arguments), key)
    except Exception:
        log.warning("twiceshy: reconcile of key %s failed", key, exc_info=True)
        return None


def _answer(answer: Any, key: str) -> Any:
    """A reconciler's answer; one that is none of the three it may give is said in the log."""
    if answer is None or isinstance(answer, Happened | DidNotHappen) or inspect.isawaitable(answer):
        return answer
    log.warning(
        "twiceshy: the reconciler of key %s answered %r, which is not Happened(...), "
        "DidNotHappen() or None: taken as None (it cannot tell)",
        key,
        answer,
    )
    return None


async def _areconciled(reconcile: Reconciler, key: str, arguments: Mapping[str, Any] | None) -> Any:
    """Ask a reconciler from async code: awaited if async, in a worker thread if blocking (it
    looks at a provider: it must not stop the event loop meanwhile)."""
    if _is_async(reconcile):
        answer = _reconciled(reconcile, key, arguments)
    else:
        answer = await asyncio.to_thread(_reconciled, reconcile, key, arguments)
    if inspect.isawaitable(answer):
        return await _awaited(answer, key)
    return answer


class Guard:
    """One protected tool: its policy, bound to a ledger. Immutable; share it.

    Made by :meth:`Ledger.guard` (and by :meth:`Ledger.tool` under the hood). A framework adapter
    that sees a tool call as a name and a mapping of arguments calls :meth:`call` or
    :meth:`acall` with the arguments and the work to run; the work finds the key in
    :func:`twiceshy.current_key`.
    """

    __slots__ = (
        "_ignore_args",
        "_key_args",
        "_ledger",
        "_max_bytes",
        "_max_depth",
        "_reconcile",
        "_scope",
        "policy",
        "recorded",
    )

    def __init__(
        self,
        ledger: Ledger,
        policy: Policy,
        *,
        recorded: bool,
        reconcile: Reconciler | None,
        scope: Callable[[Mapping[str, Any]], str] | None,
        key_args: Collection[str] | None,
        ignore_args: Collection[str],
        max_arg_bytes: int = MAX_BYTES,
        max_arg_depth: int = MAX_DEPTH,
    ) -> None:
        if key_args is not None and ignore_args:
            raise ValueError("give key_args= or ignore_args=, not both")
        for option, bound in (("max_arg_bytes", max_arg_bytes), ("max_arg_depth", max_arg_depth)):
            if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
                raise ValueError(f"{option}= must be a whole number of at least 1")
        self._ledger = ledger
        self.policy = policy
        self.recorded = recorded
        self._reconcile = reconcile
        self._scope = scope
        self._key_args = frozenset(key_args) if key_args is not None else None
        self._ignore_args = frozenset(ignore_args)
        self._max_bytes = max_arg_bytes
        self._max_depth = max_arg_depth

    @property
    def name(self) -> str:
        """The tool's name in keys."""
        return self.policy.tool

    @property
    def effect(self) -> Effect:
        """The tool's effect class."""
        return self.policy.effect

    def __repr__(self) -> str:
        return f"Guard({self.name!r}, effect={self.effect.name}, ledger={self._ledger!r})"

    def bind(self, arguments: Mapping[str, Any], *, key: str | None = None) -> BoundCall:
        """A call given by its arguments by name, narrowed by ``key_args`` / ``ignore_args``."""
        return BoundCall.of(
            arguments, key_args=self._key_args, ignore_args=self._ignore_args, explicit_key=key
        )

    def call(
        self,
        arguments: Mapping[str, Any],
        work: Callable[[], R],
        *,
        scope: str | None = None,
        key: str | None = None,
    ) -> R:
        """Run ``work`` at most once for the intent ``(scope, tool, arguments)``; blocking.

        Args:
            arguments: the call's arguments by name; they name the intent.
            work: runs the tool (``twiceshy.current_key()`` is set while it runs).
            scope: the run's scope; by default the innermost ``twiceshy.run(...)``.
            key: an explicit key instead of one derived from scope and arguments.

        Returns:
            The result of this call's run, or of the first run, replayed.

        Raises:
            MissingScope, UnkeyableArgument, KeyReuseMismatch: before anything runs.
            OutcomeUnknown, InProgress: the honest answers for the model.
            StoreError: the ledger failed; nothing ran unprotected.
        """
        return cast("R", self._execute(self.bind(arguments, key=key), lambda _key: work(), scope))

    async def acall(
        self,
        arguments: Mapping[str, Any],
        work: Callable[[], Awaitable[R]],
        *,
        scope: str | None = None,
        key: str | None = None,
    ) -> R:
        """:meth:`call` for async work."""
        bound = self.bind(arguments, key=key)
        return cast("R", await self._aexecute(bound, lambda _key: work(), scope))

    def with_errors(
        self,
        *,
        definite: Collection[type[BaseException]] = (),
        not_applied: Collection[type[BaseException]] = (),
        wrappers: Collection[type[BaseException]] = (),
    ) -> Guard:
        """This guard, reading more exception types as certain failures or as "nothing happened".

        For adapters: a framework's own "the tool failed for certain" exception can be added to a
        guard the user built, without rebuilding it. ``wrappers`` are a framework's exception
        types that carry the tool's own error as their ``__cause__``: an unknown outcome's reason
        names that error, never the wrapper.
        """
        return self._replaced(
            definite=(*self.policy.definite, *definite),
            not_applied=(*self.policy.not_applied, *not_applied),
            wrappers=(*self.policy.wrappers, *wrappers),
        )

    def with_stored_answers(self) -> Guard:
        """This guard, answering the call that runs the tool with its result as stored.

        Every retry gets the stored result, rebuilt as the return type; with this, the first
        caller gets the same (a result that could not be kept excepted: the first caller gets
        it as it was). For adapters whose model reads a text made from the result: it then reads
        the same text on the first call and on every retry.
        """
        return self._replaced(answer_stored=True)

    def key_for(
        self, arguments: Mapping[str, Any], *, scope: str | None = None, key: str | None = None
    ) -> str:
        """The key a call of this tool with ``arguments`` goes by (as :meth:`call` derives it).

        Raises:
            MissingScope, UnkeyableArgument: as :meth:`call`, before anything runs.
        """
        return self._plan(self.bind(arguments, key=key), scope).key

    def _replaced(self, **policy: Any) -> Guard:
        """This guard with ``policy`` fields replaced (a guard is immutable)."""
        return Guard(
            self._ledger,
            dataclasses.replace(self.policy, **policy),
            recorded=self.recorded,
            reconcile=self._reconcile,
            scope=self._scope,
            key_args=self._key_args,
            ignore_args=self._ignore_args,
            max_arg_bytes=self._max_bytes,
            max_arg_depth=self._max_depth,
        )

    def settle(self, key: str) -> Record | None:
        """Ask this tool's reconciler about a parked (UNKNOWN) record, outside any call.

        For operators (``twiceshy reconcile``): the reconciler gets ``(key, None)``. A record
        that is not UNKNOWN, or belongs to another tool, is answered unchanged.

        Returns:
            The record afterwards: SUCCEEDED or RELEASED when the reconciler knew, else as it
            was; ``None`` when the key has no record.

        Raises:
            ValueError: the tool has no reconciler.
            StoreError: the ledger failed.
        """
        reconcile = self._reconciler()
        store, ns = self._ledger.store, self._ledger.namespace
        snap = store.get(ns, key)
        record = snap.record
        if record is None or not self._parked(record):
            return record
        answer = _reconciled(reconcile, key, None)
        if inspect.isawaitable(answer):
            if _loop_running():
                close = getattr(answer, "close", None)
                if callable(close):
                    close()
                raise RuntimeError(
                    f"the reconciler of {self.name!r} is async and an event loop is running "
                    "here: use await guard.asettle(key)"
                )
            answer = asyncio.run(_awaited(answer, key))
        change = settle(self.policy, record, answer, snap.now)
        return record if change is None else store.write(ns, key, change).record

    async def asettle(self, key: str) -> Record | None:
        """:meth:`settle` from async code: the reconciler is awaited if it is async, and run
        in a worker thread if it blocks; the ledger is used through its async store."""
        reconcile = self._reconciler()
        store, ns = self._ledger.async_store, self._ledger.namespace
        snap = await store.get(ns, key)
        record = snap.record
        if record is None or not self._parked(record):
            return record
        answer = await _areconciled(reconcile, key, None)
        change = settle(self.policy, record, answer, snap.now)
        return record if change is None else (await store.write(ns, key, change)).record

    def _reconciler(self) -> Reconciler:
        if self._reconcile is None:
            raise ValueError(f"the tool {self.name!r} has no reconcile= function")
        return self._reconcile

    def _parked(self, record: Record) -> bool:
        """Whether ``record`` is this tool's, parked UNKNOWN: the one thing settling may change."""
        return record.state is State.UNKNOWN and record.tool == self.name

    # -- shared, no I/O --------------------------------------------------------------------

    def _plan(self, bound: BoundCall, scope: str | None) -> CallPlan:
        """Key and plan one call; every refusal happens here, before anything runs.

        The scope is, in this order: the one given; an enclosing ``twiceshy.run(...)``; the
        ``scope=`` function of the arguments; the scope inherited from an enclosing protected
        call (its nested runs' scope).
        """
        name = self.policy.tool
        try:
            if bound.explicit_key is not None:
                key = bound.explicit_key
                fingerprint = bound.identity(
                    None, name, max_depth=self._max_depth, max_bytes=self._max_bytes
                )[1]
            else:
                if scope is None:
                    scope = self._scope_of(bound)
                if not scope or not isinstance(scope, str):
                    raise MissingScope(
                        f"the tool {name!r} was called outside any twiceshy.run(...) scope; wrap "
                        "the agent's run in `with twiceshy.run(run_id):` so retries of one intent "
                        "share a key"
                    )
                derived, fingerprint = bound.identity(
                    scope, name, max_depth=self._max_depth, max_bytes=self._max_bytes
                )
                assert derived is not None
                key = derived
        except UnkeyableArgument as refusal:
            if refusal.bound is None:
                raise
            raise self._beyond(refusal) from None
        ledger = self._ledger
        return CallPlan(self.policy, ledger.namespace, key, fingerprint, ledger._owner_token())

    def _scope_of(self, bound: BoundCall) -> str | None:
        """The scope of a call given none: an enclosing ``twiceshy.run(...)``, else the
        ``scope=`` function of the arguments, else the enclosing protected call's nested one."""
        entered = entered_scope()
        if entered is not None and not entered[1]:
            return entered[0]
        if self._scope is not None:
            return self._scope(bound.arguments)
        return entered[0] if entered is not None else None

    def _nesting(self, work: _Work, bound: BoundCall, scope: str | None) -> _Work:
        """``work`` of a SAFE call kept out of the ledger, giving the runs started inside it the
        nested scope a recorded call would give them (its key, derived only if asked for)."""
        outer = scope if scope is not None else self._scope_of(bound)
        if not outer or not isinstance(outer, str):
            return work  # no scope to derive one from: nested runs name their own

        def derive() -> str:
            try:
                return self._plan(bound, outer).key
            except UnkeyableArgument:  # a SAFE call need not be keyable: the outer scope
                return outer

        return _nested_work(work, Deferred(derive))

    def _beyond(self, refusal: UnkeyableArgument) -> UnkeyableArgument:
        """A refusal by a bound, saying which option of the tool lifts it."""
        if refusal.bound == "max_bytes":
            hint = (
                f"raise the tool's max_arg_bytes= (now {self._max_bytes}), or name the "
                "arguments that make the intent with key_args= (the others are then only "
                "fingerprinted, with no bound)"
            )
        else:
            hint = f"raise the tool's max_arg_depth= (now {self._max_depth})"
        error = type(refusal)(refusal.path, f"{refusal.reason}; the call did not run: {hint}")
        error.bound = refusal.bound
        return error

    def _join(self, plan: CallPlan, seen: _Seen) -> tuple[Flight, bool]:
        """This process's flight of the intent, and whether this call leads it."""
        seen.key = plan.key
        flight, leader = self._ledger._flights.join(plan.namespace, plan.key, plan.fingerprint)
        if not leader:
            seen.outcome = Outcome.JOINED
            if flight.fingerprint != plan.fingerprint:
                raise _mismatch(plan)
        return flight, leader

    def _joined(
        self, plan: CallPlan, seen: _Seen, flight: Flight, landed: bool
    ) -> tuple[bool, Any]:
        """A joined call's answer once its flight landed: ``(True, outcome)``, or ``(False,
        None)`` when the leader was interrupted and this call must go to the ledger itself."""
        if not landed:
            raise InProgress(plan.policy.tool, plan.key, here=True)
        try:
            return True, flight.outcome()
        except _LeaderInterrupted:
            seen.outcome = Outcome.EXECUTED  # a call of its own from now on
            return False, None

    def _recalled(self, plan: CallPlan) -> Snapshot | None:
        """The settled record of the plan's key this process kept, if any (``remember=``)."""
        memo = self._ledger._memo
        return memo.recall(plan) if memo is not None else None

    def _failed(
        self, plan: CallPlan, seen: _Seen, flight: Flight, error: BaseException
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
        self._ledger._flights.land(plan.namespace, plan.key, flight, None, _for_joiners(error))
        interrupted = seen.interrupted
        if interrupted is not None and error is not interrupted:
            raise interrupted from error
        return error

    def _enter(self, plan: CallPlan, command: Run) -> tuple[Renewal, Current, CallTokens]:
        """Start renewing the lease and make the call current, before the work runs."""
        heartbeat, policy = self._ledger._heartbeat, plan.policy
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

    def _leave(self, job: Renewal, tokens: CallTokens) -> None:
        reset_call(tokens)
        self._ledger._heartbeat.stop(job)

    # -- the blocking driver ---------------------------------------------------------------

    def _execute(self, bound: BoundCall, work: _Work, scope: str | None) -> Any:
        arounds = self._ledger._arounds
        if arounds:
            with _Around(arounds, self):
                return self._execute_told(bound, work, scope)
        return self._execute_told(bound, work, scope)

    def _execute_told(self, bound: BoundCall, work: _Work, scope: str | None) -> Any:
        seen = _Seen()
        try:
            value = self._execute_once(bound, work, scope, seen)
        except BaseException as exc:
            self._ledger._answered(self, seen, exc)
            raise
        self._ledger._answered(self, seen, None)
        return value

    def _execute_once(self, bound: BoundCall, work: _Work, scope: str | None, seen: _Seen) -> Any:
        if not self.recorded:
            nested = self._nesting(work, bound, scope)
            return self._drive(retry_only(self.policy), nested, None, bound, seen)
        plan = self._plan(bound, scope)
        flights = self._ledger._flights
        wait_until = time.monotonic() + self.policy.wait  # one wait= for the whole call
        for _ in range(_JOINS):
            flight, leader = self._join(plan, seen)
            if leader:
                break
            landed = flight.wait(max(wait_until - time.monotonic(), 0.0))
            done, value = self._joined(plan, seen, flight, landed)
            if done:
                return value
        else:
            raise InProgress(plan.policy.tool, plan.key, here=True)
        try:
            protocol = protect(plan, self._recalled(plan), wait_until)
            value = self._drive(protocol, work, plan, bound, seen)
        except BaseException as exc:
            raise self._failed(plan, seen, flight, exc)  # noqa: B904 - it is exc, or from it
        flights.land(plan.namespace, plan.key, flight, value, None)
        return value

    def _drive(
        self, protocol: Protocol, work: _Work, plan: CallPlan | None, bound: BoundCall, seen: _Seen
    ) -> Any:
        store, memo = self._ledger.store, self._ledger._memo
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
                        self._give_back(store, plan, seen, exc)
                    raise
                if memo is not None:
                    memo.keep(plan, answer, sent)
            elif kind is Run:
                try:
                    answer = self._run(work, plan, cast("Run", command), seen)
                except BaseException as exc:  # only before the work started: nothing ran
                    if plan is not None:
                        self._give_back(store, plan, seen, exc)
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
                assert self._reconcile is not None
                answer = _reconciled(self._reconcile, plan.key, bound.arguments)
                if inspect.isawaitable(answer):
                    close = getattr(answer, "close", None)
                    if callable(close):
                        close()
                    raise TypeError("a blocking call needs a blocking reconcile= function")
            else:  # pragma: no cover - the protocol yields nothing else
                raise AssertionError(command)

    def _run(self, work: _Work, plan: CallPlan | None, command: Run, seen: _Seen) -> Ran:
        if plan is None:
            try:
                return Ran(value=work(""))
            except Exception as exc:
                return Ran(error=exc)
        job, current, tokens = self._enter(plan, command)  # interrupted here: it never ran
        seen.ran = True
        try:
            value = work(plan.key)
        except Exception as exc:
            return Ran(error=exc, marked=current.marked)
        except BaseException as exc:  # the protocol records the doubt, then raises it again
            seen.interrupted = exc
            return Ran(error=exc, marked=current.marked)
        finally:
            self._leave(job, tokens)
        if inspect.isawaitable(value):
            # An async tool protected as a blocking one (a plain decorator around an async def):
            # nothing has run yet, and nothing will. Released, with an error that says why.
            close = getattr(value, "close", None)
            if callable(close):
                close()
            return Ran(error=_ReturnedAwaitable(plan.policy.tool))
        return Ran(value=value)

    def _give_back(self, store: Store, plan: CallPlan, seen: _Seen, why: BaseException) -> None:
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

    async def _aexecute(self, bound: BoundCall, work: _Work, scope: str | None) -> Any:
        arounds = self._ledger._arounds
        if arounds:
            with _Around(arounds, self):
                return await self._aexecute_told(bound, work, scope)
        return await self._aexecute_told(bound, work, scope)

    async def _aexecute_told(self, bound: BoundCall, work: _Work, scope: str | None) -> Any:
        seen = _Seen()
        try:
            value = await self._aexecute_once(bound, work, scope, seen)
        except BaseException as exc:
            self._ledger._answered(self, seen, exc)
            raise
        self._ledger._answered(self, seen, None)
        return value

    async def _aexecute_once(
        self, bound: BoundCall, work: _Work, scope: str | None, seen: _Seen
    ) -> Any:
        if not self.recorded:
            nested = self._nesting(work, bound, scope)
            return await self._adrive(retry_only(self.policy), nested, None, bound, seen)
        plan = self._plan(bound, scope)
        flights = self._ledger._flights
        wait_until = time.monotonic() + self.policy.wait  # one wait= for the whole call
        for _ in range(_JOINS):
            flight, leader = self._join(plan, seen)
            if leader:
                break
            landed = await flight.wait_async(max(wait_until - time.monotonic(), 0.0))
            done, value = self._joined(plan, seen, flight, landed)
            if done:
                return value
        else:
            raise InProgress(plan.policy.tool, plan.key, here=True)
        try:
            protocol = protect(plan, self._recalled(plan), wait_until)
            value = await self._adrive(protocol, work, plan, bound, seen)
        except BaseException as exc:
            raise self._failed(plan, seen, flight, exc)  # noqa: B904 - it is exc, or from it
        flights.land(plan.namespace, plan.key, flight, value, None)
        return value

    async def _adrive(
        self, protocol: Protocol, work: _Work, plan: CallPlan | None, bound: BoundCall, seen: _Seen
    ) -> Any:
        store, memo = self._ledger.async_store, self._ledger._memo
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
                answer = await self._astore_op(store, command, plan, seen)
                if memo is not None:
                    memo.keep(plan, answer, sent)
            elif kind is Run:
                try:
                    answer = await self._arun(work, plan, cast("Run", command), seen)
                except BaseException as exc:  # only before the work started: nothing ran
                    if plan is not None:
                        await self._agive_back(store, plan, seen, exc)
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
                assert self._reconcile is not None
                answer = await _areconciled(self._reconcile, plan.key, bound.arguments)
            else:  # pragma: no cover - the protocol yields nothing else
                raise AssertionError(command)

    async def _astore_op(
        self, store: AsyncStore, command: Command, plan: CallPlan, seen: _Seen
    ) -> Snapshot:
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
            await self._agive_back(store, plan, seen, cancelled, task)
            raise cancelled from None
        except Exception as exc:
            if _may_have_made_owner(command, exc):
                await self._agive_back(store, plan, seen, exc)
            raise

    async def _agive_back(
        self,
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

    async def _arun(self, work: _Work, plan: CallPlan | None, command: Run, seen: _Seen) -> Ran:
        if plan is None:
            try:
                return Ran(value=await work(""))
            except Exception as exc:
                return Ran(error=exc)
        job, current, tokens = self._enter(plan, command)  # interrupted here: it never ran
        seen.ran = True
        try:
            value = await work(plan.key)
        except Exception as exc:
            return Ran(error=exc, marked=current.marked)
        except BaseException as exc:  # the protocol records the doubt, then raises it again
            seen.interrupted = exc
            return Ran(error=exc, marked=current.marked)
        finally:
            self._leave(job, tokens)
        return Ran(value=value)


def _nested_work(work: _Work, deferred: Deferred) -> _Work:
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


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calls of ``fn`` answer a coroutine: an async def, or an object whose ``__call__``
    is one. A wrapper is taken for what it is, not for what it wraps: a blocking wrapper of an
    async def may run it to the end itself."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - the method itself, not callable()
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(call)


def _mismatch(plan: CallPlan) -> KeyReuseMismatch:
    return KeyReuseMismatch(
        f"the key {plan.key} is in use by a running call of {plan.policy.tool!r} with other "
        "arguments; this call did not run"
    )


class Ledger:
    """Where keys are claimed and outcomes kept; protects tools with :meth:`tool`.

    One ledger serves sync and async tools, threads and tasks. Create it once and share it.

    Args:
        url: ``memory://``, ``sqlite:///path/ledger.db``, ``postgresql://…``, ``redis://…``; by
            default ``TWICESHY_LEDGER``, else the embedded SQLite file
            ``$XDG_STATE_HOME/twiceshy/ledger.db``.
        namespace: a tenant: records of different namespaces never meet.
        store: a store object instead of a URL (anything implementing
            :class:`twiceshy.stores.Store`).
        async_store: its async twin, when ``store`` is given and async tools are used.
        observers: told of every protected call once it is answered (see :meth:`observe`).
        counts_interval: how often this process adds its call counts (how each call was
            answered: executed, replayed, joined, ...) to the store, for ``twiceshy stats``;
            they are added once more by :meth:`close`. ``None`` keeps them in the process.
        remember: how many settled outcomes (SUCCEEDED, FAILED) this process keeps, the least
            recently used dropped first, to answer its own retries of them without a round
            trip to the store. ``0`` (the default) asks the store every time. A kept outcome
            is dropped no later than the store's retention ends; a record deleted from the
            store by hand is still answered from here until then. Each kept outcome holds its
            result's JSON text (at most the tool's ``max_result_bytes``).

    Raises:
        ValueError: the URL names no known store.
        StoreUnavailable: the store cannot be reached.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str = "",
        store: Store | None = None,
        async_store: AsyncStore | None = None,
        observers: Collection[Observer] = (),
        counts_interval: Duration | None = 10.0,
        remember: int = 0,
    ) -> None:
        if not isinstance(namespace, str):
            raise TypeError("namespace= must be a string")
        if not isinstance(remember, int) or isinstance(remember, bool):
            raise TypeError("remember= must be a whole number of outcomes")
        if remember < 0:
            raise ValueError("remember= must be 0 or more")
        if store is not None:
            if url is not None:
                raise ValueError("give a url or a store, not both")
            from .stores import ThreadedAsyncStore

            self.url = f"<{type(store).__name__}>"
            self.store: Store = store
            self.async_store: AsyncStore = async_store or ThreadedAsyncStore(store)
        else:
            self.url = url if url is not None else default_url()
            self.store, self.async_store = open_store(self.url)
        self.namespace = namespace
        self._memo = Remembered(remember) if remember else None
        self._flights = Flights()
        self._heartbeat = Heartbeat(self.store)
        self._owner_prefix = secrets.token_hex(8)
        self._owner_count = itertools.count(1)
        self._observers: tuple[Observer, ...] = ()
        self._arounds: tuple[Callable[[str, Effect], Any], ...] = ()
        for observer in observers:
            self.observe(observer)
        interval = None if counts_interval is None else _seconds(counts_interval, "counts_interval")
        if interval == 0:
            raise ValueError("counts_interval= must be positive, or None")
        self._tally = (
            Tally(self.store, namespace, interval)
            if interval is not None and isinstance(self.store, CallCounts)
            else None
        )

    def observe(self, observer: Observer) -> None:
        """Tell ``observer`` of every protected call of this ledger once it is answered.

        Observers run in the caller's thread (and context) right after the call; one that
        raises is logged and otherwise ignored: observing never changes an outcome. An observer
        with a method ``around(tool, effect)`` also gets to wrap every call in the context
        manager it returns (see :data:`Observer`).
        """
        self._observers = (*self._observers, observer)
        around = getattr(observer, "around", None)
        if callable(around):
            self._arounds = (*self._arounds, around)

    def _answered(self, guard: Guard, seen: _Seen, error: BaseException | None) -> None:
        """A call was answered: count it; tell observers and the log when anyone listens.

        An unknown outcome is always worth a warning, observed or not.
        """
        outcome = _outcome_of(error, seen)
        if self._tally is not None:
            self._tally.add(guard.name, outcome)
        if self._observers or log.isEnabledFor(logging.DEBUG) or outcome is Outcome.UNKNOWN:
            duration = time.perf_counter() - seen.clock
            self._tell(guard, seen.key, error, outcome, time.time() - duration, duration)

    def _tell(
        self,
        guard: Guard,
        key: str | None,
        error: BaseException | None,
        outcome: Outcome,
        started: float,
        duration: float,
    ) -> None:
        event = CallEvent(
            tool=guard.name,
            effect=guard.effect,
            outcome=outcome,
            key=key,
            error=error,
            started=started,
            duration=duration,
        )
        level = logging.WARNING if event.outcome is Outcome.UNKNOWN else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(
                level,
                "twiceshy: %s %s key=%s effect=%s %.1f ms%s",
                event.tool,
                event.outcome.value,
                event.key,
                event.effect.value,
                event.duration * 1000,
                (f" error={describe(error)}" if error is not None else "")
                + (f" {clearing(key)}" if outcome is Outcome.UNKNOWN and key else ""),
                extra={
                    "twiceshy_tool": event.tool,
                    "twiceshy_key": event.key,
                    "twiceshy_effect": event.effect.value,
                    "twiceshy_outcome": event.outcome.value,
                },
            )
        for observer in self._observers:
            try:
                observer(event)
            except Exception:
                log.exception("twiceshy: an observer failed on %s", event.tool)

    def _owner_token(self) -> str:
        """A token no other call shares: this ledger's random prefix, the process, a counter."""
        return f"{self._owner_prefix}.{os.getpid()}.{next(self._owner_count)}"

    def __repr__(self) -> str:
        return f"Ledger({redacted_url(self.url)!r}, namespace={self.namespace!r})"

    def counts(self) -> dict[tuple[str, str], int]:
        """This process's call counts not yet added to the store, by ``(tool, outcome)``."""
        return self._tally.pending() if self._tally is not None else {}

    def flush_counts(self) -> None:
        """Add this process's pending call counts to the store now.

        They are also added every ``counts_interval`` seconds and by :meth:`close`.

        Raises:
            StoreError: the store failed; the counts stay for the next flush.
        """
        if self._tally is not None:
            self._tally.flush()

    def close(self) -> None:
        """Add the pending call counts to the store and release its connections."""
        if self._tally is not None:
            self._tally.close()
        self.store.close()

    async def aclose(self) -> None:
        """Add the pending call counts and release the store's connections, async ones included."""
        if self._tally is not None:
            await asyncio.to_thread(self._tally.close)
        await self.async_store.close()
        self.store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def guard(
        self,
        name: str,
        *,
        effect: Effect,
        lease: Duration = 30.0,
        wait: Duration = 10.0,
        ttl: Duration | None = timedelta(hours=24),
        key_args: Collection[str] | None = None,
        ignore_args: Collection[str] = (),
        definite: Collection[type[BaseException]] = (),
        not_applied: Collection[type[BaseException]] = (),
        attempts: int | None = None,
        backoff: Callable[[int], float] | None = None,
        reconcile: Reconciler | None = None,
        record: bool | None = None,
        scope: Callable[[Mapping[str, Any]], str] | None = None,
        returns: Any = None,
        max_result_bytes: int = MAX_RESULT_BYTES,
        effect_at: Literal["mark", "http"] | None = None,
        max_arg_bytes: int = MAX_BYTES,
        max_arg_depth: int = MAX_DEPTH,
        release_grace: Duration | None = None,
    ) -> Guard:
        """A :class:`Guard` for the tool ``name``: the options of :meth:`tool`, without a function.

        ``returns`` is the type results are rebuilt as on replay (the decorator takes it from
        the function's return annotation). ``effect_at`` has no ``"auto"`` here: there is no
        function to read.

        Raises:
            ResultNotStorable: ``returns`` has no JSON form.
        """
        if not isinstance(effect, Effect):
            raise TypeError("effect= must be twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE")
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a tool name must be a non-empty string without ':' ({name!r})")
        if record is not None and effect is not Effect.SAFE:
            raise ValueError("record= applies to SAFE tools; KEYED and UNSAFE are always recorded")
        if attempts is None:
            attempts = 1 if effect is Effect.UNSAFE else 3
        if attempts < 1:
            raise ValueError("attempts= must be at least 1")
        if effect is Effect.UNSAFE and attempts != 1:
            raise ValueError("an UNSAFE tool runs exactly once: attempts= must be 1")
        lease_s = _seconds(lease, "lease")
        if lease_s <= 0:
            raise ValueError("lease= must be positive")
        if effect_at not in (None, "mark", "http"):
            raise ValueError(f"effect_at= must be 'mark', 'http' or None, not {effect_at!r}")
        try:
            codec = ResultCodec(returns, max_bytes=max_result_bytes)
        except ResultNotStorable as exc:
            raise ResultNotStorable(
                f"the tool {name!r} is declared to return what the ledger cannot keep: {exc}. "
                "Return JSON types, a dataclass, a TypedDict, a named tuple or a pydantic model "
                "(or convert the result first); nothing has run",
                tool=name,
            ) from None
        policy = Policy(
            tool=name,
            effect=effect,
            lease=lease_s,
            wait=_seconds(wait, "wait"),
            ttl=None if ttl is None else _seconds(ttl, "ttl"),
            attempts=attempts,
            backoff=backoff or exponential_backoff(),
            definite=tuple(definite),
            not_applied=tuple(not_applied),
            codec=codec,
            reconcile=reconcile is not None,
            effect_at=effect_at,
            release_grace=(
                2 * lease_s if release_grace is None else _seconds(release_grace, "release_grace")
            ),
        )
        return Guard(
            self,
            policy,
            recorded=effect is not Effect.SAFE or bool(record),
            reconcile=reconcile,
            scope=scope,
            key_args=key_args,
            ignore_args=ignore_args,
            max_arg_bytes=max_arg_bytes,
            max_arg_depth=max_arg_depth,
        )

    def tool(
        self,
        *,
        effect: Effect,
        name: str | None = None,
        lease: Duration = 30.0,
        wait: Duration = 10.0,
        ttl: Duration | None = timedelta(hours=24),
        key_args: Collection[str] | None = None,
        ignore_args: Collection[str] = (),
        definite: Collection[type[BaseException]] = (),
        not_applied: Collection[type[BaseException]] = (),
        attempts: int | None = None,
        backoff: Callable[[int], float] | None = None,
        reconcile: Reconciler | None = None,
        record: bool | None = None,
        scope: Callable[[Mapping[str, Any]], str] | None = None,
        key_param: str = "idempotency_key",
        inject: Collection[str] = (),
        max_result_bytes: int = MAX_RESULT_BYTES,
        effect_at: Literal["auto", "mark", "http"] | None = "auto",
        max_arg_bytes: int = MAX_BYTES,
        max_arg_depth: int = MAX_DEPTH,
        release_grace: Duration | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Protect a tool (``def`` or ``async def``); the decorated tool keeps its signature.

        Args:
            effect: what the tool does to the world: ``SAFE``, ``KEYED`` or ``UNSAFE``. Required:
                there is no silent default.
            name: the tool's name in keys (default: the function's ``__name__``).
            lease: how long a claim holds without renewal; a heartbeat renews it while the tool
                runs. After a crash, a KEYED tool is taken over and an UNSAFE one becomes UNKNOWN
                once the lease lapses.
            wait: how long a duplicate waits for a running call before ``InProgress``.
            ttl: how long outcomes are kept (``None``: forever). A retry after that runs again.
            key_args: only these parameters name the intent (the rest must match, or
                ``KeyReuseMismatch``).
            ignore_args: parameters left out of the intent (volatile ones).
            definite: exception types meaning "it ran and failed for certain": recorded, replayed.
            not_applied: exception types meaning "nothing happened": the intent may run again.
            attempts: runs of a KEYED or SAFE tool on ambiguous errors, with backoff and the same
                key (default 3). An UNSAFE tool has exactly one.
            backoff: the delay after the n-th attempt (default: exponential with full jitter).
            reconcile: ``reconcile(key, args)`` looks at the provider for an UNKNOWN intent and
                answers ``Happened(result)``, ``DidNotHappen()`` or ``None`` (cannot tell).
            record: SAFE tools only: keep outcomes in the ledger (replay within a run).
            scope: derive the scope from the call's arguments when no ``twiceshy.run`` is active.
            key_param: the parameter through which the key is injected, if the tool has it.
            inject: parameters a framework fills in (contexts), left out of the key.
            max_result_bytes: the bound on a stored result. A result beyond it (or with no JSON
                form) is recorded as done all the same, and a retry is told so
                (:class:`~twiceshy.ResultNotStorable`).
            effect_at: where the tool's effect starts, so that an exception raised before it
                means nothing happened (the intent is released, the next call runs it):
                ``"mark"``, where the tool calls :func:`twiceshy.point_of_no_return`; ``"http"``,
                at its first request through a twiceshy HTTP transport (or an earlier
                ``point_of_no_return()``); ``None``, unsaid (any exception may follow an effect).
                ``"auto"`` (the default) is ``"mark"`` when the tool's own code calls
                ``point_of_no_return``, else ``None``.
            max_arg_bytes: the largest canonical text of the arguments that name the intent, in
                UTF-8 bytes (1 MiB by default); with ``key_args=`` it bounds only those.
            max_arg_depth: how deeply containers in the arguments may nest (64 by default).
            release_grace: how long after an UNSAFE call's lapsed lease was marked unknown its
                reconciler may not release it (``DidNotHappen()`` is then read as "cannot
                tell"): a lapse is not a crash, and a paused owner may still be taking effect.
                Twice the lease by default.

        Raises:
            ValueError: an option is out of range or names parameters the tool lacks.
            ResultNotStorable: the return annotation has no JSON form.
        """

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            is_async = _is_async(fn)
            if reconcile is not None and not is_async and _is_async(reconcile):
                raise TypeError("a sync tool needs a sync reconcile= function")
            try:
                returns = inspect.get_annotations(fn, eval_str=True).get("return")
            except Exception:  # it names what is not defined yet: read it at the first replay
                returns = ReturnOf(fn)
            binder = Binder(
                fn, key_param=key_param, inject=inject, key_args=key_args, ignore_args=ignore_args
            )
            where = effect_at
            if where == "auto":
                where = "mark" if calls_point_of_no_return(fn) else None
            guard = self.guard(
                name or fn.__name__,
                effect=effect,
                lease=lease,
                wait=wait,
                ttl=ttl,
                key_args=key_args,
                ignore_args=ignore_args,
                definite=definite,
                not_applied=not_applied,
                attempts=attempts,
                backoff=backoff,
                reconcile=reconcile,
                record=record,
                scope=scope,
                returns=returns,
                max_result_bytes=max_result_bytes,
                effect_at=where,
                max_arg_bytes=max_arg_bytes,
                max_arg_depth=max_arg_depth,
                release_grace=release_grace,
            )
            if is_async:
                wrapper = _async_tool(cast("Callable[..., Awaitable[Any]]", fn), guard, binder)
            else:
                wrapper = _sync_tool(fn, guard, binder)
            wrapper.twiceshy = guard  # type: ignore[attr-defined]
            return cast("Callable[P, R]", wrapper)

        return decorate


def _sync_tool(fn: Callable[..., Any], guard: Guard, binder: Binder) -> Callable[..., Any]:
    @functools.wraps(fn)
    def protected(*args: Any, **kwargs: Any) -> Any:
        arguments, explicit = binder.bind(args, kwargs)
        bound = guard.bind(arguments, key=explicit)

        def work(key: str) -> Any:
            call_args, call_kwargs = binder.call_args(args, kwargs, key) if key else (args, kwargs)
            return fn(*call_args, **call_kwargs)

        return guard._execute(bound, work, None)

    return protected


def _async_tool(
    fn: Callable[..., Awaitable[Any]], guard: Guard, binder: Binder
) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def protected(*args: Any, **kwargs: Any) -> Any:
        arguments, explicit = binder.bind(args, kwargs)
        bound = guard.bind(arguments, key=explicit)

        def work(key: str) -> Awaitable[Any]:
            call_args, call_kwargs = binder.call_args(args, kwargs, key) if key else (args, kwargs)
            return fn(*call_args, **call_kwargs)

        return await guard._aexecute(bound, work, None)

    return protected
