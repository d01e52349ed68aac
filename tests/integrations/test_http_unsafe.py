"""UNSAFE calls and ``effect_at="http"`` through the transports, against a provider on loopback.

The provider double applies every POST it reads (it deduplicates only by an ``Idempotency-Key``
the caller set) and can lose the answer after applying it: the connection dropped, a 500, or no
answer before the client's timeout. Real clients (openai on httpx2, httpx, httpx2) retry on top.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import httpx2
import openai
import pytest
from loopback import JSONHandler, openai_client, serve

import twiceshy
from twiceshy.integrations import httpx as tx
from twiceshy.integrations import httpx2 as tx2


class Provider:
    """A provider that cannot deduplicate by itself: every POST it reads is one effect."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Idempotency-Key
        self.effects: list[str] = []  # the body of every effect applied
        self.by_key: dict[str, dict[str, Any]] = {}
        self.lose = 0  # how many of the next answers are lost after the effect
        self.how = "drop"  # how an answer is lost: "drop", "500" or "stall"
        self.hold = threading.Event()  # a stalled answer waits for it (set at teardown)
        self.lock = threading.Lock()


@pytest.fixture
def provider() -> Iterator[tuple[Provider, str]]:
    state = Provider()

    class Handler(JSONHandler):
        def do_GET(self) -> None:
            with state.lock:
                state.requests.append(("GET", self.path, self.headers.get("Idempotency-Key")))
            self._answer(200, {"id": "cus_1"})

        def _change(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            key = self.headers.get("Idempotency-Key")
            with state.lock:
                state.requests.append((self.command, self.path, key))
                if key is not None and key in state.by_key:
                    self._answer(200, state.by_key[key])
                    return
                state.effects.append(body.decode(errors="replace"))
                answer = {
                    "id": f"ch_{len(state.effects)}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [],
                }
                if key is not None:
                    state.by_key[key] = answer
                lost = state.lose > 0
                state.lose -= lost
            if not lost:
                self._answer(200, answer)
            elif state.how == "500":
                self._answer(500, {"error": {"message": "upstream hiccup"}})
            else:  # the effect happened; its answer never comes
                if state.how == "stall":
                    state.hold.wait(30)
                self.close_connection = True

        do_POST = do_PUT = _change

    with serve(Handler) as base:
        try:
            yield state, base
        finally:
            state.hold.set()  # a stalled answer ends before the server shuts down


def _chain(error: BaseException | None) -> list[BaseException]:
    """An error and its causes and contexts, outermost first."""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _assert_unknown_text(text: str, tool: str) -> None:
    """What the model must read for an UNSAFE call whose request may have taken effect."""
    assert text.startswith(f"The tool '{tool}' was started but its outcome is unknown (")
    assert "it may or may not have taken effect" in text
    assert "It will not be run again for these arguments. Do not call it again" in text
    assert "try again" not in text.lower()
    assert "httpx" not in text


@pytest.mark.parametrize("how", ["drop", "500", "stall"])
def test_openai_sdk_retry_inside_an_unsafe_tool_is_refused(
    provider: tuple[Provider, str], how: str
) -> None:
    """The SDK's retry after a lost answer never leaves: one effect, and an unknown outcome."""
    state, base = provider
    state.lose, state.how = 1, how
    ledger = twiceshy.Ledger("memory://")
    client = openai_client(base, timeout=0.5 if how == "stall" else 10)  # default max_retries=2
    raised: list[BaseException] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    def summarise(text: str) -> str:
        try:
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}]
            )
        except Exception as exc:
            raised.append(exc)
            raise
        return reply.id

    with twiceshy.run("run-u1"):
        with pytest.raises(twiceshy.OutcomeUnknown) as first:
            summarise("hello")
        with pytest.raises(twiceshy.OutcomeUnknown) as again:  # the model calls it again
            summarise("hello")
    client.close()
    assert len(state.effects) == 1
    assert [m for m, _, _ in state.requests] == ["POST"]
    # What the tool saw: the SDK passes twiceshy's refusal on as it is (not one of its own
    # request errors, so it does not retry it again); the lost answer is no cause of it.
    assert len(raised) == 1
    refusal = raised[0]
    assert isinstance(refusal, twiceshy.RepeatedRequest)
    assert refusal in _chain(first.value)
    assert refusal.url == f"{base}/v1/chat/completions"
    text = str(first.value)
    _assert_unknown_text(text, "summarise")
    assert "RepeatedRequest: the UNSAFE tool 'summarise' refused to send POST" in text
    assert "a second time (an HTTP client retrying it): the first may have taken effect)" in text
    assert str(again.value) == text


