"""G7: a key reused with other arguments never runs, for any arguments (property tests)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import twiceshy

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _same_intent(a: Any, b: Any) -> bool:
    return twiceshy.canonical_json(a) == twiceshy.canonical_json(b)


@settings(max_examples=150, deadline=None)
@given(order=st.text(min_size=1, max_size=6), first=JSON, second=JSON)
def test_a_narrowed_key_with_another_rest_never_runs(order: str, first: Any, second: Any) -> None:
    """With key_args, a call whose keyed part matches and whose rest differs is refused with
    KeyReuseMismatch and does not run; one whose rest is the same replays."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[Any] = []

    @ledger.tool(effect=twiceshy.UNSAFE, key_args=["order"])
    def ship(order: str, note: Any) -> int:
        runs.append(note)
        return len(runs)

    with twiceshy.run("run-g7"):
        assert ship(order, first) == 1
        if _same_intent(first, second):
            assert ship(order, second) == 1
        else:
            with pytest.raises(twiceshy.KeyReuseMismatch):
                ship(order, second)
    assert len(runs) == 1


@settings(max_examples=150, deadline=None)
@given(key=st.text(min_size=1, max_size=12), first=JSON, second=JSON)
def test_an_explicit_key_with_other_arguments_never_runs(key: str, first: Any, second: Any) -> None:
    """A key the caller passes again with other arguments is refused and does not run."""
    assume(not _same_intent(first, second))
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    guard = ledger.guard("ship", effect=twiceshy.KEYED)
    runs: list[Any] = []
    assert guard.call({"note": first}, lambda: runs.append(first) or "sent", key=key) == "sent"
    with pytest.raises(twiceshy.KeyReuseMismatch):
        guard.call({"note": second}, lambda: runs.append(second), key=key)
    assert runs == [first]
