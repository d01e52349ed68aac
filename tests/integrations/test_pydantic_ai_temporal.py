"""TwiceshyCapability and Pydantic AI's Temporal integration, through workflows on the Temporal
CLI's dev server (started once for the module by test_temporal.py's fixture), with a worker in
this process running them in Temporal's sandbox under Pydantic AI's plugin.

Pydantic AI's deprecated ``TemporalAgent`` runs the agent in the workflow and each tool call in an
activity, with ``wrap_tool_execute``, where the capability sits, in workflow code: the ledger's
I/O there failed the workflow task, which Temporal retried forever. Every way to put the
capability there is refused before anything runs - the wrapper made around an agent with it, the
capability given to one run in a workflow - and so is a tool called in workflow code by any other
agent; the refusal is a Pydantic AI ``UserError``, which fails the workflow instead of its task.
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from datetime import timedelta
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.durable_exec.temporal import AgentPlugin, PydanticAIPlugin, TemporalAgent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions
from test_temporal import address  # noqa: F401 - the module's dev server

from twiceshy import UNSAFE, Ledger
from twiceshy.integrations.pydantic_ai import DurableAgentRefused, TwiceshyCapability

# Pydantic AI warns that the wrappers are deprecated each time one is made.
DEPRECATED = r".*TemporalAgent. is deprecated"
pytestmark = pytest.mark.filterwarnings(f"ignore:{DEPRECATED}:UserWarning")

CHARGE = {"amount": 4900, "customer": "cus_1"}
# Releases whose wrappers ask each capability of the agent they wrap whether it runs durably (2.78
# does, 2.16 does not): on the others the wrapper is made, and the run refuses the capability.
ASKS_WHEN_WRAPPING = pytest.mark.skipif(
    not hasattr(AbstractCapability, "_durable_unsupported_reason"),
    reason="this Pydantic AI's wrappers ask no capability: the run refuses it when it starts",
)


class Shop:
    """An agent's world: a model that calls ``charge`` once, the ledger, and the charges made.
    Workflows reach it as this module's global (the module is passed through the sandbox)."""

    __name__ = "script"  # FunctionModel names itself after its function

    def __init__(self) -> None:
        self.requests = 0
        self.ledger = Ledger("memory://")
        self.charges: list[dict[str, Any]] = []

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if self.requests == 1:
            return ModelResponse(parts=[ToolCallPart("charge", dict(CHARGE), "c1")])
        return ModelResponse(parts=[TextPart("done")])

    async def charge(self, amount: int, customer: str) -> str:
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


AT_RUN = Shop()
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", DEPRECATED, UserWarning)
    WRAPPED = TemporalAgent(AT_RUN.agent("twiceshy_shop"))
IN_WORKFLOW = Shop()
PLAIN = IN_WORKFLOW.agent("twiceshy_plain", IN_WORKFLOW.capability())


@workflow.defn(name="twiceshy_pydantic_ai_at_run")
class CapabilityAtRun:
    """Runs the TemporalAgent with TwiceshyCapability given to the run."""

    @workflow.run
    async def run(self) -> str:
        result = await WRAPPED.run("charge the customer", capabilities=[AT_RUN.capability()])
        return result.output


@workflow.defn(name="twiceshy_pydantic_ai_in_workflow")
class AgentInWorkflow:
    """Runs an agent with TwiceshyCapability in workflow code, its model and tool as well."""

    @workflow.run
    async def run(self) -> str:
        result = await PLAIN.run("charge the customer", run_id="order-1")
        return result.output


def failure(address: str, run: Any) -> ApplicationError:  # noqa: F811 - the fixture's value
    """Run a workflow with a worker of this process; the error the workflow failed with."""

    async def go() -> ApplicationError:
        client = await Client.connect(address, plugins=[PydanticAIPlugin()])
        queue = f"queue-{uuid.uuid4().hex[:12]}"
        restrictions = SandboxRestrictions.default.with_passthrough_modules(__name__, "twiceshy")
        async with Worker(
            client,
            task_queue=queue,
            workflows=[CapabilityAtRun, AgentInWorkflow],
            plugins=[AgentPlugin(WRAPPED)],
            workflow_runner=SandboxedWorkflowRunner(restrictions=restrictions),
        ):
            with pytest.raises(WorkflowFailureError) as failed:
                await client.execute_workflow(
                    run,
                    id=f"order-{uuid.uuid4().hex[:12]}",
                    task_queue=queue,
                    execution_timeout=timedelta(seconds=60),
                )
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError), failed.value
        return cause

    return asyncio.run(go())


@ASKS_WHEN_WRAPPING
def test_temporal_agent_around_an_agent_with_the_capability_is_refused_when_made() -> None:
    """TemporalAgent made around an agent that carries TwiceshyCapability raises
    DurableAgentRefused saying to protect the tool function that Temporal runs in an
    activity."""
    shop = Shop()
    agent = shop.agent("twiceshy_refused", shop.capability())
    with pytest.raises(DurableAgentRefused) as refused:
        TemporalAgent(agent)
    assert "twiceshy.integrations.temporal.protect(ledger, effect=...)" in str(refused.value)
    assert shop.untouched()


def test_the_capability_given_to_a_run_in_a_workflow_fails_the_workflow(
    address: str,  # noqa: F811 - the fixture
) -> None:
    """TwiceshyCapability given to a TemporalAgent's run in a workflow is refused when the run
    starts, before the model's activity: the workflow fails with DurableAgentRefused (it is not
    left retrying its task), and the tool's activity never runs."""
    cause = failure(address, CapabilityAtRun.run)
    assert cause.type == "DurableAgentRefused"
    assert "an agent run by TemporalAgent" in cause.message
    assert "twiceshy.integrations.temporal.protect(ledger, effect=...)" in cause.message
    assert AT_RUN.untouched()


def test_a_tool_called_in_workflow_code_fails_the_workflow(
    address: str,  # noqa: F811 - the fixture
) -> None:
    """An agent with TwiceshyCapability run in Temporal workflow code: its UNSAFE tool is
    refused in the sandbox before it runs and before the ledger is asked, and the workflow fails
    with DurableAgentRefused."""
    cause = failure(address, AgentInWorkflow.run)
    assert cause.type == "DurableAgentRefused"
    assert "called in Temporal workflow code" in cause.message
    assert IN_WORKFLOW.charges == []
    assert IN_WORKFLOW.ledger.store.records(IN_WORKFLOW.ledger.namespace) == []
