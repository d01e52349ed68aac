"""TwiceshyCapability and Pydantic AI's DBOS integration, through DBOS on a SQLite system database.

Pydantic AI's deprecated ``DBOSAgent`` runs an agent in a DBOS workflow, and with it
``wrap_tool_execute``, where the capability sits, in the workflow's own code: a recovered
workflow ran an UNSAFE tool a second time. Every way to put the capability there is refused
before anything runs: the wrapper made around an agent with it, the capability given to one run
of a wrapped agent, and one made per run. Any other agent's tool called in a workflow's own code
is refused too, unless its function is a twiceshy step, which answers inside its step.

DBOS is one per process: the module launches it once, on a SQLite system database of its own,
with every workflow registered first, and destroys it (registry included) at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dbos import DBOS
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.durable_exec.dbos import DBOSAgent, DBOSDurability
from pydantic_ai.exceptions import UserError
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import twiceshy
from twiceshy import UNSAFE, Ledger, TwiceshyError
from twiceshy.integrations.dbos import step
from twiceshy.integrations.pydantic_ai import DurableAgentRefused, TwiceshyCapability

# Pydantic AI warns that the wrappers are deprecated each time one is made.
pytestmark = pytest.mark.filterwarnings("ignore:.*DBOSAgent. is deprecated:UserWarning")

CHARGE = {"amount": 4900, "customer": "cus_1"}
# Releases whose wrappers ask each capability of the agent they wrap whether it runs durably (2.78
# does, 2.16 does not): on the others the wrapper is made, and the run refuses the capability.
ASKS_WHEN_WRAPPING = pytest.mark.skipif(
    not hasattr(AbstractCapability, "_durable_unsupported_reason"),
    reason="this Pydantic AI's wrappers ask no capability: the run refuses it when it starts",
)


class Script:
    """A model that calls ``charge`` once, then answers with what the tool returned; it counts
    its requests."""

    __name__ = "script"

    def __init__(self) -> None:
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if self.requests == 1:
            return ModelResponse(parts=[ToolCallPart("charge", dict(CHARGE), "c1")])
        return ModelResponse(parts=[TextPart("done")])


class Shop:
    """An agent's world: its model, its ledger, and the charges its tool made."""

    def __init__(self) -> None:
        self.script = Script()
        self.ledger = Ledger("memory://")
        self.charges: list[dict[str, Any]] = []

    def charge(self, amount: int, customer: str) -> str:
        """Charge the customer (a provider that cannot deduplicate)."""
        self.charges.append({"amount": amount, "customer": customer})
        return f"ch_{len(self.charges)}"

    def capability(self) -> TwiceshyCapability[None]:
        """TwiceshyCapability on the shop's ledger, ``charge`` declared UNSAFE."""
        return TwiceshyCapability(self.ledger, {"charge": UNSAFE})

    def agent(self, name: str, *capabilities: Any, tool: Callable[..., str] | None = None) -> Any:
        """An agent named ``name`` with the shop's model, ``tool`` (else its charge) and
        ``capabilities``."""
        return Agent(
            FunctionModel(self.script),
            name=name,
            tools=[tool or self.charge],
            capabilities=list(capabilities),
        )


class World:
    """The module's shops and the workflows that run their agents, on one launched DBOS."""

    def __init__(self, tmp: Path) -> None:
        self.at_run = Shop()
        self.wrapped_at_run = DBOSAgent(self.at_run.agent("at_run"))
        self.per_run = Shop()
        capability = self.per_run.capability()
        self.wrapped_per_run = DBOSAgent(self.per_run.agent("per_run", lambda ctx: capability))
        self.in_workflow = Shop()
        plain = self.in_workflow.agent("in_workflow", self.in_workflow.capability())
        self.stepped = Shop()
        self.step_ledger = Ledger(f"sqlite:///{tmp / 'steps.db'}")
        charge_step = step(self.step_ledger, effect=UNSAFE, name="charge")(self.stepped.charge)
        stepped = self.stepped.agent("stepped", self.stepped.capability(), tool=charge_step)

        @DBOS.workflow(name="twiceshy_pydantic_ai_run")
        async def run_agent(which: str) -> str:
            """Run a plain agent in a DBOS workflow's own code."""
            agent = plain if which == "in_workflow" else stepped
            result = await agent.run("charge the customer", run_id=f"run-{which}")
            return str(result.output)

        self.run_agent = run_agent


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """DBOS launched on a SQLite system database, with the module's agents and workflows."""
    tmp = tmp_path_factory.mktemp("dbos")
    DBOS(config={"name": "twiceshy_pydantic_ai", "system_database_url": f"sqlite:///{tmp}/s.db"})
    try:
        made = World(tmp)
        DBOS.launch()
        yield made
    finally:
        DBOS.destroy(destroy_registry=True)


