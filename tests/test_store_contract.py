"""The store contract: what every ledger store promises, tested through the Store protocol only.

Every test runs against each store kind, blocking and then its async twin (the
``store_or_twin`` fixture, ``tests/conftest.py``; an async store is awaited through
``tests/awaited_store.py``). Guarded writes are checked against the reference semantics of
``twiceshy._records`` (``guard_holds``, ``apply_change``, ``new_claim``, ``is_live``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import pickle
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import servers
from twiceshy._records import (
    Change,
    Effect,
    Record,
    Snapshot,
    State,
    apply_change,
    guard_holds,
    is_live,
    new_claim,
)
from twiceshy.stores import CallCounts, ExpiredOutcomes, Store, open_store

if TYPE_CHECKING:
    from conftest import FakeClock

NS = "tenant-a"
KEY = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
LEASE = 30.0
CLAIMED = frozenset({State.CLAIMED})
UNKNOWN = frozenset({State.UNKNOWN})
RELEASED = frozenset({State.RELEASED})


@pytest.fixture
def store(store_or_twin: Store) -> Store:
    """Every store kind, blocking and async: the contract is the same."""
    return store_or_twin


def claim(
    store: Store,
    owner: str = "alice",
    *,
    key: str = KEY,
    namespace: str = NS,
    lease: float = LEASE,
    tool: str = "charge",
    effect: Effect = Effect.KEYED,
    fingerprint: str = "fp-1",
) -> Snapshot:
    """Claim ``key`` for ``owner`` with the suite's defaults."""
    return store.claim(
        namespace,
        key,
        fingerprint=fingerprint,
        tool=tool,
        effect=effect,
        owner=owner,
        lease=lease,
    )


def owned(store: Store, owner: str = "alice", **kwargs: Any) -> Record:
    """Claim and insist on winning; answer the claimed record."""
    snap = claim(store, owner, **kwargs)
    assert snap.won
    assert snap.record is not None
    return snap.record


def fields(record: Record | None) -> dict[str, Any] | None:
    """A record as a dict, so a mismatch shows field by field."""
    return asdict(record) if record is not None else None


def finish(
    store: Store, record: Record, to: State, *, ttl: float | None = None, **kwargs: Any
) -> Record:
    """Record an outcome as the owner of ``record``; insist that it lands."""
    change = Change(record.fence, CLAIMED, to, owner=record.owner, ttl=ttl, **kwargs)
    snap = store.write(record.namespace, record.key, change)
    assert snap.won
    assert snap.record is not None
    return snap.record


# -- claim ----------------------------------------------------------------------------------


def test_claim_on_empty_key_wins_with_fence_one(store: Store, clock: FakeClock) -> None:
    """A first claim wins: fence 1, CLAIMED, lease on the store clock, one attempt."""
    snap = claim(store, "alice", lease=12.5)
    assert snap.won
    assert snap.now == clock.now
    record = snap.record
    assert record is not None
    assert record.state is State.CLAIMED
    assert record.fence == 1
    assert record.owner == "alice"
    assert record.lease_deadline == clock.now + 12.5
    assert record.attempts == 1
    assert (record.result, record.error, record.reason, record.expires_at) == (
        None,
        None,
        None,
        None,
    )
    expected = new_claim(
        NS,
        KEY,
        fingerprint="fp-1",
        tool="charge",
        effect=Effect.KEYED,
        owner="alice",
        lease=12.5,
        now=clock.now,
    )
    assert fields(record) == fields(expected)
    assert fields(store.get(NS, KEY).record) == fields(expected)


def test_answers_are_frozen_values(store: Store) -> None:
    """What a store answers is a frozen value: the same as one built field by field, equal,
    hashed and pickled alike, and refusing to change, so a caller can never alter a record
    the store (or a process remembering outcomes) still holds."""
    claimed = claim(store, "alice")
    record = claimed.record
    assert record is not None
    written = store.write(NS, KEY, Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result="1"))
    answers = ((claimed, "won"), (record, "state"), (written, "won"), (written.record, "state"))
    for value, name in answers:
        assert value is not None
        rebuilt = type(value)(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
        assert value == rebuilt
        assert hash(value) == hash(rebuilt)
        assert repr(value) == repr(rebuilt)
        assert pickle.loads(pickle.dumps(value)) == value
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, None)
    assert dataclasses.replace(record, state=State.RELEASED).state is State.RELEASED
    assert record.state is State.CLAIMED


