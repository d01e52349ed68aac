"""What a protected tool may be: an object with an async ``__call__``, an async function behind a
blocking wrapper (refused, never recorded as run), a tool with its own key parameter."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

import twiceshy
from twiceshy import State


class SendMail:
    """A tool object whose ``__call__`` is async."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def __call__(self, to: str) -> str:
        self.sent.append(to)
        return "sent"


def test_an_object_with_an_async_call_is_an_async_tool() -> None:
    """An object whose ``__call__`` is async is protected as an async tool and replayed."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    mailer = SendMail()
    send = ledger.tool(effect=twiceshy.KEYED, name="send_mail")(mailer)

    async def main() -> list[str]:
        with twiceshy.run("run-1"):
            return [await send("ada@example.com"), await send("ada@example.com")]

    assert asyncio.run(main()) == ["sent", "sent"]
    assert mailer.sent == ["ada@example.com"]


def test_a_blocking_wrapper_of_an_async_tool_is_refused_and_released() -> None:
    """Protected as a blocking tool, an async def behind a plain decorator answers a coroutine:
    it never ran, so the intent is released with an error that says why, not recorded FAILED."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    posted: list[str] = []

    def logged(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    @ledger.tool(effect=twiceshy.UNSAFE)
    @logged
    async def post(text: str) -> str:
        posted.append(text)
        return "posted"

    with twiceshy.run("run-1"):
        with pytest.raises(TypeError, match="returned an awaitable"):
            post("hello")
        (record,) = ledger.store.records("")
    assert record.state is State.RELEASED
    assert posted == []


def test_a_key_parameter_defaulting_to_empty_text_gets_the_intent_key() -> None:
    """An ``idempotency_key=""`` default is filled with the intent's key; a chosen key is kept."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    def send(to: str, idempotency_key: str = "") -> str:
        return idempotency_key

    with twiceshy.run("run-1"):
        assert send("ada@example.com") == twiceshy.idempotency_key(
            "run-1", "send", {"to": "ada@example.com"}
        )
        assert send("ada@example.com", idempotency_key="chosen") == "chosen"
