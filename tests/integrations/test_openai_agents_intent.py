"""The OpenAI Agents SDK adapter at the edges of real use (issue 12), through the real ``Runner``
and the SDK's ``ScriptedModel``: the intent is what the tool function receives, nested runs
inherit the outer call's scope, and what the model reads never misleads it.

Each test re-enacts an incident: a tool takes effect and its answer is lost (it raises after
the effect), then the model calls it again under a new call id; a provider double counts the
effects. No network (sockets refuse to connect) and no tracing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Any

import pytest
from agents import Agent, FunctionTool, RunConfig, Runner, function_tool

try:
    from agents.testing import ScriptedModel, assistant_message, function_call
except ImportError:  # before 0.21 the SDK ships no scripted model: the project's own
    from scripted_openai_agents import ScriptedModel, assistant_message, function_call
from agents.tool_context import ToolContext
from packaging.version import Version
from pydantic import BaseModel, Field, model_validator
from test_openai_agents import ledger as ledger  # fixtures: the aliases keep them exported
from test_openai_agents import offline as offline  # autouse: no network, no tracing
from test_openai_agents import script

import twiceshy
from twiceshy.integrations.openai_agents import protect


class Priority(enum.IntEnum):
    """An enum the SDK accepts by value, also as text ("2")."""

    LOW = 1
    HIGH = 2


class Address(BaseModel):
    """A nested model whose fields the SDK coerces."""

    street: str
    number: int


VALIDATED: list[str] = []
# From 0.22.3 the SDK's invocation takes the arguments it prepared for the key; before, it
# prepares them again from the same JSON, with the same schema.
PREPARES_ONCE = Version(version("openai-agents")) >= Version("0.22.3")


class Memo(BaseModel):
    """A model whose validation the test counts."""

    text: str

    @model_validator(mode="after")
    def counted(self) -> Memo:
        """Count each validation."""
        VALIDATED.append(self.text)
        return self


class Booking(BaseModel):
    """A typed result holding an aware datetime."""

    ref: str
    at: dt.datetime


def _fresh_id() -> str:
    """A default factory making a new value on every call."""
    return uuid.uuid4().hex


class Message(BaseModel):
    """A nested model with a field a factory makes anew, and one a pure factory makes."""

    body: str
    trace: str = Field(default_factory=_fresh_id)
    tags: list[str] = Field(default_factory=list)


@dataclass
class Note:
    """The same as a dataclass."""

    body: str
    trace: str = field(default_factory=_fresh_id)
    tags: list[str] = field(default_factory=list)


class Handle:
    """A result with no JSON form (a client object): the SDK shows the model its ``str()``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"Handle to {self.name}"

    def __repr__(self) -> str:
        return f"<Handle {self.name}>"


def call(name: str, args: dict[str, Any] | str, call_id: str) -> list[Any]:
    """One model turn calling ``name`` once with ``args`` (a mapping, or raw JSON text)."""
    return [function_call(name, args, call_id=call_id)]


def outputs(model: ScriptedModel) -> dict[str, str]:
    """Every tool output the model read, by call id, each as first read."""
    read: dict[str, str] = {}
    for made in model.calls:
        assert isinstance(made.input, list)
        for item in made.input:
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                read.setdefault(item["call_id"], str(item["output"]))
    return read


def run(agent: Agent[Any], *, context: Any = None, group_id: str | None = "conv-1") -> Any:
    """Run the agent to its end, offline and untraced."""
    config = RunConfig(group_id=group_id, tracing_disabled=True)
    result = asyncio.run(Runner.run(agent, "go", context=context, run_config=config))
    return result.final_output


def flat(text: str) -> str:
    """``text`` with its whitespace runs made single spaces."""
    return " ".join(text.split())


def assert_never_invites_a_retry(text: str) -> None:
    """No blind invitation to retry, and no internal name."""
    assert "try again" not in text.lower()
    assert "error occurred" not in text.lower()
    for internal in ("_AttemptTimedOut", "_ArgumentsRefused", "CancelledError", "<Task"):
        assert internal not in text


# --- 1. The intent is the arguments the function receives ------------------------------------