def test_async_openai_sdk_retry_inside_an_unsafe_tool_is_refused(
    provider: tuple[Provider, str],
) -> None:
    """The async SDK and transport: its retry after a dropped answer never leaves either."""
    state, base = provider
    state.lose = 1
    ledger = twiceshy.Ledger("memory://")
    raised: list[BaseException] = []

    @ledger.tool(effect=twiceshy.UNSAFE)
    async def summarise(text: str) -> str:
        client = openai.AsyncOpenAI(
            base_url=f"{base}/v1",
            api_key="x",
            http_client=httpx2.AsyncClient(transport=tx2.AsyncIdempotencyKeyTransport()),
        )
        async with client:
            try:
                reply = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": text}]
                )
            except Exception as exc:
                raised.append(exc)
                raise
        return reply.id

    async def main() -> list[BaseException]:
        answers: list[BaseException] = []
        async with twiceshy.run("run-u2"):
            for _ in range(2):
                try:
                    await summarise("hello")
                except twiceshy.OutcomeUnknown as exc:
                    answers.append(exc)
        return answers

    answers = asyncio.run(main())
    assert len(state.effects) == 1
    assert len(state.requests) == 1
    assert len(answers) == 2
    assert isinstance(raised[0], twiceshy.RepeatedRequest)
    assert raised[0] in _chain(answers[0])
    _assert_unknown_text(str(answers[0]), "summarise")
    assert str(answers[1]) == str(answers[0])


def _retrying(send: Callable[[], Any], errors: type[Exception]) -> Any:
    """A tool's own retry loop (as a retry library would do it): three tries on transport errors."""
    for _ in range(2):
        try:
            return send()
        except errors:
            continue
    return send()


async def _aretrying(send: Callable[[], Any], errors: type[Exception]) -> Any:
    """The async twin of :func:`_retrying`."""
    for _ in range(2):
        try:
            return await send()
        except errors:
            continue
    return await send()


@pytest.mark.parametrize(("module", "tmod"), [(httpx, tx), (httpx2, tx2)], ids=["httpx", "httpx2"])
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_plain_client_retry_inside_an_unsafe_tool_is_refused(
    provider: tuple[Provider, str], module: Any, tmod: Any, blocking: bool
) -> None:
    """httpx and httpx2, sync and async: a retry of a POST whose answer was lost never leaves."""
    state, base = provider
    state.lose = 1
    ledger = twiceshy.Ledger("memory://")
    url = f"{base}/v1/mails"

    if blocking:

        @ledger.tool(effect=twiceshy.UNSAFE, name="send_mail")
        def send_mail(to: str) -> str:
            with module.Client(transport=tmod.IdempotencyKeyTransport()) as client:
                post = lambda: client.post(url, json={"to": to})  # noqa: E731
                return str(_retrying(post, module.TransportError).json()["id"])

        def call() -> str:
            with twiceshy.run("run-u3"):
                return send_mail("ann@example.com")

    else:

        @ledger.tool(effect=twiceshy.UNSAFE, name="send_mail")
        async def asend_mail(to: str) -> str:
            async with module.AsyncClient(transport=tmod.AsyncIdempotencyKeyTransport()) as client:
                post = lambda: client.post(url, json={"to": to})  # noqa: E731
                return str((await _aretrying(post, module.TransportError)).json()["id"])

        async def acall() -> str:
            async with twiceshy.run("run-u3"):
                return await asend_mail("ann@example.com")

        def call() -> str:
            return asyncio.run(acall())

    with pytest.raises(twiceshy.OutcomeUnknown) as unknown:
        call()
    assert isinstance(unknown.value.__cause__, twiceshy.RepeatedRequest)
    _assert_unknown_text(str(unknown.value), "send_mail")
    with pytest.raises(twiceshy.OutcomeUnknown) as again:  # the model calls it again
        call()
    assert str(again.value) == str(unknown.value)
    assert len(state.effects) == 1
    assert len(state.requests) == 1


def test_unsafe_request_with_its_own_key_may_be_repeated(provider: tuple[Provider, str]) -> None:
    """A request carrying the caller's own Idempotency-Key is retried; the provider dedupes it."""
    state, base = provider
    state.lose = 1
    ledger = twiceshy.Ledger("memory://")
    client = openai_client(base)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def summarise(text: str) -> str:
        reply = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": text}],
            extra_headers={"Idempotency-Key": "caller-chose-this"},
        )
        return reply.id

    with twiceshy.run("run-u4"):
        assert summarise("hello") == "ch_1"
    client.close()
    assert state.requests == [("POST", "/v1/chat/completions", "caller-chose-this")] * 2
    assert len(state.effects) == 1


