"""Edge states of the ledger's own machinery: the heartbeat, the in-process join, waits, scopes
and tools that are not what they seem."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from typing import Any

import pytest

import twiceshy
from twiceshy import Change, Snapshot, State
from twiceshy.stores.memory import MemoryStore


class FirstRenewalFails(MemoryStore):
    """A store whose first lease renewal raises what no store error is (a custom store's bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals = 0

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        renewal = change.to is State.CLAIMED and change.lease is not None
        if renewal and change.new_owner is None and not change.count_attempt:
            self.renewals += 1
            if self.renewals == 1:
                raise ConnectionError("a network blip the store did not expect")
        return super().write(namespace, key, change)


def test_a_renewal_that_raises_anything_leaves_the_heartbeat_renewing() -> None:
    """The owner's lease is renewed at the next beat: nobody takes over a running call."""
    store = FirstRenewalFails()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    other = twiceshy.Ledger(store=store, counts_interval=None)  # another process, in effect
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, lease=0.3, name="job")
    def job(x: int) -> int:
        runs.append("owner")
        time.sleep(1.2)
        return x

    @other.tool(effect=twiceshy.KEYED, lease=0.3, wait=0.1, name="job")
    def job_elsewhere(x: int) -> int:
        runs.append("other")
        return x

    def owner() -> None:
        with twiceshy.run("run-1"):
            job(1)

    thread = threading.Thread(target=owner)
    thread.start()
    time.sleep(0.7)  # past the lease, had the failed renewal been the last one
    with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress):
        job_elsewhere(1)
    thread.join(10)
    assert runs == ["owner"]
    assert store.renewals >= 2


def test_a_joined_caller_whose_loop_is_gone_does_not_fail_the_leader() -> None:
    """An async duplicate gave up (InProgress) and its event loop closed: the leader's own call
    still answers its result."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    answers: dict[str, Any] = {}

    @ledger.tool(effect=twiceshy.KEYED, wait=0.2)
    def pay(x: int) -> str:
        time.sleep(0.8)
        return "paid"

    def leader() -> None:
        with twiceshy.run("run-1"):
            try:
                answers["leader"] = pay(1)
            except BaseException as exc:  # what the leader's caller would get
                answers["leader"] = exc

    thread = threading.Thread(target=leader)
    thread.start()
    time.sleep(0.2)

    async def joined() -> Any:
        with twiceshy.run("run-1"):
            return await pay.twiceshy.acall({"x": 1}, lambda: asyncio.sleep(0))  # type: ignore[attr-defined]

    with pytest.raises(twiceshy.InProgress):
        asyncio.run(joined())  # the loop is closed once this returns
    thread.join(10)
    assert answers["leader"] == "paid"


class WakesAtOnce(MemoryStore):
    """A store whose waits return at once, as a wait may (a spurious wake-up)."""

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        time.sleep(0.001)
        return self.get(namespace, key)


def test_a_duplicate_woken_often_waits_its_whole_wait() -> None:
    """However many times its waits end early, a duplicate waits ``wait=``, then InProgress:
    never a store error for "too many rounds"."""
    store = WakesAtOnce()
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    other = twiceshy.Ledger(store=store, counts_interval=None)
    release = threading.Event()

    @ledger.tool(effect=twiceshy.KEYED, name="job")
    def job(x: int) -> int:
        release.wait(10)
        return x

    @other.tool(effect=twiceshy.KEYED, wait=0.6, name="job")
    def job_elsewhere(x: int) -> int:
        raise AssertionError("the intent is running elsewhere")

    def owner() -> None:
        with twiceshy.run("run-1"):
            job(1)

    thread = threading.Thread(target=owner)
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress):
        job_elsewhere(1)  # some hundreds of early wake-ups
    assert time.monotonic() - started >= 0.55
    release.set()
    thread.join(10)


def test_one_run_object_serves_concurrent_tasks() -> None:
    """A scope made once and entered by parallel tool calls gives each its scope back."""
    scope = twiceshy.run("run-1")

    async def call(delay: float) -> str | None:
        async with scope:
            await asyncio.sleep(delay)
            inside = twiceshy.current_scope()
        assert twiceshy.current_scope() is None
        return inside

    async def main() -> list[str | None]:
        return await asyncio.gather(call(0.05), call(0.1))

    assert asyncio.run(main()) == ["run-1", "run-1"]
    with scope, twiceshy.run("inner"):
        assert twiceshy.current_scope() == "inner"
    assert twiceshy.current_scope() is None


class SendMail:
    """A tool object whose ``__call__`` is async."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def __call__(self, to: str) -> str:
        self.sent.append(to)
        return "sent"


