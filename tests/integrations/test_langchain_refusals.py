"""What the LangChain adapter refuses, through ``create_agent`` and a plain ``ToolNode``: a call
the tool refuses before its function runs never meets the ledger (the model reads LangChain's
own error, nothing runs, nothing is recorded), and a recorded generator tool is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import ToolNode, ToolRuntime
from pydantic import BaseModel, ConfigDict, model_validator
from test_langchain import (
    BUBBLES_THROUGH_RETRIES,
    ScriptedModel,
    calls,
    retries,
    thread,
    tool_graph,
)

import twiceshy
from twiceshy.integrations.langchain import GeneratorTool, TwiceshyMiddleware


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    """A ledger in memory, then in a SQLite file."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ledger.db'}"
    with twiceshy.Ledger(url) as opened:
        yield opened


def records(ledger: twiceshy.Ledger) -> list[twiceshy.Record]:
    """Every record the ledger holds, for any key."""
    return ledger.store.records(ledger.namespace)


def fax_tool(sent: list[str]) -> BaseTool:
    """``send_fax(to, body)``: each call sends a fax (kept in ``sent``)."""

    @tool
    def send_fax(to: str, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    return send_fax


def run_agent(
    fax: BaseTool, model: ScriptedModel, middleware: list[Any], thread_id: str
) -> dict[str, Any]:
    """One invocation of an agent with the fax tool, on the thread ``thread_id``."""
    agent = create_agent(
        model=model, tools=[fax], middleware=middleware, checkpointer=InMemorySaver()
    )
    return agent.invoke({"messages": [HumanMessage("fax")]}, thread(thread_id))


def told_without_twiceshy(args: dict[str, Any]) -> ToolMessage:
    """What the model reads for a call of the fax tool with ``args``, without twiceshy."""
    sent: list[str] = []
    model = ScriptedModel(responses=[calls(("send_fax", args, "c1")), AIMessage("ok")])
    run_agent(fax_tool(sent), model, [retries(2)], "plain")
    assert sent == []
    return model.tool_answer(1, "c1")


@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_call_missing_a_required_argument_never_meets_the_ledger(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """The model leaves out ``to``: it reads ToolNode's own error, as without twiceshy, nothing
    is sent and nothing is recorded; the well-formed call after it sends one fax."""
    sent: list[str] = []
    fax = fax_tool(sent)
    model = ScriptedModel(
        responses=[
            calls(("send_fax", {"body": "hello"}, "c1")),
            AIMessage("I will fix it"),
            calls(("send_fax", {"to": "555", "body": "hello"}, "c2")),
            AIMessage("done"),
        ]
    )
    protect = TwiceshyMiddleware(ledger, {"send_fax": effect})
    agent = create_agent(
        model=model,
        tools=[fax],
        middleware=[retries(2), protect],
        checkpointer=InMemorySaver(),
    )

    agent.invoke({"messages": [HumanMessage("fax")]}, thread("fax-1"))
    told = model.tool_answer(1, "c1")
    plain = told_without_twiceshy({"body": "hello"})
    assert (told.content, told.status) == (plain.content, plain.status)
    assert "Error invoking tool 'send_fax'" in str(told.content)
    assert sent == []
    assert records(ledger) == []

    agent.invoke({"messages": [HumanMessage("again")]}, thread("fax-1"))
    assert model.tool_answer(3, "c2").content == "faxed 555"
    assert sent == ["555"]
    assert len(records(ledger)) == 1


def test_a_tool_taking_the_runtime_passes_a_refused_call_by_the_ledger(
    ledger: twiceshy.Ledger,
) -> None:
    """A tool that also takes LangGraph's ``ToolRuntime``: its refusal of a call missing ``to``
    reaches the model as ToolNode's error, nothing runs or is recorded; the well-formed call
    after it runs once."""
    sent: list[str] = []

    @tool
    def send_fax(to: str, body: str, runtime: ToolRuntime) -> str:
        """Send a fax."""
        assert runtime.tool_call_id is not None
        sent.append(to)
        return f"faxed {to}"

    model = ScriptedModel(
        responses=[
            calls(("send_fax", {"body": "hello"}, "c1")),
            AIMessage("I will fix it"),
            calls(("send_fax", {"to": "555", "body": "hello"}, "c2")),
            AIMessage("done"),
        ]
    )
    agent = create_agent(
        model=model,
        tools=[send_fax],
        middleware=[TwiceshyMiddleware(ledger, {"send_fax": twiceshy.UNSAFE})],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("fax")]}, thread("rt-1"))
    told = model.tool_answer(1, "c1")
    assert told.status == "error"
    assert str(told.content).startswith("Error invoking tool 'send_fax'")
    assert sent == []
    assert records(ledger) == []

    agent.invoke({"messages": [HumanMessage("again")]}, thread("rt-1"))
    assert model.tool_answer(3, "c2").content == "faxed 555"
    assert sent == ["555"]
    assert len(records(ledger)) == 1


