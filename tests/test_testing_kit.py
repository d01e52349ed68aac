"""``twiceshy.testing``: the kit users test their own tools with, and its pytest plugin.

Each part is shown doing what docs/testing.md says, and each assertion failing when it should:
a tool protected wrongly (a fresh key per attempt, KEYED against a provider that does not
deduplicate) or not at all is caught by ``assert_took_effect_once``. The plugin's fixtures are
met as a user meets them, in test files run by ``pytester``.
"""

from __future__ import annotations

import asyncio
import contextlib
import doctest
import functools
import importlib.metadata
import inspect
import re
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest

import twiceshy
import twiceshy.testing
from twiceshy.integrations import httpx as tx
from twiceshy.integrations import httpx2 as tx2
from twiceshy.reconcilers import stripe_like
from twiceshy.testing import (
    AnswerLost,
    FakeProvider,
    Handling,
    IdempotencyKeyReused,
    LoseAnswers,
    ProviderDown,
    ProviderRequest,
    assert_no_effect,
    assert_same_key,
    assert_took_effect_once,
)
from twiceshy.testing import httpx as fx
from twiceshy.testing import httpx2 as fx2

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


def no_backoff(attempt: int) -> float:
    return 0.0


# The provider double.


def test_a_provider_that_does_not_deduplicate_applies_every_request() -> None:
    """Without deduplicate=, every request takes effect, the same key twice included."""
    provider = FakeProvider()
    first = provider.charge(4900, "cus_1", idempotency_key="k1")
    again = provider.charge(4900, "cus_1", idempotency_key="k1")
    mail = provider.send_mail("ann@example.com", "Receipt")
    assert first == {
        "id": "ch_1",
        "status": "succeeded",
        "amount": 4900,
        "customer": "cus_1",
        "currency": "usd",
    }
    assert again["id"] == "ch_2"
    assert mail["id"] == "msg_3"
    assert [r.handling for r in provider.requests] == [Handling.APPLIED] * 3
    assert [r.key for r in provider.effects] == ["k1", "k1", None]


def test_a_deduplicating_provider_answers_a_known_key_with_its_first_answer() -> None:
    """deduplicate=True: the same key and request is one effect; another request is refused."""
    provider = FakeProvider(deduplicate=True)
    first = provider.charge(4900, "cus_1", idempotency_key="k1")
    assert provider.charge(4900, "cus_1", idempotency_key="k1") == first
    with pytest.raises(IdempotencyKeyReused, match="'k1' was used before for another request"):
        provider.charge(5000, "cus_1", idempotency_key="k1")
    other = provider.charge(4900, "cus_1", idempotency_key="k2")
    unkeyed = [provider.charge(4900, "cus_1"), provider.charge(4900, "cus_1")]
    assert other["id"] == "ch_2"
    assert [u["id"] for u in unkeyed] == ["ch_3", "ch_4"]
    handled = [r.handling for r in provider.requests]
    assert handled == [
        Handling.APPLIED,
        Handling.DEDUPLICATED,
        Handling.REFUSED,
        Handling.APPLIED,
        Handling.APPLIED,
        Handling.APPLIED,
    ]
    assert len(provider.effects) == 4


