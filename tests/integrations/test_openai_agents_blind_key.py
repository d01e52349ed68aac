"""A KEYED tool that never hands its key on, through the real ``Runner`` and a scripted model:
twiceshy does not repeat the charge its provider cannot recognise (docs/design.md §4)."""

from __future__ import annotations

from typing import Any

from agents import Agent, function_tool
from test_openai_agents import calls, received, run, script
from test_openai_agents import ledger as ledger  # fixtures: the aliases keep them exported
from test_openai_agents import offline as offline  # autouse: no network, no tracing

import twiceshy
from twiceshy.integrations.openai_agents import protect
from twiceshy.testing import FakeProvider

ORDER = {"amount": 4900, "customer": "cus_1"}


def charge_tool(provider: FakeProvider, *, hands_key: bool) -> Any:
    """``charge(amount, customer)``, handing the provider its key or not."""

    @function_tool
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        key = twiceshy.current_key() if hands_key else None
        return str(provider.charge(amount, customer, idempotency_key=key)["id"])

    return charge


def test_a_keyed_tool_blind_to_its_key_charges_once_and_says_the_outcome_is_unknown(
    ledger: twiceshy.Ledger,
) -> None:
    """Its answers lost, the charge is sent once (not once per attempt), and both the call and
    the model's re-call read that the outcome is unknown and must be checked."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=5)
    tools = protect(
        [charge_tool(provider, hands_key=False)], ledger, effects={"charge": twiceshy.KEYED}
    )
    model = script(calls("c1", name="charge", args=ORDER), calls("c2", name="charge", args=ORDER))
    run(Agent(name="billing", model=model, tools=tools), group_id="order-1")

    answers = received(model)
    assert len(provider.requests) == 1
    assert len(provider.effects) == 1
    for call in ("c1", "c2"):
        assert "outcome is unknown" in answers[call]
        assert "Do not call it again" in answers[call]
    assert "its idempotency key was not handed to the provider" in answers["c1"]


def test_the_same_tool_handing_its_key_on_is_retried_and_charges_once(
    ledger: twiceshy.Ledger,
) -> None:
    """Handing ``current_key()`` to the provider, the lost answers are retried in place with
    the key, the provider applies one charge, and the model reads it on both calls."""
    provider = FakeProvider(deduplicate=True)
    provider.lose_answers(times=2)
    tools = protect(
        [charge_tool(provider, hands_key=True)], ledger, effects={"charge": twiceshy.KEYED}
    )
    model = script(calls("c1", name="charge", args=ORDER), calls("c2", name="charge", args=ORDER))
    run(Agent(name="billing", model=model, tools=tools), group_id="order-1")

    assert received(model) == {"c1": "ch_1", "c2": "ch_1"}
    assert len(provider.requests) == 3
    assert len(provider.effects) == 1
