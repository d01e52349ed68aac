"""Google ADK trigger deliveries, through ADK's own API server: its FastAPI app (as ``adk
api_server --trigger_sources=pubsub,eventarc`` serves it) receives Pub/Sub pushes and Eventarc
events over ASGI, and runs a real ``LlmAgent`` whose model (a ``Relay``) charges what the
message asks through a protected tool.

ADK runs each delivery in a new session, so a redelivered message (Pub/Sub and Eventarc
redeliver whatever was not acknowledged) would be charged again under the session-id scope; from
ADK 2.12 its trigger routes keep the delivery in the session state, and the scope comes from it.
A provider double counts charges.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.adk.agents import LlmAgent
from google.adk.apps import App
from google.adk.artifacts import InMemoryArtifactService
from google.adk.auth.credential_service.in_memory_credential_service import (
    InMemoryCredentialService,
)
from google.adk.cli import trigger_routes
from google.adk.cli.api_server import ApiServer
from google.adk.cli.utils.base_agent_loader import BaseAgentLoader
from google.adk.evaluation.in_memory_eval_sets_manager import InMemoryEvalSetsManager
from google.adk.evaluation.local_eval_set_results_manager import LocalEvalSetResultsManager
from google.adk.memory import InMemoryMemoryService
from google.adk.sessions import InMemorySessionService
from google.adk.tools import ToolContext
from google.adk.tools.agent_tool import AgentTool
from provider_log import CHARGE, Provider
from scripted_google_adk import Relay

from twiceshy import SAFE, UNSAFE, Ledger
from twiceshy.integrations.google_adk import TRIGGER_DELIVERY, delivery_scope, protect

pytestmark = pytest.mark.skipif(
    not hasattr(trigger_routes, "TRIGGER_DELIVERY_STATE_KEY"),
    reason="this Google ADK release (before 2.12) keeps no record of a trigger's delivery",
)

APP = "shop"
SUBSCRIPTION = "projects/p/subscriptions/billing"
TOPIC_SOURCE = "//pubsub.googleapis.com/projects/p/topics/orders"


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    """An in-memory ledger, then a SQLite one."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(url) as opened:
        yield opened


class Loader(BaseAgentLoader):
    """ADK's agent loader, answering one app built in this process."""

    def __init__(self, app: App) -> None:
        self.app = app

    def load_agent(self, agent_name: str) -> App:
        """The app, whatever its name."""
        return self.app

    def list_agents(self) -> list[str]:
        """The app's name."""
        return [self.app.name]


class Server:
    """ADK's API server for one app, with its trigger routes, and a way to deliver to them."""

    def __init__(self, app: App, agents_dir: str) -> None:
        options: dict[str, Any] = {"trigger_sources": ["pubsub", "eventarc"]}
        if "trigger_auth_verifier" in inspect.signature(ApiServer).parameters:
            options["trigger_auth_verifier"] = lambda request: None  # ADK 2.13 asks for one
        self.sessions = InMemorySessionService()
        self.api = ApiServer(
            agent_loader=Loader(app),
            session_service=self.sessions,
            memory_service=InMemoryMemoryService(),
            artifact_service=InMemoryArtifactService(),
            credential_service=InMemoryCredentialService(),
            eval_sets_manager=InMemoryEvalSetsManager(),
            eval_set_results_manager=LocalEvalSetResultsManager(agents_dir),
            agents_dir=agents_dir,
            **options,
        )
        self.app = self.api.get_fast_api_app()

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        """POST ``body`` to ``/apps/shop/trigger/<path>``, as Pub/Sub or Eventarc does."""

        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://adk") as client:
                return await client.post(f"/apps/{APP}/trigger/{path}", json=body, headers=headers)

        return asyncio.run(send())

    def answers(self, user: str) -> list[str]:
        """The agent's last words in each session of ``user`` (one session per delivery)."""

        async def read() -> list[str]:
            listed = await self.sessions.list_sessions(app_name=APP, user_id=user)
            said = []
            for found in sorted(listed.sessions, key=lambda s: s.last_update_time):
                session = await self.sessions.get_session(
                    app_name=APP, user_id=user, session_id=found.id
                )
                assert session is not None
                texts = [p.text for e in session.events for p in e.content.parts or [] if p.text]
                said.append(texts[-1])
            return said

        return asyncio.run(read())


