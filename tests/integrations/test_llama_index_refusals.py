"""What a protected LlamaIndex tool refuses, through a real ``FunctionAgent``: a call whose
arguments do not fit its function never runs and is never recorded, and a generator function is
refused where the tool is protected.
"""

from collections.abc import AsyncIterator, Iterator

import pytest
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.tools import FunctionTool
from scripted_llama_index import Script, run

from twiceshy import KEYED, SAFE, UNSAFE, Effect, Ledger, idempotency_key
from twiceshy.integrations.llama_index import protect

pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning")


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


@pytest.mark.parametrize("effect", [UNSAFE, KEYED])
def test_a_call_missing_a_required_argument_never_runs_and_is_not_recorded(
    ledger: Ledger, effect: Effect
) -> None:
    """The model leaves out ``to``: it reads Python's refusal as an error, nothing is sent, the
    ledger holds no record; the well-formed call that follows sends one fax."""
    sent: list[str] = []

    def send_fax(to: str, body: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    tools = protect([send_fax], ledger, effects={"send_fax": effect})
    refused = Script([("c1", "send_fax", {"body": "hello"})])
    run(FunctionAgent(tools=tools, llm=refused.llm()), run_id=f"{effect.value}-1", scope="fax-1")

    assert refused.results()["c1"].endswith(".send_fax() missing a required argument: 'to'")
    assert sent == []
    assert ledger.store.records(ledger.namespace) == []

    well_formed = Script([("c2", "send_fax", {"to": "555", "body": "hello"})])
    run(
        FunctionAgent(tools=tools, llm=well_formed.llm()), run_id=f"{effect.value}-2", scope="fax-1"
    )
    assert well_formed.results() == {"c2": "faxed 555"}
    assert sent == ["555"]
    records = ledger.store.records(ledger.namespace)
    key = idempotency_key("fax-1", "send_fax", {"to": "555", "body": "hello"})
    assert [record.key for record in records] == [key]


def test_an_argument_the_function_has_no_parameter_for_is_refused_alike(ledger: Ledger) -> None:
    """An argument the function does not take is refused as Python refuses it: nothing runs,
    nothing is recorded."""
    sent: list[str] = []

    def send_fax(to: str) -> str:
        """Send a fax."""
        sent.append(to)
        return f"faxed {to}"

    tools = protect([send_fax], ledger, effects={"send_fax": UNSAFE})
    script = Script([("c1", "send_fax", {"to": "555", "cover": "urgent"})])
    run(FunctionAgent(tools=tools, llm=script.llm()), run_id="fax-2")
    assert script.results()["c1"].endswith(".send_fax() got an unexpected keyword argument 'cover'")
    assert sent == []
    assert ledger.store.records(ledger.namespace) == []


def collect(to: str) -> Iterator[str]:
    """A generator tool: its body runs only as its result is consumed."""
    yield f"faxed {to}"


def unannotated(to: str):  # type: ignore[no-untyped-def]
    """A generator tool with no return annotation."""
    yield f"faxed {to}"


async def stream(to: str) -> AsyncIterator[str]:
    """An async generator tool."""
    yield f"faxed {to}"


@pytest.mark.parametrize("function", [collect, unannotated, stream])
@pytest.mark.parametrize("effect", [KEYED, UNSAFE])
def test_a_recorded_generator_tool_is_refused_when_protected(
    ledger: Ledger, function: object, effect: Effect
) -> None:
    """A generator function cannot be a KEYED or UNSAFE tool: ``protect`` says what to do."""
    with pytest.raises(TypeError, match=r"is a generator function.*Return a list"):
        protect([function], ledger, default=effect)  # type: ignore[list-item]
    tool = FunctionTool.from_defaults(function, name="fax")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        protect([tool], ledger, effects={"fax": ledger.guard("fax", effect=SAFE, record=True)})


def test_a_safe_generator_tool_keeping_no_record_is_protected(ledger: Ledger) -> None:
    """A SAFE tool keeps no record: a generator is no risk there, and it is protected."""
    assert len(protect([collect], ledger, default=SAFE)) == 1
