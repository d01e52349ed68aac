"""What one ledger shares among its guards and their calls: the store, the flights of this
process, the heartbeat, the remembered outcomes, the call counts, the observers, owner tokens."""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ._forks import reset_in_children
from ._inflight import Flights, Heartbeat
from ._memo import Remembered
from ._protocol import describe
from ._records import CallEvent, Effect, Outcome
from ._tally import Tally
from .errors import clearing
from .stores import AsyncStore, Store
from .typing import Observer

__all__ = ["Observer", "Runtime"]

log = logging.getLogger("twiceshy")


class Runtime:
    """The rooms a ledger's calls share; one per ledger, made by it.

    Attributes:
        store: the blocking store; ``async_store`` its async twin.
        namespace: the ledger's tenant.
        flights: the calls running in this process, which duplicates join.
        heartbeat: renews the leases of running calls.
        memo: the settled outcomes this process keeps (``remember=``), if any.
        tally: the call counts added to the store, if it keeps them.
        observers: told of every call; ``arounds``: their context managers around each call.
    """

    __slots__ = (
        "__weakref__",
        "_owner_count",
        "_owner_head",
        "_owner_prefix",
        "arounds",
        "async_store",
        "flights",
        "heartbeat",
        "memo",
        "namespace",
        "observers",
        "store",
        "tally",
    )

    def __init__(
        self,
        store: Store,
        async_store: AsyncStore,
        namespace: str,
        *,
        remember: int,
        tally: Tally | None,
    ) -> None:
        self.store = store
        self.async_store = async_store
        self.namespace = namespace
        self.memo = Remembered(remember) if remember else None
        self.flights = Flights()
        self.heartbeat = Heartbeat(store)
        self.tally = tally
        self.observers: tuple[Observer, ...] = ()
        self.arounds: tuple[Callable[[str, Effect], Any], ...] = ()
        self._owner_prefix = secrets.token_hex(8)
        self._owner_count = itertools.count(1)
        self._owner_head = f"{self._owner_prefix}.{os.getpid()}."
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        # Owner tokens name the process: a child's never equal its parent's.
        self._owner_head = f"{self._owner_prefix}.{os.getpid()}."

    def observe(self, observer: Observer) -> None:
        """Tell ``observer`` of every call (and enter its ``around``, if it has one)."""
        self.observers = (*self.observers, observer)
        around = getattr(observer, "around", None)
        if callable(around):
            self.arounds = (*self.arounds, around)

    def owner_token(self) -> str:
        """A token no other call shares: this ledger's random prefix, the process, a counter."""
        return f"{self._owner_head}{next(self._owner_count)}"

    def answered(
        self,
        tool: str,
        effect: Effect,
        key: str | None,
        outcome: Outcome,
        clock: float,
        error: BaseException | None,
        ran: bool = False,
        hint: str = "",
    ) -> None:
        """A call was answered: count it; tell observers and the log when anyone listens.

        ``clock`` is when the call began (``time.perf_counter()``); ``ran``, whether it ran the
        tool, whatever it answers. An unknown outcome is always worth a warning, observed or not;
        ``hint`` says there how the tool could have kept it from needing an operator.
        """
        if self.tally is not None:
            self.tally.add(tool, outcome, ran)
        if self.observers or log.isEnabledFor(logging.DEBUG) or outcome is Outcome.UNKNOWN:
            duration = time.perf_counter() - clock
            self._tell(tool, effect, key, error, outcome, time.time() - duration, duration, hint)

    def _tell(
        self,
        tool: str,
        effect: Effect,
        key: str | None,
        error: BaseException | None,
        outcome: Outcome,
        started: float,
        duration: float,
        hint: str,
    ) -> None:
        event = CallEvent(
            tool=tool,
            effect=effect,
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
                + (f" {clearing(key)}" if outcome is Outcome.UNKNOWN and key else "")
                + (f" {hint}" if hint else ""),
                extra={
                    "twiceshy_tool": event.tool,
                    "twiceshy_key": event.key,
                    "twiceshy_effect": event.effect.value,
                    "twiceshy_outcome": event.outcome.value,
                },
            )
        for observer in self.observers:
            try:
                observer(event)
            except Exception:
                log.exception("twiceshy: an observer failed on %s", event.tool)


class Around:
    """The observers' contexts around one call; an observer that fails is logged and left out."""

    __slots__ = ("_entered", "_tool")

    def __init__(
        self, arounds: tuple[Callable[[str, Effect], Any], ...], tool: str, effect: Effect
    ) -> None:
        self._tool = tool
        self._entered: list[Any] = []
        for around in arounds:
            try:
                context = around(tool, effect)
                context.__enter__()
            except Exception:
                log.exception("twiceshy: an observer failed around %s", tool)
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