SPELLINGS: list[dict[str, Any]] = [
    # The canonical call: the optional note left out.
    {"qty": 2, "priority": 2, "address": {"street": "Main", "number": 5}},
    # A number as text, the enum as text, a nested field as text: the SDK coerces them all.
    {"qty": "2", "priority": "2", "address": {"street": "Main", "number": "5"}},
    # Another key order, at both levels, and the default sent.
    {"note": "none", "address": {"number": 5, "street": "Main"}, "priority": 2, "qty": 2},
]
RECEIVED = {"qty": 2, "priority": 2, "address": {"street": "Main", "number": 5}, "note": "none"}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lax"])
@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED], ids=["unsafe", "keyed"])
def test_spellings_the_sdk_accepts_name_one_intent(
    ledger: twiceshy.Ledger, strict: bool, effect: twiceshy.Effect
) -> None:
    """Spellings the SDK coerces to what the function receives: one intent, effect and key."""
    effects: list[tuple[int, Priority, Address, str]] = []
    keys: list[str | None] = []

    @function_tool(strict_mode=strict)
    def ship(
        ctx: ToolContext[Any], qty: int, priority: Priority, address: Address, note: str = "none"
    ) -> str:
        """Ship an order; the answer is lost the first time."""
        keys.append(twiceshy.current_key())
        effects.append((qty, priority, address, note))
        if len(effects) == 1:
            raise TimeoutError("read timed out")
        return "shipped"

    guard = ledger.guard("ship", effect=effect, attempts=1)
    tools = protect([ship], ledger, effects={"ship": guard})
    model = script(*(call("ship", args, f"call_{n}") for n, args in enumerate(SPELLINGS, 1)))

    run(Agent(name="warehouse", model=model, tools=tools))

    key = twiceshy.idempotency_key("conv-1", "ship", RECEIVED)
    read = outputs(model)
    if effect is twiceshy.UNSAFE:
        # One effect: the model reads that it may have happened, on every call.
        assert len(effects) == 1
        assert len({read["call_1"], read["call_2"], read["call_3"]}) == 1
        assert "outcome is unknown" in read["call_1"]
        assert f"reference {key[:16]}" in read["call_1"]
    else:
        # The re-call ran again with the same key (the provider deduplicates), then replayed.
        assert len(effects) == 2
        assert read["call_2"] == read["call_3"] == "shipped"
    assert keys == [key] * len(keys)
    # The function received the SDK's values, the very ones that named the intent.
    qty, priority, address, note = effects[0]
    assert (qty, priority, note) == (2, Priority.HIGH, "none")
    assert address == Address(street="Main", number=5)
    assert_never_invites_a_retry(read["call_1"])


def test_the_function_receives_the_values_that_named_the_intent(ledger: twiceshy.Ledger) -> None:
    """The SDK validates a call once, for the key and the function alike (twice, to equal
    values, on releases that cannot take a preparation)."""
    VALIDATED.clear()
    filed: list[Memo] = []

    @function_tool
    def file(memo: Memo) -> str:
        """File a memo."""
        filed.append(memo)
        return "filed"

    tools = protect([file], ledger, effects={"file": twiceshy.UNSAFE})
    model = script(call("file", {"memo": {"text": "hello"}}, "call_1"))

    run(Agent(name="clerk", model=model, tools=tools))

    times = 1 if PREPARES_ONCE else 2
    assert ["hello"] * times == VALIDATED
    assert [memo.text for memo in filed] == ["hello"]


def test_a_hand_built_tool_is_named_by_its_json_and_schema_defaults(
    ledger: twiceshy.Ledger,
) -> None:
    """A FunctionTool with no Python function is named by its JSON and its schema's defaults."""
    sent: list[dict[str, Any]] = []

    async def invoke(ctx: ToolContext[Any], raw: str) -> str:
        sent.append(json.loads(raw))
        return f"sent {len(sent)}"

    schema = {
        "type": "object",
        "properties": {"to": {"type": "string"}, "urgent": {"type": "boolean", "default": False}},
        "required": ["to"],
        "additionalProperties": False,
    }
    tool = FunctionTool(
        name="send",
        description="Send a mail.",
        params_json_schema=schema,
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )
    tools = protect([tool], ledger, effects={"send": twiceshy.UNSAFE})
    model = script(
        call("send", {"to": "a@example.com"}, "call_1"),
        call("send", {"urgent": False, "to": "a@example.com"}, "call_2"),
    )

    run(Agent(name="mail", model=model, tools=tools))

    assert outputs(model) == {"call_1": "sent 1", "call_2": "sent 1"}
    assert sent == [{"to": "a@example.com"}]
    record = ledger.store.get(
        "",
        twiceshy.idempotency_key("conv-1", "send", {"to": "a@example.com", "urgent": False}),
    ).record
    assert record is not None
    assert record.state is twiceshy.State.SUCCEEDED


