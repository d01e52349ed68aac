"""The Google ADK adapter, through a real ``LlmAgent`` and ``InMemoryRunner`` driven by a
scripted ``BaseLlm`` (scripted_google_adk.py).

Each test re-enacts the incident: a tool takes effect and its answer is lost (a timeout, a
crash); the model calls it again under a new function-call id, or the run is started again on
its session, and the effect (counted by a provider double) happens once.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.adk.agents import LlmAgent
from google.adk.plugins import BasePlugin, ReflectAndRetryToolPlugin
from google.adk.tools import BaseTool, FunctionTool, ToolContext
from google.genai import types
from provider_log import CHARGE, Provider
from scripted_google_adk import ScriptedModel, agent_process, calls, racer, responses, run

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger, idempotency_key
from twiceshy.integrations.google_adk import protect, protect_tool

WIRE = {"amount": 700, "iban": "DE89370400440532013000"}
CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


def timing_out_charge(provider: Provider, timeouts: int = 1, *, sync: bool = False) -> Any:
    """A ``charge`` function whose first ``timeouts`` runs take effect, then time out."""
    left = [timeouts]

    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        charge_id = provider.charge(twiceshy.current_key(), amount, customer)
        if left[0] > 0:
            left[0] -= 1
            raise TimeoutError("the provider did not answer in time")
        return charge_id

    async def acharge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return charge(amount, customer)

    chosen = charge if sync else acharge
    chosen.__name__ = "charge"
    return chosen


def assert_honest(response: Any) -> None:
    """The honest answer for an unknown outcome, as ADK words a refusal, inviting no retry."""
    assert set(response) == {"error"}
    assert "outcome is unknown" in response["error"]
    assert "It will not be run again for these arguments" in response["error"]
    assert "try again" not in response["error"].lower()


# -- the incident ------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_keyed_charge_recalled_by_the_model_reaches_the_provider_with_one_key(
    ledger: Ledger, tmp_path: Path, sync: bool
) -> None:
    """A KEYED charge times out after taking effect; the model calls again with a new id: the
    same key reaches the provider, which charges once, and the model reads the charge."""
    provider = Provider(tmp_path / "effects")
    guard = ledger.guard("charge", effect=KEYED, attempts=1)
    tools = protect([timing_out_charge(provider, sync=sync)], ledger, effects={"charge": guard})
    model = ScriptedModel.of([("c1", "charge", CHARGE)], [("c2", "charge", CHARGE)])

    run(LlmAgent(name="billing", model=model, tools=tools), "order-1")

    read = model.results()
    assert read["c1"]["error"].startswith(
        "The tool 'charge' did not finish on its one attempt (the last: TimeoutError: the "
        "provider did not answer in time): it may have taken effect."
    )
    assert read["c2"] == {"result": "ch_1"}
    key = idempotency_key("order-1", "charge", CHARGE)
    assert provider.keys == [key, key]
    assert provider.effects == 1


def test_keyed_charge_is_retried_in_place_with_the_same_key(ledger: Ledger, tmp_path: Path) -> None:
    """With the default attempts the timeout is retried inside the call: the model reads the
    charge at once, and its re-call is replayed."""
    provider = Provider(tmp_path / "effects")
    tools = protect([timing_out_charge(provider)], ledger, effects={"charge": KEYED})
    model = ScriptedModel.of([("c1", "charge", CHARGE)], [("c2", "charge", CHARGE)])

    run(LlmAgent(name="billing", model=model, tools=tools), "order-1")

    assert model.results() == {"c1": {"result": "ch_1"}, "c2": {"result": "ch_1"}}
    assert len(provider.keys) == 2
    assert provider.effects == 1


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_unsafe_wire_that_timed_out_is_not_rerun_and_the_model_is_told(
    ledger: Ledger, sync: bool
) -> None:
    """An UNSAFE wire times out after sending; ADK's ReflectAndRetryToolPlugin is installed,
    and still the model reads the honest text on both calls, and the wire is sent once."""
    sent: list[int] = []

    def wire(amount: int, iban: str) -> str:
        """Wire money."""
        sent.append(amount)
        raise TimeoutError("the bank did not answer")

    async def awire(amount: int, iban: str) -> str:
        """Wire money."""
        return wire(amount, iban)

    awire.__name__ = "wire"
    tools = protect([wire if sync else awire], ledger, effects={"wire": UNSAFE})
    model = ScriptedModel.of([("c1", "wire", WIRE)], [("c2", "wire", WIRE)])

    agent = LlmAgent(name="billing", model=model, tools=tools)
    run(agent, "order-1", plugins=[ReflectAndRetryToolPlugin(max_retries=3)])

    read = model.results()
    assert_honest(read["c1"])
    assert read["c2"] == read["c1"]
    assert sent == [700]


def test_the_confirmation_gate_stays_in_front_of_the_ledger(ledger: Ledger) -> None:
    """A tool that requires confirmation: the call waiting for it claims nothing and runs
    nothing; once the user confirms, it runs once, and a later identical call is replayed."""
    sent: list[int] = []

    def wire(amount: int, iban: str) -> str:
        """Wire money."""
        sent.append(amount)
        return f"wired {amount}"

    tools = protect([FunctionTool(wire, require_confirmation=True)], ledger, default=UNSAFE)
    model = ScriptedModel.of([("c1", "wire", WIRE)], [("c2", "wire", WIRE)])
    agent = LlmAgent(name="billing", model=model, tools=tools)
    runner = run(agent, "order-1")

    key = idempotency_key("order-1", "wire", WIRE)
    assert sent == []
    assert ledger.store.get(ledger.namespace, key).record is None
    asked = responses(runner, "order-1")["c1"]["error"]
    assert asked == "This tool call requires confirmation, please approve or reject."

    (confirm,) = [
        call_id
        for call_id, call in calls(runner, "order-1").items()
        if call.name == "adk_request_confirmation"
    ]
    answer = types.FunctionResponse(
        id=confirm, name="adk_request_confirmation", response={"confirmed": True}
    )
    message = types.Content(role="user", parts=[types.Part(function_response=answer)])
    run(agent, "order-1", runner=runner, message=message)

    assert sent == [700]
    record = ledger.store.get(ledger.namespace, key).record
    assert record is not None
    assert record.state is twiceshy.State.SUCCEEDED
    assert model.results()["c1"] == {"result": "wired 700"}


def test_what_callbacks_make_of_a_call_does_not_overwrite_the_ledger(ledger: Ledger) -> None:
    """A plugin's before-tool callback that answers a call: the tool does not run and nothing
    is recorded (ADK still runs the after-tool callback on that answer). An after-tool callback
    that rewrites the answer: the ledger keeps what the function returned, and the replay reads
    it, rewritten again."""
    sent: list[int] = []

    def wire(amount: int, iban: str) -> str:
        """Wire money."""
        sent.append(amount)
        return f"wired {amount}"

    class Gate(BasePlugin):
        async def before_tool_callback(
            self, *, tool: BaseTool, tool_args: dict[str, Any], tool_context: ToolContext
        ) -> dict[str, Any] | None:
            if tool_context.function_call_id == "c1":
                return {"error": "held for review"}
            return None

    def annotate(
        tool: BaseTool, args: dict[str, Any], tool_context: ToolContext, tool_response: Any
    ) -> dict[str, Any]:
        return {"result": f"{tool_response} (seen by {tool_context.function_call_id})"}

    model = ScriptedModel.of([("c1", "wire", WIRE)], [("c2", "wire", WIRE)], [("c3", "wire", WIRE)])
    agent = LlmAgent(
        name="billing",
        model=model,
        tools=protect([wire], ledger, effects={"wire": UNSAFE}),
        after_tool_callback=annotate,
    )
    run(agent, "order-1", plugins=[Gate(name="gate")])

    assert model.results() == {
        # ADK runs the after-tool callback on the before-callback's answer too.
        "c1": {"result": "{'error': 'held for review'} (seen by c1)"},
        "c2": {"result": "wired 700 (seen by c2)"},
        "c3": {"result": "wired 700 (seen by c3)"},
    }
    assert sent == [700]
    record = ledger.store.get(ledger.namespace, idempotency_key("order-1", "wire", WIRE)).record
    assert record is not None
    assert json.loads(record.result) == "wired 700"  # the function's own answer, as JSON


# -- scopes -------------------------------------------------------------------------------


def test_two_sessions_with_the_same_arguments_both_charge(ledger: Ledger, tmp_path: Path) -> None:
    """The session id is the scope: two sessions with the same arguments are two intents."""
    provider = Provider(tmp_path / "effects")
    tools = protect([timing_out_charge(provider, timeouts=0)], ledger, effects={"charge": KEYED})
    for session in ("order-1", "order-2"):
        model = ScriptedModel.of([("c1", "charge", CHARGE)])
        run(LlmAgent(name="billing", model=model, tools=tools), session)
    assert provider.keys == [
        idempotency_key("order-1", "charge", CHARGE),
        idempotency_key("order-2", "charge", CHARGE),
    ]
    assert provider.effects == 2


def test_an_enclosing_run_and_a_scope_function_replace_the_session(
    ledger: Ledger, tmp_path: Path
) -> None:
    """``twiceshy.run(...)`` around the run wins over the session id; a ``scope=`` function of
    the tool context wins over both."""
    provider = Provider(tmp_path / "effects")
    fn = timing_out_charge(provider, timeouts=0)
    enclosed = protect([fn], ledger, effects={"charge": KEYED})
    chosen = protect(
        [fn], ledger, effects={"charge": KEYED}, scope=lambda ctx: f"user:{ctx.user_id}"
    )
    for tools in (enclosed, chosen):
        model = ScriptedModel.of([("c1", "charge", CHARGE)])
        run(LlmAgent(name="billing", model=model, tools=tools), "order-1", scope="outer")
    assert provider.keys == [
        idempotency_key("outer", "charge", CHARGE),
        idempotency_key("user:ann", "charge", CHARGE),
    ]


def test_a_scope_function_naming_none_runs_nothing(ledger: Ledger) -> None:
    """A recorded tool whose scope= function names no scope raises MissingScope before it runs,
    which ends the run; a SAFE tool runs without a scope."""
    ran: list[int] = []

    def send(n: int) -> int:
        """Send."""
        ran.append(n)
        return n

    unscoped = protect([send], ledger, effects={"send": UNSAFE}, scope=lambda ctx: None)
    model = ScriptedModel.of([("c1", "send", {"n": 1})])
    with pytest.raises(twiceshy.MissingScope, match="the scope= function returned no scope"):
        run(LlmAgent(name="billing", model=model, tools=unscoped), "order-1")
    safe = protect([send], ledger, default=SAFE, scope=lambda ctx: None)
    model = ScriptedModel.of([("c1", "send", {"n": 2})])
    run(LlmAgent(name="billing", model=model, tools=safe), "order-1")
    assert ran == [2]


# -- processes ----------------------------------------------------------------------------


def test_two_processes_racing_one_intent_charge_once(tmp_path: Path) -> None:
    """Two processes released together run the same session on one SQLite ledger: one charge,
    and both models read it."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    log = tmp_path / "effects"
    barrier = CTX.Barrier(2)
    out = CTX.Queue()
    procs = [CTX.Process(target=racer, args=(url, str(log), barrier, out)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        answers = [out.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert answers == [("ok", {"result": "ch_1"})] * 2
    assert Provider(log).effects == 1


@pytest.mark.parametrize("effect", [KEYED, UNSAFE], ids=["keyed", "unsafe"])
def test_a_run_killed_after_the_charge_and_started_again(
    tmp_path: Path, effect: twiceshy.Effect
) -> None:
    """kill -9 right after the charge, before its answer is recorded; the run is started again
    on its session in a new process: a KEYED charge is taken over with the same key (one
    charge), an UNSAFE one is not run again and the model reads why."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    log = tmp_path / "effects"
    crashed = CTX.Process(
        target=agent_process,
        args=(url, str(log), effect.value, "order-9"),
        kwargs={"crash": True, "lease": 0.5},
    )
    crashed.start()
    crashed.join(60)
    assert crashed.exitcode == -signal.SIGKILL
    assert Provider(log).effects == 1

    read = agent_process(url, str(log), effect.value, "order-9", lease=0.5)

    provider = Provider(log)
    assert provider.effects == 1
    if effect is KEYED:
        assert read == {"result": "ch_1"}
        assert provider.keys == [idempotency_key("order-9", "charge", CHARGE)] * 2
    else:
        assert "The tool 'charge' was started but its outcome is unknown" in read["error"]
        assert len(provider.keys) == 1


# -- construction and imports ---------------------------------------------------------------


def test_protect_refuses_what_it_cannot_use(ledger: Ledger) -> None:
    """Undeclared tools, names that are not given, streaming recorded tools and other kinds of
    tools are refused at once; the copy keeps the tool's class and confirmation policy."""

    def lookup(q: str) -> str:
        """Look up."""
        return q

    def stream(q: str) -> Iterator[str]:
        """Stream."""
        yield q

    with pytest.raises(ValueError, match="has no effect class"):
        protect([lookup], ledger)
    with pytest.raises(ValueError, match="not given: wire"):
        protect([lookup], ledger, effects={"lookup": SAFE, "wire": UNSAFE})
    with pytest.raises(TypeError, match="an AgentTool or a function"):
        protect([42], ledger, default=SAFE)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="is a generator function"):
        protect([stream], ledger, default=KEYED)
    with pytest.raises(ValueError, match="is named 'other'"):
        protect_tool(FunctionTool(lookup), ledger.guard("other", effect=SAFE))
    original = FunctionTool(lookup, require_confirmation=True)
    (tool,) = protect([original], ledger, default=SAFE)
    assert isinstance(tool, FunctionTool)
    assert tool.name == "lookup"
    assert tool._require_confirmation is True  # type: ignore[attr-defined]
    assert type(original) is FunctionTool


def test_the_module_without_google_adk_names_its_extra() -> None:
    """Imported where Google ADK is missing, the adapter says which extra to install."""
    code = (
        "import sys; sys.modules['google.adk'] = None\n"
        "try:\n    import twiceshy.integrations.google_adk\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'twiceshy[google-adk]'" in done.stdout
