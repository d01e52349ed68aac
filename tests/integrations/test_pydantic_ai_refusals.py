"""What the Pydantic AI adapter never records as started, through real agents driven by a
scripted ``FunctionModel``: a call Pydantic AI refused before entering the tool function (its
arguments missing or invalid), and a recorded tool whose function is a generator, whose effects
would run after the ledger recorded it as done.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger, State, idempotency_key
from twiceshy.integrations.pydantic_ai import TwiceshyCapability

CHARGE = {"amount": 4900, "customer": "cus_1"}


class Script:
    """A scripted model: its n-th request gets the n-th answer; it keeps every request."""

    __name__ = "script"  # FunctionModel names itself after its function

    def __init__(self, *answers: ModelResponse) -> None:
        self._answers = list(answers)
        self.requests: list[list[ModelMessage]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(list(messages))
        if len(self.requests) > len(self._answers):
            raise AssertionError("the model was asked more often than scripted")
        return self._answers[len(self.requests) - 1]

    def parts(self, request: int) -> list[Any]:
        """The parts of the last message of the ``request``-th request (from 1)."""
        last = self.requests[request - 1][-1]
        assert isinstance(last, ModelRequest)
        return list(last.parts)


def call(tool: str, args: dict[str, Any], tool_call_id: str) -> ModelResponse:
    """A model response calling ``tool`` with ``args``."""
    return ModelResponse(parts=[ToolCallPart(tool, dict(args), tool_call_id=tool_call_id)])


def done() -> ModelResponse:
    """The model's final answer."""
    return ModelResponse(parts=[TextPart("done")])


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


def records(ledger: Ledger) -> list[twiceshy.Record]:
    """Every record the ledger holds."""
    return ledger.store.records(ledger.namespace)


# -- a call Pydantic AI refuses before entering the function -------------------------------------


@pytest.mark.parametrize(
    "sent",
    [
        {"amount": "lots", "customer": "cus_1"},
        {"customer": "cus_1"},
        {"amount": 4900, "customer": "cus_1", "currency": 978},
    ],
    ids=["invalid", "missing", "unknown"],
)
@pytest.mark.parametrize("effect", [UNSAFE, KEYED], ids=lambda e: e.name)
def test_a_call_refused_for_its_arguments_is_never_recorded(
    ledger: Ledger, sent: dict[str, Any], effect: twiceshy.Effect
) -> None:
    """The model sends arguments Pydantic AI refuses, then good ones: the refused call never
    reaches the ledger (no record, no protected call), and the good one runs once."""
    charges: list[dict[str, Any]] = []
    seen: list[twiceshy.CallEvent] = []
    ledger.observe(seen.append)
    script = Script(call("charge", sent, "c1"), call("charge", CHARGE, "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": effect})]
    )

    @agent.tool_plain(retries=1)
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        charges.append({"amount": amount, "customer": customer, "key": twiceshy.current_key()})
        return "ch_1"

    agent.run_sync("charge the customer", run_id="run-1")

    (refused,) = script.parts(2)
    assert refused.tool_call_id == "c1"
    # A retry request: a RetryPromptPart, or from Pydantic AI 2.60 a "retried" ToolReturnPart.
    assert isinstance(refused, RetryPromptPart) or refused.outcome == "retried"
    key = idempotency_key("run-1", "charge", CHARGE)
    assert charges == [{**CHARGE, "key": key}]
    assert [(r.key, r.state) for r in records(ledger)] == [(key, State.SUCCEEDED)]
    assert [event.key for event in seen] == [key]


# -- a recorded tool whose function is a generator -----------------------------------------------

# The tools whose bodies ran (a generator's body runs as its result is read, not when called).
ran: list[str] = []


@pytest.fixture(autouse=True)
def nothing_ran_yet() -> None:
    """Each test starts with no tool body run."""
    ran.clear()


def export(rows: int) -> Iterator[str]:
    """Export rows, one at a time."""
    ran.append("export")
    yield from (f"row {n}" for n in range(rows))


async def export_async(rows: int) -> AsyncIterator[str]:
    """Export rows, one at a time."""
    ran.append("export_async")
    for n in range(rows):
        yield f"row {n}"


def export_plain(rows: int):  # type: ignore[no-untyped-def] - no annotation to give it away
    """Export rows, one at a time."""
    ran.append("export_plain")
    yield from (f"row {n}" for n in range(rows))


