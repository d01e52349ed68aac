"""The protocol of one protected call, with no I/O (docs/design.md §3, §4, §8).

Every decision twiceshy makes about a record lives here: when to claim, replay, wait, take over,
reconcile or refuse, how to read a tool's exception, when to retry in place. The protocol is a
generator that yields *commands* (claim, write, wait, run the tool, sleep, ...) and receives their
answers; :mod:`twiceshy._call` runs it inside one call's generator, and the drivers only carry
commands out.

What each state and effect class answers is data, in :mod:`twiceshy._rules`: :data:`FOUND` (what
a found record answers), :data:`ENDINGS` (what an attempt's end writes) and :data:`TRANSITIONS`
(every write a record may take); every write the protocol asks for is built by :func:`_change`,
which refuses one the table does not allow.
"""

from __future__ import annotations

import logging
import math
import random
from asyncio import CancelledError
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Final

from ._codec import NotKept, ResultCodec, decode_error, encode_error, not_kept, type_name
from ._commands import (
    CLAIM,
    NOTES,
    NOW,
    Claim,
    Command,
    Commands,
    DidNotHappen,
    Happened,
    Note,
    Now,
    Ran,
    Reconcile,
    Run,
    Sleep,
    Wait,
    Write,
)
from ._records import (
    CLOCK_TOLERANCE,
    STATE_SETS,
    Change,
    Effect,
    Outcome,
    Record,
    Snapshot,
    State,
    make_change,
)
from ._rules import (
    ENDINGS,
    FOUND,
    RECONCILED_FIRST,
    TRANSITIONS,
    Actor,
    Answer,
    Ending,
    Found,
    Then,
    Written,
)
from .errors import (
    InProgress,
    KeyReuseMismatch,
    NotApplied,
    OutcomeUnknown,
    ReplayedError,
    ResultNotStorable,
    StoreError,
)

log = logging.getLogger("twiceshy")

__all__ = [
    "CallPlan",
    "Claim",
    "Command",
    "DidNotHappen",
    "Happened",
    "Note",
    "Now",
    "Policy",
    "Commands",
    "Ran",
    "Reconcile",
    "Run",
    "Sleep",
    "Wait",
    "Write",
    "exponential_backoff",
    "describe",
    "protect",
    "renewal",
    "retry_only",
    "settle",
]


_C, _S, _F, _R, _U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN

MAX_STEPS: Final = 100
"""A bound on the protocol's rounds that are not waits; reaching it is a store fault."""

LEASE_TRUST: Final = 0.5
"""The part of a new lease an owner trusts, on its own monotonic clock from before it asked.

Past that, before running the work, it renews the lease first (docs/design.md §3: the owner stops
trusting its lease before the store would let it lapse).
"""


def _change(
    actor: Actor,
    record: Record,
    to: State,
    *,
    also_from: frozenset[State] = frozenset(),
    owner: str | None = None,
    lapsed: bool = False,
    new_owner: str | None = None,
    lease: float | None = None,
    count_attempt: bool = False,
    result: str | None = None,
    error: str | None = None,
    reason: str | None = None,
    ttl: float | None = None,
) -> Change:
    """A guarded write of ``record`` to ``to`` by ``actor``, checked against the table."""
    sources = _ONLY[record.state] | also_from if also_from else _ONLY[record.state]
    if (actor, sources, to) not in _ALLOWED:
        source = next(s for s in sources if actor not in TRANSITIONS.get((s, to), _NOBODY))
        raise AssertionError(f"{actor.value} may not move a record from {source} to {to}")
    fields = (owner, lapsed, new_owner, lease, count_attempt, result, error, reason, ttl)
    if new_owner is not None:  # a take-over: checked as Change() checks it
        return Change(record.fence, sources, to, *fields)
    return make_change(record.fence, sources, to, *fields)


_ONLY: Final = {state: frozenset({state}) for state in State}
_NOBODY: Final[frozenset[Actor]] = frozenset()
_ALLOWED: Final = frozenset(
    (actor, sources, to)
    for actor in Actor
    for to in State
    for sources in STATE_SETS
    if all(actor in TRANSITIONS.get((source, to), _NOBODY) for source in sources)
)
"""Every write :data:`TRANSITIONS` allows, by actor, states it starts from and state it writes."""


