"""What a call does with each answer its claim can get (docs/design.md §3, §8)."""

from __future__ import annotations

from typing import Any

import pytest

from twiceshy._codec import encode_error
from twiceshy._protocol import LAPSED, Ran, protect
from twiceshy._records import Change, Effect, Outcome, Snapshot, State
from twiceshy.errors import InProgress, KeyReuseMismatch, OutcomeUnknown, ReplayedError

from .script import (
    OTHER,
    OWNER,
    T0,
    TRUST,
    Declined,
    Script,
    claim,
    elsewhere,
    note,
    now,
    plan,
    run,
    states,
    stored,
    wait,
    write,
)

C, S, F, R, U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN
RECORDED = [Effect.SAFE, Effect.KEYED, Effect.UNSAFE]


class CardDeclined(Declined):
    """A subclass of a listed definite type, not listed itself."""


class Unlisted(Exception):
    """A failure type no policy lists."""


class Fussy(Declined):
    """A listed type that cannot be rebuilt from a message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)


def finished(owner: str, fence: int, text: str) -> Change:
    """Another owner's write of its result (JSON ``text``)."""
    return Change(fence=fence, from_states=states(C), to=S, owner=owner, result=text)


@pytest.mark.parametrize("effect", RECORDED)
def test_a_first_call_claims_runs_once_and_records_its_value(effect: Effect) -> None:
    """A first call claims, runs the tool once under fence 1, records SUCCEEDED, returns it."""
    call = plan(effect)
    script = Script(call)
    value = script.play(
        [
            now(0.0),
            claim(),
            now(1.0),
            run(Ran(value={"id": 7}), fence=1, attempt=1, trusted_until=TRUST),
            write(
                S,
                fence=1,
                from_states=states(C, U),
                owner=OWNER,
                result=call.policy.codec.encode({"id": 7}),
                ttl=86_400.0,
            ),
        ]
    )
    assert value == {"id": 7}
    assert script.record is not None
    assert script.record.state is S
    assert script.record.expires_at == T0 + 86_400.0


@pytest.mark.parametrize("result", [{"id": 7}, 0, "", [], None, False])
def test_a_succeeded_record_is_replayed_and_noted(result: object) -> None:
    """A SUCCEEDED record answers with its result as stored, noted REPLAYED; nothing runs."""
    call = plan(Effect.UNSAFE)
    text = call.policy.codec.encode(result)
    script = Script(call, stored(call, S, result=text))
    assert script.play([now(), claim(), note(Outcome.REPLAYED)]) == result


def test_a_kept_record_answers_with_no_claim() -> None:
    """A settled record this process kept stands in for the claim: no store command at all."""
    call = plan(Effect.KEYED)
    record = stored(call, S, result='"sent"')
    script = Script(call, record)
    value = script.play([note(Outcome.REPLAYED)], protect(call, Snapshot(record, T0)))
    assert value == "sent"


@pytest.mark.parametrize(
    ("error", "listed", "replayed"),
    [
        (Declined("card declined"), None, Declined),
        (CardDeclined("card declined"), Declined, Declined),
        (Unlisted("card declined"), None, ReplayedError),
        (Fussy(7, "card declined"), Fussy, ReplayedError),
    ],
    ids=["listed", "as-its-listed-base", "unlisted", "not-rebuildable"],
)
def test_a_failed_record_replays_its_error(
    error: Exception, listed: type[BaseException] | None, replayed: type[Exception]
) -> None:
    """FAILED replays the error as its listed type where it can be rebuilt, else ReplayedError."""
    call = plan(Effect.UNSAFE, definite=(Declined, Fussy))
    script = Script(call, stored(call, F, error=encode_error(error, listed)))
    with pytest.raises(replayed, match="card declined") as raised:
        script.play([now(), claim(), note(Outcome.REPLAYED)])
    assert type(raised.value) is replayed
    if replayed is ReplayedError:
        assert isinstance(raised.value, ReplayedError)
        assert raised.value.type_name.endswith(type(error).__qualname__)


