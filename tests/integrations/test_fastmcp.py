"""twiceshy in a FastMCP 4.x server, through FastMCP's own in-process client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fastmcp import Client, Context, FastMCP
from fastmcp.client.client import CallToolResult
from fastmcp.dependencies import Depends
from fastmcp.server.middleware.error_handling import RetryMiddleware
from mcp.types import ToolAnnotations

import twiceshy
from twiceshy.integrations.fastmcp import TwiceshyMiddleware
from twiceshy.integrations.mcp import KEY_META_KEY, SCOPE_META_KEY

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run an async test body, bounded in time."""

    async def bounded() -> T:
        return await asyncio.wait_for(main(), 60)

    return asyncio.run(bounded())


def scoped(scope: str) -> dict[str, Any]:
    """The ``_meta`` a client sends to name its run."""
    return {SCOPE_META_KEY: scope}


def text(result: CallToolResult) -> str:
    """What the model reads of a tool result."""
    return "\n".join(getattr(block, "text", "") for block in result.content)


def assert_honest(result: CallToolResult) -> None:
    """An ``isError`` result with twiceshy's honest message, which invites no retry."""
    assert result.is_error
    message = text(result)
    assert "outcome is unknown" in message
    assert "will not be run again" in message
    assert "try again" not in message.lower()
    assert "retry" not in message.lower()


class Provider:
    """A payment provider double: deduplicates charges by idempotency key, counts effects."""

    def __init__(self) -> None:
        self.charges: dict[str, dict[str, Any]] = {}
        self.keys_seen: list[str | None] = []

    def charge(self, key: str | None, customer: str, amount: int) -> dict[str, Any]:
        """Charge once per key; a repeated key gets the first charge back."""
        self.keys_seen.append(key)
        assert key is not None, "a KEYED tool must hand the provider a key"
        if key not in self.charges:
            self.charges[key] = {"id": f"ch_{len(self.charges) + 1}", "amount": amount}
        return self.charges[key]


def fast_retries() -> RetryMiddleware:
    """FastMCP's own retry layer, quick, retrying timeouts (its default set)."""
    return RetryMiddleware(max_retries=2, base_delay=0.01, max_delay=0.02)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    with twiceshy.Ledger("sqlite:///" + str(tmp_path / "ledger.db")) as opened:
        yield opened


def test_keyed_tool_replays_after_a_timeout(ledger: twiceshy.Ledger) -> None:
    """The incident, KEYED: the charge lands, then times out; the client's retry gets it once."""
    provider = Provider()
    server = FastMCP("billing")

    @server.tool
    def charge_card(customer: str, amount: int) -> dict[str, Any]:
        """Charge a card."""
        charge = provider.charge(twiceshy.current_key(), customer, amount)
        if len(provider.keys_seen) == 1:
            raise TimeoutError("the payment gateway did not answer in time")
        return charge

    # One attempt per call, so that the client's own retry is what recovers.
    guard = ledger.guard("charge_card", effect=twiceshy.KEYED, attempts=1)
    server.add_middleware(TwiceshyMiddleware(ledger, effects={"charge_card": guard}))
    args = {"customer": "cus_1", "amount": 4900}

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool(
                    "charge_card", args, meta=scoped("run-1"), raise_on_error=False
                )
                for _ in "123"
            ]

    first, second, third = run(main)
    assert first.is_error  # out of its one attempt: it may have taken effect
    assert "did not finish on its one attempt" in text(first)
    assert "calling it again later with the same arguments is safe" in text(first)
    assert not second.is_error
    assert second.structured_content == {"id": "ch_1", "amount": 4900}
    assert (third.structured_content, third.data) == (second.structured_content, second.data)
    assert text(third) == text(second)
    assert len(provider.charges) == 1
    assert len(provider.keys_seen) == 2  # the replay did not reach the provider
    assert provider.keys_seen[0] == provider.keys_seen[1]


def test_retry_middleware_outside_retries_through_the_ledger(ledger: twiceshy.Ledger) -> None:
    """RetryMiddleware added first retries a KEYED timeout through the ledger: same key, once."""
    provider = Provider()
    server = FastMCP("billing")

    @server.tool
    async def charge_card(customer: str, amount: int) -> dict[str, Any]:
        """Charge a card."""
        charge = provider.charge(twiceshy.current_key(), customer, amount)
        if len(provider.keys_seen) == 1:
            raise TimeoutError("the payment gateway did not answer in time")
        return charge

    server.add_middleware(fast_retries())
    guard = ledger.guard("charge_card", effect=twiceshy.KEYED, attempts=1)
    server.add_middleware(TwiceshyMiddleware(ledger, effects={"charge_card": guard}))

    async def main() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool(
                "charge_card", {"customer": "cus_1", "amount": 4900}, meta=scoped("run-1")
            )

    result = run(main)
    assert result.structured_content == {"id": "ch_1", "amount": 4900}
    assert len(provider.charges) == 1
    assert len(provider.keys_seen) == 2
    assert provider.keys_seen[0] == provider.keys_seen[1]


