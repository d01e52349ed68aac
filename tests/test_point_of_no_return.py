"""``twiceshy.point_of_no_return()``: an error before a tool's effect starts is not an unknown
outcome (DESIGN.md §4), and the effect never starts without the lease."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest

import twiceshy
from twiceshy import Change, State
from twiceshy.stores import Store
from twiceshy.stores.memory import MemoryStore

if TYPE_CHECKING:
    from conftest import FakeClock


@pytest.fixture
def ledger(store: Store) -> twiceshy.Ledger:
    return twiceshy.Ledger(store=store, counts_interval=None)


def _only(ledger: twiceshy.Ledger) -> twiceshy.Record:
    (record,) = ledger.store.records("")
    return record


def _lapse(store: Store, clock: FakeClock, to: State, **fields: Any) -> None:
    """The store sees the only record's lease lapse, and another caller moves it to ``to``."""
    (record,) = store.records("")
    clock.advance(1.0)
    change = Change(
        fence=record.fence, from_states=frozenset({State.CLAIMED}), to=to, lapsed=True, **fields
    )
    store.write("", record.key, change)


def test_an_error_before_the_point_releases_the_intent(ledger: twiceshy.Ledger) -> None:
    """A NameError raised before point_of_no_return() means nothing happened: the intent is
    released, the caller gets the error, and the next call runs the fax once."""
    sent: list[str] = []
    broken = [True]

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_fax(number: str) -> str:
        if broken[0]:
            raise NameError("name 'render' is not defined")
        twiceshy.point_of_no_return()
        sent.append(number)
        return "sent"

    with twiceshy.run("run-1"):
        with pytest.raises(NameError):
            send_fax("555-0100")
        assert _only(ledger).state is State.RELEASED
        broken[0] = False  # the bug is fixed
        assert send_fax("555-0100") == "sent"
        assert send_fax("555-0100") == "sent"  # replayed
    assert sent == ["555-0100"]


def test_an_error_after_the_point_stays_unknown(ledger: twiceshy.Ledger) -> None:
    """Past the point the effect may have happened: OutcomeUnknown, never run again, and the
    message says how an operator clears it."""
    sent: list[str] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_fax(number: str) -> str:
        twiceshy.point_of_no_return()
        sent.append(number)
        raise TimeoutError("the fax line went quiet")

    with twiceshy.run("run-2"):
        for _ in range(2):
            with pytest.raises(twiceshy.OutcomeUnknown) as unknown:
                send_fax("555-0100")
    text = str(unknown.value)
    assert "may or may not have taken effect" in text
    assert f"twiceshy resolve {unknown.value.key[:16]} --released" in text
    assert sent == ["555-0100"]
    assert _only(ledger).state is State.UNKNOWN


def test_an_async_tool_is_released_before_its_point(ledger: twiceshy.Ledger) -> None:
    """The same for an async tool: released before the point, run once after the fix."""
    sent: list[str] = []
    broken = [True]

    @ledger.tool(effect=twiceshy.UNSAFE)
    async def send_fax(number: str) -> str:
        await asyncio.sleep(0)
        if broken[0]:
            raise KeyError("template")
        twiceshy.point_of_no_return()
        sent.append(number)
        return "sent"

    async def main() -> None:
        with twiceshy.run("run-3"):
            with pytest.raises(KeyError):
                await send_fax("555-0100")
            broken[0] = False
            assert await send_fax("555-0100") == "sent"
            assert await send_fax("555-0100") == "sent"

    asyncio.run(main())
    assert sent == ["555-0100"]


def test_a_keyed_tool_is_not_retried_in_place_for_an_error_before_its_point(
    ledger: twiceshy.Ledger,
) -> None:
    """Nothing happened, so there is no doubt to retry away: the error is the caller's at once,
    and the next call runs the tool again."""
    attempts: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, attempts=3, backoff=lambda n: 0.0)
    def charge(amount: int) -> int:
        attempts.append(amount)
        if len(attempts) == 1:
            raise ValueError("amount out of range")
        twiceshy.point_of_no_return()
        return amount

    with twiceshy.run("run-4"):
        with pytest.raises(ValueError, match="out of range"):
            charge(5)
        assert charge(5) == 5
    assert attempts == [5, 5]


