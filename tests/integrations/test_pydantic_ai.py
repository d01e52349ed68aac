"""The Pydantic AI adapter, through real agents driven by a scripted ``FunctionModel``.

The incident, re-enacted: a tool takes effect and then times out; Pydantic AI (its ``timeout=``
turns that into a retry request), the model (calling again with a new tool-call id) or the
application (running the agent again with the same ``run_id``) retries it - and the effect
happens once.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version
from pydantic_ai import Agent, ModelRetry, RunContext, ToolFailed
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturn,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import twiceshy
from twiceshy import KEYED, SAFE, UNSAFE, Ledger, MissingScope, State, idempotency_key
from twiceshy.integrations.pydantic_ai import EffectNotDeclared, TwiceshyCapability

CHARGE = {"amount": 4900, "customer": "cus_1"}
WIRE = {"amount": 120, "iban": "DE89370400440532013000"}
# Pydantic AI 2.60 answers a tool's ModelRetry with a ToolReturnPart whose outcome is "retried";
# before, with a RetryPromptPart. The tests read the former, built from the latter before 2.60.
RETRIES_AS_RETURNS = Version(metadata.version("pydantic-ai-slim")) >= Version("2.60")


# -- doubles -------------------------------------------------------------------------------


class Script:
    """A scripted model: its n-th request gets the n-th answer; it keeps every request.

    An answer that is an exception is raised instead (the model's API failing).
    """

    __name__ = "script"  # FunctionModel names itself after its function (before 2.6x it must)

    def __init__(self, *answers: ModelResponse | Exception) -> None:
        self._answers = list(answers)
        self.requests: list[list[ModelMessage]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(list(messages))
        if len(self.requests) > len(self._answers):
            raise AssertionError("the model was asked more often than scripted")
        answer = self._answers[len(self.requests) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def results(self, request: int) -> list[ToolReturnPart]:
        """The tool results the model received in its ``request``-th request (from 1)."""
        parts = self._last(request).parts
        return [
            _as_return(part) for part in parts if isinstance(part, ToolReturnPart | RetryPromptPart)
        ]

    def prompts(self, request: int) -> list[Any]:
        """The user content that came with the tool results of the ``request``-th request."""
        parts = self._last(request).parts
        return [part.content for part in parts if isinstance(part, UserPromptPart)]

    def _last(self, request: int) -> ModelRequest:
        last = self.requests[request - 1][-1]
        assert isinstance(last, ModelRequest)
        return last


def _as_return(part: ToolReturnPart | RetryPromptPart) -> ToolReturnPart:
    """A tool's result as Pydantic AI 2.60 and later words it (a retry as a "retried" outcome)."""
    if isinstance(part, ToolReturnPart):
        return part
    assert not RETRIES_AS_RETURNS, f"a RetryPromptPart from Pydantic AI 2.60 or later: {part}"
    return ToolReturnPart(
        tool_name=part.tool_name or "",
        content=part.model_response(),
        tool_call_id=part.tool_call_id,
        outcome="retried",
    )


def call(tool: str, args: dict[str, Any] | str, *ids: str) -> ModelResponse:
    """A model response calling ``tool`` with ``args`` (a mapping, or JSON text), once per id."""
    return ModelResponse(
        parts=[
            ToolCallPart(tool, args if isinstance(args, str) else dict(args), tool_call_id=i)
            for i in ids
        ]
    )


def done() -> ModelResponse:
    """The model's final answer."""
    return ModelResponse(parts=[TextPart("done")])


class Provider:
    """A payment provider double: deduplicates charges by idempotency key; counts effects."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.charges: dict[str, str] = {}
        self.effects = 0

    def charge(self, key: str | None) -> str:
        """Charge once per key; a repeated key answers the first charge's id."""
        self.keys.append(key)
        if key is not None and key in self.charges:
            return self.charges[key]
        self.effects += 1
        charge_id = f"ch_{self.effects}"
        if key is not None:
            self.charges[key] = charge_id
        return charge_id


def assert_honest(result: ToolReturnPart) -> None:
    """The model read twiceshy's honest failure: no retry request, no invitation to retry, no
    internal names."""
    text = result.model_response_str()
    assert result.outcome == "failed", result
    assert "outcome is unknown" in text
    assert "may or may not have taken effect" in text
    assert "will not be run again" in text
    assert_no_retry_words(text)


def assert_no_retry_words(text: str) -> None:
    """No invitation to a blind retry, no internal names."""
    assert "try again" not in text.lower()
    for internal in ("ToolRetryError", "ModelRetry", "Retry", "CancelledError", "_Wrapped"):
        assert internal not in text


def record(ledger: Ledger, scope: str, tool: str, args: dict[str, Any]) -> twiceshy.Record:
    """The ledger's record of an intent."""
    snap = ledger.store.get(ledger.namespace, idempotency_key(scope, tool, args))
    assert snap.record is not None
    return snap.record


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


# -- the incident ------------------------------------------------------------------------


def test_keyed_charge_timed_out_by_pydantic_ai_reaches_the_provider_with_one_key(
    ledger: Ledger,
) -> None:
    """A KEYED charge that took effect and hit Pydantic AI's timeout: the re-call reuses its key."""
    provider = Provider()
    guard = ledger.guard("charge", effect=KEYED, attempts=1, definite=[ToolFailed])
    script = Script(
        call("charge", CHARGE, "c1"),
        call("charge", CHARGE, "c2"),
        call("charge", CHARGE, "c3"),
        done(),
    )
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": guard})]
    )

    @agent.tool_plain(timeout=0.05)
    async def charge(amount: int, customer: str) -> str:
        charge_id = provider.charge(twiceshy.current_key())
        if len(provider.keys) == 1:
            await asyncio.sleep(5)  # the provider answers after Pydantic AI gave up
        return charge_id

    agent.run_sync("charge the customer", run_id="run-1")

    (timed_out,) = script.results(2)
    # Not Pydantic AI's retry request: twiceshy's words, which ask for no blind retry.
    assert timed_out.outcome == "failed"
    text = timed_out.model_response_str()
    assert "(the last: TimeoutError: Timed out after 0.05 seconds.)" in text
    assert "may have taken effect" in text
    assert "calling it again later with the same arguments is safe" in text
    assert "Retry" not in text
    assert "try again" not in text.lower()
    assert [r.content for r in script.results(3) + script.results(4)] == ["ch_1", "ch_1"]
    key = idempotency_key("run-1", "charge", CHARGE)
    assert provider.keys == [key, key]  # the third call was replayed from the ledger
    assert provider.effects == 1


