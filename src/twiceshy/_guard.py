"""A guard: one protected tool, its policy bound to a ledger. Framework adapters use guards,
since they see a tool call as a name and a mapping of arguments."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from ._binding import BoundCall
from ._call import Protection, Work
from ._canonical import MAX_BYTES, MAX_DEPTH, _canonical, canonical_digest
from ._drivers import aexecute, execute, nested_work
from ._protocol import CallPlan, Policy, settle
from ._reconciling import Reconciler, areconciled, awaited, loop_running, reconciled
from ._records import Effect, Record, State
from ._scope import Deferred, entered_scope, handed_on
from .errors import MissingScope, UnkeyableArgument, UnkeyableValue

if TYPE_CHECKING:
    from ._ledger import Ledger

__all__ = ["KEPT_ARG_BYTES", "REDACTED", "Guard", "kept_arguments"]

R = TypeVar("R")

KEPT_ARG_BYTES: Final = 4096
"""The largest arguments' text a record keeps (UTF-8 bytes); beyond it, a marker of its size."""
REDACTED: Final = "[redacted]"
"""What a field named in ``redact_args=`` holds in the arguments a record keeps."""


def kept_arguments(text: str | None) -> dict[str, Any] | None:
    """The arguments a record kept (:attr:`Record.args`), decoded; ``None`` when it kept none,
    or only the marker of their size."""
    if text is None or not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class Guard:
    """One protected tool: its policy, bound to a ledger. Immutable; share it.

    Made by :meth:`Ledger.guard` (and by :meth:`Ledger.tool` under the hood). A framework adapter
    that sees a tool call as a name and a mapping of arguments calls :meth:`call` or
    :meth:`acall` with the arguments and the work to run; the work finds the key in
    :func:`twiceshy.current_key`.
    """

    __slots__ = (
        "_fingerprint_head",
        "_ignore_args",
        "_keep_args",
        "_key_args",
        "_ledger",
        "_max_bytes",
        "_max_depth",
        "_protection",
        "_reconcile",
        "_redact_args",
        "_runtime",
        "_scope",
        "policy",
        "recorded",
    )

    def __init__(
        self,
        ledger: Ledger,
        policy: Policy,
        *,
        recorded: bool,
        reconcile: Reconciler | None,
        scope: Callable[[Mapping[str, Any]], str] | None,
        key_args: Collection[str] | None,
        ignore_args: Collection[str],
        max_arg_bytes: int = MAX_BYTES,
        max_arg_depth: int = MAX_DEPTH,
        keep_args: bool = True,
        redact_args: Collection[str] = (),
    ) -> None:
        if key_args is not None and ignore_args:
            raise ValueError("give key_args= or ignore_args=, not both")
        if not isinstance(keep_args, bool):
            raise TypeError("keep_args= must be True or False")
        if isinstance(redact_args, str) or not all(isinstance(n, str) for n in redact_args):
            raise TypeError('redact_args= must be a collection of argument names, e.g. ("iban",)')
        if redact_args and not keep_args:
            raise ValueError("redact_args= redacts the arguments kept: leave out keep_args=False")
        for option, bound in (("max_arg_bytes", max_arg_bytes), ("max_arg_depth", max_arg_depth)):
            if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
                raise ValueError(f"{option}= must be a whole number of at least 1")
        try:
            self._fingerprint_head = f"{policy.tool}:".encode()  # hashed before every call's text
        except UnicodeEncodeError:
            raise ValueError(
                f"a tool name must have a UTF-8 form (it holds a lone surrogate): {policy.tool!r}"
            ) from None
        self._ledger = ledger
        self.policy = policy
        self.recorded = recorded
        self._reconcile = reconcile
        self._scope = scope
        self._key_args = frozenset(key_args) if key_args is not None else None
        self._ignore_args = frozenset(ignore_args)
        self._max_bytes = max_arg_bytes
        self._max_depth = max_arg_depth
        self._keep_args = keep_args
        self._redact_args = frozenset(redact_args)
        self._runtime = ledger.runtime
        self._protection = Protection(
            policy.tool,
            policy.effect,
            policy,
            recorded,
            reconcile,
            self._runtime,
            self._plan_keeping if keep_args else self._plan,  # (one call fewer)
            self._nesting,
        )

    @property
    def protection(self) -> Protection:
        """This guard as the drivers see it (for the tool decorator, which binds its own calls)."""
        return self._protection

    @property
    def reconciler(self) -> Reconciler | None:
        """The tool's ``reconcile=`` function, if it has one."""
        return self._reconcile

    @property
    def name(self) -> str:
        """The tool's name in keys."""
        return self.policy.tool

    @property
    def effect(self) -> Effect:
        """The tool's effect class."""
        return self.policy.effect

    def __repr__(self) -> str:
        return f"Guard({self.name!r}, effect={self.effect.name}, ledger={self._ledger!r})"

    def bind(self, arguments: Mapping[str, Any], *, key: str | None = None) -> BoundCall:
        """A call given by its arguments by name, narrowed by ``key_args`` / ``ignore_args``."""
        return BoundCall.of(
            arguments, key_args=self._key_args, ignore_args=self._ignore_args, explicit_key=key
        )

    def call(
        self,
        arguments: Mapping[str, Any],
        work: Callable[[], R],
        *,
        scope: str | None = None,
        key: str | None = None,
    ) -> R:
        """Run ``work`` at most once for the intent ``(scope, tool, arguments)``; blocking.

        Args:
            arguments: the call's arguments by name; they name the intent.
            work: runs the tool (``twiceshy.current_key()`` is set while it runs).
            scope: the run's scope; by default the innermost ``twiceshy.run(...)``.
            key: an explicit key instead of one derived from scope and arguments.

        Returns:
            The result of this call's run, or of the first run, replayed.

        Raises:
            MissingScope, UnkeyableArgument, KeyReuseMismatch: before anything runs.
            OutcomeUnknown, InProgress: the honest answers for the model.
            StoreError: the ledger failed; nothing ran unprotected.
        """
        bound = self.bind(arguments, key=key)
        return cast("R", execute(self._protection, bound, lambda _key: work(), scope))

    async def acall(
        self,
        arguments: Mapping[str, Any],
        work: Callable[[], Awaitable[R]],
        *,
        scope: str | None = None,
        key: str | None = None,
    ) -> R:
        """:meth:`call` for async work."""
        bound = self.bind(arguments, key=key)
        return cast("R", await aexecute(self._protection, bound, lambda _key: work(), scope))

    def with_errors(
        self,
        *,
        definite: Collection[type[BaseException]] = (),
        not_applied: Collection[type[BaseException]] = (),
        wrappers: Collection[type[BaseException]] = (),
    ) -> Guard:
        """This guard, reading more exception types as certain failures or as "nothing happened".

        For adapters: a framework's own "the tool failed for certain" exception can be added to a
        guard the user built, without rebuilding it. ``wrappers`` are a framework's exception
        types that carry the tool's own error as their ``__cause__``: an unknown outcome's reason
        names that error, never the wrapper.
        """
        return self._replaced(
            definite=(*self.policy.definite, *definite),
            not_applied=(*self.policy.not_applied, *not_applied),
            wrappers=(*self.policy.wrappers, *wrappers),
        )

    def with_stored_answers(self) -> Guard:
        """This guard, answering the call that runs the tool with its result as stored.

        Every retry gets the stored result, rebuilt as the return type; with this, the first
        caller gets the same (a result that could not be kept excepted: the first caller gets
        it as it was). For adapters whose model reads a text made from the result: it then reads
        the same text on the first call and on every retry.
        """
        return self._replaced(answer_stored=True)

    def key_for(
        self, arguments: Mapping[str, Any], *, scope: str | None = None, key: str | None = None
    ) -> str:
        """The key a call of this tool with ``arguments`` goes by (as :meth:`call` derives it).

        Raises:
            MissingScope, UnkeyableArgument: as :meth:`call`, before anything runs.
        """
        return self._plan(self.bind(arguments, key=key), scope).key

    def _replaced(self, **policy: Any) -> Guard:
        """This guard with ``policy`` fields replaced (a guard is immutable)."""
        return Guard(
            self._ledger,
            dataclasses.replace(self.policy, **policy),
            recorded=self.recorded,
            reconcile=self._reconcile,
            scope=self._scope,
            key_args=self._key_args,
            ignore_args=self._ignore_args,
            max_arg_bytes=self._max_bytes,
            max_arg_depth=self._max_depth,
            keep_args=self._keep_args,
            redact_args=self._redact_args,
        )

    def settle(self, key: str) -> Record | None:
        """Ask this tool's reconciler about a parked (UNKNOWN) record, outside any call.

        For operators (``twiceshy reconcile``): the reconciler gets ``(key, args)``, the
        arguments the record kept, decoded (``None`` when it kept none: ``keep_args=False``, a
        record older than kept arguments, or arguments beyond the bound; a field named in
        ``redact_args=`` holds :data:`REDACTED`). A record that is not UNKNOWN, or belongs to
        another tool, is answered unchanged.

        Returns:
            The record afterwards: SUCCEEDED or RELEASED when the reconciler knew, else as it
            was; ``None`` when the key has no record.

        Raises:
            ValueError: the tool has no reconciler.
            StoreError: the ledger failed.
        """
        reconcile = self._reconciler()
        store, ns = self._runtime.store, self._runtime.namespace
        snap = store.get(ns, key)
        record = snap.record
        if record is None or not self._parked(record):
            return record
        answer = reconciled(reconcile, key, kept_arguments(record.args))
        if inspect.isawaitable(answer):
            if loop_running():
                close = getattr(answer, "close", None)
                if callable(close):
                    close()
                raise RuntimeError(
                    f"the reconciler of {self.name!r} is async and an event loop is running "
                    "here: use await guard.asettle(key)"
                )
            answer = asyncio.run(awaited(answer, key))
        change = settle(self.policy, record, answer, snap.now)
        return record if change is None else store.write(ns, key, change).record

    async def asettle(self, key: str) -> Record | None:
        """:meth:`settle` from async code: the reconciler is awaited if it is async, and run
        in a worker thread if it blocks; the ledger is used through its async store."""
        reconcile = self._reconciler()
        store, ns = self._runtime.async_store, self._runtime.namespace
        snap = await store.get(ns, key)
        record = snap.record
        if record is None or not self._parked(record):
            return record
        answer = await areconciled(reconcile, key, kept_arguments(record.args))
        change = settle(self.policy, record, answer, snap.now)
        return record if change is None else (await store.write(ns, key, change)).record

    def _reconciler(self) -> Reconciler:
        if self._reconcile is None:
            raise ValueError(f"the tool {self.name!r} has no reconcile= function")
        return self._reconcile

    def _parked(self, record: Record) -> bool:
        """Whether ``record`` is this tool's, parked UNKNOWN: the one thing settling may change."""
        return record.state is State.UNKNOWN and record.tool == self.name

    # -- shared, no I/O --------------------------------------------------------------------

    def _plan(self, bound: BoundCall, scope: str | None) -> CallPlan:
        """Key and plan one call; every refusal happens here, before anything runs.

        The scope is, in this order: the one given; an enclosing ``twiceshy.run(...)``; the
        ``scope=`` function of the arguments; the scope inherited from an enclosing protected
        call (its nested runs' scope).
        """
        name = self.policy.tool
        if self._keep_args:
            return self._plan_keeping(bound, scope)
        try:
            if bound.explicit_key is not None:
                key = bound.explicit_key
                fingerprint = bound.identity(
                    None, name, max_depth=self._max_depth, max_bytes=self._max_bytes
                )[1]
            else:
                if scope is None:
                    scope = self._scope_of(bound)
                if not scope or not isinstance(scope, str):
                    raise MissingScope(
                        f"the tool {name!r} was called outside any twiceshy.run(...) scope; wrap "
                        "the agent's run in `with twiceshy.run(run_id):` so retries of one intent "
                        "share a key"
                    )
                derived, fingerprint = bound.identity(
                    scope, name, max_depth=self._max_depth, max_bytes=self._max_bytes
                )
                assert derived is not None
                key = derived
        except UnkeyableArgument as refusal:
            if refusal.bound is None:
                raise
            raise self._beyond(refusal) from None
        runtime = self._runtime
        return CallPlan(self.policy, runtime.namespace, key, fingerprint, runtime.owner_token())

    def _plan_keeping(self, bound: BoundCall, scope: str | None) -> CallPlan:
        """:meth:`_plan` for a tool that keeps its arguments: the canonical text made for the
        key is the text kept, made once (the hashing is :meth:`BoundCall.identity`'s)."""
        name = self.policy.tool
        try:
            if bound.explicit_key is None:
                if scope is None:
                    scope = self._scope_of(bound)
                if not scope or not isinstance(scope, str):
                    raise MissingScope(
                        f"the tool {name!r} was called outside any twiceshy.run(...) scope; wrap "
                        "the agent's run in `with twiceshy.run(run_id):` so retries of one intent "
                        "share a key"
                    )
            text, data = _canonical(bound.keyed, self._max_depth, self._max_bytes)
            body = text.encode() if data is None else data
            if bound.keyed is bound.fingerprinted:
                fingerprint = hashlib.sha256(self._fingerprint_head + body).hexdigest()
            else:
                fingerprint = canonical_digest(
                    bound.fingerprinted, self._fingerprint_head, max_depth=self._max_depth
                )
            if bound.explicit_key is not None:
                key = bound.explicit_key
            else:
                try:
                    head = f"{scope}:{name}:".encode()
                except UnicodeEncodeError:
                    raise UnkeyableValue("scope", f"contains a lone surrogate: {scope!r}") from None
                key = hashlib.sha256(head + body).hexdigest()
        except UnkeyableArgument as refusal:
            if refusal.bound is None:
                raise
            raise self._beyond(refusal) from None
        if self._redact_args and not self._redact_args.isdisjoint(bound.keyed):
            # A second canonical pass, only for the calls that carry a field to hide: the key
            # and fingerprint above stay those of the real arguments.
            hidden = {k: REDACTED if k in self._redact_args else v for k, v in bound.keyed.items()}
            text, data = _canonical(hidden, self._max_depth, self._max_bytes)
        size = len(text) if data is None else len(data)
        if size > KEPT_ARG_BYTES:
            text = f"<arguments not kept: {size} bytes, beyond the {KEPT_ARG_BYTES}-byte bound>"
        runtime = self._runtime
        return CallPlan(
            self.policy, runtime.namespace, key, fingerprint, runtime.owner_token(), text
        )

    def _scope_of(self, bound: BoundCall) -> str | None:
        """The scope of a call given none: an enclosing ``twiceshy.run(...)``, else the
        ``scope=`` function of the arguments, else the enclosing protected call's nested one."""
        entered = entered_scope()
        if entered is not None and not entered[1]:
            return entered[0]
        if self._scope is not None:
            return self._scope(bound.arguments)
        if entered is None:
            return None
        handed_on()  # this call is keyed inside the enclosing one: its key is handed on
        return entered[0]

    def _nesting(self, work: Work, bound: BoundCall, scope: str | None) -> Work:
        """``work`` of a SAFE call kept out of the ledger, giving the runs started inside it the
        nested scope a recorded call would give them (its key, derived only if asked for)."""
        outer = scope if scope is not None else self._scope_of(bound)
        if not outer or not isinstance(outer, str):
            return work  # no scope to derive one from: nested runs name their own

        def derive() -> str:
            try:
                return self._plan(bound, outer).key
            except UnkeyableArgument:  # a SAFE call need not be keyable: the outer scope
                return outer

        return nested_work(work, Deferred(derive))

    def _beyond(self, refusal: UnkeyableArgument) -> UnkeyableArgument:
        """A refusal by a bound, saying which option of the tool lifts it."""
        if refusal.bound == "max_bytes":
            hint = (
                f"raise the tool's max_arg_bytes= (now {self._max_bytes}), or name the "
                "arguments that make the intent with key_args= (the others are then only "
                "fingerprinted, with no bound)"
            )
        else:
            hint = f"raise the tool's max_arg_depth= (now {self._max_depth})"
        error = type(refusal)(refusal.path, f"{refusal.reason}; the call did not run: {hint}")
        error.bound = refusal.bound
        return error