def renewal(fence: int, owner: str, lease: float, *, take_back: bool = False) -> Change:
    """The heartbeat's write: the owner of ``fence`` moves its lease deadline to now + ``lease``.

    With ``take_back`` (an UNSAFE owner making sure of its lease before its effect), also from a
    record at its own fence that a lapse marked UNKNOWN: nothing but a reconciler moves such a
    record on, so nobody else has run the work.
    """
    sources = frozenset({_C, _U}) if take_back else frozenset({_C})
    if (Actor.OWNER, sources, _C) not in _ALLOWED:  # pragma: no cover - the table allows it
        raise AssertionError("the owner may not renew its lease")
    return Change(fence=fence, from_states=sources, to=_C, owner=owner, lease=lease)


def exponential_backoff(
    initial: float = 0.1, maximum: float = 2.0, *, jitter: bool = True
) -> Callable[[int], float]:
    """A backoff strategy: ``initial * 2**(n-1)`` seconds after the n-th attempt, capped.

    With ``jitter``, the delay is drawn uniformly from ``[0, that]`` (full jitter), so many
    retrying callers do not arrive together.
    """

    def delay(attempt: int) -> float:
        ceiling = min(maximum, initial * 2 ** max(attempt - 1, 0))
        return random.uniform(0, ceiling) if jitter else ceiling

    return delay


@dataclass(frozen=True, slots=True)
class Policy:
    """How one tool is protected: fixed when the tool is decorated, shared by its calls."""

    tool: str
    effect: Effect
    lease: float
    wait: float
    ttl: float | None
    attempts: int
    backoff: Callable[[int], float]
    definite: tuple[type[BaseException], ...]
    not_applied: tuple[type[BaseException], ...]
    codec: ResultCodec
    reconcile: bool
    #: Where the tool's effect starts: ``"mark"`` (its call of ``point_of_no_return()``),
    #: ``"http"`` (its first request through a twiceshy transport), or ``None`` (unsaid: any
    #: exception may follow an effect).
    effect_at: str | None = None
    #: The caller whose run recorded the result gets it as stored, as every retry does (for
    #: adapters: the model then reads the same text both times).
    answer_stored: bool = False
    #: A framework's exception types that carry the tool's own error as their cause: a record's
    #: reason names the cause.
    wrappers: tuple[type[BaseException], ...] = ()
    #: How long after a lapse was marked UNKNOWN no reconciler may release it (seconds, on the
    #: store's clock): its owner, only paused, may still be acting.
    release_grace: float = 60.0
    #: KEYED only: how long the provider remembers a key (seconds from the intent's first claim,
    #: on the store's clock). Past it, an unsettled intent answers as an UNSAFE one would.
    key_window: float | None = None


@dataclass(slots=True, eq=False)
class CallPlan:
    """One call: its tool's policy, the names it goes by in the ledger, and the arguments its
    claim keeps (canonical JSON text, a marker of their size, or ``None``: none kept).

    Never changed once made; not frozen only because it is made for every call, and a frozen
    dataclass pays a ``setattr`` per field to be made.
    """

    policy: Policy
    namespace: str
    key: str
    fingerprint: str
    owner: str
    args: str | None = None


def _classify(policy: Policy, error: BaseException) -> Ending:
    """What a tool's exception says about its effect (docs/design.md §4), recorded or not."""
    if isinstance(error, NotApplied) or (
        policy.not_applied and isinstance(error, policy.not_applied)
    ):
        return Ending.NOT_APPLIED
    if policy.definite and isinstance(error, policy.definite):
        return Ending.DEFINITE
    return Ending.AMBIGUOUS


