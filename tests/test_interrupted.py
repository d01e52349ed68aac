"""A call interrupted while its tool runs (a cancelled task, Ctrl-C) records that its outcome is
unknown before the interruption goes on, so the next call gets an honest answer at once instead
of waiting for a lease that nobody renews any more. Interrupted around a store command (Ctrl-C
right after a claim commits, a task cancelled twice, at any moment), a call gives its claim back
or records the doubt: it never leaves a claim that nobody renews."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import twiceshy
from twiceshy import Change, Snapshot, State
from twiceshy.stores import Store, ThreadedAsyncStore
from twiceshy.stores.memory import MemoryStore


def only_record(store: Store) -> twiceshy.Record:
    (record,) = store.records("")
    return record


def test_a_cancelled_keyed_call_runs_again_at_once_with_the_same_key(store: Store) -> None:
    """Every store (on a clock that never lets the lease lapse by itself)."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    keys: list[str] = []
    hang = [True]

    @ledger.tool(effect=twiceshy.KEYED, wait=5)
    async def charge(amount: int) -> dict[str, int]:
        keys.append(twiceshy.current_key())
        if hang[0]:
            await asyncio.sleep(30)  # the provider does not answer in time
        return {"amount": amount}

    async def main() -> dict[str, int]:
        with twiceshy.run("run-1"):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(charge(4900), 0.2)  # the framework's tool timeout
            record = only_record(store)
            assert record.state is State.UNKNOWN
            assert "CancelledError" in (record.reason or "")
            hang[0] = False
            started = time.monotonic()
            answer = await charge(4900)  # the model calls again
            assert time.monotonic() - started < 2  # not after waiting out the lease
            return answer

    assert asyncio.run(main()) == {"amount": 4900}
    assert len(keys) == 2
    assert keys[0] == keys[1]  # the provider deduplicates the second attempt
    assert only_record(store).state is State.SUCCEEDED


def test_a_cancelled_unsafe_call_answers_outcome_unknown_at_once(store: Store) -> None:
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, wait=5)
    async def send_mail(to: str) -> str:
        runs.append(1)
        await asyncio.sleep(30)
        return "sent"

    async def main() -> None:
        with twiceshy.run("run-1"):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(send_mail("ada@example.com"), 0.2)
            started = time.monotonic()
            with pytest.raises(twiceshy.OutcomeUnknown, match="interrupted"):
                await send_mail("ada@example.com")
            assert time.monotonic() - started < 2

    asyncio.run(main())
    assert runs == [1]  # never run again by itself


def test_ctrl_c_in_a_blocking_tool_records_the_doubt_and_goes_on(store: Store) -> None:
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        assert twiceshy.current_key()  # handed to the provider, which deduplicates by it
        if len(runs) == 1:
            raise KeyboardInterrupt
        return {"amount": amount}

    with twiceshy.run("run-1"):
        with pytest.raises(KeyboardInterrupt):
            charge(4900)
        record = only_record(store)
        assert record.state is State.UNKNOWN
        assert "KeyboardInterrupt" in (record.reason or "")
        assert charge(4900) == {"amount": 4900}
    assert runs == [4900, 4900]