def test_unsafe_tool_answers_honestly_after_a_timeout(ledger: twiceshy.Ledger) -> None:
    """The incident, UNSAFE: the mail goes out, then times out; no layer runs it again."""
    sent: list[str] = []
    server = FastMCP("mailer")

    @server.tool
    def send_mail(to: str, subject: str) -> str:
        """Send an e-mail (no annotations: UNSAFE)."""
        sent.append(to)
        raise TimeoutError("the mail server did not answer in time")

    server.add_middleware(fast_retries())  # it must not retry the honest answer
    server.add_middleware(TwiceshyMiddleware(ledger))
    args = {"to": "ada@example.com", "subject": "Your invoice"}

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool(
                    "send_mail", args, meta=scoped("run-1"), raise_on_error=False
                )
                for _ in "12"
            ]

    first, second = run(main)
    assert_honest(first)
    assert_honest(second)
    assert "TimeoutError" in text(first)  # this server does not mask error details
    assert sent == ["ada@example.com"]


def test_a_masking_server_quotes_no_error_detail(ledger: twiceshy.Ledger) -> None:
    """With mask_error_details, the honest text does not quote the tool's exception."""
    server = FastMCP("mailer", mask_error_details=True)

    @server.tool
    def send_mail(to: str) -> str:
        """Send an e-mail."""
        raise TimeoutError("smtp.internal:25 did not answer")

    server.add_middleware(TwiceshyMiddleware(ledger))

    async def main() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool(
                "send_mail", {"to": "a@b.c"}, meta=scoped("run-1"), raise_on_error=False
            )

    result = run(main)
    assert_honest(result)
    assert "smtp.internal" not in text(result)


def test_a_masking_server_quotes_no_detail_of_a_keyed_tool_out_of_attempts(
    ledger: twiceshy.Ledger,
) -> None:
    """With mask_error_details, twiceshy's words for a KEYED tool out of attempts quote
    FastMCP's masked text, never the tool's exception."""
    provider = Provider()
    server = FastMCP("billing", mask_error_details=True)

    @server.tool
    def charge_card(customer: str, amount: int) -> dict[str, Any]:
        """Charge a card."""
        provider.charge(twiceshy.current_key(), customer, amount)
        raise TimeoutError("gateway.internal:443 did not answer")

    guard = ledger.guard("charge_card", effect=twiceshy.KEYED, attempts=1)
    server.add_middleware(TwiceshyMiddleware(ledger, effects={"charge_card": guard}))

    async def main() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool(
                "charge_card",
                {"customer": "cus_1", "amount": 5},
                meta=scoped("run-1"),
                raise_on_error=False,
            )

    result = run(main)
    said = " ".join(text(result).split())
    assert result.is_error
    assert said.startswith(
        "The tool 'charge_card' did not finish on its one attempt (the last: ToolError: Error "
        "calling tool 'charge_card'): it may have taken effect."
    )
    assert "gateway.internal" not in said
    assert "try again" not in said.lower()
    assert len(provider.keys_seen) == 1


OPENED: list[str] = []


def open_connection() -> str:
    """A dependency (``Depends``): FastMCP resolves it for each run of the tool."""
    OPENED.append("opened")
    return "conn-1"


def test_injected_parameters_are_no_part_of_the_intent(ledger: twiceshy.Ledger) -> None:
    """A tool taking the Context and a dependency: "5", 5 and 5.0 are one intent, keyed by what
    it receives, and the dependency is resolved for the run only, never for the key."""
    provider = Provider()
    OPENED.clear()
    server = FastMCP("billing")

    @server.tool
    def charge_card(
        amount: int, ctx: Context, connection: str = Depends(open_connection)
    ) -> dict[str, Any]:
        """Charge a card."""
        assert ctx.fastmcp is server
        return provider.charge(twiceshy.current_key(), connection, amount)

    server.add_middleware(TwiceshyMiddleware(ledger, effects={"charge_card": twiceshy.KEYED}))

    async def main() -> list[Any]:
        async with Client(server) as client:
            return [
                (await client.call_tool("charge_card", {"amount": a}, meta=scoped("r"))).data
                for a in ("5", 5, 5.0)
            ]

    assert run(main) == [{"id": "ch_1", "amount": 5}] * 3
    assert len(provider.keys_seen) == 1
    assert provider.keys_seen[0] == twiceshy.idempotency_key("r", "charge_card", {"amount": 5})
    assert OPENED == ["opened"]


