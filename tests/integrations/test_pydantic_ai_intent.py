"""The Pydantic AI adapter at the edges of real use (issue 12), through real agents.

Each test re-enacts an incident with a scripted ``FunctionModel``: the model calls a tool, the
answer is lost or the call is repeated, and the effect (counted by a provider double) happens
once, while the model reads what happened in twiceshy's words.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import functools
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, ModelRetry, RunContext, ToolFailed
from pydantic_ai.messages import (
    BinaryContent,
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolReturn,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from test_pydantic_ai import CHARGE, Provider, Script, assert_no_retry_words, call, done
from test_pydantic_ai import ledger as ledger  # a fixture: the alias keeps it exported

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Effect, Ledger, ResultNotStorable, State
from twiceshy.integrations.pydantic_ai import TwiceshyCapability

# -- doubles (Script, Provider and the ledger fixture are test_pydantic_ai.py's) -----------


def text_of(result: ToolReturnPart) -> str:
    """What the model read for a tool result, on one line."""
    return " ".join(result.model_response_str().split())


def twice(
    ledger: Ledger, tool: str, args: dict[str, Any], effect: Effect | twiceshy.Guard
) -> tuple[Script, Agent[None, str]]:
    """A model calling ``tool`` with ``args`` twice (ids c1, c2), then done, and its agent, which
    protects ``tool`` as ``effect``; the test adds the tool."""
    script = Script(call(tool, args, "c1"), call(tool, args, "c2"), done())
    agent = Agent(FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {tool: effect})])
    return script, agent


# -- 1. the intent is what the tool receives -----------------------------------------------


class Priority(enum.IntEnum):
    """An enum Pydantic AI accepts by its value sent as text."""

    NORMAL = 1
    URGENT = 2


class Line(BaseModel):
    """A nested model with coercible fields."""

    sku: str
    quantity: int


@dataclass
class Address:
    """A nested dataclass with coercible fields."""

    zip_code: int
    city: str


def _charge_tool(provider: Provider) -> Any:
    """A KEYED-style charge taking the context, its amount positional-only."""

    async def charge(ctx: RunContext[None], amount: int, /, customer: str) -> str:
        return provider.charge(twiceshy.current_key())

    return charge


def _prioritised_tool(provider: Provider) -> Any:
    """A notification with an integer enum."""

    def notify(customer: str, priority: Priority) -> str:
        return provider.charge(twiceshy.current_key())

    return notify


def _order_tool(provider: Provider) -> Any:
    """An order with a nested model and a nested dataclass."""

    def order(line: Line, ship_to: Address) -> str:
        return provider.charge(twiceshy.current_key())

    return order


def _single_model_tool(provider: Provider) -> Any:
    """An order whose one argument is a model (sent unwrapped)."""

    def order(line: Line) -> str:
        return provider.charge(twiceshy.current_key())

    return order


def _fee_tool(provider: Provider) -> Any:
    """A refund with a Decimal default."""

    def refund(amount: int, fee: Decimal = Decimal("0.50")) -> str:
        return provider.charge(twiceshy.current_key())

    return refund


@pytest.mark.parametrize(
    ("make", "first", "second"),
    [
        pytest.param(
            _charge_tool,
            {"amount": "4900", "customer": "cus_1"},
            '{"customer": "cus_1", "amount": 4900}',
            id="number-as-text-another-key-order-context-and-positional-only",
        ),
        pytest.param(
            _prioritised_tool,
            {"customer": "cus_1", "priority": "2"},
            {"priority": 2, "customer": "cus_1"},
            id="enum-by-value-as-text",
        ),
        pytest.param(
            _order_tool,
            {"line": {"sku": "A1", "quantity": "3"}, "ship_to": {"zip_code": "10115", "city": "B"}},
            {"ship_to": {"city": "B", "zip_code": 10115}, "line": {"quantity": 3, "sku": "A1"}},
            id="nested-model-and-dataclass",
        ),
        pytest.param(
            _single_model_tool,
            {"sku": "A1", "quantity": "3"},
            {"quantity": 3, "sku": "A1"},
            id="single-model-argument",
        ),
        pytest.param(
            _fee_tool, {"amount": 4900}, {"amount": 4900, "fee": 0.5}, id="omitted-default"
        ),
    ],
)
def test_spellings_the_tool_receives_alike_name_one_intent(
    ledger: Ledger, make: Any, first: dict[str, Any], second: dict[str, Any] | str
) -> None:
    """Two spellings that Pydantic AI validates to the same arguments: one effect, replayed."""
    provider = Provider()
    tool = make(provider)
    script = Script(call(tool.__name__, first, "c1"), call(tool.__name__, second, "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {tool.__name__: UNSAFE})]
    )
    if tool.__name__ == "charge":  # the one that takes the RunContext
        agent.tool(tool)
    else:
        agent.tool_plain(tool)

    agent.run_sync("go", run_id="run-1")

    assert [r.content for r in script.results(2) + script.results(3)] == ["ch_1", "ch_1"]
    assert provider.effects == 1
    assert len(provider.keys) == 1


def test_the_key_is_made_from_the_arguments_the_tool_receives(ledger: Ledger) -> None:
    """The record's key is that of the validated arguments, the context left out."""
    provider = Provider()
    script = Script(call("charge", {"amount": "4900", "customer": "cus_1"}, "c1"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": KEYED})]
    )
    agent.tool(_charge_tool(provider))

    agent.run_sync("go", run_id="run-1")

    key = twiceshy.idempotency_key("run-1", "charge", CHARGE)
    assert provider.keys == [key]
    snap = ledger.store.get(ledger.namespace, key)
    assert snap.record is not None
    assert snap.record.state is State.SUCCEEDED


def _fresh_id() -> str:
    """A default factory making a new value on every call."""
    return uuid.uuid4().hex


class Message(BaseModel):
    """A nested model with a field a factory makes anew, and one a pure factory makes."""

    body: str
    trace: str = Field(default_factory=_fresh_id)
    tags: list[str] = Field(default_factory=list)


@dataclass
class Note:
    """The same as a dataclass."""

    body: str
    trace: str = field(default_factory=_fresh_id)
    tags: list[str] = field(default_factory=list)


def test_an_argument_a_default_factory_makes_names_no_intent(ledger: Ledger) -> None:
    """A parameter Pydantic AI fills from a default_factory is left out of the key: one effect."""
    sent: list[tuple[str, str]] = []
    script, agent = twice(ledger, "send_sms", {"text": "hi"}, UNSAFE)

    @agent.tool_plain
    def send_sms(text: str, request_id: Annotated[str, Field(default_factory=_fresh_id)]) -> str:
        sent.append((text, request_id))
        raise TimeoutError("the gateway did not answer")

    agent.run_sync("text the customer", run_id="run-1")

    assert [text for text, _ in sent] == ["hi"]
    key = twiceshy.idempotency_key("run-1", "send_sms", {"text": "hi"})
    (first,) = script.results(2)
    (second,) = script.results(3)
    assert text_of(second) == text_of(first)
    assert "outcome is unknown (TimeoutError: the gateway did not answer)" in text_of(first)
    assert f"reference {key[:16]}" in text_of(second)
    assert_no_retry_words(text_of(first))


@pytest.mark.parametrize("kind", [Message, Note], ids=["model", "dataclass"])
def test_a_nested_field_a_default_factory_makes_names_no_intent(
    ledger: Ledger, kind: type[Message] | type[Note]
) -> None:
    """A nested factory field left out is out of the key; a list factory's [] sent or not: one."""
    sent: list[tuple[str, Message | Note]] = []
    script = Script(
        call("send", {"to": "cus_1", "message": {"body": "hi"}}, "c1"),
        call("send", {"to": "cus_1", "message": {"body": "hi", "tags": []}}, "c2"),
        done(),
    )
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"send": UNSAFE})]
    )

    def send(to: str, message: Any) -> str:
        sent.append((to, message))
        raise TimeoutError("the gateway did not answer")

    send.__annotations__ = {"to": str, "message": kind, "return": str}
    agent.tool_plain(send)

    agent.run_sync("send it", run_id="run-1")

    assert len(sent) == 1
    assert isinstance(sent[0][1], kind)
    key = twiceshy.idempotency_key(
        "run-1", "send", {"to": "cus_1", "message": {"body": "hi", "tags": []}}
    )
    (first,) = script.results(2)
    (second,) = script.results(3)
    assert text_of(second) == text_of(first)
    assert f"reference {key[:16]}" in text_of(second)


