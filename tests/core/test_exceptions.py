"""How a call reads each exception of its tool, and what it records (docs/design.md §4)."""

from __future__ import annotations

from asyncio import CancelledError

import pytest

from twiceshy._codec import encode_error
from twiceshy._protocol import EXHAUSTED, Ran, exhausted
from twiceshy._records import Change, Effect, Outcome, State
from twiceshy.errors import NotApplied, OutcomeUnknown

from .script import (
    LEASE,
    OTHER,
    OWNER,
    TRUST,
    Declined,
    Expect,
    Script,
    claim,
    elsewhere,
    note,
    now,
    plan,
    run,
    sleep,
    states,
    tick,
    wait,
    write,
)

C, S, F, R, U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN
RECORDED = [Effect.SAFE, Effect.KEYED, Effect.UNSAFE]


class CardDeclined(Declined):
    """A definite failure by its listed base."""


class Refused(Exception):
    """A type a policy lists as ``not_applied=``."""


#: How a call starts as the owner of fence 1: its claim at 0, the run's clock at 1.
OWNED: list[Expect] = [now(0.0), claim(), now(1.0)]


def released() -> Expect:
    """The owner's write of "nothing happened"."""
    return write(R, fence=1, from_states=states(C, U), owner=OWNER, ttl=86_400.0)


def renewed(at: float) -> list[Expect]:
    """The renewal that counts an in-place attempt, sent at monotonic ``at``."""
    return [
        now(at),
        write(C, fence=1, from_states=states(C), owner=OWNER, lease=LEASE, count_attempt=True),
    ]


@pytest.mark.parametrize("effect", RECORDED)
@pytest.mark.parametrize("error", [NotApplied("nothing was sent"), Refused("not sent")])
def test_nothing_happened_releases_the_intent_and_raises(effect: Effect, error: Exception) -> None:
    """NotApplied (or a not_applied= type) is RELEASED at once and raised as it is."""
    script = Script(plan(effect, not_applied=(Refused,)))
    with pytest.raises(type(error)) as raised:
        script.play([*OWNED, run(Ran(error=error)), released()])
    assert raised.value is error
    assert script.record is not None
    assert script.record.state is R


@pytest.mark.parametrize("effect", RECORDED)
@pytest.mark.parametrize("error", [TimeoutError("no answer"), Declined("declined")])
def test_any_error_before_the_point_of_no_return_releases(effect: Effect, error: Exception) -> None:
    """With effect_at=, an error raised before the mark is "nothing happened", definite or not."""
    script = Script(plan(effect, effect_at="mark"))
    with pytest.raises(type(error)) as raised:
        script.play([*OWNED, run(Ran(error=error, marked=False)), released()])
    assert raised.value is error


def test_an_error_after_the_mark_is_read_as_it_is() -> None:
    """With effect_at=, an error raised past the mark is read by its type: ambiguous here."""
    script = Script(plan(Effect.UNSAFE, effect_at="mark"))
    with pytest.raises(OutcomeUnknown):
        script.play([*OWNED, run(Ran(error=TimeoutError("t"), marked=True)), write(U)])


def test_an_earlier_attempt_past_the_mark_keeps_a_later_one_from_releasing() -> None:
    """Once an attempt passed its mark, a later attempt's error before it is no "not applied"."""
    script = Script(plan(Effect.KEYED, effect_at="mark", attempts=2))
    late = TimeoutError("second")
    with pytest.raises(TimeoutError) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=TimeoutError("first"), marked=True), attempt=1),
                sleep(0.1),
                *renewed(2.0),
                run(Ran(error=late, marked=False), attempt=2),
                write(U, reason="TimeoutError: second"),
            ]
        )
    assert raised.value is late
    assert exhausted(late)


class ReadTimeout(Exception):
    """An HTTP client's error, as its module names it."""


ReadTimeout.__module__ = "httpx"