def _ending(policy: Policy, error: BaseException | None, passed: bool) -> Ending:
    """How an attempt ended: ``passed``, whether an attempt of this call passed its point of no
    return. Nothing happened when none did (where the tool says where its effect starts): an
    earlier attempt that did may have taken effect, whatever the last one raised."""
    if error is None:
        return Ending.RETURNED
    before_effect = policy.effect_at is not None and not passed and not _went_out(policy, error)
    if not isinstance(error, Exception):
        return Ending.INTERRUPTED_EARLY if before_effect else Ending.INTERRUPTED
    return Ending.NOT_APPLIED if before_effect else _classify(policy, error)


def _replay_error(plan: CallPlan, text: str | None) -> BaseException:
    """The recorded failure as an exception: its own type where it can be rebuilt."""
    name, message, listed = decode_error(text)
    # Its own type when the tool lists it; else the listed base it was recorded as (a
    # CardDeclined recorded under definite=(PaymentError,) replays as a PaymentError).
    for wanted in (name, listed):
        for kind in plan.policy.definite:
            if wanted and type_name(kind) == wanted:
                try:
                    return kind(message)
                except Exception:
                    return ReplayedError(name, message)
    return ReplayedError(name, message)


def _listed(
    kinds: tuple[type[BaseException], ...], error: BaseException
) -> type[BaseException] | None:
    """The first of ``kinds`` that ``error`` is an instance of."""
    return next((kind for kind in kinds if isinstance(error, kind)), None)


_DESCRIBED: Final = 200
"""How many characters of an error's message a description keeps."""


def describe(error: BaseException, wrappers: tuple[type[BaseException], ...] = ()) -> str:
    """``Type: message`` of an error, for records, logs and the model; safe for any error.

    It names the user's own error: through a framework's wrapper (one of ``wrappers``) to its
    cause (or the error it was raised while handling), and a private class (``_Name``) by its
    first public base. The message is bounded.
    """
    for _ in range(8):  # a bounded walk: a cause chain may loop
        inner = error.__cause__ or error.__context__  # raised from it, or while handling it
        if not isinstance(error, wrappers) or inner is None:
            break
        error = inner
    name = next(
        (c.__name__ for c in type(error).__mro__ if not c.__name__.startswith("_")), "Exception"
    )
    if isinstance(error, CancelledError):
        return name  # its message is the event loop's (a task's repr), not the user's
    try:
        text = str(error)
    except Exception:  # an error whose message cannot be read must still be recorded
        text = "(its message could not be read)"
    text = " ".join(text.split())
    if len(text) > _DESCRIBED:
        text = text[: _DESCRIBED - 3] + "..."
    return f"{name}: {text}" if text else name


@dataclass(slots=True)  # made per call: not frozen (see CallPlan)
class _Kept:
    """The outcome of this call's own run, whose write the record refused.

    The record moved under the owner (a reconciler or an operator released it, or it was
    removed): should this call come to own the intent again, it records this outcome instead of
    running the work a second time.
    """

    to: State  # SUCCEEDED, FAILED or UNKNOWN
    value: object = None  # returned when it stands (SUCCEEDED)
    raised: BaseException | None = None  # raised when it stands (FAILED, UNKNOWN)
    result: str | None = None
    error: str | None = None
    reason: str | None = None


KEY_NOT_HANDED: Final = "its idempotency key was not handed to the provider"
"""How the reason of an UNKNOWN record ends when a KEYED attempt did not hand its key on: such
an intent answers as an UNSAFE one's (docs/design.md §4, "twiceshy never multiplies an effect")."""

MARK_THE_EFFECT: Final = (
    "if the tool raised this before taking any effect (checking its input, say), call "
    "twiceshy.point_of_no_return() in it where its effect starts: an error raised before that "
    "releases the intent, and the next call runs it (or list the error's type in not_applied=)"
)
"""The way out of an UNSAFE tool's doubt that an error before its effect caused, for logs and
``twiceshy show`` (docs/design.md §4: only the tool can say where its effect starts)."""

_DOUBTFUL: Final = frozenset({Ending.AMBIGUOUS, Ending.INTERRUPTED})
"""Attempt endings that may have taken effect."""


def _blind(record: Record) -> bool:
    """Whether ``record`` is a KEYED intent left unknown by an attempt that did not hand its
    key on."""
    reason = record.reason
    return reason is not None and reason.endswith(KEY_NOT_HANDED)


