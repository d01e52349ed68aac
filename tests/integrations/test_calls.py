"""The piece every adapter shares: what a tool function receives names the intent, and
twiceshy's words for the model."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import twiceshy
from twiceshy.integrations._calls import (
    ArgumentsDoNotFit,
    effect_at_of,
    for_the_model,
    received,
    refuse_generator,
    with_schema_defaults,
)


def tool(ctx: object, /, amount: int, currency: str = "eur", *, note: str | None = None) -> None:
    """A tool with a context first, a default and a keyword-only parameter."""


def test_what_a_function_receives_is_one_mapping_however_it_is_spelled() -> None:
    """Positional or keyword, a default omitted or spelled out: one mapping, context left out."""
    expected = {"amount": 5, "currency": "eur", "note": None}
    assert received(tool, ["ctx", 5], {}, inject=("ctx",)) == expected
    assert received(tool, ["ctx"], {"amount": 5, "currency": "eur"}, inject=("ctx",)) == expected
    assert received(tool, [], {"amount": 5}, inject=("ctx",)) == expected  # context not handed


def test_a_call_that_does_not_fit_the_signature_is_a_type_error() -> None:
    """An argument the function has no parameter for, or a required one left out, is refused
    as the call would be: ``ArgumentsDoNotFit``, a ``TypeError`` naming the function."""
    with pytest.raises(ArgumentsDoNotFit, match=r"^tool\(\) got an unexpected keyword argument"):
        received(tool, ["ctx", 5], {"colour": "red"}, inject=("ctx",))
    with pytest.raises(ArgumentsDoNotFit, match=r"^tool\(\) missing a required argument: 'amount'"):
        received(tool, [], {"currency": "usd"}, inject=("ctx",))
    assert issubclass(ArgumentsDoNotFit, TypeError)
    raised = ArgumentsDoNotFit("tool() missing a required argument: 'amount'").as_raised()
    assert type(raised) is TypeError  # a framework words it as Python's own
    assert str(raised) == "tool() missing a required argument: 'amount'"


def test_a_signature_that_cannot_be_read_is_not_a_refusal() -> None:
    """A callable whose signature cannot be read raises what ``inspect`` raises, never
    ``ArgumentsDoNotFit``: the function may still take the call."""
    with pytest.raises((TypeError, ValueError)) as raised:
        received(getattr, [tool, "__name__"], {})  # a builtin without a text signature
    assert not isinstance(raised.value, ArgumentsDoNotFit)


def _generator(to: str) -> Iterator[str]:
    yield to


async def _async_generator(to: str) -> AsyncIterator[str]:
    yield to


def _passing_on(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class _Streams:
    def __call__(self, to: str) -> Iterator[str]:
        yield to


@pytest.mark.parametrize(
    "fn",
    [
        _generator,
        _async_generator,
        functools.partial(_generator, "555"),
        _Streams(),
    ],
)
def test_a_generator_function_is_refused_as_a_recorded_tool(fn: Callable[..., Any]) -> None:
    """A generator or async generator function, a partial of one or an object whose __call__
    is one, is refused, naming the fix."""
    with pytest.raises(TypeError, match=r"^the tool 'fax' is a generator function.*a list"):
        refuse_generator(fn, "fax")


def test_a_wrapper_is_read_through_only_for_a_framework_that_does() -> None:
    """A plain wrapper around a generator passes by default (one that collects the items is
    what the message asks for; one that hands the generator on is caught when called), and
    is refused where the framework itself looks through wrappers (``wrapped=True``)."""

    @functools.wraps(_generator)
    def collected(to: str) -> list[str]:
        return list(_generator(to))

    refuse_generator(collected, "fax")
    refuse_generator(_passing_on(_generator), "fax")
    with pytest.raises(TypeError, match=r"^the tool 'fax' is a generator function"):
        refuse_generator(_passing_on(_generator), "fax", wrapped=True)


def test_a_function_that_returns_its_results_is_a_tool() -> None:
    """A plain function, a coroutine function and nothing at all pass."""

    async def fax(to: str) -> list[str]:
        return [to]

    refuse_generator(tool, "fax")
    refuse_generator(fax, "fax")
    refuse_generator(None, "fax")


def test_schema_defaults_fill_in_only_what_was_left_out() -> None:
    """A JSON schema's default stands for an omitted argument, never for a sent one."""
    schema = {"properties": {"copies": {"default": 1}, "number": {"type": "string"}}}
    assert with_schema_defaults({"number": "555"}, schema) == {"number": "555", "copies": 1}
    assert with_schema_defaults({"copies": 2}, schema) == {"copies": 2}


def test_a_tool_whose_code_calls_the_point_says_where_its_effect_starts() -> None:
    """effect_at_of reads the function's own code, nested functions included."""

    def marks() -> None:
        def inner() -> None:
            twiceshy.point_of_no_return()

        inner()

    def plain() -> None:
        return None

    assert effect_at_of(marks) == "mark"
    assert effect_at_of(plain) is None
    assert effect_at_of(None) is None


def test_a_keyed_tool_out_of_attempts_is_worded_for_the_model() -> None:
    """Its last error (noted by the core) reads as possibly done, safe to call again with the same
    key; a certain failure or a SAFE tool's error is left to the framework."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    guard = ledger.guard("create_charge", effect=twiceshy.KEYED, attempts=2, backoff=lambda n: 0.0)

    def timeout() -> Any:
        assert twiceshy.current_key() is not None  # handed to the provider, which timed out
        raise TimeoutError("read timed out")

    with twiceshy.run("run-1"), pytest.raises(TimeoutError) as last:
        guard.call({"amount": 5}, timeout)
    text = for_the_model(guard, last.value, {"amount": 5}, scope="run-1")
    assert text is not None
    key = guard.key_for({"amount": 5}, scope="run-1")
    assert text.startswith(
        "The tool 'create_charge' did not finish on 2 attempts (the last: TimeoutError: read "
        "timed out): it may have taken effect."
    )
    assert "calling it again later with the same arguments is safe" in text
    assert f"(reference {key[:16]})" in text
    assert "try again" not in text.lower()
    assert for_the_model(guard, ValueError("declined"), {"amount": 5}, scope="run-1") is None
    safe = ledger.guard("search", effect=twiceshy.SAFE)
    assert for_the_model(safe, last.value, {"q": "x"}) is None
