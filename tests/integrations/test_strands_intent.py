"""The intent of a Strands tool call is what its function receives, through a real ``Agent``:
the model's input as the ``@tool`` decorator validates it, so a model that spells one call two
ways names one intent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from scripted_strands import ScriptedModel
from strands import Agent, ToolContext, tool
from strands.tools.tools import PythonAgentTool
from strands.types.tools import ToolResult, ToolUse

from twiceshy import KEYED, Ledger, current_key, idempotency_key
from twiceshy.integrations.strands import TwiceshyPlugin


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


def twice(
    ledger: Ledger, tools: list[Any], name: str, first: dict[str, Any], second: dict[str, Any]
) -> tuple[ScriptedModel, Agent]:
    """Run an agent whose model calls ``name`` with ``first`` (t1), then ``second`` (t2)."""
    model = ScriptedModel([("t1", name, first)], [("t2", name, second)])
    agent = Agent(
        model=model,
        tools=tools,
        callback_handler=None,
        plugins=[TwiceshyPlugin(ledger, default=KEYED)],
    )
    agent("go")
    return model, agent


def test_text_for_a_number_another_key_order_and_an_omitted_default_are_one_intent(
    ledger: Ledger,
) -> None:
    """``"4900"`` for an ``int`` with the default left out, then ``4900`` with the default
    sent and the keys in another order: one run, and the function receives the number."""
    received: list[Any] = []
    keys: list[str | None] = []

    @tool
    def charge(amount: int, customer: str, currency: str = "eur") -> str:
        """Charge the customer.

        Args:
            amount: in cents.
            customer: the customer's id.
            currency: the currency.
        """
        received.append(amount)
        keys.append(current_key())
        return f"charged {amount} {currency}"

    model, agent = twice(
        ledger,
        [charge],
        "charge",
        {"amount": "4900", "customer": "cus_1"},
        {"currency": "eur", "customer": "cus_1", "amount": 4900},
    )

    assert model.texts() == {"t1": "charged 4900 eur", "t2": "charged 4900 eur"}
    assert received == [4900]
    full = {"amount": 4900, "currency": "eur", "customer": "cus_1"}
    assert keys == [idempotency_key(agent.session_id, "charge", full)]


def test_what_strands_injects_is_no_part_of_the_intent(ledger: Ledger) -> None:
    """The ``ToolContext`` and the ``agent`` Strands hands a tool are left out of its key."""
    keys: list[str | None] = []

    @tool(context=True)
    def refund(charge_id: str, tool_context: ToolContext, agent: Agent) -> str:
        """Refund a charge.

        Args:
            charge_id: the charge.
        """
        assert isinstance(tool_context, ToolContext)
        keys.append(current_key())
        return f"refunded {charge_id} (call {tool_context.tool_use['toolUseId']})"

    model, agent = twice(ledger, [refund], "refund", {"charge_id": "ch_1"}, {"charge_id": "ch_1"})

    assert model.texts() == {"t1": "refunded ch_1 (call t1)", "t2": "refunded ch_1 (call t1)"}
    assert keys == [idempotency_key(agent.session_id, "refund", {"charge_id": "ch_1"})]


def test_a_tool_with_no_function_is_named_by_its_input_and_schema_defaults(
    ledger: Ledger,
) -> None:
    """A tool built from a spec (as MCP tools are) is keyed by the input the model sent, its
    schema's defaults filled in for the ones left out."""
    runs: list[dict[str, Any]] = []

    def book(tool_use: ToolUse, **kwargs: Any) -> ToolResult:
        runs.append(dict(tool_use["input"]))
        return {
            "toolUseId": tool_use["toolUseId"],
            "status": "success",
            "content": [{"text": f"booked {tool_use['input']['room']}"}],
        }

    spec = {
        "name": "book",
        "description": "Book a room.",
        "inputSchema": {
            "json": {
                "type": "object",
                "properties": {"room": {"type": "string"}, "nights": {"default": 1}},
                "required": ["room"],
            }
        },
    }
    booking = PythonAgentTool("book", spec, book)  # type: ignore[arg-type]

    model, _ = twice(ledger, [booking], "book", {"room": "101"}, {"nights": 1, "room": "101"})

    assert model.texts() == {"t1": "booked 101", "t2": "booked 101"}
    assert runs == [{"room": "101"}]
