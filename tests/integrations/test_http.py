"""The Idempotency-Key transports for httpx and httpx2, against a provider double on loopback.

The double is ``twiceshy.testing.FakeProvider``, served over HTTP: it records every request's
``Idempotency-Key`` and deduplicates by it, as Stripe does.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from loopback import openai_client

import twiceshy
from twiceshy.integrations import httpx as tx
from twiceshy.integrations import httpx2 as tx2
from twiceshy.testing import FakeProvider, Handling, assert_same_key, assert_took_effect_once

Served = tuple[FakeProvider, str]
"""The provider double and the base URL it is served at."""


@pytest.fixture
def provider() -> Iterator[Served]:
    state = FakeProvider(deduplicate=True)
    with state.serve() as base:
        yield state, base


def _keys(state: FakeProvider) -> list[str | None]:
    """The Idempotency-Key of every request the double saw, in order."""
    return [seen.key for seen in state.requests]


def test_keyed_call_sends_one_header_per_request_content(provider: Served) -> None:
    """Inside a KEYED call, a repeated request carries the same header; another request differs."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx.Client(base_url=base, transport=tx.IdempotencyKeyTransport())

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> list[str]:
        first = client.post("/v1/charges", json={"amount": amount}).json()["id"]
        again = client.post("/v1/charges", json={"amount": amount}).json()["id"]
        other = client.post("/v1/refunds", json={"amount": amount}).json()["id"]
        return [first, again, other]

    with twiceshy.run("run-h1"):
        ids = charge(100)
    with twiceshy.run("run-h2"):
        other_run = charge(100)
    client.close()
    keys = _keys(state)
    assert all(k is not None and len(k) == 64 for k in keys)
    assert keys[0] == keys[1]
    assert keys[2] != keys[0]
    assert ids[0] == ids[1] != ids[2]
    assert set(keys[3:]).isdisjoint(keys[:3])
    assert other_run[0] != ids[0]
    assert_took_effect_once(state.requests[:3], operation="POST /v1/charges")


def test_no_header_outside_keyed_calls(provider: Served) -> None:
    """No header outside a protected call, in an UNSAFE call, on a GET, or over one already set."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx.Client(base_url=base, transport=tx.IdempotencyKeyTransport())

    @ledger.tool(effect=twiceshy.UNSAFE)
    def unsafe() -> None:
        client.post("/v1/charges", json={})

    @ledger.tool(effect=twiceshy.KEYED)
    def keyed() -> None:
        client.get("/v1/charges")
        client.post("/v1/charges", json={}, headers={"Idempotency-Key": "mine"})

    client.post("/v1/charges", json={})
    with twiceshy.run("run-h3"):
        unsafe()
        keyed()
    client.close()
    assert _keys(state) == [None, None, None, "mine"]
    assert state.requests[2].handling is Handling.READ  # the GET


def test_async_transport(provider: Served) -> None:
    """The async transport adds the same header as the sync one for the same request."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")

    @ledger.tool(effect=twiceshy.KEYED)
    async def charge(amount: int) -> str:
        async with httpx.AsyncClient(
            base_url=base, transport=tx.AsyncIdempotencyKeyTransport()
        ) as client:
            response = await client.post("/v1/charges", json={"amount": amount})
            return str(response.json()["id"])

    @ledger.tool(effect=twiceshy.KEYED, name="charge")
    def charge_sync(amount: int) -> str:
        with httpx.Client(base_url=base, transport=tx.IdempotencyKeyTransport()) as client:
            return str(client.post("/v1/charges", json={"amount": amount}).json()["id"])

    async def main() -> str:
        with twiceshy.run("run-h4"):
            return await charge(7)

    first = asyncio.run(main())
    other = twiceshy.Ledger("memory://")  # a second process, say: same intent, same key
    again = other.tool(effect=twiceshy.KEYED, name="charge")(charge_sync.__wrapped__)  # type: ignore[attr-defined]
    with twiceshy.run("run-h4"):
        assert again(7) == first
    keys = _keys(state)
    assert len(keys) == 2
    assert keys[0] == keys[1]
    assert_took_effect_once(state)


def _posted_keys(state: FakeProvider) -> list[str]:
    """The Idempotency-Key of each of the two POSTs the double saw (a try and its retry)."""
    posts = [seen.key for seen in state.requests if seen.operation.startswith("POST ")]
    assert len(posts) == 2
    assert None not in posts
    return [k for k in posts if k is not None]


def test_openai_sdk_retry_carries_the_same_header(provider: Served) -> None:
    """The OpenAI SDK (httpx2) retrying a failed request sends the same Idempotency-Key again."""
    state, base = provider
    state.fail_next()  # a 503: the SDK retries the first request
    ledger = twiceshy.Ledger("memory://")
    client = openai_client(base, max_retries=2)

    @ledger.tool(effect=twiceshy.KEYED)
    def create(name: str) -> str:
        response = client.post("/charges", body={"name": name}, cast_to=httpx2.Response)
        return str(response.json()["id"])

    with twiceshy.run("run-h5"):
        charge_id = create("x")
    client.close()
    posts = _posted_keys(state)
    assert len(posts[0]) == 64  # ours: the SDK itself sends no Idempotency-Key
    assert posts[0] == posts[1]
    assert charge_id == "ch_1"
    assert_took_effect_once(state)
    assert_same_key(state)