def test_a_lost_answer_follows_the_effect() -> None:
    """lose_answers: the request takes effect, the caller gets a TimeoutError, then answers."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=1)
    with pytest.raises(AnswerLost) as lost:
        provider.charge(4900, "cus_1", idempotency_key="k1")
    assert isinstance(lost.value, TimeoutError)
    assert len(provider.effects) == 1  # it happened
    assert provider.charge(4900, "cus_1", idempotency_key="k1")["id"] == "ch_1"
    first, retry = provider.requests
    assert (first.handling, first.answer_lost) == (Handling.APPLIED, True)
    assert (retry.handling, retry.answer_lost) == (Handling.DEDUPLICATED, False)


def test_a_failure_before_the_effect_leaves_nothing() -> None:
    """fail_next: ProviderDown (a ConnectionError) and no effect; the next request applies."""
    provider = FakeProvider()
    provider.fail_next(2)
    for _ in range(2):
        with pytest.raises(ProviderDown) as down:
            provider.send_mail("ann@example.com", "Hello")
        assert isinstance(down.value, ConnectionError)
    assert provider.effects == []
    assert provider.send_mail("ann@example.com", "Hello")["id"] == "msg_1"
    assert [r.handling for r in provider.requests] == [Handling.FAILED] * 2 + [Handling.APPLIED]


def test_faults_take_a_chosen_error() -> None:
    """error= makes the error raised for a lost answer or a failure, given the operation."""
    provider = FakeProvider()
    provider.lose_answers(error=lambda op: httpx.ReadTimeout(f"{op} timed out"))
    with pytest.raises(httpx.ReadTimeout, match="create_refund timed out"):
        provider.request("create_refund", {"charge": "ch_9"})
    assert provider.effects[0].answer == {"id": "obj_1", "status": "succeeded", "charge": "ch_9"}
    assert provider.effects[0].error == "ReadTimeout: create_refund timed out"


def test_find_looks_up_an_effect_by_key_or_metadata() -> None:
    """find(key): the answer of the effect carrying the key, as key or in its metadata."""
    provider = FakeProvider()
    keyed = provider.charge(100, "cus_1", idempotency_key="k1")
    tagged = provider.charge(200, "cus_2", metadata={"twiceshy_key": "k2"})
    assert provider.find("k1") == keyed
    assert provider.find("k2") == tagged
    assert provider.find("k3") is None


def test_a_reconciler_reads_the_double() -> None:
    """An UNSAFE tool whose answer was lost is settled by stripe_like(provider.find): no rerun."""
    provider = FakeProvider()
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=stripe_like(provider.find))
    def charge(amount: int) -> dict[str, Any]:
        metadata = {"twiceshy_key": twiceshy.current_key()}
        return provider.charge(amount, "cus_1", metadata=metadata)

    provider.lose_answers()
    with twiceshy.run("run-r"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            charge(100)
        assert charge(100)["id"] == "ch_1"
    assert_took_effect_once(provider)
    ledger.close()


def test_a_late_answer_times_out_a_client_that_stopped_waiting() -> None:
    """lose_answers(late=): over HTTP the charge is made and its answer comes after the client's
    read timeout, which the client sees as its own timeout; the next request is answered."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(late=0.5)
    with provider.serve() as base, httpx.Client(base_url=base, timeout=0.1) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/charges", json={"amount": 1}, headers={"Idempotency-Key": "k"})
        again = client.post(
            "/v1/charges", json={"amount": 1}, headers={"Idempotency-Key": "k"}, timeout=10
        )
    assert again.json() == {"id": "ch_1", "status": "succeeded", "amount": 1}
    assert [(r.handling, r.answer_lost) for r in provider.requests] == [
        (Handling.APPLIED, True),
        (Handling.DEDUPLICATED, False),
    ]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda p: p.lose_answers(-1), ValueError),
        (lambda p: p.lose_answers(late=-0.5), ValueError),
        (lambda p: p.lose_answers(late="1"), ValueError),
        (lambda p: p.fail_next(True), TypeError),
        (lambda p: p.charge(1, "c", idempotency_key=5), TypeError),
        (lambda p: p.request(""), TypeError),
        (lambda p: FakeProvider(deduplicate="yes"), TypeError),  # type: ignore[arg-type]
    ],
)
def test_bad_input_is_refused_before_anything_is_recorded(call: Any, error: type) -> None:
    """A negative count, a non-str key, an empty operation: a clear error, nothing recorded."""
    provider = FakeProvider()
    with pytest.raises(error):
        call(provider)
    assert provider.requests == []


# The provider over HTTP.


