"""The one door of the integrations into twiceshy's core.

Adapters and transports use the public surface (``twiceshy``, ``twiceshy.typing``); what they
need beyond it, and only they, comes through here, so that the core can move behind this door
without touching every adapter.
"""

from __future__ import annotations

from .._binding import Binder, calls_point_of_no_return, refuse_generator
from .._codec import ResultCodec, ReturnOf
from .._forks import reset_in_children
from .._protocol import describe, exhausted
from .._scope import Current, current_call, entered_scope

__all__ = [
    "Binder",
    "Current",
    "ResultCodec",
    "ReturnOf",
    "calls_point_of_no_return",
    "current_call",
    "describe",
    "entered_scope",
    "exhausted",
    "refuse_generator",
    "reset_in_children",
]
