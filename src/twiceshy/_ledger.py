"""The ledger and its tool decorator: the sync and async drivers of the protocol.

Nothing here decides anything about a call: :mod:`twiceshy._protocol` does. A driver binds the
arguments, derives the key, joins a call already running in this process, and carries out the
protocol's commands, blocking or with ``await``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, cast

from ._binding import Binder, BoundCall
from ._codec import MAX_RESULT_BYTES, ResultCodec
from ._inflight import Flights, Heartbeat
from ._protocol import (
    CallPlan,
    Claim,
    Now,
    Policy,
    Protocol,
    Ran,
    Reconcile,
    Run,
    Sleep,
    Wait,
    Write,
    exponential_backoff,
    protect,
    retry_only,
)
from ._records import Effect
from ._scope import current_scope, reset_key, set_key
from .errors import InProgress, KeyReuseMismatch, MissingScope
from .stores import AsyncStore, Store, default_url, open_store

__all__ = ["Ledger", "ToolOptions"]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("twiceshy")

Duration = float | timedelta
Reconciler = Callable[[str, Mapping[str, Any]], Any]


def _for_joiners(plan: CallPlan, error: BaseException) -> BaseException:
    """What callers joined to a flight get when it ends in ``error``.

    An interruption of the leader (``KeyboardInterrupt``, a cancelled task) is the leader's own
    business: the joined callers learn only that the call did not finish here.
    """
    return error if isinstance(error, Exception) else InProgress(plan.policy.tool, plan.key)


def _reconciled(reconcile: Reconciler, key: str, arguments: Mapping[str, Any]) -> Any:
    """Ask a reconciler; a reconciler that fails cannot tell, and the doubt stands."""
    try:
        return reconcile(key, arguments)
    except Exception:
        log.warning("twiceshy: reconcile of key %s failed", key, exc_info=True)
        return None


def _seconds(value: Duration, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        raise ValueError(f"{name}= must not be negative")
    return seconds


@dataclass(frozen=True, slots=True)
class ToolOptions:
    """How one tool is protected; built once by :meth:`Ledger.tool`.

    Attributes:
        policy: what the protocol needs to know about the tool.
        recorded: whether calls go through the ledger (every KEYED and UNSAFE tool; SAFE
            tools with ``record=True``).
        reconcile: the tool's reconciler, if any.
        scope: derives the scope from the arguments when no ``twiceshy.run`` is active.
        binder: binds calls to the tool's signature.
    """

    policy: Policy
    recorded: bool
    reconcile: Reconciler | None
    scope: Callable[[Mapping[str, Any]], str] | None
    binder: Binder

    @property
    def name(self) -> str:
        """The tool's name in keys."""
        return self.policy.tool