def test_a_call_cancelled_while_waiting_for_another_changes_nothing(store: Store) -> None:
    """Only the owner's interruption says anything about the work; a waiter's says nothing."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    release = [False]

    @ledger.tool(effect=twiceshy.KEYED, wait=5)
    async def charge(amount: int) -> dict[str, int]:
        while not release[0]:
            await asyncio.sleep(0.01)
        return {"amount": amount}

    other = twiceshy.Ledger(store=store, counts_interval=None)  # another process, in effect

    @other.tool(effect=twiceshy.KEYED, wait=5, name="charge")
    async def charge_elsewhere(amount: int) -> dict[str, int]:
        raise AssertionError("the intent is running elsewhere; this never runs")

    async def main() -> Any:
        with twiceshy.run("run-1"):
            owner = asyncio.create_task(charge(4900))
            await asyncio.sleep(0.1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(charge_elsewhere(4900), 0.2)
            assert only_record(store).state is State.CLAIMED
            release[0] = True
            return await owner

    assert asyncio.run(main()) == {"amount": 4900}
    assert only_record(store).state is State.SUCCEEDED


class WritesFail:
    """A store whose guarded writes fail: the ledger cannot record anything after the claim."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def write(self, *args: Any, **kwargs: Any) -> Any:
        raise twiceshy.StoreUnavailable("the ledger went away")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_interruption_goes_on_when_the_doubt_cannot_be_recorded() -> None:
    """A failed write never turns a Ctrl-C or a cancellation into a store error."""
    from twiceshy.stores.memory import MemoryStore

    ledger = twiceshy.Ledger(store=WritesFail(MemoryStore()), counts_interval=None)  # type: ignore[arg-type]

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_mail(to: str) -> str:
        raise KeyboardInterrupt

    @ledger.tool(effect=twiceshy.UNSAFE)
    async def post(text: str) -> str:
        await asyncio.sleep(30)
        return "posted"

    with twiceshy.run("run-1"):
        with pytest.raises(KeyboardInterrupt) as interrupted:
            send_mail("ada@example.com")
        assert isinstance(interrupted.value.__cause__, twiceshy.OutcomeNotRecorded)

        async def main() -> None:
            task = asyncio.create_task(post("hello"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError) as cancelled:
                await task
            assert isinstance(cancelled.value.__cause__, twiceshy.OutcomeNotRecorded)

        asyncio.run(main())


@pytest.mark.parametrize(
    ("effect", "answer"),
    [(twiceshy.KEYED, {"amount": 4900, "run": 2}), (twiceshy.UNSAFE, twiceshy.OutcomeUnknown)],
)
def test_callers_joined_to_an_interrupted_call_ask_the_ledger(
    store: Store, effect: twiceshy.Effect, answer: Any
) -> None:
    """The joined duplicate is not interrupted, nor told "still running": it gets the truth."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []
    keys: list[str] = []

    @ledger.tool(effect=effect, wait=5)
    async def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        keys.append(twiceshy.current_key())
        if len(runs) == 1:
            await asyncio.sleep(30)
        return {"amount": amount, "run": len(runs)}

    async def main() -> Any:
        with twiceshy.run("run-1"):
            leader = asyncio.create_task(charge(4900))
            await asyncio.sleep(0.05)
            joined = asyncio.create_task(charge(4900))
            await asyncio.sleep(0.05)
            leader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leader
            try:
                return await asyncio.wait_for(joined, 3)
            except twiceshy.OutcomeUnknown as exc:
                return exc

    got = asyncio.run(main())
    if isinstance(answer, type):
        assert isinstance(got, answer)
        assert runs == [4900]
    else:
        assert got == answer
        assert len(set(keys)) == 1  # the joined caller ran it again with the same key


def test_a_call_cancelled_between_attempts_records_the_doubt(store: Store) -> None:
    """Cancelled in the back-off after an ambiguous attempt: unknown, so the next call runs it
    again with the key at once instead of waiting out a lease nobody renews."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    keys: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, wait=5, backoff=lambda attempt: 30.0)
    async def charge(amount: int) -> dict[str, int]:
        keys.append(twiceshy.current_key())
        if len(keys) == 1:
            raise ConnectionError("the provider reset the connection")
        return {"amount": amount}

    async def main() -> dict[str, int]:
        with twiceshy.run("run-1"):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(charge(4900), 0.3)  # cut off during the back-off
            record = only_record(store)
            assert record.state is State.UNKNOWN
            assert "ConnectionError" in (record.reason or "")
            started = time.monotonic()
            answer = await charge(4900)
            assert time.monotonic() - started < 2
            return answer

    assert asyncio.run(main()) == {"amount": 4900}
    assert len(keys) == 2
    assert keys[0] == keys[1]


def test_a_call_cancelled_while_its_claim_is_under_way_gives_the_claim_back(
    tmp_path: Path,
) -> None:
    """The claim goes on in the store's thread and wins after the caller was cancelled: it is
    released, so the UNSAFE tool that never ran is not answered OutcomeUnknown for good."""
    path = tmp_path / "ledger.db"
    ledger = twiceshy.Ledger(f"sqlite:///{path}?busy_timeout=5", counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, lease=0.5, wait=0.2)
    async def charge(amount: int) -> str:
        runs.append(amount)
        return "charged"

    async def main() -> str:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # the claim waits for the writer's lock
        with twiceshy.run("run-1"):
            first = asyncio.create_task(charge(4900))
            await asyncio.sleep(0.3)
            first.cancel()
            await asyncio.sleep(0.1)
            blocker.execute("ROLLBACK")  # now the claim can win
            blocker.close()
            with pytest.raises(asyncio.CancelledError):
                await first
            (record,) = ledger.store.records("", states=list(State))
            assert record.state is State.RELEASED
            await asyncio.sleep(0.6)  # past the lease: no doubt may come of it
            return await charge(4900)

    assert asyncio.run(main()) == "charged"
    assert runs == [4900]
    ledger.close()


# -- interrupted around a store command -------------------------------------------------------


def states(store: Any) -> list[State]:
    return [record.state for record in store.records("", states=list(State))]


class InterruptedAfterOp(MemoryStore):
    """Ctrl-C lands right after the ``n``-th claim or write of the caller's thread committed."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def _tick(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.n -= 1
            if self.n == 0:
                raise KeyboardInterrupt

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        self._tick()
        return snap

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        snap = super().write(namespace, key, change)
        self._tick()
        return snap


@pytest.mark.parametrize(
    ("effect", "n", "after"),
    [
        (twiceshy.UNSAFE, 1, State.RELEASED),  # right after the claim: the tool never ran
        (twiceshy.KEYED, 2, State.UNKNOWN),  # right after an in-place retry's renewal
    ],
)
def test_ctrl_c_right_after_a_blocking_store_write_leaves_no_claim_unrenewed(
    effect: twiceshy.Effect, n: int, after: State
) -> None:
    """Ctrl-C in a store command of a blocking call is given back, as a cancellation is."""
    store = InterruptedAfterOp(n)
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=effect, wait=0.05, backoff=lambda attempt: 0.0)
    def charge(amount: int) -> str:
        runs.append(amount)
        assert twiceshy.current_key()  # handed to the provider, which deduplicates by it
        if effect is twiceshy.KEYED and len(runs) == 1:
            raise TimeoutError("read timed out")
        return "charged"

    with twiceshy.run("run-1"):
        with pytest.raises(KeyboardInterrupt):
            charge(5)
        assert states(store) == [after]
        assert charge(5) == "charged"  # at once, not InProgress until the lease lapses


class SlowClaim(MemoryStore):
    """Every claim commits, and answers 0.3 s later (a slow round trip)."""

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        time.sleep(0.3)
        return snap


def test_a_claim_cancelled_twice_is_given_back() -> None:
    """A second cancellation while a cancelled claim finishes must not leave it CLAIMED."""
    store = SlowClaim()
    ledger = twiceshy.Ledger(
        store=store, async_store=ThreadedAsyncStore(store), counts_interval=None
    )
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, wait=0.05)
    async def send(to: str) -> str:
        runs.append(1)
        return "sent"

    async def main() -> str:
        with twiceshy.run("run-1"):
            task = asyncio.create_task(send("ada"))
            await asyncio.sleep(0.1)
            task.cancel()  # the framework's timeout
            await asyncio.sleep(0.05)
            task.cancel()  # the task group around it, shutting down
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.4)  # the claim has committed in the store's thread
            assert states(store) == [State.RELEASED]
            return await send("ada")

    assert asyncio.run(main()) == "sent"
    assert runs == [1]


def test_ctrl_c_as_the_work_is_about_to_start_leaves_no_heartbeat_renewing_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C between the heartbeat's start and the work: nobody renews the lease forever."""
    import twiceshy._drivers as ledger_module

    store = MemoryStore()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE, lease=0.3, wait=0.05)
    def send(to: str) -> str:
        return "sent"

    real = ledger_module.set_call

    def interrupted(call: Any) -> Any:
        monkeypatch.setattr(ledger_module, "set_call", real)
        raise KeyboardInterrupt  # where a signal may land: the lease is renewed from here on

    monkeypatch.setattr(ledger_module, "set_call", interrupted)
    with twiceshy.run("run-1"):
        with pytest.raises(KeyboardInterrupt):
            send("ada")
        assert states(store) == [State.RELEASED]  # the work never started: given back
        time.sleep(1.0)  # three leases
        assert send("ada") == "sent"  # not InProgress for the process's life


