"""Where keys are claimed and outcomes kept.

A store is anything that implements :class:`Store` (blocking) and, for async tools,
:class:`AsyncStore`; nobody must inherit from a class of ours. Every store passes one contract
test suite (``tests/test_store_contract.py``). Stores are chosen by URL with :func:`open_store`.

The contract, in short:

- :meth:`Store.claim` is one atomic conditional write: it inserts a CLAIMED record when the key
  has no live record — fence 1 for a new key, the old fence + 1 over an expired outcome — and
  otherwise changes nothing and answers the record as it is. Claiming again with the same owner
  token answers ``won=True`` for the record that token already owns (a retry after a lost
  connection recognises its own claim).
- :meth:`Store.write` applies a :class:`~twiceshy.Change` only when its guards hold.
- Lease deadlines and expiry are measured on the store's clock, reported in every
  :class:`~twiceshy.Snapshot`.
- Errors reaching the store raise :class:`~twiceshy.StoreError` (``StoreUnavailable`` when it
  cannot be reached), chained from the driver's own error; a store never answers "no record" for a
  record it could not read.

Opened with ``create=False`` (:func:`open_store`, ``SQLiteStore``, ``PostgresStore``,
``DynamoDBStore``), a store never creates a ledger: where the location holds none (no file, a
file or schema without twiceshy's tables, no DynamoDB table or one without its schema item) it
raises :class:`LedgerNotFound` before writing anything. A ledger that is
there opens exactly as with ``create=True``, brought up to date as every open does (PostgreSQL's
version 1 migrated to 2, a missing call counts table added). Redis creates nothing on open, and
a ``memory://`` ledger is always new.

A store may also keep call counts (:class:`CallCounts`): how many calls of each tool were
answered which way, summed over every process that shares the ledger. Every store of twiceshy's
does; a ledger whose store does not simply keeps its counts to itself.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from .._records import Change, Effect, Record, Snapshot, State
from .._redaction import redacted
from ..errors import LedgerNotFound

__all__ = [
    "AsyncStore",
    "CallCounts",
    "ExpiredOutcomes",
    "LedgerNotFound",
    "Store",
    "ThreadedAsyncStore",
    "open_store",
]


@runtime_checkable
class Store(Protocol):
    """A ledger store, blocking."""

    def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
        args: str | None = None,
    ) -> Snapshot:
        """Insert a CLAIMED record (fence 1) unless the key has a live one; answer the record.

        ``args`` (the call's arguments as canonical JSON text, or ``None``) is kept in the new
        record as it is; a claim that does not win changes nothing, its ``args`` included.
        """
        ...

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """Apply ``change`` if its guards hold; answer the record as it now is.

        A write that applied answers the record it wrote, even one already past its retention
        (``ttl=0``); one that did not answers the live record, or ``None``.
        """
        ...

    def get(self, namespace: str, key: str) -> Snapshot:
        """Answer the key's live record, or ``None``."""
        ...

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """Block until the record is no longer CLAIMED under ``fence``, or ``timeout`` passes."""
        ...

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """List live records of a namespace, newest first."""
        ...

    def purge_expired(self, namespace: str | None = None) -> int:
        """Delete outcomes past their retention (never CLAIMED or UNKNOWN); answer how many."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


@runtime_checkable
class CallCounts(Protocol):
    """The optional part of a store that sums call counts across processes.

    A count is keyed by ``(tool, outcome)``, the outcome being a :class:`~twiceshy.Outcome`'s
    value (``"executed"``, ``"replayed"``, ``"joined"``, ...). Counts only ever grow.
    """

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add ``counts`` to the namespace's totals, all of them or none."""
        ...

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """The namespace's totals by ``(tool, outcome)``."""
        ...


@runtime_checkable
class ExpiredOutcomes(Protocol):
    """The optional part of a store that shows what :meth:`Store.purge_expired` would remove.

    Every store of twiceshy's has it (``twiceshy gc --dry-run`` uses it); a store without it
    only says what gc keeps.
    """

    def expired(self, namespace: str | None = None) -> list[Record]:
        """The outcomes past their retention, of one namespace or of all, removing nothing.

        They are what a purge now would delete: SUCCEEDED, FAILED or RELEASED records whose
        expiry has passed on the store's clock, never a CLAIMED or UNKNOWN one.
        """
        ...


@runtime_checkable
class AsyncStore(Protocol):
    """A ledger store for async callers; the same contract as :class:`Store`."""

    async def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
        args: str | None = None,
    ) -> Snapshot:
        """See :meth:`Store.claim`."""
        ...

    async def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`Store.write`."""
        ...

    async def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`Store.get`."""
        ...

    async def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`Store.wait`."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class ThreadedAsyncStore:
    """An :class:`AsyncStore` over a blocking :class:`Store`.

    Each call runs in a worker thread, so a store that blocks (a busy SQLite file) never stalls
    the event loop. Waiting polls with backoff and holds no thread while it sleeps.

    Args:
        store: the blocking store.
        threaded: run calls in worker threads; ``False`` for stores that never block (memory).
    """

    def __init__(self, store: Store, *, threaded: bool = True) -> None:
        self.store = store
        self._threaded = threaded

    async def _call(self, fn: object, *args: object, **kwargs: object) -> Snapshot:
        assert callable(fn)
        if self._threaded:
            result = await asyncio.to_thread(fn, *args, **kwargs)
        else:
            result = fn(*args, **kwargs)
        assert isinstance(result, Snapshot)
        return result

    async def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
        args: str | None = None,
    ) -> Snapshot:
        """See :meth:`Store.claim`."""
        return await self._call(
            self.store.claim,
            namespace,
            key,
            fingerprint=fingerprint,
            tool=tool,
            effect=effect,
            owner=owner,
            lease=lease,
            args=args,
        )

    async def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`Store.write`."""
        return await self._call(self.store.write, namespace, key, change)

    async def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`Store.get`."""
        return await self._call(self.store.get, namespace, key)

    async def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """Poll with backoff (1 ms doubling to 25 ms) until the record settles or time is up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        delay = 0.001
        while True:
            snap = await self.get(namespace, key)
            rec = snap.record
            if rec is None or rec.state is not State.CLAIMED or rec.fence != fence:
                return snap
            left = deadline - loop.time()
            if left <= 0:
                return snap
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.025)

    async def close(self) -> None:
        """Close the blocking store."""
        self.store.close()


def open_store(url: str, *, create: bool = True) -> tuple[Store, AsyncStore]:
    """Open the store a URL names.

    ``memory://``, ``sqlite:///path/ledger.db``, ``postgresql://user@host/db`` (the
    ``postgres`` extra), ``redis://host:6379/0`` and ``redis+cluster://host:port,host:port``
    (the ``redis`` extra), ``dynamodb://TABLE?region=...`` (the ``dynamodb`` extra).

    Args:
        url: the ledger URL.
        create: make the ledger (the SQLite file, the PostgreSQL schema and tables, the
            DynamoDB table) where there is none; ``False`` to open only a ledger that exists
            (for tools that inspect one, such as the command line). Redis and memory create
            nothing on open.

    Returns:
        The blocking store and its async twin.

    Raises:
        ValueError: the URL names no store twiceshy knows.
        ImportError: the store's extra is not installed.
        StoreUnavailable: the store cannot be reached.
        LedgerNotFound: with ``create=False``, there is no ledger at the URL.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        from .memory import MemoryStore

        memory = MemoryStore()
        return memory, ThreadedAsyncStore(memory, threaded=False)
    if scheme == "sqlite":
        from .sqlite import SQLiteStore

        sqlite = SQLiteStore.from_url(url, create=create)
        return sqlite, ThreadedAsyncStore(sqlite)
    if scheme in ("postgresql", "postgres"):
        try:
            from .postgres import open_postgres
        except ImportError as exc:
            raise _missing_extra("postgres", exc) from exc
        return open_postgres(url, create=create)
    if scheme in ("redis", "rediss", "unix"):
        try:
            from .redis import open_redis
        except ImportError as exc:
            raise _missing_extra("redis", exc) from exc
        return open_redis(url)
    if scheme == "redis+cluster":
        try:
            from .redis import open_redis_cluster
        except ImportError as exc:
            raise _missing_extra("redis", exc) from exc
        return open_redis_cluster(url)
    if scheme == "dynamodb":
        try:
            from .dynamodb import open_dynamodb
        except ImportError as exc:
            raise _missing_extra("dynamodb", exc) from exc
        return open_dynamodb(url, create=create)
    known = (
        "memory://, sqlite:///path, postgresql://..., redis://..., redis+cluster://..., "
        "dynamodb://TABLE?region=..."
    )
    raise ValueError(f"unknown ledger URL {redacted_url(url)!r}: expected one of {known}")


def _missing_extra(extra: str, exc: ImportError) -> ImportError:
    return ImportError(
        f"the {extra} ledger needs its client library: pip install 'twiceshy[{extra}]' ({exc})"
    )


def redacted_url(url: str) -> str:
    """``url`` without secrets, for reprs, logs and errors: the password of its user part and the
    values of settings named like secrets (``password=``, ``ssl_password=``, ``token=``...) become
    ``***``, even in a URL that does not parse (a bad port)."""
    return redacted(url)


def default_url() -> str:
    """The ledger URL used when none is given: ``TWICESHY_LEDGER``, else the embedded file."""
    env = os.environ.get("TWICESHY_LEDGER")
    if env:
        return env
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return "sqlite:///" + os.path.join(state_home, "twiceshy", "ledger.db")