# -- 2. nested runs: a sub-agent run by a tool ---------------------------------------------


def billing_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The sub-agent's model: it charges, then answers with the charge's id."""
    last = messages[-1]
    results = [p for p in last.parts if isinstance(p, ToolReturnPart)]
    if results:
        return ModelResponse(parts=[TextPart(str(results[0].content))])
    return call("charge", CHARGE, "b1")


def billing_agent(capability: TwiceshyCapability[Any], provider: Provider) -> Agent[None, str]:
    """A sub-agent with an UNSAFE charge: it must never run twice for one outer intent."""
    agent = Agent(FunctionModel(billing_model), capabilities=[capability])

    @agent.tool_plain
    def charge(amount: int, customer: str) -> str:
        return provider.charge(None)  # the provider cannot deduplicate

    return agent


@pytest.mark.parametrize("retried_by", ["model", "twiceshy"])
def test_a_sub_agent_run_again_by_a_retried_tool_charges_once(
    ledger: Ledger, retried_by: str
) -> None:
    """A tool delegating to a sub-agent, retried after the sub-agent charged: one charge per outer
    intent, though each sub-agent run draws a fresh run_id; another outer intent charges anew."""
    provider = Provider()
    billing = billing_agent(TwiceshyCapability(ledger, {"charge": UNSAFE}), provider)
    lost = {"o-1": 2}  # the first two answers of the delegation for o-1 are lost
    if retried_by == "model":
        effect: Effect | twiceshy.Guard = ledger.guard(
            "bill", effect=KEYED, attempts=1, definite=[ToolFailed]
        )
        script = Script(
            *(call("bill", {"order": "o-1"}, f"c{n}") for n in (1, 2, 3)),
            call("bill", {"order": "o-2"}, "c4"),
            done(),
        )
    else:  # KEYED: retried in place with the same key, within one call of the model
        effect = ledger.guard("bill", effect=KEYED, attempts=3, backoff=lambda _: 0.0)
        script = Script(
            call("bill", {"order": "o-1"}, "c1"), call("bill", {"order": "o-2"}, "c2"), done()
        )
    outer = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"bill": effect})]
    )
    runs: list[str] = []

    @outer.tool
    async def bill(ctx: RunContext[None], order: str) -> str:
        result = await billing.run(f"charge order {order}", usage=ctx.usage)
        runs.append(order)
        if lost.get(order):
            lost[order] -= 1
            raise TimeoutError("the billing agent's answer was lost")
        return result.output

    outer.run_sync("bill both orders", run_id="run-1")

    assert runs == ["o-1", "o-1", "o-1", "o-2"]  # the sub-agent ran four times
    assert provider.effects == 2  # once per outer intent
    answers = [r.content for n in range(2, len(script.requests) + 1) for r in script.results(n)]
    assert answers[-2:] == ["ch_1", "ch_2"]


def test_a_delegation_declared_safe_gives_its_sub_agent_the_outer_intent(ledger: Ledger) -> None:
    """A SAFE tool delegating to a sub-agent: two outer intents charge twice; the first one, run
    again in place and called again by the model, does not charge again."""
    provider = Provider()
    billing = billing_agent(TwiceshyCapability(ledger, {"charge": UNSAFE}), provider)
    guard = ledger.guard("bill", effect=SAFE, attempts=2, backoff=lambda _: 0.0)
    script = Script(
        call("bill", {"order": "o-1"}, "c1"),
        call("bill", {"order": "o-2"}, "c2"),
        call("bill", {"order": "o-1"}, "c3"),
        done(),
    )
    outer = Agent(FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"bill": guard})])
    runs: list[str] = []
    lost = {"o-1": 1}  # the first answer of the delegation for o-1 is lost: run again in place

    @outer.tool
    async def bill(ctx: RunContext[None], order: str) -> str:
        result = await billing.run(f"charge order {order}", usage=ctx.usage)
        runs.append(order)
        if lost.get(order):
            lost[order] -= 1
            raise TimeoutError("the billing agent's answer was lost")
        return result.output

    outer.run_sync("bill both orders", run_id="run-1")

    assert runs == ["o-1", "o-1", "o-2", "o-1"]  # the sub-agent ran four times
    assert provider.effects == 2  # once per outer intent
    assert [r.content for n in (2, 3, 4) for r in script.results(n)] == ["ch_1", "ch_2", "ch_1"]
    for order in ("o-1", "o-2"):
        outer_key = twiceshy.idempotency_key("run-1", "bill", {"order": order})
        inner_key = twiceshy.idempotency_key(outer_key, "charge", CHARGE)
        assert ledger.store.get(ledger.namespace, inner_key).record is not None


@pytest.mark.parametrize("given", ["scope-function", "run-inside-the-tool"])
def test_a_scope_the_application_gives_wins_over_the_inherited_one(
    ledger: Ledger, given: str
) -> None:
    """A scope= function of the sub-agent's capability, or a twiceshy.run inside the tool, names
    the sub-agent's intents instead of the scope the outer call passes on."""
    provider = Provider()
    if given == "scope-function":
        capability = TwiceshyCapability(ledger, {"charge": UNSAFE}, scope=lambda ctx: "billing")
    else:
        capability = TwiceshyCapability(ledger, {"charge": UNSAFE})
    billing = billing_agent(capability, provider)
    script = Script(
        call("bill", {"order": "o-1"}, "c1"), call("bill", {"order": "o-2"}, "c2"), done()
    )
    outer = Agent(FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"bill": KEYED})])

    @outer.tool
    async def bill(ctx: RunContext[None], order: str) -> str:
        if given == "scope-function":
            return (await billing.run(f"charge order {order}", usage=ctx.usage)).output
        with twiceshy.run("billing"):
            return (await billing.run(f"charge order {order}", usage=ctx.usage)).output

    outer.run_sync("bill both orders", run_id="run-1")

    # Both outer intents charge under the scope given: one intent, one charge.
    assert provider.effects == 1
    assert [r.content for r in script.results(2) + script.results(3)] == ["ch_1", "ch_1"]
    key = twiceshy.idempotency_key("billing", "charge", CHARGE)
    assert ledger.store.get(ledger.namespace, key).record is not None


