"""The LangChain / LangGraph adapter, through the real framework with a scripted chat model.

Each agent is built with ``langchain.agents.create_agent`` (or a LangGraph ``StateGraph`` with a
``ToolNode``) and a chat model that answers from a script and keeps every request it received,
so the tests assert on what the model actually read.
"""

from __future__ import annotations

import asyncio
import operator
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ToolCallRequest, ToolRetryMiddleware
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import InjectedState, ToolNode, ToolRuntime
from langgraph.types import Command, RetryPolicy, interrupt
from packaging.version import Version
from pydantic import Field

import twiceshy
from twiceshy.integrations.langchain import (
    EffectNotDeclared,
    ScopeNotFound,
    TwiceshyMiddleware,
    thread_scope,
)

# -- the scripted model, the provider double, helpers ---------------------------------------


class ScriptedModel(FakeMessagesListChatModel):
    """A chat model that answers with its script in order and keeps every request it got."""

    requests: list[list[BaseMessage]] = Field(default_factory=list)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.requests.append(list(messages))
        if len(self.requests) > len(self.responses):
            raise AssertionError("the model was called more often than scripted")
        answer = self.responses[len(self.requests) - 1]
        return ChatResult(generations=[ChatGeneration(message=answer)])

    def tool_answer(self, request: int, call_id: str) -> ToolMessage:
        """The ToolMessage for ``call_id`` that the model read in its ``request``-th request."""
        for message in self.requests[request]:
            if isinstance(message, ToolMessage) and message.tool_call_id == call_id:
                return message
        raise AssertionError(f"request {request} carried no answer to {call_id}")


def calls(*tool_calls: tuple[str, dict[str, Any], str]) -> AIMessage:
    """An AI message calling tools, each given as (name, arguments, tool-call id)."""
    return AIMessage(
        content="",
        tool_calls=[
            {"name": name, "args": args, "id": call_id, "type": "tool_call"}
            for name, args, call_id in tool_calls
        ],
    )


class Provider:
    """A payment provider double: deduplicates by idempotency key and counts real effects."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.charges: dict[str | None, str] = {}
        self._lock = threading.Lock()

    def charge(self, amount: int, key: str | None) -> str:
        with self._lock:
            self.keys.append(key)
            if key not in self.charges:
                self.charges[key] = f"ch_{len(self.charges) + 1}_{amount}"
            return self.charges[key]


class Spy(AgentMiddleware):
    """Counts the tool calls that pass it (placed between two middlewares)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def wrap_tool_call(self, request: ToolCallRequest, handler: Any) -> Any:
        self.seen.append(str(request.tool_call["id"]))
        return handler(request)


def no_backoff(attempt: int) -> float:
    return 0.0


def retries(max_retries: int) -> ToolRetryMiddleware:
    """LangChain's ToolRetryMiddleware, retrying every error at once."""
    return ToolRetryMiddleware(max_retries=max_retries, initial_delay=0.0, jitter=False)


