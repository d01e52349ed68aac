"""The ledger's promises to a tool's caller, on every store (DESIGN.md §3 to §5, §7).

The ``store`` and ``clock`` fixtures (``conftest.py``) run each test on every store kind, with
a store clock that moves only when a test says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import numbers
import threading
import time
import types
from collections import Counter
from collections.abc import Iterable, Iterator
from decimal import Decimal
from typing import Any, SupportsInt

import pydantic
import pytest

import twiceshy
from twiceshy import State
from twiceshy.stores import Store
from twiceshy.stores.memory import MemoryStore
from twiceshy.testing import FakeProvider, assert_same_key, assert_took_effect_once


@pytest.fixture
def ledger(store: Store) -> twiceshy.Ledger:
    # No counts: a flush due after the store fixture closed the store would warn into the log
    # of whichever test runs then (test_counts.py tests the counts).
    return twiceshy.Ledger(store=store, counts_interval=None)


def no_backoff(attempt: int) -> float:
    return 0.0


def test_replays_the_first_result(ledger: twiceshy.Ledger) -> None:
    """A retry of one intent gets the first result and the work runs once."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int, customer: str) -> dict[str, Any]:
        runs.append(amount)
        return {"id": f"ch_{len(runs)}", "amount": amount}

    with twiceshy.run("run-1"):
        first = charge(4900, "cus_1")
        second = charge(4900, "cus_1")
    assert first == second == {"id": "ch_1", "amount": 4900}
    assert runs == [4900]


@pytest.mark.parametrize("value", [0, "", [], {}, None, False, 0.0])
def test_falsy_results_replay_as_themselves(ledger: twiceshy.Ledger, value: object) -> None:
    """0, "", [], {}, None and False replay as themselves, and the work runs once."""
    runs = Counter[str]()

    @ledger.tool(effect=twiceshy.KEYED)
    def tool() -> object:
        runs["tool"] += 1
        return value

    with twiceshy.run("run-falsy"):
        assert tool() == value
        replayed = tool()
    assert replayed == value
    assert type(replayed) is type(value)
    assert runs["tool"] == 1


def test_spellings_of_one_call_share_a_key(ledger: twiceshy.Ledger) -> None:
    """Positional, keyword and default-filled spellings of one call are one intent."""
    keys: list[str | None] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def send(to: str, subject: str, urgent: bool = False) -> int:
        keys.append(twiceshy.current_key())
        return len(keys)

    with twiceshy.run("run-2"):
        assert send("a@example.com", "hi") == 1
        assert send(to="a@example.com", subject="hi") == 1
        assert send("a@example.com", subject="hi", urgent=False) == 1
        assert send("a@example.com", "hi", True) == 2
    assert len(keys) == 2
    assert keys[0] == twiceshy.idempotency_key(
        "run-2", "send", {"to": "a@example.com", "subject": "hi", "urgent": False}
    )


def test_scopes_are_different_intents(ledger: twiceshy.Ledger) -> None:
    """Two runs calling a tool with the same arguments both execute."""
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def act(x: int) -> int:
        runs.append("x")
        return x

    for scope in ("run-a", "run-b", "run-a"):
        with twiceshy.run(scope):
            act(1)
    assert len(runs) == 2


def test_missing_scope_is_refused_before_the_tool_runs(ledger: twiceshy.Ledger) -> None:
    """A call outside any run scope raises MissingScope and the tool never runs."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def act(x: int) -> int:
        runs.append(x)
        return x

    with pytest.raises(twiceshy.MissingScope, match=r"twiceshy\.run"):
        act(1)
    assert runs == []


def test_scope_derived_from_arguments(ledger: twiceshy.Ledger) -> None:
    """A tool may derive its scope from its arguments when no run scope is active."""
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, scope=lambda args: f"order-{args['order']}")
    def ship(order: str) -> str:
        runs.append(order)
        return order

    assert ship("o1") == ship("o1") == "o1"
    assert runs == ["o1"]


def test_unkeyable_argument_is_refused_before_the_tool_runs(ledger: twiceshy.Ledger) -> None:
    """An argument with no canonical form raises UnkeyableType naming its path; nothing runs."""
    runs: list[object] = []

    class Foo:
        pass

    @ledger.tool(effect=twiceshy.KEYED)
    def act(items: list[object]) -> None:
        runs.append(items)

    with twiceshy.run("run-3"), pytest.raises(twiceshy.UnkeyableType, match=r"items\[1\]"):
        act([1, Foo()])
    with twiceshy.run("run-3"), pytest.raises(twiceshy.UnkeyableValue):
        act([float("nan")])
    assert runs == []


def test_key_reuse_with_other_arguments_never_runs(ledger: twiceshy.Ledger) -> None:
    """With key_args narrowing the key, a call with other full arguments is refused."""
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, key_args=["order"])
    def refund(order: str, amount: int) -> int:
        runs.append(order)
        return amount

    with twiceshy.run("run-4"):
        assert refund("o1", 100) == 100
        with pytest.raises(twiceshy.KeyReuseMismatch):
            refund("o1", 999)
        assert refund("o1", 100) == 100
    assert runs == ["o1"]


def test_ignored_arguments_do_not_name_the_intent(ledger: twiceshy.Ledger) -> None:
    """ignore_args leaves a volatile argument out of key and fingerprint: a retry whose
    requested_at differs replays the first outcome."""
    runs: list[tuple[int, str]] = []

    @ledger.tool(effect=twiceshy.KEYED, ignore_args=["requested_at"])
    def act(x: int, requested_at: str) -> int:
        runs.append((x, requested_at))
        return x * 10

    with twiceshy.run("run-5"):
        assert act(1, "12:00:00") == 10
        assert act(1, requested_at="12:00:07") == 10
        assert act(2, "12:00:09") == 20
    assert runs == [(1, "12:00:00"), (2, "12:00:09")]


def test_narrowed_keys_still_refuse_other_arguments(ledger: twiceshy.Ledger) -> None:
    """With key_args, the other arguments must match: KeyReuseMismatch, and nothing runs."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, key_args=["order"])
    def act(order: str, amount: int) -> int:
        runs.append(amount)
        return amount

    with twiceshy.run("run-5b"):
        assert act("o-1", 5) == 5
        with pytest.raises(twiceshy.KeyReuseMismatch):
            act("o-1", 6)
    assert runs == [5]


