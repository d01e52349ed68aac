"""Issue 12 through both MCP servers (the ``mcp`` SDK's ``MCPServer`` and FastMCP), each driven by
its own in-process client: the intent is what the tool receives, a nested agent run inherits the
outer call's scope, and every text the client reads says what is known.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import fastmcp
import mcp
import pytest
from mcp.server.mcpserver import MCPServer
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import twiceshy
from twiceshy.integrations.fastmcp import TwiceshyMiddleware
from twiceshy.integrations.mcp import SCOPE_META_KEY, Effects, protect
from twiceshy.integrations.pydantic_ai import TwiceshyCapability

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run an async test body, bounded in time."""

    async def bounded() -> T:
        return await asyncio.wait_for(main(), 60)

    return asyncio.run(bounded())


@dataclass(frozen=True)
class Answer:
    """What a client read of one ``tools/call``."""

    is_error: bool
    text: str
    content: list[dict[str, Any]]
    structured: Any

    @classmethod
    def read(cls, result: Any) -> Answer:
        """What the client read of a ``CallToolResult`` (the SDK's or FastMCP's)."""
        content = [
            b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content
        ]
        text = "\n".join(getattr(b, "text", "") for b in result.content)
        return cls(result.is_error, text, content, result.structured_content)


def flat(text: str) -> str:
    """A text on one line, as a reader takes it in."""
    return " ".join(text.split())


class Served:
    """One of the two servers, with its own client: tools, twiceshy's middleware, calls."""

    kind = ""

    def tool(self, fn: Callable[..., Any]) -> None:
        """Register ``fn`` as a tool (no annotations)."""
        raise NotImplementedError

    def protect(self, ledger: twiceshy.Ledger, effects: Effects | None = None) -> None:
        """Add twiceshy's middleware."""
        raise NotImplementedError

    async def calls(self, *calls: tuple[str, dict[str, Any], str]) -> list[Answer]:
        """Make each ``(tool, arguments, scope)`` call in turn through one client."""
        raise NotImplementedError


class SDK(Served):
    """``mcp.server.mcpserver.MCPServer`` and ``mcp.Client``."""

    kind = "mcp"

    def __init__(self) -> None:
        self.server: MCPServer[Any] = MCPServer("app")

    def tool(self, fn: Callable[..., Any]) -> None:
        self.server.tool()(fn)

    def protect(self, ledger: twiceshy.Ledger, effects: Effects | None = None) -> None:
        protect(self.server, ledger, effects=effects)

    async def calls(self, *calls: tuple[str, dict[str, Any], str]) -> list[Answer]:
        answers = []
        async with mcp.Client(self.server) as client:
            for name, args, scope in calls:
                result = await client.call_tool(name, args, meta={SCOPE_META_KEY: scope})
                answers.append(Answer.read(result))
        return answers


class Fast(Served):
    """``fastmcp.FastMCP`` and ``fastmcp.Client``."""

    kind = "fastmcp"

    def __init__(self) -> None:
        self.server = fastmcp.FastMCP("app")

    def tool(self, fn: Callable[..., Any]) -> None:
        self.server.tool(fn)

    def protect(self, ledger: twiceshy.Ledger, effects: Effects | None = None) -> None:
        self.server.add_middleware(TwiceshyMiddleware(ledger, effects=effects))

    async def calls(self, *calls: tuple[str, dict[str, Any], str]) -> list[Answer]:
        answers = []
        async with fastmcp.Client(self.server) as client:
            for name, args, scope in calls:
                result = await client.call_tool(
                    name, args, meta={SCOPE_META_KEY: scope}, raise_on_error=False
                )
                answers.append(Answer.read(result))
        return answers


@pytest.fixture(params=[SDK, Fast], ids=["mcp", "fastmcp"])
def served(request: pytest.FixtureRequest) -> Served:
    made: Served = request.param()
    return made


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    with twiceshy.Ledger("sqlite:///" + str(tmp_path / "ledger.db")) as opened:
        yield opened


class Provider:
    """A payment provider double: deduplicates charges by idempotency key, counts effects."""

    def __init__(self) -> None:
        self.charges: dict[str, int] = {}
        self.keys_seen: list[str | None] = []

    def charge(self, amount: int) -> str:
        """Charge once per key (the key of the protected call running now)."""
        key = twiceshy.current_key()
        self.keys_seen.append(key)
        assert key is not None, "a KEYED tool must hand the provider a key"
        self.charges.setdefault(key, amount)
        return f"charge {list(self.charges).index(key) + 1}: {self.charges[key]}"


