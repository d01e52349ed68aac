"""The LlamaIndex adapter, through a real ``FunctionAgent`` and LlamaIndex's own
``MockFunctionCallingLLM`` answering from a script.

Each test re-enacts the incident: a tool takes effect and its answer is lost (a timeout, a
crash, a step that fails after it); the model calls it again under a new call id, or the run is
started again, and the effect (counted by a provider double) happens once.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.tools import FunctionTool
from provider_log import CHARGE, Provider
from scripted_llama_index import Script, agent_process, racer, run
from workflows import Context, Workflow, step
from workflows.events import StartEvent, StopEvent
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger, idempotency_key
from twiceshy.integrations.llama_index import protect, protect_tool, run_scope

WIRE = {"amount": 700, "iban": "DE89370400440532013000"}
CTX = multiprocessing.get_context("spawn")

# LlamaIndex's workflows read every attribute of an agent (a pydantic model) when they collect
# its steps, deprecated ones included; that warning is LlamaIndex's, not the adapter's.
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning")


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


def timing_out_charge(provider: Provider, timeouts: int = 1, *, sync: bool = False) -> Any:
    """A charge function whose first ``timeouts`` runs take effect, then time out."""
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

    return charge if sync else acharge


def assert_honest(text: str) -> None:
    """The honest answer for an unknown outcome, with no invitation to retry."""
    assert "outcome is unknown" in text
    assert "It will not be run again for these arguments" in text
    assert "try again" not in text.lower()


# -- the incident ------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_keyed_charge_recalled_by_the_model_reaches_the_provider_with_one_key(
    ledger: Ledger, tmp_path: Path, sync: bool
) -> None:
    """A KEYED charge times out after taking effect; the model calls again with a new id:
    the same key reaches the provider, which charges once, and the model reads the charge."""
    provider = Provider(tmp_path / "effects")
    guard = ledger.guard("charge", effect=KEYED, attempts=1)
    tool = FunctionTool.from_defaults(timing_out_charge(provider, sync=sync), name="charge")
    script = Script([("c1", "charge", CHARGE)], [("c2", "charge", CHARGE)])
    agent = FunctionAgent(
        tools=protect([tool], ledger, effects={"charge": guard}), llm=script.llm()
    )

    assert run(agent, run_id="order-1") == "done"

    read = script.results()
    assert read["c1"].startswith(
        "The tool 'charge' did not finish on its one attempt (the last: TimeoutError: the "
        "provider did not answer in time): it may have taken effect."
    )
    assert "try again" not in read["c1"].lower()
    assert read["c2"] == "ch_1"
    key = idempotency_key("order-1", "charge", CHARGE)
    assert provider.keys == [key, key]
    assert provider.effects == 1


def test_keyed_charge_is_retried_in_place_with_the_same_key(ledger: Ledger, tmp_path: Path) -> None:
    """With the default attempts the timeout is retried inside the call: the model reads the
    charge at once, and its re-call is replayed."""
    provider = Provider(tmp_path / "effects")
    tools = protect([timing_out_charge(provider)], ledger, effects={"acharge": KEYED})
    script = Script([("c1", "acharge", CHARGE)], [("c2", "acharge", CHARGE)])

    run(FunctionAgent(tools=tools, llm=script.llm()), run_id="order-1")

    assert script.results() == {"c1": "ch_1", "c2": "ch_1"}
    assert len(provider.keys) == 2
    assert len(set(provider.keys)) == 1
    assert provider.effects == 1


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_unsafe_wire_that_timed_out_is_not_rerun_and_the_model_is_told(
    ledger: Ledger, sync: bool
) -> None:
    """An UNSAFE wire times out after sending; the model's re-call reads the honest text as an
    error output, and the wire is sent once."""
    sent: list[int] = []

    def wire(amount: int, iban: str) -> str:
        """Wire money."""
        sent.append(amount)
        raise TimeoutError("the bank did not answer")

    async def awire(amount: int, iban: str) -> str:
        """Wire money."""
        return wire(amount, iban)

    tool = FunctionTool.from_defaults(wire if sync else awire, name="wire")
    (protected,) = protect([tool], ledger, effects={"wire": UNSAFE})
    script = Script([("c1", "wire", WIRE)], [("c2", "wire", WIRE)])
    outputs: list[Any] = []

    async def go() -> None:
        handler = FunctionAgent(tools=[protected], llm=script.llm()).run(
            user_msg="go", run_id="order-1"
        )
        async for event in handler.stream_events():
            if type(event).__name__ == "ToolCallResult":
                outputs.append(event.tool_output)
        await handler

    asyncio.run(go())

    read = script.results()
    assert_honest(read["c1"])
    assert read["c2"] == read["c1"]
    assert sent == [700]
    assert [output.is_error for output in outputs] == [True, True]
    assert all(isinstance(output.exception, twiceshy.OutcomeUnknown) for output in outputs)


def test_a_workflow_step_retried_by_its_retry_policy_replays_the_charge(
    ledger: Ledger, tmp_path: Path
) -> None:
    """LlamaIndex's own retry: a step with a retry policy charges, then fails before it can
    answer; the retried step calls the tool again and gets the first charge replayed."""
    provider = Provider(tmp_path / "effects")

    async def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(twiceshy.current_key(), amount, customer)

    (tool,) = protect([charge], ledger, effects={"charge": UNSAFE})
    attempts: list[str] = []

    class Billing(Workflow):
        @step(retry_policy=retry_policy(wait=wait_fixed(0.01), stop=stop_after_attempt(3)))
        async def bill(self, ctx: Context, ev: StartEvent) -> StopEvent:
            output = await tool.acall(**CHARGE)
            attempts.append(output.content)
            if len(attempts) == 1:
                raise ConnectionError("the answer was lost on its way back")
            return StopEvent(result=output.content)

    async def go() -> Any:
        return await Billing(timeout=30).run(run_id="bill-1")

    assert asyncio.run(go()) == "ch_1"
    assert attempts == ["ch_1", "ch_1"]
    assert provider.effects == 1


# -- scopes -------------------------------------------------------------------------------


def test_two_runs_with_different_run_ids_both_charge(ledger: Ledger, tmp_path: Path) -> None:
    """The run id is the scope: two orders with the same arguments are two intents."""
    provider = Provider(tmp_path / "effects")
    tools = protect([timing_out_charge(provider, timeouts=0)], ledger, effects={"acharge": KEYED})
    for order in ("order-1", "order-2"):
        script = Script([("c1", "acharge", CHARGE)])
        run(FunctionAgent(tools=tools, llm=script.llm()), run_id=order)
    assert provider.effects == 2
    assert provider.keys == [
        idempotency_key("order-1", "acharge", CHARGE),
        idempotency_key("order-2", "acharge", CHARGE),
    ]


def test_an_enclosing_run_and_a_scope_function_replace_the_run_id(
    ledger: Ledger, tmp_path: Path
) -> None:
    """``twiceshy.run(...)`` around the run wins over the run id; a ``scope=`` function wins
    over both, and sees the step's Context."""
    provider = Provider(tmp_path / "effects")
    fn = timing_out_charge(provider, timeouts=0)
    seen: list[str | None] = []

    def scope(ctx: Context[Any] | None) -> str:
        seen.append(run_scope(ctx))
        return "from-function"

    enclosed = protect([fn], ledger, effects={"acharge": KEYED})
    chosen = protect([fn], ledger, effects={"acharge": KEYED}, scope=scope)
    run(FunctionAgent(tools=enclosed, llm=Script([("c1", "acharge", CHARGE)]).llm()), "r", "outer")
    run(FunctionAgent(tools=chosen, llm=Script([("c1", "acharge", CHARGE)]).llm()), "r", "outer")

    assert provider.keys == [
        idempotency_key("outer", "acharge", CHARGE),
        idempotency_key("from-function", "acharge", CHARGE),
    ]
    assert seen == ["r"]