def thread(name: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": name}}


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    """A ledger in memory, then in a SQLite file."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ledger.db'}"
    with twiceshy.Ledger(url) as opened:
        yield opened


CHARGE = {"amount": 4900, "customer": "cus_1"}
# LangChain 1.3.12 let LangGraph's bubble-up errors pass ToolRetryMiddleware. Before, it retries a
# refusal and hands its text to the model: the run goes on, and the tool still does not run.
BUBBLES_THROUGH_RETRIES = Version(metadata.version("langchain")) >= Version("1.3.12")
WIRE = {"amount": 500, "to": "DE89 3704 0044 0532 0130 00"}


# -- the incident, re-enacted ---------------------------------------------------------------


def test_keyed_model_recall_after_timeout_gets_the_first_charge(ledger: twiceshy.Ledger) -> None:
    """KEYED: charged then timed out; the model re-calls (new id); the provider charges once."""
    provider = Provider()

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        charge = provider.charge(amount, twiceshy.current_key())
        if len(provider.keys) == 1:
            raise TimeoutError("read timed out")
        return charge

    model = ScriptedModel(
        responses=[
            calls(("create_charge", CHARGE, "call_1")),
            calls(("create_charge", CHARGE, "call_2")),
            AIMessage("Charged."),
        ]
    )
    guard = ledger.guard("create_charge", effect=twiceshy.KEYED, attempts=1)
    agent = create_agent(
        model=model,
        tools=[create_charge],
        # Left to it, the framework would tell the model "Please try again." after the timeout.
        middleware=[retries(0), TwiceshyMiddleware(ledger, {"create_charge": guard})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("charge cus_1 49 EUR")]}, thread("thread-1"))

    key = twiceshy.idempotency_key("thread-1", "create_charge", CHARGE)
    assert provider.keys == [key, key]
    assert provider.charges == {key: "ch_1_4900"}
    first = model.tool_answer(1, "call_1")
    text = str(first.content)
    assert first.status == "error"
    assert text.startswith(
        "The tool 'create_charge' did not finish on its one attempt (the last: TimeoutError: "
        "read timed out): it may have taken effect."
    )
    assert "calling it again later with the same arguments is safe" in text
    assert "try again" not in text.lower()
    assert "failed after" not in text  # not ToolRetryMiddleware's words
    retried = model.tool_answer(2, "call_2")
    assert retried.content == "ch_1_4900"
    assert retried.status == "success"


def test_keyed_result_is_replayed_to_a_model_recall(ledger: twiceshy.Ledger) -> None:
    """KEYED: a timeout is retried in place with the same key; a later re-call replays it."""
    provider = Provider()

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        charge = provider.charge(amount, twiceshy.current_key())
        if len(provider.keys) == 1:
            raise TimeoutError("read timed out")
        return charge

    model = ScriptedModel(
        responses=[
            calls(("create_charge", CHARGE, "call_1")),
            calls(("create_charge", CHARGE, "call_2")),
            AIMessage("Charged."),
        ]
    )
    guard = ledger.guard("create_charge", effect=twiceshy.KEYED, backoff=no_backoff)
    agent = create_agent(
        model=model,
        tools=[create_charge],
        middleware=[TwiceshyMiddleware(ledger, {"create_charge": guard})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("charge cus_1 49 EUR")]}, thread("thread-2"))

    key = twiceshy.idempotency_key("thread-2", "create_charge", CHARGE)
    assert provider.keys == [key, key]  # two attempts of the first call; the re-call ran nothing
    assert len(provider.charges) == 1
    first, second = model.tool_answer(1, "call_1"), model.tool_answer(2, "call_2")
    assert first.content == second.content == "ch_1_4900"
    assert second.name == "create_charge"


def test_unsafe_timeout_reaches_the_model_as_an_honest_error(ledger: twiceshy.Ledger) -> None:
    """UNSAFE: wired then timed out; the model reads the honest message, re-calls, no rerun."""
    wires: list[dict[str, Any]] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        wires.append({"amount": amount, "to": to})
        raise TimeoutError("read timed out")

    model = ScriptedModel(
        responses=[
            calls(("wire", WIRE, "call_1")),
            calls(("wire", WIRE, "call_2")),
            AIMessage("The transfer may have happened; please check."),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[wire],
        middleware=[retries(2), TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})],
        checkpointer=InMemorySaver(),
    )
    result = agent.invoke({"messages": [HumanMessage("wire 5 EUR")]}, thread("thread-3"))

    assert wires == [WIRE]
    for request, call_id in ((1, "call_1"), (2, "call_2")):
        answer = model.tool_answer(request, call_id)
        text = str(answer.content)
        assert answer.status == "error"
        assert "outcome is unknown" in text
        assert "will not be run again" in text
        assert "try again" not in text.lower()
        assert "failed after" not in text  # not ToolRetryMiddleware's text
    assert result["messages"][-1].content == "The transfer may have happened; please check."


def test_unsafe_inside_tool_retry_middleware_runs_once(ledger: twiceshy.Ledger) -> None:
    """Placed inside ToolRetryMiddleware an UNSAFE timeout runs once; placed outside, thrice."""
    wires: list[int] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        wires.append(amount)
        raise TimeoutError("read timed out")

    def run(middleware: list[Any], thread_id: str) -> ScriptedModel:
        model = ScriptedModel(responses=[calls(("wire", WIRE, "call_1")), AIMessage("Done.")])
        agent = create_agent(
            model=model, tools=[wire], middleware=middleware, checkpointer=InMemorySaver()
        )
        agent.invoke({"messages": [HumanMessage("wire 5 EUR")]}, thread(thread_id))
        return model

    protect = TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})
    model = run([retries(2), protect], "thread-4")
    assert wires == [500]
    assert "outcome is unknown" in str(model.tool_answer(1, "call_1").content)

    # The wrong order, to show why the order is documented: the retries happen inside the one
    # protected call, where no ledger sees them, and the model is told to try again.
    wires.clear()
    model = run([protect, retries(2)], "thread-5")
    assert wires == [500, 500, 500]
    assert "Please try again" in str(model.tool_answer(1, "call_1").content)


def test_keyed_retries_of_tool_retry_middleware_each_meet_the_ledger(
    ledger: twiceshy.Ledger,
) -> None:
    """Errors before the point of no return are retried by ToolRetryMiddleware; one effect."""
    provider = Provider()
    connects: list[int] = []

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        connects.append(amount)
        if len(connects) < 3:
            raise ConnectionRefusedError("connection refused")  # nothing was sent
        twiceshy.point_of_no_return()
        return provider.charge(amount, twiceshy.current_key())

    spy = Spy()
    model = ScriptedModel(
        responses=[calls(("create_charge", CHARGE, "call_1")), AIMessage("Charged.")]
    )
    agent = create_agent(
        model=model,
        tools=[create_charge],
        middleware=[retries(2), spy, TwiceshyMiddleware(ledger, {"create_charge": twiceshy.KEYED})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("charge")]}, thread("thread-6"))

    key = twiceshy.idempotency_key("thread-6", "create_charge", CHARGE)
    assert spy.seen == ["call_1"] * 3  # each retry of ToolRetryMiddleware met the ledger
    assert connects == [4900] * 3
    assert provider.keys == [key]
    assert model.tool_answer(1, "call_1").content == "ch_1_4900"


def test_two_threads_with_the_same_arguments_both_execute(ledger: twiceshy.Ledger) -> None:
    """Two LangGraph threads are two runs: the same call executes in each, once."""
    provider = Provider()

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        return provider.charge(amount, twiceshy.current_key())

    protect = TwiceshyMiddleware(ledger, {"create_charge": twiceshy.KEYED})
    answers: list[Any] = []
    for thread_id, call_id in (("thread-a", "a1"), ("thread-b", "b1"), ("thread-a", "a2")):
        model = ScriptedModel(
            responses=[calls(("create_charge", CHARGE, call_id)), AIMessage("Done.")]
        )
        agent = create_agent(
            model=model, tools=[create_charge], middleware=[protect], checkpointer=InMemorySaver()
        )
        agent.invoke({"messages": [HumanMessage("charge")]}, thread(thread_id))
        answers.append(model.tool_answer(1, call_id).content)

    assert answers == ["ch_1_4900", "ch_2_4900", "ch_1_4900"]
    assert provider.keys == [
        twiceshy.idempotency_key("thread-a", "create_charge", CHARGE),
        twiceshy.idempotency_key("thread-b", "create_charge", CHARGE),
    ]


def test_async_agent_is_protected_the_same_way(ledger: twiceshy.Ledger) -> None:
    """``ainvoke`` goes through awrap_tool_call: UNSAFE honest error, KEYED replay, async tools."""
    provider = Provider()
    wires: list[int] = []

    @tool
    async def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        await asyncio.sleep(0)
        return provider.charge(amount, twiceshy.current_key())

    @tool
    async def wire(amount: int, to: str) -> str:
        """Wire money."""
        wires.append(amount)
        raise TimeoutError("read timed out")

    model = ScriptedModel(
        responses=[
            calls(("create_charge", CHARGE, "c1"), ("wire", WIRE, "w1")),
            calls(("create_charge", CHARGE, "c2"), ("wire", WIRE, "w2")),
            AIMessage("Done."),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[create_charge, wire],
        middleware=[
            retries(2),
            TwiceshyMiddleware(ledger, {"create_charge": twiceshy.KEYED, "wire": twiceshy.UNSAFE}),
        ],
        checkpointer=InMemorySaver(),
    )
    asyncio.run(agent.ainvoke({"messages": [HumanMessage("go")]}, thread("thread-7")))

    key = twiceshy.idempotency_key("thread-7", "create_charge", CHARGE)
    assert provider.keys == [key]
    assert wires == [500]
    assert model.tool_answer(2, "c2").content == model.tool_answer(1, "c1").content == "ch_1_4900"
    for request, call_id in ((1, "w1"), (2, "w2")):
        answer = model.tool_answer(request, call_id)
        assert answer.status == "error"
        assert "will not be run again" in str(answer.content)


# -- plain LangGraph: a ToolNode in a StateGraph --------------------------------------------


class Messages(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def tool_graph(node: ToolNode, retry: RetryPolicy | None = None, state: type = Messages) -> Any:
    """A graph whose one node is the ToolNode, with a checkpointer."""
    graph = StateGraph(state)
    graph.add_node("tools", node, retry_policy=retry)
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    return graph.compile(checkpointer=InMemorySaver())


def test_tool_node_replays_an_ai_message_fed_twice(ledger: twiceshy.Ledger) -> None:
    """A ToolNode fed the same call twice (new ids) runs it once and answers both ids."""
    provider = Provider()

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        return provider.charge(amount, twiceshy.current_key())

    protect = TwiceshyMiddleware(ledger, {"create_charge": twiceshy.KEYED})
    app = tool_graph(
        ToolNode(
            [create_charge],
            wrap_tool_call=protect.wrap_tool_call,
            awrap_tool_call=protect.awrap_tool_call,
        )
    )
    first = app.invoke({"messages": [calls(("create_charge", CHARGE, "n1"))]}, thread("g-1"))
    second = app.invoke({"messages": [calls(("create_charge", CHARGE, "n2"))]}, thread("g-1"))
    third = asyncio.run(
        app.ainvoke({"messages": [calls(("create_charge", CHARGE, "n3"))]}, thread("g-1"))
    )

    assert len(provider.keys) == 1
    answers = [out["messages"][-1] for out in (first, second, third)]
    assert [a.tool_call_id for a in answers] == ["n1", "n2", "n3"]
    assert {a.content for a in answers} == {"ch_1_4900"}


def test_tool_node_parallel_duplicates_run_once(ledger: twiceshy.Ledger) -> None:
    """One AI message calling the same tool twice with the same arguments runs it once."""
    provider = Provider()
    started = threading.Barrier(2, timeout=5)

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        return provider.charge(amount, twiceshy.current_key())

    protect = TwiceshyMiddleware(ledger, {"create_charge": twiceshy.KEYED})

    def wrap(request: ToolCallRequest, handler: Any) -> Any:
        started.wait()  # both calls are in flight before either reaches the ledger
        return protect.wrap_tool_call(request, handler)

    app = tool_graph(ToolNode([create_charge], wrap_tool_call=wrap))
    out = app.invoke(
        {"messages": [calls(("create_charge", CHARGE, "p1"), ("create_charge", CHARGE, "p2"))]},
        thread("g-2"),
    )
    answers = {m.tool_call_id: m.content for m in out["messages"] if isinstance(m, ToolMessage)}
    assert answers == {"p1": "ch_1_4900", "p2": "ch_1_4900"}
    assert len(provider.keys) == 1


def test_artifact_is_replayed_with_the_content(ledger: twiceshy.Ledger) -> None:
    """A tool answering content and artifact gives a retry both again, without running."""
    searches: list[str] = []

    @tool(response_format="content_and_artifact")
    def search_orders(customer: str) -> tuple[str, dict[str, Any]]:
        """Search a customer's orders."""
        searches.append(customer)
        return "2 orders", {"order_ids": ["o_1", "o_2"]}

    protect = TwiceshyMiddleware(ledger, {"search_orders": twiceshy.UNSAFE})
    app = tool_graph(
        ToolNode(
            [search_orders],
            wrap_tool_call=protect.wrap_tool_call,
            awrap_tool_call=protect.awrap_tool_call,
        )
    )
    args = {"customer": "cus_1"}
    first = app.invoke({"messages": [calls(("search_orders", args, "a1"))]}, thread("g-8"))
    second = app.invoke({"messages": [calls(("search_orders", args, "a2"))]}, thread("g-8"))
    third = asyncio.run(
        app.ainvoke({"messages": [calls(("search_orders", args, "a3"))]}, thread("g-8"))
    )

    assert searches == ["cus_1"]
    answers = [out["messages"][-1] for out in (first, second, third)]
    assert [(a.tool_call_id, a.content) for a in answers] == [
        ("a1", "2 orders"),
        ("a2", "2 orders"),
        ("a3", "2 orders"),
    ]
    assert [a.artifact for a in answers] == [{"order_ids": ["o_1", "o_2"]}] * 3


def test_injected_arguments_sent_by_the_model_are_no_part_of_the_intent(
    ledger: twiceshy.Ledger,
) -> None:
    """A model sending a value for an injected parameter (ToolNode drops it) calls one intent."""
    sent: list[str] = []

    @tool
    def send_mail(
        to: str,
        state: Annotated[dict[str, Any], InjectedState],
        call_id: Annotated[str, InjectedToolCallId],
    ) -> str:
        """Send a mail."""
        sent.append(to)
        return f"mail {len(sent)}"

    protect = TwiceshyMiddleware(ledger, {"send_mail": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([send_mail], wrap_tool_call=protect.wrap_tool_call))
    forged = {"to": "a@example.com", "state": {"messages": []}, "call_id": "x"}
    answers: list[object] = []
    for args, call_id in (({"to": "a@example.com"}, "s1"), (forged, "s2")):
        out = app.invoke({"messages": [calls(("send_mail", args, call_id))]}, thread("g-9"))
        answers.append(out["messages"][-1].content)

    assert sent == ["a@example.com"]
    assert answers == ["mail 1", "mail 1"]


def test_langgraph_retry_policy_meets_the_ledger(ledger: twiceshy.Ledger) -> None:
    """A node rerun by LangGraph's RetryPolicy after an error that left no effect runs it once."""
    connects: list[int] = []
    wires: list[int] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        connects.append(amount)
        if len(connects) == 1:
            raise ConnectionRefusedError("connection refused")  # before anything was sent
        twiceshy.point_of_no_return()
        wires.append(amount)
        return "sent"

    protect = TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})
    node = ToolNode([wire], wrap_tool_call=protect.wrap_tool_call)
    policy = RetryPolicy(
        max_attempts=3, initial_interval=0.0, jitter=False, retry_on=ConnectionRefusedError
    )
    app = tool_graph(node, retry=policy)
    out = app.invoke({"messages": [calls(("wire", WIRE, "r1"))]}, thread("g-3"))

    assert connects == [500, 500]
    assert wires == [500]
    assert out["messages"][-1].content == "sent"


