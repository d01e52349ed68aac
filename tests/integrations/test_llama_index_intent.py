"""The intent of a LlamaIndex tool call is what its function receives, through a real
``FunctionAgent``: a model that spells one call two ways names one intent, and the function
receives the values of the tool's own schema.

No ``from __future__ import annotations`` here: LlamaIndex builds a tool's schema from its
function's annotations, and cannot resolve a model named in a string annotation.
"""

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.tools import FunctionTool
from provider_log import Provider
from pydantic import BaseModel, Field
from scripted_llama_index import Script, run
from workflows import Context

from twiceshy import KEYED, Ledger, current_key, idempotency_key
from twiceshy.integrations.llama_index import protect

pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning")


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


class Line(BaseModel):
    """A nested model with coercible fields."""

    sku: str
    quantity: int


def twice(
    tools: list[Any], name: str, first: dict[str, Any], second: dict[str, Any], run_id: str
) -> Script:
    """Run an agent whose model calls ``name`` with ``first`` (c1), then ``second`` (c2)."""
    script = Script([("c1", name, first)], [("c2", name, second)])
    run(FunctionAgent(tools=tools, llm=script.llm()), run_id=run_id)
    return script


def test_a_number_sent_as_text_and_keys_in_another_order_are_one_intent(
    ledger: Ledger, tmp_path: Path
) -> None:
    """``"4900"`` for an ``int``, then ``4900`` with the keys in another order: one charge, and
    the function receives the number both times."""
    provider = Provider(tmp_path / "effects")
    received: list[Any] = []

    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        received.append(amount)
        return provider.charge(current_key(), amount, customer)

    tools = protect([charge], ledger, effects={"charge": KEYED})
    script = twice(
        tools,
        "charge",
        {"amount": "4900", "customer": "cus_1"},
        {"customer": "cus_1", "amount": 4900},
        "intent-1",
    )

    assert script.results() == {"c1": "ch_1", "c2": "ch_1"}
    assert received == [4900]
    assert provider.keys == [
        idempotency_key("intent-1", "charge", {"amount": 4900, "customer": "cus_1"})
    ]


def test_an_omitted_default_and_the_default_sent_are_one_intent(ledger: Ledger) -> None:
    """Leaving ``currency`` out and sending its default name the same intent."""
    keys: list[str | None] = []

    def charge(amount: int, currency: str = "eur") -> str:
        """Charge."""
        keys.append(current_key())
        return f"{amount} {currency}"

    tools = protect([charge], ledger, effects={"charge": KEYED})
    script = twice(tools, "charge", {"amount": 5}, {"amount": 5, "currency": "eur"}, "intent-2")

    assert script.results() == {"c1": "5 eur", "c2": "5 eur"}
    assert keys == [idempotency_key("intent-2", "charge", {"amount": 5, "currency": "eur"})]


def test_a_nested_model_is_validated_and_named_by_its_fields(ledger: Ledger) -> None:
    """A line sent with a quantity as text, then as a number in another key order: one intent,
    and the function receives the model, as its annotation says."""
    received: list[Any] = []

    def order(line: Line) -> str:
        """Order a line."""
        received.append(line)
        return f"{line.quantity} x {line.sku}"

    tools = protect([order], ledger, effects={"order": KEYED})
    script = twice(
        tools,
        "order",
        {"line": {"sku": "A1", "quantity": "3"}},
        {"line": {"quantity": 3, "sku": "A1"}},
        "intent-3",
    )

    assert script.results() == {"c1": "3 x A1", "c2": "3 x A1"}
    assert received == [Line(sku="A1", quantity=3)]


def test_the_context_is_left_out_and_partial_params_are_part_of_the_intent(
    ledger: Ledger,
) -> None:
    """The workflow Context the function takes is no part of the intent; the arguments the
    application binds with ``partial_params`` are (two accounts: two intents)."""
    keys: list[str | None] = []

    async def charge(ctx: Context, account: str, amount: int) -> str:
        """Charge an account."""
        assert isinstance(ctx, Context)
        keys.append(current_key())
        return f"{account}: {amount}"

    tools = protect(
        [
            FunctionTool.from_defaults(charge, name="charge", partial_params={"account": "a_1"}),
            FunctionTool.from_defaults(charge, name="refund", partial_params={"account": "a_2"}),
        ],
        ledger,
        effects={"charge": KEYED, "refund": KEYED},
    )
    script = Script(
        [("c1", "charge", {"amount": 5})],
        [("c2", "charge", {"amount": 5})],
        [("c3", "refund", {"amount": 5})],
    )
    run(FunctionAgent(tools=tools, llm=script.llm()), run_id="intent-4")

    assert script.results() == {"c1": "a_1: 5", "c2": "a_1: 5", "c3": "a_2: 5"}
    assert keys == [
        idempotency_key("intent-4", "charge", {"account": "a_1", "amount": 5}),
        idempotency_key("intent-4", "refund", {"account": "a_2", "amount": 5}),
    ]


def test_a_default_made_by_a_factory_is_no_part_of_the_intent(ledger: Ledger) -> None:
    """A request id LlamaIndex makes for each tool from a default factory differs between two
    processes; the model never sent it, and the intent is the same in both."""
    made: list[str] = []

    def send(to: str, request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)) -> str:
        """Send a message."""
        made.append(request_id)
        return f"sent to {to}"

    first = protect([send], ledger, effects={"send": KEYED})  # one process's tool
    second = protect([send], ledger, effects={"send": KEYED})  # another's, made anew
    assert first[0]._field_defaults != second[0]._field_defaults  # type: ignore[attr-defined]
    for tools, call_id in ((first, "c1"), (second, "c2")):
        script = Script([(call_id, "send", {"to": "ann"})])
        # Two runs of the same order (a process's run id is LlamaIndex's to hold): one scope.
        run(FunctionAgent(tools=tools, llm=script.llm()), run_id=f"run-{call_id}", scope="o-5")
        assert script.results() == {call_id: "sent to ann"}
    assert len(made) == 1


def test_arguments_the_schema_refuses_reach_the_function_as_sent(ledger: Ledger) -> None:
    """A value the tool's schema refuses is handed on unchanged, as without twiceshy."""
    received: list[Any] = []

    def charge(amount: int) -> str:
        """Charge."""
        received.append(amount)
        return f"charged {amount!r}"

    tools = protect([charge], ledger, effects={"charge": KEYED})
    script = Script([("c1", "charge", {"amount": "lots"})])
    run(FunctionAgent(tools=tools, llm=script.llm()), run_id="intent-6")
    assert script.results() == {"c1": "charged 'lots'"}
    assert received == ["lots"]
