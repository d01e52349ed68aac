"""twiceshy never multiplies an effect, even when a tool is declared wrongly (docs/design.md §4).

A KEYED tool that never hands its key on is not retried in place, and its doubt is an UNSAFE
one's; a generator function is refused as a tool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

import twiceshy
from twiceshy import State
from twiceshy.integrations import httpx as tx
from twiceshy.stores import Store
from twiceshy.testing import AnswerLost, FakeProvider


def no_backoff(attempt: int) -> float:
    """Retry at once."""
    return 0.0


def test_a_keyed_tool_that_never_hands_its_key_on_runs_once_and_answers_unknown(
    store: Store,
) -> None:
    """Answers lost after the charge: one charge, not one per attempt, and every later call is
    told the outcome is unknown instead of charging again."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=5)
    ledger = twiceshy.Ledger(store=store, counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff)
    def charge(amount: int, customer: str) -> str:
        return str(provider.charge(amount, customer)["id"])  # no idempotency key

    with twiceshy.run("run-blind"):
        with pytest.raises(twiceshy.OutcomeUnknown) as first:
            charge(4900, "cus_1")
        with pytest.raises(twiceshy.OutcomeUnknown) as again:
            charge(4900, "cus_1")
    assert len(provider.effects) == 1
    assert len(provider.requests) == 1
    assert "idempotency key was not handed to the provider" in str(first.value)
    assert "Do not call it again" in str(again.value)
    (record,) = store.records("")
    assert record.state is State.UNKNOWN
    assert isinstance(first.value.__cause__, AnswerLost)


def test_a_keyed_tool_handing_its_key_on_is_retried_with_it() -> None:
    """The same tool handing current_key() to its provider is retried in place, and the
    provider applies the charge once."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=2)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff)
    def charge(amount: int, customer: str) -> str:
        key = twiceshy.current_key()
        return str(provider.charge(amount, customer, idempotency_key=key)["id"])

    with twiceshy.run("run-handed"):
        assert charge(4900, "cus_1") == "ch_1"
    assert len(provider.requests) == 3
    assert len(provider.effects) == 1


def test_a_key_parameter_hands_the_key_on() -> None:
    """A tool given its key through its idempotency_key parameter is retried with it."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=1)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff)
    def charge(amount: int, idempotency_key: str | None = None) -> str:
        return str(provider.charge(amount, "cus_1", idempotency_key=idempotency_key)["id"])

    with twiceshy.run("run-param"):
        assert charge(4900) == "ch_1"
    assert len(provider.requests) == 2
    assert len(provider.effects) == 1


