"""The DynamoDB stores, blocking and async, and :func:`open_dynamodb`: thin loops around the
operations.

Each method of :class:`DynamoDBStore` and :class:`AsyncDynamoDBStore` is an operation of
``_ops.py`` carried out by a loop that sends its requests to DynamoDB — through boto3's client,
or an aiobotocore client of the running event loop — and hands back each answer, or throws in
each error. Nothing else differs between the two.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar

import aiobotocore.config  # type: ignore[import-untyped]
import aiobotocore.session  # type: ignore[import-untyped]
import boto3  # type: ignore[import-untyped]
import botocore.config  # type: ignore[import-untyped]
import botocore.session  # type: ignore[import-untyped]
from botocore.exceptions import BotoCoreError, NoRegionError  # type: ignore[import-untyped]

from ..._forks import reset_in_children
from . import _ops
from ._core import Core, data_loader, split_url
from ._ops import Call, Op, Step

P = ParamSpec("P")
T = TypeVar("T")
_Outcome = tuple[Any, Exception | None]


def _signed(method: Callable[..., Any], op: Callable[..., Any], owner: str, name: str) -> None:
    """Give ``method`` the name, documentation and signature of ``op``, less its core."""
    signature = inspect.signature(op)
    returns = signature.return_annotation
    if isinstance(returns, str):  # the annotations are text: "Op[Snapshot]" answers a Snapshot
        returns = returns.removeprefix("Op[").removesuffix("]")
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[this, *list(signature.parameters.values())[1:]], return_annotation=returns
    )
    method.__name__ = name
    method.__qualname__ = f"{owner}.{name}"
    method.__doc__ = op.__doc__


@dataclass(slots=True)
class _Done(Generic[T]):
    """An operation's result: it has no step left."""

    value: T


def _resume(op: Op[T], outcome: _Outcome | None) -> Step | _Done[T]:
    """``op``'s next step, given the last step's answer or error (``None`` to start it)."""
    try:
        if outcome is None:
            return next(op)
        answer, error = outcome
        return op.send(answer) if error is None else op.throw(error)
    except StopIteration as done:
        return _Done(done.value)


def _no_region(core: Core, exc: Exception) -> ValueError:
    return ValueError(
        f"DynamoDB ledger {core.errors.where}: no AWS region ({exc}); add region= to the "
        "ledger URL, or set AWS_REGION"
    )


# -- the blocking loop ----------------------------------------------------------------------------


def _blocking_step(client: Any, step: Step) -> _Outcome:
    try:
        if isinstance(step, Call):
            return getattr(client, step.method)(**step.params), None
        time.sleep(step.seconds)
        return None, None
    except Exception as exc:
        return None, exc


def _run(client: Any, op: Op[T]) -> T:
    """Carry ``op``'s requests to DynamoDB and their answers back, blocking; its result."""
    step = _resume(op, None)
    while not isinstance(step, _Done):
        step = _resume(op, _blocking_step(client, step))
    return step.value


def _blocking(
    op: Callable[Concatenate[Core, P], Op[T]], name: str
) -> Callable[Concatenate[DynamoDBStore, P], T]:
    """The method of :class:`DynamoDBStore` that is ``op``, run by the blocking loop."""

    def method(self: DynamoDBStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return _run(self._live_client(), op(self._core, *args, **kwargs))

    _signed(method, op, "DynamoDBStore", name)
    return method


# -- the async loop -------------------------------------------------------------------------------


async def _async_step(client: Any, step: Step) -> _Outcome:
    try:
        if isinstance(step, Call):
            return await getattr(client, step.method)(**step.params), None
        await asyncio.sleep(step.seconds)
        return None, None
    except Exception as exc:
        return None, exc


async def _arun(client: Any, op: Op[T]) -> T:
    """Carry ``op``'s requests to DynamoDB and their answers back, on the running event loop."""
    step = _resume(op, None)
    while not isinstance(step, _Done):
        step = _resume(op, await _async_step(client, step))
    return step.value


def _awaiting(
    op: Callable[Concatenate[Core, P], Op[T]], name: str
) -> Callable[Concatenate[AsyncDynamoDBStore, P], Coroutine[Any, Any, T]]:
    """The method of :class:`AsyncDynamoDBStore` that is ``op``, run on the caller's loop."""

    async def method(self: AsyncDynamoDBStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        client = await self._loop_client()
        return await _arun(client, op(self._core, *args, **kwargs))

    _signed(method, op, "AsyncDynamoDBStore", name)
    return method


# -- the stores -----------------------------------------------------------------------------------


class _Opening:
    """How both stores are configured: the settings, checked once, in a :class:`Core`."""

    _core: Core

    def __init__(
        self,
        table: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        prefix: str = "twiceshy",
        profile: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 10.0,
        max_attempts: int = 3,
        poll_interval: float = 0.25,
        create_timeout: float = 120.0,
        clock: Callable[[], float] | None = None,
        create: bool = True,
    ) -> None:
        core = Core(
            table,
            region=region,
            endpoint_url=endpoint_url,
            prefix=prefix,
            profile=profile,
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
            poll_interval=poll_interval,
            create_timeout=create_timeout,
            clock=clock,
        )
        self._open(core, create=create)

    def _open(self, core: Core, *, create: bool) -> None:
        raise NotImplementedError

    @classmethod
    def from_url(
        cls, url: str, *, clock: Callable[[], float] | None = None, create: bool = True
    ) -> Self:
        """Open the store a ``dynamodb://TABLE?region=...`` URL names.

        The query may carry every keyword argument of the constructor but ``clock`` and
        ``create`` (see :class:`DynamoDBStore`).

        Raises:
            ValueError: the URL names no table, or an option is unknown or malformed.
            StoreUnavailable: the endpoint cannot be reached.
            LedgerNotFound: with ``create=False``, there is no ledger in the table.
        """
        return cls(**split_url(url), clock=clock, create=create)

    @property
    def table(self) -> str:
        """The table's name."""
        return self._core.table

    @property
    def prefix(self) -> str:
        """The first part of every partition key of this store's items."""
        return self._core.prefix

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._core.describe()})"


