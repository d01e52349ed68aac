"""twiceshy inside DBOS steps, through real DBOS workflows on SQLite and on PostgreSQL.

Each scenario runs ``dbos_app.py`` in processes of its own: one starts the workflow (and is
killed with SIGKILL where the scenario says so), the next lets DBOS recover it. Effects are
counted by the provider double's file, and every command the ledger sent its store is logged
with the DBOS context it ran in, so a test sees whether the ledger was asked in workflow code.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dbos import DBOSClient
from docs_examples import run_example
from provider_log import CHARGE, Provider

import servers
import twiceshy
from twiceshy import KEYED, UNSAFE, errors
from twiceshy.integrations.dbos import retryable, step, workflow_scope

HERE = Path(__file__).resolve().parent
APP = HERE / "dbos_app.py"
KEY = twiceshy.idempotency_key("wf-1", "charge", {"amount": 4900, "customer": "cus_1"})


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """DBOS's system database and the ledger: SQLite files, or schemas of their own on the test
    PostgreSQL server (dropped afterwards)."""
    if request.param == "sqlite":
        yield {
            "system_database": f"sqlite:///{tmp_path / 'dbos.db'}",
            "ledger": f"sqlite:///{tmp_path / 'ledger.db'}",
            "dir": str(tmp_path),
        }
        return
    url = servers.require("postgres")
    suffix = uuid.uuid4().hex[:10]
    dbos_schema, ledger_schema = f"dbos_{suffix}", f"ledger_{suffix}"
    try:
        yield {
            "system_database": url,
            "schema": dbos_schema,
            "ledger": f"{url}?schema={ledger_schema}",
            "dir": str(tmp_path),
        }
    finally:
        servers.drop_schema(url, dbos_schema)
        servers.drop_schema(url, ledger_schema)


def start(settings: dict[str, Any], phase: str) -> subprocess.Popen[str]:
    """Start the app in one phase."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    command = [sys.executable, str(APP), json.dumps({**settings, "phase": phase})]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, dict[str, Any]]:
    """Wait for the app to end; its exit status and what the workflow ended with."""
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    if process.returncode not in (0, -signal.SIGKILL):
        pytest.fail(f"the DBOS app failed ({process.returncode}):\n{stderr[-4000:]}")
    lines = stdout.strip().splitlines()
    return process.returncode, (json.loads(lines[-1]) if process.returncode == 0 and lines else {})


def launch(settings: dict[str, Any], phase: str) -> tuple[int, dict[str, Any]]:
    """Run the app in one phase; its exit status and what the workflow ended with."""
    return finish(start(settings, phase))


def crash_and_recover(settings: dict[str, Any]) -> dict[str, Any]:
    """Start the workflow in a worker that is killed mid-way, then recover it in another: started
    beside the first so that it imports meanwhile, the other launches DBOS once the first died."""
    recovering = start(settings, "recover")
    try:
        status, _ = launch(settings, "first")
        assert status == -signal.SIGKILL, "the first worker was to be killed"
        (Path(settings["dir"]) / "recover.go").write_text("the first worker died")
        status, ended = finish(recovering)
    finally:
        if recovering.poll() is None:
            recovering.kill()
            recovering.communicate()
    assert status == 0
    return ended


def io(settings: dict[str, Any], phase: str | None = None) -> list[dict[str, Any]]:
    """The commands the ledger sent its store (of one phase), with where they ran."""
    log = Path(settings["dir"]) / "io.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    commands = [json.loads(line) for line in lines]
    return [c for c in commands if phase is None or c["phase"] == phase]


def provider(settings: dict[str, Any]) -> Provider:
    return Provider(Path(settings["dir"]) / "provider.jsonl")


def heard(settings: dict[str, Any], workflow_id: str = "wf-1") -> BaseException:
    """The error the workflow ended with, as another process reads it from DBOS's journal."""
    client = DBOSClient(
        system_database_url=settings["system_database"],
        dbos_system_schema=settings.get("schema") or "dbos",
    )
    try:
        client.retrieve_workflow(workflow_id).get_result()
    except BaseException as exc:
        return exc
    finally:
        client.destroy()
    pytest.fail("the workflow ended without an error")


def claims(commands: list[dict[str, Any]]) -> int:
    return sum(1 for c in commands if c["command"] == "claim")


# -- the engine retries a step whose answer was lost -------------------------------------------


@pytest.mark.parametrize("is_async", [False, True], ids=["def", "async"])
def test_a_keyed_step_retried_after_a_lost_answer_charges_once(
    engine: dict[str, Any], is_async: bool
) -> None:
    """DBOS retries a KEYED step whose charge happened and whose answer was lost: the retry
    sends the same key, the provider charges once, and the workflow gets the charge."""
    settings = {**engine, "scenario": "lost-answer", "effect": "keyed", "async": is_async}
    status, ended = launch(settings, "first")
    assert (status, ended) == (0, {"output": "notified of ch_1"})
    assert provider(settings).keys == [KEY, KEY]
    assert provider(settings).effects == 1
    assert claims(io(settings)) == 2  # the engine's retry went through the ledger


