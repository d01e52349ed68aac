"""The Strands adapter, through a real ``Agent`` driven by a scripted ``Model``
(scripted_strands.py).

Each test re-enacts the incident: a tool takes effect and its answer is lost (a timeout, a
crash); the model calls it again under a new ``toolUseId``, a hook asks Strands to retry the
call, or the run is started again on its session, and the effect (counted by a provider double)
happens once.
"""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from provider_log import CHARGE, Provider
from scripted_strands import ScriptedModel, agent_process, racer
from strands import Agent, ToolContext, tool
from strands.hooks import AfterToolCallEvent

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger, idempotency_key
from twiceshy.integrations.strands import TwiceshyPlugin

WIRE = {"amount": 700, "iban": "DE89370400440532013000"}
CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


def timing_out_charge(provider: Provider, timeouts: int = 1, *, sync: bool = False) -> Any:
    """A ``charge`` tool whose first ``timeouts`` runs take effect, then time out."""
    left = [timeouts]

    def charge_once(amount: int, customer: str) -> str:
        charge_id = provider.charge(twiceshy.current_key(), amount, customer)
        if left[0] > 0:
            left[0] -= 1
            raise TimeoutError("the provider did not answer in time")
        return charge_id

    if sync:

        @tool(name="charge")
        def charge(amount: int, customer: str) -> str:
            """Charge the customer, in cents.

            Args:
                amount: in cents.
                customer: the customer's id.
            """
            return charge_once(amount, customer)

        return charge

    @tool(name="charge")
    async def acharge(amount: int, customer: str) -> str:
        """Charge the customer, in cents.

        Args:
            amount: in cents.
            customer: the customer's id.
        """
        return charge_once(amount, customer)

    return acharge


def agent_of(model: ScriptedModel, tools: list[Any], plugin: TwiceshyPlugin, **kw: Any) -> Agent:
    """An agent with no console output, protected by ``plugin``."""
    return Agent(model=model, tools=tools, callback_handler=None, plugins=[plugin], **kw)


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
    """A KEYED charge times out after taking effect; the model calls again with a new id: the
    same key reaches the provider, which charges once, and the model reads the charge."""
    provider = Provider(tmp_path / "effects")
    guard = ledger.guard("charge", effect=KEYED, attempts=1)
    model = ScriptedModel([("t1", "charge", CHARGE)], [("t2", "charge", CHARGE)])
    tools = [timing_out_charge(provider, sync=sync)]
    agent = agent_of(model, tools, TwiceshyPlugin(ledger, {"charge": guard}))

    agent("charge the customer")

    results = model.results()
    assert results["t1"]["status"] == "error"
    assert model.texts()["t1"].startswith(
        "The tool 'charge' did not finish on its one attempt (the last: TimeoutError: the "
        "provider did not answer in time): it may have taken effect."
    )
    assert results["t2"] == {"toolUseId": "t2", "status": "success", "content": [{"text": "ch_1"}]}
    key = idempotency_key(agent.session_id, "charge", CHARGE)
    assert provider.keys == [key, key]
    assert provider.effects == 1


def test_keyed_charge_is_retried_in_place_with_the_same_key(ledger: Ledger, tmp_path: Path) -> None:
    """With the default attempts the timeout is retried inside the call: the model reads the
    charge at once, and its re-call is replayed."""
    provider = Provider(tmp_path / "effects")
    model = ScriptedModel([("t1", "charge", CHARGE)], [("t2", "charge", CHARGE)])
    agent = agent_of(model, [timing_out_charge(provider)], TwiceshyPlugin(ledger, default=KEYED))

    agent("charge the customer")

    assert model.texts() == {"t1": "ch_1", "t2": "ch_1"}
    assert len(provider.keys) == 2
    assert provider.effects == 1


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_unsafe_wire_retried_by_a_hook_is_not_rerun_and_the_model_is_told(
    ledger: Ledger, sync: bool
) -> None:
    """Strands' own retry: a hook asks to retry every failed call (up to three times). An
    UNSAFE wire that timed out after sending is not sent again: each retry meets the ledger,
    and the model reads the honest text on its call and on its re-call."""
    sent: list[int] = []
    retries: list[str] = []

    def send(amount: int) -> str:
        sent.append(amount)
        raise TimeoutError("the bank did not answer")

    @tool(name="wire")
    def wire(amount: int, iban: str) -> str:
        """Wire money.

        Args:
            amount: in cents.
            iban: the account.
        """
        return send(amount)

    @tool(name="wire")
    async def awire(amount: int, iban: str) -> str:
        """Wire money.

        Args:
            amount: in cents.
            iban: the account.
        """
        return send(amount)

    def retry_failures(event: AfterToolCallEvent) -> None:
        if event.result["status"] == "error" and len(retries) < 3:
            retries.append(event.tool_use["toolUseId"])
            event.retry = True

    model = ScriptedModel([("t1", "wire", WIRE)], [("t2", "wire", WIRE)])
    agent = agent_of(model, [wire if sync else awire], TwiceshyPlugin(ledger, {"wire": UNSAFE}))
    agent.add_hook(retry_failures)

    agent("wire the money")

    texts = model.texts()
    assert_honest(texts["t1"])
    assert texts["t2"] == texts["t1"]
    assert retries == ["t1", "t1", "t1"]
    assert sent == [700]


