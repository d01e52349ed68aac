"""twiceshy in an MCP server of the official ``mcp`` SDK (2.x), through real clients and servers.

In-process pairs use the SDK's own in-memory transport (``mcp.Client(server)``); the race runs a
server process on streamable HTTP (and stdio servers sharing one SQLite ledger) with two client
processes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import mcp_server_app
import pytest
from mcp import Client
from mcp.server.mcpserver import Context, MCPServer, Resolve
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, InputRequiredResult, RequestParamsMeta, ToolAnnotations

import twiceshy
from twiceshy.integrations.mcp import (
    KEY_META_KEY,
    SCOPE_META_KEY,
    ToolFailed,
    TwiceshyMiddleware,
    effect_from_annotations,
    protect,
    twiceshy_meta,
)

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run an async test body, bounded in time."""

    async def bounded() -> T:
        return await asyncio.wait_for(main(), 60)

    return asyncio.run(bounded())


def scoped(scope: str) -> RequestParamsMeta:
    """The ``_meta`` a client sends to name its run."""
    meta = twiceshy_meta(scope)
    assert meta == {SCOPE_META_KEY: scope}
    return meta


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


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[twiceshy.Ledger]:
    with twiceshy.Ledger("sqlite:///" + str(tmp_path / "ledger.db")) as opened:
        yield opened


def test_keyed_tool_replays_after_a_timeout(ledger: twiceshy.Ledger) -> None:
    """The incident, KEYED: the charge lands, then times out; the client's retry gets it once."""
    provider = Provider()
    server: MCPServer[Any] = MCPServer("billing")

    @server.tool()
    def charge_card(customer: str, amount: int) -> dict[str, Any]:
        """Charge a card."""
        charge = provider.charge(twiceshy.current_key(), customer, amount)
        if len(provider.keys_seen) == 1:
            raise TimeoutError("the payment gateway did not answer in time")
        return charge

    # One attempt per call, so that the client's own retry is what recovers.
    guard = ledger.guard("charge_card", effect=twiceshy.KEYED, attempts=1)
    protect(server, ledger, effects={"charge_card": guard})
    args = {"customer": "cus_1", "amount": 4900}

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool("charge_card", args, meta=scoped("run-1")) for _ in "123"
            ]

    first, second, third = run(main)
    assert first.is_error  # out of its one attempt: it may have taken effect
    assert "did not finish on its one attempt" in text(first)
    assert "calling it again later with the same arguments is safe" in text(first)
    assert not second.is_error
    assert second.structured_content == {"id": "ch_1", "amount": 4900}
    assert third.structured_content == second.structured_content
    assert len(provider.charges) == 1
    assert len(provider.keys_seen) == 2  # the replay did not reach the provider
    assert provider.keys_seen[0] == provider.keys_seen[1]


def test_keyed_tool_is_retried_in_place_with_the_same_key(ledger: twiceshy.Ledger) -> None:
    """A KEYED tool's timeout is retried inside the call with the same key; one charge."""
    provider = Provider()
    server: MCPServer[Any] = MCPServer("billing")

    @server.tool()
    async def charge_card(customer: str, amount: int) -> dict[str, Any]:
        """Charge a card."""
        charge = provider.charge(twiceshy.current_key(), customer, amount)
        if len(provider.keys_seen) == 1:
            raise TimeoutError("the payment gateway did not answer in time")
        return charge

    protect(server, ledger, effects={"charge_card": twiceshy.KEYED})

    async def main() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool(
                "charge_card", {"customer": "cus_1", "amount": 4900}, meta=scoped("run-1")
            )

    result = run(main)
    assert not result.is_error
    assert result.structured_content == {"id": "ch_1", "amount": 4900}
    assert len(provider.charges) == 1
    assert len(set(provider.keys_seen)) == 1
    assert len(provider.keys_seen) == 2


def test_unsafe_tool_answers_honestly_after_a_timeout(ledger: twiceshy.Ledger) -> None:
    """The incident, UNSAFE: the mail goes out, then times out; retries read the honest text."""
    sent: list[str] = []
    server: MCPServer[Any] = MCPServer("mailer")

    @server.tool()
    def send_mail(to: str, subject: str) -> str:
        """Send an e-mail (no annotations: UNSAFE)."""
        sent.append(to)
        raise TimeoutError("the mail server did not answer in time")

    protect(server, ledger)
    args = {"to": "ada@example.com", "subject": "Your invoice"}

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [await client.call_tool("send_mail", args, meta=scoped("run-1")) for _ in "12"]

    first, second = run(main)
    assert_honest(first)
    assert_honest(second)
    assert sent == ["ada@example.com"]