def test_only_a_tool_that_says_where_its_effect_starts_is_released(
    ledger: twiceshy.Ledger,
) -> None:
    """Without point_of_no_return() in its code (or effect_at="mark"), an error stays
    ambiguous; a helper that calls it counts once the tool declares effect_at="mark"."""
    sent: list[str] = []

    def point() -> None:
        twiceshy.point_of_no_return()

    @ledger.tool(effect=twiceshy.UNSAFE)
    def silent(number: str) -> str:
        raise NameError("render")

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="mark")
    def through_helper(number: str) -> str:
        if not sent:
            sent.append("failed")
            raise NameError("render")
        point()
        sent.append(number)
        return "sent"

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at=None)
    def declared_unsaid(number: str) -> str:
        twiceshy.point_of_no_return()
        raise NameError("render")

    assert silent.twiceshy.policy.effect_at is None  # type: ignore[attr-defined]
    assert declared_unsaid.twiceshy.policy.effect_at is None  # type: ignore[attr-defined]
    with twiceshy.run("run-5"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            silent("1")
        with pytest.raises(NameError):
            through_helper("2")
        assert through_helper("2") == "sent"
        with pytest.raises(twiceshy.OutcomeUnknown):
            declared_unsaid("3")
    assert sent == ["failed", "2"]


def test_an_interruption_before_the_point_releases(ledger: twiceshy.Ledger) -> None:
    """Ctrl-C before the effect started: released, so the next call runs instead of being told
    the outcome is unknown."""
    sent: list[str] = []
    stop = [True]

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_fax(number: str) -> str:
        if stop[0]:
            stop[0] = False
            raise KeyboardInterrupt
        twiceshy.point_of_no_return()
        sent.append(number)
        return "sent"

    with twiceshy.run("run-6"):
        with pytest.raises(KeyboardInterrupt):
            send_fax("555-0100")
        assert _only(ledger).state is State.RELEASED
        assert send_fax("555-0100") == "sent"
    assert sent == ["555-0100"]


def test_outside_a_protected_call_it_does_nothing() -> None:
    """A tool called directly (a unit test of the tool itself) passes the point."""
    twiceshy.point_of_no_return()


def test_the_effect_never_starts_once_the_lease_was_taken_over(clock: FakeClock) -> None:
    """The owner paused past its lease and a KEYED retry took it over: point_of_no_return()
    refuses (FencedOut), the paused owner's effect does not start, and its call answers the
    intent as it now stands."""
    store = MemoryStore(clock=clock)
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    effects: list[int] = []
    refused: list[BaseException] = []

    @ledger.tool(effect=twiceshy.KEYED, lease=0.2, wait=0.0, attempts=1)
    def charge(amount: int) -> int:
        _lapse(store, clock, State.CLAIMED, new_owner="another-process", lease=30.0)  # taken over
        time.sleep(0.3)  # past this owner's own trust in its lease
        try:
            twiceshy.point_of_no_return()
        except twiceshy.FencedOut as exc:
            refused.append(exc)
            raise
        effects.append(amount)
        return amount

    with twiceshy.run("run-7"), pytest.raises(twiceshy.InProgress):
        charge(4900)
    assert effects == []
    assert len(refused) == 1
    assert "no longer holds its lease" in str(refused[0])
    record = _only(ledger)
    assert (record.state, record.fence, record.owner) == (State.CLAIMED, 2, "another-process")


def test_an_unsafe_owner_takes_back_a_lapse_marked_unknown_at_its_own_fence(
    clock: FakeClock,
) -> None:
    """Paused past its lease, an UNSAFE owner finds its own fence marked UNKNOWN by a duplicate:
    nobody else ran it, so the point takes the record back and the effect happens once."""
    store = MemoryStore(clock=clock)
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    effects: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, lease=0.2)
    def wire(amount: int) -> int:
        reason = "the call's owner stopped without recording an outcome"
        _lapse(store, clock, State.UNKNOWN, reason=reason)  # a duplicate marks it UNKNOWN
        time.sleep(0.3)
        twiceshy.point_of_no_return()
        effects.append(amount)
        return amount

    with twiceshy.run("run-8"):
        assert wire(100) == 100
        assert wire(100) == 100
    assert effects == [100]
    assert _only(ledger).state is State.SUCCEEDED


