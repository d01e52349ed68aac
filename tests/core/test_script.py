"""The script runner itself: it refuses what no call may do, and any command not scripted."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import pytest

from twiceshy._protocol import Claim, Command, Now, Ran, Run, Write
from twiceshy._records import Change, Effect, State

from .script import OWNER, Script, Step, claim, now, plan, run, states, stored, write

C, S, U = State.CLAIMED, State.SUCCEEDED, State.UNKNOWN
Failed = pytest.fail.Exception


def yields(*commands: Command) -> Generator[Command, Any, str]:
    """A stand-in protocol: these commands, whatever their answers, then ``"done"``."""
    for command in commands:  # noqa: UP028 - the runner sends answers, which a tuple refuses
        yield command
    return "done"


def fails(script: Script, steps: Sequence[Step], protocol: Any, match: str) -> None:
    """Playing ``protocol`` through ``steps`` fails the test with a message matching ``match``."""
    with pytest.raises(Failed, match=match):
        script.play(steps, protocol)


def test_an_unexpected_command_fails_naming_both() -> None:
    """A command other than the next step's fails, naming what was expected and what came."""
    fails(Script(plan(Effect.KEYED)), [now()], yields(Claim()), r"expected Now\(\).*Claim\(\)")


def test_a_field_that_differs_fails_naming_it() -> None:
    """A command whose field differs from the step's fails, naming the field."""
    call = plan(Effect.KEYED)
    steps = [now(), claim(), run(Ran(), attempt=2)]
    fails(Script(call), steps, yields(Now(), Claim(), Run(1, 1)), "its attempt is 1")


def test_a_protocol_that_ends_early_fails() -> None:
    """A protocol that returns before the script's last step fails, naming the step."""
    fails(Script(plan(Effect.KEYED)), [now(), claim()], yields(Now()), "returned 'done' before")


def test_a_protocol_that_goes_on_past_the_script_fails() -> None:
    """A command after the script's last step fails."""
    fails(Script(plan(Effect.KEYED)), [now()], yields(Now(), Claim()), "the script has ended")


def test_a_write_the_table_does_not_allow_fails() -> None:
    """A write no actor may take fails, however the script expects it."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, S, owner=OWNER))
    bad = Write(Change(fence=1, from_states=states(S), to=C, owner=OWNER))
    fails(script, [write(C)], yields(bad), "the owner of the fence may not write")


def test_a_rerun_of_an_unsafe_intent_by_a_caller_fails() -> None:
    """A caller's claim of an UNSAFE intent left UNKNOWN fails: it is never run again."""
    call = plan(Effect.UNSAFE)
    script = Script(call, stored(call, U))
    rerun = Change(fence=1, from_states=states(U), to=C, new_owner=OWNER, lease=30.0)
    fails(script, [write(C)], yields(Write(rerun)), "never run again by a caller")


def test_a_write_scripted_to_win_that_the_record_refuses_fails() -> None:
    """A write the script says wins, which the model record's guard refuses, fails."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, C))  # another caller's claim
    mine = Change(fence=1, from_states=states(C), to=S, owner=OWNER)
    fails(script, [write(S)], yields(Write(mine)), "the model record refuses it")


def test_a_run_without_a_claim_of_its_own_fails() -> None:
    """The tool may run only under a live CLAIMED record this call owns."""
    call = plan(Effect.KEYED)
    script = Script(call, stored(call, C))  # another caller's claim
    fails(script, [run(Ran())], yields(Run(1, 1)), "no live claim of this call's")


def test_an_unsafe_tool_run_twice_under_one_fence_fails() -> None:
    """An UNSAFE tool's second run under one fence fails."""
    call = plan(Effect.UNSAFE)
    script = Script(call)
    steps = [claim(), run(Ran()), run(Ran())]
    fails(script, steps, yields(Claim(), Run(1, 1), Run(1, 1)), "ran a second time")
