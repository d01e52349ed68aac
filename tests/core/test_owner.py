"""An owner's hold on its record: the trust in its lease, and a write the record refused.

An owner trusts its lease for half of it, from when its claim was sent; past that it renews
before the work starts. A write the record refuses raises nothing: the call follows the record's
real outcome, and should it own the intent again, it records its own run's outcome rather than
running the work a second time (docs/design.md §3).
"""

from __future__ import annotations

import pytest

from twiceshy._codec import encode_error
from twiceshy._protocol import LAPSED, Actor, Ran
from twiceshy._records import Change, Effect, Outcome, State
from twiceshy.errors import NotApplied, OutcomeUnknown

from .script import (
    LEASE,
    OTHER,
    OWNER,
    TRUST,
    Declined,
    Expect,
    Meanwhile,
    Script,
    claim,
    elsewhere,
    note,
    now,
    plan,
    run,
    states,
    tick,
    wait,
    write,
)

C, S, F, R, U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN
RECORDED = [Effect.SAFE, Effect.KEYED, Effect.UNSAFE]

#: How a call starts as the owner of fence 1: its claim at 0, the run's clock at 1.
OWNED: list[Expect] = [now(0.0), claim(), now(1.0)]

#: The lease of fence 1 lapses, and an operator releases the intent (`resolve --force`).
OPERATOR_RELEASES: list[Meanwhile] = [
    tick(LEASE),
    elsewhere(
        Change(fence=1, from_states=states(C), to=R, lapsed=True, ttl=60.0), by=Actor.RECONCILER
    ),
]

#: The lease of fence 1 lapses, and another caller takes it over at fence 2.
TAKEN_OVER: list[Meanwhile] = [
    tick(LEASE),
    elsewhere(
        Change(fence=1, from_states=states(C), to=C, lapsed=True, new_owner=OTHER, lease=LEASE)
    ),
]


def retaken() -> list[Expect]:
    """This call takes the released intent at fence 2."""
    return [now(2.0), write(C, fence=1, from_states=states(R), new_owner=OWNER)]


@pytest.mark.parametrize("effect", RECORDED)
@pytest.mark.parametrize(("at", "renews"), [(TRUST - 0.5, False), (TRUST, True)])
def test_an_owner_past_its_trust_renews_before_the_work(
    effect: Effect, at: float, renews: bool
) -> None:
    """An owner whose claim came back at or past half its lease renews it before running."""
    script = Script(plan(effect))
    # An UNSAFE owner's renewal also takes back its record a lapse marked UNKNOWN.
    sources = states(C, U) if effect is Effect.UNSAFE else states(C)
    renewal = [
        now(at),
        write(C, fence=1, from_states=sources, owner=OWNER, lease=LEASE, count_attempt=False),
    ]
    value = script.play(
        [
            now(0.0),
            claim(),
            now(at),
            *(renewal if renews else []),
            run(Ran(value=1), fence=1, attempt=1, trusted_until=at + TRUST if renews else TRUST),
            write(S),
        ]
    )
    assert value == 1


def test_an_owner_whose_late_renewal_is_refused_never_runs() -> None:
    """A KEYED owner past its trust whose lease was taken over runs nothing: it waits."""
    script = Script(plan(Effect.KEYED))
    theirs = Change(fence=2, from_states=states(C), to=S, owner=OTHER, result='"theirs"')
    value = script.play(
        [
            now(0.0),
            claim(),
            now(TRUST),
            *TAKEN_OVER,
            now(TRUST),
            write(C, from_states=states(C), owner=OWNER, won=False),
            now(TRUST),
            elsewhere(theirs),
            wait(10.0, fence=2, elapsed=1.0),
            note(Outcome.WAITED),
        ]
    )
    assert value == "theirs"
    assert not script.runs