def test_keyed_charge_that_raised_timeout_is_retried_in_place_and_replayed(
    ledger: Ledger,
) -> None:
    """A sync KEYED charge that raised TimeoutError after charging: one charge, one key."""
    provider = Provider()
    script = Script(call("charge", CHARGE, "c1"), call("charge", CHARGE, "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": KEYED})]
    )

    @agent.tool_plain
    def charge(amount: int, customer: str) -> str:
        charge_id = provider.charge(twiceshy.current_key())
        if len(provider.keys) == 1:
            raise TimeoutError("the provider did not answer in time")
        return charge_id

    agent.run_sync("charge the customer", run_id="run-1")

    assert [r.content for r in script.results(2) + script.results(3)] == ["ch_1", "ch_1"]
    assert all(r.outcome == "success" for r in script.results(2) + script.results(3))
    key = idempotency_key("run-1", "charge", CHARGE)
    assert provider.keys == [key, key]  # twiceshy's own retry; the model's re-call was replayed
    assert provider.effects == 1


@pytest.mark.parametrize(
    "framework_timeout", [True, False], ids=["pydantic-ai-timeout", "tool-raises-timeout"]
)
def test_unsafe_wire_that_timed_out_is_not_rerun_and_the_model_is_told(
    ledger: Ledger, framework_timeout: bool
) -> None:
    """An UNSAFE wire that took effect then timed out: the model reads the honest failure twice."""
    sent: list[dict[str, Any]] = []
    script = Script(call("wire", WIRE, "c1"), call("wire", WIRE, "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )

    @agent.tool_plain(timeout=0.05 if framework_timeout else None)
    async def wire(amount: int, iban: str) -> str:
        sent.append({"amount": amount, "iban": iban})
        if framework_timeout:
            await asyncio.sleep(5)  # Pydantic AI's timeout fires: it would ask for a retry
        else:
            raise TimeoutError("the bank did not answer in time")
        return "sent"

    assert agent.run_sync("pay the invoice", run_id="run-1").output == "done"

    (first,) = script.results(2)
    (second,) = script.results(3)
    assert_honest(first)
    assert_honest(second)
    # The reason names the tool's own error, not Pydantic AI's retry request made from it.
    reason = (
        "(TimeoutError: Timed out after 0.05 seconds.)"
        if framework_timeout
        else "(TimeoutError: the bank did not answer in time)"
    )
    assert reason in first.model_response_str()
    assert first.tool_call_id == "c1"
    assert second.tool_call_id == "c2"
    assert len(sent) == 1
    assert record(ledger, "run-1", "wire", WIRE).state is State.UNKNOWN


def test_a_call_still_running_elsewhere_is_reported_as_in_progress(tmp_path: Path) -> None:
    """A duplicate while the first call still runs in another process reads InProgress."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    started, release = threading.Event(), threading.Event()
    sent: list[str] = []

    def wire(amount: int, iban: str) -> str:
        sent.append(iban)
        started.set()
        release.wait(5)
        return "sent"

    with Ledger(url) as first_ledger, Ledger(url) as second_ledger:
        first_script = Script(call("wire", WIRE, "c1"), done())
        first = Agent(
            FunctionModel(first_script),
            tools=[wire],
            capabilities=[TwiceshyCapability(first_ledger, {"wire": UNSAFE})],
        )
        guard = second_ledger.guard("wire", effect=UNSAFE, wait=0.2, definite=[ToolFailed])
        second_script = Script(call("wire", WIRE, "c9"), done())
        second = Agent(
            FunctionModel(second_script),
            tools=[wire],
            capabilities=[TwiceshyCapability(second_ledger, {"wire": guard})],
        )
        # A thread of its own with a loop of its own, as another process would have.
        running = threading.Thread(target=lambda: asyncio.run(first.run("pay", run_id="r")))
        running.start()
        try:
            assert started.wait(5)
            second.run_sync("pay", run_id="r")
        finally:
            release.set()
            running.join(5)

    (duplicate,) = second_script.results(2)
    text = duplicate.model_response_str()
    assert duplicate.outcome == "failed"
    # Seen only in the ledger: what is known, not a claim that it is still running.
    assert "An identical call of the tool 'wire' started at " in text
    assert "it may still be running, or the process running it may have stopped" in text
    assert "This call did not start it a second time" in text
    assert "its outcome becomes unknown and it is not run again by itself" in text
    assert "try again" not in text.lower()
    assert [r.content for r in first_script.results(2)] == ["sent"]
    assert len(sent) == 1


# -- runs and scopes ---------------------------------------------------------------------


def test_rerun_with_the_same_run_id_in_a_new_process_runs_a_keyed_charge_with_its_key(
    tmp_path: Path,
) -> None:
    """A KEYED charge that timed out, its run ended by the model's API failing, run again with
    its run_id in a new process: one charge, one key."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    provider = Provider()
    script = Script(
        call("charge", CHARGE, "c1"),
        ConnectionError("the model's API is down"),
        call("charge", CHARGE, "c2"),
        done(),
    )

    def process() -> tuple[Agent[None, str], Ledger]:
        """One process: its own ledger on the shared file, its own agent."""
        ledger = Ledger(url)
        guard = ledger.guard("charge", effect=KEYED, attempts=1, definite=[ToolFailed])
        agent = Agent(
            FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": guard})]
        )

        @agent.tool_plain
        def charge(amount: int, customer: str) -> str:
            charge_id = provider.charge(twiceshy.current_key())
            if len(provider.keys) == 1:
                raise TimeoutError("the provider did not answer in time")
            return charge_id

        return agent, ledger

    first, first_ledger = process()
    with pytest.raises(ConnectionError):
        first.run_sync("charge the customer", run_id="order-7")
    first_ledger.close()

    second, second_ledger = process()
    assert second.run_sync("charge the customer", run_id="order-7").output == "done"
    second_ledger.close()

    (timed_out,) = script.results(2)
    assert timed_out.outcome == "failed"
    assert "may have taken effect" in timed_out.model_response_str()
    assert [r.content for r in script.results(4)] == ["ch_1"]
    key = idempotency_key("order-7", "charge", CHARGE)
    assert provider.keys == [key, key]
    assert provider.effects == 1


def test_rerun_with_the_same_run_id_replays_what_the_tool_returned(ledger: Ledger) -> None:
    """A run that failed after an UNSAFE wire succeeded, run again: the wire is replayed."""
    sent: list[str] = []
    script = Script(
        call("wire", WIRE, "c1"),
        ConnectionError("the model's API is down"),
        call("wire", WIRE, "c2"),
        done(),
    )
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )

    @agent.tool_plain
    def wire(amount: int, iban: str) -> str:
        sent.append(iban)
        return f"wire {len(sent)} sent"

    with pytest.raises(ConnectionError):
        agent.run_sync("pay the invoice", run_id="order-8")
    agent.run_sync("pay the invoice", run_id="order-8")

    assert [r.content for r in script.results(4)] == ["wire 1 sent"]
    assert sent == [WIRE["iban"]]


def test_two_runs_with_different_run_ids_both_execute(ledger: Ledger) -> None:
    """The same arguments in two runs are two intents; in one run again, one."""
    sent: list[str] = []
    script = Script(
        *(answer for _ in range(3) for answer in (call("wire", WIRE, "c1"), done())),
    )
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )

    @agent.tool_plain
    def wire(amount: int, iban: str) -> str:
        sent.append(iban)
        return f"wire {len(sent)} sent"

    for run_id in ("order-1", "order-2", "order-1"):
        agent.run_sync("pay the invoice", run_id=run_id)

    assert len(sent) == 2
    assert [script.results(n)[0].content for n in (2, 4, 6)] == [
        "wire 1 sent",
        "wire 2 sent",
        "wire 1 sent",
    ]


