"""The pure pieces around the protocol: the table, its writes, settling, giving a claim back."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from twiceshy._codec import NotKept, encode_error
from twiceshy._protocol import (
    LAPSED,
    MAX_STEPS,
    DidNotHappen,
    Happened,
    _change,
    abandoned,
    renewal,
    settle,
)
from twiceshy._records import Change, Effect, Record, Snapshot, State, new_claim
from twiceshy._rules import TRANSITIONS, Actor
from twiceshy.errors import StoreError

from .script import (
    LEASE,
    OTHER,
    OWNER,
    T0,
    Script,
    Step,
    claim,
    elsewhere,
    now,
    plan,
    states,
    stored,
    write,
)

C, S, F, R, U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN
KEYED = plan(Effect.KEYED)


def test_a_settled_outcome_is_left_only_by_expiring() -> None:
    """No transition leaves SUCCEEDED or FAILED, and nothing writes a record back to none."""
    assert not [edge for edge in TRANSITIONS if edge[0] in (S, F)]
    assert not [edge for edge in TRANSITIONS if edge[1] is None]


def test_an_unknown_outcome_is_settled_only_by_a_reconciler_or_its_owner() -> None:
    """UNKNOWN reaches a final state only by a reconciler or that fence's owner, never a caller."""
    for final in (S, F, R):
        assert TRANSITIONS[(U, final)] == {Actor.RECONCILER, Actor.OWNER}
    assert TRANSITIONS[(U, C)] == {Actor.CALLER, Actor.OWNER}


@pytest.mark.parametrize(
    ("actor", "state", "to"),
    [
        (Actor.CALLER, S, C),
        (Actor.CALLER, C, S),
        (Actor.RECONCILER, R, S),
        (Actor.OWNER, F, R),
        (Actor.RECONCILER, C, U),
    ],
)
def test_a_write_the_table_does_not_allow_is_refused_when_built(
    actor: Actor, state: State, to: State
) -> None:
    """A write the table does not allow for its actor is never built: AssertionError."""
    with pytest.raises(AssertionError, match="may not move a record"):
        _change(actor, stored(KEYED, state), to)


def test_a_write_is_guarded_on_its_record_fence_and_state() -> None:
    """A built write names the record's fence and its state (and any extra states allowed)."""
    change = _change(Actor.OWNER, stored(KEYED, C, fence=4), S, also_from=states(U), owner=OWNER)
    assert (change.fence, change.from_states, change.owner) == (4, states(C, U), OWNER)


@pytest.mark.parametrize(("take_back", "sources"), [(False, states(C)), (True, states(C, U))])
def test_a_renewal_moves_the_owners_lease_at_its_fence(
    take_back: bool, sources: frozenset[State]
) -> None:
    """A renewal is the owner's CLAIMED write at its fence; taking back, also from UNKNOWN."""
    change = renewal(3, OWNER, 30.0, take_back=take_back)
    assert change == Change(fence=3, from_states=sources, to=C, owner=OWNER, lease=30.0)


def lapse_marked(age: float) -> Record:
    """An UNKNOWN record marked at a lapse ``age`` seconds before T0."""
    return stored(KEYED, U, reason=LAPSED, updated_at=T0 - age)


@pytest.mark.parametrize(
    ("record", "answer", "to"),
    [
        (stored(KEYED, U, reason="TimeoutError"), Happened([1]), S),
        (stored(KEYED, U, reason="TimeoutError"), DidNotHappen(), R),
        (stored(KEYED, U, reason="TimeoutError"), None, None),
        (stored(KEYED, U, reason="TimeoutError"), "it did", None),
        (lapse_marked(10.0), Happened([1]), S),
        (lapse_marked(10.0), DidNotHappen(), None),
        (lapse_marked(10.0), None, None),
        (lapse_marked(60.0), DidNotHappen(), R),
    ],
    ids=[
        "happened",
        "did-not-happen",
        "cannot-tell",
        "anything-else",
        "lapse-happened",
        "lapse-in-grace",
        "lapse-cannot-tell",
        "lapse-past-grace",
    ],
)
def test_settle_writes_what_the_reconciler_knew(
    record: Record, answer: object, to: State | None
) -> None:
    """settle records Happened as SUCCEEDED, DidNotHappen as RELEASED (past a lapse's grace)."""
    change = settle(KEYED.policy, record, answer, T0)
    if to is None:
        assert change is None
        return
    assert change is not None
    result = "[1]" if to is S else None
    assert change == Change(
        fence=1, from_states=states(U), to=to, result=result, ttl=KEYED.policy.ttl
    )