def test_annotations_decide_the_effect_class_unless_declared(ledger: twiceshy.Ledger) -> None:
    """readOnlyHint or idempotentHint: SAFE; no hint: UNSAFE; a declaration wins over hints."""
    runs: dict[str, int] = {}
    server: MCPServer[Any] = MCPServer("mixed")

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

    protect(server, ledger, effects={"declared": twiceshy.UNSAFE})

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
    assert [r.structured_content for r in results["append_note"]] == [{"result": 1}] * 2
    assert [r.structured_content for r in results["declared"]] == [{"result": 1}] * 2
    assert effect_from_annotations(None) is twiceshy.UNSAFE
    assert effect_from_annotations(ToolAnnotations()) is twiceshy.UNSAFE
    assert effect_from_annotations(ToolAnnotations(read_only_hint=True)) is twiceshy.SAFE
    assert effect_from_annotations(ToolAnnotations(idempotent_hint=True)) is twiceshy.SAFE


def test_omitted_default_and_explicit_default_are_one_intent(ledger: twiceshy.Ledger) -> None:
    """A client leaving out a defaulted argument, then sending its default, runs the tool once."""
    sent: list[tuple[str, bool]] = []
    server: MCPServer[Any] = MCPServer("mailer")

    @server.tool()
    def send_mail(to: str, urgent: bool = False) -> str:
        """Send an e-mail."""
        sent.append((to, urgent))
        return f"mail {len(sent)}"

    protect(server, ledger, effects={"send_mail": twiceshy.UNSAFE})

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


REGIONS: list[str] = []


def region_of_the_account() -> str:
    """A resolver (``Resolve``): the SDK fills the ``region`` parameter with its answer."""
    REGIONS.append("looked up")
    return "eu"


def test_injected_parameters_are_no_part_of_the_intent(ledger: twiceshy.Ledger) -> None:
    """A tool taking the Context and a resolved parameter: "5" and 5 are one intent, keyed by
    what it receives, and the SDK resolves the parameter only for the run."""
    provider = Provider()
    REGIONS.clear()
    server: MCPServer[Any] = MCPServer("billing")

    @server.tool()
    def create_charge(
        amount: int, ctx: Context, region: Annotated[str, Resolve(region_of_the_account)]
    ) -> dict[str, Any]:
        """Charge a card."""
        assert ctx.request_context is not None
        return provider.charge(twiceshy.current_key(), region, amount)

    protect(server, ledger, effects={"create_charge": twiceshy.KEYED})

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool("create_charge", {"amount": amount}, meta=scoped("r"))
                for amount in ("5", 5, 5.0)
            ]

    answers = run(main)
    assert [a.structured_content for a in answers] == [{"id": "ch_1", "amount": 5}] * 3
    assert len(provider.keys_seen) == 1
    assert provider.keys_seen[0] == twiceshy.idempotency_key("r", "create_charge", {"amount": 5})
    assert REGIONS == ["looked up"]


