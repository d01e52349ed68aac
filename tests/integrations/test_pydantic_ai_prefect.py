"""TwiceshyCapability and Pydantic AI's Prefect integration, through flow runs on Prefect's local
server (started once for the module, as test_prefect.py does).

Pydantic AI's deprecated ``PrefectAgent`` runs an agent in a flow and each tool call in a task,
with ``wrap_tool_execute``, where the capability sits, in the flow, around the task: Prefect's
retry of the task never met the ledger, and the provider charged twice. Every way to put the
capability there is refused before anything runs: the wrapper made around an agent with it, and
the capability given to one run of a wrapped agent. Any other agent's tool called in a flow's own
code is refused too, unless its function protects itself.
"""

from __future__ import annotations

import os

# Before Prefect is imported here: its SDK analytics start when it is imported.
os.environ.setdefault("DO_NOT_TRACK", "1")

from collections.abc import Iterator
from typing import Any

import pytest
from prefect import flow
from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.durable_exec.prefect import PrefectAgent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from test_prefect import prefect_env  # noqa: F401 - the module's Prefect server

from twiceshy import UNSAFE, Ledger
from twiceshy.integrations.pydantic_ai import DurableAgentRefused, TwiceshyCapability

# Pydantic AI warns that the wrappers are deprecated each time one is made.
pytestmark = pytest.mark.filterwarnings("ignore:.*PrefectAgent. is deprecated:UserWarning")

CHARGE = {"amount": 4900, "customer": "cus_1"}
# Releases whose wrappers ask each capability of the agent they wrap whether it runs durably (2.78
# does, 2.16 does not): on the others the wrapper is made, and the run refuses the capability.
ASKS_WHEN_WRAPPING = pytest.mark.skipif(
    not hasattr(AbstractCapability, "_durable_unsupported_reason"),
    reason="this Pydantic AI's wrappers ask no capability: the run refuses it when it starts",
)


class Shop:
    """An agent's world: a model that calls ``charge`` once, the ledger, and the charges made."""

    __name__ = "script"  # FunctionModel names itself after its function

    def __init__(self) -> None:
        self.requests = 0
        self.ledger = Ledger("memory://")
        self.charges: list[dict[str, Any]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if self.requests == 1:
            return ModelResponse(parts=[ToolCallPart("charge", dict(CHARGE), "c1")])
        return ModelResponse(parts=[TextPart("done")])

    def charge(self, amount: int, customer: str) -> str:
        """Charge the customer (a provider that cannot deduplicate)."""
        self.charges.append({"amount": amount, "customer": customer})
        return f"ch_{len(self.charges)}"

    def agent(self, name: str, *capabilities: Any) -> Agent[None, str]:
        """An agent named ``name`` with the shop's model and tool, and ``capabilities``."""
        return Agent(
            FunctionModel(self), name=name, tools=[self.charge], capabilities=list(capabilities)
        )

    def capability(self) -> TwiceshyCapability[None]:
        """TwiceshyCapability on the shop's ledger, ``charge`` declared UNSAFE."""
        return TwiceshyCapability(self.ledger, {"charge": UNSAFE})

    def untouched(self) -> bool:
        """Nothing ran: the model was not asked, nothing was charged, nothing was recorded."""
        recorded = self.ledger.store.records(self.ledger.namespace)
        return (self.requests, self.charges, recorded) == (0, [], [])


@pytest.fixture
def server(prefect_env: dict[str, str]) -> Iterator[None]:  # noqa: F811 - the fixture's use
    """Flow runs of this process go to the module's Prefect server (their logs stay here: a
    log sent after the server stopped would be an error at exit)."""
    api = prefect_env["PREFECT_API_URL"]
    with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_LOGGING_TO_API_ENABLED: False}):
        yield


@ASKS_WHEN_WRAPPING
def test_prefect_agent_around_an_agent_with_the_capability_is_refused_when_made() -> None:
    """PrefectAgent made around an agent that carries TwiceshyCapability raises
    DurableAgentRefused saying to protect the tool function that Prefect runs in a task."""
    shop = Shop()
    agent = shop.agent("shop", shop.capability())
    with pytest.raises(DurableAgentRefused) as refused:
        PrefectAgent(agent)
    assert "twiceshy.integrations.prefect.protect(ledger, effect=...)" in str(refused.value)
    assert shop.untouched()


def test_the_capability_given_to_a_prefect_agents_run_is_refused_in_its_flow(
    server: None,
) -> None:
    """TwiceshyCapability given to one run of a PrefectAgent is refused when the agent's flow
    starts the run: the model is never asked and the tool's task never runs."""
    shop = Shop()
    wrapped = PrefectAgent(shop.agent("shop"))
    with pytest.raises(DurableAgentRefused, match="an agent run by PrefectAgent") as refused:
        wrapped.run_sync("charge the customer", capabilities=[shop.capability()])
    assert "twiceshy.integrations.prefect.protect(ledger, effect=...)" in str(refused.value)
    assert shop.untouched()


def test_a_tool_called_in_a_flows_own_code_is_refused(server: None) -> None:
    """An agent with TwiceshyCapability run in a Prefect flow's own code: its UNSAFE tool, which
    would run in the flow too, is refused before it runs, and the ledger is not asked."""
    shop = Shop()
    agent = shop.agent("shop", shop.capability())

    @flow(name="twiceshy-pydantic-ai-in-flow")
    def order() -> str:
        return agent.run_sync("charge the customer", run_id="order-1").output

    with pytest.raises(DurableAgentRefused, match="called in Prefect flow code"):
        order()
    assert shop.charges == []
    assert shop.ledger.store.records(shop.ledger.namespace) == []