def test_a_value_the_sdk_makes_without_a_key_form_is_keyed_by_the_json(
    ledger: twiceshy.Ledger,
) -> None:
    """A Path the SDK makes has no key form: the JSON names the intent, the tool runs once."""
    removed: list[Path] = []

    @function_tool
    def remove(path: Path) -> str:
        """Remove a file; the answer is lost the first time."""
        removed.append(path)
        raise TimeoutError("read timed out")

    tools = protect([remove], ledger, effects={"remove": twiceshy.UNSAFE})
    model = script(
        call("remove", {"path": "/srv/report.pdf"}, "call_1"),
        call("remove", {"path": "/srv/report.pdf"}, "call_2"),
    )

    run(Agent(name="files", model=model, tools=tools))

    assert removed == [Path("/srv/report.pdf")]
    key = twiceshy.idempotency_key("conv-1", "remove", {"path": "/srv/report.pdf"})
    read = outputs(model)
    assert read["call_1"] == read["call_2"]
    assert f"reference {key[:16]}" in read["call_2"]


def test_a_naive_time_names_no_instant_and_nothing_runs(ledger: twiceshy.Ledger) -> None:
    """A datetime argument without offset is refused with a reason the model can act on."""
    booked: list[dt.datetime] = []

    @function_tool
    def book(at: dt.datetime) -> str:
        """Book a slot."""
        booked.append(at)
        return "booked"

    tools = protect([book], ledger, effects={"book": twiceshy.UNSAFE})
    model = script(
        call("book", {"at": "2025-03-01T10:00:00"}, "call_1"),
        call("book", {"at": "2025-03-01T10:00:00+00:00"}, "call_2"),
    )

    run(Agent(name="desk", model=model, tools=tools))

    read = outputs(model)
    assert "args.at" in read["call_1"]
    assert "naive" in read["call_1"]
    assert read["call_2"] == "booked"
    assert booked == [dt.datetime(2025, 3, 1, 10, tzinfo=dt.UTC)]


def test_an_argument_a_default_factory_makes_names_no_intent(ledger: twiceshy.Ledger) -> None:
    """A parameter the SDK fills from a default_factory is left out of the key: one effect."""
    sent: list[tuple[str, str]] = []

    @function_tool
    def send_sms(text: str, request_id: Annotated[str, Field(default_factory=_fresh_id)]) -> str:
        """Text the customer; the answer is lost."""
        sent.append((text, request_id))
        raise TimeoutError("read timed out")

    tools = protect([send_sms], ledger, effects={"send_sms": twiceshy.UNSAFE})
    model = script(
        call("send_sms", {"text": "hi"}, "call_1"), call("send_sms", {"text": "hi"}, "call_2")
    )

    run(Agent(name="support", model=model, tools=tools))

    assert [text for text, _ in sent] == ["hi"]
    key = twiceshy.idempotency_key("conv-1", "send_sms", {"text": "hi"})
    read = outputs(model)
    assert read["call_2"] == read["call_1"]
    assert "it may or may not have taken effect" in flat(read["call_1"])
    assert f"reference {key[:16]}" in read["call_2"]


@pytest.mark.parametrize("kind", [Message, Note], ids=["model", "dataclass"])
def test_a_nested_field_a_default_factory_makes_names_no_intent(
    ledger: twiceshy.Ledger, kind: type[Message] | type[Note]
) -> None:
    """A nested factory field left out is out of the key; a list factory's [] sent or not: one."""
    sent: list[tuple[str, Message | Note]] = []

    def send(to: str, message: Any) -> str:
        sent.append((to, message))
        raise TimeoutError("read timed out")

    send.__doc__ = "Send a message; the answer is lost."
    send.__annotations__ = {"to": "str", "message": kind, "return": "str"}
    tools = protect([function_tool(send)], ledger, effects={"send": twiceshy.UNSAFE})
    model = script(
        call("send", {"to": "cus_1", "message": {"body": "hi"}}, "call_1"),
        call("send", {"to": "cus_1", "message": {"body": "hi", "tags": []}}, "call_2"),
    )

    run(Agent(name="support", model=model, tools=tools))

    assert len(sent) == 1
    assert isinstance(sent[0][1], kind)
    key = twiceshy.idempotency_key(
        "conv-1", "send", {"to": "cus_1", "message": {"body": "hi", "tags": []}}
    )
    read = outputs(model)
    assert read["call_2"] == read["call_1"]
    assert f"reference {key[:16]}" in read["call_2"]