def test_scope_function_and_enclosing_run_replace_the_run_id(ledger: Ledger) -> None:
    """scope= (a function of the RunContext) and twiceshy.run(...) name the scope instead."""
    sent: list[str] = []

    def order(ctx: RunContext[str]) -> str | None:
        return ctx.deps

    script = Script(*(answer for _ in range(4) for answer in (call("wire", WIRE, "c"), done())))
    by_deps = Agent(
        FunctionModel(script),
        deps_type=str,
        capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE}, scope=order)],
    )
    plain = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )

    def wire(amount: int, iban: str) -> str:
        sent.append(iban)
        return f"wire {len(sent)} sent"

    by_deps.tool_plain(wire)
    plain.tool_plain(wire)

    by_deps.run_sync("pay", deps="order-9", run_id="attempt-1")
    by_deps.run_sync("pay", deps="order-9", run_id="attempt-2")
    with twiceshy.run("order-10"):
        plain.run_sync("pay", run_id="attempt-3")
        plain.run_sync("pay", run_id="attempt-4")

    assert len(sent) == 2
    assert record(ledger, "order-9", "wire", WIRE).state is State.SUCCEEDED
    assert record(ledger, "order-10", "wire", WIRE).state is State.SUCCEEDED


def test_a_call_without_scope_raises_missing_scope_and_does_not_run(ledger: Ledger) -> None:
    """A scope= function that finds no scope ends the run with MissingScope; nothing ran."""
    sent: list[str] = []
    script = Script(call("wire", WIRE, "c1"), done())
    agent = Agent(
        FunctionModel(script),
        capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE}, scope=lambda ctx: None)],
    )

    @agent.tool_plain
    def wire(amount: int, iban: str) -> str:
        sent.append(iban)
        return "sent"

    with pytest.raises(MissingScope, match="'wire' cannot be protected"):
        agent.run_sync("pay", run_id="run-1")
    assert sent == []