def test_a_tool_that_interrupts_releases_the_intent_and_runs_on_resume(ledger: Ledger) -> None:
    """A tool asks for approval (a Strands interrupt) before it wires: nothing is recorded
    while the agent waits; once resumed with the approval, it wires once."""
    sent: list[int] = []

    @tool(context=True)
    def wire(amount: int, iban: str, tool_context: ToolContext) -> str:
        """Wire money.

        Args:
            amount: in cents.
            iban: the account.
        """
        if tool_context.interrupt("approve-wire", reason="wire money?") != "yes":
            return "not approved"
        sent.append(amount)
        return f"wired {amount}"

    model = ScriptedModel([("t1", "wire", WIRE)])
    agent = agent_of(model, [wire], TwiceshyPlugin(ledger, {"wire": UNSAFE}))

    stopped = agent("wire the money")

    assert stopped.stop_reason == "interrupt"
    record = ledger.store.get(
        ledger.namespace, idempotency_key(agent.session_id, "wire", WIRE)
    ).record
    assert record is None or record.state is twiceshy.State.RELEASED
    assert sent == []
    (interrupt,) = stopped.interrupts
    agent([{"interruptResponse": {"interruptId": interrupt.id, "response": "yes"}}])
    assert model.texts() == {"t1": "wired 700"}
    assert sent == [700]


# -- scopes -------------------------------------------------------------------------------


def test_two_agents_sessions_with_the_same_arguments_both_charge(
    ledger: Ledger, tmp_path: Path
) -> None:
    """The session id is the scope: two sessions with the same arguments are two intents."""
    provider = Provider(tmp_path / "effects")
    charge = timing_out_charge(provider, timeouts=0)
    sessions = []
    for _ in range(2):
        model = ScriptedModel([("t1", "charge", CHARGE)])
        agent = agent_of(model, [charge], TwiceshyPlugin(ledger, {"charge": KEYED}))
        agent("charge the customer")
        sessions.append(agent.session_id)
    assert provider.keys == [idempotency_key(s, "charge", CHARGE) for s in sessions]
    assert provider.effects == 2


def test_an_enclosing_run_and_a_scope_function_replace_the_session(
    ledger: Ledger, tmp_path: Path
) -> None:
    """``twiceshy.run(...)`` around the call wins over the session id; a ``scope=`` function
    of the context (here: the invocation state) wins over both."""
    provider = Provider(tmp_path / "effects")
    charge = timing_out_charge(provider, timeouts=0)
    enclosed = agent_of(
        ScriptedModel([("t1", "charge", CHARGE)]),
        [charge],
        TwiceshyPlugin(ledger, {"charge": KEYED}),
    )
    chosen = agent_of(
        ScriptedModel([("t1", "charge", CHARGE)]),
        [charge],
        TwiceshyPlugin(
            ledger, {"charge": KEYED}, scope=lambda ctx: ctx.invocation_state["order_id"]
        ),
    )
    with twiceshy.run("outer"):
        enclosed("charge the customer")
        chosen("charge the customer", invocation_state={"order_id": "order-7"})
    assert provider.keys == [
        idempotency_key("outer", "charge", CHARGE),
        idempotency_key("order-7", "charge", CHARGE),
    ]