def test_a_tool_node_passes_a_refused_call_by_the_ledger(ledger: twiceshy.Ledger) -> None:
    """A plain ToolNode, run asynchronously: a wrongly typed argument gets ToolNode's error
    message, nothing is recorded; the well-formed call runs once."""
    sent: list[str] = []
    protect = TwiceshyMiddleware(ledger, {"send_fax": twiceshy.UNSAFE})
    app = tool_graph(
        ToolNode(
            [fax_tool(sent)],
            wrap_tool_call=protect.wrap_tool_call,
            awrap_tool_call=protect.awrap_tool_call,
        )
    )

    refused = asyncio.run(
        app.ainvoke(
            {"messages": [calls(("send_fax", {"to": ["5", "5"], "body": "hi"}, "n1"))]},
            thread("g-1"),
        )
    )
    answer = refused["messages"][-1]
    assert answer.status == "error"
    assert str(answer.content).startswith("Error invoking tool 'send_fax'")
    assert sent == []
    assert records(ledger) == []

    done = asyncio.run(
        app.ainvoke(
            {"messages": [calls(("send_fax", {"to": "555", "body": "hi"}, "n2"))]},
            thread("g-1"),
        )
    )
    assert done["messages"][-1].content == "faxed 555"
    assert sent == ["555"]
    assert len(records(ledger)) == 1


class FaxArgs(BaseModel):
    """A schema that lets through arguments the function does not take."""

    model_config = ConfigDict(extra="allow")

    to: str