def test_an_unsafe_step_whose_answer_was_lost_ends_the_engines_retries(
    engine: dict[str, Any],
) -> None:
    """An UNSAFE step that may have charged answers OutcomeUnknown, which DBOS does not retry
    (three attempts were allowed): one charge, one claim, and the workflow - read back from
    DBOS's journal by another process - ends with the OutcomeUnknown and its key."""
    settings = {**engine, "scenario": "lost-answer", "effect": "unsafe"}
    status, ended = launch(settings, "first")
    assert status == 0
    assert ended["error"] == "OutcomeUnknown"
    assert ended["key"] == KEY
    assert "will not be run again" in ended["message"]
    assert len(provider(settings).requests()) == 1
    assert claims(io(settings)) == 1
    error = heard(settings)
    assert isinstance(error, twiceshy.OutcomeUnknown)
    assert (error.tool, error.key) == ("charge", KEY)


def test_the_applications_own_should_retry_is_still_asked(engine: dict[str, Any]) -> None:
    """A step's own ``should_retry=`` decides for the tool's own errors: refusing a dropped
    connection, the KEYED step is not retried, and the workflow hears the ConnectionError."""
    settings = {**engine, "scenario": "lost-answer", "effect": "keyed", "refuse_retry": True}
    status, ended = launch(settings, "first")
    assert status == 0
    assert ended["error"] == "ConnectionError"
    assert claims(io(settings)) == 1


# -- the worker is killed, and DBOS recovers the workflow --------------------------------------


def test_a_keyed_step_killed_mid_way_is_resumed_with_the_same_key(engine: dict[str, Any]) -> None:
    """The worker dies after the charge, before the step's checkpoint; DBOS's recovery runs the
    step again, which takes the lapsed claim over with the same key: one charge."""
    settings = {**engine, "scenario": "kill-in-step", "effect": "keyed"}
    ended = crash_and_recover(settings)
    assert ended == {"output": "notified of ch_1"}
    requests = provider(settings).requests()
    assert [r["key"] for r in requests] == [KEY, KEY]
    assert requests[0]["pid"] != requests[1]["pid"]
    assert provider(settings).effects == 1


def test_an_unsafe_step_killed_mid_way_answers_unknown_once(engine: dict[str, Any]) -> None:
    """The worker dies after an UNSAFE charge; the recovered step answers OutcomeUnknown instead
    of charging again, and DBOS does not retry it: one charge, one claim in the recovery."""
    settings = {**engine, "scenario": "kill-in-step", "effect": "unsafe"}
    ended = crash_and_recover(settings)
    assert ended["error"] == "OutcomeUnknown"
    assert ended["key"] == KEY
    assert len(provider(settings).requests()) == 1
    assert claims(io(settings, "recover")) == 1
    unknown = heard(settings)
    assert isinstance(unknown, twiceshy.OutcomeUnknown)
    # No promise of a later call DBOS never makes: its recovery and resume replay this error.
    text = " ".join(str(unknown).split())
    assert "the next call runs it" not in text
    assert "a recovery or a resume of this DBOS workflow" in text
    assert "answers this same error whatever is recorded" in text


def test_an_outcome_recorded_before_the_checkpoint_is_replayed(engine: dict[str, Any]) -> None:
    """The worker dies after the ledger recorded the charge and before DBOS checkpointed the
    step: the recovered step gets the recorded charge from the ledger and does not run."""
    settings = {**engine, "scenario": "kill-after-record", "effect": "unsafe"}
    ended = crash_and_recover(settings)
    assert ended == {"output": "notified of ch_1"}
    assert len(provider(settings).requests()) == 1


def test_recovery_replays_checkpointed_steps_without_asking_the_ledger(
    engine: dict[str, Any],
) -> None:
    """The worker dies in a later step; DBOS's recovery replays the checkpointed charge from its
    journal: the ledger is not asked at all, and it never was in workflow code."""
    settings = {**engine, "scenario": "kill-after-step", "effect": "keyed"}
    ended = crash_and_recover(settings)
    assert ended == {"output": "notified of ch_1"}
    assert len(provider(settings).requests()) == 1
    assert io(settings, "recover") == []
    commands = io(settings)
    assert commands
    assert all(c["workflow"] == "wf-1" and c["step"] is not None for c in commands)