# --- 2. Nested runs --------------------------------------------------------------------------


class Card:
    """A card network double: UNSAFE, every request charges."""

    def __init__(self) -> None:
        self.charges: list[tuple[int, str | None]] = []

    def charge(self, amount: int) -> str:
        """Charge once per request; remember the key the request ran under."""
        self.charges.append((amount, twiceshy.current_key()))
        return f"ch_{len(self.charges)}"


def billing_agent(
    ledger: twiceshy.Ledger, card: Card, runs: int, **protect_options: Any
) -> tuple[Agent[Any], ScriptedModel]:
    """A sub-agent charging 4900 through its own protected UNSAFE tool, on each of ``runs``."""

    @function_tool
    def charge(amount: int) -> str:
        """Charge the card."""
        return card.charge(amount)

    turns: list[Any] = []
    for n in range(1, runs + 1):
        turns += [call("charge", {"amount": 4900}, f"inner_{n}"), [assistant_message("charged")]]
    model = ScriptedModel(turns)
    tools = protect([charge], ledger, effects={"charge": twiceshy.UNSAFE}, **protect_options)
    return Agent(name="billing", model=model, tools=tools), model


def lost_answers(times: int) -> Any:
    """An output extractor whose first ``times`` calls lose the sub-agent's answer."""
    left = [times]

    async def extract(result: Any) -> str:
        if left[0] > 0:
            left[0] -= 1
            raise TimeoutError("the sub-agent's answer was lost")
        return str(result.final_output)

    return extract


def test_a_sub_agent_charges_once_when_the_outer_tool_runs_again(
    ledger: twiceshy.Ledger,
) -> None:
    """An outer KEYED tool runs three times (answers lost): its sub-agent's charge, once."""
    card = Card()
    billing, inner_model = billing_agent(ledger, card, runs=3)
    delegate = billing.as_tool("delegate", "Ask billing.", custom_output_extractor=lost_answers(2))
    guard = ledger.guard("delegate", effect=twiceshy.KEYED, attempts=1)
    tools = protect([delegate], ledger, effects={"delegate": guard})
    args = {"input": "charge 4900"}
    model = script(*(call("delegate", args, f"call_{n}") for n in (1, 2, 3)))

    run(Agent(name="front", model=model, tools=tools))

    inner_model.assert_complete()
    outer_key = twiceshy.idempotency_key("conv-1", "delegate", args)
    inner_key = twiceshy.idempotency_key(outer_key, "charge", {"amount": 4900})
    assert card.charges == [(4900, inner_key)]
    read = outputs(model)
    assert read["call_3"] == "charged"
    assert "it may have taken effect" in read["call_1"]
    assert_never_invites_a_retry(read["call_1"])
    # Each run of the sub-agent read the first charge.
    assert set(outputs(inner_model).values()) == {"ch_1"}


def test_two_outer_intents_never_share_an_inner_intent(ledger: twiceshy.Ledger) -> None:
    """Two outer intents in one group_id: the sub-agent's equal charges are two intents."""
    card = Card()
    billing, _ = billing_agent(ledger, card, runs=2)
    tools = protect(
        [billing.as_tool("delegate", "Ask billing.")], ledger, effects={"delegate": twiceshy.KEYED}
    )
    first, second = {"input": "order 1: charge 4900"}, {"input": "order 2: charge 4900"}
    model = script(call("delegate", first, "call_1"), call("delegate", second, "call_2"))

    run(Agent(name="front", model=model, tools=tools))

    assert [key for _, key in card.charges] == [
        twiceshy.idempotency_key(
            twiceshy.idempotency_key("conv-1", "delegate", outer), "charge", {"amount": 4900}
        )
        for outer in (first, second)
    ]


