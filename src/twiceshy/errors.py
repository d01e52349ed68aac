"""The errors twiceshy raises, all under :class:`TwiceshyError`.

::

    TwiceshyError
    ├── UnkeyableArgument            an intent that cannot be named
    │   ├── UnkeyableType   (TypeError)    a value of a type with no canonical form
    │   └── UnkeyableValue  (ValueError)   NaN, a naive datetime, a cycle, too deep, too large,
    │                                      colliding mapping keys, a tool name with ":"
    ├── MissingScope        (LookupError)  a protected call outside any ``twiceshy.run(...)``
    ├── EffectNotDeclared   (LookupError, ValueError)  a tool given to an adapter with no
    │                                      effect class and no ``default=``
    ├── KeyReuseMismatch    (ValueError)   a key already names other arguments
    ├── ResultNotStorable   (TypeError)    a tool's return annotation has no JSON form; or, on
    │                                      a retry, the first result could not be kept
    ├── NotApplied                          raised by a tool: nothing took effect
    ├── ReplayedError                       a failure recorded by an earlier call, replayed
    ├── OutcomeUnknown                      the work may or may not have taken effect
    ├── InProgress                          an identical call is still running
    ├── FencedOut                           the call lost its lease: its effect must not start
    ├── RepeatedRequest                     an UNSAFE call sent the same HTTP request twice
    └── StoreError                          the ledger misbehaved
        ├── StoreUnavailable (ConnectionError)  the ledger cannot be reached
        ├── LedgerNotFound                  opened not to create one, there is no ledger there
        ├── EvictionPolicyRefused           a Redis server that may evict the ledger's records
        └── OutcomeNotRecorded              the tool ran; the ledger failed to record how it ended

The framework adapters add their own leaves, raised before anything runs and meant to end the
run (they also subclass the framework's own error for that)::

    MissingScope
    └── ScopeNotFound             twiceshy.integrations.langchain (a LangGraph bubble-up signal)
    EffectNotDeclared
    └── EffectNotDeclared         twiceshy.integrations.langchain, .pydantic_ai, .strands: the
                                  same refusal at call time, as the framework's own signal
    (an adapter's words for the model are these errors' texts, never new types)

``twiceshy.integrations.mcp.ToolFailed`` is no twiceshy error: it stands for a tool's own
``isError`` answer inside the guard, read like any exception of the tool.

``OutcomeUnknown``, ``InProgress`` and a replayed ``ResultNotStorable`` carry a message written
for the model that called the tool: what happened, that the call will not be run again by itself,
and what to tell the user.

Every error of the tree, an adapter's included, survives ``pickle`` and ``copy.deepcopy`` with its
message and its attributes: durable engines journal a step's error, process pools send it back,
and agent frameworks copy their state.
"""

from __future__ import annotations

import copyreg
import datetime as _dt
from typing import Any

__all__ = [
    "EffectNotDeclared",
    "EvictionPolicyRefused",
    "FencedOut",
    "InProgress",
    "KeyReuseMismatch",
    "LedgerNotFound",
    "MissingScope",
    "NotApplied",
    "OutcomeNotRecorded",
    "OutcomeUnknown",
    "RepeatedRequest",
    "ReplayedError",
    "ResultNotStorable",
    "StoreError",
    "StoreUnavailable",
    "TwiceshyError",
    "UnkeyableArgument",
    "UnkeyableType",
    "UnkeyableValue",
]


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # not in typeshed; pickle knows it
"""``cls.__new__(cls, *args)``: pickle writes a reduction by it as its NEWOBJ opcode."""


class TwiceshyError(Exception):
    """The root of every error twiceshy raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduction rebuilds an error as ``type(*args)``, its message alone, which
        # twiceshy's constructors do not take (``OutcomeUnknown(tool, key, reason)``, keyword-only
        # fields): it would fail, or wrap the message in a second one. Rebuilt instead without the
        # constructor: the type's __new__ (copyreg's __newobj__), then BaseException.__setstate__
        # sets each attribute, ``args`` among them (an OSError leaf with its own __init__, such as
        # LedgerDirectoryNotFound, gets its args from __init__ alone). The traceback, __cause__
        # and __context__ are dropped, as pickle drops them from any exception.
        return (_NEWOBJ, (type(self), *self.args), {**vars(self), "args": self.args})


class UnkeyableArgument(TwiceshyError):
    """The arguments of a call cannot be turned into an idempotency key.

    Attributes:
        path: where inside the arguments the offending value sits, e.g. ``args.items[2].when``.
        reason: what is wrong there.
        bound: ``"max_bytes"`` or ``"max_depth"`` when a bound refused the arguments, else
            ``None``.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        self.bound: str | None = None
        super().__init__(f"{path}: {reason}")


class UnkeyableType(UnkeyableArgument, TypeError):
    """A value has a type with no canonical JSON form."""