LAPSED: Final = "the call's owner stopped without recording an outcome"
"""The reason of an UNKNOWN record that a caller marked when its owner's lease lapsed."""


def paused_owner_may_act(policy: Policy, record: Record, now: float) -> bool:
    """Whether ``record`` is an unknown outcome marked at a lapse whose owner may still act: a
    lapse is not a crash (a paused process resumes), so within ``release_grace`` of the lapse
    nothing may release it."""
    return (
        record.state is State.UNKNOWN
        and record.reason == LAPSED
        and now < record.updated_at + policy.release_grace
    )


def settle(policy: Policy, record: Record, answer: object, now: float) -> Change | None:
    """The write that settles an UNKNOWN ``record`` by a reconciler's answer, if it knew.

    ``Happened(result)`` records the result (SUCCEEDED); ``DidNotHappen()`` releases the intent
    (RELEASED), except for a lapse whose paused owner may still act (:func:`paused_owner_may_act`,
    at store time ``now``): the provider may not show its effect yet, so the doubt stands; anything
    else (``None``: it cannot tell) leaves the doubt standing too.
    """
    if isinstance(answer, Happened):
        try:
            text = policy.codec.encode(answer.result)
        except ResultNotStorable as exc:
            # It happened, though its result cannot be kept: recorded as done all the same.
            text = not_kept(answer.result, str(exc))
        return _change(Actor.RECONCILER, record, _S, result=text, ttl=policy.ttl)
    if isinstance(answer, DidNotHappen) and not paused_owner_may_act(policy, record, now):
        return _change(Actor.RECONCILER, record, _R, ttl=policy.ttl)
    return None


def protect(
    plan: CallPlan, recalled: Snapshot | None = None, wait_until: float | None = None
) -> Commands:
    """The protocol of one protected call; returns the result or raises the outcome's error.

    ``recalled``: a settled record of the key this process kept (``Ledger(remember=)``), which
    answers in place of the first claim: such a record changes only by expiring.
    ``wait_until``: when the call's waiting for a running duplicate ends (monotonic; the
    ledger passes ``wait=`` from the call's start, its waits on a flight in this process
    included); without it, ``wait=`` from when the call first finds the intent running.
    """
    # ``sent``: when the last command that could make this call the owner was sent.
    if recalled is None:
        sent = yield NOW  # _timed(Claim()), written out: every call takes this step
        snap = yield CLAIM
    else:
        sent, snap = -math.inf, recalled  # never won: it makes nobody the owner
    policy = plan.policy
    reconciled = False
    settled = Outcome.REPLAYED  # how an outcome found in the record is answered
    kept: _Kept | None = None  # this call's own outcome, refused by the record once
    rounds = 0  # rounds that are not waits: the waits are bounded by the call's wait=
    while rounds < MAX_STEPS:
        rounds += 1
        record = snap.record
        if record is None:
            # The record expired between two commands: claim afresh.
            sent, snap = yield from _timed(CLAIM)
            continue
        if snap.won and record.state is State.CLAIMED and record.owner == plan.owner:
            if kept is not None:
                # The work already ran in this call: its outcome is recorded, never run again.
                snap = yield Write(_record_kept(plan, record, kept))
                if not snap.won:
                    continue
                if kept.raised is not None:
                    raise kept.raised
                return kept.value
            remaining = (record.lease_deadline or snap.now) - snap.now
            window_ends = math.inf
            if policy.key_window is not None:  # on this caller's clock, from when it asked
                window_ends = sent + record.created_at + policy.key_window - snap.now
            done, value, snap, kept = yield from _own(
                plan, record, sent + LEASE_TRUST * remaining, window_ends
            )
            if done:
                return value
            continue
        if record.fingerprint != plan.fingerprint:
            raise KeyReuseMismatch(
                f"the key {plan.key} already names a call of {record.tool!r} with other "
                "arguments; this call did not run"
            )
        found = _FOUND_BY_STATE.get(record.state) or _claimed(record, snap.now)
        if found in RECONCILED_FIRST and policy.reconcile and not reconciled:
            reconciled = True
            answer = yield Reconcile()
            settled = Outcome.RECONCILED
            settlement = settle(policy, record, answer, snap.now)
            if settlement is not None:
                snap = yield Write(settlement)
                continue
        effect = policy.effect
        forgotten = policy.key_window is not None and _window_passed(policy, record, snap.now)
        if forgotten or (found is Found.UNKNOWN and effect is Effect.KEYED and _blind(record)):
            effect = Effect.UNSAFE  # the provider cannot recognise a retry: it would be blind
        action = FOUND[found, effect]
        if action is Answer.REPLAY:
            assert record.result is not None
            yield NOTES[settled]
            return _replayed(plan, record.result)
        if action is Answer.RAISE_RECORDED:
            yield NOTES[settled]
            raise _replay_error(plan, record.error)
        if action is Answer.TAKE or action is Answer.TAKE_LAPSED:
            sent, snap = yield from _take(plan, record, lapsed=action is Answer.TAKE_LAPSED)
            continue
        if action is Answer.MARK_UNKNOWN:
            snap = yield Write(
                _change(Actor.CALLER, record, _U, lapsed=True, reason=LAPSED, error=None)
            )
            continue
        if action is Answer.REFUSE:
            reason = record.reason or ""
            if forgotten:
                reason = f"{reason}; {_window_text(policy)}" if reason else _window_text(policy)
            raise OutcomeUnknown(policy.tool, plan.key, reason)
        # Answer.WAIT: its owner is running it.
        now = yield NOW
        if wait_until is None:
            wait_until = now + policy.wait
        left = wait_until - now
        if left <= 0:
            raise InProgress(
                policy.tool,
                plan.key,
                started_at=record.created_at,
                lapses_at=record.lease_deadline,
                effect=policy.effect.value,
                resumed=record.fence > 1,
            )
        until_lapse = (record.lease_deadline or snap.now) - snap.now
        settled = Outcome.WAITED
        snap = yield Wait(record.fence, min(left, max(until_lapse, 0.0) + 0.005))
        rounds -= 1
    raise StoreError(f"the ledger gave no settled answer for key {plan.key} in {MAX_STEPS} rounds")


