"""The rules of a record's life, as data (docs/design.md §3, §4).

Three tables, read by the protocol (:mod:`twiceshy._protocol`), which only carries them out:

- :data:`TRANSITIONS`: every write a record may take, and who may take it; each write the protocol
  asks for is checked against it.
- :data:`FOUND`: what a call does with the record it finds, by what the record says
  (:class:`Found`) and the tool's effect class.
- :data:`ENDINGS`: what an owner writes when an attempt of the work ends, by how it ended
  (:class:`Ending`), the effect class and whether attempts are left, and what the caller gets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from ._records import Effect, State

__all__ = [
    "ENDINGS",
    "FOUND",
    "TRANSITIONS",
    "Actor",
    "Answer",
    "Ending",
    "Found",
    "Then",
    "Written",
]


class Actor(enum.Enum):
    """Who may take a transition."""

    CALLER = "any caller"
    OWNER = "the owner of the fence"
    RECONCILER = "a reconciler"

    __hash__ = object.__hash__  # as Effect's: identity, cheaper than Enum's


_C, _S, _F, _R, _U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN

TRANSITIONS: Final[dict[tuple[State | None, State], frozenset[Actor]]] = {
    # (from, to): who may write it. None is "no live record". Every guard includes the fence.
    (None, _C): frozenset({Actor.CALLER}),  # the insert wins
    # reconciler (an operator's `twiceshy resolve --force`): only once the lease has lapsed
    (_C, _S): frozenset({Actor.OWNER, Actor.RECONCILER}),
    (_C, _F): frozenset({Actor.OWNER, Actor.RECONCILER}),
    (_C, _R): frozenset({Actor.OWNER, Actor.RECONCILER}),
    (_C, _U): frozenset({Actor.OWNER, Actor.CALLER}),  # caller: lease lapsed, UNSAFE only
    (_C, _C): frozenset({Actor.OWNER, Actor.CALLER}),  # owner: heartbeat; caller: lapsed takeover
    (_R, _C): frozenset({Actor.CALLER}),
    # caller: KEYED only, the provider deduplicates by the key; owner: same fence, its claim
    # answered so late that a lapse was marked UNKNOWN before its work started
    (_U, _C): frozenset({Actor.CALLER, Actor.OWNER}),
    (_U, _S): frozenset({Actor.RECONCILER, Actor.OWNER}),  # owner: finishing late
    (_U, _F): frozenset({Actor.RECONCILER, Actor.OWNER}),
    (_U, _R): frozenset({Actor.RECONCILER, Actor.OWNER}),  # owner: its work did not apply
}
"""Every transition a record may take, and who may take it (docs/design.md §3)."""


class Found(enum.Enum):
    """What a record says to a call that is not its owner: its state, a CLAIMED one's lease read."""

    RUNNING = "claimed, its lease live"
    LAPSED = "claimed, its lease lapsed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RELEASED = "released"
    UNKNOWN = "unknown"

    __hash__ = object.__hash__  # as Effect's: identity, cheaper than Enum's


class Answer(enum.Enum):
    """What a call does with the record it found."""

    REPLAY = "replay the stored result"
    RAISE_RECORDED = "raise the stored failure again"
    TAKE = "claim it at fence + 1 and run"
    TAKE_LAPSED = "take the lapsed lease over at fence + 1 and run"
    MARK_UNKNOWN = "mark it unknown: its owner stopped, and may have taken effect"
    WAIT = "wait for its outcome (bounded by wait=), then InProgress"
    REFUSE = "raise OutcomeUnknown: never run again by itself"

    __hash__ = object.__hash__  # as Effect's: identity, cheaper than Enum's


_EVERY: Final = tuple(Effect)

FOUND: Final[dict[tuple[Found, Effect], Answer]] = {
    **{(Found.SUCCEEDED, effect): Answer.REPLAY for effect in _EVERY},
    **{(Found.FAILED, effect): Answer.RAISE_RECORDED for effect in _EVERY},
    **{(Found.RELEASED, effect): Answer.TAKE for effect in _EVERY},
    **{(Found.RUNNING, effect): Answer.WAIT for effect in _EVERY},
    (Found.LAPSED, Effect.SAFE): Answer.TAKE_LAPSED,
    (Found.LAPSED, Effect.KEYED): Answer.TAKE_LAPSED,
    (Found.LAPSED, Effect.UNSAFE): Answer.MARK_UNKNOWN,
    # After the tool's reconciler, if it has one, could not tell (RECONCILED_FIRST).
    (Found.UNKNOWN, Effect.SAFE): Answer.TAKE,
    (Found.UNKNOWN, Effect.KEYED): Answer.TAKE,  # the provider deduplicates by the same key
    (Found.UNKNOWN, Effect.UNSAFE): Answer.REFUSE,
}
"""What a call does with the record it finds (docs/design.md §3, "what a new call gets")."""

