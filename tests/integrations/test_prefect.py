"""twiceshy inside Prefect tasks, through real flow runs on a Prefect server on loopback.

The module starts Prefect's local server (``prefect server start``, its SQLite database in a
temporary Prefect home, analytics and telemetry off) and runs each scenario's flow in a process of
its own (``prefect_app.py``, killed with SIGKILL where the scenario says so); for a killed one,
the flow run is marked crashed and retried with Prefect's own ``prefect flow-run retry``, which
runs the same flow run again. How the flow run ended is read back from Prefect by the test's own
process. Effects are counted by the provider double's file, and every command the ledger sent its
store is logged with whether it ran in a task.
"""

from __future__ import annotations

import os

# Before Prefect is imported here: its SDK analytics start when it is imported.
os.environ.setdefault("DO_NOT_TRACK", "1")

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docs_examples import run_example
from prefect.client.orchestration import get_client
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_LOGGING_TO_API_ENABLED,
    temporary_settings,
)
from prefect.states import Crashed, Failed
from provider_log import CHARGE, Provider

import twiceshy
from twiceshy import KEYED, errors
from twiceshy.integrations.prefect import (
    flow_run_scope,
    protect,
    retry_condition,
    task,
)

HERE = Path(__file__).resolve().parent
APP = HERE / "prefect_app.py"
PREFECT = Path(sys.executable).with_name("prefect")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Prefect's local server on a free loopback port, and the environment that points at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "PREFECT_UI_ENABLED": "false",
        "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
    }
    env.pop("PREFECT_API_URL", None)
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        api = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Prefect's server did not start: {(home / 'server.log').read_text()}")
            time.sleep(0.5)
        yield {**env, "PREFECT_API_URL": api}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()


