"""The rules as data: every case has a row, and the rows say what docs/design.md §3 and §4 say."""

from __future__ import annotations

import itertools

from twiceshy._records import Effect, State
from twiceshy._rules import ENDINGS, FOUND, TRANSITIONS, Actor, Answer, Ending, Found, Then

C, S, F, R, U = State.CLAIMED, State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN


def test_every_found_record_and_effect_class_has_an_answer() -> None:
    """No case of a found record is left to an if-chain: the table covers every one."""
    assert set(FOUND) == set(itertools.product(Found, Effect))


def test_every_ending_has_a_row() -> None:
    """Every way an attempt can end, for every class, last attempt or not, has its write."""
    assert set(ENDINGS) == set(itertools.product(Ending, Effect, (True, False)))


def test_only_an_unsafe_tool_is_never_taken_again() -> None:
    """UNSAFE: an unknown outcome is refused and a lapsed lease marked unknown; the others
    take both over at fence + 1 (§3)."""
    assert FOUND[Found.UNKNOWN, Effect.UNSAFE] is Answer.REFUSE
    assert FOUND[Found.LAPSED, Effect.UNSAFE] is Answer.MARK_UNKNOWN
    for effect in (Effect.SAFE, Effect.KEYED):
        assert FOUND[Found.UNKNOWN, effect] is Answer.TAKE
        assert FOUND[Found.LAPSED, effect] is Answer.TAKE_LAPSED
    for effect in Effect:
        assert FOUND[Found.SUCCEEDED, effect] is Answer.REPLAY
        assert FOUND[Found.FAILED, effect] is Answer.RAISE_RECORDED
        assert FOUND[Found.RELEASED, effect] is Answer.TAKE
        assert FOUND[Found.RUNNING, effect] is Answer.WAIT


def test_an_ambiguous_error_is_retried_only_where_a_retry_is_safe() -> None:
    """An ambiguous error: UNSAFE never retries (UNKNOWN, OutcomeUnknown); KEYED and SAFE retry
    while attempts are left, then KEYED leaves it unknown and SAFE releases it (§4)."""
    for last in (True, False):
        written = ENDINGS[Ending.AMBIGUOUS, Effect.UNSAFE, last]
        assert (written.to, written.then, written.kept) == (U, Then.RAISE_UNKNOWN, True)
    for effect in (Effect.KEYED, Effect.SAFE):
        assert ENDINGS[Ending.AMBIGUOUS, effect, False].then is Then.RETRY
    assert ENDINGS[Ending.AMBIGUOUS, Effect.KEYED, True].to is U
    assert ENDINGS[Ending.AMBIGUOUS, Effect.SAFE, True].to is R


def test_what_an_ending_writes_is_an_owner_transition() -> None:
    """Every write an ending asks for is one the owner may take from CLAIMED, and a late one
    also from UNKNOWN; settled outcomes are kept when refused, an interruption always goes on."""
    for (ending, _, _), written in ENDINGS.items():
        assert Actor.OWNER in TRANSITIONS[(C, written.to)]
        if written.late:
            assert Actor.OWNER in TRANSITIONS[(U, written.to)]
        if written.to in (S, F):
            assert written.kept
        assert written.always == (ending in (Ending.INTERRUPTED, Ending.INTERRUPTED_EARLY))