def _window_passed(policy: Policy, record: Record, now: float) -> bool:
    """Whether the provider of a KEYED tool has forgotten the key of ``record`` at store time
    ``now``: its window has passed since the intent's first claim."""
    assert policy.key_window is not None
    created = record.created_at
    # A first claim stamped ahead of this clock (a store judging on its callers' clocks) may be
    # older than it reads: counted as passed, no retry goes out blind past the real window.
    return policy.effect is Effect.KEYED and (
        now >= created + policy.key_window or created > now + CLOCK_TOLERANCE
    )


def _window_text(policy: Policy) -> str:
    return (
        f"its provider remembers idempotency keys for {policy.key_window:g} s, and that window "
        "has passed since the first attempt, so it is not run again with its key"
    )


def _claimed(record: Record, now: float) -> Found:
    """What a CLAIMED ``record`` says to a call that does not own it, at store time ``now``."""
    deadline = record.lease_deadline
    return Found.LAPSED if deadline is not None and deadline <= now else Found.RUNNING


_FOUND_BY_STATE: Final[dict[State, Found]] = {
    State.SUCCEEDED: Found.SUCCEEDED,
    State.FAILED: Found.FAILED,
    State.RELEASED: Found.RELEASED,
    State.UNKNOWN: Found.UNKNOWN,
}


def _replayed(plan: CallPlan, text: str) -> Any:
    """A recorded result, as every retry gets it.

    Raises:
        ResultNotStorable: the tool ran and succeeded, and its result was not kept.
    """
    try:
        return plan.policy.codec.decode(text)
    except NotKept as gone:
        raise ResultNotStorable.replayed(
            plan.policy.tool, plan.key, gone.type_name, gone.why, gone.text
        ) from None


_NETWORK_MODULES: Final = ("httpx", "httpcore", "httpx2", "requests", "urllib3", "aiohttp")