def test_served_provider_takes_json_keys_and_loses_answers() -> None:
    """Over HTTP: JSON fields, the header's key, a lost answer's connection closed, 503, 400."""
    provider = FakeProvider(deduplicate=True)
    with provider.serve() as base, httpx.Client(base_url=base) as client:
        made = client.post("/v1/charges", json={"amount": 1}, headers={"Idempotency-Key": "k"})
        assert made.status_code == 200
        assert made.json() == {"id": "ch_1", "status": "succeeded", "amount": 1}
        provider.lose_answers()
        with pytest.raises(httpx.RemoteProtocolError):
            client.post("/v1/charges", json={"amount": 2})
        provider.fail_next()
        assert client.post("/v1/charges", json={"amount": 3}).status_code == 503
        reused = client.post("/v1/charges", json={"amount": 9}, headers={"Idempotency-Key": "k"})
        assert reused.status_code == 400
        assert reused.json()["error"]["type"] == "idempotency_error"
        second = {"id": "ch_2", "status": "succeeded", "amount": 2}
        assert client.get("/v1/charges").json() == {"data": [made.json(), second]}
    assert [(r.operation, r.key, r.handling) for r in provider.requests] == [
        ("POST /v1/charges", "k", Handling.APPLIED),
        ("POST /v1/charges", None, Handling.APPLIED),
        ("POST /v1/charges", None, Handling.FAILED),
        ("POST /v1/charges", "k", Handling.REFUSED),
        ("GET /v1/charges", None, Handling.READ),
    ]
    assert provider.requests[1].answer_lost


def test_served_multipart_fields_do_not_depend_on_the_boundary() -> None:
    """Two sends of one upload (two random boundaries) are one request to a deduplicating double."""
    provider = FakeProvider(deduplicate=True)
    with provider.serve() as base, httpx.Client(base_url=base) as client:
        for text in ("hello", "hello", "hello!"):
            files = {"file": ("notes.txt", text.encode())}
            key = {"Idempotency-Key": text.rstrip("!")}
            client.post("/v1/files", data={"purpose": "x"}, files=files, headers=key)
    first, again, other = provider.requests
    assert first.fields == {"purpose": "x", "file": "hello"}
    assert again.handling is Handling.DEDUPLICATED
    assert other.handling is Handling.REFUSED  # the same key for another file


# Lost answers of plain functions.


def test_lose_answers_lets_the_call_happen_then_raises() -> None:
    """The wrapped function runs each time; the first ``times`` answers become AnswerLost."""
    sent: list[str] = []

    def send(to: str, body: str = "hi") -> str:
        sent.append(to)
        return f"msg_{len(sent)}"

    lose = LoseAnswers(times=2)
    wrapped = lose(send)
    for _ in range(2):
        with pytest.raises(AnswerLost, match="send: timed out"):
            wrapped("ann@example.com")
    assert wrapped(to="bob@example.com") == "msg_3"
    assert sent == ["ann@example.com", "ann@example.com", "bob@example.com"]
    assert [(r.fields, r.answer_lost) for r in lose.requests] == [
        ({"to": "ann@example.com", "body": "hi"}, True),
        ({"to": "ann@example.com", "body": "hi"}, True),
        ({"to": "bob@example.com", "body": "hi"}, False),
    ]
    assert [r.answer for r in lose.effects] == ["msg_1", "msg_2", "msg_3"]
    assert lose.left == 0


def test_lose_answers_records_the_key_of_the_call() -> None:
    """The key is the ``idempotency_key`` argument if the function takes one, else current_key()."""

    def add(amount: int) -> int:
        return amount

    def send(amount: int, idempotency_key: str | None = None) -> int:
        return amount

    lose = LoseAnswers(times=0)
    keyless, keyed = lose(add), lose(send)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        return int(keyless(amount)) + int(keyed(amount))  # the second is given no key

    with twiceshy.run("run-k"):
        charge(5)
    expected = twiceshy.idempotency_key("run-k", "charge", {"amount": 5})
    assert [r.key for r in lose.requests] == [expected, None]
    keyed(1, idempotency_key="mine")
    assert lose.requests[-1].key == "mine"
    assert "idempotency_key" not in lose.requests[-1].fields
    ledger.close()


