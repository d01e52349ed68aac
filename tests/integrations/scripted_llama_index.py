"""What the LlamaIndex tests share: a script for LlamaIndex's own ``MockFunctionCallingLLM``, and
the processes the race and crash tests run.

Importable by child processes (``multiprocessing`` spawn), so it holds everything they need.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.llms import MockFunctionCallingLLM
from llama_index.core.tools import FunctionTool
from provider_log import CHARGE, Provider

import twiceshy
from twiceshy.integrations.llama_index import protect

Call = tuple[str, str, dict[str, Any]]
"""One tool call the model makes: (call id, tool name, arguments)."""


class Script:
    """The model's turns: each a list of tool calls, then a final text answer. Records every
    request the agent made, so a test reads what the model was told."""

    def __init__(self, *turns: Sequence[Call], final: str = "done") -> None:
        self.turns = [list(turn) for turn in turns]
        self.final = final
        self.requests: list[list[ChatMessage]] = []

    def __call__(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatMessage:
        self.requests.append(list(messages))
        if not self.turns:
            return ChatMessage(role=MessageRole.ASSISTANT, content=self.final)
        blocks = [
            ToolCallBlock(tool_call_id=call_id, tool_name=name, tool_kwargs=args)
            for call_id, name, args in self.turns.pop(0)
        ]
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)

    def llm(self) -> MockFunctionCallingLLM:
        """LlamaIndex's fake function-calling model, answering by this script."""
        return MockFunctionCallingLLM(response_generator=self)

    def results(self, request: int = -1) -> dict[str, str]:
        """The tool results the model read in one request (its last by default), by call id."""
        return {
            str(message.additional_kwargs.get("tool_call_id")): message.content or ""
            for message in self.requests[request]
            if message.role == MessageRole.TOOL
        }


def run(agent: FunctionAgent, run_id: str | None = None, scope: str | None = None) -> str:
    """Run the agent to its end (with ``run_id`` when given, inside ``twiceshy.run(scope)``
    when given) and answer its final text."""

    async def go() -> str:
        if scope is None:
            return str(await agent.run(user_msg="go", run_id=run_id))
        async with twiceshy.run(scope):
            return str(await agent.run(user_msg="go", run_id=run_id))

    return asyncio.run(go())


# -- the processes of the race and crash tests ------------------------------------------------


def charge_tool(provider: Provider, *, crash: bool = False, pause: float = 0.0) -> FunctionTool:
    """The ``charge`` tool: an async function charging through the provider with the intent's
    key; with ``crash``, the process dies by SIGKILL right after the charge, before the answer
    is recorded; with ``pause``, the charge takes that long."""

    async def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        charge_id = provider.charge(twiceshy.current_key(), amount, customer)
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(pause)
        return charge_id

    return FunctionTool.from_defaults(async_fn=charge, name="charge")


def agent_process(
    url: str,
    log: str,
    effect: str,
    run_id: str,
    *,
    crash: bool = False,
    lease: float = 30.0,
    pause: float = 0.0,
    barrier: Barrier | None = None,
) -> list[str]:
    """One process running the agent once: the model calls ``charge`` (c1), then answers.

    Returns what the model read for its call (the crash variant never returns).
    """
    with twiceshy.Ledger(url) as ledger:
        guard = ledger.guard("charge", effect=twiceshy.Effect(effect), lease=lease, attempts=1)
        tools = protect(
            [charge_tool(Provider(Path(log)), crash=crash, pause=pause)],
            ledger,
            effects={"charge": guard},
        )
        script = Script([("c1", "charge", CHARGE)])
        agent = FunctionAgent(tools=tools, llm=script.llm())
        if barrier is not None:
            barrier.wait(timeout=60)
        run(agent, run_id=run_id)
        return list(script.results().values())


def racer(url: str, log: str, barrier: Barrier, out: Any) -> None:
    """A racing process: wait for the other, run the agent, report what the model read."""
    try:
        out.put(("ok", agent_process(url, log, "unsafe", "order-race", pause=0.5, barrier=barrier)))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
