"""The CrewAI adapter names an intent by what the tool function receives, through real crews
and the scripted model: CrewAI's own validation decides, on native and text tool calls alike.

Each test re-enacts the incident: the tool takes effect and its answer is lost (it raises), the
model calls again in another spelling; one effect, one key.
"""

# No `from __future__ import annotations`: CrewAI's @tool builds its argument model from the
# function's annotations as objects.
import enum
import uuid
from typing import Any

import pytest
from pydantic import BaseModel, Field, model_validator
from scripted_crewai import CREWAI_WARNINGS, ScriptedLLM, action, calls, tool
from test_crewai import kickoff
from test_crewai import ledger as ledger  # fixtures: the aliases keep them exported
from test_crewai import offline as offline  # autouse: no network

import twiceshy
from twiceshy.integrations.crewai import protect

pytestmark = CREWAI_WARNINGS


class Priority(enum.IntEnum):
    """An enum CrewAI accepts by value, also as text ("2")."""

    LOW = 1
    HIGH = 2


class Address(BaseModel):
    """A nested model whose fields CrewAI coerces."""

    street: str
    number: int


SPELLINGS: list[dict[str, Any]] = [
    # The canonical call: the optional note left out.
    {"qty": 2, "priority": 2, "address": {"street": "Main", "number": 5}},
    # A number as text, the enum as text, a nested field as text: CrewAI coerces them all.
    {"qty": "2", "priority": "2", "address": {"street": "Main", "number": "5"}},
    # Another key order, at both levels, and the default sent.
    {"note": "none", "address": {"number": 5, "street": "Main"}, "priority": 2, "qty": 2},
]
RECEIVED = {"qty": 2, "priority": 2, "address": {"street": "Main", "number": 5}, "note": "none"}


def turns(native: bool, name: str, spellings: list[dict[str, Any]]) -> list[Any]:
    """The model's turns calling ``name`` once per spelling, natively or as text."""
    if native:
        return [calls(name, args, f"call_{n}") for n, args in enumerate(spellings, 1)]
    return [action(name, args) for args in spellings]


def read(llm: ScriptedLLM, native: bool) -> list[str]:
    """What the model read after each call, in order."""
    return list(llm.results().values()) if native else llm.observations()


@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED], ids=["unsafe", "keyed"])
def test_spellings_crewai_accepts_name_one_intent(
    ledger: twiceshy.Ledger, native: bool, effect: twiceshy.Effect
) -> None:
    """Spellings CrewAI coerces to what the function receives: one intent, effect and key."""
    effects: list[tuple[Any, ...]] = []
    keys: list[Any] = []

    @tool("ship")
    def ship(qty: int, priority: Priority, address: Address, note: str = "none") -> str:
        """Ship an order; the answer is lost the first time."""
        keys.append(twiceshy.current_key())
        effects.append((qty, priority, address, note))
        if len(effects) == 1:
            raise TimeoutError("read timed out")
        return "shipped"

    guard = ledger.guard("ship", effect=effect, attempts=1)
    llm = ScriptedLLM(model="scripted", native=native, script=turns(native, "ship", SPELLINGS))

    kickoff(llm, protect([ship], ledger, effects={"ship": guard}))

    key = twiceshy.idempotency_key("order-7", "ship", RECEIVED)
    answers = read(llm, native)
    assert len(answers) == 3
    if effect is twiceshy.UNSAFE:
        assert len(effects) == 1
        assert len(set(answers)) == 1
        assert "outcome is unknown" in answers[0]
        assert f"reference {key[:16]}" in answers[0]
    else:
        # The re-call ran again with the same key (the provider deduplicates), then replayed.
        assert len(effects) == 2
        assert answers[1] == answers[2] == "shipped"
    assert keys == [key] * len(keys)
    qty, priority, _, note = effects[0]
    assert (qty, priority, note) == (2, Priority.HIGH, "none")


VALIDATED: list[str] = []


class Memo(BaseModel):
    """A model whose validation the test counts."""

    text: str

    @model_validator(mode="after")
    def counted(self) -> "Memo":
        """Count each validation."""
        VALIDATED.append(self.text)
        return self


@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
def test_crewai_validates_a_call_once_for_the_key_and_the_function(
    ledger: twiceshy.Ledger, native: bool
) -> None:
    """The key is made from what CrewAI validated for the function: no second validation."""
    VALIDATED.clear()
    filed: list[Any] = []

    @tool("file")
    def file(memo: Memo) -> str:
        """File a memo."""
        filed.append(memo)
        return "filed"

    llm = ScriptedLLM(
        model="scripted", native=native, script=turns(native, "file", [{"memo": {"text": "hi"}}])
    )
    kickoff(llm, protect([file], ledger, effects={"file": twiceshy.UNSAFE}))

    assert read(llm, native) == ["filed"]
    assert VALIDATED == ["hi"]
    assert len(filed) == 1


def _fresh_id() -> str:
    """A default factory making a new value on every call."""
    return uuid.uuid4().hex


@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
def test_an_argument_a_default_factory_makes_names_no_intent(
    ledger: twiceshy.Ledger, native: bool
) -> None:
    """A parameter CrewAI fills from a default_factory is left out of the key: one effect."""
    sent: list[tuple[str, str]] = []

    @tool("send_sms")
    def send_sms(text: str, request_id: str = Field(default_factory=_fresh_id)) -> str:
        """Text the customer; the answer is lost."""
        sent.append((text, request_id))
        raise TimeoutError("read timed out")

    spellings = [{"text": "hi"}, {"text": "hi", "to_nobody": 1}]
    llm = ScriptedLLM(model="scripted", native=native, script=turns(native, "send_sms", spellings))
    kickoff(llm, protect([send_sms], ledger, effects={"send_sms": twiceshy.UNSAFE}))

    assert [text for text, _ in sent] == ["hi"]
    key = twiceshy.idempotency_key("order-7", "send_sms", {"text": "hi"})
    answers = read(llm, native)
    assert answers[0] == answers[1]
    assert f"reference {key[:16]}" in answers[0]


@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
def test_a_factory_argument_the_model_sends_is_part_of_the_intent(
    ledger: twiceshy.Ledger, native: bool
) -> None:
    """A value the model sends for a factory parameter names the intent: two ids, two sends."""
    sent: list[str] = []

    @tool("send_sms")
    def send_sms(text: str, request_id: str = Field(default_factory=_fresh_id)) -> str:
        """Text the customer."""
        sent.append(request_id)
        return f"sent {request_id}"

    spellings = [{"text": "hi", "request_id": "r1"}, {"text": "hi", "request_id": "r2"}]
    llm = ScriptedLLM(model="scripted", native=native, script=turns(native, "send_sms", spellings))
    kickoff(llm, protect([send_sms], ledger, effects={"send_sms": twiceshy.UNSAFE}))

    assert sent == ["r1", "r2"]
    assert read(llm, native) == ["sent r1", "sent r2"]
