"""Google ADK agent tools (``AgentTool``), through a real ``LlmAgent`` whose scripted model calls
an agent tool whose agent (a ``Relay`` model) charges through a protected tool.

ADK runs an agent tool's agent in a new, empty session on every call, so the session id the
inner charge would otherwise be scoped by is new each time the model calls the agent tool
again: the incident is a second charge for the same request. A provider double counts charges.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.adk.agents import LlmAgent
from google.adk.tools import FunctionTool
from google.adk.tools.agent_tool import AgentTool
from provider_log import CHARGE, Provider
from pydantic import BaseModel, Field, ValidationError
from scripted_google_adk import Relay, ScriptedModel, responses, run

from twiceshy import KEYED, SAFE, UNSAFE, Effect, Ledger, MissingScope, current_key, idempotency_key
from twiceshy.integrations.google_adk import protect, protect_tool

# ADK's AgentTool hands its runner the caller's plugins the way ADK itself deprecates (2.13).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The `plugins` argument is deprecated:DeprecationWarning"
)

REQUEST = json.dumps(CHARGE)
"""What the outer model asks the payer agent: the charge's arguments, as its Relay reads them."""


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    """An in-memory ledger, then a SQLite one."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(url) as opened:
        yield opened


def charging(provider: Provider, keys: list[str | None]) -> Any:
    """An UNSAFE-style ``charge``: every run is a charge (no key reaches the provider); it notes
    the key it ran under."""

    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        keys.append(current_key())
        return provider.charge(None, amount, customer)

    return charge


def payer(ledger: Ledger, provider: Provider, keys: list[str | None], **relay: Any) -> LlmAgent:
    """The agent an agent tool runs: it charges, its charge protected as UNSAFE."""
    tools = protect([charging(provider, keys)], ledger, effects={"charge": UNSAFE})
    return LlmAgent(name="payer", model=Relay.of("charge", **relay), tools=tools)


def asked(*requests: dict[str, Any]) -> ScriptedModel:
    """An outer model calling the payer agent tool once per turn, with each request in turn."""
    return ScriptedModel.of(*[[(f"c{n}", "payer", r)] for n, r in enumerate(requests, 1)])


ANSWER = 'charge answered {"result": "ch_1"}'
"""What the payer agent answers after the first charge: its Relay model quoting the tool."""


@pytest.mark.parametrize("effect", [SAFE, UNSAFE], ids=["safe", "unsafe"])
def test_an_agent_tool_called_again_with_the_same_request_charges_once(
    ledger: Ledger, tmp_path: Path, effect: Effect
) -> None:
    """The model calls the agent tool twice with one request: one charge, the model reads the
    same answer twice. Declared SAFE, the agent runs again and its charge is replayed (its scope
    is derived from the agent-tool call's key); declared UNSAFE, the agent's answer is."""
    provider = Provider(tmp_path / "effects")
    keys: list[str | None] = []
    agent_tool = protect([AgentTool(payer(ledger, provider, keys))], ledger, default=effect)
    model = asked({"request": REQUEST}, {"request": REQUEST})

    run(LlmAgent(name="billing", model=model, tools=agent_tool), "order-1")

    assert model.results() == {"c1": {"result": ANSWER}, "c2": {"result": ANSWER}}
    assert provider.effects == 1
    outer = idempotency_key("order-1", "payer", {"request": REQUEST})
    assert keys == [idempotency_key(outer, "charge", CHARGE)]


@pytest.mark.parametrize("effect", [SAFE, UNSAFE], ids=["safe", "unsafe"])
def test_two_requests_to_an_agent_tool_are_two_charges(
    ledger: Ledger, tmp_path: Path, effect: Effect
) -> None:
    """Two requests (for two orders) that make the agent charge the same arguments: two
    intents, two charges; each request called again is replayed."""
    provider = Provider(tmp_path / "effects")
    keys: list[str | None] = []

    def arguments(message: str) -> dict[str, Any]:
        return {k: v for k, v in json.loads(message).items() if k != "order"}

    first = {"request": json.dumps({**CHARGE, "order": "A"})}
    second = {"request": json.dumps({**CHARGE, "order": "B"})}
    agent = payer(ledger, provider, keys, arguments=arguments)
    model = asked(first, second, first, second)

    run(
        LlmAgent(
            name="billing", model=model, tools=protect([AgentTool(agent)], ledger, default=effect)
        ),
        "order-1",
    )

    assert model.results() == {
        "c1": {"result": ANSWER},
        "c2": {"result": 'charge answered {"result": "ch_2"}'},
        "c3": {"result": ANSWER},
        "c4": {"result": 'charge answered {"result": "ch_2"}'},
    }
    assert provider.effects == 2
    assert len(set(keys)) == 2


def test_a_charge_inside_an_unprotected_agent_tool_is_refused(
    ledger: Ledger, tmp_path: Path
) -> None:
    """An agent tool left unprotected: the recorded charge inside it refuses to run (its session
    is new on every call, so its id names nothing a retry shares) and says what to protect."""
    provider = Provider(tmp_path / "effects")
    keys: list[str | None] = []
    model = asked({"request": REQUEST})
    agent = LlmAgent(name="billing", model=model, tools=[AgentTool(payer(ledger, provider, keys))])

    with pytest.raises(
        MissingScope,
        match=r"called as an AgentTool that is not protected: .*"
        r"protect the AgentTool too",
    ):
        run(agent, "order-1")

    assert provider.effects == 0
    assert keys == []
    assert ledger.store.records(ledger.namespace) == []


def test_an_enclosing_run_scopes_the_agent_tool_call_not_its_inner_session(
    ledger: Ledger, tmp_path: Path
) -> None:
    """Inside ``twiceshy.run("outer")``, the charge inside a protected agent tool is scoped by
    that agent-tool call, itself scoped by the run."""
    provider = Provider(tmp_path / "effects")
    keys: list[str | None] = []
    tools = protect([AgentTool(payer(ledger, provider, keys))], ledger, default=SAFE)

    run(LlmAgent(name="billing", model=asked({"request": REQUEST}), tools=tools), scope="outer")

    outer = idempotency_key("outer", "payer", {"request": REQUEST})
    assert keys == [idempotency_key(outer, "charge", CHARGE)]


def test_a_replayed_agent_tool_answer_ends_the_turn_as_its_run_did(
    ledger: Ledger, tmp_path: Path
) -> None:
    """An agent tool with ``skip_summarization``: its answer ends the model's turn (no request
    to summarise it) after the run of its agent and after its replay alike."""
    provider = Provider(tmp_path / "effects")
    agent = payer(ledger, provider, [])
    tools = protect([AgentTool(agent, skip_summarization=True)], ledger, default=UNSAFE)
    model = asked({"request": REQUEST}, {"request": REQUEST})
    billing = LlmAgent(name="billing", model=model, tools=tools)

    runner = run(billing, "order-1")
    assert model.answered == 1
    run(billing, "order-1", runner=runner)

    assert model.answered == 2
    assert responses(runner, "order-1") == {"c1": {"result": ANSWER}, "c2": {"result": ANSWER}}
    assert provider.effects == 1


class Order(BaseModel):
    """The input of an agent with an ``input_schema`` (module level: ADK builds its schema)."""

    amount: int
    customer: str
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


def test_an_agent_input_is_named_by_the_fields_the_model_sent(
    ledger: Ledger, tmp_path: Path
) -> None:
    """An agent with an ``input_schema``: the fields in another order are one request, and a
    field its default factory makes anew on every call is no part of it."""
    provider = Provider(tmp_path / "effects")
    keys: list[str | None] = []

    def arguments(message: str) -> dict[str, Any]:
        sent = json.loads(message)
        return {"amount": sent["amount"], "customer": sent["customer"]}

    agent = payer(ledger, provider, keys, arguments=arguments)
    agent.input_schema = Order
    model = asked(CHARGE, {"customer": "cus_1", "amount": 4900})

    run(
        LlmAgent(
            name="billing", model=model, tools=protect([AgentTool(agent)], ledger, default=UNSAFE)
        ),
        "order-1",
    )

    assert model.results() == {"c1": {"result": ANSWER}, "c2": {"result": ANSWER}}
    assert provider.effects == 1


def test_a_request_the_agent_tool_cannot_read_runs_nothing(ledger: Ledger, tmp_path: Path) -> None:
    """A call with no ``request`` is answered with what is missing, and one that does not fit
    the agent's ``input_schema`` raises ADK's own validation error: neither is recorded, and
    the next well-formed call runs."""
    provider = Provider(tmp_path / "effects")
    keys: list[str | None] = []
    tool = protect([AgentTool(payer(ledger, provider, keys))], ledger, default=UNSAFE)
    model = asked({"text": REQUEST}, {"request": REQUEST})

    run(LlmAgent(name="billing", model=model, tools=tool), "order-1")

    assert model.results()["c1"] == {
        "error": "Invoking `payer()` failed as its mandatory input parameter `request` is not "
        "present; nothing ran. Call it again with the request for the agent."
    }
    assert model.results()["c2"] == {"result": ANSWER}
    (record,) = ledger.store.records(ledger.namespace, tool="payer")
    assert record.key == idempotency_key("order-1", "payer", {"request": REQUEST})

    schema_agent = payer(ledger, provider, keys)
    schema_agent.input_schema = Order
    tool = protect([AgentTool(schema_agent)], ledger, default=UNSAFE)
    model = asked({"amount": "a lot", "customer": "cus_1"})
    with pytest.raises(ValidationError):
        run(LlmAgent(name="billing", model=model, tools=tool), "order-2")
    assert len(ledger.store.records(ledger.namespace, tool="payer")) == 1
    assert provider.effects == 1


def test_protect_takes_agent_tools_and_says_how_to_give_an_agent(
    ledger: Ledger, tmp_path: Path
) -> None:
    """An ``AgentTool`` is protected as a copy of its own class, named by its agent; an agent
    given as it is is refused with how to give it; ``protect_tool`` takes an agent tool too."""
    agent = payer(ledger, Provider(tmp_path / "effects"), [])
    original = AgentTool(agent, skip_summarization=True)
    (tool,) = protect([original], ledger, effects={"payer": SAFE})
    assert isinstance(tool, AgentTool)
    assert (tool.name, tool.agent, tool.skip_summarization) == ("payer", agent, True)
    assert type(original) is AgentTool
    with pytest.raises(TypeError, match=r"wrapped: AgentTool\(agent\)"):
        protect([agent], ledger, default=SAFE)  # type: ignore[list-item]
    guarded = protect_tool(AgentTool(agent), ledger.guard("payer", effect=KEYED, attempts=1))
    assert isinstance(guarded, AgentTool)
    assert not isinstance(guarded, FunctionTool)
