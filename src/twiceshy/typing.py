"""The extension points of twiceshy, as Protocols: nobody inherits from a class of ours to plug
something in.

- :class:`Store` and :class:`AsyncStore`: where a ledger keeps its records (``Ledger(store=...)``);
  :class:`CallCounts`, what a store that keeps call counts adds.
- :class:`Observer`: told of every protected call once it is answered; an
  :class:`AroundObserver` also wraps every call in a context of its own (a tracer's span).
- :class:`Reconciler`: ``reconcile(key, arguments)`` looks at the provider for an intent whose
  outcome is unknown.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Mapping
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

from ._protocol import DidNotHappen, Happened
from ._records import CallEvent, Effect
from .stores import AsyncStore, CallCounts, Store

__all__ = [
    "NOT_GIVEN",
    "AroundObserver",
    "AsyncStore",
    "CallCounts",
    "Duration",
    "NotGiven",
    "Observer",
    "Reconciler",
    "Store",
]


class NotGiven(enum.Enum):
    """The type of :data:`NOT_GIVEN`."""

    NOT_GIVEN = "not given"

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Final = NotGiven.NOT_GIVEN
"""An option left out: its default applies (the one meaning of "not given"). ``None``, where an
option takes it, always means "none" (no retention limit, no count flushing, no reconciler)."""

Duration: TypeAlias = float | timedelta
"""A length of time: seconds, or a ``timedelta``."""


@runtime_checkable
class Observer(Protocol):
    """Told of every protected call of a ledger once it is answered (``ledger.observe(fn)``).

    Called in the caller's thread and context right after the call; an observer that raises is
    logged and otherwise ignored: observing never changes an outcome.
    """

    def __call__(self, event: CallEvent, /) -> None:
        """Take note of one answered call."""


@runtime_checkable
class AroundObserver(Observer, Protocol):
    """An observer that also wraps every call: its context is entered in the caller's context
    before the call starts and left once it is answered (after the observer is told), so what the
    tool does inside it (a tracer's spans) nests under it."""

    def around(self, tool: str, effect: Effect, /) -> AbstractContextManager[Any]:
        """The context manager around one call of ``tool``."""


ReconcilerAnswer: TypeAlias = Happened | DidNotHappen | None


@runtime_checkable
class Reconciler(Protocol):
    """``reconcile(key, arguments)``: what became of an intent whose outcome is unknown.

    It answers :class:`~twiceshy.Happened` (with the result), :class:`~twiceshy.DidNotHappen`
    (only when the provider's answer is authoritative: the intent is then run again), or ``None``
    (it cannot tell) — or an awaitable of one of those. ``arguments`` is ``None`` when an operator
    reconciles a parked record outside any call: the ledger keeps no arguments, only their
    fingerprint, so a reconciler that can look the effect up by the key alone serves both cases.
    """

    def __call__(
        self, key: str, arguments: Mapping[str, Any] | None, /
    ) -> ReconcilerAnswer | Awaitable[ReconcilerAnswer]:
        """Look at the provider for the intent ``key``."""