@ASKS_WHEN_WRAPPING
def test_dbos_agent_around_an_agent_with_the_capability_is_refused_when_made() -> None:
    """DBOSAgent made around an agent that carries TwiceshyCapability raises DurableAgentRefused
    (a Pydantic AI UserError and a twiceshy error) saying to make the tool a twiceshy step."""
    shop = Shop()
    agent = shop.agent("shop", shop.capability())
    with pytest.raises(DurableAgentRefused) as refused:
        DBOSAgent(agent)
    assert isinstance(refused.value, UserError)
    assert isinstance(refused.value, TwiceshyError)
    text = str(refused.value)
    assert "twiceshy.integrations.dbos.step(ledger, effect=...)" in text
    assert "nothing ran" in text
    assert (shop.script.requests, shop.charges) == (0, [])


def test_an_agent_made_durable_with_dbos_durability_is_refused_by_name() -> None:
    """TwiceshyCapability beside DBOSDurability is refused with the same DurableAgentRefused
    when the agent is built."""
    shop = Shop()
    with pytest.raises(DurableAgentRefused, match=r"made durable with DBOSDurability"):
        shop.agent("durable", DBOSDurability(), shop.capability())
    assert (shop.script.requests, shop.charges) == (0, [])


def test_the_capability_given_to_a_dbos_agents_run_is_refused_before_the_workflow_runs(
    world: World,
) -> None:
    """TwiceshyCapability given to one run of a DBOSAgent is refused as DBOS records the run's
    arguments, before the workflow starts: the model is never asked, the tool never runs."""
    shop = world.at_run
    with pytest.raises(DurableAgentRefused, match=r"DBOSAgent\.run"):
        world.wrapped_at_run.run_sync("charge the customer", capabilities=[shop.capability()])
    assert (shop.script.requests, shop.charges) == (0, [])
    assert shop.ledger.store.records(shop.ledger.namespace) == []


def test_a_capability_made_per_run_is_refused_when_the_dbos_workflow_starts_the_run(
    world: World,
) -> None:
    """TwiceshyCapability made per run (which the wrapper cannot see when it is made) is refused
    when DBOSAgent's workflow starts the run, before the model is asked."""
    shop = world.per_run
    with pytest.raises(DurableAgentRefused, match=r"an agent run by DBOSAgent") as refused:
        world.wrapped_per_run.run_sync("charge the customer")
    assert "twiceshy.integrations.dbos.step(ledger, effect=...)" in str(refused.value)
    assert (shop.script.requests, shop.charges) == (0, [])
    assert shop.ledger.store.records(shop.ledger.namespace) == []


def test_a_tool_called_in_dbos_workflow_code_is_refused(world: World) -> None:
    """An agent with TwiceshyCapability run in a DBOS workflow's own code: its UNSAFE tool, which
    would run in the workflow too, is refused before it runs, and the ledger is not asked."""
    shop = world.in_workflow
    with pytest.raises(DurableAgentRefused, match="called in DBOS workflow code") as refused:
        asyncio.run(world.run_agent("in_workflow"))
    assert "twiceshy.integrations.dbos.step(ledger, effect=...)" in str(refused.value)
    assert shop.charges == []
    assert shop.ledger.store.records(shop.ledger.namespace) == []


def test_a_tool_that_is_a_twiceshy_step_runs_in_its_step_in_workflow_code(world: World) -> None:
    """The same agent whose tool is a twiceshy step: it runs once, in its step, scoped by the
    workflow; the capability leaves it to the step and asks its own ledger nothing."""
    shop = world.stepped
    assert asyncio.run(world.run_agent("stepped")) == "done"
    assert shop.charges == [CHARGE]
    assert shop.ledger.store.records(shop.ledger.namespace) == []
    (record,) = world.step_ledger.store.records(world.step_ledger.namespace)
    assert (record.tool, record.state) == ("charge", twiceshy.State.SUCCEEDED)