GENERATORS = pytest.mark.parametrize(
    "function", [export, export_async, export_plain], ids=["generator", "async", "unannotated"]
)
# Pydantic AI 2.6x and later warn that an iterator return annotation has no JSON schema.
NO_RETURN_SCHEMA = pytest.mark.filterwarnings("ignore:Could not generate return schema:UserWarning")


@NO_RETURN_SCHEMA
@GENERATORS
@pytest.mark.parametrize(
    "declared",
    [
        {"effects": {"export": UNSAFE}},
        {"effects": {"export": KEYED}},
        {"default": UNSAFE},
        {"metadata": "keyed"},
    ],
    ids=["unsafe", "keyed", "default", "metadata"],
)
def test_a_recorded_generator_tool_is_refused_when_the_agent_is_built(
    ledger: Ledger, function: Any, declared: dict[str, Any]
) -> None:
    """A KEYED or UNSAFE tool whose function is a generator - however it is declared - is
    refused with TypeError when the agent is built, naming the tool and what to do."""
    from pydantic_ai import Tool

    metadata = {"twiceshy": declared["metadata"]} if "metadata" in declared else None
    tool = Tool(function, name="export", metadata=metadata)
    capability = TwiceshyCapability(
        ledger, declared.get("effects"), default=declared.get("default")
    )
    with pytest.raises(TypeError, match="the tool 'export' is a generator function") as refused:
        Agent(FunctionModel(Script()), tools=[tool], capabilities=[capability])
    assert "Return a list" in str(refused.value)


@NO_RETURN_SCHEMA
@GENERATORS
def test_a_recorded_generator_tool_added_later_is_refused_when_the_run_starts(
    ledger: Ledger, function: Any
) -> None:
    """A generator tool added with ``@agent.tool_plain`` after the agent was built is refused
    when a run starts, before the model is asked: nothing runs, nothing is recorded."""
    script = Script(call("export", {"rows": 2}, "c1"), done())
    capability = TwiceshyCapability(ledger, {"export": UNSAFE})
    agent = Agent(FunctionModel(script), capabilities=[capability])
    agent.tool_plain(name="export")(function)

    with pytest.raises(TypeError, match="'export' is a generator function"):
        agent.run_sync("export the orders", run_id="run-1")
    assert script.requests == []
    assert ran == []
    assert records(ledger) == []


@NO_RETURN_SCHEMA
@GENERATORS
def test_a_generator_tool_of_a_toolset_given_to_one_run_is_refused_at_its_call(
    ledger: Ledger, function: Any
) -> None:
    """A generator tool of a toolset given to one run (seen only when it is called) is refused
    before it runs: its body never runs and the ledger records nothing."""
    name = function.__name__
    script = Script(call(name, {"rows": 2}, "c1"), done())
    agent = Agent(FunctionModel(script), capabilities=[TwiceshyCapability(ledger, default=UNSAFE)])
    with pytest.raises(TypeError, match=f"'{name}' is a generator function"):
        agent.run_sync("export the orders", run_id="run-1", toolsets=[FunctionToolset([function])])
    assert len(script.requests) == 1
    assert ran == []
    assert records(ledger) == []


@NO_RETURN_SCHEMA
def test_a_safe_generator_tool_is_left_to_pydantic_ai(ledger: Ledger) -> None:
    """A SAFE tool is not recorded, so its function may be a generator: it is not refused."""
    script = Script(call("export", {"rows": 2}, "c1"), done())
    agent = Agent(
        FunctionModel(script),
        tools=[export],
        capabilities=[TwiceshyCapability(ledger, {"export": SAFE}, default=UNSAFE)],
    )
    assert agent.run_sync("export the orders", run_id="run-1").output == "done"
    assert ran == ["export"]
    assert records(ledger) == []


def test_a_copy_of_the_capability_protects_as_the_original(ledger: Ledger) -> None:
    """A shallow copy of the capability (copy.copy) shares its ledger: a call made through an
    agent holding the copy replays the original's record."""
    charges: list[str] = []
    original = TwiceshyCapability(ledger, {"charge": UNSAFE})

    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        charges.append(customer)
        return "ch_1"

    for capability in (original, copy.copy(original)):
        script = Script(call("charge", CHARGE, "c1"), done())
        agent = Agent(FunctionModel(script), tools=[charge], capabilities=[capability])
        agent.run_sync("charge the customer", run_id="run-1")
    assert charges == ["cus_1"]
