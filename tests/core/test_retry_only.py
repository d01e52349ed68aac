"""A SAFE tool kept out of the ledger: run, retrying only its ambiguous errors."""

from __future__ import annotations

import math

import pytest

from twiceshy._protocol import Ran, retry_only
from twiceshy._records import Effect
from twiceshy.errors import NotApplied

from .script import Declined, Script, policy, run, sleep


class Refused(Exception):
    """A type the policy lists as ``not_applied=``."""


SAFE = policy(Effect.SAFE, not_applied=(Refused,))


def test_a_value_is_returned_from_one_run() -> None:
    """A run that returns is the answer: no store command, no sleep."""
    value = Script(None).play(
        [run(Ran(value=5), fence=0, attempt=1, trusted_until=math.inf)], retry_only(SAFE)
    )
    assert value == 5


def test_ambiguous_errors_are_retried_with_backoff() -> None:
    """An ambiguous error sleeps the backoff of its attempt, and the tool runs again."""
    value = Script(None).play(
        [
            run(Ran(error=TimeoutError("t1")), attempt=1),
            sleep(0.1),
            run(Ran(error=ConnectionError("t2")), attempt=2),
            sleep(0.2),
            run(Ran(value="ok"), attempt=3),
        ],
        retry_only(SAFE),
    )
    assert value == "ok"


def test_the_last_ambiguous_error_is_raised_when_attempts_run_out() -> None:
    """Out of attempts, the last error is raised as it is, with no sleep after it."""
    last = TimeoutError("t3")
    with pytest.raises(TimeoutError) as raised:
        Script(None).play(
            [
                run(Ran(error=TimeoutError("t1"))),
                sleep(0.1),
                run(Ran(error=TimeoutError("t2"))),
                sleep(0.2),
                run(Ran(error=last)),
            ],
            retry_only(SAFE),
        )
    assert raised.value is last


@pytest.mark.parametrize(
    "error", [Declined("no"), NotApplied("not sent"), Refused("not sent")], ids=type
)
def test_a_definite_or_not_applied_error_is_raised_at_once(error: Exception) -> None:
    """A definite= error, NotApplied or a not_applied= type is the tool's answer: no retry."""
    with pytest.raises(type(error)) as raised:
        Script(None).play([run(Ran(error=error))], retry_only(SAFE))
    assert raised.value is error


def test_an_interrupted_sleep_raises_the_interruption() -> None:
    """An interruption between attempts is raised, and nothing runs again."""
    interruption = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as raised:
        Script(None).play(
            [run(Ran(error=TimeoutError("t1"))), sleep(0.1, interrupted=interruption)],
            retry_only(SAFE),
        )
    assert raised.value is interruption