def test_a_delegate_declared_safe_gives_its_sub_agent_the_outer_intent(
    ledger: twiceshy.Ledger,
) -> None:
    """A SAFE as_tool: two outer intents charge twice; the first one called again, not again."""
    card = Card()
    billing, inner_model = billing_agent(ledger, card, runs=3)
    tools = protect(
        [billing.as_tool("delegate", "Ask billing.")], ledger, effects={"delegate": twiceshy.SAFE}
    )
    first, second = {"input": "order 1: charge 4900"}, {"input": "order 2: charge 4900"}
    model = script(
        call("delegate", first, "call_1"),
        call("delegate", second, "call_2"),
        call("delegate", first, "call_3"),
    )

    run(Agent(name="front", model=model, tools=tools))

    inner_model.assert_complete()
    assert card.charges == [
        (
            4900,
            twiceshy.idempotency_key(
                twiceshy.idempotency_key("conv-1", "delegate", outer), "charge", {"amount": 4900}
            ),
        )
        for outer in (first, second)
    ]
    # The sub-agent run again for the first order read the first charge.
    assert outputs(inner_model) == {"inner_1": "ch_1", "inner_2": "ch_2", "inner_3": "ch_1"}


def _from_context(ctx: ToolContext[Any]) -> str | None:
    """The application's scope: its order id."""
    return str(ctx.context["order"])


def _deferring(ctx: ToolContext[Any]) -> str | None:
    """The application's scope, deferring to a nested run's inherited one."""
    return twiceshy.inherited_scope() or _from_context(ctx)


@pytest.mark.parametrize("source", [_from_context, _deferring], ids=["given", "deferring"])
def test_an_application_scope_names_nested_runs_too(
    ledger: twiceshy.Ledger, source: Callable[[ToolContext[Any]], str | None]
) -> None:
    """A scope= the application gives wins over the inherited one, unless it defers to it."""
    card = Card()
    billing, _ = billing_agent(ledger, card, runs=1, scope=source)
    delegate = billing.as_tool("delegate", "Ask billing.")
    tools = protect([delegate], ledger, effects={"delegate": twiceshy.KEYED}, scope=source)
    args = {"input": "charge 4900"}
    model = script(call("delegate", args, "call_1"))

    run(Agent(name="front", model=model, tools=tools), context={"order": "order-7"})

    outer_key = twiceshy.idempotency_key("order-7", "delegate", args)
    scope = outer_key if source is _deferring else "order-7"
    assert card.charges == [(4900, twiceshy.idempotency_key(scope, "charge", {"amount": 4900}))]


def test_a_handed_off_agent_deduplicates_a_model_recall(ledger: twiceshy.Ledger) -> None:
    """A handed-off agent's UNSAFE tool, re-called after a lost answer, takes effect once."""
    sent: list[str] = []

    @function_tool
    def notify(text: str) -> str:
        """Text the customer; the answer is lost."""
        sent.append(text)
        raise TimeoutError("read timed out")

    args = {"text": "Your refund is on its way"}
    support_model = script(call("notify", args, "call_1"), call("notify", args, "call_2"))
    support = Agent(
        name="support",
        model=support_model,
        tools=protect([notify], ledger, effects={"notify": twiceshy.UNSAFE}),
    )
    triage_model = ScriptedModel([call("transfer_to_support", {}, "handoff_1")])
    triage = Agent(name="triage", model=triage_model, handoffs=[support])

    assert run(triage) == "done"

    assert sent == ["Your refund is on its way"]
    read = outputs(support_model)
    assert read["call_1"] == read["call_2"]
    key = twiceshy.idempotency_key("conv-1", "notify", args)
    assert f"reference {key[:16]}" in read["call_2"]


# --- 3 and 8. What the model reads on the first call is what every replay reads ---------------


def _handle(name: str) -> Handle:
    """Open a handle (annotated with a type that has no JSON form)."""
    return Handle(name)


def _handle_inside(name: str) -> dict[str, Any]:
    """Open a handle, inside a mapping (no JSON form at run time only)."""
    return {"handle": Handle(name)}


def _booking(name: str) -> Booking:
    """Book; the typed result holds a datetime in timezone.utc."""
    return Booking(ref=name, at=dt.datetime(2025, 3, 1, 10, tzinfo=dt.UTC))


def _tags(name: str):  # type: ignore[no-untyped-def]
    """Tag; a set, with no annotation."""
    return {name, "b", "a"}


def _naive(name: str):  # type: ignore[no-untyped-def]
    """Stamp; a naive datetime, with no annotation."""
    return dt.datetime(2025, 3, 1, 10)


