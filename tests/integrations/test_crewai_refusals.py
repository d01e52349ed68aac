"""What a protected CrewAI tool refuses, through real crews and the scripted model: a call the
function never runs never meets the ledger (the model reads CrewAI's own error), and a recorded
generator tool is refused where it is protected.
"""

# No `from __future__ import annotations`: CrewAI's @tool builds its argument model from the
# function's annotations as objects.
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field
from scripted_crewai import CREWAI_WARNINGS, BaseTool, ScriptedLLM, action, calls, tool
from test_crewai import kickoff
from test_crewai import ledger as ledger  # fixtures: the aliases keep them exported
from test_crewai import offline as offline  # autouse: no network

import twiceshy
from twiceshy.integrations.crewai import protect

pytestmark = CREWAI_WARNINGS


def records(ledger: twiceshy.Ledger) -> list[twiceshy.Record]:
    """Every record the ledger holds, for any key."""
    return ledger.store.records(ledger.namespace)


def fax_tool(sent: list[str]) -> Any:
    """``send_fax(to, body)``: each call sends a fax (kept in ``sent``)."""

    @tool("send_fax")
    def send_fax(to: str, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    return send_fax


def turn(native: bool, args: dict[str, Any], call_id: str) -> Any:
    """One model turn calling ``send_fax`` with ``args``, natively or as text."""
    return calls("send_fax", args, call_id) if native else action("send_fax", args)


def read(llm: ScriptedLLM, native: bool) -> list[str]:
    """What the model read after each of its calls, in order."""
    return list(llm.results().values()) if native else llm.observations()


@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
@pytest.mark.parametrize("effect", [twiceshy.UNSAFE, twiceshy.KEYED])
def test_a_call_missing_a_required_argument_never_meets_the_ledger(
    ledger: twiceshy.Ledger, effect: twiceshy.Effect, native: bool
) -> None:
    """The model leaves out ``to``: it reads CrewAI's own error, as without twiceshy, nothing is
    sent and nothing is recorded; the well-formed call after it sends one fax."""
    plain = ScriptedLLM(
        model="scripted", native=native, script=[turn(native, {"body": "hi"}, "c1")]
    )
    kickoff(plain, [fax_tool([])])

    sent: list[str] = []
    tools = protect([fax_tool(sent)], ledger, effects={"send_fax": effect})
    llm = ScriptedLLM(model="scripted", native=native, script=[turn(native, {"body": "hi"}, "c1")])
    kickoff(llm, tools, scope="fax-1")
    assert read(llm, native) == read(plain, native)
    assert "validation failed" in read(llm, native)[0]
    assert sent == []
    assert records(ledger) == []

    good = {"to": "555", "body": "hi"}
    llm = ScriptedLLM(model="scripted", native=native, script=[turn(native, good, "c2")])
    kickoff(llm, tools, scope="fax-1")
    assert "faxed 555" in read(llm, native)[0]
    assert sent == ["555"]
    assert len(records(ledger)) == 1


class FaxArgs(BaseModel):
    """A schema that lets through arguments the function does not take."""

    model_config = ConfigDict(extra="allow")

    to: str


class SendFax(BaseTool):
    """A BaseTool subclass whose schema is wider than its ``_run``."""

    name: str = "send_fax"
    description: str = "Send a fax."
    args_schema: type[BaseModel] = FaxArgs
    sent: list[str] = Field(default_factory=list)

    def _run(self, to: str) -> str:
        self.sent.append(to)
        return f"faxed {to}"


def test_arguments_the_function_does_not_take_raise_as_python_raises_them(
    ledger: twiceshy.Ledger,
) -> None:
    """The schema lets ``cover`` through, ``_run`` has no such parameter: CrewAI answers the
    ``TypeError`` as a tool's error, as without twiceshy, and nothing runs or is recorded; the
    well-formed call after it runs once."""
    cover = {"to": "555", "cover": "urgent"}
    plain_tool = SendFax()
    plain = ScriptedLLM(model="scripted", script=[calls("send_fax", cover, "c1")])
    kickoff(plain, [plain_tool])
    assert plain_tool.sent == []

    original = SendFax()
    (protected,) = protect([original], ledger, effects={"send_fax": twiceshy.UNSAFE})
    llm = ScriptedLLM(model="scripted", script=[calls("send_fax", cover, "c1")])
    kickoff(llm, [protected], scope="fax-2")
    said = llm.results()["c1"]
    assert "got an unexpected keyword argument 'cover'" in said
    assert "SendFax._run()" in said
    assert "unknown" not in said
    assert original.sent == []
    assert records(ledger) == []

    llm = ScriptedLLM(model="scripted", script=[calls("send_fax", {"to": "555"}, "c2")])
    kickoff(llm, [protected], scope="fax-2")
    assert llm.results() == {"c2": "faxed 555"}
    assert original.sent == ["555"]
    assert len(records(ledger)) == 1


class SendFaxes(BaseTool):
    """A BaseTool subclass whose ``_run`` is a generator."""

    name: str = "send_faxes"
    description: str = "Send faxes."

    def _run(self, to: str) -> Any:
        yield f"faxed {to}"


@tool("send_faxes")
def send_faxes(to: str) -> Any:
    """Send faxes."""
    yield f"faxed {to}"


@pytest.mark.parametrize("fax", [send_faxes, SendFaxes()], ids=["tool", "subclass"])
@pytest.mark.parametrize("effect", [twiceshy.KEYED, twiceshy.UNSAFE])
def test_a_recorded_generator_tool_is_refused_when_protected(
    ledger: twiceshy.Ledger, fax: Any, effect: twiceshy.Effect
) -> None:
    """A generator function cannot be a KEYED or UNSAFE tool: ``protect`` says what to do."""
    with pytest.raises(TypeError, match=r"is a generator function.*Return a list"):
        protect([fax], ledger, default=effect)
    recorded = ledger.guard("send_faxes", effect=twiceshy.SAFE, record=True)
    with pytest.raises(TypeError, match="generator"):
        protect([fax], ledger, effects={"send_faxes": recorded})


def test_a_safe_generator_tool_keeping_no_record_is_protected(ledger: twiceshy.Ledger) -> None:
    """A SAFE tool keeps no record: a generator there is no risk, and it is protected."""
    assert len(protect([send_faxes], ledger, default=twiceshy.SAFE)) == 1