class SlowOps(MemoryStore):
    """Every claim and write commits, then answers 20 ms later."""

    def claim(self, namespace: str, key: str, **options: Any) -> Snapshot:
        snap = super().claim(namespace, key, **options)
        time.sleep(0.02)
        return snap

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        snap = super().write(namespace, key, change)
        time.sleep(0.02)
        return snap


def _cancelled_once(effect: twiceshy.Effect, delay: float) -> tuple[list[State], int]:
    """One call cancelled after ``delay``: the states left, and how often the tool ran."""
    store = SlowOps()
    ledger = twiceshy.Ledger(
        store=store, async_store=ThreadedAsyncStore(store), counts_interval=None
    )
    runs: list[int] = []
    attempts = 1 if effect is twiceshy.UNSAFE else 3

    @ledger.tool(effect=effect, attempts=attempts, backoff=lambda n: 0.01, wait=0.05)
    async def tool(x: int) -> str:
        runs.append(x)
        assert twiceshy.current_key()  # handed to the provider, which deduplicates by it
        await asyncio.sleep(0.01)
        if effect is twiceshy.KEYED and len(runs) < 3:
            raise TimeoutError("read timed out")
        return "done"

    async def main() -> list[State]:
        with twiceshy.run("run-1"):
            task = asyncio.create_task(tool(1))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await task
            await asyncio.sleep(0.05)
            found = states(store)
            if effect is twiceshy.UNSAFE:
                with contextlib.suppress(twiceshy.OutcomeUnknown):
                    await tool(1)
            return found

    return asyncio.run(main()), len(runs)


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_one_cancellation_at_any_moment_leaves_no_claim_unrenewed(effect: twiceshy.Effect) -> None:
    """Cancelled at 3 ms steps through claims, runs, backoffs and writes: never left CLAIMED,
    and an UNSAFE tool never runs a second time."""
    for step in range(30):
        found, runs = _cancelled_once(effect, step * 0.003)
        assert State.CLAIMED not in found, (step, found)
        if effect is twiceshy.UNSAFE:
            assert runs <= 1, step