def test_second_claim_by_other_owner_loses_unchanged(store: Store, clock: FakeClock) -> None:
    """A claim on a live CLAIMED record loses and answers that record as it is."""
    first = owned(store, "alice")
    clock.advance(3)
    snap = claim(store, "bob", fingerprint="fp-2", tool="other", lease=99)
    assert not snap.won
    assert fields(snap.record) == fields(first)
    assert fields(store.get(NS, KEY).record) == fields(first)


def test_second_claim_by_same_owner_is_recognised(store: Store, clock: FakeClock) -> None:
    """Claiming again with the same owner token answers won=True for the same record."""
    first = owned(store, "alice")
    clock.advance(1)
    snap = claim(store, "alice")
    assert snap.won
    assert fields(snap.record) == fields(first)


@pytest.mark.parametrize(
    "state", [State.SUCCEEDED, State.FAILED, State.RELEASED, State.UNKNOWN], ids=str
)
def test_claim_on_live_outcome_loses(store: Store, clock: FakeClock, state: State) -> None:
    """A claim on any live settled record, even by its former owner, changes nothing."""
    settled = finish(store, owned(store, "alice"), state, ttl=100)
    clock.advance(1)
    for owner in ("alice", "bob"):
        snap = claim(store, owner)
        assert not snap.won
        assert fields(snap.record) == fields(settled)


# -- guarded writes against the reference semantics -----------------------------------------


def _start_claimed(store: Store, clock: FakeClock) -> Record:
    return owned(store, "alice")


def _start_lapsed(store: Store, clock: FakeClock) -> Record:
    record = owned(store, "alice")
    clock.advance(LEASE + 1)
    return record


def _start_released(store: Store, clock: FakeClock) -> Record:
    return finish(store, owned(store, "alice"), State.RELEASED, ttl=3600)


def _start_unknown(store: Store, clock: FakeClock) -> Record:
    return finish(
        store, owned(store, "alice"), State.UNKNOWN, error='{"type":"Timeout"}', reason="timeout"
    )


STARTS: dict[str, Callable[[Store, FakeClock], Record]] = {
    "claimed": _start_claimed,
    "lapsed": _start_lapsed,
    "released": _start_released,
    "unknown": _start_unknown,
}

# (start, change made from the starting record), one per row of DESIGN.md §3.
TRANSITIONS: dict[str, tuple[str, Callable[[Record], Change]]] = {
    "claimed-succeeded": (
        "claimed",
        lambda r: Change(
            r.fence, CLAIMED, State.SUCCEEDED, owner=r.owner, result='{"id":7}', ttl=3600
        ),
    ),
    "claimed-succeeded-forever": (
        "claimed",
        lambda r: Change(r.fence, CLAIMED, State.SUCCEEDED, owner=r.owner, result="null"),
    ),
    "claimed-failed": (
        "claimed",
        lambda r: Change(r.fence, CLAIMED, State.FAILED, owner=r.owner, error='"no"', ttl=60),
    ),
    "claimed-released": (
        "claimed",
        lambda r: Change(r.fence, CLAIMED, State.RELEASED, owner=r.owner, ttl=60),
    ),
    "claimed-unknown-by-owner": (
        "claimed",
        lambda r: Change(
            r.fence, CLAIMED, State.UNKNOWN, owner=r.owner, error='"t/o"', reason="timeout", ttl=9
        ),
    ),
    "lapsed-unknown-by-anyone": (
        "lapsed",
        lambda r: Change(r.fence, CLAIMED, State.UNKNOWN, lapsed=True, reason="lease lapsed"),
    ),
    "lapsed-takeover": (
        "lapsed",
        lambda r: Change(
            r.fence, CLAIMED, State.CLAIMED, lapsed=True, new_owner="bob", lease=LEASE
        ),
    ),
    "released-reclaimed": (
        "released",
        lambda r: Change(r.fence, RELEASED, State.CLAIMED, new_owner="bob", lease=LEASE),
    ),
    "unknown-reclaimed": (
        "unknown",
        lambda r: Change(r.fence, UNKNOWN, State.CLAIMED, new_owner="bob", lease=LEASE),
    ),
    "unknown-reconciled-succeeded": (
        "unknown",
        lambda r: Change(r.fence, UNKNOWN, State.SUCCEEDED, result='{"found":true}', ttl=60),
    ),
    "unknown-reconciled-failed": (
        "unknown",
        lambda r: Change(r.fence, UNKNOWN, State.FAILED, error='"declined"'),
    ),
    "unknown-reconciled-released": (
        "unknown",
        lambda r: Change(r.fence, UNKNOWN, State.RELEASED, ttl=60),
    ),
    "unknown-late-owner-succeeded": (
        "unknown",
        lambda r: Change(r.fence, UNKNOWN, State.SUCCEEDED, owner=r.owner, result="[1,2]"),
    ),
    "unknown-late-owner-failed": (
        "unknown",
        lambda r: Change(r.fence, UNKNOWN, State.FAILED, owner=r.owner, error='"x"', ttl=5),
    ),
    "claimed-heartbeat": (
        "claimed",
        lambda r: Change(r.fence, CLAIMED, State.CLAIMED, owner=r.owner, lease=60),
    ),
    "claimed-attempt-in-place": (
        "claimed",
        lambda r: Change(r.fence, CLAIMED, State.CLAIMED, owner=r.owner, count_attempt=True),
    ),
}


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_transition_matches_reference(store: Store, clock: FakeClock, name: str) -> None:
    """Each §3 transition with a holding guard wins and yields exactly apply_change's record."""
    start, make = TRANSITIONS[name]
    before = STARTS[start](store, clock)
    clock.advance(1.25)
    change = make(before)
    assert guard_holds(before, change, clock.now)
    snap = store.write(NS, KEY, change)
    assert snap.won
    assert snap.now == clock.now
    expected = apply_change(before, change, clock.now)
    assert fields(snap.record) == fields(expected)
    assert fields(store.get(NS, KEY).record) == fields(expected)


