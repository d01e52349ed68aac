"""The ASGI middleware, through FastAPI's and Starlette's own apps and test client.

The incident, re-enacted: a webhook (or any request) is delivered again by its sender with the
same ``Idempotency-Key``. Without a scope of the delivery, the agent run it starts is a new run
(a new ``run_id``), every key below it changes, and the charge is made again. With the
middleware, the second delivery names the same intents: one effect, and the same answer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import BackgroundTasks, FastAPI
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger
from twiceshy.integrations.asgi import IdempotencyKeyMiddleware
from twiceshy.integrations.pydantic_ai import TwiceshyCapability
from twiceshy.testing import FakeProvider

HOOK = "/webhooks/orders"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "scope.md"


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


class Shop:
    """A FastAPI app whose webhook sends a receipt (UNSAFE: the mail gateway deduplicates
    nothing) and charges (KEYED), counting what its endpoint was asked."""

    def __init__(self, ledger: Ledger, **options: Any) -> None:
        self.mail = FakeProvider()
        self.payments = FakeProvider(deduplicate=True)
        self.entered: list[str] = []
        self.lookups = 0
        app = FastAPI()

        @ledger.tool(effect=UNSAFE)
        async def send_receipt(order: str) -> str:
            return str(self.mail.send_mail(f"{order}@example.com", f"receipt {order}")["id"])

        @ledger.tool(effect=KEYED)
        async def charge(order: str, amount: int) -> str:
            made = self.payments.charge(amount, order, idempotency_key=twiceshy.current_key())
            return str(made["id"])

        @ledger.tool(effect=SAFE)
        async def lookup(order: str) -> int:
            self.lookups += 1
            return 4900

        @app.post(HOOK)
        async def order_paid(event: dict[str, Any]) -> dict[str, Any]:
            self.entered.append(event["order"])
            amount = await lookup(event["order"])
            return {
                "charge": await charge(event["order"], amount),
                "receipts": [await send_receipt(order) for order in event.get("receipts", [])],
                "scope": twiceshy.current_scope(),
            }

        @app.get("/orders")
        async def orders() -> dict[str, Any]:
            return {"scope": twiceshy.current_scope()}

        @app.post("/open")
        async def unprotected() -> dict[str, Any]:
            self.entered.append("open")
            try:
                await send_receipt("o-open")
            except twiceshy.MissingScope:
                return {"refused": True, "scope": twiceshy.current_scope()}
            return {"refused": False}

        app.add_middleware(IdempotencyKeyMiddleware, **options)
        self.app = app

    def client(self) -> TestClient:
        """A test client; entered, it runs the app's lifespan through the middleware too."""
        return TestClient(self.app)


def deliver(client: TestClient, key: str | None, order: str = "o-1", **event: Any) -> Any:
    """POST the webhook's event, with ``key`` as its Idempotency-Key (none when ``None``)."""
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(HOOK, json={"order": order, **event}, headers=headers)


# -- the incident ------------------------------------------------------------------------


def test_the_same_delivery_twice_takes_effect_once_and_answers_the_same(ledger: Ledger) -> None:
    """A webhook delivered twice with one Idempotency-Key charges and mails once; same body."""
    shop = Shop(ledger)
    with shop.client() as client:
        first = deliver(client, "evt_1", receipts=["o-1"])
        again = deliver(client, "evt_1", receipts=["o-1"])
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()
    assert first.json()["charge"] == "ch_1"
    assert first.json()["receipts"] == ["msg_1"]
    assert len(shop.mail.effects) == 1
    assert len(shop.payments.requests) == 1  # the KEYED charge was replayed, not re-sent
    assert shop.entered == ["o-1", "o-1"]  # the endpoint ran both times


def test_two_keys_are_two_runs(ledger: Ledger) -> None:
    """Two deliveries with different keys are two runs: two charges, two receipts."""
    shop = Shop(ledger)
    with shop.client() as client:
        first = deliver(client, "evt_1", receipts=["o-1"]).json()
        second = deliver(client, "evt_2", receipts=["o-1"]).json()
    assert first["charge"] != second["charge"]
    assert first["receipts"] != second["receipts"]
    assert len(shop.mail.effects) == 2
    assert len(shop.payments.effects) == 2