@pytest.mark.parametrize(
    ("body", "first"),
    [
        (_handle, "Handle to x"),
        (_handle_inside, "{'handle': <Handle x>}"),
        (_booking, "ref='x' at=datetime.datetime(2025, 3, 1, 10, 0, tzinfo=TzInfo(0))"),
        (_tags, "['a', 'b', 'x']"),
        (_naive, "2025-03-01T10:00:00"),
    ],
    ids=["no-json-annotation", "no-json-value", "model-utc", "set", "naive-datetime"],
)
def test_a_replay_reads_as_the_first_answer_did(
    ledger: twiceshy.Ledger, body: Any, first: str
) -> None:
    """The model reads one text on the first call and on a replay; the tool runs once."""
    ran: list[str] = []

    def tool(name: str) -> Any:
        ran.append(name)
        return body(name)

    tool.__name__, tool.__doc__ = "open", body.__doc__
    tool.__annotations__ = {**body.__annotations__}
    tools = protect([function_tool(tool)], ledger, effects={"open": twiceshy.UNSAFE})
    model = script(call("open", {"name": "x"}, "call_1"), call("open", {"name": "x"}, "call_2"))

    run(Agent(name="desk", model=model, tools=tools))

    assert outputs(model) == {"call_1": first, "call_2": first}
    assert ran == ["x"]


# --- 5, 6, 7. Texts after the attempts, a timeout, a crash inside the lease -----------------


def test_an_unsafe_tool_timeout_reads_without_internal_names(ledger: twiceshy.Ledger) -> None:
    """An UNSAFE tool's timeout= reads as an unknown outcome naming a TimeoutError, no internals."""
    sent: list[str] = []

    @function_tool(timeout=0.05)
    async def notify(text: str) -> str:
        """Text the customer; hangs after sending."""
        sent.append(text)
        await asyncio.sleep(5)
        return "sent"

    args = {"text": "Your order shipped"}
    tools = protect([notify], ledger, effects={"notify": twiceshy.UNSAFE})
    model = script(call("notify", args, "call_1"), call("notify", args, "call_2"))

    run(Agent(name="support", model=model, tools=tools))

    key = twiceshy.idempotency_key("conv-1", "notify", args)
    read = outputs(model)
    text = flat(read["call_1"])
    assert text.startswith(
        "The tool 'notify' was started but its outcome is unknown (TimeoutError: the tool "
        "'notify' did not finish within 0.05 seconds): it may or may not have taken effect. It "
        "will not be run again for these arguments."
    )
    assert f"needs to be checked (reference {key[:16]})" in text
    assert f"an operator clears it with `twiceshy resolve {key[:16]} --released`" in text
    assert read["call_2"] == read["call_1"]
    assert_never_invites_a_retry(read["call_1"])
    assert sent == ["Your order shipped"]


@pytest.mark.parametrize(
    ("effect", "then"),
    [
        (twiceshy.KEYED, "the next identical call resumes it with the same idempotency key"),
        (twiceshy.UNSAFE, "its outcome becomes unknown and it is not run again by itself"),
    ],
    ids=["keyed", "unsafe"],
)
def test_a_call_left_claimed_by_a_stopped_process_reads_in_progress(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect, then: str
) -> None:
    """A claim left inside its lease reads as in progress, maybe stopped, never "still running"."""
    charged: list[int] = []

    @function_tool
    def charge(amount: int) -> str:
        """Charge the card."""
        charged.append(amount)
        return "ch_1"

    guard = ledger.guard("charge", effect=effect, wait=0.0)
    args = {"amount": 4900}
    key = guard.key_for(args, scope="conv-1")
    claimed = ledger.store.claim(
        "",
        key,
        fingerprint=guard.bind(args).identity(None, "charge")[1],
        tool="charge",
        effect=effect,
        owner="a-process-that-stopped",
        lease=30.0,
    )
    assert claimed.won
    tools = protect([charge], ledger, effects={"charge": guard})
    model = script(call("charge", args, "call_1"))

    run(Agent(name="billing", model=model, tools=tools))

    text = flat(outputs(model)["call_1"])
    assert text.startswith("An identical call of the tool 'charge' started at ")
    assert "UTC and has not recorded an outcome" in text
    assert "it may still be running, or the process running it may have stopped" in text
    assert "This call did not start it a second time" in text
    assert "If it records none by " in text
    assert f"UTC, {then}" in text
    assert "still running" not in text
    assert_never_invites_a_retry(text)
    assert charged == []