def test_arguments_the_function_does_not_take_raise_as_python_raises_them(
    ledger: twiceshy.Ledger,
) -> None:
    """The schema lets ``cover`` through, the function has no such parameter: the run fails with
    the ``TypeError`` the call raises without twiceshy, nothing is recorded, and the well-formed
    call after it runs once."""
    sent: list[str] = []

    def send_fax(to: str) -> str:
        sent.append(to)
        return f"faxed {to}"

    fax = StructuredTool.from_function(send_fax, description="Send a fax.", args_schema=FaxArgs)
    cover = {"messages": [calls(("send_fax", {"to": "555", "cover": "urgent"}, "n0"))]}
    with pytest.raises(TypeError, match="unexpected keyword argument 'cover'"):
        tool_graph(ToolNode([fax])).invoke(cover, thread("plain"))  # without twiceshy
    protect = TwiceshyMiddleware(ledger, {"send_fax": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([fax], wrap_tool_call=protect.wrap_tool_call))

    with pytest.raises(TypeError, match=r"send_fax\(\) got an unexpected keyword argument 'cover'"):
        app.invoke(
            {"messages": [calls(("send_fax", {"to": "555", "cover": "urgent"}, "n1"))]},
            thread("g-2"),
        )
    assert sent == []
    assert records(ledger) == []

    done = app.invoke({"messages": [calls(("send_fax", {"to": "555"}, "n2"))]}, thread("g-3"))
    assert done["messages"][-1].content == "faxed 555"
    assert sent == ["555"]
    assert len(records(ledger)) == 1


class Recipient(BaseModel):
    """A schema whose own validator refuses an input as a whole."""

    to: str | None = None
    email: str | None = None

    @model_validator(mode="after")
    def one_of(self) -> Recipient:
        if (self.to is None) == (self.email is None):
            raise ValueError("give exactly one of to and email")
        return self


def test_an_input_the_schema_refuses_as_a_whole_never_meets_the_ledger(
    ledger: twiceshy.Ledger,
) -> None:
    """The schema's own validator refuses the input: the model reads ToolNode's error, nothing
    runs, nothing is recorded; the well-formed call runs once."""
    sent: list[str] = []

    def notify(to: str | None = None, email: str | None = None) -> str:
        sent.append(str(to or email))
        return "notified"

    tool_ = StructuredTool.from_function(notify, description="Notify.", args_schema=Recipient)
    protect = TwiceshyMiddleware(ledger, {"notify": twiceshy.UNSAFE})
    app = tool_graph(ToolNode([tool_], wrap_tool_call=protect.wrap_tool_call))

    both = {"to": "555", "email": "a@b.c"}
    refused = app.invoke({"messages": [calls(("notify", both, "n1"))]}, thread("v-1"))
    assert str(refused["messages"][-1].content).startswith("Error invoking tool 'notify'")
    assert sent == []
    assert records(ledger) == []

    done = app.invoke({"messages": [calls(("notify", {"to": "555"}, "n2"))]}, thread("v-1"))
    assert done["messages"][-1].content == "notified"
    assert sent == ["555"]
    assert len(records(ledger)) == 1


@pytest.mark.parametrize("effect", [twiceshy.KEYED, twiceshy.UNSAFE])
def test_a_recorded_generator_tool_is_refused_when_called(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect
) -> None:
    """A KEYED or UNSAFE tool whose function is a generator ends the run with ``GeneratorTool``
    (LangChain would show the model the generator object, its body never run): nothing runs,
    nothing is recorded."""
    sent: list[str] = []

    def send_faxes(to: str) -> Any:
        sent.append(to)
        yield f"faxed {to}"

    fax = StructuredTool.from_function(send_faxes, description="Send faxes.")
    model = ScriptedModel(responses=[calls(("send_faxes", {"to": "555"}, "c1")), AIMessage("?")])
    agent = create_agent(
        model=model,
        tools=[fax],
        middleware=[retries(2), TwiceshyMiddleware(ledger, {"send_faxes": effect})],
        checkpointer=InMemorySaver(),
    )
    if not BUBBLES_THROUGH_RETRIES:  # pragma: no cover - LangChain before 1.3.12
        agent.invoke({"messages": [HumanMessage("fax")]}, thread("gen-1"))
        assert "is a generator function" in str(model.tool_answer(1, "c1").content)
    else:
        with pytest.raises(GeneratorTool, match=r"is a generator function.*Return a list"):
            agent.invoke({"messages": [HumanMessage("fax")]}, thread("gen-1"))
    assert sent == []
    assert records(ledger) == []


def test_a_safe_generator_tool_keeping_no_record_is_left_to_langchain(
    ledger: twiceshy.Ledger,
) -> None:
    """A SAFE tool keeps no record: a generator there is LangChain's to answer, as without
    twiceshy."""

    def search(q: str) -> Any:
        yield q

    found = StructuredTool.from_function(search, description="Search.")
    model = ScriptedModel(responses=[calls(("search", {"q": "fax"}, "c1")), AIMessage("ok")])
    agent = create_agent(
        model=model,
        tools=[found],
        middleware=[TwiceshyMiddleware(ledger, default=twiceshy.SAFE)],
        checkpointer=InMemorySaver(),
    )
    agent.invoke({"messages": [HumanMessage("search")]}, thread("gen-2"))
    assert str(model.tool_answer(1, "c1").content).startswith("<generator object")