def test_the_scope_names_header_method_path_and_key(ledger: Ledger) -> None:
    """The default scope is the documented text; another path is another run."""
    shop = Shop(ledger)
    with shop.client() as client:
        body = deliver(client, 'evt "1"').json()
        assert body["scope"] == 'http ["idempotency-key","POST","/webhooks/orders","evt \\"1\\""]'
        other = client.post("/open", headers={"Idempotency-Key": 'evt "1"'}).json()
    assert other == {"refused": False}
    assert len(shop.mail.effects) == 1  # /open's receipt, in a scope of its own


def test_an_agent_run_started_by_the_webhook_charges_once(ledger: Ledger) -> None:
    """A Pydantic AI run (a fresh run_id each time) started by a redelivered webhook: one charge."""
    payments = FakeProvider()

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned = [
            part.content
            for message in messages
            for part in message.parts
            if part.part_kind == "tool-return"
        ]
        if returned:
            return ModelResponse(parts=[TextPart(f"charged: {returned[-1]}")])
        return ModelResponse(parts=[ToolCallPart("charge", {"order": "o-1", "amount": 4900})])

    agent = Agent(
        FunctionModel(model), capabilities=[TwiceshyCapability(ledger, {"charge": UNSAFE})]
    )

    @agent.tool_plain
    def charge(order: str, amount: int) -> str:
        return str(payments.charge(amount, order)["id"])

    app = FastAPI()
    run_ids: list[str] = []

    @app.post(HOOK)
    async def order_paid(event: dict[str, Any]) -> dict[str, str]:
        result = await agent.run(f"charge order {event['order']}")  # no run_id: a new one
        run_ids.append(result.run_id)
        return {"answer": result.output}

    app.add_middleware(IdempotencyKeyMiddleware)
    with TestClient(app) as client:
        first = deliver(client, "evt_1").json()
        again = deliver(client, "evt_1").json()
        other = deliver(client, "evt_2").json()
    assert len(set(run_ids)) == 3  # Pydantic AI drew a new run id for every delivery
    assert first == again == {"answer": "charged: ch_1"}
    assert other == {"answer": "charged: ch_2"}
    assert len(payments.effects) == 2


# -- no header, a bad header ---------------------------------------------------------------


def test_a_request_without_the_header_is_refused_and_nothing_runs(ledger: Ledger) -> None:
    """No Idempotency-Key: 400 with a problem document naming the header; the app never runs."""
    shop = Shop(ledger)
    with shop.client() as client:
        refused = deliver(client, None)
    assert refused.status_code == 400
    assert refused.headers["content-type"] == "application/problem+json"
    problem = refused.json()
    assert problem["status"] == 400
    assert problem["title"] == "Bad Request"
    assert problem["detail"].startswith("This request needs the Idempotency-Key header.")
    assert "the same on every retry" in problem["detail"]
    assert shop.entered == []
    assert shop.mail.requests == shop.payments.requests == []


def test_without_the_header_a_request_passes_unscoped_when_not_required(ledger: Ledger) -> None:
    """required=False: the app runs with no scope, and a protected tool refuses to run."""
    shop = Shop(ledger, required=False)
    with shop.client() as client:
        answer = client.post("/open").json()
        scoped = client.post("/open", headers={"Idempotency-Key": "k"}).json()
    assert answer == {"refused": True, "scope": None}
    assert scoped == {"refused": False}
    assert shop.entered == ["open", "open"]
    assert len(shop.mail.requests) == 1  # the scoped request's receipt only


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ([("Idempotency-Key", "")], "The Idempotency-Key header is empty."),
        ([("Idempotency-Key", '""')], "The Idempotency-Key header is empty."),
        ([("Idempotency-Key", "k" * 256)], "is longer than 255 characters."),
        ([("Idempotency-Key", "caf\xe9")], "characters other than printable ASCII."),
        ([("Idempotency-Key", "a\tb")], "characters other than printable ASCII."),
        ([("Idempotency-Key", '"unclosed')], "is not one quoted string."),
        ([("Idempotency-Key", '"a"b"')], "is not one quoted string."),
        ([("Idempotency-Key", '"a\\b"')], "is not one quoted string."),
        ([("Idempotency-Key", "a"), ("idempotency-key", "a")], "has 2 Idempotency-Key headers"),
    ],
)
def test_a_malformed_header_is_refused_even_when_not_required(
    ledger: Ledger, headers: list[tuple[str, str]], reason: str
) -> None:
    """An empty, too long, non-ASCII, badly quoted or repeated header: 400, nothing runs."""
    shop = Shop(ledger, required=False)
    raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    with shop.client() as client:
        refused = client.post(HOOK, json={"order": "o-1"}, headers=raw)
    assert refused.status_code == 400
    assert reason in refused.json()["detail"]
    assert shop.entered == []
    assert shop.payments.requests == []


