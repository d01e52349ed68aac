"""The Claude Agent SDK adapter, through real sessions: the SDK's bundled ``claude`` CLI, its
in-process MCP server and hooks, and a scripted model behind the Messages API on loopback
(scripted_messages_api.py).

The incident, re-enacted: a tool takes effect and its answer is lost (it raises after the
effect); the model calls it again under a new tool-use id, or the session is resumed after its
process was killed - and the effect happens once. The CLI is told to send nothing but its
requests to the scripted model (no telemetry, no updates, any other HTTP to a closed loopback
port).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import claude_agent_sdk
import pytest
from claude_agent_sdk import ClaudeAgentOptions, create_sdk_mcp_server, query, tool
from scripted_messages_api import MessagesAPI, Turn, tool_use

import twiceshy
from twiceshy import KEYED, UNSAFE, Ledger, State, idempotency_key
from twiceshy.integrations.claude_agent_sdk import ProtectedTools, protect

CLI = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
pytestmark = pytest.mark.skipif(
    not CLI.exists(), reason="the Claude Agent SDK's bundled claude CLI is not installed"
)

CHARGE = {"amount": 4900, "customer": "cus_1"}
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """An in-memory ledger."""
    with Ledger("memory://") as opened:
        yield opened


class Provider:
    """A payment provider double: deduplicates charges by idempotency key; counts effects."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.charges: dict[str, str] = {}

    def charge(self, key: str | None) -> str:
        """Charge once per key; a repeated key answers the first charge's id."""
        self.keys.append(key)
        if key is None:
            key = f"unkeyed-{len(self.keys)}"
        return self.charges.setdefault(key, f"ch_{len(self.charges) + 1}")

    @property
    def effects(self) -> int:
        """How many charges took effect."""
        return len(self.charges)


def text(content: str) -> dict[str, Any]:
    """An Agent SDK tool result carrying ``content``."""
    return {"content": [{"type": "text", "text": content}]}


def charge_tool(provider: Provider, timeouts: int = 1) -> Any:
    """A charge tool: each of its first ``timeouts`` runs takes effect, then times out."""
    left = [timeouts]

    @tool("charge", "Charge the customer, in cents.", {"amount": int, "customer": str})
    async def charge(args: dict[str, Any]) -> dict[str, Any]:
        charge_id = provider.charge(twiceshy.current_key())
        if left[0] > 0:
            left[0] -= 1
            raise TimeoutError("read timed out")
        return text(charge_id)

    return charge


def calls(name: str, args: dict[str, Any], *ids: str) -> list[Turn]:
    """The model's turns calling the billing server's tool ``name``, one turn per id."""
    return [tool_use(f"mcp__billing__{name}", args, i) for i in ids]


def session(
    api: MessagesAPI,
    tools: ProtectedTools | list[Any],
    home: Path,
    *,
    session_id: str | None = None,
    resume: str | None = None,
    hooks: bool = True,
    scope: str | None = None,
) -> list[Any]:
    """Run one Agent SDK session against the scripted model; its messages."""

    async def go() -> list[Any]:
        with api.serve() as base:
            options = ClaudeAgentOptions(
                mcp_servers={"billing": create_sdk_mcp_server("billing", tools=tools)},
                allowed_tools=[f"mcp__billing__{t.name}" for t in tools],
                hooks=tools.hooks if hooks and isinstance(tools, ProtectedTools) else None,
                env=cli_env(base, home),
                cwd=str(home),
                setting_sources=[],
                max_turns=10,
                session_id=session_id,
                resume=resume,
            )
            run = twiceshy.run(scope) if scope is not None else contextlib.nullcontext()
            async with run:
                return [message async for message in query(prompt="go", options=options)]

    return asyncio.run(asyncio.wait_for(go(), 120))


def cli_env(base: str, home: Path) -> dict[str, str]:
    """The CLI's environment: the scripted model, a home of its own, no other traffic."""
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens
    return {
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": "sk-scripted",
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # MCP tools in the prompt: with tool search the CLI appends "call the tool again" to
        # an error of a tool whose schema the (scripted) model did not load first.
        "ENABLE_TOOL_SEARCH": "false",
        "HTTPS_PROXY": closed,
        "HTTP_PROXY": closed,
        "NO_PROXY": "127.0.0.1,localhost",
    }


def assert_honest(read: tuple[str, bool]) -> None:
    """The honest answer for an unknown outcome, as an error, with no invitation to retry."""
    content, is_error = read
    assert is_error
    assert "outcome is unknown" in content
    assert "may or may not have taken effect" in content
    assert "will not be run again" in content
    assert "try again" not in content.lower()


# -- the model's re-call ---------------------------------------------------------------------