@pytest.fixture
def effects(tmp_path: Path) -> Provider:
    """The provider double the charges reach."""
    return Provider(tmp_path / "effects")


def server(ledger: Ledger, provider: Provider, where: Path, **protection: Any) -> Server:
    """ADK's API server for an app whose agent charges what each message asks (its ``data``),
    the charge protected as UNSAFE."""

    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(None, amount, customer)

    def arguments(message: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(message)["data"]
        return data

    tools = protect([charge], ledger, effects={"charge": UNSAFE}, **protection)
    agent = LlmAgent(name="billing", model=Relay.of("charge", arguments), tools=tools)
    return Server(App(name=APP, root_agent=agent), str(where))


def pushed(message_id: str, data: dict[str, Any], subscription: str = SUBSCRIPTION) -> Any:
    """A Pub/Sub push request body."""
    encoded = base64.b64encode(json.dumps(data).encode()).decode()
    message = {"data": encoded, "messageId": message_id, "publishTime": "2026-12-07T10:00:00Z"}
    return {"message": message, "subscription": subscription}


USER = SUBSCRIPTION.replace("/", "--")
"""The user ADK runs a Pub/Sub delivery as: the subscription."""

ANSWER = 'charge answered {"result": "ch_1"}'


def test_a_redelivered_pubsub_message_charges_once(
    ledger: Ledger, effects: Provider, tmp_path: Path
) -> None:
    """Pub/Sub delivers one message twice (the first push was not acknowledged in time): ADK
    runs each in a new session; one charge, and the second run's agent reads the first's."""
    adk = server(ledger, effects, tmp_path)

    first = adk.post("pubsub", pushed("1001", CHARGE))
    again = adk.post("pubsub", pushed("1001", CHARGE))

    assert (first.status_code, again.status_code) == (200, 200)
    assert effects.effects == 1
    assert adk.answers(USER) == [ANSWER, ANSWER]


def test_two_pubsub_messages_asking_the_same_are_two_charges(
    ledger: Ledger, effects: Provider, tmp_path: Path
) -> None:
    """Two messages with the same data are two deliveries: two charges. The same message id
    on another subscription of the topic is another delivery too."""
    adk = server(ledger, effects, tmp_path)

    for message_id, subscription in [
        ("1001", SUBSCRIPTION),
        ("1002", SUBSCRIPTION),
        ("1001", "projects/p/subscriptions/audit"),
    ]:
        assert adk.post("pubsub", pushed(message_id, CHARGE, subscription)).status_code == 200

    assert effects.effects == 3


def test_a_redelivered_eventarc_event_charges_once(
    ledger: Ledger, effects: Provider, tmp_path: Path
) -> None:
    """An Eventarc event delivered twice, in structured mode (CloudEvents attributes in the
    body) and in binary mode (``ce-*`` headers, a Pub/Sub message as the body), charges once
    per event id and source; another event id charges again."""
    adk = server(ledger, effects, tmp_path)
    structured = {
        "specversion": "1.0",
        "id": "evt-7",
        "source": TOPIC_SOURCE,
        "type": "google.cloud.pubsub.topic.v1.messagePublished",
        "data": CHARGE,
    }
    headers = {
        "ce-id": "evt-8",
        "ce-source": TOPIC_SOURCE,
        "ce-type": "google.cloud.pubsub.topic.v1.messagePublished",
        "ce-specversion": "1.0",
    }

    for _ in range(2):
        assert adk.post("eventarc", structured).status_code == 200
    assert effects.effects == 1
    for _ in range(2):
        assert adk.post("eventarc", pushed("2001", CHARGE), headers=headers).status_code == 200
    assert effects.effects == 2


def refusal(answered: httpx.Response, caplog: pytest.LogCaptureFixture) -> str:
    """What ADK said of a delivery's error: its answer's detail and, from ADK 2.15, which
    answers only an error id, the exception it logged under that id."""
    logged = [str(r.exc_info[1]) for r in caplog.records if r.exc_info and r.exc_info[1]]
    return "\n".join([str(answered.json()["detail"]), *logged])


def test_a_delivery_with_no_id_runs_nothing(
    ledger: Ledger, effects: Provider, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An event with no id (nothing tells its redelivery from a new event): the UNSAFE charge
    refuses to run, and ADK answers the delivery with an error, so it is delivered again."""
    adk = server(ledger, effects, tmp_path)
    event = {"source": TOPIC_SOURCE, "type": "order.placed", "data": CHARGE}

    with caplog.at_level(logging.ERROR):
        answered = adk.post("eventarc", event)

    assert answered.status_code == 500
    assert "carries no id" in refusal(answered, caplog)
    assert effects.effects == 0
    assert ledger.store.records(ledger.namespace) == []


def delegating(ledger: Ledger, provider: Provider, where: Path, *, protected: bool) -> Server:
    """ADK's API server for an app whose agent hands each message's data to a payer agent, an
    agent tool (protected as SAFE, or not at all), whose charge is protected as UNSAFE."""

    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(None, amount, customer)

    inner = protect([charge], ledger, effects={"charge": UNSAFE})
    payer = LlmAgent(name="payer", model=Relay.of("charge"), tools=inner)
    tools: list[Any] = [AgentTool(payer)]
    if protected:
        tools = protect(tools, ledger, default=SAFE)
    relay = Relay.of("payer", lambda message: {"request": json.dumps(json.loads(message)["data"])})
    agent = LlmAgent(name="billing", model=relay, tools=tools)
    return Server(App(name=APP, root_agent=agent), str(where))


# ADK's AgentTool hands its runner the caller's plugins the way ADK itself deprecates (2.13).
@pytest.mark.filterwarnings("ignore:The `plugins` argument is deprecated:DeprecationWarning")
def test_a_redelivered_message_charging_through_an_agent_tool_charges_once(
    ledger: Ledger, effects: Provider, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent a message starts hands it to a protected agent tool: its charge is scoped by
    that call, itself scoped by the delivery, so a redelivery charges nothing more. Left
    unprotected, the agent tool's charge refuses to run rather than take the delivery ADK
    copies into the agent tool's own session."""
    adk = delegating(ledger, effects, tmp_path, protected=True)
    for _ in range(2):
        assert adk.post("pubsub", pushed("1001", CHARGE)).status_code == 200
    assert effects.effects == 1
    inner = 'charge answered {"result": "ch_1"}'
    assert adk.answers(USER) == [f"payer answered {json.dumps({'result': inner})}"] * 2

    adk = delegating(ledger, effects, tmp_path, protected=False)
    with caplog.at_level(logging.ERROR):
        answered = adk.post("pubsub", pushed("1002", CHARGE))
    assert answered.status_code == 500
    assert "called as an AgentTool that is not protected" in refusal(answered, caplog)
    assert effects.effects == 1


def test_a_scope_function_comes_before_the_delivery(
    ledger: Ledger, effects: Provider, tmp_path: Path
) -> None:
    """``scope=`` names the scope before the delivery does: two messages of one scope, with the
    same data, are one intent."""
    adk = server(ledger, effects, tmp_path, scope=lambda ctx: "order-1234")

    for message_id in ("1001", "1002"):
        assert adk.post("pubsub", pushed(message_id, CHARGE)).status_code == 200

    assert effects.effects == 1


def test_the_delivery_is_read_where_adk_keeps_it(tmp_path: Path) -> None:
    """twiceshy reads the delivery under ADK's own session-state key, where a tool finds ADK's
    record of a Pub/Sub push (the message id and subscription a redelivery keeps); its scope,
    from ``delivery_scope``, is the same for a redelivery and another for another message."""
    seen: list[Any] = []
    scopes: list[str | None] = []

    def lookup(amount: int, customer: str, tool_context: ToolContext) -> str:
        """Look the customer up."""
        seen.append(tool_context.state.get(TRIGGER_DELIVERY))
        scopes.append(delivery_scope(tool_context))
        return customer

    relay = Relay.of("lookup", lambda message: json.loads(message)["data"])
    agent = LlmAgent(name="billing", model=relay, tools=[lookup])
    adk = Server(App(name=APP, root_agent=agent), str(tmp_path))
    for message_id in ("1001", "1001", "1002"):
        adk.post("pubsub", pushed(message_id, CHARGE))

    assert TRIGGER_DELIVERY == trigger_routes.TRIGGER_DELIVERY_STATE_KEY
    assert seen[0] == {
        "source": "pubsub",
        "id": "1001",
        "subscription": SUBSCRIPTION,
        "publish_time": "2026-12-07T10:00:00Z",
    }
    assert scopes[0] == scopes[1] != scopes[2]
    assert None not in scopes
