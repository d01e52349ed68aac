"""The ``anthropic`` SDK's tool runner with tools protected by ``twiceshy.integrations.
claude_agent_sdk``, through the real ``client.beta.messages.tool_runner`` and a scripted model
answering as the Messages API through the client's transport (scripted_messages_api.py).

The incident, re-enacted: a tool takes effect and its answer is lost (it raises after the
effect, or the request that posts its result fails and the application runs the conversation
again); the model calls the tool again under a new tool-use id - and the effect happens once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from anthropic import beta_async_tool, beta_tool
from pydantic import Field
from scripted_messages_api import MessagesAPI, http, tool_use

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger, idempotency_key
from twiceshy.integrations.claude_agent_sdk import protect

CHARGE = {"amount": 4900, "customer": "cus_1"}
PROMPT = [{"role": "user", "content": "charge the customer"}]


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


class Provider:
    """A payment provider double: deduplicates charges by idempotency key; counts effects."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.charges: dict[str, str] = {}

    def charge(self, key: str | None) -> str:
        """Charge once per key; a repeated key answers the first charge's id."""
        self.keys.append(key)
        if key is None:
            key = f"unkeyed-{len(self.keys)}"
        return self.charges.setdefault(key, f"ch_{len(self.charges) + 1}")

    @property
    def effects(self) -> int:
        """How many charges took effect."""
        return len(self.charges)


def client(api: MessagesAPI) -> anthropic.Anthropic:
    """The anthropic client answered by the scripted model; no retries of its own."""
    web = http.Client(transport=api.transport())
    return anthropic.Anthropic(
        api_key="sk-scripted", base_url="http://api.scripted", http_client=web, max_retries=0
    )


def run(api: MessagesAPI, tools: list[Any], scope: str | None = "order-7") -> Any:
    """Run the tool runner to its end, inside ``twiceshy.run(scope)`` when a scope is given."""
    runner = client(api).beta.messages.tool_runner(
        model="claude-scripted", max_tokens=256, messages=list(PROMPT), tools=tools
    )
    if scope is None:
        return runner.until_done()
    with twiceshy.run(scope):
        return runner.until_done()


def assert_honest(read: tuple[str, bool]) -> None:
    """The honest answer for an unknown outcome, as an error, with no invitation to retry."""
    content, is_error = read
    assert is_error
    assert "outcome is unknown" in content
    assert "will not be run again" in content
    assert "try again" not in content.lower()


def test_an_unsafe_tool_recalled_by_the_model_runs_once(ledger: Ledger) -> None:
    """An UNSAFE tool timed out after its effect; the model re-calls: honest text twice."""
    sent: list[str] = []

    @beta_tool
    def notify(to: str, text: str) -> str:
        """Text the customer."""
        sent.append(text)
        raise TimeoutError("read timed out")

    args = {"to": "+15550100", "text": "Your order shipped"}
    api = MessagesAPI(tool_use("notify", args, "toolu_1"), tool_use("notify", args, "toolu_2"))

    run(api, protect([notify], ledger, effects={"notify": UNSAFE}))

    read = api.results()
    assert_honest(read["toolu_1"])
    assert read["toolu_2"] == read["toolu_1"]
    assert sent == ["Your order shipped"]


def test_a_conversation_run_again_after_its_result_post_failed_charges_once(
    ledger: Ledger,
) -> None:
    """The charge ran, posting its result failed, the application ran the conversation again:
    the model's new call is replayed, one charge."""
    provider = Provider()

    @beta_tool
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(twiceshy.current_key())

    tools = protect([charge], ledger, effects={"charge": KEYED})
    api = MessagesAPI(tool_use("charge", CHARGE, "toolu_1"), 500)
    with pytest.raises(anthropic.InternalServerError):
        run(api, tools)

    again = MessagesAPI(tool_use("charge", CHARGE, "toolu_2"))
    run(again, tools)

    assert api.results() == {"toolu_1": ("ch_1", False)}
    assert again.results() == {"toolu_2": ("ch_1", False)}
    assert provider.keys == [idempotency_key("order-7", "charge", CHARGE)]
    assert provider.effects == 1