def test_lose_answers_keeps_async_functions_async() -> None:
    """An async function stays a coroutine function with its signature, and loses its answers."""
    runs: list[int] = []

    async def charge(amount: int) -> str:
        runs.append(amount)
        return "ch_1"

    lose = LoseAnswers(times=1, error=lambda op: ConnectionResetError(op))
    wrapped = lose(charge)
    assert inspect.iscoroutinefunction(wrapped)
    assert inspect.signature(wrapped) == inspect.signature(charge)

    async def main() -> str:
        with contextlib.suppress(ConnectionResetError):
            await wrapped(7)
        return await wrapped(7)

    assert asyncio.run(main()) == "ch_1"
    assert runs == [7, 7]
    assert [r.answer_lost for r in lose.requests] == [True, False]


def test_a_call_that_raises_is_recorded_as_no_effect() -> None:
    """A wrapped function's own error passes through; the call is FAILED, not an effect."""
    lose = LoseAnswers(times=1)

    def refuse(amount: int) -> None:
        raise LookupError("no such customer")

    with pytest.raises(LookupError):
        lose(refuse)(3)
    assert lose.left == 1  # an answer that never came cannot be lost
    (seen,) = lose.requests
    assert (seen.handling, seen.error) == (Handling.FAILED, "LookupError: no such customer")
    assert_no_effect(lose)


def test_lose_answers_refuses_what_is_not_a_function() -> None:
    """Wrapping something that cannot be called, or a bad count, is a TypeError at once."""
    with pytest.raises(TypeError, match="wraps a function"):
        LoseAnswers()(42)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="times="):
        LoseAnswers(times=1.5)  # type: ignore[arg-type]


# Lost answers over HTTP, through twiceshy's transports.


@pytest.mark.parametrize(("module", "tmod", "fmod"), [(httpx, tx, fx), (httpx2, tx2, fx2)])
def test_transport_loses_the_answer_after_the_effect(module: Any, tmod: Any, fmod: Any) -> None:
    """The request reaches the provider; the client gets ReadTimeout; a GET and later pass."""
    provider = FakeProvider()
    faulty = fmod.LostAnswerTransport(times=1)
    with provider.serve() as base, module.Client(base_url=base, transport=faulty) as client:
        assert client.get("/v1/charges").status_code == 200
        with pytest.raises(module.ReadTimeout, match="POST"):
            client.post("/v1/charges", json={"amount": 1})
        assert client.post("/v1/charges", json={"amount": 2}).status_code == 200
    assert [r.fields["amount"] for r in provider.effects] == [1, 2]
    assert [r.method for r in faulty.lost] == ["POST"]
    assert faulty.left == 0


@pytest.mark.parametrize(("module", "tmod", "fmod"), [(httpx, tx, fx), (httpx2, tx2, fx2)])
def test_a_keyed_http_tool_retried_after_a_lost_answer_charges_once(
    module: Any, tmod: Any, fmod: Any
) -> None:
    """Under IdempotencyKeyTransport the retry carries the same header: one effect."""
    provider = FakeProvider(deduplicate=True)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    transport = tmod.IdempotencyKeyTransport(fmod.LostAnswerTransport(times=1))
    with provider.serve() as base, module.Client(base_url=base, transport=transport) as client:

        @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff)
        def charge(amount: int) -> str:
            return str(client.post("/v1/charges", json={"amount": amount}).json()["id"])

        with twiceshy.run("run-t"):
            assert charge(4900) == "ch_1"
    effect = assert_took_effect_once(provider)
    assert effect.answer["id"] == "ch_1"
    assert len(assert_same_key(provider)) == 64
    assert len(provider.requests) == 2
    ledger.close()


def test_async_transport_loses_the_answer_after_the_effect() -> None:
    """The async twin: the effect happens, the caller gets httpx.ReadTimeout."""
    provider = FakeProvider()

    async def main(base: str) -> None:
        transport = fx.AsyncLostAnswerTransport(times=1)
        async with httpx.AsyncClient(base_url=base, transport=transport) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/mails", json={"to": "ann@example.com"})

    with provider.serve() as base:
        asyncio.run(main(base))
    assert_took_effect_once(provider)


