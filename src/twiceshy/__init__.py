"""twiceshy: side-effecting tool calls of AI agents, safe to retry.

An intent (run scope + tool + canonical arguments) gets one key; the key is claimed atomically
in a ledger before the work runs; every retry of the intent gets the first outcome, or an honest
error where nobody can know it.

    >>> import twiceshy
    >>> ledger = twiceshy.Ledger("memory://")
    >>> @ledger.tool(effect=twiceshy.KEYED)
    ... def charge(amount: int, customer: str) -> str:
    ...     return f"charged {amount} to {customer} under {twiceshy.current_key()[:8]}"
    >>> with twiceshy.run("run-42"):
    ...     charge(4900, "cus_1") == charge(4900, customer="cus_1")
    True

(PYTEST_DONT_REWRITE: the package ships a pytest plugin, ``twiceshy.testing``, and pytest would
otherwise rewrite this module's asserts whenever it is installed, and warn when a program that
imported twiceshy then runs pytest.)
"""

import logging as _logging

from ._canonical import canonical_json, idempotency_key
from ._guard import Guard
from ._ledger import Ledger
from ._protocol import DidNotHappen, Happened, exponential_backoff
from ._records import CallEvent, Change, Effect, Outcome, Record, Snapshot, State
from ._scope import (
    current_key,
    current_scope,
    inherited_scope,
    last_outcome,
    point_of_no_return,
    run,
    was_replayed,
)
from .errors import (
    EffectNotDeclared,
    EvictionPolicyRefused,
    FencedOut,
    InProgress,
    KeyReuseMismatch,
    LedgerNotFound,
    MissingScope,
    NotApplied,
    OutcomeNotRecorded,
    OutcomeUnknown,
    RepeatedRequest,
    ReplayedError,
    ResultNotStorable,
    StoreError,
    StoreUnavailable,
    TwiceshyError,
    UnkeyableArgument,
    UnkeyableType,
    UnkeyableValue,
)

SAFE = Effect.SAFE
"""Safe to retry: reads, searches, computations."""
KEYED = Effect.KEYED
"""Safe with a key: the provider deduplicates by the key twiceshy hands the tool."""
UNSAFE = Effect.UNSAFE
"""Never retry blindly: one attempt, then an honest error."""


def __getattr__(name: str) -> str:
    # The installed package's version, from its metadata (pyproject.toml is its one source),
    # read when first asked for: reading the metadata costs milliseconds at every import.
    if name != "__version__":
        raise AttributeError(f"module 'twiceshy' has no attribute {name!r}")
    from importlib import metadata as _metadata  # itself tens of milliseconds to import

    try:
        version = _metadata.version("twiceshy")
    except _metadata.PackageNotFoundError:  # run from a source tree that is not installed
        version = "0+unknown"
    globals()["__version__"] = version
    return version


# A library leaves handlers to the application: without one, Python's last-resort handler would
# print twiceshy's warnings to stderr.
_logging.getLogger("twiceshy").addHandler(_logging.NullHandler())

__all__ = [
    "KEYED",
    "SAFE",
    "UNSAFE",
    "CallEvent",
    "Change",
    "DidNotHappen",
    "Effect",
    "EffectNotDeclared",
    "EvictionPolicyRefused",
    "FencedOut",
    "Guard",
    "Happened",
    "InProgress",
    "KeyReuseMismatch",
    "Ledger",
    "LedgerNotFound",
    "MissingScope",
    "NotApplied",
    "Outcome",
    "OutcomeNotRecorded",
    "OutcomeUnknown",
    "Record",
    "RepeatedRequest",
    "ReplayedError",
    "ResultNotStorable",
    "Snapshot",
    "State",
    "StoreError",
    "StoreUnavailable",
    "TwiceshyError",
    "UnkeyableArgument",
    "UnkeyableType",
    "UnkeyableValue",
    "__version__",
    "canonical_json",
    "current_key",
    "current_scope",
    "exponential_backoff",
    "idempotency_key",
    "inherited_scope",
    "last_outcome",
    "point_of_no_return",
    "run",
    "was_replayed",
]