def test_a_recovery_inside_the_dead_workers_lease_waits_it_out(engine: dict[str, Any]) -> None:
    """The worker dies mid-step and DBOS recovers its workflows at once, well inside the dead
    claims' 6 s lease: by default a step waits the lease out, then a KEYED charge resumes with
    the same key (one effect) and an UNSAFE one answers OutcomeUnknown. A step whose own wait=
    is shorter answers InProgress, which promises no later call: DBOS does not run it again."""
    settings = {**engine, "scenario": "recover-in-lease"}
    ended = crash_and_recover(settings)
    waited = {c["workflow"] for c in io(settings, "recover") if c["command"] == "wait"}
    assert {"wf-keyed", "wf-unsafe"} <= waited  # the recovery met the claims inside their lease
    keyed = twiceshy.idempotency_key("wf-keyed", "charge_keyed", CHARGE)
    resumed = [r for r in provider(settings).requests() if r["key"] == keyed]
    assert len(resumed) == 2
    assert resumed[0]["pid"] != resumed[1]["pid"]
    assert ended["wf-keyed"]["output"].startswith("ch_")
    assert ended["wf-unsafe"]["error"] == "OutcomeUnknown"
    assert [r["key"] for r in provider(settings).requests()].count(None) == 1
    hasty = ended["wf-hasty"]
    assert hasty["error"] == "InProgress"
    assert hasty["key"] == twiceshy.idempotency_key("wf-hasty", "charge_hasty", CHARGE)
    text = " ".join(hasty["message"].split())
    assert "DBOS does not run this step again" in text
    assert "Nothing will take it up by itself" in text
    assert "next identical call" not in text
    assert str(heard(settings, "wf-hasty")) == hasty["message"]


def test_a_child_workflows_scope_is_the_id_dbos_derives_for_it(tmp_path: Path) -> None:
    """Child workflows started without an id: DBOS derives each one's id from its parent's and
    the call's position, the same in the recovery. The worker dies in the first child's KEYED
    charge; the recovered child resumes it with the same key (one effect), and the second child,
    with the same arguments, is an intent of its own."""
    settings = {
        "system_database": f"sqlite:///{tmp_path / 'dbos.db'}",
        "ledger": f"sqlite:///{tmp_path / 'ledger.db'}",
        "dir": str(tmp_path),
        "scenario": "kill-in-child",
        "effect": "keyed",
    }
    ended = crash_and_recover(settings)
    first, second = (twiceshy.idempotency_key(f"wf-1-{n}", "charge", CHARGE) for n in (1, 3))
    assert provider(settings).keys == [first, first, second]
    assert provider(settings).effects == 2
    assert ended == {"output": "ch_1 ch_2"}


# -- Pydantic AI's durable agent ---------------------------------------------------------------


def test_a_durable_agents_tool_in_a_twiceshy_step_recovers_without_workflow_io(
    tmp_path: Path,
) -> None:
    """A DBOSDurability agent whose tool is a twiceshy step: the worker dies after the charge,
    the recovered workflow replays it from DBOS's journal and finishes; one charge, and the
    ledger was only ever asked inside the step."""
    settings = {
        "system_database": f"sqlite:///{tmp_path / 'dbos.db'}",
        "ledger": f"sqlite:///{tmp_path / 'ledger.db'}",
        "dir": str(tmp_path),
        "scenario": "agent-in-step",
    }
    ended = crash_and_recover(settings)
    assert ended == {"output": "charged: ch_1"}
    assert provider(settings).effects == 1
    assert io(settings, "recover") == []
    assert all(c["step"] is not None for c in io(settings))


def test_the_ledger_in_wrap_tool_execute_runs_in_workflow_code_and_breaks_recovery(
    tmp_path: Path,
) -> None:
    """The hazard, reproduced: where TwiceshyCapability sits (``wrap_tool_execute``), a
    DBOSDurability agent asks the ledger in workflow code, on the first run and again in the
    recovery's replay; the ledger's replayed answer skips the tool's checkpointed step, and DBOS
    refuses the recovery as non-deterministic."""
    settings = {
        "system_database": f"sqlite:///{tmp_path / 'dbos.db'}",
        "ledger": f"sqlite:///{tmp_path / 'ledger.db'}",
        "dir": str(tmp_path),
        "scenario": "agent-capability",
    }
    ended = crash_and_recover(settings)
    replayed = io(settings, "recover")
    assert replayed
    assert all(c["workflow"] == "wf-1" and c["step"] is None for c in io(settings))
    assert ended["error"] == "DBOSUnexpectedStepError"