RECONCILED_FIRST: Final = frozenset({Found.UNKNOWN})
"""Records a tool's reconciler is asked about (once per call) before :data:`FOUND` applies."""


class Ending(enum.Enum):
    """How one attempt of the work ended, as its owner reads it (docs/design.md §4)."""

    RETURNED = "it returned"
    NOT_APPLIED = "it raised before its effect, or said that nothing happened"
    DEFINITE = "it failed for certain (a definite= type)"
    AMBIGUOUS = "it raised something else: it may have taken effect"
    INTERRUPTED = "it was interrupted (a cancelled task, Ctrl-C): it may have taken effect"
    INTERRUPTED_EARLY = "it was interrupted before its point of no return"

    __hash__ = object.__hash__  # as Effect's: identity, cheaper than Enum's


class Then(enum.Enum):
    """What the caller gets once the owner's write is done."""

    RETURN = "the result"
    RAISE = "the tool's own exception (or the interruption)"
    RAISE_UNKNOWN = "OutcomeUnknown, raised from the tool's exception"
    RETRY = "nothing yet: the owner renews its lease, counts the attempt and runs again"

    __hash__ = object.__hash__  # as Effect's: identity, cheaper than Enum's


@dataclass(frozen=True, slots=True)
class Written:
    """An attempt's end, as its owner records it: the state it writes, and what follows.

    ``kept``: when the record refused the write (it moved under the owner), whether this outcome
    is kept to be recorded should the call own the intent again: a settled outcome, or an unsafe
    doubt, must never lead to a second run. ``always``: the caller gets ``then`` whether the
    write won or not (an interruption goes on whatever the write). ``late``: the write may also
    resolve a lapse marked UNKNOWN at the owner's own fence (a late owner's outcome settles it).
    """

    to: State
    then: Then
    kept: bool = False
    always: bool = False
    late: bool = True


_LAST, _MORE = True, False
_UNSAFE_DOUBT: Final = Written(_U, Then.RAISE_UNKNOWN, kept=True, late=False)

ENDINGS: Final[dict[tuple[Ending, Effect, bool], Written]] = {
    **{
        (Ending.RETURNED, effect, last): Written(_S, Then.RETURN, kept=True)
        for effect in _EVERY
        for last in (_LAST, _MORE)
    },
    **{
        (Ending.NOT_APPLIED, effect, last): Written(_R, Then.RAISE)
        for effect in _EVERY
        for last in (_LAST, _MORE)
    },
    **{
        (Ending.DEFINITE, effect, last): Written(_F, Then.RAISE, kept=True)
        for effect in _EVERY
        for last in (_LAST, _MORE)
    },
    # An interruption goes on whatever the write; the next call is answered at once (KEYED:
    # runs again with the key; UNSAFE: OutcomeUnknown) rather than after the lease.
    **{
        (Ending.INTERRUPTED, effect, last): Written(_U, Then.RAISE, always=True, late=False)
        for effect in _EVERY
        for last in (_LAST, _MORE)
    },
    **{
        (Ending.INTERRUPTED_EARLY, effect, last): Written(_R, Then.RAISE, always=True)
        for effect in _EVERY
        for last in (_LAST, _MORE)
    },
    # UNSAFE: one attempt, then an honest answer.
    (Ending.AMBIGUOUS, Effect.UNSAFE, _LAST): Written(
        _U, Then.RAISE_UNKNOWN, kept=True, late=False
    ),
    (Ending.AMBIGUOUS, Effect.UNSAFE, _MORE): Written(
        _U, Then.RAISE_UNKNOWN, kept=True, late=False
    ),
    # KEYED: retried in place with the same key; unknown when attempts run out, and the next
    # identical call runs it again with that key.
    (Ending.AMBIGUOUS, Effect.KEYED, _MORE): Written(_C, Then.RETRY),
    (Ending.AMBIGUOUS, Effect.KEYED, _LAST): Written(_U, Then.RAISE, late=False),
    # SAFE: retried in place; released when attempts run out.
    (Ending.AMBIGUOUS, Effect.SAFE, _MORE): Written(_C, Then.RETRY),
    (Ending.AMBIGUOUS, Effect.SAFE, _LAST): Written(_R, Then.RAISE, late=False),
}
"""What an owner writes when an attempt ends: by (how it ended, effect class, last attempt)."""