def test_only_identical_requests_of_the_configured_methods_are_refused(
    provider: tuple[Provider, str],
) -> None:
    """GETs repeat, other URLs and bodies go, unlisted methods repeat; a listed one does not."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx.Client(base_url=base, transport=tx.IdempotencyKeyTransport(methods={"PUT"}))

    @ledger.tool(effect=twiceshy.UNSAFE)
    def sync_profile(name: str) -> None:
        client.get("/v1/profile")
        client.get("/v1/profile")
        client.post("/v1/profile", json={"name": name})
        client.post("/v1/profile", json={"name": name})  # POST is not listed here
        client.put("/v1/profile", json={"name": name})
        client.put("/v1/profile", json={"name": name + "!"})
        client.put("/v1/avatar", json={"name": name})
        client.put("/v1/profile", json={"name": name})

    with twiceshy.run("run-u5"), pytest.raises(twiceshy.OutcomeUnknown) as unknown:
        sync_profile("ann")
    client.close()
    assert isinstance(unknown.value.__cause__, twiceshy.RepeatedRequest)
    assert unknown.value.__cause__.method == "PUT"
    assert [(m, p) for m, p, _ in state.requests] == [
        ("GET", "/v1/profile"),
        ("GET", "/v1/profile"),
        ("POST", "/v1/profile"),
        ("POST", "/v1/profile"),
        ("PUT", "/v1/profile"),
        ("PUT", "/v1/profile"),
        ("PUT", "/v1/avatar"),
    ]


def test_sdk_retry_of_an_unsafe_upload_is_refused(provider: tuple[Provider, str]) -> None:
    """A multipart upload retried by the SDK is the same request, though its boundary is new."""
    state, base = provider
    state.lose = 1
    ledger = twiceshy.Ledger("memory://")
    client = openai_client(base)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def upload(text: str) -> str:
        reply = client.files.create(file=("notes.txt", text.encode()), purpose="assistants")
        return reply.id

    with twiceshy.run("run-u6"), pytest.raises(twiceshy.OutcomeUnknown) as unknown:
        upload("hello")
    client.close()
    assert isinstance(unknown.value.__cause__, twiceshy.RepeatedRequest)
    assert len(state.effects) == 1
    assert len(state.requests) == 1


def test_unsafe_calls_given_headers_still_refuse_repeats(provider: tuple[Provider, str]) -> None:
    """``effects=`` adding the header to UNSAFE calls does not let their repeats through."""
    state, base = provider
    state.lose = 1
    ledger = twiceshy.Ledger("memory://")
    transport = tx.IdempotencyKeyTransport(effects=(twiceshy.KEYED, twiceshy.UNSAFE))

    @ledger.tool(effect=twiceshy.UNSAFE)
    def send_mail(to: str) -> None:
        with httpx.Client(base_url=base, transport=transport) as client:
            request = client.build_request("POST", "/v1/mails", json={"to": to})
            _retrying(lambda: client.send(request), httpx.TransportError)  # the same object

    with twiceshy.run("run-u7"), pytest.raises(twiceshy.OutcomeUnknown) as unknown:
        send_mail("ann@example.com")
    assert isinstance(unknown.value.__cause__, twiceshy.RepeatedRequest)
    assert len(state.requests) == 1
    assert len(state.requests[0][2] or "") == 64  # it got the derived header
    assert len(state.effects) == 1


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_effect_at_http_error_before_the_first_request_releases(
    provider: tuple[Provider, str], blocking: bool
) -> None:
    """Before any request nothing happened (released, runs again); after one, it is unknown."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    settings: dict[str, str] = {}  # the provider's URL, missing at first

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="http", name="send_mail")
    def send_mail(to: str) -> str:
        url = settings["MAIL_URL"]  # KeyError before anything is sent
        with httpx.Client(transport=tx.IdempotencyKeyTransport()) as client:
            return str(client.post(url, json={"to": to}).json()["id"])

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="http", name="send_mail")
    async def asend_mail(to: str) -> str:
        url = settings["MAIL_URL"]
        async with httpx.AsyncClient(transport=tx.AsyncIdempotencyKeyTransport()) as client:
            return str((await client.post(url, json={"to": to})).json()["id"])

    def call() -> str:
        if blocking:
            with twiceshy.run("run-u8"):
                return send_mail("ann@example.com")

        async def main() -> str:
            async with twiceshy.run("run-u8"):
                return await asend_mail("ann@example.com")

        return asyncio.run(main())

    with pytest.raises(KeyError):
        call()
    released = ledger.store.records(ledger.namespace, states=[twiceshy.State.RELEASED])
    assert len(released) == 1  # nothing happened, the ledger says
    settings["MAIL_URL"] = f"{base}/v1/mails"
    state.lose = 1
    with pytest.raises(twiceshy.OutcomeUnknown) as unknown:  # it ran; its answer was lost
        call()
    assert isinstance(unknown.value.__cause__, httpx.RemoteProtocolError)
    _assert_unknown_text(str(unknown.value), "send_mail")
    assert "RemoteProtocolError: Server disconnected without sending a response" in str(
        unknown.value
    )
    with pytest.raises(twiceshy.OutcomeUnknown):  # the model calls it again
        call()
    assert len(state.effects) == 1