# -- 3. results with no JSON form ----------------------------------------------------------


def test_a_return_annotation_with_no_json_form_ends_the_run_before_the_tool_runs(
    ledger: Ledger,
) -> None:
    """An UNSAFE tool declared to return a timedelta: ResultNotStorable ends the run; nothing
    ran. A SAFE tool, whose results are not kept, may return one."""
    ran: list[str] = []
    script = Script(call("locate", {"name": "a"}, "c1"), done(), call("export", {}, "c2"))
    agent = Agent(
        FunctionModel(script),
        capabilities=[TwiceshyCapability(ledger, {"export": UNSAFE, "locate": SAFE})],
    )

    @agent.tool_plain
    def locate(name: str) -> timedelta:
        return timedelta(seconds=len(name))

    @agent.tool_plain
    def export() -> timedelta:
        ran.append("export")
        return timedelta(seconds=5)

    assert agent.run_sync("where is a", run_id="run-1").output == "done"
    assert [r.content for r in script.results(2)] == [timedelta(seconds=1)]
    with pytest.raises(ResultNotStorable, match="'export' is declared to return") as refused:
        agent.run_sync("export", run_id="run-1")
    assert "nothing has run" in str(refused.value)
    assert ran == []
    assert ledger.store.records(ledger.namespace) == []