def test_an_async_keyed_tool_recalled_by_the_model_keeps_its_key(ledger: Ledger) -> None:
    """An async KEYED charge timed out on its one attempt; the re-call runs it with its key."""
    provider = Provider()
    timeouts = [1]

    @beta_async_tool
    async def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        charge_id = provider.charge(twiceshy.current_key())
        if timeouts[0]:
            timeouts[0] -= 1
            raise TimeoutError("read timed out")
        return charge_id

    guard = ledger.guard("charge", effect=KEYED, attempts=1)
    tools = protect([charge], ledger, effects={"charge": guard})
    api = MessagesAPI(*(tool_use("charge", CHARGE, f"toolu_{n}") for n in (1, 2, 3)))

    async def go() -> Any:
        web = http.AsyncClient(transport=api.transport())
        aclient = anthropic.AsyncAnthropic(
            api_key="sk-scripted", base_url="http://api.scripted", http_client=web, max_retries=0
        )
        runner = aclient.beta.messages.tool_runner(
            model="claude-scripted", max_tokens=256, messages=list(PROMPT), tools=tools
        )
        async with twiceshy.run("order-7"):
            return await runner.until_done()

    asyncio.run(go())

    read = api.results()
    assert read["toolu_1"][1]
    assert "may have taken effect" in read["toolu_1"][0]
    assert "calling it again later with the same arguments is safe" in read["toolu_1"][0]
    assert read["toolu_2"] == read["toolu_3"] == ("ch_1", False)
    key = idempotency_key("order-7", "charge", CHARGE)
    assert provider.keys == [key, key]
    assert provider.effects == 1


def test_a_certain_failure_is_replayed_as_the_tool_reported_it(ledger: Ledger) -> None:
    """A ToolError the tool raised is a certain failure: the re-call reads it, no second run."""
    runs: list[int] = []

    @beta_tool
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        runs.append(amount)
        raise anthropic.lib.tools.ToolError("card declined")

    api = MessagesAPI(tool_use("charge", CHARGE, "toolu_1"), tool_use("charge", CHARGE, "toolu_2"))
    run(api, protect([charge], ledger, effects={"charge": KEYED}))

    assert api.results() == {"toolu_1": ("card declined", True), "toolu_2": ("card declined", True)}
    assert runs == [4900]


def _fresh_id() -> str:
    return uuid.uuid4().hex


def test_the_intent_is_what_the_function_receives(ledger: Ledger) -> None:
    """ "2" for an int, an omitted default, another key order, and a default_factory's value:
    one intent, one effect."""
    received: list[tuple[Any, ...]] = []

    @beta_tool
    def ship(
        qty: int,
        sku: str,
        express: bool = False,
        request_id: str = Field(default_factory=_fresh_id),
    ) -> str:
        """Ship an order; the answer is lost."""
        received.append((qty, sku, express))
        raise TimeoutError("read timed out")

    spellings = [
        {"qty": 2, "sku": "A-1"},
        {"qty": "2", "sku": "A-1"},
        {"express": False, "sku": "A-1", "qty": 2},
    ]
    api = MessagesAPI(*(tool_use("ship", args, f"toolu_{n}") for n, args in enumerate(spellings)))

    run(api, protect([ship], ledger, effects={"ship": UNSAFE}))

    read = api.results()
    assert received == [(2, "A-1", False)]
    key = idempotency_key("order-7", "ship", {"qty": 2, "sku": "A-1", "express": False})
    assert read["toolu_0"] == read["toolu_1"] == read["toolu_2"]
    assert f"reference {key[:16]}" in read["toolu_0"][0]


def test_two_scopes_both_run(ledger: Ledger) -> None:
    """Two runs with their own ids both charge; a SAFE tool needs no scope."""
    provider = Provider()

    @beta_tool
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(twiceshy.current_key())

    @beta_tool
    def lookup(customer: str) -> str:
        """Look a customer up."""
        return f"{customer} is in good standing"

    tools = protect([charge, lookup], ledger, effects={"charge": KEYED, "lookup": SAFE})
    for scope in ("order-1", "order-2"):
        run(MessagesAPI(tool_use("charge", CHARGE, "toolu_1")), tools, scope=scope)
    looked = MessagesAPI(tool_use("lookup", {"customer": "cus_1"}, "toolu_1"))
    run(looked, tools, scope=None)

    assert provider.effects == 2
    assert looked.results() == {"toolu_1": ("cus_1 is in good standing", False)}


def test_a_run_without_scope_does_not_run_the_tool(ledger: Ledger) -> None:
    """No twiceshy.run: the model reads that nothing ran, and nothing is charged."""
    provider = Provider()

    @beta_tool
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(twiceshy.current_key())

    api = MessagesAPI(tool_use("charge", CHARGE, "toolu_1"))
    run(api, protect([charge], ledger, effects={"charge": KEYED}), scope=None)

    content, is_error = api.results()["toolu_1"]
    assert is_error
    assert "did not run" in content
    assert provider.keys == []


def test_protection_is_declared_explicitly(ledger: Ledger) -> None:
    """A tool without an effect class, a stray name or a foreign object is refused at once."""

    @beta_tool
    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return "ch_1"

    with pytest.raises(ValueError, match="no effect class"):
        protect([charge], ledger)
    with pytest.raises(ValueError, match="refund"):
        protect([charge], ledger, effects={"charge": KEYED, "refund": KEYED})
    with pytest.raises(TypeError, match="can be protected"):
        protect([lambda: None], ledger, default=KEYED)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="is named 'refund'"):
        protect([charge], ledger, effects={"charge": ledger.guard("refund", effect=KEYED)})