def test_a_quoted_key_is_the_key_it_quotes(ledger: Ledger) -> None:
    """``"evt_1"`` (the IETF draft's structured string) and ``evt_1`` name one delivery."""
    shop = Shop(ledger)
    with shop.client() as client:
        bare = deliver(client, "evt_1", receipts=["o-1"]).json()
        quoted = deliver(client, '"evt_1"', receipts=["o-1"]).json()
        spaced = deliver(client, '  "evt_1"  ', receipts=["o-1"]).json()
    assert bare == quoted == spaced
    assert len(shop.mail.effects) == 1


# -- what it covers --------------------------------------------------------------------------


def test_methods_and_paths_limit_what_is_refused_and_scoped(ledger: Ledger) -> None:
    """GET passes by default; ``paths=`` covers whole segments; an uncovered request is unscoped."""
    with Shop(ledger).client() as client:
        assert client.get("/orders").json() == {"scope": None}  # GET is not covered by default
    shop = Shop(ledger, paths=["/webhooks/"])
    with shop.client() as client:
        assert client.get("/orders").json() == {"scope": None}
        assert client.get("/orders", headers={"Idempotency-Key": "k"}).json() == {"scope": None}
        assert client.post("/open").json() == {"refused": True, "scope": None}
        assert deliver(client, None).status_code == 400
    every = Shop(ledger, methods=None, paths=["/orders"])
    with every.client() as client:
        assert client.get("/orders").status_code == 400
        assert client.get("/orders", headers={"Idempotency-Key": "k"}).json() == {
            "scope": 'http ["idempotency-key","GET","/orders","k"]'
        }
    with Shop(ledger, methods=["get"]).client() as client:  # method names in any case
        assert client.get("/orders").status_code == 400
        assert client.post("/open").json() == {"refused": True, "scope": None}
    prefix = Shop(ledger, paths=["/op"])  # not a segment of /open
    with prefix.client() as client:
        assert client.post("/open").json() == {"refused": True, "scope": None}


def test_another_header_names_the_delivery(ledger: Ledger) -> None:
    """``header="X-GitHub-Delivery"``: GitHub's delivery id scopes the run; case does not matter."""
    shop = Shop(ledger, header="X-GitHub-Delivery")
    with shop.client() as client:
        missing = deliver(client, "evt_1")  # an Idempotency-Key is not the header asked for
        headers = {"x-github-delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958"}
        first = client.post(HOOK, json={"order": "o-1", "receipts": ["o-1"]}, headers=headers)
        again = client.post(HOOK, json={"order": "o-1", "receipts": ["o-1"]}, headers=headers)
    assert missing.status_code == 400
    assert "needs the X-GitHub-Delivery header" in missing.json()["detail"]
    assert first.json() == again.json()
    assert first.json()["scope"].startswith('http ["x-github-delivery","POST",')
    assert len(shop.mail.effects) == 1


def test_a_scope_function_keeps_tenants_apart() -> None:
    """``scope=`` (sync or async) names the run: one key from two tenants is two runs."""

    def tenant_scope(request: Any, key: str) -> str:
        tenant = dict(request["headers"]).get(b"x-tenant", b"").decode()
        return json.dumps(["orders", tenant, key])

    async def later(request: Any, key: str) -> str:
        return tenant_scope(request, key)

    charges: list[str] = []
    for scope in (tenant_scope, later):
        with Ledger("memory://") as fresh, Shop(fresh, scope=scope).client() as client:
            for tenant in ("acme", "globex", "acme"):
                headers = {"Idempotency-Key": "evt_1", "X-Tenant": tenant}
                body = client.post(HOOK, json={"order": "o-1"}, headers=headers).json()
                assert body["scope"] == json.dumps(["orders", tenant, "evt_1"])
                charges.append(body["charge"])
    assert charges == ["ch_1", "ch_2", "ch_1"] * 2  # acme's second delivery got its first charge


def test_a_scope_function_that_answers_no_scope_runs_nothing(ledger: Ledger) -> None:
    """A ``scope=`` answering an empty string fails the request loudly; the endpoint never runs."""
    shop = Shop(ledger, scope=lambda request, key: "")
    with shop.client() as client, pytest.raises(TypeError, match="non-empty string"):
        deliver(client, "evt_1")
    assert shop.entered == []


