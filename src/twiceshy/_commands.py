"""The commands the protocol of a call yields, and their answers (docs/design.md §8).

A command says what the protocol needs done: claim the key, write a change, wait for an owner,
run the tool, sleep, ask the reconciler, tell how the call is answered, read the clock. The
protocol (:mod:`twiceshy._protocol`) yields them; the drivers (:mod:`twiceshy._drivers`) carry
each to the room that serves it and send back its answer.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from ._records import Change, Outcome

__all__ = [
    "Claim",
    "Command",
    "DidNotHappen",
    "Happened",
    "Note",
    "Now",
    "Commands",
    "Ran",
    "Reconcile",
    "Run",
    "Sleep",
    "Wait",
    "Write",
    "CLAIM",
    "NOTES",
    "NOW",
]


@dataclass(frozen=True, slots=True)
class Now:
    """Answer the driver's monotonic clock (seconds)."""


@dataclass(frozen=True, slots=True)
class Note:
    """Say how the call is being answered (for observers); answer: ``None``.

    Yielded only right before the protocol answers from the record; a call that noted nothing
    was answered by running the tool (EXECUTED).
    """

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Claim:
    """Claim the key (answer: a :class:`Snapshot`)."""


@dataclass(slots=True)  # made per call: not frozen (see CallPlan)
class Write:
    """Apply a guarded write (answer: a :class:`Snapshot`).

    ``finish``: carried to its end even if the call is interrupted meanwhile (a claim given back).
    """

    change: Change
    finish: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait until the record leaves CLAIMED under ``fence``, at most ``timeout`` seconds."""

    fence: int
    timeout: float


@dataclass(slots=True)  # made per call: not frozen (see CallPlan)
class Run:
    """Run the tool once as the owner of ``fence``, renewing the lease (answer: :class:`Ran`).

    ``trusted_until``: the monotonic time at which the owner's trust in its lease ends: the
    lease must be renewed by then, and ``point_of_no_return`` renews it first past it.
    """

    fence: int
    attempt: int
    trusted_until: float = math.inf


@dataclass(slots=True)  # made per call: not frozen (see CallPlan)
class Ran:
    """How one run of the tool ended.

    Attributes:
        value: what the tool returned.
        error: what it raised, or ``None``; for a recorded call also an interruption (a
            ``BaseException`` that is no ``Exception``: a cancelled task, ``KeyboardInterrupt``).
        marked: whether the attempt passed its point of no return (``point_of_no_return()``,
            or an HTTP transport that marks it) before it ended.
        handed: whether the attempt handed its key on (:attr:`twiceshy._scope.Current.handed`).
    """

    value: object = None
    error: BaseException | None = None
    marked: bool = False
    handed: bool = True


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep ``seconds`` (between in-place retries).

    Answer: ``None``, or the interruption that cut the sleep short (a cancelled task, Ctrl-C).
    """

    seconds: float


@dataclass(frozen=True, slots=True)
class Reconcile:
    """Ask the tool's reconciler what became of the intent.

    Answer: :class:`Happened`, :class:`DidNotHappen`, or ``None`` (it cannot tell).
    """


@dataclass(frozen=True, slots=True)
class Happened:
    """A reconciler's answer: the intent took effect, and this is its result."""

    result: object = None


@dataclass(frozen=True, slots=True)
class DidNotHappen:
    """A reconciler's answer: the intent certainly did not take effect."""


Command: TypeAlias = Now | Note | Claim | Write | Wait | Run | Sleep | Reconcile
Commands: TypeAlias = Generator[Command, Any, Any]
"""One call's protocol as it runs: a generator of the commands it needs, sent their answers."""

NOW: Final = Now()
CLAIM: Final = Claim()
NOTES: Final = {outcome: Note(outcome) for outcome in Outcome}