def test_annotations_decide_the_effect_class_unless_declared(ledger: twiceshy.Ledger) -> None:
    """readOnlyHint or idempotentHint: SAFE; no hint: UNSAFE; a declaration wins over hints."""
    runs: dict[str, int] = {}
    server = FastMCP("mixed")

    def count(name: str) -> int:
        runs[name] = runs.get(name, 0) + 1
        return runs[name]

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def lookup(q: str) -> int:
        """Read only."""
        return count("lookup")

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True))
    def set_flag(q: str) -> int:
        """Idempotent."""
        return count("set_flag")

    @server.tool(annotations=ToolAnnotations(destructive_hint=False))
    def append_note(q: str) -> int:
        """Neither read-only nor idempotent."""
        return count("append_note")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def declared(q: str) -> int:
        """Claims to be read-only, declared UNSAFE by the operator."""
        return count("declared")

    server.add_middleware(TwiceshyMiddleware(ledger, effects={"declared": twiceshy.UNSAFE}))

    async def main() -> dict[str, list[CallToolResult]]:
        async with Client(server) as client:
            out: dict[str, list[CallToolResult]] = {}
            for name in ("lookup", "set_flag", "append_note", "declared"):
                out[name] = [
                    await client.call_tool(name, {"q": "x"}, meta=scoped("run-1")) for _ in "12"
                ]
            # SAFE tools are not recorded and need no scope at all.
            out["lookup"].append(await client.call_tool("lookup", {"q": "x"}))
            return out

    results = run(main)
    assert runs == {"lookup": 3, "set_flag": 2, "append_note": 1, "declared": 1}
    assert [r.data for r in results["append_note"]] == [1, 1]
    assert [r.data for r in results["declared"]] == [1, 1]


def test_omitted_default_and_explicit_default_are_one_intent(ledger: twiceshy.Ledger) -> None:
    """A client leaving out a defaulted argument, then sending its default, runs the tool once."""
    sent: list[tuple[str, bool]] = []
    server = FastMCP("mailer")

    @server.tool(annotations=ToolAnnotations(destructive_hint=False))
    def send_mail(to: str, urgent: bool = False) -> str:
        """Send an e-mail."""
        sent.append((to, urgent))
        return f"mail {len(sent)}"

    server.add_middleware(TwiceshyMiddleware(ledger))

    async def main() -> list[str]:
        async with Client(server) as client:
            return [
                text(await client.call_tool("send_mail", args, meta=scoped("run-1")))
                for args in (
                    {"to": "a@b.c"},
                    {"to": "a@b.c", "urgent": False},
                    {"to": "a@b.c", "urgent": True},
                )
            ]

    assert run(main) == ["mail 1", "mail 1", "mail 2"]
    assert sent == [("a@b.c", False), ("a@b.c", True)]


class Declined(Exception):
    """The provider refused the charge: it certainly did not happen."""


@pytest.mark.parametrize("mask", [True, False])
def test_a_definite_failure_is_replayed_as_the_same_error_result(
    ledger: twiceshy.Ledger, mask: bool
) -> None:
    """A failure declared definite reaches a retry as the first call's isError result, once."""
    attempts: list[int] = []
    server = FastMCP("billing", mask_error_details=mask)

    @server.tool
    def charge_card(amount: int) -> str:
        """Charge a card."""
        attempts.append(amount)
        raise Declined("card declined by issuer 4711")

    guard = ledger.guard("charge_card", effect=twiceshy.UNSAFE, definite=(Declined,))
    server.add_middleware(TwiceshyMiddleware(ledger, effects={"charge_card": guard}))

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool(
                    "charge_card", {"amount": 5}, meta=scoped("run-1"), raise_on_error=False
                )
                for _ in "12"
            ]

    first, second = run(main)
    assert first.is_error
    assert second.is_error
    detail = "" if mask else ": card declined by issuer 4711"
    assert text(first) == text(second) == f"Error calling tool 'charge_card'{detail}"
    assert attempts == [5]


