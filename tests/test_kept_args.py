"""Each call's arguments kept with its record: by default, bounded, none, or redacted.

Through real ledgers (memory, SQLite) and the decorator a user writes: the record keeps the
canonical JSON text of the arguments that name the intent, while the key and fingerprint stay
what they were; a reconciler asked outside a call gets the arguments back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import twiceshy

SCOPE = "run-args"


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A ledger on each local store."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ledger.db'}"
    with twiceshy.Ledger(url, namespace="shop") as opened:
        yield opened


def kept(ledger: twiceshy.Ledger, key: str) -> str | None:
    """The arguments the record of ``key`` kept."""
    record = ledger.store.get("shop", key).record
    assert record is not None
    return record.args


def test_a_call_keeps_its_canonical_arguments_and_its_key(ledger: twiceshy.Ledger) -> None:
    """The record holds the arguments' canonical text (keys sorted, no spaces); the key is
    the one idempotency_key gives."""

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(iban: str, amount: int, note: str = "caf\u00e9") -> str:
        return "ch_1"

    with twiceshy.run(SCOPE):
        charge("DE89370400440532013000", 4900)
    key = twiceshy.idempotency_key(
        SCOPE, "charge", {"iban": "DE89370400440532013000", "amount": 4900, "note": "caf\u00e9"}
    )
    assert kept(ledger, key) == '{"amount":4900,"iban":"DE89370400440532013000","note":"caf\u00e9"}'


def test_keep_args_false_keeps_none_and_the_same_key(ledger: twiceshy.Ledger) -> None:
    """keep_args=False: no arguments in the record, the key and fingerprint unchanged."""
    keeping = ledger.guard("charge", effect=twiceshy.KEYED)
    bare = ledger.guard("charge", effect=twiceshy.KEYED, keep_args=False)
    args = {"iban": "DE89370400440532013000", "amount": 4900}
    with twiceshy.run(SCOPE):
        assert bare.call(args, lambda: "ch_1") == "ch_1"
        assert keeping.call(args, lambda: "ch_2") == "ch_1"  # the same intent: replayed
    key = twiceshy.idempotency_key(SCOPE, "charge", args)
    assert bare.key_for(args, scope=SCOPE) == keeping.key_for(args, scope=SCOPE) == key
    assert kept(ledger, key) is None


def test_redacted_fields_are_hidden_and_the_key_is_not(ledger: twiceshy.Ledger) -> None:
    """redact_args: the named field is stored as the marker; key and fingerprint are those of
    the real value (a retry with another IBAN is refused as key reuse)."""
    guard = ledger.guard(
        "charge", effect=twiceshy.KEYED, redact_args=("iban",), key_args=("order",)
    )
    args = {"order": "o-1", "iban": "DE89370400440532013000", "amount": 4900}
    with twiceshy.run(SCOPE):
        guard.call(args, lambda: "ch_1")
        with pytest.raises(twiceshy.KeyReuseMismatch):
            guard.call({**args, "iban": "FR7630006000011234567890189"}, lambda: "ch_2")
    key = twiceshy.idempotency_key(SCOPE, "charge", {"order": "o-1"})
    assert kept(ledger, key) == '{"order":"o-1"}'  # only what names the intent is kept
    whole = ledger.guard("refund", effect=twiceshy.KEYED, redact_args=("iban",))
    with twiceshy.run(SCOPE):
        whole.call(args, lambda: "re_1")
    key = twiceshy.idempotency_key(SCOPE, "refund", args)
    assert kept(ledger, key) == '{"amount":4900,"iban":"[redacted]","order":"o-1"}'
    assert "DE89" not in str(ledger.store.get("shop", key).record)


def test_arguments_beyond_4_kib_leave_a_marker_of_their_size(ledger: twiceshy.Ledger) -> None:
    """Arguments over 4096 bytes of text are not kept; the marker says how large they were."""
    guard = ledger.guard("mail", effect=twiceshy.KEYED)
    with twiceshy.run(SCOPE):
        guard.call({"body": "x" * 5000}, lambda: "sent")
        guard.call({"body": "y" * 4085}, lambda: "sent")  # 4096 bytes of text exactly
    big = twiceshy.idempotency_key(SCOPE, "mail", {"body": "x" * 5000})
    assert kept(ledger, big) == "<arguments not kept: 5011 bytes, beyond the 4096-byte bound>"
    edge = twiceshy.idempotency_key(SCOPE, "mail", {"body": "y" * 4085})
    assert kept(ledger, edge) == '{"body":"' + "y" * 4085 + '"}'


def _parked(ledger: twiceshy.Ledger, **options: Any) -> tuple[Any, str, list[Any]]:
    """An UNSAFE tool with a reconciler that cannot tell, parked UNKNOWN: its guard, key and
    what the reconciler was asked."""
    asked: list[Any] = []

    def look_up(key: str, args: Any) -> None:
        asked.append(args)

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=look_up, **options)
    def wire(iban: str, amount: int) -> str:
        raise TimeoutError("the bank did not answer")

    with twiceshy.run(SCOPE), pytest.raises(twiceshy.OutcomeUnknown):
        wire("DE89370400440532013000", 4900)
    asked.clear()
    key = twiceshy.idempotency_key(
        SCOPE, "wire", {"iban": "DE89370400440532013000", "amount": 4900}
    )
    return wire.twiceshy, key, asked  # type: ignore[attr-defined]


def test_settle_hands_the_reconciler_the_kept_arguments(ledger: twiceshy.Ledger) -> None:
    """Outside a call, settle and asettle give the reconciler the arguments decoded."""
    guard, key, asked = _parked(ledger, redact_args=("iban",))
    guard.settle(key)
    asyncio.run(guard.asettle(key))
    assert asked == [{"amount": 4900, "iban": "[redacted]"}] * 2


def test_settle_without_kept_arguments_hands_none(ledger: twiceshy.Ledger) -> None:
    """A tool keeping none: the reconciler outside a call gets None, as before."""
    guard, key, asked = _parked(ledger, keep_args=False)
    guard.settle(key)
    assert asked == [None]


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"keep_args": "no"}, TypeError, "keep_args= must be True or False"),
        ({"redact_args": "iban"}, TypeError, "collection of argument names"),
        ({"redact_args": ("iban",), "keep_args": False}, ValueError, "leave out keep_args"),
    ],
)
def test_bad_options_are_refused_when_the_tool_is_made(
    options: dict[str, Any], error: type[Exception], words: str
) -> None:
    """keep_args must be a bool, redact_args names, and not both off and redacting."""
    with twiceshy.Ledger("memory://") as ledger, pytest.raises(error, match=words):
        ledger.guard("charge", effect=twiceshy.KEYED, **options)
