"""A Temporal worker for tests/integrations/test_temporal*.py, run as a process of its own (a
test kills some of them with SIGKILL).

``python -c 'import asyncio, temporal_app; asyncio.run(temporal_app.main())'`` - imported by
its name, so that a workflow importing it passed through gets this module, not a second copy -
reads its settings as JSON from ``TWICESHY_TEMPORAL_APP``, connects to the Temporal server named
there and serves the workflows of ``temporal_workflows.py`` and the activities below until it is
ended. Every command the ledger sends its store is written to ``io.jsonl`` with where it ran (in
an activity, in workflow code), every charge the provider double got to ``provider.jsonl``, and
twiceshy's warnings to ``twiceshy.log``. twiceshy's interceptor is installed on the client (the
worker takes it from there) unless the settings say ``"interceptor": false``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import temporal_tools  # noqa: F401  (imported before the workflows pass it through)
from provider_log import Provider
from temporal_workflows import (
    ChargeChild,
    CheckoutChild,
    Misplaced,
    MisplacedAgentTool,
    Order,
    OrderAgent,
    OrderChildren,
)
from temporalio import activity as temporal_activity
from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import Worker

import twiceshy
from twiceshy import KEYED, UNSAFE
from twiceshy.integrations.temporal import TwiceshyInterceptor, activity
from twiceshy.stores import open_store

SETTINGS: dict[str, Any] = json.loads(os.environ["TWICESHY_TEMPORAL_APP"])
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
    """A store seen: every command is noted with where it ran, then sent on."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        command = getattr(self._store, name)
        if name not in ("claim", "write", "get", "wait"):
            return command

        def seen(*args: Any, **kwargs: Any) -> Any:
            note(
                "io.jsonl",
                command=name,
                in_activity=temporal_activity.in_activity(),
                in_workflow=workflow.in_workflow(),
                phase=PHASE,
            )
            return command(*args, **kwargs)

        if asyncio.iscoroutinefunction(command):

            async def seen_async(*args: Any, **kwargs: Any) -> Any:
                return await seen(*args, **kwargs)

            return seen_async
        return seen


store, async_store = open_store(SETTINGS["ledger"])
ledger = twiceshy.Ledger(store=Seen(store), async_store=Seen(async_store))  # type: ignore[arg-type]


def after_record(event: twiceshy.CallEvent) -> None:
    """Scenario ``kill-after-record``: die once the ledger holds the outcome, before Temporal
    has the activity's result."""
    if PHASE == "first" and event.tool == "charge":
        die()


if SCENARIO == "kill-after-record":
    ledger.observe(after_record)

EFFECT = {"keyed": KEYED, "unsafe": UNSAFE}[SETTINGS.get("effect", "keyed")]
# One twiceshy attempt per activity attempt: the engine's retry is the one under test.
TOOL_OPTIONS: dict[str, Any] = {"lease": 1.0, "wait": 15.0}
if EFFECT is KEYED:
    TOOL_OPTIONS["attempts"] = 1
TOOL_OPTIONS.update(SETTINGS.get("tool_options", {}))  # a scenario's own lease= and wait=
runs = 0


async def charge_body(amount: int, customer: str) -> str:
    """Charge the customer (the provider deduplicates by key); misbehave as the scenario says."""
    global runs
    runs += 1
    key = twiceshy.current_key() if EFFECT is KEYED else None
    if temporal_activity.in_activity():
        note("charged_in.jsonl", workflow=temporal_activity.info().workflow_id)
    charge_id = provider.charge(key, amount, customer)
    if SCENARIO in ("lost-answer", "agent-lost-answer", "children") and runs == 1:
        raise ConnectionError("the connection dropped before the provider's answer arrived")
    if SCENARIO == "kill-in-activity" and PHASE == "first":
        die()
    return charge_id


charge = activity(ledger, effect=EFFECT, name="charge", **TOOL_OPTIONS)(charge_body)


@temporal_activity.defn(name="notify")
async def notify(charge_id: str) -> str:
    """Tell the customer; scenario ``kill-after-activity`` dies here, after ``charge``
    completed."""
    if SCENARIO == "kill-after-activity" and PHASE == "first":
        die()
    return f"notified of {charge_id}"


# -- Pydantic AI's durable agent ---------------------------------------------------------------


def make_agent() -> Any:
    """A ``TemporalDurability`` agent whose tool function is protected inside the activity
    Pydantic AI runs it in, driven by a scripted model."""
    from pydantic_ai import Agent, Tool
    from pydantic_ai.durable_exec.temporal import TemporalDurability
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from twiceshy.integrations.temporal import protect

    def model(messages: list[Any], info: AgentInfo) -> ModelResponse:
        results = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not results:
            call = ToolCallPart("charge", {"amount": 4900, "customer": "cus_1"}, "c1")
            return ModelResponse(parts=[call])
        return ModelResponse(parts=[TextPart(f"charged: {results[0].content}")])

    capabilities: list[Any] = [TemporalDurability()]
    if SCENARIO == "agent-capability":
        from pydantic_ai.capabilities import AbstractCapability

        class LedgerInWorkflow(AbstractCapability[Any]):
            """Where ``TwiceshyCapability`` sits: the ledger asked in ``wrap_tool_execute``."""

            async def wrap_tool_execute(
                self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any
            ) -> Any:
                guard = ledger.guard("charge", effect=EFFECT)
                return await guard.acall(dict(args), lambda: handler(args), scope=ctx.run_id)

        capabilities.append(LedgerInWorkflow())
        tool: Any = charge_body
    else:
        tool = protect(ledger, effect=EFFECT, name="charge", **TOOL_OPTIONS)(charge_body)
    return Agent(
        FunctionModel(model),
        name="shop",
        tools=[Tool(tool, name="charge")],
        capabilities=capabilities,
    )


agent = make_agent() if SCENARIO.startswith("agent") else None


# A workflow task Temporal queued for a worker that dies (on that worker's own sticky queue) goes
# to the shared queue, where the other worker polls, after this long: for the worker a scenario
# kills, 1 s, not the 10 s default, which its test would only wait out. (The others keep the
# default: a short one would move their tasks off their own cache whenever they are slow to poll.)
KILLED = SCENARIO.startswith("kill-") and PHASE == "first"
STICKY = timedelta(seconds=1 if KILLED else 10)


async def main() -> None:
    plugins: list[Any] = []
    client_plugins: list[Any] = []
    if agent is not None:
        from pydantic_ai.durable_exec.temporal import AgentPlugin, PydanticAIPlugin

        plugins, client_plugins = [AgentPlugin(agent)], [PydanticAIPlugin()]
    interceptors = [TwiceshyInterceptor()] if SETTINGS.get("interceptor", True) else []
    client = await Client.connect(
        SETTINGS["address"], plugins=client_plugins, interceptors=interceptors
    )
    worker = Worker(
        client,
        task_queue=SETTINGS["task_queue"],
        workflows=[
            Order,
            Misplaced,
            MisplacedAgentTool,
            OrderAgent,
            OrderChildren,
            CheckoutChild,
            ChargeChild,
        ],
        activities=[charge, notify],
        plugins=plugins,
        sticky_queue_schedule_to_start_timeout=STICKY,
    )
    (HERE / f"worker-{PHASE}.ready").write_text(str(os.getpid()))
    await worker.run()


if __name__ == "__main__":
    raise SystemExit(
        "run it as: python -c 'import asyncio, temporal_app; asyncio.run(temporal_app.main())'"
    )