def test_an_object_with_an_async_call_is_an_async_tool() -> None:
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    mailer = SendMail()
    send = ledger.tool(effect=twiceshy.KEYED, name="send_mail")(mailer)

    async def main() -> list[str]:
        with twiceshy.run("run-1"):
            return [await send("ada@example.com"), await send("ada@example.com")]

    assert asyncio.run(main()) == ["sent", "sent"]
    assert mailer.sent == ["ada@example.com"]


def test_a_blocking_wrapper_of_an_async_tool_is_refused_and_released() -> None:
    """Protected as a blocking tool, an async def behind a plain decorator answers a coroutine:
    it never ran, so the intent is released with an error that says why, not recorded FAILED."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    posted: list[str] = []

    def logged(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    @ledger.tool(effect=twiceshy.UNSAFE)
    @logged
    async def post(text: str) -> str:
        posted.append(text)
        return "posted"

    with twiceshy.run("run-1"):
        with pytest.raises(TypeError, match="returned an awaitable"):
            post("hello")
        (record,) = ledger.store.records("")
    assert record.state is State.RELEASED
    assert posted == []


def test_a_key_parameter_defaulting_to_empty_text_gets_the_intent_key() -> None:
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    def send(to: str, idempotency_key: str = "") -> str:
        return idempotency_key

    with twiceshy.run("run-1"):
        assert send("ada@example.com") == twiceshy.idempotency_key(
            "run-1", "send", {"to": "ada@example.com"}
        )
        assert send("ada@example.com", idempotency_key="chosen") == "chosen"


def test_a_reconciler_whose_result_cannot_be_stored_records_it_happened() -> None:
    """It says the call happened, with a result that has no JSON form: recorded as done, and
    every later call is told that it ran (never that the outcome is unknown, never a rerun)."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[int] = []

    def reconcile(key: str, arguments: Any) -> twiceshy.Happened:
        return twiceshy.Happened({"took": object()})

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=reconcile)
    def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        raise TimeoutError("the gateway did not answer")

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            charge(4900)
        for _ in range(2):
            with pytest.raises(twiceshy.ResultNotStorable, match="already ran"):
                charge(4900)
    (record,) = ledger.store.records("")
    assert record.state is State.SUCCEEDED
    assert runs == [4900]


class LateClaimAnswer(MemoryStore):
    """A store whose answer to one thread's claim arrives late (a slow round trip, a pause)."""

    def claim(self, *args: Any, **kwargs: Any) -> Snapshot:
        snap = super().claim(*args, **kwargs)
        if threading.current_thread().name == "late-owner":
            time.sleep(0.9)
        return snap


def test_an_unsafe_owner_answered_late_renews_its_lease_before_a_duplicate_finds_it_lapsed() -> (
    None
):
    """Most of its 1 s lease was gone when the claim's answer came: it runs anyway (nobody else
    will), and its heartbeat renews at once, so a duplicate finds the call running, not lapsed."""
    store = LateClaimAnswer()
    tools = []
    for _ in range(2):
        ledger = twiceshy.Ledger(store=store, counts_interval=None)

        @ledger.tool(effect=twiceshy.UNSAFE, lease=1.0, wait=0.05, name="charge")
        def charge(amount: int) -> str:
            time.sleep(1.5)
            return "charged"

        tools.append(charge)
    owner_tool, duplicate = tools
    answers: dict[str, Any] = {}

    def owner() -> None:
        with twiceshy.run("run-1"):
            answers["owner"] = owner_tool(1)

    thread = threading.Thread(target=owner, name="late-owner")
    thread.start()
    time.sleep(1.1)  # past the lease granted at the claim, had nobody renewed it
    with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress):
        duplicate(1)
    thread.join(10)
    assert answers["owner"] == "charged"


