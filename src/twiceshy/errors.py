"""The errors twiceshy raises, all under :class:`TwiceshyError`.

::

    TwiceshyError
    ├── UnkeyableArgument            an intent that cannot be named
    │   ├── UnkeyableType   (TypeError)    a value of a type with no canonical form
    │   └── UnkeyableValue  (ValueError)   NaN, a naive datetime, a cycle, too deep, too large,
    │                                      colliding mapping keys, a tool name with ":"
    ├── MissingScope        (LookupError)  a protected call outside any ``twiceshy.run(...)``
    ├── KeyReuseMismatch    (ValueError)   a key already names other arguments
    ├── ResultNotStorable   (TypeError)    a tool's result has no JSON form, or is too large
    ├── NotApplied                          raised by a tool: nothing took effect
    ├── ReplayedError                       a failure recorded by an earlier call, replayed
    ├── OutcomeUnknown                      the work may or may not have taken effect
    ├── InProgress                          an identical call is still running
    ├── FencedOut                           a newer attempt owns the key
    └── StoreError                          the ledger misbehaved
        ├── StoreUnavailable (ConnectionError)  the ledger cannot be reached
        ├── LedgerNotFound                  opened not to create one, there is no ledger there
        └── OutcomeNotRecorded              the tool ran; the ledger failed to record how it ended

``OutcomeUnknown`` and ``InProgress`` carry a message written for the model that called the tool:
what happened, that the call will not be run again by itself, and what to tell the user.
"""

from __future__ import annotations

__all__ = [
    "FencedOut",
    "InProgress",
    "KeyReuseMismatch",
    "LedgerNotFound",
    "MissingScope",
    "NotApplied",
    "OutcomeNotRecorded",
    "OutcomeUnknown",
    "ReplayedError",
    "ResultNotStorable",
    "StoreError",
    "StoreUnavailable",
    "TwiceshyError",
    "UnkeyableArgument",
    "UnkeyableType",
    "UnkeyableValue",
]


class TwiceshyError(Exception):
    """The root of every error twiceshy raises."""


class UnkeyableArgument(TwiceshyError):
    """The arguments of a call cannot be turned into an idempotency key.

    Attributes:
        path: where inside the arguments the offending value sits, e.g. ``args.items[2].when``.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class UnkeyableType(UnkeyableArgument, TypeError):
    """A value has a type with no canonical JSON form."""


class UnkeyableValue(UnkeyableArgument, ValueError):
    """A value of a known type cannot be keyed (NaN, a naive datetime, a cycle, too large...)."""


class MissingScope(TwiceshyError, LookupError):
    """A protected call was made outside any ``twiceshy.run(...)`` and without ``scope=``."""


class KeyReuseMismatch(TwiceshyError, ValueError):
    """The key of this call already names a call with other arguments; nothing ran."""


class ResultNotStorable(TwiceshyError, TypeError):
    """The tool ran, but its result has no JSON form or exceeds the size bound."""


class NotApplied(TwiceshyError):
    """Raised by a tool to say that nothing took effect: the intent may run again."""


class ReplayedError(TwiceshyError):
    """The first call of this intent failed for certain; its error is replayed.

    Raised when the recorded error's own type cannot be rebuilt (it is not among the tool's
    ``definite=`` types, or does not take a message).

    Attributes:
        type_name: the qualified name of the original error's type.
        message: the original error's message.
    """

    def __init__(self, type_name: str, message: str) -> None:
        self.type_name = type_name
        self.message = message
        super().__init__(f"{type_name}: {message}" if type_name else message)


class OutcomeUnknown(TwiceshyError):
    """The tool may or may not have taken effect, and will not be run again for these arguments.

    ``str()`` of this error is written for the model: pass it on as the tool's output.

    Attributes:
        key: the intent's idempotency key.
        tool: the tool's name.
    """

    def __init__(self, tool: str, key: str, reason: str = "") -> None:
        self.tool = tool
        self.key = key
        self.reason = reason
        detail = f" ({reason})" if reason else ""
        super().__init__(
            f"The tool {tool!r} was started but its outcome is unknown{detail}: it may or may not "
            "have taken effect. It will not be run again for these arguments. Do not call it "
            "again; tell the user that the action may have happened and needs to be checked "
            f"(reference {key[:16]})."
        )


class InProgress(TwiceshyError):
    """An identical call is still running elsewhere; its outcome is not known yet.

    ``str()`` of this error is written for the model: pass it on as the tool's output.
    """

    def __init__(self, tool: str, key: str) -> None:
        self.tool = tool
        self.key = key
        super().__init__(
            f"An identical call of the tool {tool!r} is still running; its outcome is not known "
            "yet and this call did not start it a second time. Tell the user the action is under "
            f"way (reference {key[:16]})."
        )


class FencedOut(TwiceshyError):
    """A write named a fence that is no longer current: a newer attempt owns the key."""


class StoreError(TwiceshyError):
    """The ledger's store failed; no work ran unprotected."""


class StoreUnavailable(StoreError, ConnectionError):
    """The ledger's store cannot be reached."""


class LedgerNotFound(StoreError):
    """Opened with ``create=False`` (as the ``twiceshy`` commands open it), the location holds
    no twiceshy ledger; nothing was written there.

    The message names the place looked at: ``no twiceshy ledger at <where>: <why>``.
    """


class OutcomeNotRecorded(StoreError):
    """The tool ran, and then the ledger failed (its outcome, or its next attempt, could not be
    written): the work may have taken effect. The store's own error is the ``__cause__``.

    The record is marked UNKNOWN where the ledger could still be written (a renewal between
    attempts that failed), else left claimed: once its lease lapses, a KEYED tool is run again
    with the same key, an UNSAFE one is answered :class:`OutcomeUnknown`. ``str()`` is written
    for the model.

    Attributes:
        key: the intent's idempotency key.
        tool: the tool's name.
    """

    def __init__(self, tool: str, key: str, cause: str = "") -> None:
        self.tool = tool
        self.key = key
        detail = f" ({cause})" if cause else ""
        super().__init__(
            f"The tool {tool!r} ran, but the ledger could not record its outcome{detail}: it may "
            "have taken effect. Do not call it again; tell the user that the action may have "
            f"happened and needs to be checked (reference {key[:16]})."
        )