# -- the whole request -----------------------------------------------------------------------


def test_background_tasks_streams_and_threads_run_in_the_scope(ledger: Ledger) -> None:
    """A sync endpoint, FastAPI's background tasks, a streamed body: one effect per delivery."""
    mail = FakeProvider()

    @ledger.tool(effect=UNSAFE)
    def notify(to: str) -> str:
        return str(mail.send_mail(to, "paid")["id"])

    app = FastAPI()

    @app.post("/sync")
    def in_a_thread() -> dict[str, str]:  # run in Starlette's thread pool
        return {"id": notify("sync@example.com")}

    @app.post("/later")
    async def afterwards(tasks: BackgroundTasks) -> dict[str, bool]:
        tasks.add_task(notify, "background@example.com")  # run after the response is sent
        return {"queued": True}

    @app.post("/stream")
    async def streamed() -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            yield "sending "
            yield notify("stream@example.com")

        return StreamingResponse(body())

    app.add_middleware(IdempotencyKeyMiddleware)
    with TestClient(app) as client:
        for _ in range(2):
            for path in ("/sync", "/later", "/stream"):
                answer = client.post(path, headers={"Idempotency-Key": "evt_1"})
                assert answer.status_code == 200, answer.text
    assert sorted(seen.fields["to"] for seen in mail.effects) == [
        "background@example.com",
        "stream@example.com",
        "sync@example.com",
    ]


def test_starlette_background_task_and_middleware_list(ledger: Ledger) -> None:
    """In a Starlette app (``middleware=[...]``), a response's background task is in the scope."""
    mail = FakeProvider()

    @ledger.tool(effect=UNSAFE)
    async def notify(to: str) -> None:
        mail.send_mail(to, "paid")

    async def order_paid(request: Request) -> JSONResponse:
        event = await request.json()
        return JSONResponse({"ok": True}, background=BackgroundTask(notify, event["to"]))

    app = Starlette(
        routes=[Route(HOOK, order_paid, methods=["POST"])],
        middleware=[Middleware(IdempotencyKeyMiddleware)],
    )
    with TestClient(app) as client:
        for key in ("evt_1", "evt_1", "evt_2"):
            client.post(HOOK, json={"to": "a@example.com"}, headers={"Idempotency-Key": key})
    assert len(mail.effects) == 2


def test_a_plain_asgi_app(ledger: Ledger) -> None:
    """Any ASGI app: a bare callable wrapped by the middleware runs in the delivery's scope."""
    mail = FakeProvider()

    @ledger.tool(effect=UNSAFE)
    async def notify() -> str:
        return str(mail.send_mail("a@example.com", "paid")["id"])

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = (await notify()).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    client = TestClient(IdempotencyKeyMiddleware(bare))
    answers = [client.post("/", headers={"Idempotency-Key": "k"}).text for _ in range(2)]
    assert answers == ["msg_1", "msg_1"]
    assert client.post("/").status_code == 400
    assert len(mail.effects) == 1


BARE = """
import asyncio
import sys

for name in ("starlette", "fastapi", "anyio", "httpx", "sniffio"):
    sys.modules[name] = None  # unimportable

import twiceshy
from twiceshy.integrations.asgi import IdempotencyKeyMiddleware

ledger = twiceshy.Ledger("memory://")
effects = []


@ledger.tool(effect=twiceshy.UNSAFE)
async def notify() -> str:
    effects.append(1)
    return f"msg_{len(effects)}"


async def app(scope, receive, send):
    body = (await notify()).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def request(headers):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    await IdempotencyKeyMiddleware(app, mark_replays=ledger)(scope, receive, send)
    start, body = sent
    print(start["status"], dict(start["headers"]).get(b"idempotent-replayed"), body["body"])


async def main():
    for _ in range(2):
        await request([(b"idempotency-key", b"k")])
    await request([])


asyncio.run(main())
"""


