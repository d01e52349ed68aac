"""twiceshy's errors survive ``pickle`` and ``copy``: message, type and every attribute.

Durable engines journal a step's error (DBOS and Prefect pickle it), process pools send it back
to the parent, and agent frameworks deep-copy their state, tool errors included.
"""

from __future__ import annotations

import concurrent.futures
import copy
import multiprocessing
import pickle
from collections.abc import Callable
from typing import Any

import pytest

import twiceshy
import twiceshy.errors

KEY = "3f1c9a7e5b2d4c6a8e0f1b3d5c7a9e2f4b6d8c0a1e3f5b7d9c2a4e6f8b0d1c3e"


def _unkeyable_value() -> twiceshy.UnkeyableValue:
    error = twiceshy.UnkeyableValue("args.payload", "larger than 65536 bytes")
    error.bound = "max_bytes"
    return error


def _with_note() -> twiceshy.OutcomeUnknown:
    error = twiceshy.OutcomeUnknown("send_mail", KEY, "TimeoutError: the SMTP server hung up")
    error.add_note("seen by the worker on host-2")
    return error


# One realistic instance of every error class; the test below checks that none is missing.
MADE: dict[str, Callable[[], BaseException]] = {
    "TwiceshyError": lambda: twiceshy.TwiceshyError("something twiceshy-specific went wrong"),
    "UnkeyableArgument": lambda: twiceshy.UnkeyableArgument("args.when", "a naive datetime"),
    "UnkeyableType": lambda: twiceshy.UnkeyableType("args.items[2]", "a Decimal has no form"),
    "UnkeyableValue": _unkeyable_value,
    "MissingScope": lambda: twiceshy.MissingScope("charge_card ran outside any twiceshy.run()"),
    "EffectNotDeclared": lambda: twiceshy.EffectNotDeclared(
        "the tool 'charge' has no effect class"
    ),
    "KeyReuseMismatch": lambda: twiceshy.KeyReuseMismatch(
        f"the key {KEY} is in use by a running call of 'charge' with other arguments"
    ),
    "ResultNotStorable": lambda: twiceshy.ResultNotStorable.replayed(
        "export", KEY, "Report", "no JSON form", "Report(rows=12)"
    ),
    "NotApplied": lambda: twiceshy.NotApplied("the provider refused the card before charging"),
    "ReplayedError": lambda: twiceshy.ReplayedError("billing.CardDeclined", "insufficient funds"),
    "OutcomeUnknown": lambda: twiceshy.OutcomeUnknown("send_mail", KEY, "ConnectionResetError"),
    "InProgress": lambda: twiceshy.InProgress(
        "charge_card",
        KEY,
        started_at=1_780_000_000.25,
        lapses_at=1_780_000_030.25,
        effect="keyed",
        resumed=True,
    ),
    "FencedOut": lambda: twiceshy.FencedOut("charge_card", KEY),
    "RepeatedRequest": lambda: twiceshy.RepeatedRequest(
        "send_mail", "POST", "https://api.mail.example/v3/messages"
    ),
    "StoreError": lambda: twiceshy.StoreError("the ledger answered a record of another version"),
    "StoreUnavailable": lambda: twiceshy.StoreUnavailable("PostgreSQL at 127.0.0.1:5432: refused"),
    "LedgerNotFound": lambda: twiceshy.LedgerNotFound("no twiceshy ledger at /tmp/x.db: no table"),
    "EvictionPolicyRefused": lambda: twiceshy.EvictionPolicyRefused(
        "the Redis server's maxmemory-policy is allkeys-lru, not noeviction"
    ),
    "OutcomeNotRecorded": lambda: twiceshy.OutcomeNotRecorded(
        "charge_card", KEY, "StoreUnavailable: the connection dropped"
    ),
}


def _public_errors() -> set[type[BaseException]]:
    """Every exception class that ``twiceshy`` and ``twiceshy.errors`` export."""
    found: set[type[BaseException]] = set()
    for module in (twiceshy, twiceshy.errors):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found.add(value)
    return found