# -- effect classes ----------------------------------------------------------------------


def test_effect_class_from_tool_metadata_and_the_mapping_wins(ledger: Ledger) -> None:
    """metadata={"twiceshy": ...} declares a tool's class; the effects mapping overrides it."""
    script = Script(
        ModelResponse(
            parts=[
                ToolCallPart("notify", {"to": "ops"}, tool_call_id="c1"),
                ToolCallPart("charge", dict(CHARGE), tool_call_id="c2"),
            ]
        ),
        done(),
    )
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": KEYED})]
    )

    @agent.tool_plain(metadata={"twiceshy": "unsafe"})
    def notify(to: str) -> str:
        return f"notified {to}"

    @agent.tool_plain(metadata={"twiceshy": "unsafe"})
    def charge(amount: int, customer: str) -> str:
        return "ch_1"

    agent.run_sync("go", run_id="run-1")

    assert record(ledger, "run-1", "notify", {"to": "ops"}).effect is UNSAFE
    assert record(ledger, "run-1", "charge", CHARGE).effect is KEYED


@pytest.mark.parametrize("metadata", [None, {"twiceshy": "sometimes"}], ids=["none", "bad"])
def test_a_tool_without_a_declared_class_is_refused_before_it_runs(
    ledger: Ledger, metadata: dict[str, Any] | None
) -> None:
    """No mapping, no metadata class, no default: EffectNotDeclared ends the run; nothing ran."""
    ran: list[str] = []
    script = Script(call("lookup", {"q": "x"}, "c1"), done())
    agent = Agent(FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"other": SAFE})])

    @agent.tool_plain(metadata=metadata)
    def lookup(q: str) -> str:
        ran.append(q)
        return q

    with pytest.raises(EffectNotDeclared, match="'lookup'"):
        agent.run_sync("look it up", run_id="run-1")
    assert ran == []