def test_the_middleware_needs_no_web_framework() -> None:
    """With Starlette, FastAPI, anyio and httpx unimportable, it imports and scopes requests."""
    ran = subprocess.run(
        [sys.executable, "-c", BARE], capture_output=True, text=True, timeout=120, check=False
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[:2] == ["200 None b'msg_1'", "200 b'true' b'msg_1'"]
    assert lines[2].startswith("400 None b'{")


# -- Idempotent-Replayed ---------------------------------------------------------------------


def test_a_replayed_delivery_is_marked(ledger: Ledger) -> None:
    """With ``mark_replays=``, the response whose effects were all replayed says so; no other."""
    shop = Shop(ledger, mark_replays=ledger)
    with shop.client() as client:
        first = deliver(client, "evt_1", receipts=["o-1"])
        again = deliver(client, "evt_1", receipts=["o-1"])
        # one receipt replayed, one sent now: not a replay
        more = deliver(client, "evt_1", receipts=["o-1", "o-2"])
        none = client.post("/open", headers={"Idempotency-Key": "evt_9"})
        read = client.get("/orders")
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert "idempotent-replayed" not in more.headers
    assert "idempotent-replayed" not in none.headers  # its one call ran
    assert "idempotent-replayed" not in read.headers
    assert shop.lookups == 3  # the SAFE lookup ran every time, and did not spoil the mark


def test_replays_are_not_marked_unless_asked_or_when_streamed(ledger: Ledger) -> None:
    """No ``mark_replays=``: no header. A streamed body cannot carry it, all replayed or not."""
    shop = Shop(ledger)
    with shop.client() as client:
        deliver(client, "evt_1")
        assert "idempotent-replayed" not in deliver(client, "evt_1").headers

    mail = FakeProvider()

    @ledger.tool(effect=UNSAFE)
    async def notify(to: str) -> str:
        return str(mail.send_mail(to, "paid")["id"])

    async def streamed(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            yield await notify("first@example.com")
            yield await notify("second@example.com")  # after the response has started

        return StreamingResponse(body())

    app = Starlette(routes=[Route("/stream", streamed, methods=["POST"])])
    marked = IdempotencyKeyMiddleware(app, mark_replays=[ledger])
    with TestClient(marked) as client:
        answers = [client.post("/stream", headers={"Idempotency-Key": "s"}) for _ in range(2)]
    assert [a.text for a in answers] == ["msg_1msg_2", "msg_1msg_2"]
    assert all("idempotent-replayed" not in a.headers for a in answers)


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"header": "Idempotency Key"}, ValueError),
        ({"header": ""}, ValueError),
        ({"required": "yes"}, TypeError),
        ({"methods": "POST"}, TypeError),
        ({"methods": ["POST", "P OST"]}, ValueError),
        ({"paths": "/webhooks"}, TypeError),
        ({"paths": ["webhooks"]}, ValueError),
        ({"scope": "tenant"}, TypeError),
        ({"max_length": 0}, ValueError),
        ({"max_length": True}, ValueError),
        ({"mark_replays": [object()]}, TypeError),
    ],
)
def test_a_wrong_option_is_refused_when_the_middleware_is_made(
    options: dict[str, Any], error: type[Exception]
) -> None:
    """A malformed option raises when the middleware is made, before any request."""
    app = FastAPI()
    with pytest.raises(error):
        IdempotencyKeyMiddleware(app, **options)


# -- docs/scope.md -----------------------------------------------------------------------------

PRINTED = {
    "webhook_app.py": (
        "{'receipt': 'receipt 1 for order-1234'} {'receipt': 'receipt 1 for order-1234'} true\n"
        "receipts sent: 1\n"
        "without the header: 400\n"
    ),
    "stripe_webhook.py": "{'shipment': 'shipment 1'}\n{'shipment': 'shipment 1'}\nshipped: 1\n",
    "sqs_worker.py": "receipts sent: 1\n",
    "pubsub_push.py": (
        "{'receipt': 'receipt for order-1234'}\n"
        "{'receipt': 'receipt for order-1234'}\n"
        "receipts sent: 1\n"
    ),
    "reminders.py": "[('inv-7', 1), ('inv-7', 2)]\n",
}
"""What each runnable example of docs/scope.md prints, in a directory of its own."""


def _examples() -> dict[str, str]:
    """The titled Python blocks of docs/scope.md, by title."""
    return dict(re.findall(r'```python title="([^"]+)"\n(.*?)\n```', PAGE.read_text(), re.S))


def test_every_runnable_example_of_the_page_is_run_here() -> None:
    """The page's titled examples are the ones the next test runs."""
    assert sorted(_examples()) == sorted(PRINTED)


@pytest.mark.parametrize("name", sorted(PRINTED))
def test_the_docs_examples_run_as_printed(name: str, tmp_path: Path) -> None:
    """Each runnable example of docs/scope.md runs as printed and prints what the page says."""
    (tmp_path / name).write_text(_examples()[name] + "\n")
    ran = subprocess.run(
        [sys.executable, name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == PRINTED[name]
