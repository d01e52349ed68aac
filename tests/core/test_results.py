"""What the first caller and its retries get for a result (docs/design.md §4, §5)."""

from __future__ import annotations

import pytest

from twiceshy._codec import NotKept, ResultCodec
from twiceshy._protocol import Ran
from twiceshy._records import Effect, Outcome, State
from twiceshy.errors import ResultNotStorable

from .script import KEY, Script, claim, note, now, plan, run, stored, write

C, S = State.CLAIMED, State.SUCCEEDED


class Receipt:
    """A result with no JSON form."""

    def __str__(self) -> str:
        return "receipt 42"


@pytest.mark.parametrize("answer_stored", [False, True])
@pytest.mark.parametrize(
    ("value", "codec"),
    [(Receipt(), ResultCodec()), ("x" * 50, ResultCodec(max_bytes=10))],
    ids=["no-json-form", "too-large"],
)
def test_a_result_that_cannot_be_kept_is_done_and_the_first_caller_gets_it(
    value: object, codec: ResultCodec, answer_stored: bool
) -> None:
    """A result that cannot be kept is SUCCEEDED, marked not kept; the first caller gets it."""
    script = Script(plan(Effect.KEYED, codec=codec, answer_stored=answer_stored))
    got = script.play([now(), claim(), now(), run(Ran(value=value)), write(S)])
    assert got is value
    text = script.changes[-1].result
    assert text is not None
    with pytest.raises(NotKept) as kept:
        codec.decode(text)
    assert kept.value.text == str(value)[:1000]


def test_a_retry_of_a_result_not_kept_is_told_it_ran() -> None:
    """A replay of a result that was not kept raises ResultNotStorable: it ran, not again."""
    call = plan(Effect.UNSAFE)
    script = Script(call)
    script.play([now(), claim(), now(), run(Ran(value=Receipt())), write(S)])
    replay = Script(call, script.record)
    with pytest.raises(ResultNotStorable, match="already ran") as raised:
        replay.play([now(), claim(), note(Outcome.REPLAYED)])
    assert (raised.value.tool, raised.value.key) == ("charge", KEY)
    assert "receipt 42" in str(raised.value)
    assert not replay.runs


@pytest.mark.parametrize(("answer_stored", "expected"), [(False, (1, 2)), (True, [1, 2])])
def test_with_stored_answers_the_first_caller_gets_the_stored_form(
    answer_stored: bool, expected: object
) -> None:
    """With answer_stored, the first caller gets its result as every retry will: decoded."""
    call = plan(Effect.KEYED, answer_stored=answer_stored)
    script = Script(call)
    value = script.play([now(), claim(), now(), run(Ran(value=(1, 2))), write(S, result="[1,2]")])
    assert value == expected
    assert type(value) is type(expected)
    replay = Script(call, stored(call, S, result="[1,2]"))
    assert replay.play([now(), claim(), note(Outcome.REPLAYED)]) == [1, 2]