def test_every_public_error_has_an_instance_here() -> None:
    """The table above covers every exported error class, so a new one cannot be left out."""
    made = {type(make()) for make in MADE.values()}
    assert made == _public_errors()
    assert {kind.__name__ for kind in made} == set(MADE)


def _same(copied: BaseException, original: BaseException) -> None:
    assert type(copied) is type(original)
    assert str(copied) == str(original)
    assert copied.args == original.args
    assert vars(copied) == vars(original)
    assert copied is not original


@pytest.mark.parametrize("name", sorted(MADE))
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_an_error_survives_pickle(name: str, protocol: int) -> None:
    """Pickled and loaded, an error keeps its type, its message and every attribute."""
    original = MADE[name]()
    loaded = pickle.loads(pickle.dumps(original, protocol))
    _same(loaded, original)
    _same(pickle.loads(pickle.dumps(loaded, protocol)), original)  # a journal stores it again


@pytest.mark.parametrize("name", sorted(MADE))
def test_an_error_survives_deepcopy_and_copy(name: str) -> None:
    """``copy.deepcopy`` and ``copy.copy`` give an equal error of the same type."""
    original = MADE[name]()
    _same(copy.deepcopy(original), original)
    _same(copy.copy(original), original)


def test_an_in_progress_worded_for_an_engine_survives() -> None:
    """An InProgress worded for a durable engine's unit keeps its words and its fields through
    pickle and deepcopy (DBOS and Prefect journal a unit's error)."""
    original = twiceshy.InProgress(
        "charge_card",
        KEY,
        started_at=1_780_000_000.25,
        lapses_at=1_780_000_030.25,
        effect="keyed",
        ends="DBOS does not run this step again",
        resumable=False,
    )
    for copied in (pickle.loads(pickle.dumps(original)), copy.deepcopy(original)):
        _same(copied, original)
        assert isinstance(copied, twiceshy.InProgress)
        assert (copied.ends, copied.resumable) == ("DBOS does not run this step again", False)


def test_fields_and_notes_survive() -> None:
    """The attributes a caller reads (``tool``, ``key``, ``bound``...) and ``__notes__`` stay."""
    error = pickle.loads(pickle.dumps(_with_note()))
    assert (error.tool, error.key) == ("send_mail", KEY)
    assert error.reason == "TimeoutError: the SMTP server hung up"
    assert error.__notes__ == ["seen by the worker on host-2"]
    assert str(error).startswith("The tool 'send_mail' was started but its outcome is unknown")
    assert str(error).count("outcome is unknown") == 1  # not a message wrapped in a message
    bounded = copy.deepcopy(_unkeyable_value())
    assert (bounded.path, bounded.reason, bounded.bound) == (
        "args.payload",
        "larger than 65536 bytes",
        "max_bytes",
    )
    waiting = pickle.loads(pickle.dumps(MADE["InProgress"]()))
    assert isinstance(waiting, twiceshy.InProgress)
    assert (waiting.started_at, waiting.lapses_at) == (1_780_000_000.25, 1_780_000_030.25)
    assert (waiting.effect, waiting.here, waiting.resumed) == ("keyed", False, True)
    assert isinstance(pickle.loads(pickle.dumps(twiceshy.StoreUnavailable("x"))), ConnectionError)


def _unknown_in_a_child() -> Any:
    """Raised by a real protected call in a worker process: an UNSAFE tool that lost its answer."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_mail(to: str) -> str:
        raise TimeoutError("the SMTP server did not answer")

    with twiceshy.run("run-pool"):
        send_mail("ada@example.com")


def test_an_error_raised_in_a_process_pool_reaches_the_parent_whole() -> None:
    """A process pool pickles a worker's error back: the parent gets the OutcomeUnknown itself."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        future = pool.submit(_unknown_in_a_child)
        with pytest.raises(twiceshy.OutcomeUnknown) as caught:
            future.result(timeout=60)
    error = caught.value
    assert error.tool == "send_mail"
    assert len(error.key) == 64
    assert "TimeoutError" in error.reason
    assert str(error).count("outcome is unknown") == 1