def test_missing_scope_is_an_error_and_nothing_runs(ledger: twiceshy.Ledger) -> None:
    """A call without the scope in _meta gets isError naming the key, and the tool never runs."""
    sent: list[str] = []
    server: MCPServer[Any] = MCPServer("mailer")

    @server.tool()
    def send_mail(to: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return "sent"

    protect(server, ledger)

    async def main() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool("send_mail", {"to": "ada@example.com"})

    result = run(main)
    assert result.is_error
    assert SCOPE_META_KEY in text(result)
    assert "did not run" in text(result)
    assert sent == []


def test_two_scopes_both_execute(ledger: twiceshy.Ledger) -> None:
    """Two runs calling a tool with the same arguments are two intents; a repeat replays."""
    sent: list[str] = []
    server: MCPServer[Any] = MCPServer("mailer")

    @server.tool()
    def send_mail(to: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return f"mail {len(sent)} sent"

    protect(server, ledger)
    args = {"to": "ada@example.com"}

    async def main() -> list[str]:
        async with Client(server) as client:
            return [
                text(await client.call_tool("send_mail", args, meta=scoped(scope)))
                for scope in ("run-a", "run-b", "run-a")
            ]

    assert run(main) == ["mail 1 sent", "mail 2 sent", "mail 1 sent"]
    assert len(sent) == 2


def test_explicit_key_in_meta_is_the_intent_key(ledger: twiceshy.Ledger) -> None:
    """A key sent in _meta is the one the tool sees, and needs no scope."""
    keys: list[str | None] = []
    server: MCPServer[Any] = MCPServer("billing")

    @server.tool()
    def charge_card(amount: int) -> int:
        """Charge a card."""
        keys.append(twiceshy.current_key())
        return len(keys)

    protect(server, ledger, effects={"charge_card": twiceshy.KEYED})

    async def main() -> list[str]:
        async with Client(server) as client:
            return [
                text(
                    await client.call_tool("charge_card", {"amount": 1}, meta=twiceshy_meta(key=k))
                )
                for k in ("order-7-charge", "order-7-charge")
            ]

    assert run(main) == ["1", "1"]
    assert keys == ["order-7-charge"]
    assert twiceshy_meta(key="k") == {KEY_META_KEY: "k"}
    with pytest.raises(ValueError, match="scope"):
        twiceshy_meta()


def test_scope_fallback_is_asked_when_meta_names_none(ledger: twiceshy.Ledger) -> None:
    """With a scope= fallback, a call without _meta scope runs under the fallback's scope."""
    sent: list[str] = []
    server: MCPServer[Any] = MCPServer("mailer")

    @server.tool()
    def send_mail(to: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return f"mail {len(sent)} sent"

    protect(server, ledger, scope=lambda ctx: "tenant-42")

    async def main() -> list[str]:
        async with Client(server) as client:
            return [text(await client.call_tool("send_mail", {"to": "a@b.c"})) for _ in "12"]

    assert run(main) == ["mail 1 sent", "mail 1 sent"]
    assert sent == ["a@b.c"]


def test_calls_the_server_refuses_are_not_claimed(ledger: twiceshy.Ledger) -> None:
    """Invalid arguments and unknown tools get the SDK's own answer, never 'outcome unknown'."""
    sent: list[int] = []
    server: MCPServer[Any] = MCPServer("mailer")

    @server.tool()
    def send_mail(count: int) -> str:
        """Send some e-mails."""
        sent.append(count)
        return "sent"

    protect(server, ledger, effects={"ghost": twiceshy.UNSAFE})  # declared, never registered
    calls = [("send_mail", "many"), ("send_mail", "many"), ("ghost", 1), ("ghost", 1)]

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            results = [
                await client.call_tool(name, {"count": value}, meta=scoped("run-1"))
                for name, value in calls
            ]
            results.append(await client.call_tool("send_mail", {"count": 2}, meta=scoped("run-1")))
            return results

    *refused, good = run(main)
    for result, expected in zip(
        refused, ["validation error"] * 2 + ["Unknown tool"] * 2, strict=True
    ):
        assert result.is_error
        assert expected in text(result)
    assert not good.is_error
    assert sent == [2]


def test_a_duplicate_still_running_gets_in_progress(ledger: twiceshy.Ledger) -> None:
    """A duplicate that outwaits its bound reads InProgress as isError; the tool runs once."""
    started: list[str] = []
    server: MCPServer[Any] = MCPServer("slow")

    @server.tool()
    async def export(report: str) -> str:
        """A slow export."""
        started.append(report)
        await asyncio.sleep(0.5)
        return "exported"

    protect(
        server,
        ledger,
        effects={"export": ledger.guard("export", effect=twiceshy.UNSAFE, wait=0.05)},
    )

    async def call() -> CallToolResult:
        async with Client(server) as client:
            return await client.call_tool("export", {"report": "q3"}, meta=scoped("run-1"))

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


def test_a_failure_declared_definite_is_replayed(ledger: twiceshy.Ledger) -> None:
    """With definite=[ToolFailed], an isError answer is a certain failure, replayed to retries."""
    attempts: list[int] = []
    server: MCPServer[Any] = MCPServer("billing")

    @server.tool()
    def charge_card(amount: int) -> str:
        """Charge a card."""
        attempts.append(amount)
        raise ToolError("card declined")

    guard = ledger.guard("charge_card", effect=twiceshy.UNSAFE, definite=[ToolFailed])
    protect(server, ledger, effects={"charge_card": guard})

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool("charge_card", {"amount": 5}, meta=scoped("run-1"))
                for _ in "12"
            ]

    first, second = run(main)
    assert first.is_error
    assert second.is_error
    assert text(first) == text(second) == "Error executing tool charge_card: card declined"
    assert attempts == [5]


def test_input_required_rounds_are_not_the_outcome(ledger: twiceshy.Ledger) -> None:
    """An input_required round releases the claim: the client's next round runs the tool."""
    rounds: list[str | None] = []
    server: MCPServer[Any] = MCPServer("bank")

    @server.tool()
    def transfer(amount: int, ctx: Context) -> str | InputRequiredResult:
        """Transfer money once the client confirms."""
        rounds.append(ctx.request_state)
        if ctx.request_state is None:
            return InputRequiredResult(request_state="confirmed")
        return f"transferred {amount}"

    protect(server, ledger)

    async def main() -> list[str]:
        async with Client(server) as client:
            return [
                text(await client.call_tool("transfer", {"amount": 5}, meta=scoped("run-1")))
                for _ in "12"
            ]

    assert run(main) == ["transferred 5", "transferred 5"]
    assert rounds == [None, "confirmed"]  # the client's repeat was a replay


def test_middleware_without_server_refuses_undeclared_tools(ledger: twiceshy.Ledger) -> None:
    """Passed to MCPServer(middleware=...), undeclared tools are refused; declared ones run."""
    runs: list[str] = []
    middleware = TwiceshyMiddleware(ledger, effects={"declared": twiceshy.UNSAFE})
    server: MCPServer[Any] = MCPServer("plain", middleware=[middleware])

    @server.tool()
    def declared() -> str:
        """Declared."""
        runs.append("declared")
        return "ok"

    @server.tool()
    def undeclared() -> str:
        """Not declared."""
        runs.append("undeclared")
        return "ok"

    async def main() -> list[CallToolResult]:
        async with Client(server) as client:
            return [
                await client.call_tool(name, {}, meta=scoped("run-1"))
                for name in ("declared", "undeclared")
            ]

    declared_result, undeclared_result = run(main)
    assert text(declared_result) == "ok"
    assert undeclared_result.is_error
    assert "no declared effect class" in text(undeclared_result)
    assert runs == ["declared"]


def test_a_protect_with_a_bad_declaration_fails_at_once(ledger: twiceshy.Ledger) -> None:
    """An effect that is not an effect class, or a guard of another tool, is refused up front."""
    server: MCPServer[Any] = MCPServer("x")
    with pytest.raises(TypeError, match="effects"):
        protect(server, ledger, effects={"a": "KEYED"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="another tool"):
        protect(server, ledger, effects={"a": ledger.guard("b", effect=twiceshy.KEYED)})


# -- two client processes racing one intent ---------------------------------------------------


def _wait_for_port(port_file: Path, server: subprocess.Popen[bytes], deadline: float) -> int:
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text(encoding="utf-8"))
        if server.poll() is not None:
            raise AssertionError(f"the MCP server exited early with {server.returncode}")
        time.sleep(0.05)
    raise AssertionError("the MCP server did not start in time")


def _race(target: Any, scope: str) -> list[tuple[str, Any]]:
    """Two client processes, released together, call ``book_room`` with the same scope."""
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(2)
    results = spawn.Queue()
    clients = [
        spawn.Process(target=mcp_server_app.race_client, args=(target, barrier, results, scope))
        for _ in range(2)
    ]
    try:
        for client in clients:
            client.start()
        answers = [results.get(timeout=120) for _ in clients]
        for client in clients:
            client.join(timeout=30)
        return answers
    finally:
        for client in clients:
            if client.is_alive():
                client.kill()
                client.join(timeout=10)


def test_two_client_processes_racing_one_intent_execute_once(tmp_path: Path) -> None:
    """One server on streamable HTTP, two client processes at once: one execution, one answer."""
    effects = tmp_path / "effects"
    port_file = tmp_path / "port"
    command = [
        sys.executable,
        mcp_server_app.__file__,
        "--ledger",
        "sqlite:///" + str(tmp_path / "ledger.db"),
        "--effects",
        str(effects),
        "--port-file",
        str(port_file),
    ]
    with (tmp_path / "server.log").open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            port = _wait_for_port(port_file, server, time.monotonic() + 30)
            answers = _race(f"http://127.0.0.1:{port}/mcp", "run-race")
        finally:
            server.kill()
            server.wait(timeout=10)
    assert [status for status, _ in answers] == ["ok", "ok"], answers
    assert answers[0][1] == answers[1][1]
    assert answers[0][1]["content"][0]["text"] == "booked 101 for 2026-07-28 (execution 1)"
    assert len(effects.read_text(encoding="utf-8").splitlines()) == 1


def test_two_stdio_servers_sharing_a_ledger_execute_once(tmp_path: Path) -> None:
    """Two clients, each with its own stdio server process on one SQLite ledger: one execution."""
    effects = tmp_path / "effects"
    target = mcp_server_app.stdio_target("sqlite:///" + str(tmp_path / "ledger.db"), effects)
    answers = _race(target, "run-race")
    assert [status for status, _ in answers] == ["ok", "ok"], answers
    assert answers[0][1] == answers[1][1]
    assert answers[0][1]["content"][0]["text"] == "booked 101 for 2026-07-28 (execution 1)"
    lines = effects.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1


def test_the_adapter_does_not_shadow_the_sdk() -> None:
    """``twiceshy.integrations.mcp`` imports the SDK's ``mcp`` package, not itself."""
    import mcp as sdk
    from mcp.server import mcpserver

    import twiceshy.integrations.mcp as adapter

    assert adapter.__name__ == "twiceshy.integrations.mcp"
    assert sdk.__name__ == "mcp"
    assert Path(sdk.__file__ or "").parent.name == "mcp"
    assert "twiceshy" not in Path(sdk.__file__ or "").parts
    assert vars(adapter)["MCPServer"] is mcpserver.MCPServer
