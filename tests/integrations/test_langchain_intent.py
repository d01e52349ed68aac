"""The LangChain adapter at the edges of real use: the intent is what the tool receives.

Through the real framework (``create_agent`` with a scripted chat model, or a ``StateGraph`` whose
``ToolNode`` is fed an ``AIMessage`` with tool calls): arguments LangChain coerces, runs nested
inside a protected tool, results with no JSON form, a KEYED tool out of attempts, what the model
reads on a replay, and a tool's point of no return.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import NodeCancelledError
from langgraph.prebuilt import ToolNode
from langgraph.types import RetryPolicy
from pydantic import BaseModel, Field
from test_langchain import (
    CHARGE,
    WIRE,
    Provider,
    ScriptedModel,
    Spy,
    calls,
    no_backoff,
    retries,
    thread,
    tool_graph,
)

import twiceshy
from twiceshy.integrations.langchain import TwiceshyMiddleware


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    """A ledger in memory, then in a SQLite file."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ledger.db'}"
    with twiceshy.Ledger(url) as opened:
        yield opened


def no_retry_words(text: str) -> None:
    """The text invites no blind retry and quotes no framework wording."""
    assert "try again" not in text.lower()
    assert "failed after" not in text  # ToolRetryMiddleware's words
    assert "Please fix" not in text  # ToolNode's words


def recalled(
    ledger: twiceshy.Ledger,
    tool: Any,
    effect: twiceshy.Effect | twiceshy.Guard,
    args: dict[str, Any],
    *call_ids: str,
    thread_id: str = "t",
    spy: Spy | None = None,
) -> ScriptedModel:
    """Run an agent whose model calls ``tool`` with ``args`` once per call id, each after the
    last answer, under ToolRetryMiddleware (two retries), then ``spy``, then twiceshy; the model
    keeps what it read."""
    model = ScriptedModel(
        responses=[*(calls((tool.name, args, call_id)) for call_id in call_ids), AIMessage("?")]
    )
    inner = [] if spy is None else [spy]
    agent = create_agent(
        model=model,
        tools=[tool],
        middleware=[retries(2), *inner, TwiceshyMiddleware(ledger, {tool.name: effect})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("go")]}, thread(thread_id))
    return model


# -- 1. the arguments the tool receives -----------------------------------------------------


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Address(BaseModel):
    zip: str
    floor: int


SHIPPING = {"zip": "01067", "floor": 3}
ORDER = {"amount": 4900, "customer": "cus_1", "priority": 2, "ship_to": SHIPPING}


def order_tool(provider: Provider) -> Any:
    """A KEYED order tool whose parameters LangChain validates and coerces."""

    @tool
    def place_order(
        amount: int, customer: str, priority: Priority, ship_to: Address, note: str = ""
    ) -> str:
        """Place an order."""
        return provider.charge(amount, twiceshy.current_key())

    return place_order


SPELLINGS = [
    ORDER,
    {**ORDER, "amount": "4900"},  # a number sent as text
    {**ORDER, "note": ""},  # the omitted optional argument's default, sent
    dict(reversed(list(ORDER.items()))),  # another key order
    {**ORDER, "priority": "2"},  # an IntEnum sent as text, which pydantic accepts
    {**ORDER, "ship_to": {"floor": "3", "zip": "01067"}},  # a nested model, coercible fields
]


def test_coerced_arguments_are_one_intent(ledger: twiceshy.Ledger) -> None:
    """Spellings LangChain coerces to the same call run once, under the one key they all name."""
    provider = Provider()
    responses = [calls(("place_order", args, f"o{i}")) for i, args in enumerate(SPELLINGS)]
    model = ScriptedModel(responses=[*responses, AIMessage("Ordered.")])
    agent = create_agent(
        model=model,
        tools=[order_tool(provider)],
        middleware=[TwiceshyMiddleware(ledger, {"place_order": twiceshy.KEYED})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("order")]}, thread("intent-1"))

    received = {**ORDER, "note": ""}
    key = twiceshy.idempotency_key("intent-1", "place_order", received)
    assert provider.keys == [key]
    answers = {str(model.tool_answer(i + 1, f"o{i}").content) for i in range(len(SPELLINGS))}
    assert answers == {"ch_1_4900"}