def test_explicit_key_is_used_and_checked(ledger: twiceshy.Ledger) -> None:
    """A key passed through the key parameter is the key, checked against the arguments."""
    seen: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int, idempotency_key: str | None = None) -> int:
        assert idempotency_key is not None
        seen.append(idempotency_key)
        return amount

    assert charge(5, idempotency_key="order-77") == 5
    assert charge(5, idempotency_key="order-77") == 5
    with pytest.raises(twiceshy.KeyReuseMismatch):
        charge(6, idempotency_key="order-77")
    assert seen == ["order-77"]


def test_key_is_injected_and_current(ledger: twiceshy.Ledger) -> None:
    """Inside a KEYED tool the key is both injected and current_key(), and left out of the key."""
    seen: list[tuple[str | None, str | None]] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int, idempotency_key: str | None = None) -> int:
        seen.append((idempotency_key, twiceshy.current_key()))
        return amount

    with twiceshy.run("run-6"):
        charge(5)
    expected = twiceshy.idempotency_key("run-6", "charge", {"amount": 5})
    assert seen == [(expected, expected)]
    assert twiceshy.current_key() is None


def test_keyed_ambiguous_error_is_retried_in_place_with_the_same_key(
    ledger: twiceshy.Ledger,
) -> None:
    """A timeout of a KEYED tool is retried with the same key; the caller gets the result."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=2)  # each takes effect (or is deduplicated), then times out

    @ledger.tool(effect=twiceshy.KEYED, attempts=3, backoff=no_backoff)
    def charge(amount: int) -> str:
        key = twiceshy.current_key()
        return str(provider.charge(amount, "cus_1", idempotency_key=key)["id"])

    with twiceshy.run("run-7"):
        assert charge(10) == "ch_1"
        assert charge(10) == "ch_1"
    assert len(provider.requests) == 3
    assert_same_key(provider, key=twiceshy.idempotency_key("run-7", "charge", {"amount": 10}))
    assert_took_effect_once(provider)


def test_keyed_attempts_exhausted_runs_again_with_the_same_key(
    ledger: twiceshy.Ledger, store: Store
) -> None:
    """When attempts run out the record is UNKNOWN and the next call runs with the same key."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=2)  # both attempts of the first call lose their answer

    @ledger.tool(effect=twiceshy.KEYED, attempts=2, backoff=no_backoff)
    def charge(amount: int) -> str:
        key = twiceshy.current_key()
        return str(provider.charge(amount, "cus_1", idempotency_key=key)["id"])

    with twiceshy.run("run-8"):
        with pytest.raises(TimeoutError):
            charge(10)
        key = twiceshy.idempotency_key("run-8", "charge", {"amount": 10})
        record = store.get("", key).record
        assert record is not None
        assert record.state is twiceshy.State.UNKNOWN
        assert charge(10) == "ch_1"
    record = store.get("", key).record
    assert record is not None
    assert record.state is twiceshy.State.SUCCEEDED
    assert record.fence == 2
    assert len(provider.requests) == 3
    assert_same_key(provider, key=key)
    assert_took_effect_once(provider)


def test_unsafe_ambiguous_error_is_never_rerun(ledger: twiceshy.Ledger, store: Store) -> None:
    """An UNSAFE tool that times out gives OutcomeUnknown, now and on every retry; it runs once."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def wire(amount: int) -> str:
        runs.append(amount)
        raise TimeoutError("read timed out")

    with twiceshy.run("run-9"):
        with pytest.raises(twiceshy.OutcomeUnknown) as first:
            wire(500)
        assert isinstance(first.value.__cause__, TimeoutError)
        for _ in range(3):
            with pytest.raises(twiceshy.OutcomeUnknown):
                wire(500)
    assert runs == [500]
    record = store.get("", first.value.key).record
    assert record is not None
    assert record.state is twiceshy.State.UNKNOWN
    assert record.reason is not None
    assert "TimeoutError" in record.reason


def test_outcome_unknown_speaks_to_the_model() -> None:
    """OutcomeUnknown says it may have happened, will not rerun, tell the user; no 'try again'."""
    text = str(twiceshy.OutcomeUnknown("wire", "ab" * 32, "TimeoutError"))
    assert "may or may not have taken effect" in text
    assert "will not be run again" in text
    assert "tell the user" in text
    assert "try again" not in text.lower()
    busy = str(twiceshy.InProgress("wire", "ab" * 32))
    assert "still running" in busy
    assert "try again" not in busy.lower()


def test_not_applied_releases_the_intent(ledger: twiceshy.Ledger) -> None:
    """A tool raising NotApplied (or a not_applied= type) leaves the intent free to run again."""
    runs: list[int] = []

    class Declined(Exception):
        pass

    @ledger.tool(effect=twiceshy.UNSAFE, not_applied=[Declined])
    def wire(amount: int) -> str:
        runs.append(amount)
        if len(runs) == 1:
            raise twiceshy.NotApplied("provider refused before doing anything")
        if len(runs) == 2:
            raise Declined("rate limited")
        return "ok"

    with twiceshy.run("run-10"):
        with pytest.raises(twiceshy.NotApplied):
            wire(1)
        with pytest.raises(Declined):
            wire(1)
        assert wire(1) == "ok"
        assert wire(1) == "ok"
    assert runs == [1, 1, 1]


class CardDeclined(Exception):
    """A definite failure of the test provider."""


def test_definite_error_is_recorded_and_replayed_as_its_type(ledger: twiceshy.Ledger) -> None:
    """A definite= error is recorded as FAILED and replayed as the same type without rerunning."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, definite=[CardDeclined])
    def charge(amount: int) -> str:
        runs.append(amount)
        raise CardDeclined("card declined: insufficient funds")

    with twiceshy.run("run-11"):
        with pytest.raises(CardDeclined, match="insufficient funds"):
            charge(1)
        with pytest.raises(CardDeclined, match="insufficient funds"):
            charge(1)
    assert runs == [1]