class PaymentError(Exception):
    """A failure the tool lists as certain."""


class CardDeclined(PaymentError):
    """A kind of it the tool does not list by name."""


def test_a_listed_failure_of_a_subclass_replays_as_the_listed_type() -> None:
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, definite=(PaymentError,))
    def charge(amount: int) -> str:
        runs.append(amount)
        raise CardDeclined("the card was declined")

    with twiceshy.run("run-1"):
        with pytest.raises(CardDeclined):
            charge(4900)
        with pytest.raises(PaymentError, match="the card was declined") as replayed:
            charge(4900)  # the caller's `except PaymentError` holds for the replay too
    assert type(replayed.value) is PaymentError
    assert runs == [4900]


class RecordingFails(MemoryStore):
    """A store that fails every write once the work has started: the outcome cannot be kept."""

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        raise twiceshy.StoreUnavailable("the ledger went away")


def test_a_ledger_failing_after_the_work_ran_says_the_work_ran() -> None:
    """Not "the ledger is unreachable" (which reads as "nothing happened, try again"): the tool
    ran and may have taken effect, in words for the model."""
    ledger = twiceshy.Ledger(store=RecordingFails(), counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_fax(number: str) -> str:
        runs.append(1)
        return "sent"

    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeNotRecorded) as failed:
        send_fax("+15550100")
    assert runs == [1]
    assert isinstance(failed.value, twiceshy.StoreError)
    assert not isinstance(failed.value, ConnectionError)
    assert isinstance(failed.value.__cause__, twiceshy.StoreUnavailable)
    assert "ran" in str(failed.value)
    assert "try again" not in str(failed.value).lower()


# Decorated when this module is imported, before the class it returns is defined.
LATE = twiceshy.Ledger("memory://", counts_interval=None)


@LATE.tool(effect=twiceshy.KEYED)
def issue_receipt(amount: int) -> LateReceipt:
    return LateReceipt("rc_1", amount)


@dataclasses.dataclass(frozen=True)
class LateReceipt:
    """Defined after the tool that returns it."""

    id: str
    amount: int


def test_a_return_type_defined_after_the_tool_is_rebuilt_on_replay() -> None:
    with twiceshy.run("run-1"):
        first = issue_receipt(5)
        again = issue_receipt(5)
    assert again == first
    assert type(again) is LateReceipt


def test_a_blocking_duplicate_on_the_leaders_event_loop_does_not_stop_it() -> None:
    """A blocking call made from async code, joining an async call of the same intent on that
    loop, would stop the loop the leader needs: it is answered InProgress at once."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    guard = ledger.guard("lookup", effect=twiceshy.KEYED, wait=3)

    async def work() -> str:
        await asyncio.sleep(0.05)
        return "done"

    async def main() -> str:
        with twiceshy.run("run-1"):
            leader = asyncio.create_task(guard.acall({"q": 1}, work))
            await asyncio.sleep(0.01)
            started = time.monotonic()
            with pytest.raises(twiceshy.InProgress):
                guard.call({"q": 1}, lambda: "blocking")
            assert time.monotonic() - started < 1
            return await leader

    assert asyncio.run(main()) == "done"


class Garbled(Exception):
    """An error whose message cannot be read (its ``__str__`` raises)."""

    def __str__(self) -> str:
        raise AttributeError("no attribute 'detail'")


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_an_error_whose_message_cannot_be_read_is_recorded_as_unknown(
    effect: twiceshy.Effect, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller gets the honest answer, not the message's own error; nothing stays claimed."""
    caplog.set_level(logging.DEBUG, logger="twiceshy")  # every call's log line is written
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=effect, attempts=1)
    def wire(amount: int) -> None:
        runs.append(amount)
        raise Garbled

    expected = twiceshy.OutcomeUnknown if effect is twiceshy.UNSAFE else Garbled
    with twiceshy.run("run-garbled"), pytest.raises(expected):
        wire(1)
    records = ledger.store.records("")
    assert [r.state for r in records] == [twiceshy.State.UNKNOWN]
    assert "message could not be read" in (records[0].reason or "")
    assert "Garbled" in caplog.text
    assert runs == [1]