def test_twiceshy_capability_is_refused_on_a_dbos_durable_agent() -> None:
    """TwiceshyCapability on a DBOSDurability agent - built with it, or given it for one run -
    is refused with Pydantic AI's UserError, which says to make the tool a twiceshy step."""
    from pydantic_ai import Agent
    from pydantic_ai.durable_exec.dbos import DBOSDurability
    from pydantic_ai.exceptions import UserError
    from pydantic_ai.models.test import TestModel

    from twiceshy.integrations.pydantic_ai import TwiceshyCapability

    ledger = twiceshy.Ledger("memory://")
    capability = TwiceshyCapability(ledger, default=twiceshy.SAFE)
    with pytest.raises(UserError, match=r"twiceshy\.integrations\.dbos\.step\(ledger"):
        Agent(TestModel(), name="shop", capabilities=[DBOSDurability(), capability])
    durable = Agent(TestModel(), name="shop_run", capabilities=[DBOSDurability()])
    with pytest.raises(UserError, match="wrap_tool_execute runs in the workflow's own code"):
        durable.run_sync("hello", capabilities=[capability])


# -- outside a workflow, and the pieces ----------------------------------------------------------


def test_outside_a_workflow_the_step_is_a_protected_call(tmp_path: Path) -> None:
    """Called outside any workflow, the step has no workflow scope: it is scoped as any
    protected tool, by an enclosing twiceshy.run, and refuses to run without one."""
    ledger = twiceshy.Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    calls: list[int] = []

    @step(ledger, effect=KEYED)
    def charge(amount: int) -> int:
        calls.append(amount)
        return amount

    assert workflow_scope() is None
    with twiceshy.run("outside"):
        assert charge(5) == charge(5) == 5
    assert calls == [5]
    with pytest.raises(twiceshy.MissingScope):
        charge(6)
    assert calls == [5]
    ledger.close()


def test_the_step_refuses_what_is_not_a_ledger() -> None:
    """A step made with something else than a Ledger is refused when declared."""
    with pytest.raises(TypeError, match=r"twiceshy\.Ledger"):
        step("sqlite:///ledger.db", effect=UNSAFE)  # type: ignore[arg-type]


FINAL = [
    errors.OutcomeUnknown("charge", KEY, "TimeoutError"),
    errors.InProgress("charge", KEY, started_at=1.0e9, lapses_at=1.0e9 + 30, effect="keyed"),
    errors.KeyReuseMismatch("the key names other arguments"),
    errors.MissingScope("no scope"),
    errors.UnkeyableType("args.when", "cannot make a key from a Foo"),
    errors.UnkeyableValue("args.amount", "NaN names no intent"),
    errors.ResultNotStorable("no JSON form", tool="charge"),
    errors.RepeatedRequest("charge", "POST", "https://api.example/charges"),
    errors.ReplayedError("CardDeclined", "declined"),
    errors.FencedOut("charge", KEY),
    errors.OutcomeNotRecorded("charge", KEY, "the store went away"),
]


@pytest.mark.parametrize("error", FINAL, ids=lambda e: type(e).__name__)
def test_twiceshys_final_answers_are_not_retried(error: BaseException) -> None:
    """Every twiceshy answer that a retry cannot change is not retryable for DBOS."""
    assert retryable(error) is False


@pytest.mark.parametrize(
    "error",
    [errors.NotApplied("nothing sent"), errors.StoreUnavailable("down"), ConnectionError("x")],
    ids=lambda e: type(e).__name__,
)
def test_nothing_ran_and_the_tools_own_errors_are_retryable(error: BaseException) -> None:
    """NotApplied, an unreachable ledger (nothing ran) and the tool's own errors stay
    retryable."""
    assert retryable(error) is True


@pytest.mark.parametrize("error", FINAL, ids=lambda e: type(e).__name__)
def test_errors_leaving_a_step_survive_dboss_journal(tmp_path: Path, error: Exception) -> None:
    """A twiceshy error raised out of a step pickles and loads back (as DBOS journals it) as
    the same type, message and fields."""
    ledger = twiceshy.Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")

    @step(ledger, effect=twiceshy.SAFE, attempts=1)
    def raises() -> None:
        raise error

    with pytest.raises(type(error)) as caught:
        raises()
    loaded = pickle.loads(pickle.dumps(caught.value))
    assert type(loaded) is type(error)
    assert str(loaded) == str(error)
    assert _fields(loaded) == _fields(error)
    assert _fields(pickle.loads(pickle.dumps(loaded))) == _fields(error)
    ledger.close()


def _fields(error: BaseException) -> dict[str, Any]:
    return {name: value for name, value in vars(error).items() if name != "__reduce_ex__"}


def test_the_docs_example_runs(tmp_path: Path) -> None:
    """docs/durable_engines.md's DBOS example runs as written and charges under the key of its
    workflow's id."""
    done = run_example(tmp_path, ["dbos_shop.py"])
    assert done.returncode == 0, done.stderr
    args = {"order_id": "order-1234", "amount": 4900}
    key = twiceshy.idempotency_key("order-1234", "create_charge", args)
    assert done.stdout.split() == [f"ch_{key[:12]}"]
