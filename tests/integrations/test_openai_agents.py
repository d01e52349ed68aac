"""The OpenAI Agents SDK adapter, through the real ``Runner`` and the SDK's own ``ScriptedModel``.

Each test re-enacts the incident: a tool takes effect, then times out; the model calls it again
with the same arguments under a new call id. No network (sockets refuse to connect) and no
tracing (disabled globally and per run).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from agents import (
    Agent,
    FunctionTool,
    RunConfig,
    RunContextWrapper,
    Runner,
    UserError,
    WebSearchTool,
    function_tool,
    set_tracing_disabled,
)

try:
    from agents.testing import ScriptedModel, assistant_message, function_call
except ImportError:  # before 0.21 the SDK ships no scripted model: the project's own
    from scripted_openai_agents import ScriptedModel, assistant_message, function_call
from agents.tool_context import ToolContext

import twiceshy
from twiceshy.integrations.openai_agents import protect

ARGS = {"amount": 4900, "customer": "cus_1"}


@dataclass
class Receipt:
    """A typed tool output (module level: the SDK resolves the tool's annotations)."""

    message_id: str


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracing export, and any attempt to open a network connection fails the test."""
    set_tracing_disabled(True)

    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"a test tried to connect to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def ledger() -> Iterator[twiceshy.Ledger]:
    """An in-memory ledger."""
    with twiceshy.Ledger("memory://") as opened:
        yield opened


class Provider:
    """A payment provider double that deduplicates charges by idempotency key, as Stripe does."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}
        self.keys: list[str | None] = []

    def charge(self, key: str | None, amount: int, customer: str) -> str:
        """Charge once per key; a repeated key answers the first charge."""
        self.keys.append(key)
        if key is None:  # no key: every request is a new charge
            key = f"unkeyed-{len(self.keys)}"
        return self.charges.setdefault(key, f"ch_{len(self.charges) + 1}")

    @property
    def effects(self) -> int:
        """How many charges took effect."""
        return len(self.charges)


def charge_tool(provider: Provider, timeouts: int = 1) -> FunctionTool:
    """A KEYED charge tool: each of its first ``timeouts`` runs takes effect, then times out."""
    left = [timeouts]

    async def charge(amount: int, customer: str) -> str:
        """Charge the customer."""
        charge_id = provider.charge(twiceshy.current_key(), amount, customer)
        if left[0] > 0:
            left[0] -= 1
            raise TimeoutError("read timed out")
        return charge_id

    return function_tool(charge)


def script(*steps: list[Any]) -> ScriptedModel:
    """A scripted model: the given turns, then a final text answer."""
    return ScriptedModel([*steps, [assistant_message("done")]])


def calls(*call_ids: str, name: str = "charge", args: dict[str, Any] = ARGS) -> list[Any]:
    """One model turn calling ``name`` with ``args`` under each call id."""
    return [function_call(name, args, call_id=call_id) for call_id in call_ids]


def received(model: ScriptedModel, request: int = -1) -> dict[str, str]:
    """The tool outputs the model received in one request (by default its last), by call id."""
    items = model.calls[request].input
    assert isinstance(items, list)
    return {
        item["call_id"]: str(item["output"])
        for item in items
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    }


def run(
    agent: Agent[Any], *, context: Any = None, group_id: str | None = None, scope: str | None = None
) -> Any:
    """Run the agent to its end, offline and untraced, optionally inside ``twiceshy.run``."""

    async def go() -> Any:
        config = RunConfig(group_id=group_id, tracing_disabled=True)
        if scope is None:
            return await Runner.run(agent, "go", context=context, run_config=config)
        async with twiceshy.run(scope):
            return await Runner.run(agent, "go", context=context, run_config=config)

    return asyncio.run(go()).final_output


def assert_honest(text: str) -> None:
    """The honest answer for an unknown outcome, with no invitation to retry."""
    assert "outcome is unknown" in text
    assert "will not be run again" in text
    assert "try again" not in text.lower()


def test_keyed_tool_recalled_by_the_model_takes_effect_once(ledger: twiceshy.Ledger) -> None:
    """A KEYED charge that timed out is re-called by the model: same key, first charge, once."""
    provider = Provider()
    guard = ledger.guard("charge", effect=twiceshy.KEYED, attempts=1)
    tools = protect([charge_tool(provider)], ledger, effects={"charge": guard})
    model = script(calls("call_1"), calls("call_2"), calls("call_3"))

    assert run(Agent(name="billing", model=model, tools=tools), group_id="conv-1") == "done"

    model.assert_complete()
    outputs = received(model)
    # Out of attempts, the model reads that it may have happened and that a retry is safe.
    assert outputs["call_1"].startswith(
        "The tool 'charge' did not finish on its one attempt (the last: TimeoutError: read timed "
        "out): it may have taken effect. It was sent with an idempotency key that stays the same "
        "for these arguments, so the provider applies it at most once: calling it again later "
        "with the same arguments is safe and does not repeat it."
    )
    assert "try again" not in outputs["call_1"].lower()
    assert "error occurred" not in outputs["call_1"]
    assert outputs["call_2"] == outputs["call_3"] == "ch_1"
    assert provider.effects == 1
    # call_2 ran again with the first key (the provider deduplicated); call_3 was replayed.
    key = twiceshy.idempotency_key("conv-1", "charge", ARGS)
    assert provider.keys == [key, key]


def test_keyed_tool_retries_inside_the_call_with_the_same_key(ledger: twiceshy.Ledger) -> None:
    """With the default attempts the timeout is retried in place; the model sees the charge."""
    provider = Provider()
    tools = protect([charge_tool(provider)], ledger, effects={"charge": twiceshy.KEYED})
    model = script(calls("call_1"), calls("call_2"))

    run(Agent(name="billing", model=model, tools=tools), group_id="conv-1")

    assert received(model) == {"call_1": "ch_1", "call_2": "ch_1"}
    assert provider.effects == 1
    assert len(provider.keys) == 2
    assert len(set(provider.keys)) == 1


def _custom_failure(ctx: RunContextWrapper[Any], error: Exception) -> str:
    return f"Tool failed ({error}). Please try again."


@pytest.mark.parametrize(
    "build",
    [
        function_tool,
        lambda fn: function_tool(fn, failure_error_function=_custom_failure),
        lambda fn: function_tool(fn, failure_error_function=None),
    ],
    ids=["sdk-default", "custom", "none"],
)
def test_unsafe_tool_answers_the_model_honestly(
    ledger: twiceshy.Ledger, build: Callable[[Callable[..., Any]], FunctionTool]
) -> None:
    """An UNSAFE tool that timed out after its effect: the model reads why, and it runs once."""
    sent: list[str] = []

    async def notify(to: str, text: str) -> str:
        """Send a text message."""
        sent.append(text)
        raise TimeoutError("read timed out")

    args = {"to": "+15550100", "text": "Your order shipped"}
    tools = protect([build(notify)], ledger, effects={"notify": twiceshy.UNSAFE})
    model = script(
        calls("call_1", name="notify", args=args), calls("call_2", name="notify", args=args)
    )

    run(Agent(name="support", model=model, tools=tools), group_id="conv-1")

    # What the model read right after each call: the honest answer, both times.
    assert_honest(received(model, 1)["call_1"])
    assert_honest(received(model, 2)["call_2"])
    assert sent == ["Your order shipped"]


def test_two_runs_are_two_intents_and_outlive_a_restart(tmp_path: Path) -> None:
    """The run context names the scope: two runs both charge; a restarted run replays."""

    @dataclass
    class Order:
        run_id: str

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    provider = Provider()
    for run_id, expected in [("order-1", "ch_1"), ("order-2", "ch_2"), ("order-1", "ch_1")]:
        # A fresh ledger and agent for each run, as after a process restart.
        with twiceshy.Ledger(url) as ledger:
            tools = protect(
                [charge_tool(provider, timeouts=0)],
                ledger,
                effects={"charge": twiceshy.KEYED},
                scope="run_id",
            )
            model = script(calls("call_1"))
            run(Agent(name="billing", model=model, tools=tools), context=Order(run_id))
        assert received(model) == {"call_1": expected}
    assert provider.effects == 2
    assert len(provider.keys) == 2


def test_group_id_is_the_default_scope_and_twiceshy_run_overrides_it(
    ledger: twiceshy.Ledger,
) -> None:
    """RunConfig.group_id scopes the calls; an enclosing twiceshy.run(...) wins over it."""
    provider = Provider()
    tools = protect([charge_tool(provider, timeouts=0)], ledger, effects={"charge": twiceshy.KEYED})

    def charge_in(group_id: str, scope: str | None = None) -> str:
        model = script(calls("call_1"))
        run(Agent(name="billing", model=model, tools=tools), group_id=group_id, scope=scope)
        return received(model)["call_1"]

    assert [charge_in("conv-1"), charge_in("conv-2"), charge_in("conv-1")] == [
        "ch_1",
        "ch_2",
        "ch_1",
    ]
    assert charge_in("conv-1", scope="order-7") == "ch_3"
    assert provider.keys[-1] == twiceshy.idempotency_key("order-7", "charge", ARGS)


def test_the_intent_is_the_model_arguments(ledger: twiceshy.Ledger) -> None:
    """Call ids and the injected context are left out; an omitted default equals its value."""
    keys: list[str | None] = []

    @function_tool(strict_mode=False)
    def send(ctx: ToolContext[Any], to: str, urgent: bool = False) -> str:
        """Send a mail (a sync tool: the SDK runs it in a thread)."""
        keys.append(twiceshy.current_key())
        return f"sent {len(keys)}"

    tools = protect(
        [send], ledger, effects={"send": twiceshy.KEYED}, scope=lambda ctx: ctx.context["thread"]
    )
    model = script(
        calls("call_1", name="send", args={"to": "a@example.com"}),
        calls("call_2", name="send", args={"to": "a@example.com", "urgent": False}),
        calls("call_3", name="send", args={"to": "a@example.com", "urgent": True}),
    )

    run(Agent(name="mail", model=model, tools=tools), context={"thread": "t-1"})

    assert received(model) == {"call_1": "sent 1", "call_2": "sent 1", "call_3": "sent 2"}
    assert keys == [
        twiceshy.idempotency_key("t-1", "send", {"to": "a@example.com", "urgent": False}),
        twiceshy.idempotency_key("t-1", "send", {"to": "a@example.com", "urgent": True}),
    ]


def test_sdk_timeout_bounds_each_attempt_inside_the_ledger(ledger: twiceshy.Ledger) -> None:
    """A tool's timeout= fires inside the ledger: UNSAFE answers honestly, KEYED retries."""
    sent: list[str] = []
    provider = Provider()
    hung = [False]

    @function_tool(timeout=0.05)
    async def notify(to: str, text: str) -> str:
        """Send a text message; this one hangs after sending."""
        sent.append(text)
        await asyncio.sleep(5)
        return "sent"

    @function_tool(timeout=0.05)
    async def charge(amount: int, customer: str) -> str:
        """Charge the customer; the first attempt hangs after charging."""
        charge_id = provider.charge(twiceshy.current_key(), amount, customer)
        if not hung[0]:
            hung[0] = True
            await asyncio.sleep(5)
        return charge_id

    args = {"to": "+15550100", "text": "Your order shipped"}
    tools = protect(
        [notify, charge], ledger, effects={"notify": twiceshy.UNSAFE, "charge": twiceshy.KEYED}
    )
    model = script(
        [*calls("call_1", name="notify", args=args), *calls("call_2")],
        calls("call_3", name="notify", args=args),
    )

    run(Agent(name="support", model=model, tools=tools), group_id="conv-1")

    outputs = received(model)
    assert_honest(outputs["call_1"])
    assert_honest(outputs["call_3"])
    assert "timed out" not in outputs["call_1"]
    assert outputs["call_2"] == "ch_1"
    assert sent == ["Your order shipped"]
    assert provider.effects == 1


def test_definite_failure_keeps_the_sdk_failure_policy(ledger: twiceshy.Ledger) -> None:
    """A definite failure reaches the tool's failure_error_function and is replayed, not rerun."""
    runs: list[int] = []

    @function_tool(failure_error_function=lambda ctx, error: f"declined: {error}")
    async def charge(amount: int, customer: str) -> str:
        """Charge the customer."""
        runs.append(amount)
        raise ValueError("card declined")

    guard = ledger.guard("charge", effect=twiceshy.KEYED, definite=[ValueError])
    tools = protect([charge], ledger, effects={"charge": guard})
    model = script(calls("call_1"), calls("call_2"))

    run(Agent(name="billing", model=model, tools=tools), group_id="conv-1")

    assert received(model) == {
        "call_1": "declined: card declined",
        "call_2": "declined: card declined",
    }
    assert runs == [4900]


def test_duplicate_calls_in_one_turn_run_once(ledger: twiceshy.Ledger) -> None:
    """Two identical calls the model makes in parallel share one run and its result."""
    sent: list[str] = []

    @function_tool
    async def notify(to: str, text: str) -> str:
        """Send a text message."""
        sent.append(text)
        await asyncio.sleep(0.05)
        return f"message {len(sent)}"

    args = {"to": "+15550100", "text": "Your order shipped"}
    tools = protect([notify], ledger, effects={"notify": twiceshy.UNSAFE})
    model = script(calls("call_1", "call_2", name="notify", args=args))

    run(Agent(name="support", model=model, tools=tools), group_id="conv-1")

    assert received(model) == {"call_1": "message 1", "call_2": "message 1"}
    assert sent == ["Your order shipped"]


def test_a_run_without_scope_fails_before_the_tool_runs(ledger: twiceshy.Ledger) -> None:
    """No group_id and no scope: the run fails with MissingScope and nothing is charged."""
    provider = Provider()
    tools = protect([charge_tool(provider)], ledger, effects={"charge": twiceshy.KEYED})
    model = ScriptedModel([calls("call_1")])

    with pytest.raises(UserError) as raised:
        run(Agent(name="billing", model=model, tools=tools))

    assert isinstance(raised.value.__cause__, twiceshy.MissingScope)
    assert "group_id" in str(raised.value.__cause__)
    assert provider.keys == []


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda tool, ledger: protect([tool], ledger), ValueError, "no effect class"),
        (
            lambda tool, ledger: protect(
                [tool], ledger, effects={"charge": twiceshy.KEYED, "refund": twiceshy.KEYED}
            ),
            ValueError,
            "refund",
        ),
        (
            lambda tool, ledger: protect(
                [tool, cast(Any, WebSearchTool())], ledger, default=twiceshy.SAFE
            ),
            TypeError,
            "WebSearchTool",
        ),
        (
            lambda tool, ledger: protect([tool], ledger, effects={"charge": cast(Any, "KEYED")}),
            TypeError,
            "effect class",
        ),
    ],
    ids=["undeclared", "unknown-name", "hosted-tool", "not-an-effect"],
)
def test_protection_is_declared_explicitly(
    ledger: twiceshy.Ledger,
    call: Callable[[FunctionTool, twiceshy.Ledger], object],
    error: type[Exception],
    match: str,
) -> None:
    """A tool without an effect class, a stray name or a hosted tool is refused at once."""
    with pytest.raises(error, match=match):
        call(charge_tool(Provider()), ledger)


