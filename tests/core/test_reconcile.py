"""An UNKNOWN record met by a call whose tool has a reconciler (docs/design.md §3, §4)."""

from __future__ import annotations

import pytest

from twiceshy._protocol import LAPSED, DidNotHappen, Happened, Ran
from twiceshy._records import Change, Effect, Outcome, State
from twiceshy.errors import OutcomeUnknown, ResultNotStorable

from .script import (
    LEASE,
    OTHER,
    OWNER,
    T0,
    Expect,
    Script,
    claim,
    elsewhere,
    note,
    now,
    plan,
    reconcile,
    run,
    states,
    stored,
    wait,
    write,
)

C, S, F, R, U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN
BOTH = [Effect.KEYED, Effect.UNSAFE]


def unknown(effect: Effect, **changes: object) -> Script:
    """A call of a tool with a reconciler (``changes`` to its policy), meeting an UNKNOWN
    record of its key."""
    call = plan(effect, reconcile=True, **changes)
    return Script(call, stored(call, U, reason="TimeoutError: no answer"))


def runs_at(fence: int, value: object) -> list[Expect]:
    """This call takes the intent at ``fence`` + 1, runs it, and records its value."""
    return [
        now(1.0),
        write(C, fence=fence, new_owner=OWNER),
        now(2.0),
        run(Ran(value=value), fence=fence + 1),
        write(S, fence=fence + 1),
    ]


@pytest.mark.parametrize("effect", BOTH)
def test_happened_records_the_result_and_answers_it(effect: Effect) -> None:
    """Happened(result) is recorded SUCCEEDED by the reconciler and answered, noted RECONCILED."""
    script = unknown(effect)
    value = script.play(
        [
            now(),
            claim(),
            reconcile(Happened({"id": 1})),
            write(S, fence=1, from_states=states(U), owner=None, result='{"id":1}', ttl=86_400.0),
            note(Outcome.RECONCILED),
        ]
    )
    assert value == {"id": 1}
    assert not script.runs


def test_happened_with_a_result_that_cannot_be_kept_is_done_all_the_same() -> None:
    """Happened with a result with no JSON form is SUCCEEDED; the call gets ResultNotStorable."""
    script = unknown(Effect.UNSAFE)
    with pytest.raises(ResultNotStorable, match="already ran"):
        script.play(
            [
                now(),
                claim(),
                reconcile(Happened(object())),
                write(S, from_states=states(U)),
                note(Outcome.RECONCILED),
            ]
        )
    assert script.record is not None
    assert script.record.state is S


@pytest.mark.parametrize("effect", BOTH)
def test_did_not_happen_releases_and_the_call_runs_it(effect: Effect) -> None:
    """DidNotHappen releases the intent; the call then takes it at fence + 1 and runs it."""
    script = unknown(effect)
    value = script.play(
        [
            now(0.0),
            claim(),
            reconcile(DidNotHappen()),
            write(R, fence=1, from_states=states(U), owner=None, ttl=86_400.0),
            *runs_at(1, "ran"),
        ]
    )
    assert value == "ran"


@pytest.mark.parametrize(
    ("age", "grace", "releases"),
    [(10.0, 60.0, False), (60.0, 60.0, True), (10.0, 5.0, True)],
    ids=["within-grace", "at-its-end", "a-shorter-grace"],
)
def test_did_not_happen_is_read_as_cannot_tell_within_the_release_grace(
    age: float, grace: float, releases: bool
) -> None:
    """A lapse marked UNKNOWN ``age`` seconds ago is not released within release_grace."""
    call = plan(Effect.UNSAFE, reconcile=True, release_grace=grace)
    script = Script(call, stored(call, U, reason=LAPSED, updated_at=T0 - age))
    opening = [now(0.0), claim(), reconcile(DidNotHappen())]
    if releases:
        assert script.play([*opening, write(R), *runs_at(1, "ran")]) == "ran"
        return
    with pytest.raises(OutcomeUnknown) as raised:
        script.play(opening)
    assert raised.value.reason == LAPSED


@pytest.mark.parametrize("answer", [None, "yes", True, Happened], ids=repr)
def test_any_other_answer_leaves_the_doubt_standing(answer: object) -> None:
    """An answer that is neither Happened() nor DidNotHappen() writes nothing: OutcomeUnknown."""
    script = unknown(Effect.UNSAFE)
    with pytest.raises(OutcomeUnknown):
        script.play([now(), claim(), reconcile(answer)])


def test_a_keyed_doubt_standing_runs_again_with_the_key() -> None:
    """KEYED: when the reconciler cannot tell, the call runs it again at fence + 1."""
    script = unknown(Effect.KEYED)
    assert script.play([now(0.0), claim(), reconcile(None), *runs_at(1, "ran")]) == "ran"


def test_the_reconciler_is_asked_once_per_call() -> None:
    """A call that meets UNKNOWN again (its settlement lost to a rerun that failed) asks no more."""
    script = unknown(Effect.KEYED)
    rerun = Change(fence=1, from_states=states(U), to=C, new_owner=OTHER, lease=LEASE)
    again = Change(fence=2, from_states=states(C), to=U, owner=OTHER, reason="TimeoutError")
    value = script.play(
        [
            now(0.0),
            claim(),
            reconcile(DidNotHappen()),
            elsewhere(rerun),
            write(R, won=False),
            now(0.0),
            elsewhere(again),
            wait(10.0, fence=2, elapsed=1.0),
            *runs_at(2, "third time"),
        ]
    )
    assert value == "third time"
