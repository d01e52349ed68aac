"""Fixtures for the framework tests."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def close_default_event_loop() -> Iterator[None]:
    """Close the thread's default event loop that a framework's ``run_sync`` left open.

    Pydantic AI's and the Agents SDK's ``run_sync`` create the thread's default loop and leave it
    open on purpose; dropped later, it would warn (an error here) in whichever test collects it.
    """
    yield
    policy = asyncio.get_event_loop_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            loop = policy.get_event_loop()
        except RuntimeError:
            return
    if not loop.is_running():
        loop.close()
        policy.set_event_loop(None)