@pytest.mark.skipif(
    not hasattr(FunctionTool, "output_json_schema"),
    reason="this openai-agents release has no typed tool outputs (from 0.19)",
)
def test_a_tool_with_an_output_schema_stops_the_run_honestly(ledger: twiceshy.Ledger) -> None:
    """A typed-output tool cannot answer in text: OutcomeUnknown stops the run, it runs once."""
    sent: list[str] = []

    @function_tool(output_type=Receipt)
    async def notify(to: str, text: str) -> Receipt:
        """Send a text message."""
        sent.append(text)
        raise TimeoutError("read timed out")

    args = {"to": "+15550100", "text": "Your order shipped"}
    tools = protect([notify], ledger, effects={"notify": twiceshy.UNSAFE})
    for call_id in ("call_1", "call_2"):
        model = ScriptedModel([calls(call_id, name="notify", args=args)])
        with pytest.raises(UserError) as raised:
            run(Agent(name="support", model=model, tools=tools), group_id="conv-1")
        assert isinstance(raised.value.__cause__, twiceshy.OutcomeUnknown)
    assert sent == ["Your order shipped"]


def test_arguments_the_schema_refuses_release_the_intent(ledger: twiceshy.Ledger) -> None:
    """Arguments the SDK refuses never ran: the SDK's own answer, and no unknown outcome."""
    wired: list[int] = []

    @function_tool
    async def wire(amount: int, to: str) -> str:
        """Wire money."""
        wired.append(amount)
        return f"wired {amount}"

    bad = {"amount": "lots", "to": "acct_1"}
    good = {"amount": 100, "to": "acct_1"}
    tools = protect([wire], ledger, effects={"wire": twiceshy.UNSAFE})
    model = script(
        calls("call_1", name="wire", args=bad),
        calls("call_2", name="wire", args=bad),
        calls("call_3", name="wire", args=good),
    )

    run(Agent(name="treasury", model=model, tools=tools), group_id="conv-1")

    outputs = received(model)
    assert outputs["call_1"] == outputs["call_2"]
    assert "error occurred" in outputs["call_1"]
    assert outputs["call_3"] == "wired 100"
    assert wired == [100]


