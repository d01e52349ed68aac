"""The fake store clock of the tests: it moves only when told to, so leases lapse and outcomes
expire exactly when a test says. The ``clock`` fixture (``conftest.py``) hands one to each test;
tests that build their own stores import it from here."""

from __future__ import annotations


class FakeClock:
    """A store clock that moves only when told to (seconds since the epoch)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds

    def shifted(self, seconds: float) -> ShiftedClock:
        """The clock of another process, ``seconds`` ahead of this one (behind when negative),
        moving when this one moves."""
        return ShiftedClock(self, seconds)


class ShiftedClock:
    """A clock that reads another one plus a constant offset: a process whose clock is wrong."""

    def __init__(self, base: FakeClock, seconds: float) -> None:
        self.base = base
        self.seconds = seconds

    def __call__(self) -> float:
        return self.base.now + self.seconds
