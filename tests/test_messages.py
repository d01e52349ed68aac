"""What a caller, and the model behind it, reads: each message says what is known and never
invites a blind retry (DESIGN.md §4)."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import pytest

import twiceshy
from twiceshy import Effect
from twiceshy._protocol import describe
from twiceshy.stores import Store
from twiceshy.stores.memory import MemoryStore

if TYPE_CHECKING:
    from conftest import FakeClock


@pytest.fixture
def ledger(store: Store) -> twiceshy.Ledger:
    return twiceshy.Ledger(store=store, counts_interval=None)


def _claim_elsewhere(
    ledger: twiceshy.Ledger, tool: str, effect: Effect, args: dict[str, int]
) -> str:
    """The record a process killed inside its lease leaves: claimed, and never finished."""
    guard = ledger.guard(tool, effect=effect)
    key = guard.key_for(args, scope="run-1")
    fingerprint = guard.bind(args).identity(None, tool)[1]
    snap = ledger.store.claim(
        "", key, fingerprint=fingerprint, tool=tool, effect=effect, owner="killed", lease=30.0
    )
    assert snap.won
    return key


@pytest.mark.parametrize(
    ("effect", "then"),
    [
        (twiceshy.KEYED, "the next identical call resumes it with the same idempotency key"),
        (twiceshy.UNSAFE, "its outcome becomes unknown and it is not run again by itself"),
    ],
)
def test_a_claim_left_by_a_killed_process_is_not_called_running(
    ledger: twiceshy.Ledger, clock: FakeClock, effect: Effect, then: str
) -> None:
    """Inside the lease of a killed owner, InProgress says when the call started, that it may
    have stopped, and what happens when the lease lapses, never "still running"."""
    _claim_elsewhere(ledger, "charge", effect, {"amount": 5})
    effects: list[int] = []

    @ledger.tool(effect=effect, wait=0.0)
    def charge(amount: int) -> int:
        effects.append(amount)
        return amount

    with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress) as waited:
        charge(5)
    text = " ".join(str(waited.value).split())
    assert "started at 2023-11-14 22:13:20 UTC and has not recorded an outcome" in text
    assert "it may still be running, or the process running it may have stopped" in text
    assert f"If it records none by 2023-11-14 22:13:50 UTC, {then}" in text
    assert "This call did not start it a second time" in text
    assert "still running" not in text
    assert "try again" not in text.lower()
    assert effects == []


@pytest.mark.parametrize("here", [False, True], ids=["in-the-ledger", "in-this-process"])
def test_in_progress_inside_an_engine_says_its_retries_end_and_promises_no_call(
    here: bool,
) -> None:
    """Worded for a durable engine's unit that no later call will follow (a DBOS step),
    InProgress says what ends there and that the action needs checking, and promises neither a
    next call nor what a lapse brings."""
    error = twiceshy.InProgress(
        "charge",
        "k" * 64,
        started_at=1_700_000_000.0,
        lapses_at=1_700_000_030.0,
        effect="keyed",
        here=here,
        ends="DBOS does not run this step again",
        resumable=False,
    )
    text = " ".join(str(error).split())
    assert (
        "This call did not start it a second time, and DBOS does not run this step again." in text
    )
    assert "next identical call" not in text
    assert "If it records none by" not in text
    assert "try again" not in text.lower()
    if not here:
        assert "Nothing will take it up by itself" in text
        assert "needs to be checked (reference kkkkkkkkkkkkkkkk)" in text


def test_in_progress_inside_an_engine_that_may_call_again_says_what_a_lapse_brings() -> None:
    """Worded for a unit whose engine stops retrying but may run the intent again (a Prefect
    flow run retried, a Temporal activity run again), InProgress says both."""
    error = twiceshy.InProgress(
        "charge",
        "k" * 64,
        started_at=1_700_000_000.0,
        lapses_at=1_700_000_030.0,
        effect="unsafe",
        ends="Temporal does not retry this activity",
    )
    text = " ".join(str(error).split())
    assert "did not start it a second time, and Temporal does not retry this activity." in text
    assert "If it records none by 2023-11-14 22:13:50 UTC, its outcome becomes unknown" in text
    assert text.endswith("has not been confirmed (reference kkkkkkkkkkkkkkkk).")


def test_a_call_joined_in_this_process_is_still_running() -> None:
    """A duplicate that joined a call running in this process knows that it runs."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    started, release = threading.Event(), threading.Event()

    @ledger.tool(effect=twiceshy.UNSAFE, wait=0.05)
    def wire(amount: int) -> int:
        started.set()
        release.wait(5)
        return amount

    def first() -> None:
        with twiceshy.run("run-1"):
            wire(5)

    leader = threading.Thread(target=first)
    leader.start()
    started.wait(5)
    try:
        with twiceshy.run("run-1"), pytest.raises(twiceshy.InProgress) as joined:
            wire(5)
    finally:
        release.set()
        leader.join(5)
    assert "is still running" in str(joined.value)
    assert joined.value.here