def test_an_unsafe_owner_takes_back_its_record_marked_unknown_at_a_lapse() -> None:
    """An UNSAFE owner answered late takes back, at its own fence, the UNKNOWN its lapse left."""
    script = Script(plan(Effect.UNSAFE))
    marked = Change(fence=1, from_states=states(C), to=U, lapsed=True, reason=LAPSED)
    value = script.play(
        [
            now(0.0),
            claim(),
            now(TRUST + 20.0),
            tick(LEASE),
            elsewhere(marked),
            now(TRUST + 20.0),
            write(C, fence=1, from_states=states(C, U), owner=OWNER, lease=LEASE),
            run(Ran(value="sent"), fence=1, trusted_until=TRUST + 20.0 + TRUST),
            write(S, fence=1, from_states=states(C, U), owner=OWNER),
        ]
    )
    assert value == "sent"


def test_an_outcome_refused_after_a_takeover_follows_the_newer_owner() -> None:
    """An owner whose SUCCEEDED write is refused (taken over) answers the newer owner's outcome."""
    script = Script(plan(Effect.KEYED))
    theirs = Change(fence=2, from_states=states(C), to=S, owner=OTHER, result='"theirs"')
    value = script.play(
        [
            *OWNED,
            run(Ran(value="mine")),
            *TAKEN_OVER,
            elsewhere(theirs),
            write(S, won=False),
            note(Outcome.REPLAYED),
        ]
    )
    assert value == "theirs"


@pytest.mark.parametrize("effect", RECORDED)
def test_a_refused_result_is_recorded_when_the_intent_is_owned_again(effect: Effect) -> None:
    """An owner whose result write was refused (released) retakes the intent and records its
    result under the new fence: it never runs the work a second time."""
    call = plan(effect)
    script = Script(call)
    value = script.play(
        [
            *OWNED,
            run(Ran(value="mine")),
            *OPERATOR_RELEASES,
            write(S, won=False),
            *retaken(),
            write(
                S,
                fence=2,
                from_states=states(C),
                owner=OWNER,
                result=call.policy.codec.encode("mine"),
                ttl=86_400.0,
            ),
        ]
    )
    assert value == "mine"
    assert len(script.runs) == 1


def test_a_refused_failure_is_recorded_when_the_intent_is_owned_again() -> None:
    """A definite failure whose write was refused is recorded FAILED under the new fence, and
    raised; the work does not run again."""
    script = Script(plan(Effect.KEYED))
    error = Declined("no funds")
    with pytest.raises(Declined) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=error)),
                *OPERATOR_RELEASES,
                write(F, won=False),
                *retaken(),
                write(F, fence=2, owner=OWNER, error=encode_error(error, Declined)),
            ]
        )
    assert raised.value is error
    assert len(script.runs) == 1


def test_a_refused_doubt_is_recorded_when_the_intent_is_owned_again() -> None:
    """An UNSAFE doubt whose write was refused is recorded UNKNOWN under the new fence:
    OutcomeUnknown, raised from the tool's error; the work does not run again."""
    script = Script(plan(Effect.UNSAFE))
    error = TimeoutError("no answer")
    with pytest.raises(OutcomeUnknown) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=error)),
                *OPERATOR_RELEASES,
                write(U, won=False),
                *retaken(),
                write(
                    U,
                    fence=2,
                    owner=OWNER,
                    reason="TimeoutError: no answer",
                    error=encode_error(error),
                    ttl=None,
                ),
            ]
        )
    assert raised.value.__cause__ is error
    assert len(script.runs) == 1


def test_a_refused_release_may_run_again() -> None:
    """A "nothing happened" whose write was refused keeps nothing: retaken, the work runs."""
    script = Script(plan(Effect.KEYED))
    value = script.play(
        [
            *OWNED,
            run(Ran(error=NotApplied("not sent")), fence=1),
            *OPERATOR_RELEASES,
            write(R, won=False),
            *retaken(),
            now(3.0),
            run(Ran(value="sent"), fence=2, attempt=1),
            write(S, fence=2),
        ]
    )
    assert value == "sent"