def _went_out(policy: Policy, error: BaseException | None) -> bool:
    """Whether an error of a tool declared ``effect_at="http"`` shows that a request may have
    left though no twiceshy transport marked it (the tool's client has none): a network or
    HTTP client's error, in the error or its causes. Read as past the point of no return."""
    if policy.effect_at != "http":
        return False
    seen = 0
    while error is not None and seen < 8:
        module = type(error).__module__.partition(".")[0]
        if isinstance(error, OSError) or module in _NETWORK_MODULES:
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _record_kept(plan: CallPlan, record: Record, kept: _Kept) -> Change:
    """The owner's write of the outcome its earlier run had, under the fence it owns now."""
    ttl = plan.policy.ttl if kept.to is not State.UNKNOWN else None
    return _change(
        Actor.OWNER,
        record,
        kept.to,
        owner=plan.owner,
        result=kept.result,
        error=kept.error,
        reason=kept.reason,
        ttl=ttl,
    )


def _take(
    plan: CallPlan, record: Record, *, lapsed: bool = False
) -> Generator[Command, Any, tuple[float, Snapshot]]:
    """Claim ``record`` for this call at fence + 1: a released intent, a lapsed lease of a SAFE
    or KEYED tool (``lapsed``), or a KEYED intent left unknown."""
    change = _change(
        Actor.CALLER, record, _C, lapsed=lapsed, new_owner=plan.owner, lease=plan.policy.lease
    )
    return (yield from _timed(Write(change)))


def _timed(command: Claim | Write) -> Generator[Command, Any, tuple[float, Snapshot]]:
    """Send a command that may make this call the owner: when it was sent, and its answer.

    The lease it grants is trusted from when it was sent (monotonic), never from when the answer
    came back: an answer can arrive late.
    """
    sent: float = yield NOW
    snap: Snapshot = yield command
    return sent, snap


def _doubt(plan: CallPlan, record: Record, reason: str, error: BaseException) -> Change:
    """The owner's write of an unknown outcome: the work was cut off, and may have taken effect."""
    return _change(
        Actor.OWNER, record, _U, owner=plan.owner, reason=reason, error=encode_error(error)
    )


