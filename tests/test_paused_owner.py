"""A lapse is not a crash: an unknown outcome marked when an UNSAFE owner's lease lapsed is not
released while that owner, only paused, may still be taking effect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

import twiceshy
from twiceshy import Effect, State
from twiceshy.stores import Store

if TYPE_CHECKING:
    from conftest import FakeClock


def _paused_owner(ledger: twiceshy.Ledger, guard: twiceshy.Guard, args: dict[str, Any]) -> str:
    """The claim of an owner that stopped inside the tool (SIGSTOP, a long pause)."""
    key = guard.key_for(args, scope="run-1")
    fingerprint = guard.bind(args).identity(None, guard.name)[1]
    snap = ledger.store.claim(
        "",
        key,
        fingerprint=fingerprint,
        tool=guard.name,
        effect=Effect.UNSAFE,
        owner="paused-process",
        lease=30.0,
    )
    assert snap.won
    return key


def test_a_reconciler_cannot_release_a_lapse_within_its_grace(
    store: Store, clock: FakeClock
) -> None:
    """The reconciler finds nothing at the provider yet: within release_grace of the lapse that
    means "cannot tell", and the tool does not run beside the paused owner; past it, it runs."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)
    wires: list[int] = []
    asked: list[str] = []

    def nothing_found(key: str, arguments: object) -> twiceshy.DidNotHappen:
        asked.append(key)
        return twiceshy.DidNotHappen()

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=nothing_found, release_grace=120.0, wait=0.0)
    def wire(amount: int) -> int:
        wires.append(amount)
        return amount

    key = _paused_owner(ledger, wire.twiceshy, {"amount": 100})  # type: ignore[attr-defined]
    clock.advance(31.0)  # the paused owner's lease lapses
    with twiceshy.run("run-1"):
        for _ in range(2):
            with pytest.raises(twiceshy.OutcomeUnknown, match="owner stopped"):
                wire(100)
        assert ledger.store.get("", key).record.state is State.UNKNOWN  # type: ignore[union-attr]
        clock.advance(121.0)  # the owner has had its grace: the reconciler's word stands
        assert wire(100) == 100
    assert wires == [100]
    assert asked == [key, key, key]


def test_an_operator_settling_a_lapse_within_its_grace_leaves_it(
    store: Store, clock: FakeClock
) -> None:
    """Guard.settle (twiceshy reconcile) leaves a fresh lapse unknown; an unknown outcome the
    owner itself recorded (its own timeout) is released at once."""
    ledger = twiceshy.Ledger(store=store, counts_interval=None)

    def nothing_found(key: str, arguments: object) -> twiceshy.DidNotHappen:
        return twiceshy.DidNotHappen()

    guard = ledger.guard("wire", effect=twiceshy.UNSAFE, reconcile=nothing_found, lease=30.0)
    key = _paused_owner(ledger, guard, {"amount": 100})
    clock.advance(31.0)

    def never(*_: object) -> int:
        raise AssertionError("the paused owner's intent ran twice")

    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown):
        ledger.guard("wire", effect=twiceshy.UNSAFE, lease=30.0).call({"amount": 100}, never)
    settled = guard.settle(key)
    assert settled is not None
    assert settled.state is State.UNKNOWN  # within twice the lease of the lapse
    clock.advance(61.0)
    settled = guard.settle(key)
    assert settled is not None
    assert settled.state is State.RELEASED

    def timed_out() -> int:
        raise TimeoutError("the bank did not answer")

    with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown):
        guard.call({"amount": 7}, timed_out)
    own = guard.key_for({"amount": 7}, scope="run-1")
    settled = guard.settle(own)
    assert settled is not None
    assert settled.state is State.RELEASED