def test_sdk_retry_of_a_multipart_upload_carries_the_same_header(
    provider: Served,
) -> None:
    """An SDK's retry of a file upload repeats the header, though each try draws a new boundary."""
    state, base = provider
    state.fail_next()  # a 503: the SDK retries the first request
    ledger = twiceshy.Ledger("memory://")
    client = openai_client(base, max_retries=2)

    @ledger.tool(effect=twiceshy.KEYED)
    def upload(text: str) -> str:
        files = {"file": ("notes.txt", text.encode())}
        response = client.post(
            "/files",
            body={"purpose": "assistants"},
            files=files,
            options={"headers": {"Content-Type": "multipart/form-data"}},
            cast_to=httpx2.Response,
        )
        return str(response.json()["id"])

    with twiceshy.run("run-h6"):
        upload("hello")
    client.close()
    posts = _posted_keys(state)
    assert posts[0] == posts[1]
    assert_took_effect_once(state)


def test_async_multipart_header_follows_the_content(provider: Served) -> None:
    """Async: the same upload twice carries one header; another file's upload another one."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")

    @ledger.tool(effect=twiceshy.KEYED)
    async def upload(text: str) -> None:
        async with httpx.AsyncClient(
            base_url=base, transport=tx.AsyncIdempotencyKeyTransport()
        ) as client:
            for content in (text, text, text + "!"):
                files = {"file": ("notes.txt", content.encode())}
                await client.post("/v1/files", data={"purpose": "x"}, files=files)

    async def main() -> None:
        with twiceshy.run("run-h7"):
            await upload("hello")

    asyncio.run(main())
    keys = _keys(state)
    assert len(keys) == 3
    assert keys[0] is not None
    assert keys[0] == keys[1] != keys[2]


def test_header_reaches_to_thread_and_copied_contexts_only(provider: Served) -> None:
    """As documented: asyncio.to_thread and a copied context get the header; a bare thread none."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx.Client(base_url=base, transport=tx.IdempotencyKeyTransport())

    def send() -> None:
        client.post("/v1/charges", json={"amount": 1})

    @ledger.tool(effect=twiceshy.KEYED)
    async def charge(amount: int) -> None:
        await asyncio.to_thread(send)
        bare = threading.Thread(target=send)
        bare.start()
        bare.join()
        copied = threading.Thread(target=contextvars.copy_context().run, args=(send,))
        copied.start()
        copied.join()

    async def main() -> None:
        with twiceshy.run("run-h8"):
            await charge(1)

    asyncio.run(main())
    client.close()
    keys = _keys(state)
    assert keys[0] is not None
    assert keys == [keys[0], None, keys[0]]


@pytest.mark.parametrize(
    "transport",
    [
        tx.IdempotencyKeyTransport,
        tx.AsyncIdempotencyKeyTransport,
        tx2.IdempotencyKeyTransport,
        tx2.AsyncIdempotencyKeyTransport,
    ],
)
@pytest.mark.parametrize(
    "settings", [{"methods": "POST"}, {"methods": [b"POST"]}, {"effects": twiceshy.KEYED}]
)
def test_settings_that_would_match_nothing_are_refused(
    transport: Any, settings: dict[str, Any]
) -> None:
    """``methods="POST"`` (read letter by letter) or a lone effect raise TypeError at once."""
    with pytest.raises(TypeError, match="must be a collection"):
        transport(**settings)


def test_requests_outside_protected_calls_pass_untouched(provider: Served) -> None:
    """Outside a protected call (or from a bare thread inside one) a POST repeats, headerless."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx2.Client(base_url=base, transport=tx2.IdempotencyKeyTransport())

    def send() -> None:
        client.post("/v1/charges", json={"amount": 1})

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="http")
    def charge(amount: int) -> None:
        for _ in range(2):  # the transport cannot see this call from a bare thread
            bare = threading.Thread(target=send)
            bare.start()
            bare.join()
        raise LookupError("no receipt")

    send()
    send()
    with twiceshy.run("run-h9"), pytest.raises(LookupError):
        charge(1)
    assert [(seen.operation, seen.key) for seen in state.requests] == [
        ("POST /v1/charges", None)
    ] * 4
    # Nothing marked the point of no return: the error reads as "nothing happened" (the
    # caveat docs/http.md states), so the intent was released and runs again.
    with twiceshy.run("run-h9"), pytest.raises(LookupError):
        charge(1)
    client.close()
    assert len(state.requests) == 6


def test_keyed_effect_at_http_error_after_the_request_is_retried_with_the_key(
    provider: Served,
) -> None:
    """KEYED, effect_at="http": an error after the request left retries it with the same key."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx.Client(base_url=base, transport=tx.IdempotencyKeyTransport())
    answers: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED, effect_at="http", backoff=lambda attempt: 0.0)
    def charge(amount: int) -> str:
        answers.append(client.post("/v1/charges", json={"amount": amount}).json()["id"])
        if len(answers) == 1:  # the charge was made; reading its answer failed
            raise httpx.ReadError("connection reset while reading the answer")
        return answers[-1]

    with twiceshy.run("run-h10"):
        assert charge(5) == "ch_1"
    client.close()
    keys = _keys(state)
    assert len(keys) == 2
    assert keys[0] is not None
    assert keys[0] == keys[1]
    assert_took_effect_once(state)