def test_reconcile_resolves_an_unknown_outcome(ledger: twiceshy.Ledger) -> None:
    """A reconciler that finds the effect turns UNKNOWN into the found result; none reruns."""
    runs: list[int] = []
    asked: list[str] = []

    def look_up(key: str, args: Any) -> twiceshy.Happened | None:
        asked.append(key)
        return twiceshy.Happened({"id": "ch_found", "amount": args["amount"]})

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=look_up)
    def charge(amount: int) -> dict[str, Any]:
        runs.append(amount)
        raise TimeoutError

    with twiceshy.run("run-12"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            charge(7)
        assert charge(7) == {"id": "ch_found", "amount": 7}
        assert charge(7) == {"id": "ch_found", "amount": 7}
    assert runs == [7]
    assert len(asked) == 1


def test_reconcile_did_not_happen_lets_it_run_once_more(ledger: twiceshy.Ledger) -> None:
    """A reconciler that finds nothing releases the intent; the next call runs exactly once."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=lambda key, args: twiceshy.DidNotHappen())
    def charge(amount: int) -> str:
        runs.append(amount)
        if len(runs) == 1:
            raise TimeoutError
        return "ch_2"

    with twiceshy.run("run-13"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            charge(7)
        assert charge(7) == "ch_2"
        assert charge(7) == "ch_2"
    assert runs == [7, 7]


def test_reconcile_that_cannot_tell_keeps_the_doubt(ledger: twiceshy.Ledger) -> None:
    """A reconciler that cannot tell (None, or failing) leaves OutcomeUnknown; nothing reruns."""
    runs: list[int] = []

    def broken(key: str, args: Any) -> None:
        raise RuntimeError("provider API down")

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=broken)
    def charge(amount: int) -> str:
        runs.append(amount)
        raise TimeoutError

    with twiceshy.run("run-14"):
        for _ in range(3):
            with pytest.raises(twiceshy.OutcomeUnknown):
                charge(7)
    assert runs == [7]


def test_safe_tool_retries_transient_errors_and_is_not_recorded(
    ledger: twiceshy.Ledger, store: Store
) -> None:
    """A SAFE tool is retried on errors and runs on every call; nothing is kept in the ledger."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.SAFE, attempts=3, backoff=no_backoff)
    def search(q: str) -> int:
        runs.append(1)
        if len(runs) % 2 == 1:
            raise ConnectionError("reset")
        return len(runs)

    assert search("x") == 2
    assert search("x") == 4
    assert store.records("") == []


def test_safe_tool_is_not_retried_on_its_own_answers(ledger: twiceshy.Ledger) -> None:
    """An unrecorded SAFE call retries only ambiguous errors, as a recorded call reads them."""
    runs: list[str] = []

    class Missing(Exception):
        """The record looked up does not exist: a certain answer."""

    class Busy(Exception):
        """The service refused before doing anything."""

    @ledger.tool(
        effect=twiceshy.SAFE, attempts=3, backoff=no_backoff, definite=[Missing], not_applied=[Busy]
    )
    def lookup(kind: str) -> str:
        runs.append(kind)
        if kind == "missing":
            raise Missing(kind)
        if kind == "busy":
            raise Busy(kind)
        if kind == "refused":
            raise twiceshy.NotApplied(kind)
        raise TimeoutError(kind)

    for kind, error in (("missing", Missing), ("busy", Busy), ("refused", twiceshy.NotApplied)):
        with pytest.raises(error):
            lookup(kind)
    with pytest.raises(TimeoutError):
        lookup("slow")
    assert runs == ["missing", "busy", "refused", "slow", "slow", "slow"]


def test_safe_tool_with_record_replays(ledger: twiceshy.Ledger) -> None:
    """A SAFE tool with record=True replays within a run."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.SAFE, record=True)
    def fetch(url: str) -> int:
        runs.append(1)
        return len(runs)

    with twiceshy.run("run-15"):
        assert fetch("u") == fetch("u") == 1


class Handle:
    """A result with no JSON form."""

    def __str__(self) -> str:
        return "Handle(ch_1)"


@dataclasses.dataclass
class Wrapped:
    """A dataclass with a field of no JSON form."""

    handle: Handle


def test_result_without_json_form_is_recorded_as_done(ledger: twiceshy.Ledger) -> None:
    """The first call gets its result; the record says the tool succeeded; a retry is told it
    ran, with the result's text, and it never reruns or reads as a failure."""
    runs: list[int] = []
    made = Handle()

    @ledger.tool(effect=twiceshy.KEYED)
    def make(amount: int) -> Any:
        runs.append(amount)
        return made

    with twiceshy.run("run-16"):
        assert make(5) is made
        with pytest.raises(twiceshy.ResultNotStorable) as replay:
            make(5)
    text = str(replay.value)
    assert "already ran for these arguments and succeeded" in text
    assert "it was not run again" in text
    assert "Handle(ch_1)" in text
    assert "try again" not in text.lower()
    assert replay.value.tool == "make"
    (record,) = ledger.store.records("")
    assert record.state is State.SUCCEEDED
    assert runs == [5]


def test_result_over_the_size_bound_is_recorded_as_done(ledger: twiceshy.Ledger) -> None:
    """A result larger than max_result_bytes is the first caller's; a retry says it ran."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, max_result_bytes=1000)
    def make() -> str:
        runs.append(1)
        return "x" * 2000

    with twiceshy.run("run-17"):
        assert make() == "x" * 2000
        with pytest.raises(twiceshy.ResultNotStorable, match="max_result_bytes"):
            make()
    assert runs == [1]


def test_a_result_that_reads_as_the_ledgers_own_marker_replays_as_itself(
    ledger: twiceshy.Ledger,
) -> None:
    """A result whose JSON reads like the ledger's note for a result not kept is kept as is."""
    odd = {"$twiceshy": "not kept", "type": "x", "why": "y", "text": "z"}

    @ledger.tool(effect=twiceshy.KEYED)
    def make() -> dict[str, str]:
        return dict(odd)

    with twiceshy.run("run-17b"):
        assert make() == odd
        assert make() == odd


def test_a_return_annotation_with_no_json_form_is_refused_when_declared(
    ledger: twiceshy.Ledger,
) -> None:
    """-> Handle (or a field of that type) is refused at decoration, before anything runs."""

    def charge(amount: int) -> Handle:
        raise AssertionError("never runs")

    with pytest.raises(twiceshy.ResultNotStorable, match=r"'charge'.*Handle has no JSON form"):
        ledger.tool(effect=twiceshy.KEYED)(charge)

    def wrapped() -> list[Wrapped]:
        raise AssertionError("never runs")

    with pytest.raises(twiceshy.ResultNotStorable, match=r"Wrapped\.handle"):
        ledger.tool(effect=twiceshy.UNSAFE)(wrapped)
    with pytest.raises(twiceshy.ResultNotStorable):
        ledger.guard("g", effect=twiceshy.KEYED, returns=Iterator[int])
    # What may well be stored passes: an ABC, a protocol, a union with a storable member.
    for fine in (Iterable, numbers.Number, SupportsInt, Handle | None, Wrapped | str):
        ledger.guard("g", effect=twiceshy.KEYED, returns=fine)


@dataclasses.dataclass(frozen=True)
class Charge:
    """A dataclass result."""

    id: str
    amount: Decimal
    tags: tuple[str, ...]


class Receipt(pydantic.BaseModel):
    """A pydantic result."""

    charge: str
    total: int


def test_annotated_results_are_rebuilt_on_replay(ledger: twiceshy.Ledger) -> None:
    """Dataclass and pydantic results replay as equal values of their annotated types."""

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: str) -> Charge:
        return Charge("ch_1", Decimal(amount), ("a", "b"))

    @ledger.tool(effect=twiceshy.KEYED)
    def receipt(charge: str) -> Receipt:
        return Receipt(charge=charge, total=3)

    @ledger.tool(effect=twiceshy.KEYED)
    def charges(n: int) -> list[Charge]:
        return [Charge(f"ch_{i}", Decimal("1.5"), ()) for i in range(n)]

    with twiceshy.run("run-18"):
        first = charge("10.50")
        again = charge("10.50")
        assert again == first
        assert isinstance(again, Charge)
        assert receipt("ch_1") == receipt("ch_1") == Receipt(charge="ch_1", total=3)
        listed = charges(2)
        assert charges(2) == listed
        assert all(isinstance(c, Charge) for c in charges(2))