def test_a_result_with_no_json_form_is_done_and_a_retry_reads_that_it_ran(
    ledger: Ledger,
) -> None:
    """A result that cannot be kept: the first call reads it; the re-call reads that the tool ran
    and was not run again, never a retry request."""
    exported: list[str] = []
    script, agent = twice(ledger, "export", {"table": "orders"}, UNSAFE)

    @agent.tool_plain
    def export(table: str):  # no return annotation: any result
        exported.append(table)
        return timedelta(seconds=len(table))

    agent.run_sync("export the orders", run_id="run-1")

    (first,) = script.results(2)
    (retry,) = script.results(3)
    assert first.content == timedelta(seconds=6)
    assert retry.outcome == "failed"
    text = text_of(retry)
    assert (
        "The tool 'export' already ran for these arguments and succeeded; it was not run again"
        in text
    )
    assert "It read: 0:00:06" in text
    assert_no_retry_words(text)
    assert exported == ["orders"]


# -- 5. a KEYED tool out of attempts -------------------------------------------------------


@pytest.mark.parametrize("how", ["raises", "pydantic-ai-timeout"])
def test_a_keyed_tool_out_of_attempts_reads_that_it_may_have_taken_effect(
    ledger: Ledger, how: str
) -> None:
    """A KEYED charge whose every attempt timed out after charging: the model reads twiceshy's
    words, not the error or a retry request; its later re-call runs with the same key."""
    provider = Provider()
    guard = ledger.guard("charge", effect=KEYED, attempts=2, backoff=lambda _: 0.0)
    script, agent = twice(ledger, "charge", CHARGE, guard)

    @agent.tool_plain(timeout=0.05 if how == "pydantic-ai-timeout" else None)
    async def charge(amount: int, customer: str) -> str:
        charge_id = provider.charge(twiceshy.current_key())
        if len(provider.keys) <= 2:  # both attempts of the first call
            if how == "raises":
                raise TimeoutError("the provider did not answer in time")
            await asyncio.sleep(5)  # past Pydantic AI's timeout, which cancels the tool
        return charge_id

    agent.run_sync("charge", run_id="run-1")

    (exhausted,) = script.results(2)
    assert exhausted.outcome == "failed"
    text = text_of(exhausted)
    last = (
        "TimeoutError: the provider did not answer in time"
        if how == "raises"
        else "TimeoutError: Timed out after 0.05 seconds."
    )
    said = f"The tool 'charge' did not finish on 2 attempts (the last: {last}): it may have"
    assert f"{said} taken effect." in text
    assert "calling it again later with the same arguments is safe and does not repeat it" in text
    assert_no_retry_words(text)
    assert [r.content for r in script.results(3)] == ["ch_1"]
    key = twiceshy.idempotency_key("run-1", "charge", CHARGE)
    assert provider.keys == [key, key, key]
    assert provider.effects == 1