def assert_honest_words(text: str) -> None:
    """No text twiceshy gives invites a blind retry or names an internal class."""
    assert "try again" not in text.lower()
    assert "cancel scope" not in text  # anyio's cancellation message, with a task's repr
    assert "<Task" not in text
    assert " _" not in text  # no private class named
    assert "(_" not in text


# -- 1. the intent is what the tool receives ---------------------------------------------------


class Currency(enum.Enum):
    """A currency, sent by its value."""

    EUR = "eur"
    USD = "usd"


class Priority(enum.IntEnum):
    """A priority, sent as a number (or its text, which the servers coerce)."""

    NORMAL = 1
    URGENT = 2


class Address(BaseModel):
    """A nested model whose ``zip`` a client may send as text."""

    street: str
    zip: int


def test_what_the_tool_receives_names_the_intent(served: Served, ledger: twiceshy.Ledger) -> None:
    """ "5" for 5, an omitted default, another key order, an enum's text, a nested model's
    coercible field: each the same intent on the server, one charge with one key."""
    provider = Provider()

    def create_charge(
        amount: int,
        currency: Currency = Currency.EUR,
        priority: Priority = Priority.NORMAL,
        billing: Address | None = None,
    ) -> str:
        """Charge a card."""
        return provider.charge(amount)

    served.tool(create_charge)
    served.protect(ledger, {"create_charge": twiceshy.KEYED})
    plain = [
        {"amount": 5},
        {"amount": "5"},  # a number sent as text
        {"amount": 5, "currency": "eur"},  # the default, sent
        {"currency": "eur", "amount": 5.0, "priority": 1},  # another order, 5.0, the default
        {"amount": 5, "priority": "1"},  # the enum sent as text, which the server accepts
    ]
    nested = [
        {"amount": 7, "billing": {"street": "Unter den Linden 1", "zip": "10117"}},
        {"billing": {"zip": 10117, "street": "Unter den Linden 1"}, "amount": "7"},
    ]
    answers = run(
        lambda: served.calls(*[("create_charge", args, "run-1") for args in plain + nested])
    )
    assert [a.text for a in answers] == ["charge 1: 5"] * len(plain) + ["charge 2: 7"] * 2
    assert len(provider.keys_seen) == 2  # every other call was a replay
    assert len(set(provider.keys_seen)) == 2


def test_arguments_the_server_refuses_run_nothing(served: Served, ledger: twiceshy.Ledger) -> None:
    """A value the server's validation refuses gets the server's own error; nothing ran, and the
    corrected call runs once."""
    provider = Provider()

    def create_charge(amount: int, currency: Currency = Currency.EUR) -> str:
        """Charge a card."""
        return provider.charge(amount)

    served.tool(create_charge)
    served.protect(ledger, {"create_charge": twiceshy.KEYED})
    bad, again, good = run(
        lambda: served.calls(
            ("create_charge", {"amount": 5, "currency": "EUR"}, "run-1"),  # the name: refused
            ("create_charge", {"amount": 5, "currency": "EUR"}, "run-1"),
            ("create_charge", {"amount": 5, "currency": "eur"}, "run-1"),
        )
    )
    for refused in (bad, again):
        assert refused.is_error
        assert "validation error" in refused.text
        assert "outcome is unknown" not in refused.text
    assert good.text == "charge 1: 5"
    assert len(provider.keys_seen) == 1


class Sender(BaseModel):
    """A nested model with a trace id its factory makes anew."""

    name: str
    trace_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


