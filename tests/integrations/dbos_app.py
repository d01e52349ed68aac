"""A DBOS application for tests/integrations/test_dbos*.py, run as a process of its own (DBOS
is one per process, and a test kills some of them with SIGKILL).

``python dbos_app.py SETTINGS_JSON`` launches DBOS on the settings' system database, then, in
phase ``first``, starts the workflow ``wf-1`` of the settings' scenario and waits for it; in
phase ``recover`` (started beside the first, it goes on once the file ``recover.go`` says that the
first worker died) it lets DBOS recover that workflow and waits for it. Either way it prints what
the workflow ended with, as one JSON line (scenario ``recover-in-lease`` starts three workflows,
and prints what each ended with, by its id). Every command the ledger sends its store is written
to ``io.jsonl`` with where it ran (the workflow id, and DBOS's step id: ``null`` in workflow
code), and every charge the provider double got to ``provider.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dbos import DBOS, SetWorkflowID
from provider_log import Provider

import twiceshy
from twiceshy import KEYED, UNSAFE
from twiceshy.integrations.dbos import step
from twiceshy.stores import open_store

SETTINGS: dict[str, Any] = json.loads(sys.argv[1])
SCENARIO: str = SETTINGS["scenario"]
PHASE: str = SETTINGS["phase"]
HERE = Path(SETTINGS["dir"])
WORKFLOW_ID = "wf-1"
provider = Provider(HERE / "provider.jsonl")


def wait_for_the_first_to_die() -> None:
    """Phase ``recover``: the test starts this process beside the first worker, so that it imports
    meanwhile; it opens the ledger and launches DBOS only once the test has seen that worker die
    (the file ``recover.go``), as a worker started after the crash would."""
    if SCENARIO.startswith("agent"):
        import pydantic_ai.durable_exec.dbos  # noqa: F401  (imported while waiting)
    go = HERE / "recover.go"
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("the test did not say that the first worker died")
        time.sleep(0.02)


def note(name: str, **fields: Any) -> None:
    """One line in a log of this test's directory; O_APPEND lines are whole between processes."""
    with (HERE / name).open("a", encoding="utf-8") as out:
        out.write(json.dumps(fields) + "\n")


def die() -> None:
    """The worker dies here, as kill -9 would end it."""
    os.kill(os.getpid(), signal.SIGKILL)


class Seen:
    """A store seen: every command is noted with the DBOS context it ran in, then sent on."""

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
                workflow=DBOS.workflow_id,
                step=DBOS.step_id,
                phase=PHASE,
            )
            return command(*args, **kwargs)

        if asyncio.iscoroutinefunction(command):

            async def seen_async(*args: Any, **kwargs: Any) -> Any:
                return await seen(*args, **kwargs)

            return seen_async
        return seen


if PHASE == "recover":
    wait_for_the_first_to_die()
store, async_store = open_store(SETTINGS["ledger"])
ledger = twiceshy.Ledger(store=Seen(store), async_store=Seen(async_store))  # type: ignore[arg-type]


def after_record(event: twiceshy.CallEvent) -> None:
    """Scenario ``kill-after-record``: die once the ledger holds the outcome, before DBOS has
    checkpointed the step."""
    if PHASE == "first" and event.tool == "charge":
        die()


if SCENARIO == "kill-after-record":
    ledger.observe(after_record)

# -- the tools: twiceshy inside the step -----------------------------------------------------

EFFECT = {"keyed": KEYED, "unsafe": UNSAFE}[SETTINGS.get("effect", "keyed")]
STEP_OPTIONS: dict[str, Any] = {
    "retries_allowed": True,
    "max_attempts": 3,
    "interval_seconds": 0.1,
    "backoff_rate": 1.0,
}
# One twiceshy attempt per DBOS attempt: the engine's retry is the one under test.
TOOL_OPTIONS: dict[str, Any] = {"lease": 1.0, "wait": 15.0}
if EFFECT is KEYED:
    TOOL_OPTIONS["attempts"] = 1
runs = 0


if SETTINGS.get("refuse_retry"):
    # The application's own predicate: a dropped connection is not to be retried.
    STEP_OPTIONS["should_retry"] = lambda error: not isinstance(error, ConnectionError)