@pytest.mark.parametrize("settings", [{"methods": "POST"}, {"times": -1}, {"times": False}])
def test_transport_settings_that_make_no_sense_are_refused(settings: dict[str, Any]) -> None:
    """methods="POST" (read letter by letter) or a bad count fail at once."""
    with pytest.raises((TypeError, ValueError)):
        fx.LostAnswerTransport(**settings)


# The assertions, and what they catch.


def _unprotected(provider: FakeProvider) -> None:
    """An agent's retry of an unprotected tool: the second call charges again."""

    def charge(amount: int) -> str:
        return str(provider.charge(amount, "cus_1")["id"])

    with contextlib.suppress(AnswerLost):
        charge(4900)
    charge(4900)


def _keyed(provider: FakeProvider, *, fresh_key: bool) -> None:
    """A KEYED tool handing the provider current_key(), or a key drawn anew in each attempt."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff)
    def charge(amount: int) -> str:
        key = twiceshy.current_key()
        if fresh_key:  # read, but not handed on: a key drawn anew in each attempt instead
            key = str(uuid.uuid4())
        return str(provider.charge(amount, "cus_1", idempotency_key=key)["id"])

    with twiceshy.run("run-w"):
        charge(4900)
    ledger.close()


@pytest.mark.parametrize(
    ("tool", "deduplicate", "why"),
    [
        (_unprotected, True, "None of them carried an idempotency key"),
        (functools.partial(_keyed, fresh_key=True), True, "Each carried another key"),
        (functools.partial(_keyed, fresh_key=False), False, "They all carried one key"),
    ],
    ids=["unprotected", "fresh-key", "keyed-without-dedup"],
)
def test_took_effect_once_catches_a_tool_protected_wrongly_or_not_at_all(
    tool: Any, deduplicate: bool, why: str
) -> None:
    """A double charge fails the assertion; the message lists the requests, keys, and why."""
    provider = FakeProvider(deduplicate=deduplicate)
    provider.lose_answers(times=1)
    tool(provider)
    with pytest.raises(AssertionError) as failed:
        assert_took_effect_once(provider)
    text = str(failed.value)
    assert text.startswith("expected one effect, saw 2.")
    assert why in text
    assert "It saw 2 requests:" in text
    assert re.search(r"1\. charge\(amount=4900, customer='cus_1', currency='usd'\) key=", text)
    assert ": applied, answer lost" in text
    assert "2. charge(" in text


def test_took_effect_once_passes_a_keyed_tool_and_returns_its_effect() -> None:
    """A KEYED tool handing the provider current_key(): one effect, returned to the test."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=2)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED, backoff=no_backoff)
    def charge(amount: int, customer: str) -> str:
        key = twiceshy.current_key()
        return str(provider.charge(amount, customer, idempotency_key=key)["id"])

    with twiceshy.run("run-ok"):
        assert charge(4900, "cus_1") == "ch_1"
        assert charge(4900, "cus_1") == "ch_1"  # a replay: no request at all
    effect = assert_took_effect_once(provider, operation="charge", where={"amount": 4900})
    assert effect is provider.requests[0]
    expected = twiceshy.idempotency_key("run-ok", "charge", {"amount": 4900, "customer": "cus_1"})
    assert assert_same_key(provider, key=expected) == expected
    assert len(provider.requests) == 3
    ledger.close()


def test_took_effect_once_fails_when_nothing_took_effect() -> None:
    """No effect at all, or none matching the filter, fails and says so."""
    provider = FakeProvider()
    with pytest.raises(AssertionError, match=r"saw none\.\nIt saw no request at all\."):
        assert_took_effect_once(provider)
    provider.charge(1, "cus_1")
    with pytest.raises(AssertionError) as failed:
        assert_took_effect_once(provider, where={"amount": 2})
    assert "expected one effect with amount=2, saw none." in str(failed.value)
    assert "(0 of them match.)" in str(failed.value)


