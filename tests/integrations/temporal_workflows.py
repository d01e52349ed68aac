"""The workflows of tests/integrations/test_temporal*.py, apart from their activities: Temporal's
sandbox runs this module's code again for every workflow run, so it opens nothing."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

# Temporal's default: no limit on attempts. Only the delays are shortened for the tests.
RETRIES = RetryPolicy(
    initial_interval=timedelta(milliseconds=100),
    backoff_coefficient=1.0,
    maximum_interval=timedelta(milliseconds=100),
)


@workflow.defn(name="order")
class Order:
    """Charge, then notify: twiceshy runs in the activities only."""

    @workflow.run
    async def run(self, amount: int, customer: str) -> str:
        charge_id: str = await workflow.execute_activity(
            "charge",
            args=[amount, customer],
            start_to_close_timeout=timedelta(seconds=3),
            retry_policy=RETRIES,
        )
        notified: str = await workflow.execute_activity(
            "notify",
            charge_id,
            start_to_close_timeout=timedelta(seconds=3),
            retry_policy=RETRIES,
        )
        return notified


# One attempt: a lost answer fails the activity, and so its child workflow and the parent.
ONCE = RetryPolicy(maximum_attempts=1)


@workflow.defn(name="charge_child")
class ChargeChild:
    """A child workflow that charges, once."""

    @workflow.run
    async def run(self, amount: int, customer: str) -> str:
        charge_id: str = await workflow.execute_activity(
            "charge",
            args=[amount, customer],
            start_to_close_timeout=timedelta(seconds=3),
            retry_policy=ONCE,
        )
        return charge_id


@workflow.defn(name="checkout_child")
class CheckoutChild:
    """A child workflow whose own child charges: a child of a child, both started without ids
    of their own."""

    @workflow.run
    async def run(self, amount: int, customer: str) -> str:
        charge_id: str = await workflow.execute_child_workflow(
            "charge_child", args=[amount, customer]
        )
        return charge_id


@workflow.defn(name="order_children")
class OrderChildren:
    """Two children charging the same arguments: started without ids of their own (so the SDK
    draws each one's id, anew in every run of this workflow), each charging in a child of its
    own; or, with ``named``, charging themselves, started with ids made of this workflow's."""

    @workflow.run
    async def run(self, amount: int, customer: str, named: bool) -> str:
        charges = []
        for n in range(2):
            if named:
                child_id = f"{workflow.info().workflow_id}-charge-{n}"
                charge_id: str = await workflow.execute_child_workflow(
                    "charge_child", args=[amount, customer], id=child_id
                )
            else:
                charge_id = await workflow.execute_child_workflow(
                    "checkout_child", args=[amount, customer]
                )
            charges.append(charge_id)
        return " ".join(charges)


@workflow.defn(name="misplaced")
class Misplaced:
    """Calls a protected tool in workflow code, which twiceshy refuses."""

    @workflow.run
    async def run(self, amount: int) -> int:
        with workflow.unsafe.imports_passed_through():
            from temporal_tools import misplaced_tool

        result: int = await misplaced_tool(amount)
        return result


@workflow.defn(name="misplaced_agent_tool")
class MisplacedAgentTool:
    """Invokes an OpenAI Agents tool protected by twiceshy in workflow code, as OpenAI Agents'
    Temporal integration does with a tool not made with ``activity_as_tool``."""

    @workflow.run
    async def run(self, amount: int) -> int:
        with workflow.unsafe.imports_passed_through():
            from temporal_tools import misplaced_agent_tool

        result: int = await misplaced_agent_tool.on_invoke_tool(None, f'{{"amount": {amount}}}')
        return result


@workflow.defn(name="order_agent")
class OrderAgent:
    """A Pydantic AI agent made durable with TemporalDurability charges."""

    @workflow.run
    async def run(self, amount: int, customer: str) -> str:
        with workflow.unsafe.imports_passed_through():
            from temporal_app import agent

        result = await agent.run(f"charge {amount} to {customer}")
        output: str = result.output
        return output
