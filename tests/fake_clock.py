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
