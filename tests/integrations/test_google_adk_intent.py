"""The intent of a Google ADK tool call is what its function receives from ADK, through a real
``LlmAgent``: a model that spells one call two ways names one intent wherever ADK hands the
function one value."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from google.adk.agents import LlmAgent
from google.adk.features import FeatureName, override_feature_enabled
from google.adk.tools import ToolContext
from pydantic import BaseModel, Field
from scripted_google_adk import ScriptedModel, run

from twiceshy import KEYED, Ledger, current_key, idempotency_key
from twiceshy.integrations.google_adk import protect


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


class Order(BaseModel):
    """A model argument with a field a default factory makes (module level: ADK resolves the
    function's annotations)."""

    sku: str
    quantity: int = 1
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


def twice(tools: list[Any], name: str, first: dict[str, Any], second: dict[str, Any]) -> Any:
    """Run an agent whose model calls ``name`` with ``first`` (c1), then ``second`` (c2)."""
    model = ScriptedModel.of([("c1", name, first)], [("c2", name, second)])
    run(LlmAgent(name="billing", model=model, tools=tools), "order-1")
    return model.results()


def recording_charge(received: list[Any], keys: list[str | None]) -> Any:
    """A ``charge`` tool function that notes what it receives and the key it runs under."""

    def charge(amount: int, customer: str, currency: str = "eur") -> str:
        """Charge the customer, in cents."""
        received.append(amount)
        keys.append(current_key())
        return f"charged {amount!r} {currency}"

    return charge


def test_key_order_and_an_omitted_default_are_one_intent(ledger: Ledger) -> None:
    """The keys in another order, the default left out and then sent: one run."""
    received: list[Any] = []
    keys: list[str | None] = []
    tools = protect([recording_charge(received, keys)], ledger, effects={"charge": KEYED})

    read = twice(
        tools,
        "charge",
        {"amount": 4900, "customer": "cus_1"},
        {"currency": "eur", "customer": "cus_1", "amount": 4900},
    )

    assert read == {"c1": {"result": "charged 4900 eur"}, "c2": {"result": "charged 4900 eur"}}
    full = {"amount": 4900, "customer": "cus_1", "currency": "eur"}
    assert keys == [idempotency_key("order-1", "charge", full)]


# ADK warns once that the feature is experimental.
@pytest.mark.filterwarnings("ignore:.*FUNCTION_TOOL_ARG_VALIDATION")
@pytest.mark.skipif(
    not hasattr(FeatureName, "FUNCTION_TOOL_ARG_VALIDATION"),
    reason="this Google ADK release has no FUNCTION_TOOL_ARG_VALIDATION feature",
)
def test_a_number_sent_as_text_is_the_value_adk_hands_the_function(ledger: Ledger) -> None:
    """Without ADK's argument validation the function receives ``"4900"`` as text, another
    value than ``4900`` and so another intent; with ``FUNCTION_TOOL_ARG_VALIDATION`` on, ADK
    coerces it, the function receives ``4900`` both times, and it is one intent."""
    received: list[Any] = []
    keys: list[str | None] = []
    tools = protect([recording_charge(received, keys)], ledger, effects={"charge": KEYED})
    as_text = {"amount": "4900", "customer": "cus_1"}
    as_number = {"amount": 4900, "customer": "cus_1"}

    twice(tools, "charge", as_text, as_number)
    assert received == ["4900", 4900]
    assert len(set(keys)) == 2

    received.clear()
    keys.clear()
    override_feature_enabled(FeatureName.FUNCTION_TOOL_ARG_VALIDATION, True)
    try:
        model = ScriptedModel.of([("c1", "charge", as_text)], [("c2", "charge", as_number)])
        run(LlmAgent(name="billing", model=model, tools=tools), "order-2")
    finally:
        override_feature_enabled(FeatureName.FUNCTION_TOOL_ARG_VALIDATION, False)  # its default
    assert received == [4900]
    full = {"amount": 4900, "customer": "cus_1", "currency": "eur"}
    assert keys == [idempotency_key("order-2", "charge", full)]
    assert model.results()["c2"] == {"result": "charged 4900 eur"}


def test_the_tool_context_is_no_part_of_the_intent(ledger: Ledger) -> None:
    """A function that takes ADK's ToolContext is keyed by its other arguments only."""
    keys: list[str | None] = []

    def refund(charge_id: str, tool_context: ToolContext) -> str:
        """Refund a charge."""
        assert isinstance(tool_context, ToolContext)
        keys.append(current_key())
        return f"refunded {charge_id}"

    tools = protect([refund], ledger, effects={"refund": KEYED})
    read = twice(tools, "refund", {"charge_id": "ch_1"}, {"charge_id": "ch_1"})

    assert read["c2"] == {"result": "refunded ch_1"}
    assert keys == [idempotency_key("order-1", "refund", {"charge_id": "ch_1"})]


def test_a_model_argument_is_named_by_what_the_model_sent(ledger: Ledger) -> None:
    """ADK builds the pydantic model from the JSON; a field its default factory makes anew
    on every call (a request id) is no part of the intent, an omitted plain default is."""
    made: list[str] = []

    def order(item: Order) -> str:
        """Order an item."""
        made.append(item.request_id)
        return f"{item.quantity} x {item.sku}"

    tools = protect([order], ledger, effects={"order": KEYED})
    read = twice(tools, "order", {"item": {"sku": "A1"}}, {"item": {"quantity": 1, "sku": "A1"}})

    assert read == {"c1": {"result": "1 x A1"}, "c2": {"result": "1 x A1"}}
    assert len(made) == 1
