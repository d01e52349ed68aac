"""What a protected Google ADK tool refuses, and what ADK refuses before it: a call ADK answers
itself never reaches the ledger, and a recorded tool that would run past the ledger is refused
when it is protected. Through a real ``LlmAgent`` driven by a scripted model."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from google.adk.agents import LlmAgent
from google.adk.tools import FunctionTool
from provider_log import CHARGE, Provider
from scripted_google_adk import ScriptedModel, run

from twiceshy import KEYED, SAFE, UNSAFE, Ledger, State, idempotency_key
from twiceshy.integrations.google_adk import protect


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    """An in-memory ledger, then a SQLite one."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(url) as opened:
        yield opened


def test_a_call_adk_refuses_for_a_missing_argument_is_not_recorded(
    ledger: Ledger, tmp_path: Path
) -> None:
    """The model leaves out a mandatory argument: ADK answers the call itself before the
    function (and the ledger) is reached, so nothing is recorded and nothing is charged; the
    next well-formed call runs once."""
    provider = Provider(tmp_path / "effects")

    def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(None, amount, customer)

    tools = protect([charge], ledger, effects={"charge": UNSAFE})
    model = ScriptedModel.of([("c1", "charge", {"amount": 4900})])
    run(LlmAgent(name="billing", model=model, tools=tools), "order-1")

    assert model.results()["c1"] == {
        "error": "Invoking `charge()` failed as the following mandatory input parameters are "
        "not present:\ncustomer\nYou could retry calling this tool, but it is IMPORTANT for "
        "you to provide all the mandatory parameters."
    }
    assert ledger.store.records(ledger.namespace) == []
    assert provider.effects == 0

    model = ScriptedModel.of([("c2", "charge", CHARGE)])
    run(LlmAgent(name="billing", model=model, tools=tools), "order-1")

    assert model.results()["c2"] == {"result": "ch_1"}
    (record,) = ledger.store.records(ledger.namespace)
    assert (record.key, record.state) == (
        idempotency_key("order-1", "charge", CHARGE),
        State.SUCCEEDED,
    )
    assert provider.effects == 1


def streams(amount: int, customer: str) -> Iterator[str]:
    """Charge, reporting progress."""
    yield f"charging {amount}"


async def astreams(amount: int, customer: str) -> AsyncIterator[str]:
    """Charge, reporting progress."""
    yield f"charging {amount}"


def decorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator in the user's code around a generator function (a plain function that
    returns the generator, ``functools.wraps`` naming what it wraps)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


GENERATORS = {
    "generator": streams,
    "async-generator": astreams,
    "decorated-generator": decorated(streams),
    "decorated-async-generator": decorated(astreams),
}


@pytest.mark.parametrize("fn", GENERATORS.values(), ids=GENERATORS.keys())
def test_a_recorded_generator_tool_is_refused_when_protected(
    fn: Callable[..., Any], tmp_path: Path
) -> None:
    """A generator or async-generator function (itself, or behind a decorator) declared KEYED,
    UNSAFE or SAFE with ``record=True`` is refused by ``protect``, as a function or a
    ``FunctionTool``; declared SAFE (not recorded) it is protected, and ADK streams it."""
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        name = fn.__name__
        for declared in (KEYED, UNSAFE, ledger.guard(name, effect=SAFE, record=True)):
            for tool in (fn, FunctionTool(fn)):
                with pytest.raises(TypeError, match=rf"the tool '{name}' is a generator function"):
                    protect([tool], ledger, effects={name: declared})
        (kept,) = protect([fn], ledger, default=SAFE)
        assert kept.name == name


def test_a_tool_with_positional_only_parameters_is_keyed_as_adk_calls_it(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A function with positional-only parameters: an ADK that hands them by name (it wraps
    such a function) gets the call bound as it makes it, keyed by what the function receives,
    and run once; an ADK that calls every function by keyword meets the function's own
    TypeError, and nothing is claimed or charged."""
    provider = Provider(tmp_path / "effects")

    def charge(amount: int, /, customer: str) -> str:
        """Charge the customer, in cents."""
        return provider.charge(None, amount, customer)

    tools = protect([charge], ledger, effects={"charge": UNSAFE})
    model = ScriptedModel.of([("c1", "charge", CHARGE), ("c2", "charge", CHARGE)])
    agent = LlmAgent(name="billing", model=model, tools=tools)
    if not hasattr(FunctionTool, "_get_compatible_func"):  # ADK 2.2: by keyword only
        with pytest.raises(TypeError, match="positional only, but was passed as a keyword"):
            run(agent, "order-1")
        assert ledger.store.records(ledger.namespace) == []
        assert provider.effects == 0
        return
    run(agent, "order-1")
    assert model.results() == {"c1": {"result": "ch_1"}, "c2": {"result": "ch_1"}}
    (record,) = ledger.store.records(ledger.namespace)
    assert record.key == idempotency_key("order-1", "charge", CHARGE)
    assert provider.effects == 1