def test_a_scope_function_naming_none_runs_nothing(ledger: Ledger) -> None:
    """A recorded tool whose scope= function names no scope does not run (the model reads
    why); a SAFE tool runs without a scope."""
    ran: list[int] = []

    @tool
    def send(n: int) -> int:
        """Send.

        Args:
            n: how many.
        """
        ran.append(n)
        return n

    model = ScriptedModel([("t1", "send", {"n": 1})])
    agent_of(model, [send], TwiceshyPlugin(ledger, {"send": UNSAFE}, scope=lambda c: None))("go")
    assert "the scope= function returned no scope; it did not run" in model.texts()["t1"]
    model = ScriptedModel([("t1", "send", {"n": 2})])
    agent_of(model, [send], TwiceshyPlugin(ledger, default=SAFE, scope=lambda c: None))("go")
    assert ran == [2]


# -- processes ----------------------------------------------------------------------------


def test_two_processes_racing_one_intent_charge_once(tmp_path: Path) -> None:
    """Two processes released together run the same session on one SQLite ledger: one charge,
    and both models read it."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    log = tmp_path / "effects"
    barrier = CTX.Barrier(2)
    out = CTX.Queue()
    procs = [
        CTX.Process(target=racer, args=(url, str(log), str(tmp_path), barrier, out))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        answers = [out.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert answers == [("ok", "ch_1"), ("ok", "ch_1")]
    assert Provider(log).effects == 1


@pytest.mark.parametrize("effect", [KEYED, UNSAFE], ids=["keyed", "unsafe"])
def test_a_run_killed_after_the_charge_and_started_again(
    tmp_path: Path, effect: twiceshy.Effect
) -> None:
    """kill -9 right after the charge, before its answer is recorded; the agent is started
    again on its session (a FileSessionManager) in a new process: a KEYED charge is taken over
    with the same key (one charge), an UNSAFE one is not run again and the model reads why."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    log = tmp_path / "effects"
    sessions = str(tmp_path / "sessions")
    crashed = CTX.Process(
        target=agent_process,
        args=(url, str(log), effect.value, "order-9", sessions),
        kwargs={"crash": True, "lease": 0.5},
    )
    crashed.start()
    crashed.join(60)
    assert crashed.exitcode == -signal.SIGKILL
    assert Provider(log).effects == 1

    read = agent_process(url, str(log), effect.value, "order-9", sessions, lease=0.5)

    provider = Provider(log)
    assert provider.effects == 1
    if effect is KEYED:
        assert read == "ch_1"
        assert provider.keys == [idempotency_key("order-9", "charge", CHARGE)] * 2
    else:
        assert "The tool 'charge' was started but its outcome is unknown" in read
        assert len(provider.keys) == 1


# -- construction and imports ---------------------------------------------------------------


def test_the_plugin_refuses_what_it_cannot_use(ledger: Ledger) -> None:
    """Nothing declared, an undeclared tool of the agent, a tool added later undeclared (it
    does not run), a guard of another name: each refused."""

    @tool
    def lookup(q: str) -> str:
        """Look up.

        Args:
            q: what.
        """
        return q

    @tool
    def later(q: str) -> str:
        """Added later.

        Args:
            q: what.
        """
        raise AssertionError("an undeclared tool must not run")

    with pytest.raises(ValueError, match="no silent default"):
        TwiceshyPlugin(ledger)
    with pytest.raises(ValueError, match="is named 'other'"):
        TwiceshyPlugin(ledger, {"lookup": ledger.guard("other", effect=SAFE)})
    with pytest.raises(ValueError, match="no effect class: lookup"):
        agent_of(ScriptedModel(), [lookup], TwiceshyPlugin(ledger, {"charge": KEYED}))
    model = ScriptedModel([("t1", "later", {"q": "x"})])
    agent = agent_of(model, [lookup], TwiceshyPlugin(ledger, {"lookup": SAFE}))
    agent.tool_registry.register_tool(later)
    agent("go")
    assert "the tool 'later' has no declared effect class" in model.texts()["t1"]


def test_the_module_without_strands_names_its_extra() -> None:
    """Imported where Strands is missing, the adapter says which extra to install."""
    code = (
        "import sys; sys.modules['strands'] = None\n"
        "try:\n    import twiceshy.integrations.strands\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'twiceshy[strands]'" in done.stdout