def _caused_by_os_error() -> ValueError:
    error = ValueError("parsing the reply")
    error.__cause__ = ConnectionResetError("reset by peer")
    return error


@pytest.mark.parametrize(
    "error",
    [ConnectionError("refused"), ReadTimeout("slow"), _caused_by_os_error()],
    ids=["os-error", "http-client-error", "caused-by-os-error"],
)
def test_a_network_error_of_an_http_tool_went_out(error: Exception) -> None:
    """With effect_at="http", an unmarked network error (or one caused by it) may have gone out."""
    script = Script(plan(Effect.UNSAFE, effect_at="http"))
    with pytest.raises(OutcomeUnknown):
        script.play([*OWNED, run(Ran(error=error, marked=False)), write(U)])


def test_an_other_unmarked_error_of_an_http_tool_did_not_go_out() -> None:
    """With effect_at="http", an unmarked error that is no network error released the intent."""
    script = Script(plan(Effect.UNSAFE, effect_at="http"))
    with pytest.raises(KeyError):
        script.play([*OWNED, run(Ran(error=KeyError("amount"), marked=False)), released()])


@pytest.mark.parametrize("effect", RECORDED)
@pytest.mark.parametrize("error", [Declined("no funds"), CardDeclined("no funds")])
def test_a_definite_error_is_recorded_failed_and_raised(effect: Effect, error: Exception) -> None:
    """A definite= error is FAILED (with the listed type it matched) and raised as it is."""
    script = Script(plan(effect))
    with pytest.raises(Declined) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=error)),
                write(
                    F,
                    from_states=states(C, U),
                    owner=OWNER,
                    error=encode_error(error, Declined),
                    ttl=86_400.0,
                ),
            ]
        )
    assert raised.value is error


def test_an_ambiguous_error_of_an_unsafe_tool_is_unknown() -> None:
    """UNSAFE: an ambiguous error is recorded UNKNOWN with its reason; OutcomeUnknown, from it."""
    script = Script(plan(Effect.UNSAFE))
    error = TimeoutError("provider timed out")
    with pytest.raises(OutcomeUnknown) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=error)),
                write(
                    U,
                    fence=1,
                    from_states=states(C),
                    owner=OWNER,
                    reason="TimeoutError: provider timed out",
                    error=encode_error(error),
                    ttl=None,
                ),
            ]
        )
    assert raised.value.__cause__ is error
    assert raised.value.reason == "TimeoutError: provider timed out"


def test_an_ambiguous_error_of_a_keyed_tool_is_retried_in_place() -> None:
    """KEYED: an ambiguous error sleeps, renews the lease counting the attempt, runs again."""
    script = Script(plan(Effect.KEYED))
    value = script.play(
        [
            *OWNED,
            run(Ran(error=TimeoutError("t1")), fence=1, attempt=1, trusted_until=TRUST),
            sleep(0.1),
            *renewed(2.0),
            run(Ran(error=TimeoutError("t2")), fence=1, attempt=2, trusted_until=2.0 + TRUST),
            sleep(0.2),
            *renewed(3.0),
            run(Ran(value="ok"), fence=1, attempt=3, trusted_until=3.0 + TRUST),
            write(S, fence=1),
        ]
    )
    assert value == "ok"
    assert script.record is not None
    assert script.record.attempts == 3


def test_a_keyed_tool_out_of_attempts_is_unknown_and_its_error_says_so() -> None:
    """KEYED out of attempts: UNKNOWN with the last error's reason; it is raised, noted."""
    script = Script(plan(Effect.KEYED, attempts=2))
    last = TimeoutError("t2")
    with pytest.raises(TimeoutError) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=TimeoutError("t1")), attempt=1),
                sleep(0.1),
                *renewed(2.0),
                run(Ran(error=last), attempt=2),
                write(
                    U,
                    from_states=states(C),
                    owner=OWNER,
                    reason="TimeoutError: t2",
                    error=encode_error(last),
                ),
            ]
        )
    assert raised.value is last
    (said,) = last.__notes__
    assert said.startswith(EXHAUSTED)
    assert "(2 in all)" in said
    assert "the same idempotency key" in said