def test_coerced_arguments_are_one_intent_in_async_runs(ledger: twiceshy.Ledger) -> None:
    """awrap_tool_call keys an async tool by what its coroutine receives, alike."""
    provider = Provider()

    @tool
    async def place_order(
        amount: int, customer: str, priority: Priority, ship_to: Address, note: str = ""
    ) -> str:
        """Place an order."""
        await asyncio.sleep(0)
        return provider.charge(amount, twiceshy.current_key())

    protect = TwiceshyMiddleware(ledger, {"place_order": twiceshy.KEYED})
    app = tool_graph(ToolNode([place_order], awrap_tool_call=protect.awrap_tool_call))

    async def run() -> list[Any]:
        return [
            (await app.ainvoke({"messages": [calls(("place_order", args, f"a{i}"))]}, thread("t")))[
                "messages"
            ][-1].content
            for i, args in enumerate(SPELLINGS)
        ]

    answers = asyncio.run(run())
    assert answers == ["ch_1_4900"] * len(SPELLINGS)
    assert provider.keys == [twiceshy.idempotency_key("t", "place_order", {**ORDER, "note": ""})]


class Shipment(BaseModel):
    parcel: str
    labels: list[str] = Field(default_factory=list)
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


def test_a_default_made_anew_each_call_is_no_part_of_the_intent(ledger: twiceshy.Ledger) -> None:
    """An omitted field whose factory makes a fresh id does not make every retry a new intent."""
    shipped: list[str] = []

    def ship(parcel: str, labels: list[str], request_id: str) -> str:
        shipped.append(request_id)
        return f"shipped {parcel}"

    shipper = StructuredTool.from_function(ship, description="Ship.", args_schema=Shipment)
    protect = TwiceshyMiddleware(ledger, {"ship": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([shipper], wrap_tool_call=protect.wrap_tool_call))
    answers = [
        app.invoke({"messages": [calls(("ship", args, call_id))]}, thread("t"))["messages"][-1]
        for args, call_id in (
            ({"parcel": "p-1"}, "s1"),
            ({"parcel": "p-1"}, "s2"),
            ({"parcel": "p-1", "labels": []}, "s3"),  # a factory default that is always equal
        )
    ]
    assert len(shipped) == 1
    assert [a.content for a in answers] == ["shipped p-1"] * 3


class Line(BaseModel):
    sku: str
    line_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    gifts: list[str] = Field(default_factory=list)


def test_a_factory_default_inside_a_nested_model_is_no_part_of_the_intent(
    ledger: twiceshy.Ledger,
) -> None:
    """A fresh line id a factory made in a nested model: the model's re-call places no 2nd order."""
    placed: list[str] = []

    @tool
    def place_order(lines: list[Line]) -> str:
        """Place an order; the shop's answer is lost after it took the order."""
        placed.extend(line.sku for line in lines)
        raise TimeoutError("the shop did not answer in time")

    model = ScriptedModel(
        responses=[
            calls(("place_order", {"lines": [{"sku": "A"}]}, "o1")),
            calls(("place_order", {"lines": [{"sku": "A"}]}, "o2")),
            calls(("place_order", {"lines": [{"sku": "A", "gifts": []}]}, "o3")),  # always equal
            AIMessage("?"),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[place_order],
        middleware=[TwiceshyMiddleware(ledger, {"place_order": twiceshy.UNSAFE})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("order A")]}, thread("factory-1"))

    assert placed == ["A"]
    for request, call_id in ((2, "o2"), (3, "o3")):
        text = str(model.tool_answer(request, call_id).content)
        assert text.startswith(
            "The tool 'place_order' was started but its outcome is unknown (TimeoutError: the "
            "shop did not answer in time): it may or may not have taken effect. It will not be "
            "run again"
        )
        no_retry_words(text)


def test_a_coarse_clock_factory_is_no_part_of_the_intent(ledger: twiceshy.Ledger) -> None:
    """A seconds clock from the schema's factory: a re-call a second later sends no second SMS."""
    clock = ["2026-07-28T10:00:00Z"]  # equal on every reading until the second passes
    sent: list[str] = []

    class Sms(BaseModel):
        text: str
        sent_at: str = Field(default_factory=lambda: clock[0])

    def send_sms(text: str, sent_at: str) -> str:
        sent.append(text)
        clock[0] = "2026-07-28T10:00:01Z"  # the gateway took a second, then its answer was lost
        raise TimeoutError("the SMS gateway did not answer in time")

    sms = StructuredTool.from_function(send_sms, description="Send an SMS.", args_schema=Sms)
    model = recalled(ledger, sms, twiceshy.UNSAFE, {"text": "hi"}, "s1", "s2", thread_id="clock")

    assert sent == ["hi"]
    text = str(model.tool_answer(2, "s2").content)
    assert text.startswith(
        "The tool 'send_sms' was started but its outcome is unknown (TimeoutError: the SMS "
        "gateway did not answer in time): it may or may not have taken effect."
    )
    no_retry_words(text)


def test_a_value_with_no_canonical_form_is_keyed_as_the_model_sent_it(
    ledger: twiceshy.Ledger,
) -> None:
    """A parameter LangChain turns into a Path is keyed by the text sent: it runs, once."""
    deleted: list[Path] = []

    @tool
    def delete_file(path: Path) -> str:
        """Delete a file."""
        deleted.append(path)
        return f"deleted {path}"

    protect = TwiceshyMiddleware(ledger, {"delete_file": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([delete_file], wrap_tool_call=protect.wrap_tool_call))
    for call_id in ("d1", "d2"):
        out = app.invoke(
            {"messages": [calls(("delete_file", {"path": "/tmp/a.txt"}, call_id))]}, thread("t")
        )
        assert out["messages"][-1].content == "deleted /tmp/a.txt"
    assert deleted == [Path("/tmp/a.txt")]


def test_a_json_schema_tool_is_keyed_by_its_arguments_and_defaults(
    ledger: twiceshy.Ledger,
) -> None:
    """A tool with a JSON-schema args_schema: the omitted argument and its default, one intent."""
    sent: list[dict[str, Any]] = []

    def notify(**arguments: Any) -> str:
        sent.append(arguments)
        return f"notified {len(sent)}"

    schema = {
        "type": "object",
        "properties": {"to": {"type": "string"}, "channel": {"type": "string", "default": "sms"}},
        "required": ["to"],
    }
    notifier = StructuredTool.from_function(notify, description="Notify.", args_schema=schema)
    protect = TwiceshyMiddleware(ledger, {"notify": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([notifier], wrap_tool_call=protect.wrap_tool_call))
    answers = [
        app.invoke({"messages": [calls(("notify", args, call_id))]}, thread("t"))["messages"][-1]
        for args, call_id in (({"to": "a"}, "n1"), ({"to": "a", "channel": "sms"}, "n2"))
    ]
    assert sent == [{"to": "a"}]
    assert [a.content for a in answers] == ["notified 1"] * 2


# -- 2. runs nested inside a protected tool -------------------------------------------------


def sub_agent_tool(ledger: twiceshy.Ledger, charges: list[int], fail_runs: set[int]) -> Any:
    """A KEYED outer tool that runs a sub-agent whose UNSAFE charge twiceshy protects.

    The outer tool's run number ``n`` times out after the sub-agent returned when ``n`` is in
    ``fail_runs``: the inner effect happened, the outer answer was lost.
    """
    runs: list[str] = []

    @tool
    def charge(amount: int) -> str:
        """Charge the card on file."""
        charges.append(amount)
        return f"charge {len(charges)}"

    inner = TwiceshyMiddleware(ledger, {"charge": twiceshy.UNSAFE})

    @tool
    def settle(order: str) -> str:
        """Settle an order through the billing sub-agent."""
        runs.append(order)
        model = ScriptedModel(responses=[calls(("charge", {"amount": 900}, "c")), AIMessage("ok")])
        billing = create_agent(model=model, tools=[charge], middleware=[inner])
        out = billing.invoke({"messages": [HumanMessage(f"bill {order}")]})
        if len(runs) in fail_runs:
            raise TimeoutError("read timed out")
        return f"{order}: {out['messages'][2].content}"

    return settle


def test_a_sub_agent_charges_once_per_outer_intent(ledger: twiceshy.Ledger) -> None:
    """The outer tool run thrice for one intent charges once; another outer intent charges anew."""
    charges: list[int] = []
    settle = sub_agent_tool(ledger, charges, fail_runs={1, 2})
    outer = ledger.guard("settle", effect=twiceshy.KEYED, attempts=1)
    model = ScriptedModel(
        responses=[
            calls(("settle", {"order": "o-1"}, "s1")),
            calls(("settle", {"order": "o-1"}, "s2")),
            calls(("settle", {"order": "o-1"}, "s3")),
            calls(("settle", {"order": "o-2"}, "s4")),
            AIMessage("Settled."),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[settle],
        middleware=[retries(2), TwiceshyMiddleware(ledger, {"settle": outer})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("settle o-1 and o-2")]}, thread("nested-1"))

    # The inner agent inherits the thread id from the outer run's config; keyed by it, o-2's
    # charge would have replayed o-1's.
    assert charges == [900, 900]
    for request, call_id in ((1, "s1"), (2, "s2")):
        lost = str(model.tool_answer(request, call_id).content)
        assert "it may have taken effect" in lost
        no_retry_words(lost)
    assert model.tool_answer(3, "s3").content == "o-1: charge 1"
    assert model.tool_answer(4, "s4").content == "o-2: charge 2"


def test_a_sub_agent_in_an_async_tool_inherits_the_outer_intent(ledger: twiceshy.Ledger) -> None:
    """ainvoke: the sub-agent of an async outer tool charges once per outer intent."""
    charges: list[int] = []

    @tool
    async def charge(amount: int) -> str:
        """Charge the card on file."""
        charges.append(amount)
        return f"charge {len(charges)}"

    inner = TwiceshyMiddleware(ledger, {"charge": twiceshy.UNSAFE})

    @tool
    async def settle(order: str) -> str:
        """Settle an order through the billing sub-agent."""
        model = ScriptedModel(responses=[calls(("charge", {"amount": 900}, "c")), AIMessage("ok")])
        billing = create_agent(model=model, tools=[charge], middleware=[inner])
        out = await billing.ainvoke({"messages": [HumanMessage(f"bill {order}")]})
        return f"{order}: {out['messages'][2].content}"

    protect = TwiceshyMiddleware(ledger, {"settle": twiceshy.KEYED})
    app = tool_graph(ToolNode([settle], awrap_tool_call=protect.awrap_tool_call))

    async def run() -> list[Any]:
        answers = []
        for order, call_id in (("o-1", "a1"), ("o-2", "a2"), ("o-1", "a3")):
            call = calls(("settle", {"order": order}, call_id))
            out = await app.ainvoke({"messages": [call]}, thread("nested-2"))
            answers.append(out["messages"][-1].content)
        return answers

    assert asyncio.run(run()) == ["o-1: charge 1", "o-2: charge 2", "o-1: charge 1"]
    assert charges == [900, 900]


def test_a_safe_tool_names_its_sub_agents_scope_by_what_it_receives(
    ledger: twiceshy.Ledger,
) -> None:
    """A SAFE tool re-called with "7" then 7: one outer intent, its sub-agent charges once."""
    charges: list[int] = []

    @tool
    def charge(amount: int) -> str:
        """Charge the card on file."""
        charges.append(amount)
        return f"charge {len(charges)}"

    inner = TwiceshyMiddleware(ledger, {"charge": twiceshy.UNSAFE})
    runs: list[int] = []

    @tool
    def settle(order: int) -> str:
        """Settle an order through the billing sub-agent; the first answer is lost."""
        runs.append(order)
        model = ScriptedModel(responses=[calls(("charge", {"amount": 900}, "c")), AIMessage("ok")])
        billing = create_agent(model=model, tools=[charge], middleware=[inner])
        out = billing.invoke({"messages": [HumanMessage(f"bill {order}")]})
        if len(runs) == 1:
            raise TimeoutError("read timed out")
        return f"{order}: {out['messages'][2].content}"

    outer = ledger.guard("settle", effect=twiceshy.SAFE, attempts=1)
    model = ScriptedModel(
        responses=[
            calls(("settle", {"order": "7"}, "s1")),  # a number sent as text
            calls(("settle", {"order": 7}, "s2")),  # the model's re-call, as a number
            calls(("settle", {"order": 8}, "s3")),  # another outer intent
            AIMessage("Settled."),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[settle],
        middleware=[retries(0), TwiceshyMiddleware(ledger, {"settle": outer})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("settle 7 and 8")]}, thread("safe-1"))

    assert model.tool_answer(1, "s1").status == "error"  # the first answer was lost
    assert runs == [7, 7, 8]  # SAFE: run again, as declared
    assert charges == [900, 900]  # one charge per outer intent
    assert model.tool_answer(2, "s2").content == "7: charge 1"
    assert model.tool_answer(3, "s3").content == "8: charge 2"


def test_a_subgraph_inside_a_tool_keys_its_calls_under_the_outer_call(
    ledger: twiceshy.Ledger,
) -> None:
    """A compiled graph run by a tool keys its calls under the outer call's key, or a run's."""
    charges: list[str] = []

    @tool
    def charge(amount: int) -> str:
        """Charge the card on file."""
        charges.append(twiceshy.current_key() or "")
        return f"charge {len(charges)}"

    inner = TwiceshyMiddleware(ledger, {"charge": twiceshy.KEYED})
    billing = tool_graph(ToolNode([charge], wrap_tool_call=inner.wrap_tool_call))

    @tool
    def settle(order: str, own_run: bool = False) -> str:
        """Settle an order."""
        call = calls(("charge", {"amount": 900}, f"c-{order}"))
        if own_run:  # the application names the inner run itself: its choice wins
            with twiceshy.run(f"billing:{order}"):
                return str(billing.invoke({"messages": [call]})["messages"][-1].content)
        return str(billing.invoke({"messages": [call]})["messages"][-1].content)

    protect = TwiceshyMiddleware(ledger, {"settle": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([settle], wrap_tool_call=protect.wrap_tool_call))
    for args, call_id in (({"order": "o-1"}, "s1"), ({"order": "o-2"}, "s2")):
        app.invoke({"messages": [calls(("settle", args, call_id))]}, thread("nested-3"))
    app.invoke(
        {"messages": [calls(("settle", {"order": "o-3", "own_run": True}, "s3"))]},
        thread("nested-3"),
    )

    outer = ledger.guard("settle", effect=twiceshy.UNSAFE)
    scopes = [
        outer.key_for({"order": "o-1", "own_run": False}, scope="nested-3"),
        outer.key_for({"order": "o-2", "own_run": False}, scope="nested-3"),
        "billing:o-3",
    ]
    assert charges == [twiceshy.idempotency_key(s, "charge", {"amount": 900}) for s in scopes]


# -- 3. results with no JSON form ----------------------------------------------------------


class Receipt:
    """A provider's receipt object: no JSON form."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __str__(self) -> str:
        return f"receipt #{self.number}"


def test_a_result_with_no_json_form_replays_the_text_the_model_read(
    ledger: twiceshy.Ledger,
) -> None:
    """A tool returning an object LangChain stringifies: the retry reads that text; one effect."""
    receipts: list[Receipt] = []

    @tool
    def issue_receipt(order: str) -> Receipt:
        """Issue a receipt."""
        receipts.append(Receipt(len(receipts) + 1))
        return receipts[-1]

    spy = Spy()
    model = recalled(ledger, issue_receipt, twiceshy.UNSAFE, {"order": "o-1"}, "r1", "r2", spy=spy)

    assert len(receipts) == 1
    assert spy.seen == ["r1", "r2"]
    first, retry = model.tool_answer(1, "r1"), model.tool_answer(2, "r2")
    assert first.content == retry.content == "receipt #1"
    assert retry.status == "success"


def test_a_result_too_large_to_keep_tells_the_retry_it_ran(ledger: twiceshy.Ledger) -> None:
    """A first answer the ledger cannot keep: the retry reads that it ran, nothing reruns it."""
    exports: list[int] = []

    @tool
    def export_ledger(rows: int) -> str:
        """Export the ledger to the accounting system."""
        exports.append(rows)
        return "row;" * rows

    guard = ledger.guard("export_ledger", effect=twiceshy.UNSAFE, max_result_bytes=200)
    spy = Spy()
    model = recalled(ledger, export_ledger, guard, {"rows": 500}, "e1", "e2", spy=spy)

    assert exports == [500]
    assert spy.seen == ["e1", "e2"]  # ToolRetryMiddleware reran nothing
    assert model.tool_answer(1, "e1").content == "row;" * 500
    retry = model.tool_answer(2, "e2")
    text = str(retry.content)
    assert retry.status == "success"
    assert text.startswith(
        "The tool 'export_ledger' already ran for these arguments and succeeded; it was not run "
        "again. Its result (a dict) could not be kept ("
    )
    assert "so it cannot be shown again." in text
    no_retry_words(text)


# -- 5, 6. a KEYED tool out of attempts; no internal names ----------------------------------


class _AttemptTimedOut(TimeoutError):
    """A client library's private timeout class."""


LONG = "upstream did not answer; " * 40


def test_keyed_out_of_attempts_reads_twiceshy_words_through_tool_retry(
    ledger: twiceshy.Ledger,
) -> None:
    """KEYED, every attempt lost its answer: the model reads it may have happened, not a retry."""
    provider = Provider()
    lost = [True] * 3

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        charge = provider.charge(amount, twiceshy.current_key())
        if lost and lost.pop():
            raise _AttemptTimedOut(LONG)
        return charge

    spy = Spy()
    guard = ledger.guard("create_charge", effect=twiceshy.KEYED, backoff=no_backoff)
    model = recalled(ledger, create_charge, guard, CHARGE, "c1", "c2", thread_id="keyed-1", spy=spy)

    key = twiceshy.idempotency_key("keyed-1", "create_charge", CHARGE)
    assert spy.seen == ["c1", "c2"]  # ToolRetryMiddleware did not rerun the answered call
    assert provider.keys == [key] * 4
    assert len(provider.charges) == 1
    answer = model.tool_answer(1, "c1")
    text = str(answer.content)
    assert answer.status == "error"
    assert text.startswith(
        "The tool 'create_charge' did not finish on 3 attempts (the last: TimeoutError: "
        "upstream did not answer;"
    )
    assert (
        "it may have taken effect. It was sent with an idempotency key that stays the same for "
        "these arguments, so the provider applies it at most once: calling it again later with "
        "the same arguments is safe and does not repeat it."
    ) in text
    assert f"(reference {key[:16]})" in text
    assert "_AttemptTimedOut" not in text
    assert LONG not in text  # the reason is bounded
    no_retry_words(text)
    assert model.tool_answer(2, "c2").content == "ch_1_4900"


def test_keyed_out_of_attempts_is_answered_to_a_retry_policy(ledger: twiceshy.Ledger) -> None:
    """A ToolNode under RetryPolicy answers twiceshy's text: the policy reruns nothing."""
    provider = Provider()

    @tool
    async def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        provider.charge(amount, twiceshy.current_key())
        raise TimeoutError("read timed out")

    guard = ledger.guard("create_charge", effect=twiceshy.KEYED, attempts=2, backoff=no_backoff)
    protect = TwiceshyMiddleware(ledger, {"create_charge": guard})
    node = ToolNode([create_charge], awrap_tool_call=protect.awrap_tool_call)
    policy = RetryPolicy(max_attempts=3, initial_interval=0.0, jitter=False, retry_on=TimeoutError)
    app = tool_graph(node, retry=policy)
    out = asyncio.run(
        app.ainvoke({"messages": [calls(("create_charge", CHARGE, "r1"))]}, thread("keyed-2"))
    )

    assert provider.keys == [twiceshy.idempotency_key("keyed-2", "create_charge", CHARGE)] * 2
    answer = out["messages"][-1]
    assert answer.status == "error"
    assert answer.content.startswith(
        "The tool 'create_charge' did not finish on 2 attempts (the last: TimeoutError: read "
        "timed out): it may have taken effect."
    )
    no_retry_words(answer.content)


def test_an_unknown_outcome_names_no_private_class(ledger: twiceshy.Ledger) -> None:
    """UNSAFE: the model reads the user's error by its public name, bounded; never run again."""
    wires: list[int] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        wires.append(amount)
        raise _AttemptTimedOut(LONG)

    model = recalled(ledger, wire, twiceshy.UNSAFE, WIRE, "w1", "w2")

    assert wires == [500]
    for request, call_id in ((1, "w1"), (2, "w2")):
        text = str(model.tool_answer(request, call_id).content)
        assert text.startswith(
            "The tool 'wire' was started but its outcome is unknown (TimeoutError: upstream did "
            "not answer;"
        )
        assert "it may or may not have taken effect. It will not be run again" in text
        assert "twiceshy resolve" in text
        assert "_AttemptTimedOut" not in text
        assert LONG not in text
        no_retry_words(text)


def test_a_cancelled_tool_reads_as_unknown_without_a_long_task_repr(
    ledger: twiceshy.Ledger,
) -> None:
    """An async UNSAFE tool cancelled mid-way: the re-call reads a bounded reason, not a repr."""
    wires: list[int] = []
    task = "<Task pending name='Task-7' coro=<Pregel.astream() running at pregel/main.py:2970>>"

    @tool
    async def wire(amount: int, to: str) -> str:
        """Wire money."""
        wires.append(amount)
        raise asyncio.CancelledError(f"cancelled by {task} " * 20)

    protect = TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([wire], awrap_tool_call=protect.awrap_tool_call))
    with pytest.raises(NodeCancelledError):  # LangGraph ends the run
        asyncio.run(app.ainvoke({"messages": [calls(("wire", WIRE, "w1"))]}, thread("t")))
    out = asyncio.run(app.ainvoke({"messages": [calls(("wire", WIRE, "w2"))]}, thread("t")))

    assert wires == [500]
    text = out["messages"][-1].content
    assert text.startswith("The tool 'wire' was started but its outcome is unknown (")
    assert text.count(task) <= 2  # bounded: not the twenty repetitions
    assert len(text) < 900
    no_retry_words(text)


# -- 7. a claim left by a process that stopped ----------------------------------------------


def test_a_claim_left_inside_its_lease_reads_as_in_progress(ledger: twiceshy.Ledger) -> None:
    """A record claimed by another owner: the model reads when it started and what comes next."""
    provider = Provider()

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        return provider.charge(amount, twiceshy.current_key())

    guard = ledger.guard("create_charge", effect=twiceshy.KEYED, wait=0.2)
    key, fingerprint = guard.bind(CHARGE).identity("crash-1", "create_charge")
    assert key is not None
    ledger.store.claim(
        "",
        key,
        fingerprint=fingerprint,
        tool="create_charge",
        effect=twiceshy.KEYED,
        owner="a-process-that-stopped",
        lease=600.0,
    )
    protect = TwiceshyMiddleware(ledger, {"create_charge": guard})
    app = tool_graph(ToolNode([create_charge], wrap_tool_call=protect.wrap_tool_call))
    out = app.invoke({"messages": [calls(("create_charge", CHARGE, "p1"))]}, thread("crash-1"))

    assert provider.keys == []
    answer = out["messages"][-1]
    text = answer.content
    assert answer.status == "error"
    assert text.startswith("An identical call of the tool 'create_charge' started at ")
    assert (
        "it may still be running, or the process running it may have stopped. This call did "
        "not start it a second time. If it records none by "
    ) in text
    assert (
        "the next identical call resumes it with the same idempotency key, so the provider does "
        "not apply it twice."
    ) in text
    assert "still running;" not in text  # the words for a call running in this process
    no_retry_words(text)


# -- 8. a replay reads as the first answer did ----------------------------------------------


class Booking(BaseModel):
    room: str
    starts: datetime
    guests: set[str]
    local_checkin: datetime


def test_the_model_reads_the_same_text_on_a_replay(ledger: twiceshy.Ledger) -> None:
    """A model with a UTC time, a set, a naive time, content blocks: a replay reads the first."""
    booked: list[str] = []

    @tool
    def book(room: str) -> Booking:
        """Book a room."""
        booked.append(room)
        return Booking(
            room=room,
            starts=datetime(2025, 3, 1, 15, tzinfo=UTC),
            guests={"ada", "grace", "linus"},
            local_checkin=datetime(2025, 3, 1, 16),
        )

    @tool
    def tag(room: str) -> set[str]:
        """Tag a room."""
        booked.append(f"tag {room}")
        return {"quiet", "sea-view", "non-smoking"}

    @tool
    def check_in(room: str) -> datetime:
        """Check a guest in; the hotel's local time."""
        booked.append(f"check in {room}")
        return datetime(2025, 3, 1, 16, 5)

    @tool
    def floor_plan(room: str) -> list[dict[str, Any]]:
        """Draw a room's floor plan."""
        booked.append(f"plan {room}")
        facts = {"neighbours": ("B-2", "B-3"), "drawn": datetime(2025, 3, 1, tzinfo=UTC)}
        return [
            {"type": "json", "json": facts},
            {"type": "image", "base64": b"\x89PNG", "mime_type": "image/png"},
        ]

    protect = TwiceshyMiddleware(ledger, {"book": twiceshy.UNSAFE}, default=twiceshy.KEYED)
    app = tool_graph(
        ToolNode(
            [book, tag, check_in, floor_plan],
            wrap_tool_call=protect.wrap_tool_call,
            awrap_tool_call=protect.awrap_tool_call,
        )
    )
    names = ("book", "tag", "check_in", "floor_plan")

    def read(suffix: str, run_async: bool) -> list[Any]:
        message = calls(*((name, {"room": "B-1"}, f"{name}-{suffix}") for name in names))
        if run_async:
            out = asyncio.run(app.ainvoke({"messages": [message]}, thread("t")))
        else:
            out = app.invoke({"messages": [message]}, thread("t"))
        return [(m.content, m.status) for m in out["messages"][-len(names) :]]

    first = read("1", run_async=False)
    assert read("2", run_async=False) == read("3", run_async=True) == first
    assert len(booked) == len(names)
    assert "tzinfo=datetime.timezone.utc" in first[0][0]  # LangChain's str() of the model
    # Content blocks are read as the ledger keeps them, the first time too: bytes as base64.
    assert first[3][0][1] == {"type": "image", "base64": "iVBORw==", "mime_type": "image/png"}


# -- 9. the point of no return --------------------------------------------------------------


def test_an_error_before_the_point_of_no_return_releases_the_intent(
    ledger: twiceshy.Ledger,
) -> None:
    """UNSAFE: a refused connection before the wire leaves releases it; the next call wires once."""
    wires: list[int] = []
    refusals = [True]

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        if refusals and refusals.pop():
            raise ConnectionRefusedError("connection refused")
        twiceshy.point_of_no_return()
        wires.append(amount)
        return "sent"

    protect = TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([wire], wrap_tool_call=protect.wrap_tool_call))
    with pytest.raises(ConnectionRefusedError):
        app.invoke({"messages": [calls(("wire", WIRE, "w1"))]}, thread("mark-1"))
    out = app.invoke({"messages": [calls(("wire", WIRE, "w2"))]}, thread("mark-1"))
    again = app.invoke({"messages": [calls(("wire", WIRE, "w3"))]}, thread("mark-1"))

    assert wires == [500]
    assert out["messages"][-1].content == again["messages"][-1].content == "sent"


def test_an_error_after_the_point_of_no_return_is_an_unknown_outcome(
    ledger: twiceshy.Ledger,
) -> None:
    """UNSAFE: past its point of no return, a timeout is not run again, whoever retries."""
    wires: list[int] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        twiceshy.point_of_no_return()
        wires.append(amount)
        raise TimeoutError("read timed out")

    model = recalled(ledger, wire, twiceshy.UNSAFE, WIRE, "w1", "w2", thread_id="mark-2")

    assert wires == [500]
    assert "outcome is unknown" in str(model.tool_answer(2, "w2").content)