def test_async_tools_replay_and_join(ledger: twiceshy.Ledger) -> None:
    """Async tools replay, and concurrent duplicate tasks share one execution."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    async def charge(amount: int) -> str:
        runs.append(amount)
        await asyncio.sleep(0.05)
        return f"ch_{amount}"

    async def main() -> list[str]:
        with twiceshy.run("run-19"):
            results = await asyncio.gather(*(charge(3) for _ in range(20)))
            results.append(await charge(3))
            return list(results)

    assert asyncio.run(main()) == ["ch_3"] * 21
    assert runs == [3]


def test_async_tool_missing_scope_refused() -> None:
    """An async tool called outside a scope raises MissingScope and never runs."""
    ledger = twiceshy.Ledger("memory://")
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    async def act(x: int) -> int:
        runs.append(x)
        return x

    with pytest.raises(twiceshy.MissingScope):
        asyncio.run(act(1))
    assert runs == []


def test_thread_duplicates_share_one_execution(ledger: twiceshy.Ledger) -> None:
    """Many threads calling one intent at once: one execution, every caller the same result."""
    runs: list[int] = []
    barrier = threading.Barrier(16)
    results: list[object] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(amount: int) -> dict[str, Any]:
        runs.append(amount)
        time.sleep(0.05)
        return {"id": "ch_1"}

    def caller() -> None:
        with twiceshy.run("run-20"):
            barrier.wait()
            results.append(charge(1))

    threads = [threading.Thread(target=caller) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert runs == [1]
    assert results == [{"id": "ch_1"}] * 16


def test_duplicate_on_another_ledger_waits_for_the_outcome(store: Store) -> None:
    """A duplicate through another ledger on the same store waits and gets the winner's result."""
    first, second = (
        twiceshy.Ledger(store=store, counts_interval=None),
        twiceshy.Ledger(store=store, counts_interval=None),
    )
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def body(who: str) -> str:
        runs.append(who)
        started.set()
        release.wait(5)
        return f"done by {who}"

    slow_a = first.tool(effect=twiceshy.UNSAFE, name="slow")(lambda: body("a"))
    slow_b = second.tool(effect=twiceshy.UNSAFE, name="slow")(lambda: body("b"))
    out: list[str] = []

    def run_a() -> None:
        with twiceshy.run("run-21"):
            out.append(slow_a())

    thread = threading.Thread(target=run_a)
    thread.start()
    assert started.wait(5)
    threading.Timer(0.1, release.set).start()
    with twiceshy.run("run-21"):
        assert slow_b() == "done by a"
    thread.join(5)
    assert out == ["done by a"]
    assert runs == ["a"]


def test_duplicate_gives_in_progress_after_its_wait(store: Store) -> None:
    """A duplicate that outwaits wait= gets InProgress, and does not run the work."""
    first, second = (
        twiceshy.Ledger(store=store, counts_interval=None),
        twiceshy.Ledger(store=store, counts_interval=None),
    )
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def body() -> str:
        runs.append("x")
        started.set()
        release.wait(5)
        return "ok"

    slow_a = first.tool(effect=twiceshy.UNSAFE, name="slow")(body)
    slow_b = second.tool(effect=twiceshy.UNSAFE, name="slow", wait=0.1)(body)

    def run_a() -> None:
        with twiceshy.run("run-22"):
            slow_a()

    thread = threading.Thread(target=run_a)
    thread.start()
    assert started.wait(5)
    with twiceshy.run("run-22"), pytest.raises(twiceshy.InProgress):
        slow_b()
    release.set()
    thread.join(5)
    assert runs == ["x"]


def test_lapsed_lease_keyed_is_taken_over_with_a_higher_fence(store: Store, clock: Any) -> None:
    """A KEYED claim whose owner vanished is taken over once its lease lapses (fence + 1)."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    key = twiceshy.idempotency_key("run-23", "charge", {"amount": 1})
    store.claim(
        "",
        key,
        fingerprint=_fingerprint("charge", {"amount": 1}),
        tool="charge",
        effect=twiceshy.KEYED,
        owner="crashed-owner",
        lease=30,
    )
    keys: list[str | None] = []

    @ledger.tool(effect=twiceshy.KEYED, lease=30, wait=0.05)
    def charge(amount: int) -> str:
        keys.append(twiceshy.current_key())
        return "ch_1"

    with twiceshy.run("run-23"):
        with pytest.raises(twiceshy.InProgress):
            charge(1)
        clock.advance(31)
        assert charge(1) == "ch_1"
    record = store.get("", key).record
    assert record is not None
    assert (record.state, record.fence) == (twiceshy.State.SUCCEEDED, 2)
    assert keys == [key]


def test_lapsed_lease_unsafe_becomes_unknown_and_never_runs(store: Store, clock: Any) -> None:
    """An UNSAFE claim whose owner vanished becomes UNKNOWN after the lease; the tool never runs."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    key = twiceshy.idempotency_key("run-24", "wire", {"amount": 1})
    store.claim(
        "",
        key,
        fingerprint=_fingerprint("wire", {"amount": 1}),
        tool="wire",
        effect=twiceshy.UNSAFE,
        owner="crashed-owner",
        lease=30,
    )
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, lease=30, wait=0.05)
    def wire(amount: int) -> str:
        runs.append(amount)
        return "ok"

    with twiceshy.run("run-24"):
        clock.advance(31)
        with pytest.raises(twiceshy.OutcomeUnknown, match="stopped without recording"):
            wire(1)
    assert runs == []
    record = store.get("", key).record
    assert record is not None
    assert record.state is twiceshy.State.UNKNOWN