def _own(
    plan: CallPlan, record: Record, trusted_until: float, window_ends: float = math.inf
) -> Generator[Command, Any, tuple[bool, Any, Snapshot, _Kept | None]]:
    """Run the work as the owner of ``record.fence``; record its outcome.

    ``trusted_until`` is when this owner stops trusting its lease (monotonic). An owner past it
    renews the lease before the work starts, so that it never runs beside a caller that took the
    lapsed lease over, or after a reconciler (its own, or an operator's) released the intent. An
    UNSAFE owner also takes back a record at its own fence that a lapse marked UNKNOWN: nothing
    but a reconciler moves such a record on, so nobody else has run the work.

    ``window_ends``: when the provider forgets the key of a KEYED tool (monotonic): an attempt
    that ends ambiguously past it is not retried in place, and ends as an UNSAFE one would.

    Returns ``(True, value, snap, None)`` when this call's own outcome stands, or
    ``(False, None, snap, kept)`` when a write was refused: the caller then follows the record's
    real outcome in ``snap``, and ``kept`` is the outcome of this call's run when one must never
    run again (an UNSAFE tool's; any settled one), else ``None``.
    """
    policy = plan.policy
    attempt = 1
    passed = False  # whether an attempt of this call passed its point of no return
    now = yield NOW
    if now >= trusted_until:
        take_back = _FINISH_FROM if policy.effect is Effect.UNSAFE else frozenset()
        sent, snap = yield from _timed(
            Write(
                _change(
                    Actor.OWNER,
                    record,
                    _C,
                    also_from=take_back,
                    owner=plan.owner,
                    lease=policy.lease,
                )
            )
        )
        if not snap.won:
            return False, None, snap, None
        assert snap.record is not None
        record = snap.record
        trusted_until = sent + LEASE_TRUST * policy.lease
    while True:
        ran: Ran = yield Run(record.fence, attempt, trusted_until)
        error = ran.error
        passed = passed or ran.marked
        ending = Ending.RETURNED if error is None else _ending(policy, error, passed)
        written = ENDINGS[ending, policy.effect, attempt >= policy.attempts]
        blind = not ran.handed and policy.effect is Effect.KEYED and ending in _DOUBTFUL
        if blind:
            # A KEYED attempt that never handed its key on: its provider cannot recognise a
            # second run, so its doubt is an UNSAFE one's: never run again by itself.
            written = ENDINGS[ending, Effect.UNSAFE, True]
        elif written.then is Then.RETRY and window_ends < math.inf and (yield NOW) >= window_ends:
            written = ENDINGS[ending, Effect.UNSAFE, True]  # its key is forgotten: no blind retry
        if written.then is Then.RETRY:
            assert error is not None
            interrupted = yield Sleep(policy.backoff(attempt))
            if interrupted is not None:
                # Interrupted between attempts: the last one may have taken effect.
                reason = (
                    f"interrupted by {describe(interrupted)} after "
                    f"{describe(error, policy.wrappers)}"
                )
                yield Write(_doubt(plan, record, reason, error))
                raise interrupted
            # Count the attempt in the record and renew the lease before running again: the
            # write also proves this caller still owns the fence.
            sent, snap = yield from _timed(
                Write(
                    _change(
                        Actor.OWNER,
                        record,
                        _C,
                        owner=plan.owner,
                        lease=policy.lease,
                        count_attempt=True,
                    )
                )
            )
            if not snap.won:
                return False, None, snap, None  # KEYED: a later run uses the same key
            assert snap.record is not None
            record = snap.record
            trusted_until = sent + LEASE_TRUST * policy.lease
            attempt += 1
            continue
        change, value, raised = _end_of(plan, record, written, ending, ran, blind)
        snap = yield Write(change)
        if written.always:
            assert raised is not None
            raise raised
        if snap.won:
            if raised is not None:
                raise raised
            return True, value, snap, None
        if not written.kept:
            return False, None, snap, None  # nothing settled: it may run again (same key)
        kept = _Kept(change.to, value, raised, change.result, change.error, change.reason)
        return False, None, snap, kept


_FINISH_FROM: Final = frozenset({_U})
"""Where an owner's outcome may also be written from: its own fence, that a lapse marked UNKNOWN
(a late owner's outcome resolves the doubt)."""


def _end_of(
    plan: CallPlan, record: Record, written: Written, ending: Ending, ran: Ran, blind: bool
) -> tuple[Change, object, BaseException | None]:
    """The owner's write at the end of an attempt (:data:`ENDINGS`), with what the caller gets:
    the value to return, or the exception to raise. ``blind``: a KEYED attempt that may have
    taken effect without handing its key on."""
    policy, error = plan.policy, ran.error
    to = written.to
    late = _FINISH_FROM if written.late else frozenset()
    if to is _S:
        try:
            text = policy.codec.encode(ran.value)
        except ResultNotStorable as exc:
            # It ran and succeeded; its result cannot be kept. Never a failure (a retry would
            # read "try again" where the effect happened): done, with what can be kept.
            text = not_kept(ran.value, str(exc))
            log.warning(
                "twiceshy: the result of %s (key %s) cannot be kept: %s; retries are told that "
                "it ran",
                policy.tool,
                plan.key,
                exc,
            )
            value = ran.value
        else:
            value = policy.codec.decode(text) if policy.answer_stored else ran.value
        change = _change(
            Actor.OWNER,
            record,
            _S,
            also_from=late,
            owner=plan.owner,
            result=text,
            ttl=policy.ttl,
        )
        return change, value, None
    assert error is not None
    if to is _R:
        change = _change(Actor.OWNER, record, _R, also_from=late, owner=plan.owner, ttl=policy.ttl)
        return change, None, error
    if to is _F:
        text = encode_error(error, _listed(policy.definite, error))
        change = _change(
            Actor.OWNER,
            record,
            _F,
            also_from=late,
            owner=plan.owner,
            error=text,
            ttl=policy.ttl,
        )
        return change, None, error
    # UNKNOWN: the work may have taken effect.
    if ending is Ending.INTERRUPTED:
        # Nothing is known of its effect, and nothing renews the lease any more.
        reason = f"interrupted by {describe(error, policy.wrappers)} before it finished"
    else:
        reason = describe(error, policy.wrappers)
    if blind:
        reason = f"{reason}; {KEY_NOT_HANDED}"
        log.warning(
            "twiceshy: %s is KEYED, but its attempt (key %s) did not hand its idempotency key "
            "on and ended in %s: it is recorded as unknown and not run again by itself. Hand "
            "the key to the provider (twiceshy.current_key(), an idempotency_key parameter, or "
            "a twiceshy HTTP transport), or declare the tool UNSAFE if its provider cannot "
            "deduplicate",
            policy.tool,
            plan.key,
            describe(error, policy.wrappers),
        )
    elif written.then is Then.RAISE_UNKNOWN and policy.effect is not Effect.UNSAFE:
        reason = f"{reason}; {_window_text(policy)}"  # a KEYED tool past its key window
    change = _doubt(plan, record, reason, error)
    if written.then is Then.RAISE_UNKNOWN:
        unknown = OutcomeUnknown(policy.tool, plan.key, reason)
        unknown.__cause__ = error  # as raised from it
        return change, None, unknown
    if policy.effect is Effect.KEYED and ending is Ending.AMBIGUOUS:
        _note_exhausted(error, policy.attempts)  # the next call runs it again with the key
    return change, None, error


