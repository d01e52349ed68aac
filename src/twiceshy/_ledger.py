"""The ledger: where keys are claimed and outcomes kept, and what makes guards and tools.

:class:`Ledger` opens its store, holds what its calls share (:class:`~twiceshy._runtime.Runtime`),
and makes :class:`~twiceshy.Guard` objects (``ledger.guard``) and protected tools
(``ledger.tool``). What happens in one call is the protocol's (``_protocol``), carried out by the
drivers (``_drivers``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Any, Literal, ParamSpec, TypeVar

from ._canonical import MAX_BYTES, MAX_DEPTH
from ._codec import MAX_RESULT_BYTES, ResultCodec
from ._decorator import decorating
from ._guard import Guard
from ._protocol import Policy, exponential_backoff
from ._reconciling import Reconciler
from ._records import Effect
from ._runtime import Observer, Runtime
from ._tally import Tally
from .errors import ResultNotStorable
from .stores import AsyncStore, CallCounts, Store, default_url, open_store, redacted_url
from .typing import NOT_GIVEN, NotGiven

__all__ = ["Duration", "Ledger"]

P = ParamSpec("P")
R = TypeVar("R")

Duration = float | timedelta


def _given(value: object, name: str, kinds: tuple[type, ...], what: str) -> None:
    """Refuse an option given as something else than ``kinds`` (``None`` included): left out,
    it takes its default (``NOT_GIVEN``)."""
    if value is NOT_GIVEN:
        return
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        raise TypeError(f"{name}= must be {what}, not {value!r}; leave it out for the default")


def _seconds(value: Duration, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        raise ValueError(f"{name}= must not be negative")
    return seconds


class Ledger:
    """Where keys are claimed and outcomes kept; protects tools with :meth:`tool`.

    One ledger serves sync and async tools, threads and tasks. Create it once and share it.

    Args:
        url: ``memory://``, ``sqlite:///path/ledger.db``, ``postgresql://…``, ``redis://…``; by
            default ``TWICESHY_LEDGER``, else the embedded SQLite file
            ``$XDG_STATE_HOME/twiceshy/ledger.db``.
        namespace: a tenant: records of different namespaces never meet.
        store: a store object instead of a URL (anything implementing
            :class:`twiceshy.stores.Store`).
        async_store: its async twin, when ``store`` is given and async tools are used.
        observers: told of every protected call once it is answered (see :meth:`observe`).
        counts_interval: how often this process adds its call counts (how each call was
            answered: executed, replayed, joined, ...) to the store, for ``twiceshy stats``;
            they are added once more by :meth:`close`. ``None`` keeps them in the process.
        remember: how many settled outcomes (SUCCEEDED, FAILED) this process keeps, the least
            recently used dropped first, to answer its own retries of them without a round
            trip to the store. ``0`` (the default) asks the store every time. A kept outcome
            is dropped no later than the store's retention ends; a record deleted from the
            store by hand is still answered from here until then. Each kept outcome holds its
            result's JSON text (at most the tool's ``max_result_bytes``).

    Raises:
        ValueError: the URL names no known store.
        StoreUnavailable: the store cannot be reached.
    """

    def __init__(
        self,
        url: str | NotGiven = NOT_GIVEN,
        *,
        namespace: str = "",
        store: Store | None = None,
        async_store: AsyncStore | None = None,
        observers: Collection[Observer] = (),
        counts_interval: Duration | None = 10.0,
        remember: int = 0,
    ) -> None:
        if not isinstance(namespace, str):
            raise TypeError("namespace= must be a string")
        if not isinstance(remember, int) or isinstance(remember, bool):
            raise TypeError("remember= must be a whole number of outcomes")
        if remember < 0:
            raise ValueError("remember= must be 0 or more")
        if store is not None:
            if url is not NOT_GIVEN:
                raise ValueError("give a url or a store, not both")
            from .stores import ThreadedAsyncStore

            self.url = f"<{type(store).__name__}>"
            opened: tuple[Store, AsyncStore] = (store, async_store or ThreadedAsyncStore(store))
        else:
            if url is NOT_GIVEN:
                url = default_url()
            elif not isinstance(url, str):
                raise TypeError(
                    f"url= must be a ledger URL (a str), not {url!r}; leave it out for "
                    "TWICESHY_LEDGER or the default file"
                )
            self.url = url
            opened = open_store(self.url)
        self.namespace = namespace
        interval = None if counts_interval is None else _seconds(counts_interval, "counts_interval")
        if interval == 0:
            raise ValueError("counts_interval= must be positive, or None")
        tally = (
            Tally(opened[0], namespace, interval)
            if interval is not None and isinstance(opened[0], CallCounts)
            else None
        )
        #: What this ledger's guards and their calls share.
        self.runtime = Runtime(opened[0], opened[1], namespace, remember=remember, tally=tally)
        for observer in observers:
            self.observe(observer)

    @property
    def store(self) -> Store:
        """The ledger's blocking store."""
        return self.runtime.store

    @property
    def async_store(self) -> AsyncStore:
        """The ledger's async store: its calls of async tools go through it."""
        return self.runtime.async_store

    @async_store.setter
    def async_store(self, store: AsyncStore) -> None:
        self.runtime.async_store = store

    def observe(self, observer: Observer) -> None:
        """Tell ``observer`` of every protected call of this ledger once it is answered.

        Observers run in the caller's thread (and context) right after the call; one that
        raises is logged and otherwise ignored: observing never changes an outcome. An observer
        with a method ``around(tool, effect)`` also gets to wrap every call in the context
        manager it returns (see :data:`Observer`).
        """
        self.runtime.observe(observer)

    def __repr__(self) -> str:
        return f"Ledger({redacted_url(self.url)!r}, namespace={self.namespace!r})"

    def counts(self) -> dict[tuple[str, str], int]:
        """This process's call counts not yet added to the store, by ``(tool, outcome)``.

        Beside the outcomes, ``(tool, "ran")`` counts the calls that ran the tool, however they
        were answered (one that ran and lost its reply answers ``unknown``).
        """
        tally = self.runtime.tally
        return tally.pending() if tally is not None else {}

    def flush_counts(self) -> None:
        """Add this process's pending call counts to the store now.

        They are also added every ``counts_interval`` seconds and by :meth:`close`.

        Raises:
            StoreError: the store failed; the counts stay for the next flush.
        """
        if self.runtime.tally is not None:
            self.runtime.tally.flush()

    def close(self) -> None:
        """Add the pending call counts to the store and release its connections."""
        if self.runtime.tally is not None:
            self.runtime.tally.close()
        self.store.close()

    async def aclose(self) -> None:
        """Add the pending call counts and release the store's connections, async ones included."""
        if self.runtime.tally is not None:
            await asyncio.to_thread(self.runtime.tally.close)
        await self.async_store.close()
        self.store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def guard(
        self,
        name: str,
        *,
        effect: Effect,
        lease: Duration = 30.0,
        wait: Duration = 10.0,
        ttl: Duration | None = timedelta(hours=24),
        key_args: Collection[str] | NotGiven = NOT_GIVEN,
        ignore_args: Collection[str] = (),
        definite: Collection[type[BaseException]] = (),
        not_applied: Collection[type[BaseException]] = (),
        attempts: int | NotGiven = NOT_GIVEN,
        backoff: Callable[[int], float] | NotGiven = NOT_GIVEN,
        reconcile: Reconciler | None = None,
        record: bool | NotGiven = NOT_GIVEN,
        scope: Callable[[Mapping[str, Any]], str] | None = None,
        returns: Any = None,
        max_result_bytes: int = MAX_RESULT_BYTES,
        effect_at: Literal["mark", "http"] | None = None,
        max_arg_bytes: int = MAX_BYTES,
        max_arg_depth: int = MAX_DEPTH,
        release_grace: Duration | NotGiven = NOT_GIVEN,
        key_window: Duration | None = None,
        keep_args: bool = True,
        redact_args: Collection[str] = (),
    ) -> Guard:
        """A :class:`Guard` for the tool ``name``: the options of :meth:`tool`, without a function.

        ``returns`` is the type results are rebuilt as on replay (the decorator takes it from
        the function's return annotation). ``effect_at`` has no ``"auto"`` here: there is no
        function to read.

        Raises:
            ResultNotStorable: ``returns`` has no JSON form.
        """
        if not isinstance(effect, Effect):
            raise TypeError("effect= must be twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE")
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a tool name must be a non-empty string without ':' ({name!r})")
        _given(record, "record", (bool,), "True or False")
        _given(attempts, "attempts", (int,), "a whole number")
        _given(release_grace, "release_grace", (int, float, timedelta), "a duration")
        if backoff is not NOT_GIVEN and not callable(backoff):
            raise TypeError(
                "backoff= must be a function of the attempt; leave it out for the default"
            )
        if record is not NOT_GIVEN and effect is not Effect.SAFE:
            raise ValueError("record= applies to SAFE tools; KEYED and UNSAFE are always recorded")
        if attempts is NOT_GIVEN:
            attempts = 1 if effect is Effect.UNSAFE else 3
        if attempts < 1:
            raise ValueError("attempts= must be at least 1")
        if effect is Effect.UNSAFE and attempts != 1:
            raise ValueError("an UNSAFE tool runs exactly once: attempts= must be 1")
        lease_s = _seconds(lease, "lease")
        if lease_s <= 0:
            raise ValueError("lease= must be positive")
        window = None if key_window is None else _seconds(key_window, "key_window")
        if window is not None and effect is not Effect.KEYED:
            raise ValueError(
                "key_window= is how long a provider remembers the key of a KEYED tool; "
                f"leave it out for a {effect.name} tool"
            )
        if window is not None and window <= 0:
            raise ValueError("key_window= must be positive")
        if effect_at not in (None, "mark", "http"):
            raise ValueError(f"effect_at= must be 'mark', 'http' or None, not {effect_at!r}")
        try:
            codec = ResultCodec(returns, max_bytes=max_result_bytes)
        except ResultNotStorable as exc:
            raise ResultNotStorable(
                f"the tool {name!r} is declared to return what the ledger cannot keep: {exc}. "
                "Return JSON types, a dataclass, a TypedDict, a named tuple or a pydantic model "
                "(or convert the result first); nothing has run",
                tool=name,
            ) from None
        policy = Policy(
            tool=name,
            effect=effect,
            lease=lease_s,
            wait=_seconds(wait, "wait"),
            ttl=None if ttl is None else _seconds(ttl, "ttl"),
            attempts=attempts,
            backoff=exponential_backoff() if backoff is NOT_GIVEN else backoff,
            definite=tuple(definite),
            not_applied=tuple(not_applied),
            codec=codec,
            reconcile=reconcile is not None,
            effect_at=effect_at,
            release_grace=(
                2 * lease_s
                if release_grace is NOT_GIVEN
                else _seconds(release_grace, "release_grace")
            ),
            key_window=window,
        )
        return Guard(
            self,
            policy,
            recorded=effect is not Effect.SAFE or record is True,
            reconcile=reconcile,
            scope=scope,
            key_args=None if key_args is NOT_GIVEN else key_args,
            ignore_args=ignore_args,
            max_arg_bytes=max_arg_bytes,
            max_arg_depth=max_arg_depth,
            keep_args=keep_args,
            redact_args=redact_args,
        )

    def tool(
        self,
        *,
        effect: Effect,
        name: str | NotGiven = NOT_GIVEN,
        lease: Duration = 30.0,
        wait: Duration = 10.0,
        ttl: Duration | None = timedelta(hours=24),
        key_args: Collection[str] | NotGiven = NOT_GIVEN,
        ignore_args: Collection[str] = (),
        definite: Collection[type[BaseException]] = (),
        not_applied: Collection[type[BaseException]] = (),
        attempts: int | NotGiven = NOT_GIVEN,
        backoff: Callable[[int], float] | NotGiven = NOT_GIVEN,
        reconcile: Reconciler | None = None,
        record: bool | NotGiven = NOT_GIVEN,
        scope: Callable[[Mapping[str, Any]], str] | None = None,
        key_param: str = "idempotency_key",
        inject: Collection[str] = (),
        max_result_bytes: int = MAX_RESULT_BYTES,
        effect_at: Literal["auto", "mark", "http"] | None = "auto",
        max_arg_bytes: int = MAX_BYTES,
        max_arg_depth: int = MAX_DEPTH,
        release_grace: Duration | NotGiven = NOT_GIVEN,
        key_window: Duration | None = None,
        keep_args: bool = True,
        redact_args: Collection[str] = (),
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Protect a tool (``def`` or ``async def``); the decorated tool keeps its signature.

        Args:
            effect: what the tool does to the world: ``SAFE``, ``KEYED`` or ``UNSAFE``. Required:
                there is no silent default.
            name: the tool's name in keys (default: the function's ``__name__``).
            lease: how long a claim holds without renewal; a heartbeat renews it while the tool
                runs. After a crash, a KEYED tool is taken over and an UNSAFE one becomes UNKNOWN
                once the lease lapses.
            wait: how long a duplicate waits for a running call before ``InProgress``.
            ttl: how long outcomes are kept (``None``: forever). A retry after that runs again.
            key_args: only these parameters name the intent (the rest must match, or
                ``KeyReuseMismatch``).
            ignore_args: parameters left out of the intent (volatile ones).
            definite: exception types meaning "it ran and failed for certain": recorded, replayed.
            not_applied: exception types meaning "nothing happened": the intent may run again.
            attempts: runs of a KEYED or SAFE tool on ambiguous errors, with backoff and the same
                key (default 3). An UNSAFE tool has exactly one.
            backoff: the delay after the n-th attempt (default: exponential with full jitter).
            reconcile: ``reconcile(key, args)`` looks at the provider for an UNKNOWN intent and
                answers ``Happened(result)``, ``DidNotHappen()`` or ``None`` (cannot tell).
            record: SAFE tools only: keep outcomes in the ledger (replay within a run).
            scope: derive the scope from the call's arguments when no ``twiceshy.run`` is active.
            key_param: the parameter through which the key is injected, if the tool has it.
            inject: parameters a framework fills in (contexts), left out of the key.
            max_result_bytes: the bound on a stored result. A result beyond it (or with no JSON
                form) is recorded as done all the same, and a retry is told so
                (:class:`~twiceshy.ResultNotStorable`).
            effect_at: where the tool's effect starts, so that an exception raised before it
                means nothing happened (the intent is released, the next call runs it):
                ``"mark"``, where the tool calls :func:`twiceshy.point_of_no_return`; ``"http"``,
                at its first request through a twiceshy HTTP transport (or an earlier
                ``point_of_no_return()``); ``None``, unsaid (any exception may follow an effect).
                ``"auto"`` (the default) is ``"mark"`` when the tool's own code calls
                ``point_of_no_return``, else ``None``.
            max_arg_bytes: the largest canonical text of the arguments that name the intent, in
                UTF-8 bytes (1 MiB by default); with ``key_args=`` it bounds only those.
            max_arg_depth: how deeply containers in the arguments may nest (64 by default).
            release_grace: how long after an UNSAFE call's lapsed lease was marked unknown its
                reconciler may not release it (``DidNotHappen()`` is then read as "cannot
                tell"): a lapse is not a crash, and a paused owner may still be taking effect.
                Twice the lease by default.
            key_window: KEYED tools only: how long the provider remembers an idempotency key
                (Stripe: 24 hours). Past it, counted from the intent's first claim, an intent
                that is not settled is no longer run again with its key: it answers as an
                UNSAFE one would (``OutcomeUnknown``, after the reconciler). ``None`` (the
                default): no window, the key is used however late.
            keep_args: keep each call's arguments with its record (the default): the canonical
                JSON text of the arguments that name the intent, the text its key is made from,
                up to 4 KiB (beyond it, a marker of their size). ``twiceshy show`` shows them
                and a reconciler outside a call (``twiceshy reconcile``) gets them. They may be
                personal data (names, IBANs, addresses) and are kept as long as the record:
                ``False`` keeps none.
            redact_args: names of arguments kept as ``"[redacted]"`` instead of their value
                (the key and fingerprint are still made from the real values).

        Raises:
            ValueError: an option is out of range or names parameters the tool lacks.
            TypeError: ``keep_args`` is not a bool, or ``redact_args`` is not a collection of
                names.
            ResultNotStorable: the return annotation has no JSON form.
        """

        return decorating(
            self,
            name=name,
            key_param=key_param,
            inject=inject,
            effect_at=effect_at,
            options={
                "effect": effect,
                "lease": lease,
                "wait": wait,
                "ttl": ttl,
                "key_args": key_args,
                "ignore_args": ignore_args,
                "definite": definite,
                "not_applied": not_applied,
                "attempts": attempts,
                "backoff": backoff,
                "reconcile": reconcile,
                "record": record,
                "scope": scope,
                "max_result_bytes": max_result_bytes,
                "max_arg_bytes": max_arg_bytes,
                "max_arg_depth": max_arg_depth,
                "keep_args": keep_args,
                "redact_args": redact_args,
                "release_grace": release_grace,
                "key_window": key_window,
            },
        )