def charge_body(amount: int, customer: str) -> str:
    """Charge the customer; the provider deduplicates by key (a KEYED tool sends one)."""
    global runs
    runs += 1
    key = twiceshy.current_key() if EFFECT is KEYED else None
    charge_id = provider.charge(key, amount, customer)
    if SCENARIO == "lost-answer" and runs == 1:
        raise ConnectionError("the connection dropped before the provider's answer arrived")
    if SCENARIO in ("kill-in-step", "kill-in-child") and PHASE == "first":
        die()
    return charge_id


@DBOS.step()
def notify(charge_id: str) -> str:
    """Tell the customer; scenario ``kill-after-step`` dies here, after ``charge`` was
    checkpointed."""
    if SCENARIO == "kill-after-step" and PHASE == "first":
        die()
    return f"notified of {charge_id}"


if SETTINGS.get("async"):

    @step(ledger, effect=EFFECT, name="charge", **STEP_OPTIONS, **TOOL_OPTIONS)
    async def charge(amount: int, customer: str) -> str:
        """The charge as an async step."""
        return charge_body(amount, customer)

    @DBOS.workflow()
    async def order(amount: int, customer: str) -> str:
        """Charge, then notify: twiceshy runs in the steps only."""
        return notify(await charge(amount, customer))

else:

    @step(ledger, effect=EFFECT, name="charge", **STEP_OPTIONS, **TOOL_OPTIONS)
    def charge(amount: int, customer: str) -> str:
        """The charge as a step."""
        return charge_body(amount, customer)

    @DBOS.workflow()
    def order(amount: int, customer: str) -> str:
        """Charge, then notify: twiceshy runs in the steps only."""
        return notify(charge(amount, customer))


# -- child workflows ---------------------------------------------------------------------------


@DBOS.workflow()
def charge_child(amount: int, customer: str) -> str:
    """A child workflow that charges; started without an id, DBOS derives one from its parent's
    id and the call's position (scenario ``kill-in-child`` dies in the first one's charge)."""
    return charge(amount, customer)


@DBOS.workflow()
def order_children(amount: int, customer: str) -> str:
    """Two children, each charging the same arguments: two children, two intents."""
    first = charge_child(amount, customer)
    second = charge_child(amount, customer)
    return f"{first} {second}"


# -- a recovery inside the dead worker's lease -------------------------------------------------

# Much longer than the recovering worker takes to launch DBOS once the first one died (it has
# imported everything before): the recovery meets the killed worker's claims well inside their
# lease, and a step's default wait (the lease and 5 s) outlasts it.
LEASE_IN_RECOVERY = 6.0
# Scenario ``recover-in-lease``: three workflows charge at once, and the worker dies once all
# three have charged, each inside its step.
charged_all = threading.Barrier(3, action=die)


def charge_in_lease(amount: int, customer: str, key: str | None) -> str:
    """Charge; in phase ``first``, die once every workflow of the scenario has charged."""
    charge_id = provider.charge(key, amount, customer)
    if PHASE == "first":
        charged_all.wait(60)
    return charge_id


@step(ledger, effect=KEYED, name="charge_keyed", lease=LEASE_IN_RECOVERY)
def charge_keyed(amount: int, customer: str) -> str:
    """A KEYED charge, with the step's default wait."""
    return charge_in_lease(amount, customer, twiceshy.current_key())


@step(ledger, effect=UNSAFE, name="charge_unsafe", lease=LEASE_IN_RECOVERY)
def charge_unsafe(amount: int, customer: str) -> str:
    """An UNSAFE charge, with the step's default wait."""
    return charge_in_lease(amount, customer, None)


@step(ledger, effect=KEYED, name="charge_hasty", lease=LEASE_IN_RECOVERY, wait=0.5)
def charge_hasty(amount: int, customer: str) -> str:
    """A KEYED charge whose own ``wait=`` is shorter than its lease: it answers InProgress."""
    return charge_in_lease(amount, customer, twiceshy.current_key())


IN_LEASE = {"wf-keyed": charge_keyed, "wf-unsafe": charge_unsafe, "wf-hasty": charge_hasty}