def test_what_a_default_factory_made_is_no_part_of_the_intent(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """A fresh request id and a nested trace id, made for what the client left out: one SMS."""
    sent: list[str] = []

    def send_sms(
        text: str,
        sender: Sender,
        request_id: Annotated[str, Field(default_factory=lambda: uuid.uuid4().hex)],
        tags: Annotated[list[str], Field(default_factory=list)],
    ) -> str:
        """Send an SMS; the gateway's answer is lost after it went."""
        sent.append(text)
        raise TimeoutError("the SMS gateway did not answer in time")

    served.tool(send_sms)
    served.protect(ledger, {"send_sms": twiceshy.UNSAFE})
    sms = {"text": "hi", "sender": {"name": "shop"}}
    answers = run(
        lambda: served.calls(
            ("send_sms", sms, "run-1"),
            ("send_sms", sms, "run-1"),
            ("send_sms", {**sms, "tags": []}, "run-1"),  # a factory default that is always equal
        )
    )
    for answer in answers:
        text = flat(answer.text)
        assert answer.is_error
        # FastMCP names the tool's own error; the SDK gives only its "Error executing tool".
        assert text.startswith("The tool 'send_sms' was started but its outcome is unknown (")
        assert (
            "): it may or may not have taken effect. It will not be run again for these arguments"
        ) in text
        assert_honest_words(text)
    assert sent == ["hi"]
    assert len(ledger.store.records("")) == 1


def test_a_validation_error_the_fastmcp_tool_raises_itself_is_its_own(
    ledger: twiceshy.Ledger,
) -> None:
    """FastMCP's ValidationError raised by a tool after its refund is no refusal: one refund."""
    served = Fast()
    refunds: list[str] = []

    def refund(order: str, amount: int) -> str:
        """Refund an order; the receipt lookup after it fails with FastMCP's own error."""
        refunds.append(order)
        raise fastmcp.exceptions.ValidationError("no receipt found after the refund")

    served.tool(refund)
    served.protect(ledger, {"refund": twiceshy.UNSAFE})
    refused, lost, again = run(
        lambda: served.calls(
            ("refund", {"order": "o-1", "amount": "ten"}, "run-1"),  # FastMCP refuses it
            ("refund", {"order": "o-1", "amount": 10}, "run-1"),
            ("refund", {"order": "o-1", "amount": "10"}, "run-1"),  # the same intent
        )
    )
    assert refunds == ["o-1"]
    assert refused.is_error
    assert "outcome is unknown" not in refused.text
    for answer in (lost, again):
        text = flat(answer.text)
        assert answer.is_error
        assert text.startswith(
            "The tool 'refund' was started but its outcome is unknown (ValidationError: no "
            "receipt found after the refund): it may or may not have taken effect. It will not "
            "be run again for these arguments"
        )
        assert_honest_words(text)


# -- 2. a nested agent run inherits the scope of the MCP call ----------------------------------


def test_an_agent_run_inside_a_tool_inherits_the_calls_scope(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """An MCP tool runs a Pydantic AI agent whose UNSAFE tool takes effect, and then times out:
    its retry in place and the client's repeats run no second inner effect; another outer intent
    runs its own."""
    notified: list[str] = []
    outer_runs: list[str] = []

    def notify_team(message: str) -> str:
        """The inner tool: posts a message (no idempotency key: UNSAFE)."""
        notified.append(message)
        return f"posted {len(notified)}"

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        """Call notify_team once, then answer with what it returned."""
        last = messages[-1]
        returned = [
            p.content
            for p in (last.parts if isinstance(last, ModelRequest) else [])
            if isinstance(p, ToolReturnPart)
        ]
        if returned:
            return ModelResponse(parts=[TextPart(f"team told ({returned[0]})")])
        return ModelResponse(parts=[ToolCallPart("notify_team", {"message": "trip planned"})])

    async def plan_trip(city: str) -> str:
        """The outer tool: an agent plans the trip; the booking system then times out once."""
        agent = Agent(
            FunctionModel(script),
            tools=[notify_team],
            capabilities=[TwiceshyCapability(ledger, {"notify_team": twiceshy.UNSAFE})],
        )
        # A fresh run id on every run: the scope inherited from the MCP call is what counts.
        result = await agent.run(f"plan a trip to {city}", run_id=uuid.uuid4().hex)
        outer_runs.append(city)
        if len(outer_runs) == 1:
            raise TimeoutError("the booking system did not answer in time")
        return f"{city}: {result.output}"

    served.tool(plan_trip)
    served.protect(ledger, {"plan_trip": twiceshy.KEYED})
    answers = run(
        lambda: served.calls(
            *[("plan_trip", {"city": "Lisbon"}, "run-1") for _ in "123"],
            ("plan_trip", {"city": "Porto"}, "run-1"),
        )
    )
    assert [a.text for a in answers] == ["Lisbon: team told (posted 1)"] * 3 + [
        "Porto: team told (posted 2)"
    ]
    assert outer_runs == ["Lisbon", "Lisbon", "Porto"]  # one retry in place, then replays
    assert notified == ["trip planned", "trip planned"]  # one inner effect per outer intent


# -- 3. a result that cannot be kept -----------------------------------------------------------


def test_a_result_too_large_to_keep_is_never_a_failure(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """The first caller reads the result; a repeat reads that it ran and succeeded, nothing
    inviting a retry, and the export ran once."""
    exports: list[str] = []

    def export(report: str) -> str:
        """Export a report (a large answer)."""
        exports.append(report)
        return "row;" * 2000

    served.tool(export)
    guard = ledger.guard("export", effect=twiceshy.UNSAFE, max_result_bytes=1000)
    served.protect(ledger, {"export": guard})
    first, second = run(
        lambda: served.calls(*[("export", {"report": "q3"}, "run-1") for _ in "12"])
    )
    assert not first.is_error
    assert first.text == "row;" * 2000
    text = flat(second.text)
    assert second.is_error  # no structured result to give: an error result, which says it ran
    assert text.startswith(
        "The tool 'export' already ran for these arguments and succeeded; it was not run again."
    )
    assert "could not be kept" in text
    assert_honest_words(text)
    assert exports == ["q3"]


# -- 5. a KEYED tool out of attempts -----------------------------------------------------------


def test_a_keyed_tool_out_of_attempts_reads_twiceshys_words(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """The charge lands and every attempt times out: the client reads that it may have taken
    effect and that an identical call is safe; that call later gets the one charge."""
    provider = Provider()
    outage = [True]

    def create_charge(amount: int) -> str:
        """Charge a card; the gateway times out while the outage lasts."""
        charge = provider.charge(amount)
        if outage:
            raise TimeoutError("the payment gateway did not answer in time")
        return charge

    served.tool(create_charge)
    guard = ledger.guard("create_charge", effect=twiceshy.KEYED, attempts=2, backoff=lambda n: 0)
    served.protect(ledger, {"create_charge": guard})

    async def main() -> list[Answer]:
        first = await served.calls(("create_charge", {"amount": 5}, "run-1"))
        outage.clear()
        return first + await served.calls(("create_charge", {"amount": 5}, "run-1"))

    failed, later = run(main)
    text = flat(failed.text)
    assert failed.is_error
    assert text.startswith("The tool 'create_charge' did not finish on 2 attempts (the last: ")
    assert "it may have taken effect" in text
    assert "calling it again later with the same arguments is safe and does not repeat it" in text
    assert not text.startswith("Error executing tool")
    assert "please retry" not in text.lower()
    assert_honest_words(text)
    assert later.text == "charge 1: 5"
    assert len(provider.charges) == 1
    assert len(set(provider.keys_seen)) == 1
    assert len(provider.keys_seen) == 3  # two attempts, then the later call, all one key


# -- 7. a claim left by a process that stopped inside its lease --------------------------------


@pytest.mark.parametrize(
    ("effect", "then"),
    [
        (twiceshy.KEYED, "the next identical call resumes it with the same idempotency key"),
        (twiceshy.UNSAFE, "its outcome becomes unknown and it is not run again by itself"),
    ],
    ids=["keyed", "unsafe"],
)
def test_a_claim_left_inside_its_lease_reads_what_is_known(
    served: Served, ledger: twiceshy.Ledger, effect: twiceshy.Effect, then: str
) -> None:
    """Another server process claimed the intent and stopped: the client reads when it started,
    that it may have stopped, and what happens at lapse; never "still running"."""
    booked: list[str] = []

    def book_room(room: str, nights: int = 1) -> str:
        """Book a room."""
        booked.append(room)
        return "booked"

    served.tool(book_room)
    guard = ledger.guard("book_room", effect=effect, wait=0.0)
    served.protect(ledger, {"book_room": guard})
    received = {"room": "101", "nights": 1}  # what the tool would receive
    key = guard.key_for(received, scope="run-1")
    fingerprint = guard.bind(received).identity(None, "book_room")[1]
    claimed = ledger.store.claim(
        ledger.namespace,
        key,
        fingerprint=fingerprint,
        tool="book_room",
        effect=effect,
        owner="a-server-that-stopped",
        lease=600.0,
    )
    assert claimed.won
    (answer,) = run(lambda: served.calls(("book_room", {"room": "101"}, "run-1")))
    text = flat(answer.text)
    assert answer.is_error
    assert "An identical call of the tool 'book_room' started at " in text
    assert "has not recorded an outcome" in text
    assert "it may still be running, or the process running it may have stopped" in text
    assert "If it records none by " in text
    assert then in text
    assert "This call did not start it a second time" in text
    assert "still running" not in text
    assert_honest_words(text)
    assert booked == []


# -- 8. a replay reads as the first answer did -------------------------------------------------


class Booking(BaseModel):
    """A result with what a round trip through JSON changes in Python."""

    at: datetime
    local: datetime
    tags: set[str]


def test_a_replay_carries_the_first_answers_content(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """A model with an aware (UTC) and a naive datetime and a set: the replay's content and
    structuredContent are the first answer's, to the character."""
    made: list[str] = []

    def book(room: str) -> Booking:
        """Book a room."""
        made.append(room)
        return Booking(
            at=datetime(2026, 7, 28, 14, 0, tzinfo=UTC),
            local=datetime(2026, 7, 28, 16, 0),
            tags={"sea-view", "quiet", "late-checkin", "balcony"},
        )

    served.tool(book)
    served.protect(ledger)  # undeclared: UNSAFE
    first, second = run(lambda: served.calls(*[("book", {"room": "101"}, "run-1") for _ in "12"]))
    assert not first.is_error
    assert second.content == first.content
    assert second.structured == first.structured
    assert first.structured["at"] in ("2026-07-28T14:00:00Z", "2026-07-28T14:00:00+00:00")
    assert first.structured["local"] == "2026-07-28T16:00:00"
    assert made == ["101"]


# -- 9. point_of_no_return inside an MCP tool --------------------------------------------------


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "by-annotations"])
def test_an_error_before_the_point_of_no_return_lets_the_next_call_run(
    served: Served, ledger: twiceshy.Ledger, declared: bool
) -> None:
    """An UNSAFE tool that fails before its point of no return did nothing: the next call runs
    it, and a repeat replays; one mail."""
    outage = ["the mail server refused the connection"]
    sent: list[str] = []

    def send_mail(to: str) -> str:
        """Send a mail: connect first (nothing sent yet), then send."""
        if outage:
            raise ConnectionError(outage.pop())
        twiceshy.point_of_no_return()
        sent.append(to)
        return f"sent to {to}"

    served.tool(send_mail)
    served.protect(ledger, {"send_mail": twiceshy.UNSAFE} if declared else None)
    failed, ran, again = run(
        lambda: served.calls(*[("send_mail", {"to": "ada@example.com"}, "run-1") for _ in "123"])
    )
    assert failed.is_error
    assert "outcome is unknown" not in failed.text
    assert ran.text == again.text == "sent to ada@example.com"
    assert sent == ["ada@example.com"]


def test_an_error_after_the_point_of_no_return_is_an_unknown_outcome(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """Past its point of no return, a timeout may follow the effect: both calls read the
    honest text, and the mail went once."""
    sent: list[str] = []

    def send_mail(to: str) -> str:
        """Send a mail; the server times out after it went."""
        twiceshy.point_of_no_return()
        sent.append(to)
        raise TimeoutError("the mail server did not answer in time")

    served.tool(send_mail)
    served.protect(ledger)
    answers = run(
        lambda: served.calls(*[("send_mail", {"to": "ada@example.com"}, "run-1") for _ in "12"])
    )
    for answer in answers:
        text = flat(answer.text)
        assert answer.is_error
        assert "may or may not have taken effect" in text
        assert "It will not be run again for these arguments" in text
        assert_honest_words(text)
    assert sent == ["ada@example.com"]


# -- 6. no internal names in what the client reads ---------------------------------------------


def test_a_call_cancelled_while_it_ran_is_told_without_anyios_repr(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """The client gives up on a call while the tool runs: the next identical call reads that the
    request was cancelled, never a cancel scope's task repr, and the tool is not run again."""
    started: list[str] = []

    async def send_mail(to: str) -> str:
        """Send a mail (its server never answers)."""
        started.append(to)
        await asyncio.Event().wait()
        return "sent"

    served.tool(send_mail)
    served.protect(ledger)

    async def main() -> list[Answer]:
        call = asyncio.ensure_future(served.calls(("send_mail", {"to": "ada@example.com"}, "r")))
        while not started:
            await asyncio.sleep(0.01)
        call.cancel()  # the client's task gives up: its client cancels the request
        with pytest.raises(asyncio.CancelledError):
            await call
        return await served.calls(("send_mail", {"to": "ada@example.com"}, "r"))

    (answer,) = run(main)
    text = flat(answer.text)
    assert answer.is_error
    assert "may or may not have taken effect" in text
    assert "(interrupted by CancelledError before it finished)" in text
    assert_honest_words(text)
    assert started == ["ada@example.com"]


def test_a_naive_datetime_is_refused_before_anything_runs(
    served: Served, ledger: twiceshy.Ledger
) -> None:
    """A time without an offset names no instant: the client reads why, nothing runs; the same
    time with its offset runs once."""
    reminded: list[datetime] = []

    def remind(when: datetime) -> str:
        """Schedule a reminder."""
        reminded.append(when)
        return "scheduled"

    served.tool(remind)
    served.protect(ledger)
    naive, aware, again = run(
        lambda: served.calls(
            ("remind", {"when": "2026-07-28T10:00:00"}, "run-1"),
            ("remind", {"when": "2026-07-28T10:00:00+02:00"}, "run-1"),
            ("remind", {"when": "2026-07-28T08:00:00Z"}, "run-1"),  # the same instant
        )
    )
    assert naive.is_error
    assert naive.text.startswith("args.when: a naive datetime names no instant")
    assert aware.text == again.text == "scheduled"
    assert len(reminded) == 1