class Booking(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    bookings: Annotated[list[str], operator.add]


def test_command_result_applies_once_and_replays_its_message(ledger: twiceshy.Ledger) -> None:
    """A tool returning a Command updates the state once; a re-call gets its message again."""
    runs: list[str] = []

    @tool
    def book(room: str, runtime: ToolRuntime) -> Command:
        """Book a room."""
        runs.append(room)
        answer = ToolMessage(f"booked {room}", tool_call_id=runtime.tool_call_id)
        return Command(update={"bookings": [room], "messages": [answer]})

    protect = TwiceshyMiddleware(ledger, {"book": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([book], wrap_tool_call=protect.wrap_tool_call), state=Booking)
    first = app.invoke({"messages": [calls(("book", {"room": "B-1"}, "k1"))]}, thread("g-4"))
    second = app.invoke({"messages": [calls(("book", {"room": "B-1"}, "k2"))]}, thread("g-4"))

    assert runs == ["B-1"]
    assert first["bookings"] == second["bookings"] == ["B-1"]
    replay = second["messages"][-1]
    assert (replay.tool_call_id, replay.content, replay.status) == ("k2", "booked B-1", "success")


def test_hand_off_signal_from_inside_a_tool_passes_once(ledger: twiceshy.Ledger) -> None:
    """A sub-agent's hand-off (a Command for the parent graph) raised in a tool passes, once."""
    handoffs: list[str] = []

    def hand_off(state: Messages) -> Command:
        handoffs.append("hand-off")
        update = {"messages": [AIMessage("handed off")]}
        return Command(graph=Command.PARENT, goto="audit", update=update)

    subagent = StateGraph(Messages)
    subagent.add_node("hand_off", hand_off)
    subagent.add_edge(START, "hand_off")
    subagent_app = subagent.compile()

    @tool
    def escalate(reason: str) -> str:
        """Escalate to a human team."""
        subagent_app.invoke({"messages": [HumanMessage(reason)]})
        return "not handed off"

    protect = TwiceshyMiddleware(ledger, {"escalate": twiceshy.UNSAFE})
    graph = StateGraph(Messages)
    node = ToolNode([escalate], wrap_tool_call=protect.wrap_tool_call)
    graph.add_node("tools", node, destinations=("audit",))
    graph.add_node("audit", lambda state: {"messages": [AIMessage("audited")]})
    graph.add_edge(START, "tools")
    app = graph.compile(checkpointer=InMemorySaver())
    call = ("escalate", {"reason": "angry customer"}, "e1")
    first = app.invoke({"messages": [calls(call)]}, thread("g-7"))
    second = app.invoke({"messages": [calls(("escalate", call[1], "e2"))]}, thread("g-7"))

    assert handoffs == ["hand-off"]
    assert [m.content for m in first["messages"][-2:]] == ["handed off", "audited"]
    replay = second["messages"][-1]
    assert (replay.tool_call_id, replay.status) == ("e2", "success")
    assert "already ran for these arguments" in replay.content


def test_in_progress_reaches_the_model_as_an_error(tmp_path: Path) -> None:
    """A call of an intent another process is running answers InProgress, without running."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    runs: list[str] = []
    release = threading.Event()
    with twiceshy.Ledger(url) as elsewhere, twiceshy.Ledger(url) as here:
        busy = elsewhere.guard("wire", effect=twiceshy.UNSAFE)
        holder = threading.Thread(
            target=busy.call, args=(WIRE, lambda: release.wait(10)), kwargs={"scope": "g-5"}
        )
        holder.start()
        try:
            for _ in range(500):  # bounded: until the other process holds the claim
                key = twiceshy.idempotency_key("g-5", "wire", WIRE)
                if here.store.get("", key).record is not None:
                    break
                threading.Event().wait(0.01)

            @tool
            def wire(amount: int, to: str) -> str:
                """Wire money."""
                runs.append(to)
                return "sent"

            guard = here.guard("wire", effect=twiceshy.UNSAFE, wait=0.2)
            protect = TwiceshyMiddleware(here, {"wire": guard})
            app = tool_graph(ToolNode([wire], wrap_tool_call=protect.wrap_tool_call))
            out = app.invoke({"messages": [calls(("wire", WIRE, "i1"))]}, thread("g-5"))
        finally:
            release.set()
            holder.join(10)
    answer = out["messages"][-1]
    text = answer.content
    assert runs == []
    assert answer.status == "error"
    assert text.startswith("An identical call of the tool 'wire' started at ")
    assert (
        "UTC and has not recorded an outcome: it may still be running, or the process running it "
        "may have stopped. This call did not start it a second time. If it records none by "
    ) in text
    assert "its outcome becomes unknown and it is not run again by itself" in text
    assert "try again" not in text.lower()


# -- scope, declarations, arguments -----------------------------------------------------------


def test_missing_thread_id_ends_the_run_unretried(ledger: twiceshy.Ledger) -> None:
    """Without a thread id a recorded tool raises ScopeNotFound out of invoke; nothing retries."""
    wires: list[int] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        wires.append(amount)
        return "sent"

    @tool
    def lookup(account: str) -> str:
        """Look an account up."""
        return f"{account}: open"

    spy = Spy()
    model = ScriptedModel(
        responses=[
            calls(("lookup", {"account": "acc_1"}, "l1")),
            calls(("wire", WIRE, "w1")),
            AIMessage("unreachable"),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[wire, lookup],
        middleware=[
            retries(2),
            spy,
            TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE}, default=twiceshy.SAFE),
        ],
    )
    if not BUBBLES_THROUGH_RETRIES:
        agent.invoke({"messages": [HumanMessage("wire 5 EUR")]})
        assert wires == []
        assert "the run has no thread id" in str(model.tool_answer(2, "w1").content)
        return
    with pytest.raises(ScopeNotFound, match="no thread id") as raised:
        agent.invoke({"messages": [HumanMessage("wire 5 EUR")]})

    assert isinstance(raised.value, twiceshy.MissingScope)
    assert wires == []
    assert spy.seen == ["l1", "w1"]  # the SAFE lookup ran; the wire was refused once, unretried
    assert model.tool_answer(1, "l1").content == "acc_1: open"


def test_scope_function_replaces_the_thread_id(ledger: twiceshy.Ledger) -> None:
    """scope= names the run from the request (here the runtime context), across threads."""

    @dataclass
    class Conversation:
        conversation_id: str

    provider = Provider()

    @tool
    def create_charge(amount: int, customer: str) -> str:
        """Charge a customer."""
        return provider.charge(amount, twiceshy.current_key())

    def by_conversation(request: ToolCallRequest) -> str | None:
        assert thread_scope(request) in {"thread-x", "thread-y"}
        return f"conversation:{request.runtime.context.conversation_id}"

    protect = TwiceshyMiddleware(ledger, {"create_charge": twiceshy.KEYED}, scope=by_conversation)
    for thread_id in ("thread-x", "thread-y"):
        model = ScriptedModel(
            responses=[calls(("create_charge", CHARGE, thread_id)), AIMessage("Done.")]
        )
        agent = create_agent(
            model=model,
            tools=[create_charge],
            middleware=[protect],
            context_schema=Conversation,
            checkpointer=InMemorySaver(),
        )
        agent.invoke(
            {"messages": [HumanMessage("charge")]},
            thread(thread_id),
            context=Conversation("c-77"),
        )
    assert provider.keys == [twiceshy.idempotency_key("conversation:c-77", "create_charge", CHARGE)]


def test_undeclared_tool_is_refused_and_made_up_names_pass(ledger: twiceshy.Ledger) -> None:
    """A real tool with no effect class ends the run; a made-up name gets ToolNode's answer."""
    runs: list[str] = []

    @tool
    def delete_user(user: str) -> str:
        """Delete a user."""
        runs.append(user)
        return "deleted"

    protect = TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})
    model = ScriptedModel(
        responses=[
            calls(("teleport", {"to": "mars"}, "t1")),
            calls(("delete_user", {"user": "u1"}, "d1")),
            AIMessage("unreachable"),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[delete_user],
        middleware=[retries(2), protect],
        checkpointer=InMemorySaver(),
    )
    if BUBBLES_THROUGH_RETRIES:
        with pytest.raises(EffectNotDeclared, match="'delete_user' has no declared effect class"):
            agent.invoke({"messages": [HumanMessage("go")]}, thread("thread-8"))
    else:
        agent.invoke({"messages": [HumanMessage("go")]}, thread("thread-8"))
        assert "has no declared effect class" in str(model.tool_answer(2, "d1").content)
    assert runs == []
    made_up = model.tool_answer(1, "t1")
    assert made_up.status == "error"
    assert "not a valid tool" in str(made_up.content)


def test_configuration_is_checked_at_construction(ledger: twiceshy.Ledger) -> None:
    """No declaration, a wrong effect value or a guard of another name is refused at once."""
    with pytest.raises(ValueError, match="no silent default"):
        TwiceshyMiddleware(ledger)
    with pytest.raises(TypeError, match=r"must be twiceshy\.SAFE"):
        TwiceshyMiddleware(ledger, {"wire": "unsafe"})
    with pytest.raises(ValueError, match="named 'send'"):
        TwiceshyMiddleware(ledger, {"wire": ledger.guard("send", effect=twiceshy.UNSAFE)})
    with pytest.raises(ValueError, match="without ':'"):
        TwiceshyMiddleware(ledger, {"a:b": twiceshy.KEYED})


def test_omitted_default_and_explicit_default_are_one_intent(ledger: twiceshy.Ledger) -> None:
    """The model leaving out a defaulted argument, then sending it, calls one intent."""
    sent: list[tuple[str, bool]] = []

    @tool
    def send_mail(to: str, urgent: bool = False) -> str:
        """Send a mail."""
        sent.append((to, urgent))
        return f"mail {len(sent)}"

    model = ScriptedModel(
        responses=[
            calls(("send_mail", {"to": "a@example.com"}, "m1")),
            calls(("send_mail", {"to": "a@example.com", "urgent": False}, "m2")),
            calls(("send_mail", {"to": "a@example.com", "urgent": True}, "m3")),
            AIMessage("Sent."),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[send_mail],
        middleware=[TwiceshyMiddleware(ledger, {"send_mail": twiceshy.UNSAFE})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("mail")]}, thread("thread-9"))
    assert sent == [("a@example.com", False), ("a@example.com", True)]
    assert model.tool_answer(2, "m2").content == "mail 1"
    assert model.tool_answer(3, "m3").content == "mail 2"


def test_arguments_the_tool_refuses_run_nothing(ledger: twiceshy.Ledger) -> None:
    """Arguments that fail the tool's schema run nothing; the same call gets the same answer."""
    runs: list[int] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money."""
        runs.append(amount)
        return "sent"

    protect = TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([wire], wrap_tool_call=protect.wrap_tool_call))
    bad = {"amount": "lots", "to": "x"}
    answers = [
        app.invoke({"messages": [calls(("wire", args, call_id))]}, thread("g-6"))["messages"][-1]
        for args, call_id in ((bad, "v1"), (bad, "v2"), ({"amount": 5, "to": "x"}, "v3"))
    ]
    assert runs == [5]
    assert answers[0].status == answers[1].status == "error"
    assert answers[0].content == answers[1].content
    assert "valid integer" in answers[1].content
    assert (answers[2].content, answers[2].tool_call_id) == ("sent", "v3")


def test_interrupt_inside_a_tool_releases_the_intent(ledger: twiceshy.Ledger) -> None:
    """A tool that waits for approval with interrupt() runs to its end once on resume."""
    wires: list[int] = []

    @tool
    def wire(amount: int, to: str) -> str:
        """Wire money after approval."""
        if interrupt({"approve": amount}) != "yes":
            return "not approved"
        wires.append(amount)
        return "sent"

    model = ScriptedModel(
        responses=[
            calls(("wire", WIRE, "w1")),
            calls(("wire", WIRE, "w2")),
            AIMessage("Done."),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[wire],
        middleware=[TwiceshyMiddleware(ledger, {"wire": twiceshy.UNSAFE})],
        checkpointer=InMemorySaver(),
    )
    paused = agent.invoke({"messages": [HumanMessage("wire")]}, thread("thread-10"))
    assert paused["__interrupt__"][0].value == {"approve": 500}
    assert wires == []
    agent.invoke(Command(resume="yes"), thread("thread-10"))

    assert wires == [500]
    assert model.tool_answer(1, "w1").content == "sent"
    assert model.tool_answer(2, "w2").content == "sent"