class Ledger:
    """Where keys are claimed and outcomes kept; protects tools with :meth:`tool`.

    One ledger serves sync and async tools, threads and tasks. Create it once and share it.

    Args:
        url: ``memory://``, ``sqlite:///path/ledger.db``; by default ``TWICESHY_LEDGER``, else
            the embedded SQLite file ``$XDG_STATE_HOME/twiceshy/ledger.db``.
        namespace: a tenant: records of different namespaces never meet.
        store: a store object instead of a URL (anything implementing
            :class:`twiceshy.stores.Store`).
        async_store: its async twin, when ``store`` is given and async tools are used.

    Raises:
        ValueError: the URL names no known store.
        StoreUnavailable: the store cannot be reached.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str = "",
        store: Store | None = None,
        async_store: AsyncStore | None = None,
    ) -> None:
        if store is not None:
            if url is not None:
                raise ValueError("give a url or a store, not both")
            from .stores import ThreadedAsyncStore

            self.url = f"<{type(store).__name__}>"
            self.store: Store = store
            self.async_store: AsyncStore = async_store or ThreadedAsyncStore(store)
        else:
            self.url = url if url is not None else default_url()
            self.store, self.async_store = open_store(self.url)
        if not isinstance(namespace, str):
            raise TypeError("namespace= must be a string")
        self.namespace = namespace
        self._flights = Flights()
        self._heartbeat = Heartbeat(self.store)
        self._owner_prefix = secrets.token_hex(8)
        self._owner_count = itertools.count(1)

    def _owner_token(self) -> str:
        """A token no other call shares: this ledger's random prefix, the process, a counter."""
        return f"{self._owner_prefix}.{os.getpid()}.{next(self._owner_count)}"

    def __repr__(self) -> str:
        return f"Ledger({self.url!r}, namespace={self.namespace!r})"

    def close(self) -> None:
        """Release the store's connections."""
        self.store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tool(
        self,
        *,
        effect: Effect,
        name: str | None = None,
        lease: Duration = 30.0,
        wait: Duration = 10.0,
        ttl: Duration | None = timedelta(hours=24),
        key_args: Collection[str] | None = None,
        ignore_args: Collection[str] = (),
        definite: Collection[type[BaseException]] = (),
        not_applied: Collection[type[BaseException]] = (),
        attempts: int | None = None,
        backoff: Callable[[int], float] | None = None,
        reconcile: Reconciler | None = None,
        record: bool | None = None,
        scope: Callable[[Mapping[str, Any]], str] | None = None,
        key_param: str = "idempotency_key",
        inject: Collection[str] = (),
        max_result_bytes: int = MAX_RESULT_BYTES,
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
            max_result_bytes: the bound on a stored result.

        Raises:
            ValueError: an option is out of range or names parameters the tool lacks.
        """
        if not isinstance(effect, Effect):
            raise TypeError("effect= must be twiceshy.SAFE, twiceshy.KEYED or twiceshy.UNSAFE")
        if record is not None and effect is not Effect.SAFE:
            raise ValueError("record= applies to SAFE tools; KEYED and UNSAFE are always recorded")
        if attempts is None:
            attempts = 1 if effect is Effect.UNSAFE else 3
        if attempts < 1:
            raise ValueError("attempts= must be at least 1")
        if effect is Effect.UNSAFE and attempts != 1:
            raise ValueError("an UNSAFE tool runs exactly once: attempts= must be 1")
        lease_s = _seconds(lease, "lease")
        if lease_s <= 0:
            raise ValueError("lease= must be positive")

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            is_async = inspect.iscoroutinefunction(fn)
            if reconcile is not None and not is_async and inspect.iscoroutinefunction(reconcile):
                raise TypeError("a sync tool needs a sync reconcile= function")
            try:
                hints = inspect.get_annotations(fn, eval_str=True)
            except Exception:
                hints = {}
            options = ToolOptions(
                policy=Policy(
                    tool=name or fn.__name__,
                    effect=effect,
                    lease=lease_s,
                    wait=_seconds(wait, "wait"),
                    ttl=None if ttl is None else _seconds(ttl, "ttl"),
                    attempts=attempts,
                    backoff=backoff or exponential_backoff(),
                    definite=tuple(definite),
                    not_applied=tuple(not_applied),
                    codec=ResultCodec(hints.get("return"), max_bytes=max_result_bytes),
                    reconcile=reconcile is not None,
                ),
                recorded=effect is not Effect.SAFE or bool(record),
                reconcile=reconcile,
                scope=scope,
                binder=Binder(
                    fn,
                    key_param=key_param,
                    inject=inject,
                    key_args=key_args,
                    ignore_args=ignore_args,
                ),
            )
            if ":" in options.name:
                raise ValueError(f"a tool name must not contain ':' ({options.name!r})")
            if is_async:
                wrapper = self._async_wrapper(cast("Callable[..., Awaitable[Any]]", fn), options)
            else:
                wrapper = self._sync_wrapper(fn, options)
            wrapper.twiceshy = options  # type: ignore[attr-defined]
            return cast("Callable[P, R]", wrapper)

        return decorate

    # -- shared, no I/O --------------------------------------------------------------------

    def _plan(
        self, options: ToolOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[CallPlan, BoundCall]:
        """Bind, key and plan one call; every refusal happens here, before anything runs."""
        bound = options.binder.bind(args, kwargs)
        if bound.explicit_key is not None:
            key, fingerprint = bound.explicit_key, bound.identity(None, options.name)[1]
        else:
            scope = current_scope()
            if scope is None and options.scope is not None:
                scope = options.scope(bound.arguments)
            if not scope or not isinstance(scope, str):
                raise MissingScope(
                    f"the tool {options.name!r} was called outside any twiceshy.run(...) scope; "
                    "wrap the agent's run in `with twiceshy.run(run_id):` so retries of one "
                    "intent share a key"
                )
            derived, fingerprint = bound.identity(scope, options.name)
            assert derived is not None
            key = derived
        plan = CallPlan(options.policy, self.namespace, key, fingerprint, self._owner_token())
        return plan, bound

    @staticmethod
    def _mismatch(plan: CallPlan) -> KeyReuseMismatch:
        return KeyReuseMismatch(
            f"the key {plan.key} is in use by a running call of {plan.policy.tool!r} with other "
            "arguments; this call did not run"
        )

    # -- the blocking driver ---------------------------------------------------------------

    def _sync_wrapper(self, fn: Callable[..., Any], options: ToolOptions) -> Callable[..., Any]:
        @functools.wraps(fn)
        def protected(*args: Any, **kwargs: Any) -> Any:
            if not options.recorded:
                plain = retry_only(options.policy)
                return self._drive(plain, fn, args, kwargs, options, None)
            plan, bound = self._plan(options, args, kwargs)
            flight, leader = self._flights.join(plan.namespace, plan.key, plan.fingerprint)
            if not leader:
                if flight.fingerprint != plan.fingerprint:
                    raise self._mismatch(plan)
                if not flight.wait(plan.policy.wait):
                    raise InProgress(plan.policy.tool, plan.key)
                return flight.outcome()
            try:
                value = self._drive(protect(plan), fn, args, kwargs, options, plan, bound)
            except BaseException as exc:
                self._flights.land(plan.namespace, plan.key, flight, None, _for_joiners(plan, exc))
                raise
            self._flights.land(plan.namespace, plan.key, flight, value, None)
            return value

        return protected

    def _drive(
        self,
        protocol: Protocol,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: ToolOptions,
        plan: CallPlan | None,
        bound: BoundCall | None = None,
    ) -> Any:
        store, ns = self.store, self.namespace
        answer: Any = None
        while True:
            try:
                command = protocol.send(answer)
            except StopIteration as stop:
                return stop.value
            if isinstance(command, Now):
                answer = time.monotonic()
            elif isinstance(command, Write):
                assert plan is not None
                answer = store.write(ns, plan.key, command.change)
            elif isinstance(command, Claim):
                assert plan is not None
                answer = store.claim(
                    ns,
                    plan.key,
                    fingerprint=plan.fingerprint,
                    tool=plan.policy.tool,
                    effect=plan.policy.effect,
                    owner=plan.owner,
                    lease=plan.policy.lease,
                )
            elif isinstance(command, Run):
                answer = self._run_sync(fn, args, kwargs, options, plan, command)
            elif isinstance(command, Wait):
                assert plan is not None
                answer = store.wait(ns, plan.key, command.fence, command.timeout)
            elif isinstance(command, Sleep):
                time.sleep(command.seconds)
                answer = None
            elif isinstance(command, Reconcile):
                assert plan is not None
                assert bound is not None
                assert options.reconcile is not None
                answer = _reconciled(options.reconcile, plan.key, bound.arguments)
            else:  # pragma: no cover - the protocol yields nothing else
                raise AssertionError(command)

    def _run_sync(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: ToolOptions,
        plan: CallPlan | None,
        command: Run,
    ) -> Ran:
        if plan is None:
            try:
                return Ran(value=fn(*args, **kwargs))
            except Exception as exc:
                return Ran(error=exc)
        call_args, call_kwargs = options.binder.call_args(args, kwargs, plan.key)
        job = self._heartbeat.start(
            plan.namespace, plan.key, command.fence, plan.owner, plan.policy.lease
        )
        token = set_key(plan.key)
        try:
            value = fn(*call_args, **call_kwargs)
        except Exception as exc:
            return Ran(error=exc, renewed_at=job.renewed_at)
        finally:
            reset_key(token)
            self._heartbeat.stop(job)
        return Ran(value=value, renewed_at=job.renewed_at)

    # -- the async driver ------------------------------------------------------------------

    def _async_wrapper(
        self, fn: Callable[..., Awaitable[Any]], options: ToolOptions
    ) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def protected(*args: Any, **kwargs: Any) -> Any:
            if not options.recorded:
                plain = retry_only(options.policy)
                return await self._adrive(plain, fn, args, kwargs, options, None)
            plan, bound = self._plan(options, args, kwargs)
            flight, leader = self._flights.join(plan.namespace, plan.key, plan.fingerprint)
            if not leader:
                if flight.fingerprint != plan.fingerprint:
                    raise self._mismatch(plan)
                if not await flight.wait_async(plan.policy.wait):
                    raise InProgress(plan.policy.tool, plan.key)
                return flight.outcome()
            try:
                value = await self._adrive(protect(plan), fn, args, kwargs, options, plan, bound)
            except BaseException as exc:
                self._flights.land(plan.namespace, plan.key, flight, None, _for_joiners(plan, exc))
                raise
            self._flights.land(plan.namespace, plan.key, flight, value, None)
            return value

        return protected

    async def _adrive(
        self,
        protocol: Protocol,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: ToolOptions,
        plan: CallPlan | None,
        bound: BoundCall | None = None,
    ) -> Any:
        store, ns = self.async_store, self.namespace
        answer: Any = None
        while True:
            try:
                command = protocol.send(answer)
            except StopIteration as stop:
                return stop.value
            if isinstance(command, Now):
                answer = time.monotonic()
            elif isinstance(command, Write):
                assert plan is not None
                answer = await store.write(ns, plan.key, command.change)
            elif isinstance(command, Claim):
                assert plan is not None
                answer = await store.claim(
                    ns,
                    plan.key,
                    fingerprint=plan.fingerprint,
                    tool=plan.policy.tool,
                    effect=plan.policy.effect,
                    owner=plan.owner,
                    lease=plan.policy.lease,
                )
            elif isinstance(command, Run):
                answer = await self._run_async(fn, args, kwargs, options, plan, command)
            elif isinstance(command, Wait):
                assert plan is not None
                answer = await store.wait(ns, plan.key, command.fence, command.timeout)
            elif isinstance(command, Sleep):
                await asyncio.sleep(command.seconds)
                answer = None
            elif isinstance(command, Reconcile):
                assert plan is not None
                assert bound is not None
                assert options.reconcile is not None
                answer = _reconciled(options.reconcile, plan.key, bound.arguments)
                if inspect.isawaitable(answer):
                    try:
                        answer = await answer
                    except Exception:
                        log.warning("twiceshy: reconcile of key %s failed", plan.key, exc_info=True)
                        answer = None
            else:  # pragma: no cover - the protocol yields nothing else
                raise AssertionError(command)

    async def _run_async(
        self,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: ToolOptions,
        plan: CallPlan | None,
        command: Run,
    ) -> Ran:
        if plan is None:
            try:
                return Ran(value=await fn(*args, **kwargs))
            except Exception as exc:
                return Ran(error=exc)
        call_args, call_kwargs = options.binder.call_args(args, kwargs, plan.key)
        job = self._heartbeat.start(
            plan.namespace, plan.key, command.fence, plan.owner, plan.policy.lease
        )
        token = set_key(plan.key)
        try:
            value = await fn(*call_args, **call_kwargs)
        except Exception as exc:
            return Ran(error=exc, renewed_at=job.renewed_at)
        finally:
            reset_key(token)
            self._heartbeat.stop(job)
        return Ran(value=value, renewed_at=job.renewed_at)