# -- 6. the tool's own error, named --------------------------------------------------------


def test_a_retry_request_made_from_an_error_is_named_by_that_error(ledger: Ledger) -> None:
    """An UNSAFE wire raising ModelRetry from a ConnectionError after sending: the model reads an
    unknown outcome that names the ConnectionError, not Pydantic AI's retry request."""
    sent: list[int] = []
    script, agent = twice(ledger, "wire", {"amount": 120}, UNSAFE)

    @agent.tool_plain
    def wire(amount: int) -> str:
        sent.append(amount)
        try:
            raise ConnectionError("the bank hung up")
        except ConnectionError as exc:
            raise ModelRetry("the bank did not confirm; call again") from exc

    agent.run_sync("pay", run_id="run-1")

    for request in (2, 3):
        (result,) = script.results(request)
        assert result.outcome == "failed"
        text = text_of(result)
        assert "outcome is unknown (ConnectionError: the bank hung up)" in text
        assert_no_retry_words(text)
    assert sent == [120]


# -- 7. a claim left by a crashed process --------------------------------------------------


@pytest.mark.parametrize(
    ("effect", "then"),
    [
        (KEYED, "the next identical call resumes it with the same idempotency key"),
        (UNSAFE, "its outcome becomes unknown and it is not run again by itself"),
    ],
)
def test_a_claim_left_by_a_crashed_process_reads_as_not_confirmed(
    ledger: Ledger, effect: Effect, then: str
) -> None:
    """A record claimed by a process that crashed inside its lease: the model reads when the call
    started, that it may have stopped, and what happens next; the tool does not run."""
    guard = ledger.guard("charge", effect=effect, wait=0.0, definite=[ToolFailed])
    key = guard.key_for(CHARGE, scope="run-1")
    fingerprint = guard.bind(CHARGE).identity(None, "charge")[1]
    claimed = ledger.store.claim(
        ledger.namespace,
        key,
        fingerprint=fingerprint,
        tool="charge",
        effect=effect,
        owner="crashed-process",
        lease=30.0,
    )
    assert claimed.won
    provider = Provider()
    script = Script(call("charge", CHARGE, "c1"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": guard})]
    )

    @agent.tool_plain
    def charge(amount: int, customer: str) -> str:
        return provider.charge(twiceshy.current_key())

    agent.run_sync("charge", run_id="run-1")

    (result,) = script.results(2)
    assert result.outcome == "failed"
    text = text_of(result)
    assert "An identical call of the tool 'charge' started at " in text
    assert "it may still be running, or the process running it may have stopped" in text
    assert "This call did not start it a second time." in text
    assert then in text
    assert "has not been confirmed" in text
    assert "still running;" not in text
    assert_no_retry_words(text)
    assert provider.effects == 0


# -- 8. a replay reads as the first answer did ---------------------------------------------


class Receipt(BaseModel):
    """A pydantic result with an aware datetime."""

    charge_id: str
    at: dt.datetime


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


def _receipt() -> Receipt:
    return Receipt(charge_id="ch_1", at=dt.datetime(2026, 5, 1, 9, 30, tzinfo=dt.UTC))


def _tags():  # no return annotation: the set goes as it is
    return {"vip", "eu", "b2b", 7}


def _booked():
    return dt.datetime(2026, 5, 1, 9, 30)  # naive


def _chart() -> ToolReturn:
    return ToolReturn(
        return_value="the chart is attached",
        content=["the chart:", BinaryContent(data=PNG, media_type="image/png")],
        metadata={"rows": 12},
    )


def _chart_unannotated():
    return _chart()


def _picture():
    return [BinaryContent(data=PNG, media_type="image/png"), "a picture"]


@pytest.mark.parametrize(
    "make",
    [_receipt, _tags, _booked, _chart, _chart_unannotated, _picture],
    ids=["model-utc", "set", "naive-datetime", "tool-return", "tool-return-bare", "binary-list"],
)
def test_a_replay_reads_as_the_first_answer_did(ledger: Ledger, make: Any) -> None:
    """The model reads the same result, and the same content beside it, on the first call and on
    the model's re-call, replayed from the ledger."""
    ran: list[str] = []
    script, agent = twice(ledger, "report", {}, UNSAFE)

    @functools.wraps(make)  # make's return annotation, or none
    def report() -> Any:
        ran.append("report")
        return make()

    agent.tool_plain(name="report")(report)

    agent.run_sync("report", run_id="run-1")

    (first,) = script.results(2)
    (replayed,) = script.results(3)
    assert replayed.model_response_str() == first.model_response_str()
    assert repr(replayed.content) == repr(first.content)
    assert script.prompts(3) == script.prompts(2)
    assert ran == ["report"]


@pytest.mark.parametrize("make", [_chart, _chart_unannotated], ids=["annotated", "bare"])
def test_a_tool_return_reaches_the_model_as_pydantic_ai_reads_it(ledger: Ledger, make: Any) -> None:
    """A ToolReturn's image reaches the model as an image beside the result, its metadata not at
    all, on the first call and on a replay alike."""
    script, agent = twice(ledger, "chart", {}, UNSAFE)
    agent.tool_plain(name="chart")(make)

    agent.run_sync("chart", run_id="run-1")

    for request in (2, 3):
        (result,) = script.results(request)
        assert result.content == "the chart is attached"
        assert "rows" not in result.model_response_str()
        (content,) = script.prompts(request)
        assert content[0] == "the chart:"
        assert isinstance(content[1], BinaryContent)
        assert content[1].data == PNG
        assert content[1].media_type == "image/png"


def test_an_image_returned_as_the_result_reaches_the_model_as_an_image(ledger: Ledger) -> None:
    """A result holding an image: the model gets the image, not its JSON, on a replay too."""
    script, agent = twice(ledger, "picture", {}, UNSAFE)
    agent.tool_plain(name="picture")(_picture)

    agent.run_sync("picture", run_id="run-1")

    for request in (2, 3):
        (result,) = script.results(request)
        image, caption = result.content
        assert isinstance(image, BinaryContent)
        assert image.data == PNG
        assert caption == "a picture"
        assert "iVBOR" not in result.model_response_str()  # no base64 text for the model


def test_content_too_large_to_keep_is_seen_live_and_a_replay_says_it_ran(ledger: Ledger) -> None:
    """An image beyond the ledger's bound: the first call sees it; the re-call reads that the tool
    ran and its result cannot be shown again."""
    ran: list[str] = []
    guard = ledger.guard("chart", effect=UNSAFE, max_result_bytes=64, definite=[ToolFailed])
    script, agent = twice(ledger, "chart", {}, guard)

    @agent.tool_plain
    def chart() -> ToolReturn:
        ran.append("chart")
        return _chart()

    agent.run_sync("chart", run_id="run-1")

    (first,) = script.results(2)
    assert first.content == "the chart is attached"
    (content,) = script.prompts(2)
    assert isinstance(content[1], BinaryContent)
    (retry,) = script.results(3)
    assert retry.outcome == "failed"
    text = text_of(retry)
    assert "already ran for these arguments and succeeded; it was not run again" in text
    assert "cannot be shown again" in text
    assert_no_retry_words(text)
    assert ran == ["chart"]


# -- 9. the point of no return -------------------------------------------------------------


@pytest.mark.parametrize("fails", ["before", "after"])
def test_an_error_before_the_point_of_no_return_releases_the_intent(
    ledger: Ledger, fails: str
) -> None:
    """An UNSAFE wire failing before point_of_no_return(): nothing happened, the re-call runs it;
    failing after: the outcome is unknown, and it is not run again."""
    sent: list[int] = []
    attempts: list[int] = []
    script, agent = twice(ledger, "wire", {"amount": 120}, UNSAFE)

    @agent.tool_plain
    def wire(amount: int) -> str:
        attempts.append(amount)
        if fails == "before" and len(attempts) == 1:
            try:
                raise ConnectionError("the bank is unreachable")
            except ConnectionError as exc:
                raise ModelRetry("the bank is unreachable; nothing was sent") from exc
        twiceshy.point_of_no_return()
        sent.append(amount)
        if fails == "after":
            raise TimeoutError("the bank did not confirm")
        return "sent"

    agent.run_sync("pay", run_id="run-1")

    (first,) = script.results(2)
    (second,) = script.results(3)
    if fails == "before":
        assert first.outcome == "retried"  # nothing happened: Pydantic AI's own retry request
        assert second.content == "sent"
        assert attempts == [120, 120]
    else:
        for result in (first, second):
            assert result.outcome == "failed"
            assert "outcome is unknown (TimeoutError: the bank did not confirm)" in text_of(result)
        assert attempts == [120]
    assert sent == [120]
