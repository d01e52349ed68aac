"""A Prefect application for tests/integrations/test_prefect*.py, run in processes of its own
against a Prefect server on loopback (a test kills some of them with SIGKILL).

Settings come as JSON in ``TWICESHY_PREFECT_APP``, so that Prefect's own ``prefect flow-run retry
ID --entrypoint prefect_app.py:order`` can load this file as the flow's code (in phase
``recover``). ``python prefect_app.py`` in phase ``first`` runs the flow ``order`` of the
settings' scenario, writing its flow run's id to ``flow_run.txt``; the test itself marks a
killed one's flow run crashed, and reads back from Prefect how it ended. Every command the
ledger sends its store is written to ``io.jsonl`` with where it ran (in a task run or not),
every charge the provider double got to ``provider.jsonl``, every subflow run's id to
``subflows.jsonl``, and twiceshy's warnings to ``twiceshy.log``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from prefect import flow
from prefect import task as prefect_task
from prefect.context import TaskRunContext
from provider_log import Provider

import twiceshy
from twiceshy import KEYED, UNSAFE
from twiceshy.integrations.prefect import protect, retry_condition, task
from twiceshy.stores import open_store

SETTINGS: dict[str, Any] = json.loads(os.environ["TWICESHY_PREFECT_APP"])
SCENARIO: str = SETTINGS["scenario"]
PHASE: str = SETTINGS["phase"]
HERE = Path(SETTINGS["dir"])
provider = Provider(HERE / "provider.jsonl")
logging.getLogger("twiceshy").addHandler(logging.FileHandler(HERE / "twiceshy.log"))


def note(name: str, **fields: Any) -> None:
    """One line in a log of this test's directory; O_APPEND lines are whole between processes."""
    with (HERE / name).open("a", encoding="utf-8") as out:
        out.write(json.dumps(fields) + "\n")


def die() -> None:
    """The worker dies here, as kill -9 would end it."""
    os.kill(os.getpid(), signal.SIGKILL)


class Seen:
    """A store seen: every command is noted with whether it ran in a task, then sent on."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        command = getattr(self._store, name)
        if name not in ("claim", "write", "get", "wait"):
            return command

        def seen(*args: Any, **kwargs: Any) -> Any:
            in_task = TaskRunContext.get()
            note("io.jsonl", command=name, in_task=in_task is not None, phase=PHASE)
            return command(*args, **kwargs)

        if asyncio.iscoroutinefunction(command):

            async def seen_async(*args: Any, **kwargs: Any) -> Any:
                return await seen(*args, **kwargs)

            return seen_async
        return seen


store, async_store = open_store(SETTINGS["ledger"])
ledger = twiceshy.Ledger(store=Seen(store), async_store=Seen(async_store))  # type: ignore[arg-type]


def after_record(event: twiceshy.CallEvent) -> None:
    """Scenario ``kill-after-record``: die once the ledger holds the outcome, before Prefect has
    recorded the task run's result."""
    if PHASE == "first" and event.tool == "charge":
        die()


if SCENARIO == "kill-after-record":
    ledger.observe(after_record)

EFFECT = {"keyed": KEYED, "unsafe": UNSAFE}[SETTINGS.get("effect", "keyed")]
# One twiceshy attempt per Prefect run of the task: the engine's retry is the one under test.
TOOL_OPTIONS: dict[str, Any] = {"lease": 1.0, "wait": 15.0}
if EFFECT is KEYED:
    TOOL_OPTIONS["attempts"] = 1
TOOL_OPTIONS.update(SETTINGS.get("tool_options", {}))  # a scenario's own lease= and wait=


def refuse_dropped_connections(task: Any, task_run: Any, state: Any) -> bool:
    """The application's own condition: a dropped connection is not to be retried."""
    return not isinstance(state.result(raise_on_failure=False), ConnectionError)


RETRY_CONDITION = refuse_dropped_connections if SETTINGS.get("refuse_retry") else None
runs = 0


def charge_body(amount: int, customer: str, key: str | None) -> str:
    """Charge the customer (the provider deduplicates by key); misbehave as the scenario says."""
    global runs
    runs += 1
    charge_id = provider.charge(key, amount, customer)
    if SCENARIO in ("lost-answer", "agent-capability", "agent-in-task", "children") and runs == 1:
        raise ConnectionError("the connection dropped before the provider's answer arrived")
    if SCENARIO == "kill-in-task" and PHASE != "first":
        return charge_id
    if SCENARIO == "kill-in-task":
        die()
    return charge_id


@task(
    ledger,
    effect=EFFECT,
    name="charge",
    retries=2,
    retry_delay_seconds=0,
    retry_condition_fn=RETRY_CONDITION,
    **TOOL_OPTIONS,
)
def charge(amount: int, customer: str) -> str:
    """The charge as a task."""
    return charge_body(amount, customer, twiceshy.current_key() if EFFECT is KEYED else None)