def test_stale_owner_cannot_record_after_a_takeover(store: Store, clock: Any) -> None:
    """An owner paused past its lease is fenced out; it returns the new owner's outcome (G4)."""
    first, second = (
        twiceshy.Ledger(store=store, counts_interval=None),
        twiceshy.Ledger(store=store, counts_interval=None),
    )
    started, release = threading.Event(), threading.Event()
    keys: list[str | None] = []

    def body(who: str) -> str:
        keys.append(twiceshy.current_key())
        if who == "stale":
            started.set()
            release.wait(5)
        return f"result of {who}"

    stale = first.tool(effect=twiceshy.KEYED, name="charge", lease=30)(lambda: body("stale"))
    fresh = second.tool(effect=twiceshy.KEYED, name="charge", lease=30)(lambda: body("fresh"))
    out: list[str] = []

    def run_stale() -> None:
        with twiceshy.run("run-25"):
            out.append(stale())

    thread = threading.Thread(target=run_stale)
    thread.start()
    assert started.wait(5)
    clock.advance(31)  # the stale owner's lease lapses on the store's clock
    with twiceshy.run("run-25"):
        assert fresh() == "result of fresh"
    release.set()
    thread.join(5)
    assert out == ["result of fresh"]
    assert len(keys) == 2
    assert len(set(keys)) == 1
    key = keys[0]
    assert key is not None
    record = store.get("", key).record
    assert record is not None
    assert (record.state, record.fence, record.result) == (
        twiceshy.State.SUCCEEDED,
        2,
        '"result of fresh"',
    )


def test_retention_is_explicit(ledger: twiceshy.Ledger, store: Store, clock: Any) -> None:
    """Outcomes replay until their ttl, then a late retry runs again; UNKNOWN never expires."""
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, ttl=3600)
    def charge(amount: int) -> int:
        runs.append("charge")
        return len(runs)

    @ledger.tool(effect=twiceshy.UNSAFE, ttl=3600)
    def wire(amount: int) -> int:
        runs.append("wire")
        raise TimeoutError

    with twiceshy.run("run-26"):
        assert charge(1) == 1
        clock.advance(3599)
        assert charge(1) == 1
        clock.advance(2)
        assert charge(1) == 2
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(1)
        clock.advance(10 * 365 * 86400)
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(1)
    assert runs == ["charge", "charge", "wire"]


def test_namespaces_never_meet(store: Store) -> None:
    """The same intent in two namespaces runs once in each."""
    runs: list[str] = []
    tools = []
    for ns in ("tenant-a", "tenant-b"):
        ledger = twiceshy.Ledger(store=store, namespace=ns)
        tools.append(
            ledger.tool(effect=twiceshy.KEYED, name="act")(lambda ns=ns: runs.append(ns) or ns)
        )
    with twiceshy.run("run-27"):
        assert [t() for t in tools] == ["tenant-a", "tenant-b"]
        assert [t() for t in tools] == ["tenant-a", "tenant-b"]
    assert runs == ["tenant-a", "tenant-b"]


def test_configuration_errors_are_refused_at_decoration() -> None:
    """Bad options fail when the tool is defined, not when it is called."""
    ledger = twiceshy.Ledger("memory://")

    def f(x: int) -> int:
        return x

    with pytest.raises(TypeError):
        ledger.tool(effect="keyed")(f)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly once"):
        ledger.tool(effect=twiceshy.UNSAFE, attempts=3)(f)
    with pytest.raises(ValueError, match="does not have"):
        ledger.tool(effect=twiceshy.KEYED, key_args=["y"])(f)
    with pytest.raises(ValueError, match=":"):
        ledger.tool(effect=twiceshy.KEYED, name="a:b")(f)
    with pytest.raises(ValueError, match="record="):
        ledger.tool(effect=twiceshy.KEYED, record=True)(f)
    with pytest.raises(ValueError, match="unknown ledger URL"):
        twiceshy.Ledger("ftp://nowhere")


