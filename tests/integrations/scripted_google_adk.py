"""What the Google ADK tests share: the smallest scripted models ADK can run (``BaseLlm``
subclasses answering from a script, no network), a run of an agent to its end, and the
processes the race and crash tests run.

Importable by child processes (``multiprocessing`` spawn), so it holds everything they need.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncGenerator, Callable, Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from google.adk.agents import LlmAgent
from google.adk.apps import App
from google.adk.models import BaseLlm, LlmRequest, LlmResponse
from google.adk.plugins import BasePlugin
from google.adk.runners import InMemoryRunner
from google.genai import types
from provider_log import CHARGE, Provider
from pydantic import PrivateAttr

import twiceshy
from twiceshy.integrations.google_adk import protect

Call = tuple[str, str, dict[str, Any]]
"""One function call the model makes: (call id, tool name, arguments)."""

APP = "billing-app"
USER = "ann"


class ScriptedModel(BaseLlm):
    """A model that answers each request with the next turn of its script (function calls),
    then with a final text; it keeps every request, so a test reads what the model was told."""

    model: str = "scripted"
    _turns: list[list[Call]] = PrivateAttr(default_factory=list)
    _requests: list[LlmRequest] = PrivateAttr(default_factory=list)

    @classmethod
    def of(cls, *turns: Sequence[Call]) -> ScriptedModel:
        """A model calling the tools of each turn in order, then answering "done"."""
        model = cls()
        model._turns = [list(turn) for turn in turns]
        return model

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        """The next turn of the script."""
        self._requests.append(llm_request)
        if not self._turns:
            text = types.Part.from_text(text="done")
            yield LlmResponse(content=types.Content(role="model", parts=[text]))
            return
        parts = [
            types.Part(function_call=types.FunctionCall(id=call_id, name=name, args=args))
            for call_id, name, args in self._turns.pop(0)
        ]
        yield LlmResponse(content=types.Content(role="model", parts=parts))

    @property
    def answered(self) -> int:
        """How many requests the model has answered."""
        return len(self._requests)

    def results(self, request: int = -1) -> dict[str, Any]:
        """The function responses the model read in one request (its last by default), by id."""
        found: dict[str, Any] = {}
        for content in self._requests[request].contents:
            for part in content.parts or []:
                if part.function_response is not None:
                    found[str(part.function_response.id)] = part.function_response.response
        return found


class Relay(BaseLlm):
    """A model for an agent asked one thing per run (an agent tool's agent, an agent a trigger
    starts): it calls its tool with the arguments it reads in the user's message, then answers
    with the text ``<tool> answered <the tool's response as JSON>``."""

    model: str = "relay"
    _tool: str = PrivateAttr(default="")
    _read: tuple[Callable[[str], dict[str, Any]]] = PrivateAttr(default=(json.loads,))
    _calls: int = PrivateAttr(default=0)

    @classmethod
    def of(cls, tool: str, arguments: Callable[[str], dict[str, Any]] = json.loads) -> Relay:
        """A model calling ``tool`` with ``arguments(message)`` (the message as JSON by default)."""
        model = cls()
        model._tool = tool
        model._read = (arguments,)  # in a tuple: a function kept as an attribute would bind
        return model

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        """The call of the tool for a new message; the answer once the tool has responded."""
        last = llm_request.contents[-1]
        answered = [p.function_response for p in last.parts or [] if p.function_response]
        if answered:
            text = f"{self._tool} answered {json.dumps(answered[-1].response, sort_keys=True)}"
            yield LlmResponse(content=types.Content(role="model", parts=[types.Part(text=text)]))
            return
        self._calls += 1
        message = "".join(part.text or "" for part in last.parts or [])
        call = types.FunctionCall(
            id=f"{self._tool}-{self._calls}", name=self._tool, args=self._read[0](message)
        )
        yield LlmResponse(
            content=types.Content(role="model", parts=[types.Part(function_call=call)])
        )


def run(
    agent: LlmAgent,
    session: str = "session-1",
    *,
    scope: str | None = None,
    message: types.Content | None = None,
    runner: InMemoryRunner | None = None,
    plugins: Sequence[BasePlugin] = (),
) -> InMemoryRunner:
    """Run the agent (in an app with ``plugins``) on a session of that id (made if new) until
    it stops, inside ``twiceshy.run(scope)`` when given; answers the runner, to run it again."""
    if runner is None:
        app = App(name=APP, root_agent=agent, plugins=list(plugins))
        runner = InMemoryRunner(app=app)
    message = message or types.Content(role="user", parts=[types.Part.from_text(text="go")])

    async def go() -> None:
        service = runner.session_service
        if await service.get_session(app_name=APP, user_id=USER, session_id=session) is None:
            await service.create_session(app_name=APP, user_id=USER, session_id=session)
        async for _event in runner.run_async(user_id=USER, session_id=session, new_message=message):
            pass

    async def scoped() -> None:
        if scope is None:
            await go()
            return
        async with twiceshy.run(scope):
            await go()

    asyncio.run(scoped())
    return runner


def responses(runner: InMemoryRunner, session: str = "session-1") -> dict[str, Any]:
    """Every function response recorded in the session, by function-call id."""

    async def events() -> list[Any]:
        found = await runner.session_service.get_session(
            app_name=APP, user_id=USER, session_id=session
        )
        return list(found.events) if found is not None else []

    return {
        str(part.function_response.id): part.function_response.response
        for event in asyncio.run(events())
        for part in (event.content.parts if event.content else [])
        if part.function_response is not None
    }


def calls(runner: InMemoryRunner, session: str = "session-1") -> dict[str, Any]:
    """Every function call recorded in the session, by id: the model's and ADK's own."""

    async def events() -> list[Any]:
        found = await runner.session_service.get_session(
            app_name=APP, user_id=USER, session_id=session
        )
        return list(found.events) if found is not None else []

    return {
        str(part.function_call.id): part.function_call
        for event in asyncio.run(events())
        for part in (event.content.parts if event.content else [])
        if part.function_call is not None
    }


# -- the processes of the race and crash tests ------------------------------------------------


def agent_process(
    url: str,
    log: str,
    effect: str,
    session: str,
    *,
    crash: bool = False,
    lease: float = 30.0,
    pause: float = 0.0,
    barrier: Barrier | None = None,
) -> Any:
    """One process running the agent once on ``session``: the model calls ``charge`` (c1),
    then answers. With ``crash``, the process dies by SIGKILL right after the charge, before
    its answer is recorded; with ``pause``, the charge takes that long.

    Returns what the model read for its call.
    """
    provider = Provider(Path(log))

    async def charge(amount: int, customer: str) -> str:
        """Charge the customer, in cents."""
        charge_id = provider.charge(twiceshy.current_key(), amount, customer)
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(pause)
        return charge_id

    with twiceshy.Ledger(url) as ledger:
        guard = ledger.guard("charge", effect=twiceshy.Effect(effect), lease=lease, attempts=1)
        model = ScriptedModel.of([("c1", "charge", CHARGE)])
        tools = protect([charge], ledger, effects={"charge": guard})
        agent = LlmAgent(name="billing", model=model, tools=tools)
        if barrier is not None:
            barrier.wait(timeout=60)
        run(agent, session)
        return model.results()["c1"]


def racer(url: str, log: str, barrier: Barrier, out: Any) -> None:
    """A racing process: wait for the other, run the agent, report what the model read."""
    try:
        out.put(("ok", agent_process(url, log, "unsafe", "race", pause=0.5, barrier=barrier)))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