def test_a_request_through_a_key_transport_hands_the_key_on() -> None:
    """A tool whose request left through twiceshy's transport (which set the key header) is
    retried in place: the provider recognises the repeat."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=1)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    with provider.serve() as base:
        client = httpx.Client(base_url=base, transport=tx.IdempotencyKeyTransport())

        @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff)
        def charge(amount: int) -> str:
            answer = client.post("/v1/charges", json={"amount": amount, "customer": "cus_1"})
            return str(answer.json()["id"])

        with twiceshy.run("run-http"):
            assert charge(4900) == "ch_1"
        client.close()
    assert len(provider.requests) == 2
    assert len(provider.effects) == 1


def test_an_interrupted_keyed_tool_that_never_handed_its_key_is_not_run_again(
    store: Store,
) -> None:
    """Ctrl-C in a KEYED tool that sent its charge without the key: the next call is told the
    outcome is unknown, and nothing charges twice."""
    provider = FakeProvider(deduplicate=True)
    ledger = twiceshy.Ledger(store=store, counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> str:
        made = provider.charge(amount, "cus_1")
        if len(provider.effects) == 1:
            raise KeyboardInterrupt
        return str(made["id"])

    with twiceshy.run("run-ctrl-c"):
        with pytest.raises(KeyboardInterrupt):
            charge(4900)
        with pytest.raises(twiceshy.OutcomeUnknown):
            charge(4900)
    assert len(provider.effects) == 1


def test_a_blind_keyed_doubt_asks_the_reconciler_first() -> None:
    """A reconciler that finds the charge settles the blind doubt: the retry gets its result."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=1)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    def find(key: str, args: dict[str, object]) -> twiceshy.Happened | None:
        found = [r for r in provider.effects if r.fields.get("amount") == args["amount"]]
        return twiceshy.Happened(f"ch_{len(found)}") if found else None

    @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff, reconcile=find)
    def charge(amount: int) -> str:
        return str(provider.charge(amount, "cus_1")["id"])

    with twiceshy.run("run-reconciled"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            charge(4900)
        assert charge(4900) == "ch_1"
    assert len(provider.effects) == 1


def test_a_keyed_tool_whose_code_never_mentions_its_key_warns_when_declared(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning names the tool and the fix; a tool that reads its key, takes a key
    parameter or sends through a transport (effect_at="http") is not warned about."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    with caplog.at_level(logging.WARNING, logger="twiceshy"):

        @ledger.tool(effect=twiceshy.KEYED)
        def blind(amount: int) -> int:
            return amount

        @ledger.tool(effect=twiceshy.KEYED)
        def reads(amount: int) -> str:
            return f"{amount}:{twiceshy.current_key()}"

        @ledger.tool(effect=twiceshy.KEYED)
        def takes(amount: int, idempotency_key: str = "") -> str:
            return idempotency_key

        @ledger.tool(effect=twiceshy.KEYED, effect_at="http")
        def sends(amount: int) -> int:
            return amount

        @ledger.tool(effect=twiceshy.UNSAFE)
        def unsafe(amount: int) -> int:
            return amount

    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert "'blind' is declared KEYED" in warned[0]
    assert "twiceshy.current_key()" in warned[0]


def _charges() -> Iterator[int]:
    yield 1


async def _async_charges() -> AsyncIterator[int]:
    yield 1


@pytest.mark.parametrize("function", [_charges, _async_charges], ids=["sync", "async"])
@pytest.mark.parametrize(
    "options",
    [
        {"effect": twiceshy.KEYED},
        {"effect": twiceshy.UNSAFE},
        {"effect": twiceshy.SAFE, "record": True},
    ],
    ids=["keyed", "unsafe", "safe-recorded"],
)
def test_a_generator_function_is_refused_as_a_recorded_tool(
    function: object, options: dict[str, object]
) -> None:
    """Declaring one fails at once, saying what to do."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    with pytest.raises(TypeError, match=r"generator function.*Return a list"):
        ledger.tool(**options)(function)  # type: ignore[arg-type]


def test_a_safe_generator_kept_out_of_the_ledger_is_left_alone() -> None:
    """A SAFE tool that is not recorded may stream: nothing is recorded before its items."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    def search(query):  # type: ignore[no-untyped-def]  # unannotated: nothing to keep
        yield query

    assert list(ledger.tool(effect=twiceshy.SAFE)(search)("x")) == ["x"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_guard_whose_work_answers_a_generator_releases_the_intent(
    asynchronous: bool,
) -> None:
    """Through a guard (as adapters call it), work that answers a generator ran nothing: the
    caller gets a TypeError saying so, the intent is released, and no effect happened."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    guard = ledger.guard("charge", effect=twiceshy.UNSAFE)
    effects: list[int] = []

    def charges() -> Iterator[int]:
        effects.append(1)
        yield 1

    async def acharges() -> AsyncIterator[int]:
        effects.append(1)
        yield 1

    async def work() -> object:
        return acharges()

    with twiceshy.run("run-gen"):
        if asynchronous:
            with pytest.raises(TypeError, match="returned a generator"):
                asyncio.run(guard.acall({"amount": 1}, work))
        else:
            with pytest.raises(TypeError, match="returned a generator"):
                guard.call({"amount": 1}, charges)
    assert effects == []
    assert [r.state for r in ledger.store.records("")] == [State.RELEASED]