@pytest.mark.parametrize("effect", RECORDED)
def test_a_released_record_is_taken_at_the_next_fence(effect: Effect) -> None:
    """RELEASED is claimed again at fence + 1 by a new owner, and the tool runs under it."""
    call = plan(effect)
    script = Script(call, stored(call, R, fence=3))
    value = script.play(
        [
            now(0.0),
            claim(),
            now(1.0),
            write(C, fence=3, from_states=states(R), new_owner=OWNER, lease=30.0, lapsed=False),
            now(2.0),
            run(Ran(value="ok"), fence=4, attempt=1, trusted_until=1.0 + TRUST),
            write(S, fence=4),
        ]
    )
    assert value == "ok"


@pytest.mark.parametrize(
    ("effect", "then"),
    [
        (Effect.KEYED, "resumes it with the same idempotency key"),
        (Effect.UNSAFE, "its outcome becomes unknown and it is not run again by itself"),
        (Effect.SAFE, "the next identical call runs it again"),
    ],
)
def test_a_live_claim_is_waited_for_then_in_progress(effect: Effect, then: str) -> None:
    """A live claim is waited for up to wait= (10 s), then InProgress with the record's facts."""
    call = plan(effect)
    script = Script(call, stored(call, C, fence=2))
    with pytest.raises(InProgress) as raised:
        script.play(
            [
                now(0.0),
                claim(),
                now(5.0),
                wait(10.0, fence=2, elapsed=10.0),
                now(15.0),
            ]
        )
    error = raised.value
    assert (error.started_at, error.lapses_at) == (T0 - 60.0, T0 + 20.0)
    assert (error.effect, error.resumed, error.here) == (effect.value, True, False)
    text = str(error)
    assert "started at 2023-11-14 22:12:20 UTC, was taken up again since," in text
    assert "If it records none by 2023-11-14 22:13:40 UTC, " in text
    assert then in text
    assert not script.runs


def test_a_wait_is_bounded_by_the_lease_and_a_lapse_is_taken_over() -> None:
    """A wait lasts no longer than the lease (and 5 ms); a KEYED lapse then is taken over."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, C, lease_deadline=T0 + 3.0))
    value = script.play(
        [
            now(0.0),
            claim(),
            now(0.0),
            wait(3.0 + 0.005, fence=1, elapsed=3.0 + 0.005),
            now(3.0),
            write(C, fence=1, lapsed=True, new_owner=OWNER),
            now(3.0),
            run(Ran(value="mine"), fence=2),
            write(S, fence=2),
        ]
    )
    assert value == "mine"


def test_the_calls_own_wait_until_is_kept() -> None:
    """A call whose wait= was spent (on a flight here) gets InProgress at once, with no Wait."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, C))
    with pytest.raises(InProgress):
        script.play([now(), claim(), now(5.0)], protect(call, wait_until=5.0))


def test_a_waiter_replays_the_outcome_it_waited_for() -> None:
    """A waiter woken by the owner's write answers with its outcome, noted WAITED."""
    call = plan(Effect.UNSAFE)
    script = Script(call, stored(call, C))
    value = script.play(
        [
            now(0.0),
            claim(),
            now(0.0),
            elsewhere(finished(OTHER, 1, '"theirs"')),
            wait(10.0, elapsed=2.0),
            note(Outcome.WAITED),
        ]
    )
    assert value == "theirs"


def test_an_expired_record_is_claimed_afresh() -> None:
    """A record gone past its retention between two commands is claimed again, at fence + 1."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, C))
    gone = Change(fence=1, from_states=states(C), to=S, owner=OTHER, result="1", ttl=1.0)
    value = script.play(
        [
            now(0.0),
            claim(),
            now(0.0),
            elsewhere(gone),
            wait(10.0, elapsed=5.0),
            now(5.0),
            claim(),
            now(5.0),
            run(Ran(value=2), fence=2),
            write(S, fence=2),
        ]
    )
    assert value == 2


def test_an_unsafe_lapse_is_marked_unknown_and_never_run() -> None:
    """An UNSAFE claim that lapsed is marked UNKNOWN (LAPSED); the call gets OutcomeUnknown."""
    call = plan(Effect.UNSAFE)
    script = Script(call, stored(call, C, lease_deadline=T0))
    with pytest.raises(OutcomeUnknown) as raised:
        script.play(
            [
                now(),
                claim(),
                write(U, fence=1, from_states=states(C), lapsed=True, reason=LAPSED, error=None),
            ]
        )
    assert raised.value.reason == LAPSED
    assert script.record is not None
    assert (script.record.state, script.record.reason) == (U, LAPSED)
    assert not script.runs


def test_an_unsafe_lapse_mark_refused_follows_the_owners_outcome() -> None:
    """When the owner records before the lapse mark lands, the call replays the owner's result."""
    call = plan(Effect.UNSAFE)
    script = Script(call, stored(call, C, lease_deadline=T0))
    value = script.play(
        [
            now(),
            claim(),
            elsewhere(finished(OTHER, 1, '"late"')),
            write(U, won=False),
            note(Outcome.REPLAYED),
        ]
    )
    assert value == "late"