def test_missing_scope_is_an_error_and_nothing_runs(ledger: twiceshy.Ledger) -> None:
    """A call without the scope in _meta gets isError naming the key, and the tool never runs."""
    sent: list[str] = []
    server = FastMCP("mailer")

    @server.tool
    def send_mail(to: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return "sent"

    server.add_middleware(TwiceshyMiddleware(ledger))

    async def main() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool(
                "send_mail", {"to": "ada@example.com"}, raise_on_error=False
            )

    result = run(main)
    assert result.is_error
    assert SCOPE_META_KEY in text(result)
    assert "did not run" in text(result)
    assert sent == []


def test_two_scopes_both_execute(ledger: twiceshy.Ledger) -> None:
    """Two runs calling a tool with the same arguments are two intents; a repeat replays."""
    sent: list[str] = []
    server = FastMCP("mailer")

    @server.tool
    def send_mail(to: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return f"mail {len(sent)} sent"

    server.add_middleware(TwiceshyMiddleware(ledger))
    args = {"to": "ada@example.com"}

    async def main() -> list[str]:
        async with Client(server) as client:
            return [
                text(await client.call_tool("send_mail", args, meta=scoped(scope)))
                for scope in ("run-a", "run-b", "run-a")
            ]

    assert run(main) == ["mail 1 sent", "mail 2 sent", "mail 1 sent"]
    assert len(sent) == 2


def test_explicit_key_and_scope_fallback(ledger: twiceshy.Ledger) -> None:
    """A key sent in _meta is the one the tool sees; without one, the scope= fallback names it."""
    keys: list[str | None] = []
    server = FastMCP("billing")

    @server.tool
    def charge_card(amount: int) -> int:
        """Charge a card."""
        keys.append(twiceshy.current_key())
        return len(keys)

    server.add_middleware(
        TwiceshyMiddleware(
            ledger, effects={"charge_card": twiceshy.KEYED}, scope=lambda context: "tenant-42"
        )
    )

    async def main() -> list[Any]:
        async with Client(server) as client:
            by_key = [
                (await client.call_tool("charge_card", {"amount": 1}, meta={KEY_META_KEY: k})).data
                for k in ("order-7-charge", "order-7-charge")
            ]
            by_fallback = [
                (await client.call_tool("charge_card", {"amount": 1})).data for _ in "12"
            ]
            return by_key + by_fallback

    assert run(main) == [1, 1, 2, 2]
    assert keys[0] == "order-7-charge"
    assert keys[1] == twiceshy.idempotency_key("tenant-42", "charge_card", {"amount": 1})


def test_refused_arguments_and_unknown_tools_pass_through(ledger: twiceshy.Ledger) -> None:
    """Invalid arguments get FastMCP's validation error (not 'outcome unknown'); a fix runs."""
    sent: list[int] = []
    server = FastMCP("mailer")

    @server.tool
    def send_mail(count: int) -> str:
        """Send some e-mails."""
        sent.append(count)
        return "sent"

    server.add_middleware(TwiceshyMiddleware(ledger))

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            calls = [
                client.call_tool(name, {"count": value}, meta=scoped("run-1"), raise_on_error=False)
                for name, value in (("send_mail", "many"), ("send_mail", "many"), ("nope", 1))
            ]
            results = [await call for call in calls]
            results.append(await client.call_tool("send_mail", {"count": 2}, meta=scoped("run-1")))
            return results

    bad, again, unknown, good = run(main)
    for refused in (bad, again):
        assert refused.is_error
        assert "validation error" in text(refused)
    assert unknown.is_error
    assert "Unknown tool" in text(unknown)
    assert not good.is_error
    assert sent == [2]


def test_a_duplicate_still_running_gets_in_progress(ledger: twiceshy.Ledger) -> None:
    """A duplicate that outwaits its bound reads InProgress as isError; the tool runs once."""
    started: list[str] = []
    server = FastMCP("slow")

    @server.tool
    async def export(report: str) -> str:
        """A slow export."""
        started.append(report)
        await asyncio.sleep(0.5)
        return "exported"

    guard = ledger.guard("export", effect=twiceshy.UNSAFE, wait=0.05)
    server.add_middleware(TwiceshyMiddleware(ledger, effects={"export": guard}))

    async def call() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool(
                "export", {"report": "q3"}, meta=scoped("run-1"), raise_on_error=False
            )

    async def main() -> tuple[CallToolResult, CallToolResult]:
        first = asyncio.create_task(call())
        while not started:
            await asyncio.sleep(0.01)
        second = await call()
        return await first, second

    first, second = run(main)
    assert text(first) == "exported"
    assert second.is_error
    assert "still running" in text(second)
    assert "try again" not in text(second).lower()
    assert started == ["q3"]


def test_the_adapter_does_not_shadow_the_framework() -> None:
    """``twiceshy.integrations.fastmcp`` imports FastMCP's ``fastmcp`` package, not itself."""
    import fastmcp as framework

    import twiceshy.integrations.fastmcp as adapter

    assert vars(adapter)["fastmcp"] is framework
    assert "twiceshy" not in Path(framework.__file__ or "").parts
    assert issubclass(adapter.TwiceshyMiddleware, framework.server.middleware.Middleware)