def test_omitted_default_and_explicit_default_are_one_intent(ledger: Ledger) -> None:
    """An argument left to its default and the same default sent by the model name one intent."""
    sent: list[str] = []
    script = Script(
        call("wire", WIRE, "c1"), call("wire", {**WIRE, "currency": "EUR"}, "c2"), done()
    )
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )

    @agent.tool_plain
    def wire(amount: int, iban: str, currency: str = "EUR") -> str:
        sent.append(iban)
        return "sent"

    agent.run_sync("pay", run_id="run-1")

    assert len(sent) == 1
    assert [r.content for r in script.results(3)] == ["sent"]


# -- how the ledger reads what the tool did ----------------------------------------------


def test_a_refusal_with_model_retry_releases_the_intent(ledger: Ledger) -> None:
    """A ModelRetry raised before any effect is a retry request; the re-call runs the tool."""
    sent: list[str] = []
    script = Script(call("wire", WIRE, "c1"), call("wire", WIRE, "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )
    bank_open = [False, True]

    @agent.tool_plain
    def wire(amount: int, iban: str) -> str:
        if not bank_open.pop(0):
            raise ModelRetry("the bank is closed for a minute; call again")
        sent.append(iban)
        return "sent"

    agent.run_sync("pay", run_id="run-1")

    (refused,) = script.results(2)
    assert refused.outcome == "retried"
    assert [r.content for r in script.results(3)] == ["sent"]
    assert len(sent) == 1


@pytest.mark.parametrize("given", ["class", "guard"])
def test_tool_failed_is_recorded_and_replayed(ledger: Ledger, given: str) -> None:
    """A ToolFailed is a certain failure, under a class or a plain guard: replayed, not rerun."""
    attempts: list[str] = []
    script = Script(call("charge", CHARGE, "c1"), call("charge", CHARGE, "c2"), done())
    effect = KEYED if given == "class" else ledger.guard("charge", effect=KEYED, attempts=1)
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": effect})]
    )

    @agent.tool_plain
    def charge(amount: int, customer: str) -> str:
        attempts.append(customer)
        raise ToolFailed("the card was declined")

    agent.run_sync("charge", run_id="run-1")

    for request in (2, 3):
        (failed,) = script.results(request)
        assert failed.outcome == "failed"
        assert failed.content == "the card was declined"
    assert len(attempts) == 1
    assert record(ledger, "run-1", "charge", CHARGE).state is State.FAILED


def test_identical_calls_in_one_response_run_once(ledger: Ledger) -> None:
    """Two identical calls in one model response (run in parallel) make one effect."""
    provider = Provider()
    script = Script(call("charge", CHARGE, "c1", "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"charge": KEYED})]
    )

    @agent.tool_plain
    async def charge(amount: int, customer: str) -> str:
        await asyncio.sleep(0.05)
        return provider.charge(twiceshy.current_key())

    agent.run_sync("charge", run_id="run-1")

    assert [r.content for r in script.results(2)] == ["ch_1", "ch_1"]
    assert provider.effects == 1
    assert len(provider.keys) == 1


@pytest.mark.parametrize("ending", ["failed", "refused"])
def test_identical_calls_that_fail_are_each_answered_under_their_own_id(
    ledger: Ledger, ending: str
) -> None:
    """Two identical calls in one response that fail: one run, one result for each call id."""
    attempts: list[int] = []
    script = Script(call("wire", WIRE, "c1", "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )

    @agent.tool_plain(retries=3)
    async def wire(amount: int, iban: str) -> str:
        attempts.append(amount)
        await asyncio.sleep(0.05)
        if ending == "failed":
            raise ToolFailed("the account is closed")
        raise ModelRetry("the bank is closed for a minute; call again")

    agent.run_sync("pay", run_id="run-1")

    results = script.results(2)
    # A provider refuses a request in which a tool call has no result of its own.
    assert sorted(r.tool_call_id for r in results) == ["c1", "c2"]
    assert {r.outcome for r in results} == {"failed" if ending == "failed" else "retried"}
    assert len(attempts) == 1


def test_a_replayed_tool_return_is_rebuilt_as_the_tool_returned_it(ledger: Ledger) -> None:
    """A tool's ToolReturn replays as a ToolReturn: the model reads what the first call gave it."""
    sent: list[str] = []
    script = Script(call("wire", WIRE, "c1"), call("wire", WIRE, "c2"), done())
    agent = Agent(
        FunctionModel(script), capabilities=[TwiceshyCapability(ledger, {"wire": UNSAFE})]
    )

    @agent.tool_plain
    def wire(amount: int, iban: str) -> ToolReturn:
        sent.append(iban)
        return ToolReturn(return_value="wire 1 sent", content="the receipt follows")

    agent.run_sync("pay", run_id="run-1")

    (first,) = script.results(2)
    (replayed,) = script.results(3)
    assert replayed.content == first.content == "wire 1 sent"
    assert replayed.model_response_str() == first.model_response_str()
    assert len(sent) == 1


# -- construction ------------------------------------------------------------------------


def test_construction_refuses_what_it_cannot_use(ledger: Ledger) -> None:
    """A wrong ledger, effect, default or guard is refused when the capability is made."""
    with pytest.raises(TypeError, match=r"twiceshy\.Ledger"):
        TwiceshyCapability("memory://", {"x": KEYED})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'x'"):
        TwiceshyCapability(ledger, {"x": "keyed"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="default="):
        TwiceshyCapability(ledger, default="safe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="named 'y'"):
        TwiceshyCapability(ledger, {"x": ledger.guard("y", effect=KEYED, definite=[ToolFailed])})


def test_importing_the_adapter_leaves_pydantic_ai_itself() -> None:
    """twiceshy.integrations.pydantic_ai does not shadow the pydantic_ai package."""
    import pydantic_ai

    import twiceshy.integrations.pydantic_ai as adapter

    assert sys.modules["pydantic_ai"] is pydantic_ai
    assert hasattr(pydantic_ai, "Agent")
    assert adapter.__name__ == "twiceshy.integrations.pydantic_ai"
    assert Path(adapter.__file__).parent.name == "integrations"