class UnkeyableValue(UnkeyableArgument, ValueError):
    """A value of a known type cannot be keyed (NaN, a naive datetime, a cycle, too large...)."""


class MissingScope(TwiceshyError, LookupError):
    """A protected call was made outside any ``twiceshy.run(...)`` and without ``scope=``."""


class EffectNotDeclared(TwiceshyError, LookupError, ValueError):
    """A tool was given to an adapter with no effect class and no ``default=``; nothing runs.

    There is no silent default: every tool names SAFE, KEYED or UNSAFE, or a ``twiceshy.Guard``.
    """


class KeyReuseMismatch(TwiceshyError, ValueError):
    """The key of this call already names a call with other arguments; nothing ran."""


class ResultNotStorable(TwiceshyError, TypeError):
    """A result the ledger cannot keep as JSON.

    Raised in two places:

    - when a tool is declared (or wrapped by an adapter) with a return annotation that has no
      JSON form: nothing has run;
    - to a retry of an intent whose first run succeeded with a result that could not be kept
      (no JSON form, or larger than ``max_result_bytes=``). The first caller got the result; the
      ledger recorded that the tool ran, with a bounded text of the result. ``str()`` is then
      written for the model: the tool ran, it was not run again, and what its result said.

    Attributes:
        tool: the tool's name ("" when not known).
        key: the intent's key, on a retry ("" otherwise).
    """

    def __init__(self, message: str, *, tool: str = "", key: str = "") -> None:
        self.tool = tool
        self.key = key
        super().__init__(message)

    @classmethod
    def replayed(
        cls, tool: str, key: str, type_name: str, why: str, text: str
    ) -> ResultNotStorable:
        """The error a retry gets for a first result that was not kept."""
        said = f" It read: {text}" if text else ""
        return cls(
            f"The tool {tool!r} already ran for these arguments and succeeded; it was not run "
            f"again. Its result (a {type_name}) could not be kept ({why}), so it cannot be "
            f"shown again.{said} (reference {key[:16]})",
            tool=tool,
            key=key,
        )


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
        reason: why the outcome is unknown.
        replayed_by: said by an engine adapter where the engine answers every later run of the
            intent with this same error (a DBOS recovery or resume of the workflow): an
            operator's release then runs nothing by itself, and the text says so.
    """

    def __init__(self, tool: str, key: str, reason: str = "", *, replayed_by: str = "") -> None:
        self.tool = tool
        self.key = key
        self.reason = reason
        self.replayed_by = replayed_by
        detail = f" ({reason})" if reason else ""
        super().__init__(
            f"The tool {tool!r} was started but its outcome is unknown{detail}: it may or may not "
            "have taken effect. It will not be run again for these arguments. Do not call it "
            "again; tell the user that the action may have happened and needs to be checked "
            f"(reference {key[:16]}). {clearing(key, replayed_by)}"
        )


def clearing(key: str, replayed_by: str = "") -> str:
    """How an operator clears an unknown outcome, once the effect has been checked;
    ``replayed_by``: what answers every later run with the same error (an engine's recovery)."""
    if replayed_by:
        return (
            f"Once checked, an operator records it with `twiceshy resolve {key[:16]} "
            "--succeeded 'RESULT-JSON'` (it did) or `--released` (it did not); "
            f"{replayed_by} answers this same error whatever is recorded, so work that did not "
            "happen is started again as new work."
        )
    return (
        f"Once checked, an operator clears it with `twiceshy resolve {key[:16]} --released` "
        "(it did not happen: the next call runs it) or `--succeeded 'RESULT-JSON'` (it did)."
    )


class InProgress(TwiceshyError):
    """An identical call has claimed the intent and recorded no outcome yet.

    ``str()`` of this error is written for the model: pass it on as the tool's output. It says
    what is known: a call running in this process is still running; one seen only in the ledger
    started at a time and may still be running or may have stopped with its process, and what
    happens when its lease lapses.

    Raised inside a unit of a durable engine (a DBOS step, a Prefect task, a Temporal activity),
    the engine adapters say so (``ends=``): the engine's retries end with this answer. Where the
    engine offers no later call of the same intent (a DBOS workflow ends with it, and a recovery
    or a resume answers the same), the text promises none (``resumable=False``).

    Attributes:
        tool: the tool's name.
        key: the intent's key.
        started_at: when the intent was first claimed (seconds since the epoch, on the store's
            clock), if known.
        lapses_at: when the current claim's lease lapses (the same clock), if known.
        effect: the tool's effect class (its value: ``"keyed"``...), if known.
        here: the identical call is running in this process.
        resumed: the intent was claimed again since it was first started (a lapsed lease taken
            over, a released or unknown intent run again).
        ends: what ends with this answer, said by an engine adapter (``"Prefect does not retry
            this task"``); ``""`` outside an engine.
        resumable: a later identical call may come by itself (a model's re-call, a retry) and
            take the intent up once the lease lapses. ``False`` where nothing will: the text then
            says that the action needs to be checked.
    """

    def __init__(
        self,
        tool: str,
        key: str,
        *,
        started_at: float | None = None,
        lapses_at: float | None = None,
        effect: str = "",
        here: bool = False,
        resumed: bool = False,
        ends: str = "",
        resumable: bool = True,
    ) -> None:
        self.tool = tool
        self.key = key
        self.started_at = started_at
        self.lapses_at = lapses_at
        self.effect = effect
        self.here = here
        self.resumed = resumed
        self.ends = ends
        self.resumable = resumable
        reference = f"(reference {key[:16]})"
        if here or started_at is None:
            if not ends:
                super().__init__(
                    f"An identical call of the tool {tool!r} is still running; its outcome is not "
                    "known yet and this call did not start it a second time. Tell the user the "
                    f"action is under way {reference}."
                )
                return
            super().__init__(
                f"An identical call of the tool {tool!r} is still running; its outcome is not "
                f"known yet. This call did not start it a second time, and {ends}. Tell the "
                f"user the action is under way and has not been confirmed {reference}."
            )
            return
        again = ", was taken up again since," if resumed else ""
        stop = f", and {ends}" if ends else ""
        then = ""
        tell = "Tell the user the action may be under way and has not been confirmed"
        if not resumable:
            # Nothing comes back for this intent: no lapse will be acted on by itself.
            tell = (
                "Nothing will take it up by itself: tell the user the action may be under way, "
                "has not been confirmed and needs to be checked"
            )
        elif lapses_at is not None:
            after = {
                "keyed": "the next identical call resumes it with the same idempotency key, so "
                "the provider does not apply it twice",
                "unsafe": "its outcome becomes unknown and it is not run again by itself",
            }.get(effect, "the next identical call runs it again")
            then = f" If it records none by {_when(lapses_at)}, {after}."
        super().__init__(
            f"An identical call of the tool {tool!r} started at {_when(started_at)}{again} and has "
            "not recorded an outcome: it may still be running, or the process running it may have "
            f"stopped. This call did not start it a second time{stop}.{then} {tell} {reference}."
        )


def _when(seconds: float) -> str:
    """A store time as the text a model and a user read: UTC, to the second."""
    moment = _dt.datetime.fromtimestamp(seconds, _dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


class FencedOut(TwiceshyError):
    """The call no longer holds its lease: another caller may own the intent now.

    Raised by :func:`twiceshy.point_of_no_return` (and the HTTP transports that mark it) before
    the tool's effect starts: the effect must not start. The call then answers the intent's
    real outcome.

    Attributes:
        tool: the tool's name.
        key: the intent's key.
    """

    def __init__(self, tool: str, key: str) -> None:
        self.tool = tool
        self.key = key
        super().__init__(
            f"the call of {tool!r} no longer holds its lease (another caller may have taken the "
            f"intent over): its effect must not start (reference {key[:16]})"
        )


class RepeatedRequest(TwiceshyError):
    """Inside an UNSAFE call, an HTTP request was about to be sent a second time.

    An SDK retrying a request underneath an UNSAFE tool (a timeout, a dropped connection) would
    apply its effect twice; twiceshy's transports refuse the second send instead. A request
    that carries its own idempotency key (the transport's header, set by the caller) may be
    sent again: the provider deduplicates it. To let an SDK retry safely, give the request an
    idempotency key, or declare the tool KEYED if its provider deduplicates by one.

    Attributes:
        tool: the tool's name.
        method: the request's method.
        url: the request's URL.
    """

    def __init__(self, tool: str, method: str, url: str) -> None:
        self.tool = tool
        self.method = method
        self.url = url
        super().__init__(
            f"the UNSAFE tool {tool!r} refused to send {method} {url} a second time (an HTTP "
            "client retrying it): the first may have taken effect"
        )


class StoreError(TwiceshyError):
    """The ledger's store failed; no work ran unprotected."""


class StoreUnavailable(StoreError, ConnectionError):
    """The ledger's store cannot be reached."""


class LedgerNotFound(StoreError):
    """Opened with ``create=False`` (as the ``twiceshy`` commands open it), the location holds
    no twiceshy ledger; nothing was written there.

    The message names the place looked at: ``no twiceshy ledger at <where>: <why>``.
    """


class EvictionPolicyRefused(StoreError):
    """The Redis server may evict the ledger's records: its ``maxmemory-policy`` is not
    ``noeviction``, or cannot be read. Nothing was written.

    An evicted claim or outcome lets a retry run the work again, an UNSAFE tool included. The
    message names the policy and how to set ``noeviction``; ``allow_eviction=1`` in the URL
    accepts the risk.
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
