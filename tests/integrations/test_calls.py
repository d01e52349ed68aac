"""The piece every adapter shares: what a tool function receives names the intent, and
twiceshy's words for the model."""

from __future__ import annotations

from typing import Any

import pytest

import twiceshy
from twiceshy.integrations._calls import (
    effect_at_of,
    for_the_model,
    received,
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
    """An argument the function has no parameter for is refused, as the call would be."""
    with pytest.raises(TypeError):
        received(tool, ["ctx", 5], {"colour": "red"}, inject=("ctx",))


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