def test_a_call_with_no_scope_does_not_run(ledger: Ledger) -> None:
    """A recorded tool called outside any run, or whose scope= function names none, raises
    MissingScope before it runs; a SAFE one needs no scope."""
    ran: list[int] = []

    def send(n: int) -> int:
        """Send."""
        ran.append(n)
        return n

    (unscoped,) = protect([send], ledger, effects={"send": UNSAFE})
    with pytest.raises(twiceshy.MissingScope, match="outside any workflow run"):
        unscoped.call(n=1)
    (none,) = protect([send], ledger, effects={"send": UNSAFE}, scope=lambda ctx: None)
    script = Script([("c1", "send", {"n": 2})])
    run(FunctionAgent(tools=[none], llm=script.llm()), run_id="r")
    assert "the scope= function returned no scope; it did not run" in script.results()["c1"]
    (safe,) = protect([send], ledger, default=SAFE)
    assert safe.call(n=3).raw_output == 3
    assert ran == [3]


# -- processes ----------------------------------------------------------------------------


def test_two_processes_racing_one_intent_charge_once(tmp_path: Path) -> None:
    """Two processes released together run the same order on one SQLite ledger: one charge,
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
    assert answers == [("ok", ["ch_1"]), ("ok", ["ch_1"])]
    assert Provider(log).effects == 1


@pytest.mark.parametrize("effect", [KEYED, UNSAFE], ids=["keyed", "unsafe"])
def test_a_run_killed_after_the_charge_and_started_again(
    tmp_path: Path, effect: twiceshy.Effect
) -> None:
    """kill -9 right after the charge, before its answer is recorded; the run is started again
    with its run id in a new process: a KEYED charge is taken over with the same key (one
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

    (read,) = agent_process(url, str(log), effect.value, "order-9", lease=0.5)

    provider = Provider(log)
    assert provider.effects == 1
    if effect is KEYED:
        assert read == "ch_1"
        assert provider.keys == [idempotency_key("order-9", "charge", CHARGE)] * 2
    else:
        assert "The tool 'charge' was started but its outcome is unknown" in read
        assert len(provider.keys) == 1


# -- construction and imports ---------------------------------------------------------------


def test_protect_refuses_what_it_cannot_use(ledger: Ledger) -> None:
    """Undeclared tools, names that are not given, other kinds of tools are refused at once."""

    def lookup(q: str) -> str:
        """Look up."""
        return q

    with pytest.raises(ValueError, match="has no effect class"):
        protect([lookup], ledger)
    with pytest.raises(ValueError, match="not given: wire"):
        protect([lookup], ledger, effects={"lookup": SAFE, "wire": UNSAFE})
    with pytest.raises(TypeError, match="FunctionTool or a function"):
        protect([42], ledger, default=SAFE)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="is named 'other'"):
        protect_tool(FunctionTool.from_defaults(lookup), ledger.guard("other", effect=SAFE))
    (tool,) = protect([lookup], ledger, default=SAFE)
    assert isinstance(tool, FunctionTool)
    assert tool.metadata.name == "lookup"


def test_the_module_without_llama_index_names_its_extra() -> None:
    """Imported where LlamaIndex is missing, the adapter says which extra to install."""
    code = (
        "import sys; sys.modules['llama_index'] = None\n"
        "try:\n    import twiceshy.integrations.llama_index\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'twiceshy[llama-index]'" in done.stdout