def test_an_unsafe_tool_recalled_by_the_model_runs_once(ledger: Ledger, tmp_path: Path) -> None:
    """An UNSAFE tool timed out after its effect; the model re-calls: honest text twice, one
    effect, the session id as the scope."""
    sent: list[str] = []

    @tool("notify", "Text the customer.", {"to": str, "text": str})
    async def notify(args: dict[str, Any]) -> dict[str, Any]:
        sent.append(args["text"])
        raise TimeoutError("read timed out")

    args = {"to": "+15550100", "text": "Your order shipped"}
    api = MessagesAPI(*calls("notify", args, "toolu_1", "toolu_2"))
    session_id = str(uuid.uuid4())

    session(
        api, protect([notify], ledger, effects={"notify": UNSAFE}), tmp_path, session_id=session_id
    )

    read = api.results()
    assert_honest(read["toolu_1"])
    assert read["toolu_2"] == read["toolu_1"]
    assert sent == ["Your order shipped"]
    key = idempotency_key(session_id, "notify", args)
    assert ledger.store.get("", key).record.state is State.UNKNOWN  # type: ignore[union-attr]


def test_a_keyed_charge_recalled_by_the_model_takes_effect_once(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A KEYED charge timed out on its one attempt; the re-call runs it with the same key."""
    provider = Provider()
    guard = ledger.guard("charge", effect=KEYED, attempts=1)
    tools = protect([charge_tool(provider)], ledger, effects={"charge": guard})
    api = MessagesAPI(*calls("charge", CHARGE, "toolu_1", "toolu_2", "toolu_3"))
    session_id = str(uuid.uuid4())

    session(api, tools, tmp_path, session_id=session_id)

    read = api.results()
    content, is_error = read["toolu_1"]
    assert is_error
    assert content.startswith(
        "The tool 'charge' did not finish on its one attempt (the last: TimeoutError: read timed "
        "out): it may have taken effect."
    )
    assert read["toolu_2"] == read["toolu_3"] == ("ch_1", False)
    key = idempotency_key(session_id, "charge", CHARGE)
    assert provider.keys == [key, key]  # the third call was replayed
    assert provider.effects == 1


def test_two_sessions_are_two_intents_and_twiceshy_run_names_its_own(
    ledger: Ledger, tmp_path: Path
) -> None:
    """Two sessions both charge; an enclosing twiceshy.run(...) wins over the session id."""
    provider = Provider()
    tools = protect([charge_tool(provider, timeouts=0)], ledger, effects={"charge": KEYED})

    def charge_in(session_id: str, scope: str | None = None) -> str:
        api = MessagesAPI(*calls("charge", CHARGE, "toolu_1"))
        session(api, tools, tmp_path, session_id=session_id, scope=scope)
        return api.results()["toolu_1"][0]

    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    assert [charge_in(first), charge_in(second)] == ["ch_1", "ch_2"]
    assert charge_in(str(uuid.uuid4()), scope="order-7") == "ch_3"
    assert charge_in(str(uuid.uuid4()), scope="order-7") == "ch_3"
    assert provider.keys[-1] == idempotency_key("order-7", "charge", CHARGE)


def test_a_session_without_a_scope_does_not_run_the_tool(ledger: Ledger, tmp_path: Path) -> None:
    """No hook and no twiceshy.run: the tool does not run, and the model reads why."""
    provider = Provider()
    tools = protect([charge_tool(provider)], ledger, effects={"charge": KEYED})
    api = MessagesAPI(*calls("charge", CHARGE, "toolu_1"))

    session(api, tools, tmp_path, hooks=False)

    content, is_error = api.results()["toolu_1"]
    assert is_error
    assert "did not run" in content
    assert "tools.hooks" in content
    assert provider.keys == []


def test_the_intent_is_the_validated_json_with_the_schema_defaults(
    ledger: Ledger, tmp_path: Path
) -> None:
    """Key order, an omitted default and "2" for an integer (the CLI coerces it to the schema's
    type before the call) name one intent; the hook's session id never reaches the handler."""
    received: list[dict[str, Any]] = []
    schema = {
        "type": "object",
        "properties": {
            "qty": {"type": "integer"},
            "sku": {"type": "string"},
            "express": {"type": "boolean", "default": False},
        },
        "required": ["qty", "sku"],
        "additionalProperties": False,
    }

    @tool("ship", "Ship an order.", schema)
    async def ship(args: dict[str, Any]) -> dict[str, Any]:
        received.append(dict(args))
        raise TimeoutError("read timed out")

    spellings = [
        {"qty": 2, "sku": "A-1"},
        {"sku": "A-1", "express": False, "qty": 2},
        {"qty": "2", "sku": "A-1"},
    ]
    turns = [tool_use("mcp__billing__ship", args, f"toolu_{n}") for n, args in enumerate(spellings)]
    api = MessagesAPI(*turns)
    session_id = str(uuid.uuid4())

    session(api, protect([ship], ledger, effects={"ship": UNSAFE}), tmp_path, session_id=session_id)

    read = api.results()
    assert received == [{"qty": 2, "sku": "A-1"}]
    key = idempotency_key(session_id, "ship", {"qty": 2, "sku": "A-1", "express": False})
    assert read["toolu_0"] == read["toolu_1"] == read["toolu_2"]
    assert f"reference {key[:16]}" in read["toolu_0"][0]


def test_importing_the_adapter_without_the_sdk_names_the_extra() -> None:
    """Without the Claude Agent SDK installed, the import error says which extra to install."""
    code = (
        "import sys; sys.modules['claude_agent_sdk'] = None\n"
        "try:\n    import twiceshy.integrations.claude_agent_sdk\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'twiceshy[claude-agent-sdk]'" in out.stdout


# -- processes: a race, and a crash ----------------------------------------------------------


def _booking_session(url: str, effects: Path, home: Path, barrier: Any, out: Any) -> None:
    """A process: a session whose UNSAFE tool books a room slowly, on a shared ledger."""
    with Ledger(url) as ledger:

        @tool("book_room", "Book a room for a night.", {"room": str, "night": str})
        async def book_room(args: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(0.5)
            with effects.open("a", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
            return text(f"booked {args['room']} by {os.getpid()}")

        guard = ledger.guard("book_room", effect=UNSAFE, wait=30)
        tools = protect([book_room], ledger, effects={"book_room": guard})
        api = MessagesAPI(*calls("book_room", {"room": "101", "night": "2026-07-28"}, "toolu_1"))
        own = home / str(os.getpid())
        own.mkdir()
        barrier.wait(60)
        session(api, tools, own, scope="order-7")
        out.put(api.results()["toolu_1"])


def test_two_processes_racing_one_intent_run_it_once(tmp_path: Path) -> None:
    """Two sessions in two processes, one order's intent at once: one booking, one answer."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    effects = tmp_path / "effects"
    barrier, out = SPAWN.Barrier(2), SPAWN.Queue()
    racers = [
        SPAWN.Process(target=_booking_session, args=(url, effects, tmp_path, barrier, out))
        for _ in range(2)
    ]
    for racer in racers:
        racer.start()
    try:
        answers = [out.get(timeout=150) for _ in racers]
    finally:
        for racer in racers:
            racer.join(30)
            if racer.is_alive():
                racer.kill()
    booker = effects.read_text(encoding="utf-8").split()
    assert len(booker) == 1
    assert answers == [(f"booked 101 by {booker[0]}", False)] * 2


def _charging_session(
    url: str, effects: Path, home: Path, session_id: str, effect: str, crash: bool, out: Any
) -> None:
    """A process running the session: its charge takes effect, then (when ``crash``) the
    process dies by SIGKILL; otherwise it resumes the session."""
    with Ledger(url) as ledger:

        @tool("charge", "Charge the customer, in cents.", {"amount": int, "customer": str})
        async def charge(args: dict[str, Any]) -> dict[str, Any]:
            key = twiceshy.current_key()
            seen = effects.read_text(encoding="utf-8").split() if effects.exists() else []
            if key in seen:  # the provider deduplicates by key
                return text("ch_1")
            with effects.open("a", encoding="utf-8") as f:
                f.write(f"{key}\n")
            if crash:
                os.kill(os.getpid(), signal.SIGKILL)
            return text(f"ch_{len(seen) + 1}")

        guard = ledger.guard("charge", effect=twiceshy.Effect(effect), lease=0.5, wait=5)
        tools = protect([charge], ledger, effects={"charge": guard})
        api = MessagesAPI(*calls("charge", CHARGE, f"toolu_{int(crash)}"))
        if crash:
            session(api, tools, home, session_id=session_id)
        else:
            session(api, tools, home, resume=session_id)
        out.put(api.results())


@pytest.mark.parametrize("effect", [KEYED, UNSAFE], ids=["keyed", "unsafe"])
def test_a_session_killed_inside_its_tool_and_resumed(tmp_path: Path, effect: Any) -> None:
    """kill -9 after the charge, then the session resumed: KEYED runs again with the same key
    (one charge, its id), UNSAFE reads the honest text (no second charge)."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    effects = tmp_path / "effects"
    session_id = str(uuid.uuid4())
    out = SPAWN.Queue()
    args = (url, effects, tmp_path, session_id, effect.value)
    crashed = SPAWN.Process(target=_charging_session, args=(*args, True, out))
    crashed.start()
    crashed.join(150)
    assert crashed.exitcode == -signal.SIGKILL
    # The dead owner's claim lapses 0.5 s after it was made; the resumed session's call waits
    # for that (wait=5) where its process starts sooner.
    resumed = SPAWN.Process(target=_charging_session, args=(*args, False, out))
    resumed.start()
    try:
        read = out.get(timeout=150)
    finally:
        resumed.join(30)
    key = idempotency_key(session_id, "charge", CHARGE)
    assert effects.read_text(encoding="utf-8").split() == [key]
    if effect is KEYED:
        assert read["toolu_0"] == ("ch_1", False)
    else:
        assert_honest(read["toolu_0"])