def test_a_recorded_safe_tool_out_of_attempts_is_released() -> None:
    """A recorded SAFE tool out of attempts leaves its intent RELEASED; its error is raised."""
    script = Script(plan(Effect.SAFE, attempts=1))
    error = TimeoutError("t")
    with pytest.raises(TimeoutError) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=error)),
                write(R, from_states=states(C), owner=OWNER, ttl=86_400.0),
            ]
        )
    assert raised.value is error
    assert not exhausted(error)


@pytest.mark.parametrize("effect", RECORDED)
@pytest.mark.parametrize(
    ("interruption", "name"),
    [(KeyboardInterrupt(), "KeyboardInterrupt"), (CancelledError("task 7"), "CancelledError")],
)
def test_an_interrupted_run_is_recorded_unknown_then_goes_on(
    effect: Effect, interruption: BaseException, name: str
) -> None:
    """An interruption of the work is recorded UNKNOWN (it may have acted), then raised on."""
    script = Script(plan(effect))
    with pytest.raises(type(interruption)) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=interruption)),
                write(
                    U,
                    from_states=states(C),
                    owner=OWNER,
                    reason=f"interrupted by {name} before it finished",
                    error=encode_error(interruption),
                ),
            ]
        )
    assert raised.value is interruption


def test_an_interruption_before_the_mark_releases_then_goes_on() -> None:
    """An interruption before the point of no return is RELEASED, then raised on."""
    script = Script(plan(Effect.UNSAFE, effect_at="mark"))
    with pytest.raises(KeyboardInterrupt):
        script.play([*OWNED, run(Ran(error=KeyboardInterrupt(), marked=False)), released()])


def test_an_interruption_goes_on_whatever_its_write_answers() -> None:
    """An interruption is raised even when its UNKNOWN write was refused."""
    call = plan(Effect.KEYED)
    script = Script(call)
    takeover = Change(
        fence=1, from_states=states(C), to=C, lapsed=True, new_owner=OTHER, lease=LEASE
    )
    with pytest.raises(KeyboardInterrupt):
        script.play(
            [
                *OWNED,
                run(Ran(error=KeyboardInterrupt())),
                tick(LEASE),
                elsewhere(takeover),
                write(U, won=False),
            ]
        )


def test_an_interrupted_sleep_between_attempts_is_recorded_unknown() -> None:
    """Interrupted between attempts, the last one's doubt is recorded, then raised on."""
    script = Script(plan(Effect.KEYED))
    error, interruption = TimeoutError("t1"), KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as raised:
        script.play(
            [
                *OWNED,
                run(Ran(error=error)),
                sleep(0.1, interrupted=interruption),
                write(
                    U,
                    owner=OWNER,
                    reason="interrupted by KeyboardInterrupt after TimeoutError: t1",
                    error=encode_error(error),
                ),
            ]
        )
    assert raised.value is interruption


def test_a_keyed_owner_fenced_out_between_attempts_does_not_run_again() -> None:
    """A renewal refused between attempts (taken over) ends this call's runs: it follows."""
    script = Script(plan(Effect.KEYED))
    takeover = Change(
        fence=1, from_states=states(C), to=C, lapsed=True, new_owner=OTHER, lease=LEASE
    )
    theirs = Change(fence=2, from_states=states(C), to=S, owner=OTHER, result='"theirs"')
    value = script.play(
        [
            *OWNED,
            run(Ran(error=TimeoutError("t1"))),
            sleep(0.1),
            now(2.0),
            tick(LEASE),
            elsewhere(takeover),
            write(C, count_attempt=True, won=False),
            now(3.0),
            elsewhere(theirs),
            wait(10.0, fence=2, elapsed=1.0),
            note(Outcome.WAITED),
        ]
    )
    assert value == "theirs"
    assert len(script.runs) == 1
