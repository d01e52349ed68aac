"""A store's async twin seen through the blocking :class:`~twiceshy.stores.Store` protocol, so
that the store contract suite (``tests/test_store_contract.py``) runs unchanged on every
:class:`~twiceshy.stores.AsyncStore`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from twiceshy import Change, Record, Snapshot, State
from twiceshy.stores import AsyncStore, Store

T = TypeVar("T")


class AwaitedStore:
    """Awaits each command of an async store on one event loop, from whichever thread calls.

    The loop runs in a thread of its own for the adapter's life, so the suite's callers in
    several threads (a waiter and a writer) share one loop, as async callers would. The commands
    of the AsyncStore protocol (claim, write, get, wait, close) always go to the async store.
    What that protocol does not promise (listing, purging, call counts) goes to the async
    store where it has the method, and otherwise to the blocking store of the same ledger.

    Args:
        twin: the async store under test.
        store: the blocking store it is the twin of (same ledger).
    """

    def __init__(self, twin: AsyncStore, store: Store) -> None:
        self.twin = twin
        self.store = store
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="awaited-store", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _serve(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()

        asyncio.run(main())  # and, like any asyncio.run, it ends what the loop still holds

    def _await(self, command: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None, "the adapter's event loop did not start"
        return asyncio.run_coroutine_threadsafe(command, self._loop).result()

    def _beyond(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.twin, name, None)
        if method is None:
            return getattr(self.store, name)(*args, **kwargs)
        return self._await(method(*args, **kwargs))

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`."""
        return self._await(self.twin.claim(namespace, key, **options))

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`."""
        return self._await(self.twin.write(namespace, key, change))

    def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        return self._await(self.twin.get(namespace, key))

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`."""
        return self._await(self.twin.wait(namespace, key, fence, timeout))

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`."""
        found: list[Record] = self._beyond(
            "records", namespace, states=states, tool=tool, limit=limit
        )
        return found

    def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`."""
        purged: int = self._beyond("purge_expired", namespace)
        return purged

    def expired(self, namespace: str | None = None) -> list[Record]:
        """See :meth:`twiceshy.stores.ExpiredOutcomes.expired`."""
        found: list[Record] = self._beyond("expired", namespace)
        return found

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """See :meth:`twiceshy.stores.CallCounts.add_counts`."""
        self._beyond("add_counts", namespace, counts)

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """See :meth:`twiceshy.stores.CallCounts.counts`."""
        totals: dict[tuple[str, str], int] = self._beyond("counts", namespace)
        return totals

    def close(self) -> None:
        """Close the async store on its loop, then end the loop and its thread."""
        try:
            self._await(self.twin.close())
        finally:
            if self._loop is not None and self._stop is not None:
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