def launch(env: dict[str, str], settings: dict[str, Any], phase: str, *command: str) -> int:
    """Run one phase of the app (or ``command`` with its settings); its exit status."""
    done = subprocess.run(
        list(command) or [sys.executable, str(APP)],
        env={**env, "TWICESHY_PREFECT_APP": json.dumps({**settings, "phase": phase})},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if done.returncode not in (0, -signal.SIGKILL) and not command:
        pytest.fail(f"the Prefect app failed ({done.returncode}):\n{done.stderr[-4000:]}")
    (Path(settings["dir"]) / f"{phase}.out").write_text(done.stdout)
    return done.returncode


def client_of(env: dict[str, str]) -> Any:
    """This process's Prefect settings pointed at the module's server and its Prefect home (where
    the flow runs' results are stored), for as long as the block lasts."""
    return temporary_settings(
        updates={
            PREFECT_API_URL: env["PREFECT_API_URL"],
            PREFECT_HOME: env["PREFECT_HOME"],
            PREFECT_LOGGING_TO_API_ENABLED: False,
        }
    )


async def mark_crashed(flow_run_id: uuid.UUID) -> None:
    """Mark the flow run crashed, as Prefect does for a run whose worker died."""
    async with get_client() as client:
        await client.set_flow_run_state(
            flow_run_id, Crashed(message="the worker was killed"), force=True
        )


async def read_back(flow_run_id: uuid.UUID) -> dict[str, Any]:
    """How the flow run ended, its error read back from Prefect's result storage."""
    async with get_client() as client:
        state = (await client.read_flow_run(flow_run_id)).state
    assert state is not None
    result = state.result(raise_on_failure=False)
    if asyncio.iscoroutine(result):
        result = await result
    if isinstance(result, BaseException):
        return {
            "state": state.type.value,
            "error": type(result).__name__,
            "message": str(result),
            "key": getattr(result, "key", None),
        }
    return {"state": state.type.value, "output": result}


def scenario(env: dict[str, str], tmp_path: Path, name: str, **more: Any) -> dict[str, Any]:
    """Run a scenario's flow in a process of its own; when that worker was killed, mark the flow
    run crashed and retry it with Prefect's own command. What the flow run ended with, read back
    from Prefect by this process (another than the flow's)."""
    settings = {"ledger": f"sqlite:///{tmp_path / 'ledger.db'}", "dir": str(tmp_path)}
    settings.update(scenario=name, **more)
    killed = launch(env, settings, "first") == -signal.SIGKILL
    flow_run = (tmp_path / "flow_run.txt").read_text()
    if killed:
        with client_of(env):
            asyncio.run(mark_crashed(uuid.UUID(flow_run)))
        entrypoint = f"{APP}:order"
        retry = [str(PREFECT), "flow-run", "retry", flow_run, "--entrypoint", entrypoint]
        launch(env, settings, "recover", *retry)
    with client_of(env):
        return asyncio.run(read_back(uuid.UUID(flow_run)))


def io(tmp_path: Path, phase: str | None = None) -> list[dict[str, Any]]:
    """The commands the ledger sent its store (of one phase), with where they ran."""
    log = tmp_path / "io.jsonl"
    commands = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [c for c in commands if phase is None or c["phase"] == phase]


def claims(commands: list[dict[str, Any]]) -> int:
    return sum(1 for c in commands if c["command"] == "claim")


def provider(tmp_path: Path) -> Provider:
    return Provider(tmp_path / "provider.jsonl")


def flow_run_key(tmp_path: Path) -> str:
    """The charge's key in the scenario's flow run: the flow run's id is the scope."""
    scope = (tmp_path / "flow_run.txt").read_text()
    return twiceshy.idempotency_key(scope, "charge", {"amount": 4900, "customer": "cus_1"})


# -- Prefect retries a task whose answer was lost ------------------------------------------------


def test_a_keyed_task_retried_after_a_lost_answer_charges_once(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """Prefect retries a KEYED task whose charge happened and whose answer was lost: the retry
    sends the same key (the flow run's), the provider charges once, the flow gets the charge."""
    ended = scenario(prefect_env, tmp_path, "lost-answer", effect="keyed")
    assert ended == {"state": "COMPLETED", "output": "notified of ch_1"}
    key = flow_run_key(tmp_path)
    assert provider(tmp_path).keys == [key, key]
    assert provider(tmp_path).effects == 1
    assert claims(io(tmp_path)) == 2


def test_an_unsafe_task_whose_answer_was_lost_ends_prefects_retries(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """An UNSAFE task that may have charged answers OutcomeUnknown, which ends Prefect's retries
    (two were allowed): one charge, one claim, and the flow run - read back from Prefect's result
    storage in another process - failed with the OutcomeUnknown and its key."""
    ended = scenario(prefect_env, tmp_path, "lost-answer", effect="unsafe")
    assert ended["state"] == "FAILED"
    assert ended["error"] == "OutcomeUnknown"
    assert ended["key"] == flow_run_key(tmp_path)
    assert len(provider(tmp_path).requests()) == 1
    assert claims(io(tmp_path)) == 1


def test_the_applications_own_retry_condition_is_still_asked(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """A task's own ``retry_condition_fn=`` decides for the tool's own errors: refusing a
    dropped connection, the KEYED task is not retried and the flow fails with it."""
    ended = scenario(prefect_env, tmp_path, "lost-answer", effect="keyed", refuse_retry=True)
    assert (ended["state"], ended["error"]) == ("FAILED", "ConnectionError")
    assert claims(io(tmp_path)) == 1


# -- the worker is killed, and the crashed flow run is retried ------------------------------------


def test_a_keyed_task_killed_mid_way_is_resumed_with_the_same_key(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The worker dies after the charge; the retried flow run (the same flow run id) runs the
    task again, which takes the lapsed claim over with the same key: one charge."""
    ended = scenario(prefect_env, tmp_path, "kill-in-task", effect="keyed")
    assert ended["state"] == "COMPLETED"
    assert ended["output"] == "notified of ch_1"
    requests = provider(tmp_path).requests()
    assert [r["key"] for r in requests] == [flow_run_key(tmp_path)] * 2
    assert requests[0]["pid"] != requests[1]["pid"]
    assert provider(tmp_path).effects == 1


def test_an_unsafe_task_killed_mid_way_answers_unknown_once(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The worker dies after an UNSAFE charge; the retried flow run's task answers OutcomeUnknown
    instead of charging again, and Prefect does not retry it: one charge, one claim."""
    ended = scenario(prefect_env, tmp_path, "kill-in-task", effect="unsafe")
    assert (ended["state"], ended["error"]) == ("FAILED", "OutcomeUnknown")
    assert ended["key"] == flow_run_key(tmp_path)
    assert len(provider(tmp_path).requests()) == 1
    assert claims(io(tmp_path, "recover")) == 1


def test_inside_the_dead_workers_lease_in_progress_says_prefect_does_not_retry(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The retried flow run's task meets the killed worker's claim inside its lease; with a
    wait= shorter than the lease, it answers InProgress, which ends Prefect's retries and says
    so, and says what a later identical call (a retry of the flow run) does once the lease
    lapses."""
    ended = scenario(
        prefect_env,
        tmp_path,
        "kill-in-task",
        effect="keyed",
        tool_options={"lease": 60.0, "wait": 0.5},
    )
    assert (ended["state"], ended["error"]) == ("FAILED", "InProgress")
    text = " ".join(ended["message"].split())
    assert "This call did not start it a second time, and Prefect does not retry this task." in text
    assert "the next identical call resumes it with the same idempotency key" in text
    assert len(provider(tmp_path).requests()) == 1


def test_an_outcome_recorded_before_prefect_kept_it_is_replayed(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The worker dies after the ledger recorded the charge, before Prefect recorded the task's
    result: the retried flow run's task gets the charge from the ledger and does not run."""
    ended = scenario(prefect_env, tmp_path, "kill-after-record", effect="unsafe")
    assert (ended["state"], ended["output"]) == ("COMPLETED", "notified of ch_1")
    assert len(provider(tmp_path).requests()) == 1


def test_a_retried_flow_run_takes_completed_tasks_from_prefect_without_the_ledger(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The worker dies in a later task; the retried flow run takes the completed charge from
    Prefect's cache: the ledger is not asked at all, and it never was outside a task."""
    ended = scenario(prefect_env, tmp_path, "kill-after-task", effect="keyed")
    assert (ended["state"], ended["output"]) == ("COMPLETED", "notified of ch_1")
    assert len(provider(tmp_path).requests()) == 1
    assert io(tmp_path, "recover") == []
    assert io(tmp_path)
    assert all(c["in_task"] for c in io(tmp_path))


# -- subflows ---------------------------------------------------------------------------------


def subflow_runs(tmp_path: Path) -> list[str]:
    """The id of every subflow run, in the order they started."""
    return [
        json.loads(line)["id"] for line in (tmp_path / "subflows.jsonl").read_text().splitlines()
    ]


def test_a_retried_parent_resumes_its_subflows_charge_with_the_same_key(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """A subflow of a subflow charges (KEYED), its answer is lost, and it fails, and so its
    parent subflow and the flow, which Prefect retries: Prefect runs both subflows again under
    new run ids, and the charge resumes with the key of their places in their parents (one
    charge, one key). The flow's second call of the subflow, with the same arguments, is an
    intent of its own."""
    ended = scenario(prefect_env, tmp_path, "children")
    assert ended == {"state": "COMPLETED", "output": "ch_1 ch_2"}
    lost, retried, second = subflow_runs(tmp_path)
    assert len({lost, retried, second}) == 3  # Prefect ran the retried subflow under a new id
    parent = (tmp_path / "flow_run.txt").read_text()
    first_key, second_key = (
        twiceshy.idempotency_key(f"{parent}/checkout#{n}/charge_order#0", "charge", CHARGE)
        for n in (0, 1)
    )
    assert provider(tmp_path).keys == [first_key, first_key, second_key]
    assert provider(tmp_path).effects == 2


def test_a_subflow_called_in_a_task_is_scoped_by_its_run_with_a_warning(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """A subflow called inside a task has no stable identity in its parent (Prefect names it at
    random): its charge is scoped by the subflow's own run, and twiceshy logs a warning that
    says so and to call the subflow from the flow's code."""
    ended = scenario(prefect_env, tmp_path, "child-in-task")
    assert ended["state"] == "COMPLETED"
    (subflow,) = subflow_runs(tmp_path)
    assert provider(tmp_path).keys == [twiceshy.idempotency_key(subflow, "charge", CHARGE)]
    logged = " ".join((tmp_path / "twiceshy.log").read_text().split())
    assert f"the subflow run {subflow}" in logged
    assert "has no stable identity in its parent" in logged
    assert "Call the subflow from the flow's own code" in logged


# -- Pydantic AI's durable agent ---------------------------------------------------------------


def test_a_durable_agents_protected_tool_is_retried_by_prefect_through_the_ledger(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """A PrefectDurability agent whose tool function is protected: Prefect's retry of the tool's
    task, after a lost answer, comes back through the ledger in the task - the same key, one
    charge - and the model reads the charge."""
    ended = scenario(prefect_env, tmp_path, "agent-in-task", effect="keyed")
    assert (ended["state"], ended["output"]) == ("COMPLETED", "charged: ch_1")
    keys = provider(tmp_path).keys
    assert len(keys) == 2
    assert len(set(keys)) == 1
    assert keys[0] is not None
    assert all(c["in_task"] for c in io(tmp_path))


def test_the_ledger_in_wrap_tool_execute_is_outside_prefects_task_and_its_retries(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The hazard, reproduced: where TwiceshyCapability sits (``wrap_tool_execute``), a
    PrefectDurability agent asks the ledger in the flow, around the tool's task; Prefect's retry
    of that task after a lost answer never meets the ledger, and the provider charges twice."""
    ended = scenario(prefect_env, tmp_path, "agent-capability", effect="unsafe")
    assert ended["state"] == "COMPLETED"
    assert len(provider(tmp_path).requests()) == 2
    assert claims(io(tmp_path)) == 1
    assert not any(c["in_task"] for c in io(tmp_path))


def test_twiceshy_capability_is_refused_on_a_prefect_durable_agent() -> None:
    """TwiceshyCapability on a PrefectDurability agent is refused with Pydantic AI's UserError,
    which says to protect the tool function."""
    from pydantic_ai import Agent
    from pydantic_ai.durable_exec.prefect import PrefectDurability
    from pydantic_ai.exceptions import UserError
    from pydantic_ai.models.test import TestModel

    from twiceshy.integrations.pydantic_ai import TwiceshyCapability

    capability = TwiceshyCapability(twiceshy.Ledger("memory://"), default=twiceshy.SAFE)
    with pytest.raises(UserError, match=r"twiceshy\.integrations\.prefect\.protect\(ledger"):
        Agent(TestModel(), name="shop", capabilities=[PrefectDurability(), capability])


# -- outside a flow run, and the pieces ------------------------------------------------------------


def test_outside_a_flow_run_the_tool_is_scoped_as_any_protected_tool(tmp_path: Path) -> None:
    """Called outside any flow run, a protected tool has no flow run scope: an enclosing
    twiceshy.run scopes it, and it refuses to run without one."""
    ledger = twiceshy.Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    calls: list[int] = []

    @protect(ledger, effect=KEYED)
    def charge(amount: int) -> int:
        calls.append(amount)
        return amount

    assert flow_run_scope() is None
    with twiceshy.run("outside"):
        assert charge(5) == charge(5) == 5
    assert calls == [5]
    with pytest.raises(twiceshy.MissingScope):
        charge(6)
    ledger.close()


def test_task_and_protect_refuse_what_is_not_a_ledger() -> None:
    """A tool protected with something else than a Ledger is refused when declared."""
    with pytest.raises(TypeError, match=r"twiceshy\.Ledger"):
        task("sqlite:///ledger.db", effect=KEYED)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"twiceshy\.Ledger"):
        protect("sqlite:///ledger.db", effect=KEYED)  # type: ignore[arg-type]


def asked(state: Any) -> bool:
    """What the retry condition answers for a task run that ended in ``state``."""
    return asyncio.run(retry_condition(None, None, state))  # type: ignore[arg-type]


FINAL = [
    errors.OutcomeUnknown("charge", "k" * 64, "TimeoutError"),
    errors.InProgress("charge", "k" * 64),
    errors.KeyReuseMismatch("the key names other arguments"),
    errors.MissingScope("no scope"),
    errors.UnkeyableType("args.when", "cannot make a key from a Foo"),
    errors.RepeatedRequest("charge", "POST", "https://api.example/charges"),
    errors.OutcomeNotRecorded("charge", "k" * 64),
]


@pytest.mark.parametrize("error", FINAL, ids=lambda e: type(e).__name__)
def test_the_retry_condition_refuses_twiceshys_final_answers(error: Exception) -> None:
    """A task run that failed with a twiceshy answer no retry can change is not retried."""
    assert asked(Failed(data=error)) is False


@pytest.mark.parametrize(
    "error",
    [errors.NotApplied("nothing sent"), errors.StoreUnavailable("down"), ConnectionError("x")],
    ids=lambda e: type(e).__name__,
)
def test_the_retry_condition_lets_prefect_retry_the_rest(error: Exception) -> None:
    """NotApplied, an unreachable ledger (nothing ran) and the tool's own errors are retried."""
    assert asked(Failed(data=error)) is True


def test_the_docs_example_runs(prefect_env: dict[str, str], tmp_path: Path) -> None:
    """docs/durable_engines.md's Prefect example runs as written against a Prefect server."""
    done = run_example(tmp_path, ["prefect_shop.py"], prefect_env)
    assert done.returncode == 0, done.stderr
    (charge,) = done.stdout.split()
    assert re.fullmatch(r"ch_[0-9a-f]{12}", charge)