charge = charge.with_options(persist_result=True)


@prefect_task(persist_result=True)
def notify(charge_id: str) -> str:
    """Tell the customer; scenario ``kill-after-task`` dies here, after ``charge`` completed."""
    if SCENARIO == "kill-after-task" and PHASE == "first":
        die()
    return f"notified of {charge_id}"


@flow(name="order", persist_result=True)
def order(amount: int, customer: str) -> str:
    """Charge, then notify: twiceshy runs in the tasks only."""
    from prefect.runtime import flow_run

    (HERE / "flow_run.txt").write_text(str(flow_run.id))
    if SCENARIO.startswith("agent"):
        return asyncio.run(agent_order(amount, customer))
    return notify(charge(amount, customer))


# -- subflows ----------------------------------------------------------------------------------


@task(ledger, effect=KEYED, name="charge", attempts=1, lease=1.0)
def charge_once(amount: int, customer: str) -> str:
    """The charge as a task Prefect does not retry: a lost answer fails its subflow."""
    return charge_body(amount, customer, twiceshy.current_key())


@flow(name="charge-order", persist_result=True)
def charge_order(amount: int, customer: str) -> str:
    """A subflow that charges; Prefect gives each of its runs an id of its own."""
    from prefect.runtime import flow_run

    note("subflows.jsonl", id=str(flow_run.id))
    return charge_once(amount, customer)


@flow(name="checkout", persist_result=True)
def checkout(amount: int, customer: str) -> str:
    """A subflow whose own subflow charges: a subflow of a subflow."""
    return charge_order(amount, customer)


@flow(name="order-children", persist_result=True, retries=1, retry_delay_seconds=0)
def order_children(amount: int, customer: str) -> str:
    """Scenario ``children``: two calls of the subflow ``checkout`` with the same arguments; the
    first one's charge loses its answer, which fails its subflow, ``checkout`` and this flow,
    which Prefect retries."""
    from prefect.runtime import flow_run

    (HERE / "flow_run.txt").write_text(str(flow_run.id))
    first = checkout(amount, customer)
    second = checkout(amount, customer)
    return f"{first} {second}"


@prefect_task
def charge_in_a_task(amount: int, customer: str) -> str:
    """Calls the subflow inside a task, where Prefect names it at random."""
    return charge_order(amount, customer)


@flow(name="order-child-in-task", persist_result=True)
def order_child_in_task(amount: int, customer: str) -> str:
    """Scenario ``child-in-task``: the subflow called inside a task."""
    from prefect.runtime import flow_run

    (HERE / "flow_run.txt").write_text(str(flow_run.id))
    return charge_in_a_task(amount, customer)


# -- Pydantic AI's durable agent ---------------------------------------------------------------


async def agent_order(amount: int, customer: str) -> str:
    """A ``PrefectDurability`` agent charges, its tool calls in tasks that Prefect retries."""
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.durable_exec.prefect import PrefectDurability
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    def model(messages: list[Any], info: AgentInfo) -> ModelResponse:
        results = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not results:
            call = ToolCallPart("charge", {"amount": amount, "customer": customer}, "c1")
            return ModelResponse(parts=[call])
        return ModelResponse(parts=[TextPart(f"charged: {results[0].content}")])

    retried = {"retries": 2, "retry_delay_seconds": 0, "retry_condition_fn": retry_condition}
    capabilities: list[Any] = [PrefectDurability(tool_task_config=retried)]  # type: ignore[arg-type]
    if SCENARIO == "agent-capability":

        class LedgerInFlow(AbstractCapability[Any]):
            """Where ``TwiceshyCapability`` sits: the ledger asked in ``wrap_tool_execute``."""

            async def wrap_tool_execute(
                self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any
            ) -> Any:
                guard = ledger.guard("charge", effect=UNSAFE)
                return await guard.acall(dict(args), lambda: handler(args), scope=ctx.run_id)

        capabilities.append(LedgerInFlow())

        def unprotected(amount: int, customer: str) -> str:
            """Charge the customer."""
            return charge_body(amount, customer, None)

        tool: Any = unprotected
    else:

        @protect(ledger, effect=KEYED, name="charge", attempts=1)
        def protected(amount: int, customer: str) -> str:
            """Charge the customer."""
            return charge_body(amount, customer, twiceshy.current_key())

        tool = protected
    tool.__name__ = "charge"
    agent = Agent(FunctionModel(model), name="shop", tools=[tool], capabilities=capabilities)
    result = await agent.run(f"charge {amount} to {customer}")
    return result.output


def main() -> None:
    if PHASE == "first":
        flows = {"children": order_children, "child-in-task": order_child_in_task}
        try:
            flows.get(SCENARIO, order)(4900, "cus_1")
        except Exception as exc:  # the test reads back how the flow run ended
            print(f"the flow run failed: {exc!r}", file=sys.stderr)
    ledger.close()


if __name__ == "__main__":
    main()