@pytest.mark.parametrize("redacted", [True, False], ids=["redacted", "logged"])
def test_refused_arguments_read_as_the_sdk_answers_them_alone(
    ledger: twiceshy.Ledger, monkeypatch: pytest.MonkeyPatch, redacted: bool
) -> None:
    """What the model reads for arguments the schema refuses is the SDK's own answer, word for
    word, with its tool data redacted or not (``OPENAI_AGENTS_DONT_LOG_TOOL_DATA``)."""
    import agents._debug

    monkeypatch.setattr(agents._debug, "DONT_LOG_TOOL_DATA", redacted)

    @function_tool
    async def wire(amount: int, to: str) -> str:
        """Wire money."""
        return f"wired {amount}"

    bad = {"amount": "lots", "to": "acct_1"}
    answers = []
    for tools in ([wire], protect([wire], ledger, effects={"wire": twiceshy.UNSAFE})):
        model = script(calls("call_1", name="wire", args=bad))
        run(Agent(name="treasury", model=model, tools=tools), group_id="conv-1")
        answers.append(received(model)["call_1"])
    alone, protected = answers
    assert protected == alone
    assert "error occurred" in alone


def test_a_safe_tool_runs_without_a_scope(ledger: twiceshy.Ledger) -> None:
    """A SAFE tool keeps no record, so a run with no scope still gets its answer."""
    looked_up: list[str] = []

    @function_tool
    def lookup(customer: str) -> str:
        """Look a customer up."""
        looked_up.append(customer)
        return f"{customer} is in good standing"

    tools = protect([lookup], ledger, effects={"lookup": twiceshy.SAFE})
    model = script(calls("call_1", name="lookup", args={"customer": "cus_1"}))

    assert run(Agent(name="support", model=model, tools=tools)) == "done"

    assert received(model) == {"call_1": "cus_1 is in good standing"}
    assert looked_up == ["cus_1"]