# --- 9. The point of no return ---------------------------------------------------------------


def test_an_error_before_the_point_of_no_return_releases_the_intent(
    ledger: twiceshy.Ledger,
) -> None:
    """A bug before point_of_no_return() ran nothing: the re-call runs it, one effect."""
    wired: list[int] = []
    bugs = [NameError("name 'fx_rate' is not defined")]

    @function_tool
    def wire(amount: int) -> str:
        """Wire money."""
        if bugs:
            raise bugs.pop()
        twiceshy.point_of_no_return()
        wired.append(amount)
        return f"wired {amount}"

    tools = protect([wire], ledger, effects={"wire": twiceshy.UNSAFE})
    model = script(call("wire", {"amount": 100}, "call_1"), call("wire", {"amount": 100}, "call_2"))

    run(Agent(name="treasury", model=model, tools=tools))

    read = outputs(model)
    # Nothing happened: the SDK's own failure text answers (before 0.25 "Please try again."
    # follows it, before 0.23 the error's text too), and its retry is safe.
    assert read["call_1"].startswith("An error occurred while running the tool.")
    assert read["call_2"] == "wired 100"
    assert wired == [100]


def test_an_error_after_the_point_of_no_return_is_an_unknown_outcome(
    ledger: twiceshy.Ledger,
) -> None:
    """An error after point_of_no_return() is an unknown outcome an operator can clear."""
    wired: list[int] = []

    @function_tool
    def wire(amount: int) -> str:
        """Wire money; the answer is lost."""
        twiceshy.point_of_no_return()
        wired.append(amount)
        raise ConnectionResetError("connection reset by peer")

    tools = protect([wire], ledger, effects={"wire": twiceshy.UNSAFE})
    model = script(call("wire", {"amount": 100}, "call_1"), call("wire", {"amount": 100}, "call_2"))

    run(Agent(name="treasury", model=model, tools=tools))

    key = twiceshy.idempotency_key("conv-1", "wire", {"amount": 100})
    read = outputs(model)
    text = flat(read["call_1"])
    assert "(ConnectionResetError: connection reset by peer)" in text
    assert "it may or may not have taken effect" in text
    assert f"`twiceshy resolve {key[:16]} --released`" in text
    assert read["call_2"] == read["call_1"]
    assert_never_invites_a_retry(text)
    assert wired == [100]


def test_a_thread_left_by_a_timed_out_tool_cannot_start_its_effect(
    ledger: twiceshy.Ledger,
) -> None:
    """A timed-out tool's thread reaching point_of_no_return() after the re-call: FencedOut."""
    wired: list[int] = []
    fenced: list[twiceshy.FencedOut] = []
    rerun = threading.Event()  # the re-call took effect
    orphan_done = threading.Event()
    threads: list[threading.Thread] = []

    def blocking_wire(amount: int) -> str:
        first = not threads
        threads.append(threading.current_thread())
        if first:
            # A slow blocking client: still building the request when the SDK stops waiting.
            rerun.wait(timeout=10)
        try:
            twiceshy.point_of_no_return()
        except twiceshy.FencedOut as exc:
            fenced.append(exc)
            raise
        finally:
            if first:
                orphan_done.set()
        wired.append(amount)
        rerun.set()
        return f"wired {amount}"

    @function_tool(timeout=0.5)
    async def wire(amount: int) -> str:
        """Wire money through a blocking client, in a thread."""
        return await asyncio.to_thread(blocking_wire, amount)

    guard = ledger.guard("wire", effect=twiceshy.UNSAFE, effect_at="mark")
    tools = protect([wire], ledger, effects={"wire": guard})
    model = script(call("wire", {"amount": 100}, "call_1"), call("wire", {"amount": 100}, "call_2"))
    config = RunConfig(group_id="conv-1", tracing_disabled=True)

    async def main() -> None:
        await Runner.run(Agent(name="treasury", model=model, tools=tools), "go", run_config=config)
        assert await asyncio.to_thread(orphan_done.wait, 10)

    asyncio.run(main())

    threads[0].join(timeout=10)
    assert not threads[0].is_alive()
    read = outputs(model)
    # Nothing happened before the mark: the SDK's own timeout text answers, and the re-call runs.
    assert read["call_1"] == "Tool 'wire' timed out after 0.5 seconds."
    assert read["call_2"] == "wired 100"
    assert wired == [100]
    assert len(fenced) == 1
