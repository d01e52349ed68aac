"""Runs started inside a protected call inherit a scope derived from its key (DESIGN.md §2):
the same outer intent names the same inner intents, and different outer intents never share
one."""

from __future__ import annotations

import asyncio

import pytest

import twiceshy
from twiceshy.stores import Store


@pytest.fixture
def ledger(store: Store) -> twiceshy.Ledger:
    return twiceshy.Ledger(store=store, counts_interval=None)


def test_two_outer_intents_never_share_an_inner_one(ledger: twiceshy.Ledger) -> None:
    """Under one run, booking Paris and booking Rome each charge: the same inner arguments name
    two intents, one inside each outer intent."""
    charges: list[str] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(amount: int) -> str:
        charges.append(twiceshy.current_scope() or "")
        return f"ch_{len(charges)}"

    @ledger.tool(effect=twiceshy.KEYED)
    def book_trip(destination: str) -> str:
        return charge(4900)

    with twiceshy.run("run-2"):
        assert book_trip("Paris") == "ch_1"
        assert book_trip("Rome") == "ch_2"
        assert book_trip("Paris") == "ch_1"  # replayed: nothing runs
    assert len(charges) == 2
    paris = book_trip.twiceshy.key_for({"destination": "Paris"}, scope="run-2")  # type: ignore[attr-defined]
    assert twiceshy.idempotency_key(paris, "charge", {"amount": 4900}) in {
        r.key for r in ledger.store.records("")
    }


def test_the_inherited_scope_is_the_outer_key(ledger: twiceshy.Ledger) -> None:
    """Inside a protected call, current_scope() and inherited_scope() are derived from its key;
    outside one, inherited_scope() is None."""
    seen: list[tuple[str | None, str | None, str | None]] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def outer(x: int) -> None:
        seen.append((twiceshy.current_scope(), twiceshy.inherited_scope(), twiceshy.current_key()))

    with twiceshy.run("run-3"):
        assert twiceshy.inherited_scope() is None
        outer(1)
        assert twiceshy.current_scope() == "run-3"
    ((scope, inherited, key),) = seen
    assert scope == inherited == key == twiceshy.idempotency_key("run-3", "outer", {"x": 1})


def test_a_scope_the_application_gives_inside_the_tool_wins(ledger: twiceshy.Ledger) -> None:
    """twiceshy.run(...) entered inside the tool names the nested runs' scope instead, and so
    does an inner tool's scope= function."""
    scopes: list[str | None] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def inner(x: int) -> int:
        return x

    @ledger.tool(effect=twiceshy.KEYED, scope=lambda args: f"order-{args['order']}")
    def by_order(order: int) -> int:
        return order

    @ledger.tool(effect=twiceshy.KEYED)
    def outer(x: int) -> None:
        with twiceshy.run("chosen"):
            scopes.append(twiceshy.inherited_scope())
            inner(x)
        by_order(7)

    with twiceshy.run("run-4"):
        outer(1)
    keys = {r.key for r in ledger.store.records("")}
    assert twiceshy.idempotency_key("chosen", "inner", {"x": 1}) in keys
    assert twiceshy.idempotency_key("order-7", "by_order", {"order": 7}) in keys
    assert scopes == [None]


def test_async_sub_tasks_inherit_the_scope(ledger: twiceshy.Ledger) -> None:
    """A sub-agent's calls made in tasks it starts name intents inside the outer one, and the
    outer call's retry in place finds them done."""
    charges: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    async def charge(amount: int) -> int:
        charges.append(amount)
        return amount

    @ledger.tool(effect=twiceshy.KEYED, attempts=2, backoff=lambda n: 0.0)
    async def delegate(task: str) -> int:
        results = await asyncio.gather(charge(1), charge(2))
        if len(charges) <= 2:
            raise ConnectionError("the answer was lost")
        return sum(results)

    async def main() -> None:
        with twiceshy.run("run-5"), pytest.raises(ConnectionError):
            await delegate("pay both")

    asyncio.run(main())
    assert sorted(charges) == [1, 2]
    outer = delegate.twiceshy.key_for({"task": "pay both"}, scope="run-5")  # type: ignore[attr-defined]
    keys = {r.key for r in ledger.store.records("")}
    assert {twiceshy.idempotency_key(outer, "charge", {"amount": n}) for n in (1, 2)} <= keys


def test_a_safe_call_kept_out_of_the_ledger_passes_a_nested_scope_on(
    ledger: twiceshy.Ledger,
) -> None:
    """A delegating tool declared SAFE (kept out of the ledger) still gives the runs inside it
    a scope derived from its intent: two delegations with other arguments charge twice, the same
    one retried charges once."""
    charges: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(amount: int) -> int:
        charges.append(amount)
        return amount

    @ledger.tool(effect=twiceshy.SAFE)
    def delegate(order: str) -> int:
        return charge(4900)

    @ledger.tool(effect=twiceshy.SAFE)
    async def adelegate(order: str) -> int:
        return charge(100)

    with twiceshy.run("run-6"):
        assert delegate("o-1") == delegate("o-1") == 4900
        assert delegate("o-2") == 4900
        assert asyncio.run(adelegate("o-3")) == asyncio.run(adelegate("o-3")) == 100
    assert charges == [4900, 4900, 100]
    outer = twiceshy.idempotency_key("run-6", "delegate", {"order": "o-1"})
    assert twiceshy.idempotency_key(outer, "charge", {"amount": 4900}) in {
        r.key for r in ledger.store.records("")
    }