@pytest.mark.parametrize("effect", [Effect.KEYED, Effect.SAFE])
def test_a_lapsed_claim_of_a_retryable_tool_is_taken_over(effect: Effect) -> None:
    """A KEYED or recorded SAFE claim that lapsed is taken over at fence + 1, and runs."""
    call = plan(effect)
    script = Script(call, stored(call, C, lease_deadline=T0 - 1.0))
    value = script.play(
        [
            now(0.0),
            claim(),
            now(1.0),
            write(C, fence=1, from_states=states(C), lapsed=True, new_owner=OWNER, lease=30.0),
            now(2.0),
            run(Ran(value="again"), fence=2, attempt=1, trusted_until=1.0 + TRUST),
            write(S, fence=2, owner=OWNER),
        ]
    )
    assert value == "again"
    assert script.record is not None
    assert script.record.attempts == 2


def test_an_unsafe_unknown_record_answers_outcome_unknown() -> None:
    """UNSAFE UNKNOWN with no reconciler is OutcomeUnknown with the record's reason; no run."""
    call = plan(Effect.UNSAFE)
    script = Script(call, stored(call, U, reason="TimeoutError: no answer"))
    with pytest.raises(OutcomeUnknown, match="It will not be run again") as raised:
        script.play([now(), claim()])
    assert raised.value.reason == "TimeoutError: no answer"


@pytest.mark.parametrize("effect", [Effect.KEYED, Effect.SAFE])
def test_an_unknown_record_of_a_retryable_tool_runs_again_at_the_next_fence(
    effect: Effect,
) -> None:
    """KEYED (or recorded SAFE) UNKNOWN is claimed at fence + 1 and run again with its key."""
    call = plan(effect)
    script = Script(call, stored(call, U, reason="TimeoutError: no answer"))
    value = script.play(
        [
            now(0.0),
            claim(),
            now(0.0),
            write(C, fence=1, from_states=states(U), new_owner=OWNER, lapsed=False),
            now(0.0),
            run(Ran(value="done"), fence=2),
            write(S, fence=2),
        ]
    )
    assert value == "done"


@pytest.mark.parametrize(
    ("state", "fields"),
    [
        (C, {}),
        (S, {"result": "1"}),
        (F, {"error": encode_error(Declined("no"))}),
        (R, {}),
        (U, {"reason": "TimeoutError"}),
    ],
    ids=lambda value: value.value if isinstance(value, State) else "",
)
def test_a_key_with_other_arguments_is_refused_in_every_state(
    state: State, fields: dict[str, Any]
) -> None:
    """A record of the key with other arguments is KeyReuseMismatch: nothing runs, nothing noted."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, state, fingerprint="00" * 32, **fields))
    with pytest.raises(KeyReuseMismatch, match="did not run"):
        script.play([now(), claim()])


def test_a_waiter_that_outlives_an_unsafe_lease_marks_it_unknown() -> None:
    """A wait ends at the lease's lapse; an UNSAFE claim is then marked UNKNOWN, never run."""
    call = plan(Effect.UNSAFE)
    script = Script(call, stored(call, C, lease_deadline=T0 + 4.0))
    with pytest.raises(OutcomeUnknown):
        script.play(
            [
                now(0.0),
                claim(),
                now(0.0),
                wait(4.0 + 0.005, elapsed=4.0 + 0.005),
                write(U, lapsed=True, reason=LAPSED),
            ]
        )
    assert not script.runs