def test_an_unsafe_tool_answering_outcome_unknown_took_effect_once() -> None:
    """UNSAFE after a lost answer: OutcomeUnknown every time and one effect; unprotected: two."""
    provider = FakeProvider()
    provider.lose_answers(times=2)
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send(to: str) -> str:
        return str(provider.send_mail(to, "Your receipt")["id"])

    with twiceshy.run("run-u"):
        for _ in range(3):
            with pytest.raises(twiceshy.OutcomeUnknown):
                send("ann@example.com")
    assert_took_effect_once(provider)
    with contextlib.suppress(AnswerLost):
        send.__wrapped__("ann@example.com")  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="saw 2"):
        assert_took_effect_once(provider)
    ledger.close()


def test_no_effect_passes_refusals_and_failures_and_fails_on_an_effect() -> None:
    """Refused and failed requests are no effect; one effect fails with the listing."""
    provider = FakeProvider(deduplicate=True)
    provider.fail_next()
    with pytest.raises(ProviderDown):
        provider.charge(1, "cus_1")
    assert_no_effect(provider)
    provider.charge(1, "cus_1", idempotency_key="k")
    assert_no_effect(provider, operation="send_mail")
    with pytest.raises(AssertionError) as failed:
        assert_no_effect(provider)
    text = str(failed.value)
    assert text.startswith("expected no effect, saw 1.")
    assert "1. charge(amount=1, customer='cus_1', currency='usd') key=none: failed" in text
    assert "2. charge(amount=1, customer='cus_1', currency='usd') key=k: applied" in text


def test_same_key_fails_on_a_missing_key_several_keys_or_the_wrong_key() -> None:
    """assert_same_key names what was wrong: no request, a keyless one, two keys, another key."""
    with pytest.raises(AssertionError, match="every request; no request was made"):
        assert_same_key(FakeProvider())
    keyless = FakeProvider()
    keyless.charge(1, "c", idempotency_key="a")
    keyless.charge(1, "c")
    with pytest.raises(AssertionError, match="1 of 2 had none"):
        assert_same_key(keyless)
    two = FakeProvider()
    long = "f" * 64
    two.charge(1, "c", idempotency_key="a")
    two.charge(1, "c", idempotency_key=long)
    with pytest.raises(AssertionError, match="they had 2: a, ffffffffffffffff…"):
        assert_same_key(two)
    one = FakeProvider()
    one.charge(1, "c", idempotency_key="a")
    with pytest.raises(AssertionError, match="the key b on every request of charge; they had a"):
        assert_same_key(one, key="b", operation="charge")
    assert assert_same_key(one, key="a") == "a"