def test_public_surface_is_listed_and_importable() -> None:
    """twiceshy.__all__ names every public object once, and each exists."""
    assert len(set(twiceshy.__all__)) == len(twiceshy.__all__)
    for name in twiceshy.__all__:
        assert hasattr(twiceshy, name), name
    public = {
        name
        for name, value in vars(twiceshy).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public <= set(twiceshy.__all__)


def _fingerprint(tool: str, args: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(f"{tool}:{twiceshy.canonical_json(args)}".encode()).hexdigest()


def test_results_with_lone_surrogates_are_kept(ledger: twiceshy.Ledger) -> None:
    """A result holding a lone surrogate (no UTF-8 form) is stored escaped and replays equal."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def odd() -> dict[str, str]:
        runs.append(1)
        return {"text": "a\ud800b", "emoji": "\U0001f600"}

    with twiceshy.run("run-28"):
        assert odd() == odd() == {"text": "a\ud800b", "emoji": "\U0001f600"}
    assert runs == [1]


def test_a_new_owner_always_gets_a_lease() -> None:
    """A Change handing a record to a new owner must set its lease, or it could never lapse."""
    with pytest.raises(ValueError, match="lease"):
        twiceshy.Change(
            1, frozenset({twiceshy.State.RELEASED}), twiceshy.State.CLAIMED, new_owner="x"
        )


def test_guard_protects_a_call_given_as_a_mapping(ledger: twiceshy.Ledger) -> None:
    """A guard runs work once per (scope, tool, arguments) given as a mapping, with the key set."""
    guard = ledger.guard("create_order", effect=twiceshy.KEYED)
    keys: list[str | None] = []

    def work() -> str:
        keys.append(twiceshy.current_key())
        return f"order-{len(keys)}"

    assert guard.call({"sku": "A", "qty": 2}, work, scope="run-29") == "order-1"
    assert guard.call({"qty": 2, "sku": "A"}, work, scope="run-29") == "order-1"
    assert guard.call({"sku": "A", "qty": 2}, work, scope="run-30") == "order-2"
    with twiceshy.run("run-29"):
        assert guard.call({"sku": "A", "qty": 2}, work) == "order-1"
    assert keys == [
        twiceshy.idempotency_key("run-29", "create_order", {"sku": "A", "qty": 2}),
        twiceshy.idempotency_key("run-30", "create_order", {"sku": "A", "qty": 2}),
    ]
    with pytest.raises(twiceshy.MissingScope):
        guard.call({"sku": "A", "qty": 2}, work)


def test_guard_async_call_and_narrowing(ledger: twiceshy.Ledger) -> None:
    """An async guard call replays; key_args narrows the key and checks the rest."""
    guard = ledger.guard("refund", effect=twiceshy.UNSAFE, key_args=["order"])
    runs: list[int] = []

    async def work() -> int:
        runs.append(1)
        return len(runs)

    async def main() -> None:
        assert await guard.acall({"order": "o1", "amount": 5}, work, scope="run-31") == 1
        assert await guard.acall({"order": "o1", "amount": 5}, work, scope="run-31") == 1
        with pytest.raises(twiceshy.KeyReuseMismatch):
            await guard.acall({"order": "o1", "amount": 6}, work, scope="run-31")

    asyncio.run(main())
    assert runs == [1]


def test_settle_reconciles_a_parked_record_outside_any_call(ledger: twiceshy.Ledger) -> None:
    """Guard.settle asks the reconciler with the key and the arguments the record kept, and
    records what it found."""
    asked: list[tuple[str, object]] = []
    found: dict[str, twiceshy.Happened | None] = {"answer": None}

    def look_up(key: str, args: object) -> twiceshy.Happened | None:
        asked.append((key, args))
        return found["answer"]

    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=look_up)
    def wire(amount: int) -> dict[str, str]:
        runs.append(amount)
        raise TimeoutError

    guard = wire.twiceshy  # type: ignore[attr-defined]
    key = twiceshy.idempotency_key("run-32", "wire", {"amount": 3})
    with twiceshy.run("run-32"), pytest.raises(twiceshy.OutcomeUnknown):
        wire(3)
    asked.clear()
    record = guard.settle(key)
    assert record is not None
    assert record.state is twiceshy.State.UNKNOWN
    found["answer"] = twiceshy.Happened({"id": "w_1"})
    record = guard.settle(key)
    assert record is not None
    assert record.state is twiceshy.State.SUCCEEDED
    assert asked == [(key, {"amount": 3}), (key, {"amount": 3})]
    with twiceshy.run("run-32"):
        assert wire(3) == {"id": "w_1"}
    assert runs == [3]
    assert guard.settle("no-such-key") is None


def test_asettle_reconciles_a_parked_record_from_async_code(ledger: twiceshy.Ledger) -> None:
    """Inside a running loop, settle() with an async reconciler says to use asettle, which works."""
    found: dict[str, twiceshy.Happened | None] = {"answer": None}

    async def look_up(key: str, args: object) -> twiceshy.Happened | None:
        return found["answer"]

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=look_up)
    async def wire(amount: int) -> dict[str, str]:
        raise TimeoutError

    guard = wire.twiceshy  # type: ignore[attr-defined]
    key = twiceshy.idempotency_key("run-33", "wire", {"amount": 3})

    async def main() -> twiceshy.Record | None:
        with twiceshy.run("run-33"), pytest.raises(twiceshy.OutcomeUnknown):
            await wire(3)
        found["answer"] = twiceshy.Happened({"id": "w_1"})
        with pytest.raises(RuntimeError, match="asettle"):
            guard.settle(key)
        return await guard.asettle(key)

    record = asyncio.run(main())
    assert record is not None
    assert record.state is twiceshy.State.SUCCEEDED
    assert record.result == '{"id":"w_1"}'


def test_a_blocking_reconciler_of_an_async_tool_does_not_stop_the_event_loop() -> None:
    """A blocking reconciler of an async tool runs in a worker thread: other tasks go on."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    loop_threads: list[bool] = []

    def look_up(key: str, args: object) -> twiceshy.DidNotHappen:
        loop_threads.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.3)  # a slow provider
        return twiceshy.DidNotHappen()

    calls = {"n": 0}

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=look_up)
    async def wire(amount: int) -> str:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TimeoutError
        return "sent"

    async def main() -> tuple[str, int]:
        with twiceshy.run("run-34"):
            with pytest.raises(twiceshy.OutcomeUnknown):
                await wire(3)
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            answer = await wire(3)  # reconciled (did not happen), released, run again
            ticker.cancel()
            return answer, ticks

    answer, ticks = asyncio.run(main())
    assert answer == "sent"
    assert loop_threads == [False]
    assert ticks >= 10  # the loop ran other tasks while the reconciler looked