EXHAUSTED: Final = "twiceshy: no attempt of this KEYED tool finished"
"""How the note on a KEYED tool's last error begins (:func:`exhausted`)."""


def _note_exhausted(error: BaseException, attempts: int) -> None:
    if not exhausted(error):
        error.add_note(
            f"{EXHAUSTED} ({attempts} in all): it may have taken effect; its outcome is recorded "
            "as unknown, and the next identical call runs it again with the same idempotency key"
        )


def exhausted(error: BaseException) -> bool:
    """Whether ``error`` is the last error of a KEYED tool that ran out of attempts."""
    return any(
        isinstance(note, str) and note.startswith(EXHAUSTED)
        for note in getattr(error, "__notes__", ())
    )


def abandoned(
    plan: CallPlan, snap: Snapshot, ran: bool, why: BaseException, *, handed: bool = True
) -> Change | None:
    """The write for a call interrupted while a store command was under way, given that
    command's answer: when it left this call the owner of a CLAIMED record, nobody would renew
    that lease, and a retry would wait it out. Released when the work never ran; unknown when
    an attempt did (it may have taken effect; a KEYED one that did not hand its key on, as
    ``handed`` says, is then answered as an UNSAFE one). ``None`` when the call owns nothing.
    """
    record = snap.record
    if not snap.won or record is None or record.state is not State.CLAIMED:
        return None
    if record.owner != plan.owner:
        return None
    if ran:
        reason = f"interrupted by {describe(why)} before its outcome was recorded"
        if not handed and plan.policy.effect is Effect.KEYED:
            reason = f"{reason}; {KEY_NOT_HANDED}"
        return _doubt(plan, record, reason, why)
    return _change(Actor.OWNER, record, _R, owner=plan.owner, ttl=plan.policy.ttl)


def retry_only(policy: Policy) -> Commands:
    """The protocol of a SAFE tool kept out of the ledger: run, retrying transient errors.

    The tool's exceptions are read as for a recorded call: a certain failure (``definite=``) and
    "nothing happened" (``NotApplied``, ``not_applied=``) are the tool's answer, raised at once;
    only an ambiguous error is retried.
    """
    attempt = 1
    while True:
        ran: Ran = yield Run(0, attempt)
        if ran.error is None:
            return ran.value
        error = ran.error
        if _classify(policy, error) is not Ending.AMBIGUOUS or attempt >= policy.attempts:
            raise error
        interrupted = yield Sleep(policy.backoff(attempt))
        if interrupted is not None:
            raise interrupted
        attempt += 1