def test_a_thread_left_behind_by_an_ended_attempt_cannot_start_the_effect(
    ledger: twiceshy.Ledger,
) -> None:
    """A tool gave up on a worker thread (its own timeout) before the point: the intent is
    released and run again; the worker, woken later, is refused at the point (FencedOut)."""
    sent: list[str] = []
    refused: list[BaseException] = []
    go = threading.Event()
    workers: list[threading.Thread] = []

    def send(number: str) -> None:
        go.wait(5)
        try:
            twiceshy.point_of_no_return()
        except twiceshy.FencedOut as exc:
            refused.append(exc)
            return
        sent.append(number)

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="mark")
    def send_fax(number: str) -> str:
        if not workers:
            worker = threading.Thread(target=contextvars.copy_context().run, args=(send, number))
            workers.append(worker)
            worker.start()
            raise TimeoutError("the worker did not answer in time")  # before the point
        twiceshy.point_of_no_return()
        sent.append(number)
        return "sent"

    with twiceshy.run("run-9"):
        with pytest.raises(TimeoutError):
            send_fax("555-0100")
        assert send_fax("555-0100") == "sent"
    go.set()
    workers[0].join(5)
    assert sent == ["555-0100"]
    assert len(refused) == 1


def test_an_attempt_past_the_point_keeps_a_later_one_from_releasing(
    ledger: twiceshy.Ledger,
) -> None:
    """A KEYED tool whose first attempt passed its point and timed out, and whose second failed
    before it: the intent may have taken effect, so it is unknown (next call: same key), never
    released, and the caller's error says so."""
    attempts: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED, attempts=2, backoff=lambda n: 0.0)
    def charge(amount: int) -> int:
        attempts.append(amount)
        assert twiceshy.current_key()  # handed to the provider, which deduplicates by it
        if len(attempts) == 1:
            twiceshy.point_of_no_return()
            raise TimeoutError("the provider did not answer")
        raise ConnectionRefusedError("the token endpoint is down")  # before the point

    with twiceshy.run("run-10"), pytest.raises(ConnectionRefusedError) as last:
        charge(5)
    assert _only(ledger).state is State.UNKNOWN
    assert "it may have taken effect" in " ".join(last.value.__notes__)
    assert attempts == [5, 5]


def test_an_http_tool_whose_client_skips_the_transport_is_not_released_on_a_network_error(
    ledger: twiceshy.Ledger,
) -> None:
    """Declared effect_at="http" but calling through a client without twiceshy's transport, a
    network error (the request may have left) reads as after the point; a plain bug before any
    request still releases."""
    failures: list[BaseException] = [ConnectionResetError("peer reset"), NameError("payload")]

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="http")
    def post(order: str) -> str:
        raise failures.pop(0)

    with twiceshy.run("run-11"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            post("o-1")
        with pytest.raises(NameError):
            post("o-2")
    states = {r.state for r in ledger.store.records("")}
    assert states == {State.UNKNOWN, State.RELEASED}


def test_an_unsafe_tool_left_unknown_by_its_own_error_logs_the_way_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning for an UNSAFE tool whose error (a validation error, before any effect) left
    the intent unknown names point_of_no_return(); a tool that marks its effect gets no such
    advice, and neither does a lease that lapsed."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_fax(number: str) -> str:
        raise ValueError(f"not a fax number: {number!r}")

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_mail(to: str) -> str:
        twiceshy.point_of_no_return()
        raise TimeoutError("the mail server did not answer")

    with twiceshy.run("run-advice"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            send_fax("12")
        advice = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(advice) == 1
        assert "send_fax unknown" in advice[0]
        assert "call twiceshy.point_of_no_return() in it where its effect starts" in advice[0]
        caplog.clear()
        with pytest.raises(twiceshy.OutcomeUnknown):
            send_mail("ann@example.com")
    (marked,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "send_mail unknown" in marked
    assert "point_of_no_return" not in marked