def test_settle_records_a_result_that_cannot_be_kept_as_done() -> None:
    """A Happened result with no JSON form is SUCCEEDED all the same, marked not kept."""
    change = settle(KEYED.policy, stored(KEYED, U), Happened(object()), T0)
    assert change is not None
    assert change.to is S
    assert change.result is not None
    with pytest.raises(NotKept):
        KEYED.policy.codec.decode(change.result)


@pytest.mark.parametrize("state", [S, F, R])
@pytest.mark.parametrize("answer", [Happened(1), DidNotHappen()], ids=["happened", "not"])
def test_settle_never_builds_a_write_over_a_settled_record(state: State, answer: object) -> None:
    """A settled record is not resettled: the table refuses the write as it is built."""
    with pytest.raises(AssertionError):
        settle(KEYED.policy, stored(KEYED, state), answer, T0)


def owned(**fields: Any) -> Record:
    """This call's own CLAIMED record at fence 2."""
    record = new_claim(
        KEYED.namespace,
        KEYED.key,
        fingerprint=KEYED.fingerprint,
        tool=KEYED.policy.tool,
        effect=Effect.KEYED,
        owner=OWNER,
        lease=LEASE,
        now=T0,
        fence=2,
    )
    return dataclasses.replace(record, **fields)


@pytest.mark.parametrize(
    ("snap", "ran", "to"),
    [
        (Snapshot(owned(), T0, won=True), False, R),
        (Snapshot(owned(), T0, won=True), True, U),
        (Snapshot(owned(), T0, won=False), True, None),
        (Snapshot(owned(owner=OTHER), T0, won=True), True, None),
        (Snapshot(None, T0, won=True), True, None),
        *[(Snapshot(owned(state=state), T0, won=True), True, None) for state in (S, F, R, U)],
    ],
    ids=[
        "never-ran",
        "ran",
        "not-won",
        "another-owner",
        "no-record",
        "succeeded",
        "failed",
        "released",
        "unknown",
    ],
)
def test_abandoned_gives_back_only_a_claim_this_call_holds(
    snap: Snapshot, ran: bool, to: State | None
) -> None:
    """A claim this call won and holds CLAIMED is given back: RELEASED, or UNKNOWN once it ran."""
    why = KeyboardInterrupt()
    change = abandoned(KEYED, snap, ran, why)
    if to is None:
        assert change is None
        return
    assert change is not None
    assert (change.fence, change.from_states, change.to, change.owner) == (2, states(C), to, OWNER)
    if to is U:
        assert change.reason == "interrupted by KeyboardInterrupt before its outcome was recorded"
        assert change.error == encode_error(why)
    else:
        assert change.ttl == KEYED.policy.ttl


def test_a_ledger_that_never_settles_is_a_store_error() -> None:
    """A call whose every take is lost to another caller gives up after MAX_STEPS rounds."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, R))
    steps: list[Step] = [now(), claim()]
    for fence in range(1, MAX_STEPS + 1):
        steps += [
            elsewhere(Change(fence, states(R), C, new_owner=OTHER, lease=LEASE)),
            elsewhere(Change(fence + 1, states(C), R, owner=OTHER)),
            now(),
            write(C, fence=fence, won=False),
        ]
    with pytest.raises(StoreError, match=f"no settled answer for key {call.key} in {MAX_STEPS}"):
        script.play(steps)
    assert not script.runs