class DynamoDBStore(_Opening):
    """A :class:`~twiceshy.stores.Store` in a DynamoDB table (boto3, blocking).

    Thread-safe: one store serves every thread of a process (boto3's client keeps a pool of
    connections). Opening it reads the table's schema item, and creates the table (on-demand
    capacity, TTL on ``ttl``) where there is none.

    Args:
        table: the table's name.
        region: the AWS region; by default the SDK's (``AWS_REGION``, the profile's).
        endpoint_url: another endpoint than AWS's (a DynamoDB-protocol server, a VPC
            endpoint): ``http://127.0.0.1:4567``.
        prefix: the first part of every partition key, so that several ledgers can share a
            table; it must not contain ``#``.
        profile: the AWS profile whose credentials and region to use.
        aws_access_key_id: credentials, for servers that are not AWS; otherwise leave them to
            the SDK's chain (environment, profile, the machine's role).
        aws_secret_access_key: see ``aws_access_key_id``.
        aws_session_token: see ``aws_access_key_id``.
        connect_timeout: seconds to connect.
        read_timeout: seconds to wait for any answer.
        max_attempts: attempts of each request, the SDK's retries included (``standard``
            mode: throttling and lost connections are retried with backoff).
        poll_interval: the longest pause between a waiter's reads.
        create_timeout: how long to wait for a new table to become ACTIVE.
        clock: the store's clock (seconds since the epoch); by default this machine's.
        create: create the table and its schema item where there are none; ``False`` to open
            only a ledger that exists.

    Raises:
        ValueError: a setting is malformed, or no region is known.
        StoreUnavailable: the endpoint cannot be reached.
        LedgerNotFound: with ``create=False``, there is no ledger in the table.
        StoreError: the table is not a twiceshy ledger this version reads, or DynamoDB refuses.
    """

    def _open(self, core: Core, *, create: bool) -> None:
        self._core = core
        self._abandoned: list[Any] = []
        self._pid = os.getpid()
        self._client = self._new_client()
        try:
            _run(self._client, _ops.open_ledger(core, create=create))
        except BaseException:
            self._client.close()
            raise

    def _new_client(self) -> Any:
        core = self._core
        base = botocore.session.Session()
        base.register_component("data_loader", data_loader())
        try:
            session = boto3.session.Session(botocore_session=base, profile_name=core.profile)
            return session.client(
                "dynamodb",
                config=botocore.config.Config(**core.config_options()),
                **core.client_options(),
            )
        except NoRegionError as exc:
            raise _no_region(core, exc) from None
        except BotoCoreError as exc:  # a profile not found, a malformed setting
            raise ValueError(f"DynamoDB ledger {core.errors.where}: {exc}") from None

    def _live_client(self) -> Any:
        if os.getpid() != self._pid:
            with self._core.lock:
                if os.getpid() != self._pid:
                    # A forked child never uses (nor closes) its parent's connections.
                    self._abandoned.append(self._client)
                    self._client = self._new_client()
                    self._pid = os.getpid()
        return self._client

    claim = _blocking(_ops.claim, "claim")
    write = _blocking(_ops.write, "write")
    get = _blocking(_ops.get, "get")
    wait = _blocking(_ops.wait, "wait")
    records = _blocking(_ops.records, "records")
    purge_expired = _blocking(_ops.purge_expired, "purge_expired")
    expired = _blocking(_ops.expired, "expired")
    add_counts = _blocking(_ops.add_counts, "add_counts")
    counts = _blocking(_ops.read_counts, "counts")

    def close(self) -> None:
        """Close the client's connections (idempotent).

        An :class:`AsyncDynamoDBStore` opened with it by :func:`open_dynamodb` refuses calls
        from then on too.
        """
        self._core.closed = True
        if os.getpid() == self._pid:
            self._client.close()