def test_assertions_take_a_list_of_requests_and_refuse_anything_else() -> None:
    """A plain list of ProviderRequest works; another object is a TypeError naming what to give."""
    effects = [ProviderRequest("charge", {"amount": 1}, "k")]
    assert assert_took_effect_once(effects) is effects[0]
    with pytest.raises(TypeError, match="give a FakeProvider, a LoseAnswers or a list"):
        assert_no_effect(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a ProviderRequest"):
        assert_no_effect(["charge"])  # type: ignore[list-item]


# The package and its plugin.


def test_the_package_docstring_example_runs() -> None:
    """The example in twiceshy.testing's docstring runs as shown."""
    failures, tried = doctest.testmod(twiceshy.testing, verbose=False)
    assert tried > 0
    assert failures == 0


def test_the_kit_needs_only_the_standard_library() -> None:
    """``import twiceshy.testing`` works with pytest, httpx and httpx2 unimportable."""
    code = (
        "import sys\n"
        "for name in ('pytest', 'httpx', 'httpx2', 'http.server'):\n"
        "    sys.modules[name] = None\n"
        "import twiceshy.testing as kit\n"
        "kit.assert_took_effect_once([kit.ProviderRequest('charge')])\n"
        "print(sorted(kit.__all__) == kit.__all__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_loading_the_plugin_imports_nothing_heavy() -> None:
    """The plugin loads twiceshy's core and its kit only: no client, store driver or server."""
    code = (
        "import sys\n"
        "import pytest\n"
        "before = set(sys.modules)\n"
        "import twiceshy.testing.plugin\n"
        "new = set(sys.modules) - before\n"
        "outside = [m for m in new if m.split('.')[0] not in sys.stdlib_module_names]\n"
        "print(sorted(m for m in outside if not m.startswith('twiceshy')))\n"
        "print(sorted(m for m in new if m.startswith(('twiceshy.stores.', 'twiceshy.integ',"
        " 'twiceshy.cli', 'twiceshy.testing.httpx', 'http.server'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "[]"]


def test_pip_install_registers_the_plugin() -> None:
    """pyproject.toml declares the pytest11 entry point, and the installed package carries it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugin = "twiceshy.testing.plugin"
    assert project["entry-points"]["pytest11"] == {plugin: plugin}
    installed = importlib.metadata.entry_points(group="pytest11", name=plugin)
    assert [ep.value for ep in installed] == [plugin], (
        "the installed twiceshy predates its plugin: pip install -e ."
    )


USER_TESTS = """
import contextlib

import pytest

import twiceshy
from twiceshy.testing import AnswerLost, assert_took_effect_once

SEEN = []


def charging(ledger, provider, protect):
    def charge(amount: int) -> str:
        key = twiceshy.current_key()
        return provider.charge(amount, "cus_1", idempotency_key=key)["id"]

    return ledger.tool(effect=twiceshy.KEYED)(charge) if protect else charge


@pytest.mark.fake_provider(deduplicate=True)
@pytest.mark.parametrize("protect", [True, False], ids=["protected", "unprotected"])
def test_charge_once(twiceshy_ledger, fake_provider, protect):
    charge = charging(twiceshy_ledger, fake_provider, protect)
    fake_provider.lose_answers(times=1)
    with twiceshy.run("run-1"):
        with contextlib.suppress(AnswerLost):
            charge(4900)
        charge(4900)
    assert_took_effect_once(fake_provider)
"""


def test_the_fixtures_catch_an_unprotected_tool_as_a_user_meets_them(
    pytester: pytest.Pytester,
) -> None:
    """In a user's test file: the protected tool passes, the unprotected one fails, and says why."""
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*AssertionError: expected one effect, saw 2. None of them carried an idempotency key*",
            "*1. charge(amount=4900, customer='cus_1', currency='usd') key=none: applied, answer"
            " lost",
            "*FAILED test_user.py::test_charge_once[[]unprotected[]]*",
        ]
    )


def test_each_test_gets_a_fresh_ledger_closed_afterwards(pytester: pytest.Pytester) -> None:
    """A SQLite ledger (the marker) lives in the test's tmp_path and is closed after the test."""
    pytester.makepyfile(
        test_fresh="""
        import pytest
        import twiceshy

        KEPT = []
        RUNS = []


        @pytest.mark.twiceshy_ledger("sqlite")
        def test_first(twiceshy_ledger, tmp_path):
            assert twiceshy_ledger.url == f"sqlite:///{tmp_path / 'ledger.db'}"
            KEPT.append(twiceshy_ledger)
            run(twiceshy_ledger)


        def test_second(twiceshy_ledger):
            assert twiceshy_ledger.url == "memory://"
            run(twiceshy_ledger)  # not replayed: another ledger
            assert RUNS == [1, 1]
            with pytest.raises(twiceshy.StoreError, match="is closed"):
                run(KEPT[0])


        def run(ledger):
            tool = ledger.tool(effect=twiceshy.KEYED, name="t")(lambda: RUNS.append(1))
            with twiceshy.run("same-run"):
                tool()
        """
    )
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_the_ini_option_and_the_factory_open_other_ledgers(pytester: pytest.Pytester) -> None:
    """ini twiceshy_ledger=sqlite sets the default; two factory ledgers on one file share it."""
    pytester.makeini("[pytest]\ntwiceshy_ledger = sqlite\n")
    pytester.makepyfile(
        test_factory="""
        import twiceshy

        RUNS = []


        def charge() -> int:
            RUNS.append(1)
            return len(RUNS)


        def test_shared_file(twiceshy_ledger, twiceshy_ledger_factory, tmp_path):
            assert twiceshy_ledger.url == f"sqlite:///{tmp_path / 'ledger.db'}"
            other = twiceshy_ledger_factory("sqlite", remember=10)  # another process, say
            assert twiceshy_ledger_factory().url == "memory://"
            answers = []
            for ledger in (twiceshy_ledger, other):
                tool = ledger.tool(effect=twiceshy.UNSAFE, name="t")(charge)
                with twiceshy.run("r"):
                    answers.append(tool())
            assert answers == [1, 1]
            assert RUNS == [1]
        """
    )
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.postgres
def test_a_server_ledger_gets_a_namespace_per_test(
    pytester: pytest.Pytester, pg: tuple[str, str]
) -> None:
    """On a shared server two tests (and two runs) of one intent never replay each other."""
    url, schema = pg
    pytester.makeini(f"[pytest]\ntwiceshy_ledger = {url}?schema={schema}\n")
    pytester.makepyfile(
        test_server="""
        import pytest
        import twiceshy

        RUNS = []


        @pytest.mark.parametrize("n", [1, 2])
        def test_run(twiceshy_ledger, n):
            assert twiceshy_ledger.namespace.startswith("test-")
            tool = twiceshy_ledger.tool(effect=twiceshy.UNSAFE, name="t")(lambda: RUNS.append(n))
            with twiceshy.run("same-run"):
                tool()
            assert RUNS == list(range(1, n + 1))
        """
    )
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_users_own_fixtures_of_the_same_names_win(pytester: pytest.Pytester) -> None:
    """A conftest's own ``fake_provider`` wins over the plugin's, as a user's fixture must."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def fake_provider():
            return "mine"
        """
    )
    pytester.makepyfile(
        test_own="""
        def test_own(fake_provider):
            assert fake_provider == "mine"
        """
    )
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_plugin_can_be_turned_off(pytester: pytest.Pytester) -> None:
    """``-p no:twiceshy.testing.plugin`` removes the fixtures: a test asking for one errors."""
    pytester.makepyfile(test_off="def test_off(twiceshy_ledger):\n    pass\n")
    result = pytester.runpytest("-p", "no:twiceshy.testing.plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'twiceshy_ledger' not found*"])