@DBOS.workflow()
def order_in_lease(workflow_id: str, amount: int, customer: str) -> str:
    """Charge with the step of this workflow's id."""
    return IN_LEASE[workflow_id](amount, customer)


# -- Pydantic AI's durable agent ---------------------------------------------------------------


def agent_order() -> Any:
    """The workflow of the ``agent-*`` scenarios: a ``DBOSDurability`` agent charges, driven by
    a scripted model whose second request, in phase ``first``, kills the worker (after the
    charge was checkpointed)."""
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.durable_exec.dbos import DBOSDurability
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    def model(messages: list[Any], info: AgentInfo) -> ModelResponse:
        results = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not results:
            call = ToolCallPart("charge", {"amount": 4900, "customer": "cus_1"}, tool_call_id="c1")
            return ModelResponse(parts=[call])
        if PHASE == "first":
            die()
        return ModelResponse(parts=[TextPart(f"charged: {results[0].content}")])

    capabilities: list[Any] = [DBOSDurability()]
    tool: Any = charge
    if SCENARIO == "agent-capability":

        class LedgerInWorkflow(AbstractCapability[Any]):
            """Where ``TwiceshyCapability`` sits: the ledger asked in ``wrap_tool_execute``."""

            async def wrap_tool_execute(
                self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any
            ) -> Any:
                guard = ledger.guard("charge", effect=KEYED)
                return await guard.acall(dict(args), lambda: handler(args), scope=ctx.run_id)

        capabilities.append(LedgerInWorkflow())

        @DBOS.step(name="charge_body")
        def unprotected_body(amount: int, customer: str) -> str:
            return provider.charge(None, amount, customer)

        async def plain_charge(amount: int, customer: str) -> str:
            """Charge the customer: DBOS's own advice, the body in a step."""
            return unprotected_body(amount, customer)

        tool = plain_charge
        tool.__name__ = "charge"

    agent = Agent(FunctionModel(model), name="shop", tools=[tool], capabilities=capabilities)

    @DBOS.workflow(name="order_agent")
    async def order_agent(amount: int, customer: str) -> str:
        result = await agent.run(f"charge {amount} to {customer}")
        return result.output

    return order_agent


order_agent = agent_order() if SCENARIO.startswith("agent") else None


# How often this process looks for a workflow's end or a notification in the system database:
# a tenth of DBOS's default second, which a test would only wait out (DBOS's own advice for tests).
POLL = 0.1


def outcome(handle: Any) -> dict[str, Any]:
    """What the workflow ended with."""
    try:
        return {"output": handle.get_result(polling_interval_sec=POLL)}
    except BaseException as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "key": getattr(exc, "key", None),
        }


def main() -> None:
    config: dict[str, Any] = {
        "name": "twiceshy-test",
        "system_database_url": SETTINGS["system_database"],
        "application_version": "1",
        "log_level": "WARNING",
        "notification_listener_polling_interval_sec": POLL,
    }
    if SETTINGS.get("schema"):
        config["dbos_system_schema"] = SETTINGS["schema"]
    DBOS(config=config)  # type: ignore[arg-type]
    DBOS.launch()
    try:
        if SCENARIO == "recover-in-lease":
            handles = {}
            for workflow_id in IN_LEASE:
                if PHASE == "first":
                    with SetWorkflowID(workflow_id):
                        handles[workflow_id] = DBOS.start_workflow(
                            order_in_lease, workflow_id, 4900, "cus_1"
                        )
                else:
                    handles[workflow_id] = DBOS.retrieve_workflow(workflow_id)
            print(json.dumps({w: outcome(h) for w, h in handles.items()}), flush=True)
            return
        if PHASE == "first":
            with SetWorkflowID(WORKFLOW_ID):
                workflow = order
                if SCENARIO.startswith("agent"):
                    workflow = order_agent
                elif SCENARIO == "kill-in-child":
                    workflow = order_children
                handle = DBOS.start_workflow(workflow, 4900, "cus_1")
        else:
            handle = DBOS.retrieve_workflow(WORKFLOW_ID)
        print(json.dumps(outcome(handle)), flush=True)
    finally:
        DBOS.destroy()
        ledger.close()


if __name__ == "__main__":
    main()