class _LoopClient:
    """The aiobotocore client of one event loop, closed when that loop shuts down."""

    __slots__ = ("client", "guard")

    def __init__(self, client: Any) -> None:
        self.client = client
        self.guard: AsyncGenerator[None, None] | None = None


async def _close_with_loop(client: Any) -> AsyncGenerator[None, None]:
    """An async generator whose end closes ``client``.

    Event loops close the async generators started on them when they shut down
    (``asyncio.run`` does), so a client left open by its user is closed on its own loop, where
    its connections live, instead of leaking them when the loop goes away.
    """
    try:
        yield
    finally:
        await client.close()


class AsyncDynamoDBStore(_Opening):
    """An :class:`~twiceshy.stores.AsyncStore` in a DynamoDB table (aiobotocore).

    The arguments are those of :class:`DynamoDBStore`. Nothing is sent in the constructor:
    each event loop gets its own client on first use, closed when that loop shuts down
    (``asyncio.run`` does this) or by :meth:`close`; the first call reads the table's schema
    item (creating the table where there is none, unless ``create=False``).

    Raises:
        ValueError: a setting is malformed, or no region is known.
    """

    def _open(self, core: Core, *, create: bool, owns_core: bool = True) -> None:
        self._core = core
        self._create = create
        self._owns_core = owns_core
        self._clients: dict[asyncio.AbstractEventLoop, _LoopClient] = {}
        self._lock = threading.Lock()
        self._inherited: list[_LoopClient] = []
        self._session = self._new_session()
        if core.region is None and self._session.get_config_variable("region") is None:
            raise _no_region(core, NoRegionError())
        reset_in_children(self)

    def _new_session(self) -> Any:
        session = aiobotocore.session.AioSession(profile=self._core.profile)
        session.register_component("data_loader", data_loader())
        return session

    def _after_fork_in_child(self) -> None:
        """In a forked child: a lock no parent thread holds, and none of the parent's clients
        (kept, unused and never closed: closing them could end the parent's sessions)."""
        self._lock = threading.Lock()
        self._inherited += self._clients.values()
        self._clients = {}

    @classmethod
    def twin(cls, store: DynamoDBStore) -> AsyncDynamoDBStore:
        """An async store of ``store``'s ledger and settings; closed with it."""
        twin = cls.__new__(cls)
        twin._open(store._core, create=False, owns_core=False)
        return twin

    async def _loop_client(self) -> Any:
        core = self._core
        core.check_open()
        loop = asyncio.get_running_loop()
        entry = self._clients.get(loop)
        if entry is None:
            context = self._session.create_client(
                "dynamodb",
                config=aiobotocore.config.AioConfig(**core.config_options()),
                **core.client_options(),
            )
            try:
                client = await context.__aenter__()
            except NoRegionError as exc:
                raise _no_region(core, exc) from None
            with self._lock:
                for gone in [other for other in self._clients if other.is_closed()]:
                    del self._clients[gone]
                entry = self._clients.setdefault(loop, _LoopClient(client))
            if entry.client is not client:  # another task of this loop made one meanwhile
                await client.close()
            else:
                guard = _close_with_loop(client)
                await anext(guard)  # runs to its yield without suspending
                entry.guard = guard
        if not core.schema_ready:
            await _arun(entry.client, _ops.open_ledger(core, create=self._create))
        return entry.client

    # The AsyncStore protocol; listing, purging and counts are the blocking store's (an
    # operator's tools, and the ledger's count flushes, run in threads).
    claim = _awaiting(_ops.claim, "claim")
    write = _awaiting(_ops.write, "write")
    get = _awaiting(_ops.get, "get")
    wait = _awaiting(_ops.wait, "wait")

    async def close(self) -> None:
        """Close this loop's client; a store opened on its own refuses calls from then on.

        Clients of other event loops close when their loops shut down.
        """
        with self._lock:
            entry = self._clients.pop(asyncio.get_running_loop(), None)
        if entry is not None and entry.guard is not None:
            await entry.guard.aclose()
        if self._owns_core:
            self._core.closed = True


def open_dynamodb(url: str, *, create: bool = True) -> tuple[DynamoDBStore, AsyncDynamoDBStore]:
    """Open the blocking and async stores a ``dynamodb://TABLE?region=...`` URL names.

    Closing the blocking store closes the pair.

    Raises:
        ValueError: the URL names no table, or an option is unknown or malformed.
        StoreUnavailable: the endpoint cannot be reached.
        LedgerNotFound: with ``create=False``, there is no ledger in the table.
    """
    store = DynamoDBStore.from_url(url, create=create)
    return store, AsyncDynamoDBStore.twin(store)