def test_a_conftest_naming_the_plugin_does_not_load_it_twice(pytester: pytest.Pytester) -> None:
    """``pytest_plugins = ["twiceshy.testing.plugin"]`` beside the entry point loads it once."""
    pytester.makeconftest('pytest_plugins = ["twiceshy.testing.plugin"]\n')
    pytester.makepyfile(test_on="def test_on(twiceshy_ledger):\n    assert twiceshy_ledger\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def _docs_example() -> str:
    """The example test of docs/testing.md: the first Python block after its marker."""
    text = (ROOT / "docs" / "testing.md").read_text()
    found = re.search(r"<!-- the example -->\s*```python\n(.*?)\n```", text, re.S)
    assert found is not None, "docs/testing.md lost its example"
    return found.group(1)


def test_the_docs_example_passes_with_twiceshy_and_fails_without(
    pytester: pytest.Pytester,
) -> None:
    """docs/testing.md's example passes as shown, and fails once its decorator is removed."""
    example = _docs_example()
    assert len([line for line in example.splitlines() if line.strip()]) == 15
    decorator = re.compile(r"^\s*@twiceshy_ledger\.tool\(.*\)\n", re.M)
    assert len(decorator.findall(example + "\n")) == 1
    pytester.makepyfile(test_with=example)
    pytester.makepyfile(test_without=decorator.sub("", example + "\n"))
    result = pytester.runpytest("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*expected one effect, saw 2. None of them carried an idempotency key*",
            "*FAILED test_without.py::*",
        ]
    )