REFUSALS: dict[str, Callable[[Record], Change]] = {
    "stale-fence": lambda r: Change(
        r.fence - 1, CLAIMED, State.SUCCEEDED, owner=r.owner, result="1"
    ),
    "future-fence": lambda r: Change(
        r.fence + 1, CLAIMED, State.SUCCEEDED, owner=r.owner, result="1"
    ),
    "wrong-state": lambda r: Change(r.fence, UNKNOWN, State.SUCCEEDED, result="1"),
    "no-state": lambda r: Change(r.fence, frozenset(), State.SUCCEEDED, result="1"),
    "wrong-owner": lambda r: Change(r.fence, CLAIMED, State.SUCCEEDED, owner="bob", result="1"),
    "lease-not-lapsed": lambda r: Change(
        r.fence, CLAIMED, State.CLAIMED, lapsed=True, new_owner="bob", lease=LEASE
    ),
    "unknown-not-lapsed": lambda r: Change(r.fence, CLAIMED, State.UNKNOWN, lapsed=True),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_write_with_failing_guard_changes_nothing(
    store: Store, clock: FakeClock, name: str
) -> None:
    """A stale fence, wrong state, wrong owner or an unlapsed lease loses and changes nothing."""
    before = owned(store, "alice")
    clock.advance(LEASE - 1)
    change = REFUSALS[name](before)
    assert not guard_holds(before, change, clock.now)
    snap = store.write(NS, KEY, change)
    assert not snap.won
    assert snap.now == clock.now
    assert fields(snap.record) == fields(before)
    assert fields(store.get(NS, KEY).record) == fields(before)


def test_lapsed_guard_holds_exactly_at_the_deadline(store: Store, clock: FakeClock) -> None:
    """A lease has lapsed once the store clock reaches its deadline, not a moment before."""
    before = owned(store, "alice")
    takeover = Change(1, CLAIMED, State.CLAIMED, lapsed=True, new_owner="bob", lease=LEASE)
    clock.advance(LEASE - 0.001)
    assert not store.write(NS, KEY, takeover).won
    clock.now = before.lease_deadline or 0.0
    assert store.write(NS, KEY, takeover).won


def test_write_to_missing_key_answers_none(store: Store) -> None:
    """A guarded write to a key with no record loses and answers no record."""
    snap = store.write(NS, KEY, Change(1, CLAIMED, State.SUCCEEDED, result="1"))
    assert not snap.won
    assert snap.record is None
    assert store.get(NS, KEY).record is None


def test_write_to_expired_record_is_refused(store: Store, clock: FakeClock) -> None:
    """A record past its retention cannot be written, even with a matching guard."""
    done = finish(store, owned(store), State.RELEASED, ttl=10)
    clock.advance(10)
    change = Change(done.fence, RELEASED, State.CLAIMED, new_owner="bob", lease=LEASE)
    snap = store.write(NS, KEY, change)
    assert not snap.won
    assert snap.record is None


_history_keys = itertools.count()
_owners = st.sampled_from(["alice", "bob", "carol"])
_texts = st.sampled_from([None, "", "0", '"x"', '{"k":"ü"}'])


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_histories_follow_reference(
    store: Store, clock: FakeClock, data: st.DataObject
) -> None:
    """Any sequence of claims, writes and clock moves answers what the reference model says."""
    key = f"history-{next(_history_keys)}"
    model: Record | None = None  # what the store holds, expired or not
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        clock.advance(data.draw(st.sampled_from([0.0, 0.5, 10.0, LEASE, 100.0]), label="dt"))
        now = clock.now
        live = model if model is not None and is_live(model, now) else None
        if data.draw(st.booleans(), label="claim?"):
            owner = data.draw(_owners, label="owner")
            snap = claim(store, owner, key=key, lease=LEASE)
            if live is None:
                model = new_claim(
                    NS,
                    key,
                    fingerprint="fp-1",
                    tool="charge",
                    effect=Effect.KEYED,
                    owner=owner,
                    lease=LEASE,
                    now=now,
                    fence=model.fence + 1 if model is not None else 1,
                )
                assert snap.won
                assert fields(snap.record) == fields(model)
            else:
                assert snap.won == (live.state is State.CLAIMED and live.owner == owner)
                assert fields(snap.record) == fields(live)
            continue
        base = model.fence if model is not None else 1
        to = data.draw(st.sampled_from(list(State)), label="to")
        new_owner = (
            data.draw(st.none() | _owners, label="new owner") if to is State.CLAIMED else None
        )
        leases = [5.0, LEASE] if new_owner is not None else [None, 5.0, LEASE]
        change = Change(
            fence=data.draw(st.sampled_from([base - 1, base, base + 1]), label="fence"),
            from_states=data.draw(st.frozensets(st.sampled_from(list(State))), label="from"),
            to=to,
            owner=data.draw(st.none() | _owners, label="guard owner"),
            lapsed=data.draw(st.booleans(), label="lapsed"),
            new_owner=new_owner,
            lease=data.draw(st.sampled_from(leases), label="lease"),
            count_attempt=data.draw(st.booleans(), label="count"),
            result=data.draw(_texts, label="result"),
            error=data.draw(_texts, label="error"),
            reason=data.draw(st.sampled_from([None, "why"]), label="reason"),
            ttl=data.draw(st.sampled_from([None, 1.0, 50.0]), label="ttl"),
        )
        snap = store.write(NS, key, change)
        won = live is not None and guard_holds(live, change, now)
        assert snap.won == won
        if won:
            assert live is not None
            model = apply_change(live, change, now)
            assert fields(snap.record) == fields(model)
        else:
            assert fields(snap.record) == fields(live)
        assert snap.now == now


# -- takeover and renewal -------------------------------------------------------------------


def test_takeover_after_lapse_fences_out_old_owner(store: Store, clock: FakeClock) -> None:
    """A takeover raises the fence, sets owner and lease; the stale owner's write is refused."""
    first = owned(store, "alice", lease=LEASE)
    clock.advance(LEASE + 5)
    takeover = Change(
        first.fence, CLAIMED, State.CLAIMED, lapsed=True, new_owner="bob", lease=LEASE
    )
    snap = store.write(NS, KEY, takeover)
    assert snap.won
    second = snap.record
    assert second is not None
    assert second.fence == first.fence + 1
    assert second.owner == "bob"
    assert second.lease_deadline == clock.now + LEASE
    assert second.attempts == first.attempts + 1
    assert second.state is State.CLAIMED

    clock.advance(1)
    late = Change(first.fence, CLAIMED, State.SUCCEEDED, owner="alice", result='"late"')
    refused = store.write(NS, KEY, late)
    assert not refused.won
    assert fields(refused.record) == fields(second)
    unguarded = Change(first.fence, CLAIMED, State.UNKNOWN, error='"late"')
    assert not store.write(NS, KEY, unguarded).won
    assert fields(store.get(NS, KEY).record) == fields(second)
    # The new owner still records its outcome.
    assert finish(store, second, State.SUCCEEDED, result='"bob"').result == '"bob"'


def test_renewal_moves_the_deadline(store: Store, clock: FakeClock) -> None:
    """A heartbeat by the owner, same fence, moves the lease deadline on the store clock."""
    first = owned(store, "alice", lease=LEASE)
    clock.advance(20)
    renew = Change(first.fence, CLAIMED, State.CLAIMED, owner="alice", lease=LEASE)
    snap = store.write(NS, KEY, renew)
    assert snap.won
    assert snap.record is not None
    assert snap.record.lease_deadline == clock.now + LEASE
    assert snap.record.fence == first.fence
    assert snap.record.attempts == first.attempts
    # Past the first deadline, the renewed lease still holds against a takeover.
    clock.advance(LEASE - 1)
    takeover = Change(first.fence, CLAIMED, State.CLAIMED, lapsed=True, new_owner="bob", lease=1)
    assert not store.write(NS, KEY, takeover).won
    other = Change(first.fence, CLAIMED, State.CLAIMED, owner="bob", lease=LEASE)
    assert not store.write(NS, KEY, other).won


# -- expiry ---------------------------------------------------------------------------------


def test_outcome_expires_and_key_is_claimed_again(store: Store, clock: FakeClock) -> None:
    """A SUCCEEDED record with a ttl vanishes once expired; a new claim wins with fence + 1."""
    done = finish(store, owned(store, "alice"), State.SUCCEEDED, result='"ok"', ttl=10)
    assert done.expires_at == clock.now + 10
    clock.advance(9.5)
    assert fields(store.get(NS, KEY).record) == fields(done)
    clock.advance(0.5)
    assert store.get(NS, KEY).record is None
    snap = claim(store, "bob", fingerprint="fp-2", tool="refund")
    assert snap.won
    expected = new_claim(
        NS,
        KEY,
        fingerprint="fp-2",
        tool="refund",
        effect=Effect.KEYED,
        owner="bob",
        lease=LEASE,
        now=clock.now,
        fence=done.fence + 1,
    )
    assert fields(snap.record) == fields(expected)


def test_a_won_write_answers_what_it_wrote_even_past_its_retention(
    store: Store, clock: FakeClock
) -> None:
    """An outcome with no retention (ttl=0) is answered as written to its writer, then gone."""
    done = finish(store, owned(store, "alice"), State.SUCCEEDED, result='"ok"', ttl=0)
    assert done.state is State.SUCCEEDED
    assert done.result == '"ok"'
    assert done.expires_at == clock.now
    assert store.get(NS, KEY).record is None


@pytest.mark.parametrize("state", [State.CLAIMED, State.UNKNOWN], ids=str)
def test_claimed_and_unknown_never_expire(store: Store, clock: FakeClock, state: State) -> None:
    """CLAIMED and UNKNOWN records stay however far the clock moves, whatever ttl is asked."""
    record = owned(store, "alice")
    if state is State.UNKNOWN:
        record = finish(store, record, State.UNKNOWN, error='"t/o"', reason="timeout", ttl=1)
    assert record.expires_at is None
    clock.advance(100 * 365 * 86400)
    assert fields(store.get(NS, KEY).record) == fields(record)
    assert store.purge_expired() == 0
    snap = claim(store, "bob")
    assert not snap.won
    assert fields(snap.record) == fields(record)


def test_purge_expired_deletes_only_expired_outcomes(store: Store, clock: FakeClock) -> None:
    """purge_expired removes expired SUCCEEDED/FAILED/RELEASED records and answers the count."""
    for state in (State.SUCCEEDED, State.FAILED, State.RELEASED):
        finish(store, owned(store, key=f"short-{state.value}"), state, ttl=10)
    kept = {
        "long": finish(store, owned(store, key="long"), State.SUCCEEDED, result="1", ttl=1000),
        "forever": finish(store, owned(store, key="forever"), State.FAILED, error='"e"'),
        "claimed": owned(store, key="claimed"),
        "unknown": finish(store, owned(store, key="unknown"), State.UNKNOWN, reason="r"),
    }
    finish(store, owned(store, key="short", namespace="tenant-b"), State.SUCCEEDED, ttl=10)
    clock.advance(5)
    assert store.purge_expired() == 0
    clock.advance(20)
    assert store.purge_expired(NS) == 3
    assert store.purge_expired(NS) == 0
    assert store.get("tenant-b", "short").record is None
    assert store.purge_expired() == 1
    for key, record in kept.items():
        assert fields(store.get(NS, key).record) == fields(record)
    assert {r.key for r in store.records(NS)} == set(kept)


def test_expired_lists_what_a_purge_would_delete_and_deletes_nothing(
    store: Store, clock: FakeClock
) -> None:
    """expired() answers the outcomes past their retention, whole, by namespace or all, and
    leaves them for purge_expired to count."""
    assert isinstance(store, ExpiredOutcomes)
    short = {
        state: finish(store, owned(store, key=f"short-{state.value}"), state, ttl=10)
        for state in (State.SUCCEEDED, State.FAILED, State.RELEASED)
    }
    finish(store, owned(store, key="long"), State.SUCCEEDED, result="1", ttl=1000)
    owned(store, key="claimed")
    finish(store, owned(store, key="unknown"), State.UNKNOWN, reason="r", ttl=1)
    other = finish(store, owned(store, key="b", namespace="tenant-b"), State.SUCCEEDED, ttl=10)
    clock.advance(5)
    assert store.expired(NS) == []
    clock.advance(20)
    found = store.expired(NS)
    assert sorted(r.key for r in found) == ["short-failed", "short-released", "short-succeeded"]
    by_key = {r.key: r for r in found}
    for record in short.values():
        assert fields(by_key[record.key]) == fields(record)
    assert {(r.namespace, r.key) for r in store.expired()} == {
        *((NS, r.key) for r in found),
        ("tenant-b", other.key),
    }
    assert store.purge_expired(NS) == 3
    assert store.expired(NS) == []
    assert [r.key for r in store.expired()] == ["b"]


def test_a_claim_keeps_its_arguments_through_every_write(store: Store, clock: FakeClock) -> None:
    """The args a winning claim carries are kept as given, by every read and write after it; a
    claim that loses changes nothing; one over an expired outcome keeps its own (or none)."""
    text = '{"amount":4900,"iban":"DE89 3704 0044 0532 0130 00","note":"caf\u00e9 \u2603"}'
    won = store.claim(
        NS,
        KEY,
        fingerprint="fp-1",
        tool="charge",
        effect=Effect.KEYED,
        owner="alice",
        lease=LEASE,
        args=text,
    )
    assert won.won
    assert won.record is not None
    assert won.record.args == text
    lost = store.claim(
        NS,
        KEY,
        fingerprint="fp-1",
        tool="charge",
        effect=Effect.KEYED,
        owner="bob",
        lease=LEASE,
        args='{"amount":1}',
    )
    assert not lost.won
    assert lost.record is not None
    assert lost.record.args == text
    done = finish(store, won.record, State.SUCCEEDED, result='"ok"', ttl=10)
    assert done.args == text
    got = store.get(NS, KEY).record
    assert got is not None
    assert got.args == text
    assert [r.args for r in store.records(NS)] == [text]
    clock.advance(20)
    again = claim(store, "carol")
    assert again.won
    assert again.record is not None
    assert (again.record.fence, again.record.args) == (2, None)
    assert owned(store, key="other").args is None


# -- namespaces and round trips -------------------------------------------------------------


def test_namespaces_never_meet(store: Store, clock: FakeClock) -> None:
    """The same key in two namespaces is two records, claimed and settled independently."""
    a = owned(store, "alice", namespace="tenant-a")
    b = owned(store, "bob", namespace="tenant-b")
    assert (a.fence, b.fence) == (1, 1)
    assert (a.namespace, b.namespace) == ("tenant-a", "tenant-b")
    finish(store, a, State.SUCCEEDED, result='"a"')
    got = store.get("tenant-b", KEY).record
    assert fields(got) == fields(b)
    # A guard that holds in one namespace says nothing in the other.
    change = Change(1, CLAIMED, State.FAILED, owner="alice", error='"x"')
    assert not store.write("tenant-b", KEY, change).won
    assert [r.namespace for r in store.records("tenant-b")] == ["tenant-b"]
    assert store.get("tenant-c", KEY).record is None


ROUND_TRIP_TEXTS = [
    '{"name":"Zoë","city":"Zürich","greeting":"こんにちは","emoji":"🙂"}',
    '"Ünïcödé ✓ 漢字"',
    "",
    '""',
    "0",
    '"0"',
    "[]",
    '"[]"',
    "null",
    '"null"',
    "false",
    '{"quote":"\\"","backslash":"\\\\","newline":"\\n"}',
    "line one\nline two\ttab\\ back 'single' \"double\"",
    "x" * 100_000,
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS, ids=lambda t: repr(t[:12]))
def test_results_and_errors_round_trip(store: Store, text: str) -> None:
    """Result, error and reason texts come back exactly, falsy and non-ASCII ones included."""
    ok = finish(store, owned(store, key="ok"), State.SUCCEEDED, result=text)
    bad = finish(store, owned(store, key="bad"), State.FAILED, error=text)
    unknown = finish(store, owned(store, key="unk"), State.UNKNOWN, error=text, reason=text)
    for key, record in (("ok", ok), ("bad", bad), ("unk", unknown)):
        assert fields(store.get(NS, key).record) == fields(record)
    got = store.get(NS, "ok").record
    assert got is not None
    assert type(got.result) is str
    assert got.result == text
    got = store.get(NS, "bad").record
    assert got is not None
    assert got.error == text
    got = store.get(NS, "unk").record
    assert got is not None
    assert (got.error, got.reason) == (text, text)


@pytest.mark.parametrize("effect", list(Effect), ids=str)
def test_record_fields_round_trip(store: Store, effect: Effect) -> None:
    """Fingerprint, tool, effect class and owner tokens come back as written."""
    record = owned(
        store,
        "owner-ü-🙂",
        key="ключ",
        namespace="租户",
        tool="send_mail",
        effect=effect,
        fingerprint="f" * 64,
    )
    got = store.get("租户", "ключ").record
    assert fields(got) == fields(record)
    assert got is not None
    assert got.effect is effect


# -- waiting --------------------------------------------------------------------------------


def test_wait_returns_promptly_when_outcome_is_recorded(store: Store) -> None:
    """A waiter wakes soon after another thread records the outcome, and sees it."""
    record = owned(store, "alice")

    def settle() -> None:
        time.sleep(0.05)
        finish(store, record, State.SUCCEEDED, result='"done"')

    worker = threading.Thread(target=settle)
    started = time.monotonic()
    worker.start()
    try:
        snap = store.wait(NS, KEY, record.fence, timeout=10.0)
    finally:
        worker.join()
    elapsed = time.monotonic() - started
    assert snap.record is not None
    assert snap.record.state is State.SUCCEEDED
    assert snap.record.result == '"done"'
    assert elapsed < 1.0


def test_wait_times_out_with_the_claimed_record(store: Store) -> None:
    """With nothing happening, wait answers the still-CLAIMED record after its timeout."""
    record = owned(store, "alice")
    started = time.monotonic()
    snap = store.wait(NS, KEY, record.fence, timeout=0.2)
    elapsed = time.monotonic() - started
    assert fields(snap.record) == fields(record)
    assert 0.2 <= elapsed < 2.0


def test_wait_returns_at_once_when_not_claimed_under_fence(store: Store, clock: FakeClock) -> None:
    """wait does not block for a missing key, a settled record, or a claim under another fence."""
    started = time.monotonic()
    assert store.wait(NS, "missing", 1, timeout=5.0).record is None
    record = owned(store, "alice")
    snap = store.wait(NS, KEY, record.fence + 1, timeout=5.0)
    assert fields(snap.record) == fields(record)
    done = finish(store, record, State.FAILED, error='"no"')
    assert fields(store.wait(NS, KEY, record.fence, timeout=5.0).record) == fields(done)
    assert time.monotonic() - started < 2.0


# -- listing --------------------------------------------------------------------------------


def test_records_lists_newest_first_and_filters(store: Store, clock: FakeClock) -> None:
    """records() lists live records of one namespace newest first, by state, tool and limit."""
    k1 = owned(store, key="k1", tool="charge")
    clock.advance(1)
    k2 = owned(store, key="k2", tool="mail")
    clock.advance(1)
    k3 = finish(store, owned(store, key="k3", tool="charge"), State.SUCCEEDED, result="3")
    clock.advance(1)
    k4 = finish(store, owned(store, key="k4", tool="charge"), State.UNKNOWN, reason="r")
    clock.advance(1)
    finish(store, owned(store, key="k5", tool="charge"), State.FAILED, error='"e"', ttl=0.5)
    owned(store, key="elsewhere", namespace="tenant-b", tool="charge")
    clock.advance(1)  # k5 has expired

    def keys(**kwargs: Any) -> list[str]:
        found = store.records(NS, **kwargs)
        for record in found:
            assert fields(record) == fields(store.get(NS, record.key).record)
        return [r.key for r in found]

    assert keys() == ["k4", "k3", "k2", "k1"]
    assert keys(states=[State.CLAIMED]) == ["k2", "k1"]
    assert keys(states={State.SUCCEEDED, State.UNKNOWN}) == ["k4", "k3"]
    assert keys(states=[State.FAILED]) == []
    assert keys(states=[]) == []
    assert keys(tool="charge") == ["k4", "k3", "k1"]
    assert keys(tool="mail") == ["k2"]
    assert keys(tool="nothing") == []
    assert keys(states=[State.CLAIMED], tool="charge") == ["k1"]
    assert keys(limit=2) == ["k4", "k3"]
    assert keys(limit=0) == []
    assert keys(tool="charge", limit=1) == ["k4"]
    assert [fields(r) for r in store.records(NS)] == [fields(r) for r in (k4, k3, k2, k1)]
    assert store.records("tenant-empty") == []


# -- call counts ---------------------------------------------------------------------------------


def test_call_counts_add_up_per_namespace(store: Store) -> None:
    """Counts added in several flushes sum by (tool, outcome), each namespace apart."""
    assert isinstance(store, CallCounts)
    assert store.counts(NS) == {}
    store.add_counts(NS, {("charge", "executed"): 2, ("charge", "replayed"): 5})
    store.add_counts(NS, {("charge", "replayed"): 1, ("mail", "joined"): 3})
    store.add_counts("tenant-b", {("charge", "replayed"): 7})
    store.add_counts(NS, {})
    assert store.counts(NS) == {
        ("charge", "executed"): 2,
        ("charge", "replayed"): 6,
        ("mail", "joined"): 3,
    }
    assert store.counts("tenant-b") == {("charge", "replayed"): 7}


def test_call_counts_are_not_records(store: Store) -> None:
    """Counts never show up among a namespace's records, nor are they purged."""
    assert isinstance(store, CallCounts)
    store.add_counts(NS, {("charge", "executed"): 1})
    assert store.records(NS) == []
    store.purge_expired()
    assert store.counts(NS) == {("charge", "executed"): 1}


def test_call_counts_from_many_threads_are_all_kept(store: Store) -> None:
    """Concurrent flushes of one (tool, outcome) lose nothing."""
    assert isinstance(store, CallCounts)
    threads = [
        threading.Thread(
            target=lambda: [store.add_counts(NS, {("charge", "replayed"): 1}) for _ in range(10)]
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.counts(NS) == {("charge", "replayed"): 40}


# -- the stores under test ------------------------------------------------------------------


def test_the_stores_under_test_are_those_open_store_opens(
    store_or_twin: Store, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Each store and async twin this suite tests is of the class ``open_store`` answers."""
    name, twin = request.node.callspec.params["store_or_twin"]
    where = f"twiceshy_test_{secrets.token_hex(6)}"
    url = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{tmp_path / 'opened.db'}",
        "postgres": f"{servers.POSTGRES_URL}?schema={where}",
        "redis": f"{servers.REDIS_URL}?prefix={where}",
        "redis-cluster": f"{servers.REDIS_CLUSTER_URL}?prefix={where}",
        "pgbouncer": f"{servers.PGBOUNCER_URL}?schema={where}&wakeups=poll",
        "dynamodb": servers.dynamodb_url(prefix=where),
    }[name]
    opened, async_opened = open_store(url)
    try:
        tested = store_or_twin.twin if twin else store_or_twin
        assert type(tested) is type(async_opened if twin else opened)
    finally:
        asyncio.run(async_opened.close())
        opened.close()
        if name in ("postgres", "pgbouncer"):
            servers.drop_schema(servers.POSTGRES_URL, where)