def test_a_reconciler_answer_of_no_known_kind_is_logged_and_read_as_cannot_tell(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reconciler that answers, say, the provider's dict leaves the doubt, and says why."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=lambda key, args: {"status": "succeeded"})
    def wire(amount: int) -> str:
        raise TimeoutError

    with twiceshy.run("run-35"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(3)
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(3)
    assert "not Happened(...), DidNotHappen() or None" in caplog.text


def test_an_object_with_an_async_call_is_refused_as_reconciler_of_a_sync_tool() -> None:
    """Refused when the tool is decorated, not on every call."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    class LookUp:
        async def __call__(self, key: str, args: object) -> None:
            return None

    with pytest.raises(TypeError, match="sync reconcile"):

        @ledger.tool(effect=twiceshy.UNSAFE, reconcile=LookUp())
        def wire(amount: int) -> str:
            return "sent"


def test_with_errors_extends_a_guard(ledger: twiceshy.Ledger) -> None:
    """with_errors adds definite and not-applied types to a guard; the original is unchanged."""

    class Refused(Exception):
        pass

    class Declined(Exception):
        pass

    base = ledger.guard("pay", effect=twiceshy.UNSAFE)
    extended = base.with_errors(definite=[Declined], not_applied=[Refused])
    runs: list[str] = []

    def refuse() -> None:
        runs.append("refused")
        raise Refused

    def decline() -> None:
        runs.append("declined")
        raise Declined("no funds")

    with pytest.raises(Refused):
        extended.call({"n": 1}, refuse, scope="run-33")
    with pytest.raises(Declined):
        extended.call({"n": 1}, decline, scope="run-33")
    with pytest.raises(Declined):
        extended.call({"n": 1}, decline, scope="run-33")
    with pytest.raises(twiceshy.OutcomeUnknown):
        base.call({"n": 2}, decline, scope="run-33")
    assert runs == ["refused", "declined", "declined"]
    assert base.policy.definite == ()


def test_unsafe_owner_finishing_late_resolves_the_doubt(store: Store, clock: Any) -> None:
    """An UNSAFE owner whose lapsed lease was marked UNKNOWN records its outcome when it ends."""
    first, second = (
        twiceshy.Ledger(store=store, counts_interval=None),
        twiceshy.Ledger(store=store, counts_interval=None),
    )
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def body(who: str) -> str:
        runs.append(who)
        if who == "late":
            started.set()
            release.wait(5)
        return f"sent by {who}"

    late = first.tool(effect=twiceshy.UNSAFE, name="wire", lease=30)(lambda: body("late"))
    other = second.tool(effect=twiceshy.UNSAFE, name="wire", lease=30)(lambda: body("other"))
    out: list[str] = []

    def run_late() -> None:
        with twiceshy.run("run-34"):
            out.append(late())

    thread = threading.Thread(target=run_late)
    thread.start()
    assert started.wait(5)
    clock.advance(31)  # the owner's lease lapses on the store's clock
    with twiceshy.run("run-34"), pytest.raises(twiceshy.OutcomeUnknown):
        other()
    release.set()
    thread.join(5)
    assert out == ["sent by late"]
    with twiceshy.run("run-34"):
        assert other() == "sent by late"
    assert runs == ["late"]


class StallingClaims(MemoryStore):
    """A memory store whose next claim answers only after ``stall`` seconds (a paused caller)."""

    stall = 0.0

    def claim(self, namespace: str, key: str, **options: Any) -> twiceshy.Snapshot:
        snap = super().claim(namespace, key, **options)
        stall, self.stall = self.stall, 0.0
        time.sleep(stall)
        return snap


class StalledOwner:
    """Two ledgers on one store racing for one intent: the first one's claim answers only
    after its 0.2 s lease has lapsed on the store's clock; ``other()`` calls from the second
    ledger once it has (the calls of the tool record who ran it in ``runs``)."""

    def __init__(self, effect: twiceshy.Effect, scope: str, **options: Any) -> None:
        store = StallingClaims()
        self.runs: list[str] = []
        self.answers: list[str] = []
        self.scope = scope
        stalled = self._tool(
            twiceshy.Ledger(store=store, counts_interval=None), "stalled", effect, options
        )
        self._other = self._tool(
            twiceshy.Ledger(store=store, counts_interval=None), "other", effect, options
        )

        def call_stalled() -> None:
            with twiceshy.run(scope):
                self.answers.append(stalled(1))

        store.stall = 0.6
        self.thread = threading.Thread(target=call_stalled)
        self.thread.start()
        time.sleep(0.35)  # the stalled claim's lease has lapsed on the store's clock

    def _tool(
        self, ledger: twiceshy.Ledger, who: str, effect: twiceshy.Effect, options: Any
    ) -> Any:
        @ledger.tool(effect=effect, name="charge", lease=0.2, **options)
        def charge(amount: int) -> str:
            self.runs.append(who)
            return who

        return charge

    def other(self) -> str:
        """The second ledger's call of the intent."""
        with twiceshy.run(self.scope):
            answer: str = self._other(1)
            return answer

    def finish(self) -> None:
        """Let the stalled owner's call end."""
        self.thread.join(10)


@pytest.mark.parametrize("effect", [twiceshy.KEYED, twiceshy.SAFE])
def test_an_owner_past_its_trusted_lease_renews_before_running(effect: twiceshy.Effect) -> None:
    """A claim answered after its lease lapsed, and taken over meanwhile, never runs the work."""
    options = {"record": True} if effect is twiceshy.SAFE else {}
    race = StalledOwner(effect, "run-trust", **options)
    assert race.other() == "other"  # takes the lapsed lease over and runs
    race.finish()
    assert race.runs == ["other"]
    assert race.answers == ["other"]  # the stalled owner renewed, was fenced out, and replayed


def test_an_unsafe_owner_past_its_trusted_lease_still_runs_once() -> None:
    """Nobody else runs an UNSAFE tool: a stalled owner runs it and its outcome settles the doubt.

    The caller that found the lapsed lease meanwhile is told the outcome is unknown; the stalled
    owner takes back its record, which nothing else moved on.
    """
    race = StalledOwner(twiceshy.UNSAFE, "run-trust-3")
    with pytest.raises(twiceshy.OutcomeUnknown):
        race.other()
    race.finish()
    assert race.runs == ["stalled"]
    assert race.answers == ["stalled"]
    assert race.other() == "stalled"  # the late owner's outcome is the intent's


def test_a_stalled_unsafe_owner_whose_intent_a_reconciler_released_does_not_run() -> None:
    """With a reconciler, someone else may run an UNSAFE tool: a stalled owner renews first.

    The caller that found the lapsed lease marked it UNKNOWN, asked the reconciler (nothing
    happened, as was true then), and ran the tool itself; the stalled owner then replays it.
    """
    race = StalledOwner(
        twiceshy.UNSAFE,
        "run-trust-4",
        reconcile=lambda key, args: twiceshy.DidNotHappen(),
        release_grace=0.0,  # no grace for a paused owner: its renewal is what stops it
    )
    assert race.other() == "other"
    race.finish()
    assert race.runs == ["other"]  # it ran beside the other caller's run before the fix
    assert race.answers == ["other"]


@pytest.mark.parametrize("ending", ["returns", "fails for certain", "times out"])
def test_an_owner_whose_record_is_released_under_it_records_its_outcome_and_never_runs_again(
    ending: str,
) -> None:
    """Released while its run finishes (a lapse marked UNKNOWN, then a reconciler), the owner
    claims the intent back and writes what its run did: an UNSAFE tool runs once per call."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[int] = []

    class Declined(Exception):
        """A certain failure of the provider."""

    @ledger.tool(
        effect=twiceshy.UNSAFE,
        definite=(Declined,),
        reconcile=lambda key, args: twiceshy.DidNotHappen(),
    )
    def charge(amount: int) -> str:
        runs.append(amount)
        if len(runs) == 1:
            key = twiceshy.current_key()
            # What a duplicate does once this owner's lease lapsed (a long pause) ...
            lapse = twiceshy.Change(
                fence=1,
                from_states=frozenset({twiceshy.State.CLAIMED}),
                to=twiceshy.State.UNKNOWN,
                reason="lease lapsed",
            )
            assert ledger.store.write("", key, lapse).won
            # ... and what a reconciler then answers, before this run's effect is visible.
            assert charge.twiceshy.settle(key).state is twiceshy.State.RELEASED  # type: ignore[attr-defined]
        if ending == "fails for certain":
            raise Declined("card declined")
        if ending == "times out":
            raise TimeoutError("read timed out")
        return "ch_1"

    expected: Any = {
        "returns": None,
        "fails for certain": Declined,
        "times out": twiceshy.OutcomeUnknown,
    }[ending]
    with twiceshy.run("run-released"):
        if expected is None:
            assert charge(5) == "ch_1"
        else:
            with pytest.raises(expected):
                charge(5)
    assert runs == [5]
    key = twiceshy.idempotency_key("run-released", "charge", {"amount": 5})
    record = ledger.store.get("", key).record
    assert record is not None
    assert (
        record.state
        is {
            "returns": twiceshy.State.SUCCEEDED,
            "fails for certain": twiceshy.State.FAILED,
            "times out": twiceshy.State.UNKNOWN,
        }[ending]
    )
    if ending == "returns":
        with twiceshy.run("run-released"):
            assert charge(5) == "ch_1"  # replayed
        assert runs == [5]


def test_an_owner_within_its_trusted_lease_runs_without_renewing() -> None:
    """A claim answered in time runs at once: one claim and one outcome write, no renewal."""
    writes: list[twiceshy.Change] = []

    class Counting(MemoryStore):
        def write(self, namespace: str, key: str, change: twiceshy.Change) -> twiceshy.Snapshot:
            writes.append(change)
            return super().write(namespace, key, change)

    ledger = twiceshy.Ledger(store=Counting())

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        return amount

    with twiceshy.run("run-trust-2"):
        assert charge(5) == 5
    assert [w.to for w in writes] == [twiceshy.State.SUCCEEDED]


def test_stored_answers_give_the_first_caller_what_every_retry_gets(
    ledger: twiceshy.Ledger,
) -> None:
    """With with_stored_answers(), the call that ran gets the result as stored (a set as a
    sorted list, a naive datetime as text), exactly what a replay gets; without, the live one."""
    when = dt.datetime(2026, 12, 1, 9, 30)  # a naive result, on purpose

    def work() -> dict[str, object]:
        return {"tags": {3, 1, 2}, "when": when}

    plain = ledger.guard("plain", effect=twiceshy.KEYED)
    stored = ledger.guard("stored", effect=twiceshy.KEYED).with_stored_answers()
    with twiceshy.run("run-stored"):
        assert plain.call({}, work) == {"tags": {3, 1, 2}, "when": when}
        first = stored.call({}, work)
        again = stored.call({}, work)
    assert first == again == {"tags": [1, 2, 3], "when": "2026-12-01T09:30:00"}


def test_a_huge_error_message_is_kept_bounded(ledger: twiceshy.Ledger) -> None:
    """A definite failure whose message is megabytes long is stored and replayed cut to its
    first 16,384 characters, saying how much was left out."""

    class Declined(Exception):
        """A certain failure of the provider."""

    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, definite=[Declined])
    def charge(amount: int) -> int:
        runs.append(amount)
        raise Declined("x" * 5_000_000)

    with twiceshy.run("run-huge"):
        with pytest.raises(Declined):
            charge(5)
        with pytest.raises(Declined) as replayed:
            charge(5)
    text = str(replayed.value)
    assert text.startswith("x" * 16_384)
    assert text.endswith("... (4983616 more characters not kept)")
    (record,) = ledger.store.records("")
    assert record.error is not None
    assert len(record.error) < 17_000
    assert runs == [5]


def test_the_version_is_the_installed_packages() -> None:
    """twiceshy.__version__ is read from the package's metadata, not written twice."""
    from importlib import metadata

    assert twiceshy.__version__ == metadata.version("twiceshy")


def test_the_extension_points_are_protocols() -> None:
    """twiceshy.typing offers the store, observer and reconciler Protocols: plain callables and
    objects fit them, and a guard's reconciler and a ledger's observers are typed by them."""
    import typing

    from twiceshy import typing as extension

    for name in ("Store", "AsyncStore", "Observer", "AroundObserver", "Reconciler"):
        assert getattr(extension, name)._is_protocol, name

    def observer(event: twiceshy.CallEvent) -> None:
        return None

    class Tracing:
        def __call__(self, event: twiceshy.CallEvent) -> None:
            return None

        def around(self, tool: str, effect: twiceshy.Effect) -> Any:
            return open(__file__)  # any context manager

    assert isinstance(observer, extension.Observer)
    assert isinstance(Tracing(), extension.AroundObserver)
    assert not isinstance(observer, extension.AroundObserver)
    assert isinstance(twiceshy.Ledger("memory://").store, extension.Store)
    hints = typing.get_type_hints(twiceshy.Ledger.guard)
    assert hints["reconcile"] == extension.Reconciler | None


def test_an_option_left_out_is_its_default_and_none_is_not_a_way_to_leave_it_out() -> None:
    """attempts=, record=, backoff=, release_grace= and url= take their defaults when left out
    (twiceshy.typing.NOT_GIVEN); None there is refused with a TypeError saying so."""
    from twiceshy.typing import NOT_GIVEN

    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    guard = ledger.guard("charge", effect=twiceshy.KEYED, attempts=NOT_GIVEN)
    assert guard.policy.attempts == 3
    assert guard.policy.release_grace == 60.0
    for option in ("attempts", "record", "backoff", "release_grace"):
        with pytest.raises(TypeError, match=f"{option}=.*leave it out for the default"):
            ledger.guard("charge", effect=twiceshy.SAFE, **{option: None})
    with pytest.raises(TypeError, match="leave it out"):
        twiceshy.Ledger(None)  # type: ignore[arg-type]
    assert ledger.guard("g", effect=twiceshy.KEYED, ttl=None).policy.ttl is None  # None: forever