def test_an_unknown_outcome_says_how_an_operator_clears_it(ledger: twiceshy.Ledger) -> None:
    """OutcomeUnknown names the resolve command with the key's reference."""

    @ledger.tool(effect=twiceshy.UNSAFE)
    def wire(amount: int) -> int:
        raise TimeoutError("the bank did not answer")

    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown) as unknown:
        wire(5)
    text = str(unknown.value)
    assert "(TimeoutError: the bank did not answer)" in text
    assert f"`twiceshy resolve {unknown.value.key[:16]} --released`" in text
    assert "--succeeded" in text


class _Timeout(TimeoutError):
    """A private subclass, as an adapter's own wrapper may be."""


class Wrapper(Exception):
    """A framework's exception that carries the tool's own error as its cause."""


def test_descriptions_name_the_users_own_error_briefly() -> None:
    """A private class reads as its public base, a wrapper as its cause, a cancellation without
    the event loop's task repr, and a long message is cut short."""
    assert describe(_Timeout("charge outlasted 5s")) == "TimeoutError: charge outlasted 5s"
    wrapped = Wrapper("Retry: the tool failed")
    wrapped.__cause__ = KeyError("card")
    assert describe(wrapped, (Wrapper,)) == "KeyError: 'card'"
    assert describe(wrapped) == "Wrapper: Retry: the tool failed"
    cancelled = asyncio.CancelledError("Cancelled via cancel scope 7f by <Task " + "x" * 500)
    assert describe(cancelled) == "CancelledError"  # the loop's words, not the user's
    long = describe(RuntimeError("the gateway said: " + "x" * 500))
    assert long.startswith("RuntimeError: the gateway said: xxx")
    assert long.endswith("...")
    assert len(long) == len("RuntimeError: ") + 200


def test_a_reason_names_the_cause_of_a_declared_wrapper() -> None:
    """With wrappers= on the guard, the unknown outcome's reason quotes the tool's own error."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    guard = ledger.guard("wire", effect=twiceshy.UNSAFE).with_errors(wrappers=(Wrapper,))

    def work() -> None:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as own:
            raise Wrapper("ToolRetryError: please retry") from own

    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown) as unknown:
        guard.call({"amount": 5}, work)
    assert "(ConnectionResetError: peer reset)" in str(unknown.value)
    assert "Retry" not in str(unknown.value)


def test_a_keyed_tool_out_of_attempts_says_so_on_its_error(clock: FakeClock) -> None:
    """The caller gets the tool's last error, noted: it may have taken effect, and the next call
    runs it with the same key."""
    ledger = twiceshy.Ledger(store=MemoryStore(clock=clock), counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED, attempts=2, backoff=lambda n: 0.0)
    def charge(amount: int) -> int:
        assert twiceshy.current_key()  # handed to the provider, which deduplicates by it
        raise TimeoutError("the provider did not answer")

    with twiceshy.run("run-1"), pytest.raises(TimeoutError) as last:
        charge(5)
    (note,) = last.value.__notes__
    assert "no attempt of this KEYED tool finished (2 in all)" in note
    assert "it may have taken effect" in note
    assert "same idempotency key" in note