def test_effect_at_http_a_lookup_is_the_first_request_too(provider: tuple[Provider, str]) -> None:
    """A GET marks the point of no return as well: an error after it is ambiguous."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx2.Client(base_url=base, transport=tx2.IdempotencyKeyTransport())

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="http")
    def refund(customer: str) -> None:
        found = client.get(f"/v1/customers/{customer}").json()
        raise LookupError(f"no charge to refund for {found['id']}")

    with twiceshy.run("run-u9"):
        for _ in range(2):
            with pytest.raises(twiceshy.OutcomeUnknown, match="LookupError: no charge"):
                refund("ann")
    client.close()
    assert [m for m, _, _ in state.requests] == ["GET"]


def test_effect_at_http_lost_lease_stops_the_request(provider: tuple[Provider, str]) -> None:
    """A call whose intent was taken over meanwhile raises FencedOut; its request never leaves."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx2.Client(base_url=base, transport=tx2.IdempotencyKeyTransport())
    lease = 0.2
    raised: list[BaseException] = []

    @ledger.tool(effect=twiceshy.UNSAFE, effect_at="http", lease=lease, wait=0)
    def send_mail(to: str) -> None:
        # Another process takes the intent over (a real store write at the record's fence) ...
        key = twiceshy.current_key()
        assert key is not None
        record = ledger.store.get(ledger.namespace, key).record
        assert record is not None
        change = twiceshy.Change(
            fence=record.fence,
            from_states=frozenset({twiceshy.State.CLAIMED}),
            to=twiceshy.State.CLAIMED,
            new_owner="another-process",
            lease=60.0,
        )
        assert ledger.store.write(ledger.namespace, key, change).won
        # ... while this one is slow to send: long enough that it must ask the store again.
        started = time.monotonic()
        while time.monotonic() < started + lease:
            time.sleep(lease / 4)
        try:
            client.post(f"{base}/v1/mails", json={"to": to})
        except Exception as exc:
            raised.append(exc)
            raise

    with twiceshy.run("run-u10"), pytest.raises(twiceshy.InProgress) as busy:
        send_mail("ann@example.com")
    client.close()
    assert state.requests == []
    assert len(raised) == 1
    assert isinstance(raised[0], twiceshy.FencedOut)
    text = str(busy.value)
    assert text.startswith("An identical call of the tool 'send_mail' started at ")
    assert "This call did not start it a second time." in text
    assert "try again" not in text.lower()


def test_a_request_from_a_thread_left_behind_by_an_unsafe_attempt_is_refused(
    provider: tuple[Provider, str],
) -> None:
    """An UNSAFE tool gave up on a worker (its own timeout) before any request; the intent was
    released and run again. The worker's late POST never leaves: FencedOut, one effect."""
    state, base = provider
    ledger = twiceshy.Ledger("memory://")
    client = httpx2.Client(transport=tx2.IdempotencyKeyTransport())
    go = threading.Event()
    refused: list[BaseException] = []
    workers: list[threading.Thread] = []

    def late(body: str) -> None:
        go.wait(5)
        try:
            client.post(f"{base}/v1/charges", content=body)
        except twiceshy.FencedOut as exc:
            refused.append(exc)

    @ledger.tool(effect=twiceshy.UNSAFE)
    def charge(order: str) -> str:
        if not workers:
            worker = threading.Thread(target=contextvars.copy_context().run, args=(late, order))
            workers.append(worker)
            worker.start()
            raise twiceshy.NotApplied("the worker did not start in time")
        return client.post(f"{base}/v1/charges", content=order).json()["id"]

    with twiceshy.run("run-u9"):
        with pytest.raises(twiceshy.NotApplied):
            charge("o-1")
        assert charge("o-1") == "ch_1"
    go.set()
    workers[0].join(5)
    client.close()
    assert len(refused) == 1
    assert state.effects == ["o-1"]
