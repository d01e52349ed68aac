"""What the Strands tests share: the smallest scripted model Strands can run (a ``Model``
streaming tool uses from a script, no network), and the processes the race and crash tests run.

Importable by child processes (``multiprocessing`` spawn), so it holds everything they need.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncGenerator, Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from provider_log import CHARGE, Provider
from strands import Agent, tool
from strands.models.model import Model
from strands.session.file_session_manager import FileSessionManager

import twiceshy
from twiceshy.integrations.strands import TwiceshyPlugin

Call = tuple[str, str, dict[str, Any]]
"""One tool use the model makes: (toolUseId, tool name, input)."""


class ScriptedModel(Model):
    """A model that streams each turn of its script (tool uses), then a final text; it keeps
    every request's messages, so a test reads what the model was told."""

    def __init__(self, *turns: Sequence[Call]) -> None:
        self.turns = [list(turn) for turn in turns]
        self.requests: list[list[dict[str, Any]]] = []

    def update_config(self, **model_config: Any) -> None:
        """Nothing to configure."""

    def get_config(self) -> dict[str, Any]:
        """No configuration."""
        return {}

    def structured_output(self, *args: Any, **kwargs: Any) -> Any:
        """Not used by these tests."""
        raise NotImplementedError

    async def stream(  # type: ignore[override]
        self, messages: Any, tool_specs: Any = None, system_prompt: Any = None, **kwargs: Any
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The next turn of the script, as a provider streams it."""
        self.requests.append([dict(message) for message in messages])
        yield {"messageStart": {"role": "assistant"}}
        if not self.turns:
            yield {"contentBlockStart": {"start": {}}}
            yield {"contentBlockDelta": {"delta": {"text": "done"}}}
            yield {"contentBlockStop": {}}
            yield {"messageStop": {"stopReason": "end_turn"}}
            return
        for use_id, name, args in self.turns.pop(0):
            yield {"contentBlockStart": {"start": {"toolUse": {"toolUseId": use_id, "name": name}}}}
            yield {"contentBlockDelta": {"delta": {"toolUse": {"input": json.dumps(args)}}}}
            yield {"contentBlockStop": {}}
        yield {"messageStop": {"stopReason": "tool_use"}}

    def results(self, request: int = -1) -> dict[str, dict[str, Any]]:
        """The tool results the model read in one request (its last by default), by id."""
        found: dict[str, dict[str, Any]] = {}
        for message in self.requests[request]:
            for block in message.get("content", []):
                result = block.get("toolResult")
                if result is not None:
                    found[result["toolUseId"]] = result
        return found

    def texts(self, request: int = -1) -> dict[str, str]:
        """The text of each tool result the model read, by id."""
        return {
            use_id: " ".join(part.get("text", "") for part in result["content"])
            for use_id, result in self.results(request).items()
        }


# -- the processes of the race and crash tests ------------------------------------------------


def agent_process(
    url: str,
    log: str,
    effect: str,
    session: str,
    sessions: str,
    *,
    crash: bool = False,
    lease: float = 30.0,
    pause: float = 0.0,
    barrier: Barrier | None = None,
) -> str:
    """One process running the agent once, its conversation kept by a ``FileSessionManager``
    of id ``session`` under ``sessions``: the model calls ``charge`` (t1), then answers. With
    ``crash``, the process dies by SIGKILL right after the charge, before its answer is
    recorded; with ``pause``, the charge takes that long.

    Returns the text the model read for its call.
    """
    provider = Provider(Path(log))

    @tool
    async def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents.

        Args:
            amount: in cents.
            customer: the customer's id.
        """
        charge_id = provider.charge(twiceshy.current_key(), amount, customer)
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(pause)
        return charge_id

    with twiceshy.Ledger(url) as ledger:
        guard = ledger.guard("charge", effect=twiceshy.Effect(effect), lease=lease, attempts=1)
        model = ScriptedModel([("t1", "charge", CHARGE)])
        agent = Agent(
            model=model,
            tools=[charge],
            callback_handler=None,
            session_manager=FileSessionManager(session_id=session, storage_dir=sessions),
            plugins=[TwiceshyPlugin(ledger, {"charge": guard})],
        )
        if barrier is not None:
            barrier.wait(timeout=60)
        agent("charge the customer")
        return model.texts()["t1"]


def racer(url: str, log: str, sessions: str, barrier: Barrier, out: Any) -> None:
    """A racing process: wait for the other, run the agent, report what the model read."""
    try:
        read = agent_process(
            url, log, "unsafe", "race", f"{sessions}/{os.getpid()}", pause=0.5, barrier=barrier
        )
        out.put(("ok", read))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
