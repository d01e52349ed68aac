"""A scripted CrewAI model: the smallest ``BaseLLM`` the CrewAI tests need (CrewAI ships none).

Each call of the model answers the next scripted turn: native tool calls (``calls(...)``), a
text (ReAct) tool call (``action(...)``), or, once the script is spent, a final answer. It keeps
every request, so a test reads what the model was told after each tool call.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

# Telemetry and tracing off before CrewAI is imported, by its own documented variables (not
# OTEL_SDK_DISABLED, which would turn off the OpenTelemetry tests' SDK too).
os.environ["CREWAI_DISABLE_TELEMETRY"] = "true"
os.environ["CREWAI_DISABLE_TRACKING"] = "true"
os.environ["CREWAI_TRACING_ENABLED"] = "false"

import pytest

# CrewAI installs only in an environment of its own (its pins clash with the other extras'):
# where it is absent, the modules that import this one are skipped.
pytest.importorskip("crewai", reason="CrewAI is not installed: pip install 'twiceshy[crewai]'")

with warnings.catch_warnings():
    # CrewAI's own package imports itself in a cycle, which Python reports as an ImportWarning.
    warnings.simplefilter("ignore", ImportWarning)
    from crewai import Agent, Crew, Task
    from crewai.llms.base_llm import BaseLLM
    from crewai.tools import BaseTool, tool
    from crewai.tools.tool_failure import ToolFailure

from pydantic import Field

__all__ = [
    "CREWAI_WARNINGS",
    "BaseTool",
    "ScriptedLLM",
    "ToolFailure",
    "action",
    "calls",
    "crew_of",
    "tool",
]

CREWAI_WARNINGS = [
    # CrewAI reads its own deprecated fields while it runs a crew (1.15): warnings it
    # attributes to itself, none of twiceshy's.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:crewai"),
]
"""Marks for a test module that runs crews: warnings CrewAI raises about itself."""

FINAL = "Thought: I have the answer\nFinal Answer: done"


class ScriptedLLM(BaseLLM):
    """Answers each request with the next turn of ``script``; records every request."""

    script: list[Any] = Field(default_factory=list)
    native: bool = True
    requests: list[list[dict[str, Any]]] = Field(default_factory=list)

    def call(  # type: ignore[override]
        self, messages: Any, tools: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        """The next scripted turn, or the final answer once the script is spent."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        self.requests.append([dict(message) for message in messages])
        if len(self.requests) > 40:
            raise AssertionError("the model was asked more often than any test scripts")
        return self.script.pop(0) if self.script else FINAL

    async def acall(  # type: ignore[override]
        self, messages: Any, tools: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        """:meth:`call`, awaited."""
        return self.call(messages, tools)

    def supports_function_calling(self) -> bool:
        """Native tool calls, or text (ReAct) ones."""
        return self.native

    def supports_stop_words(self) -> bool:
        """No stop words: the script decides where a turn ends."""
        return False

    def get_context_window_size(self) -> int:
        """Large enough for any test."""
        return 100_000

    def results(self) -> dict[str, str]:
        """What the model read for each native tool call, by call id, as first read."""
        read: dict[str, str] = {}
        for request in self.requests:
            for message in request:
                if message.get("role") == "tool":
                    read.setdefault(message["tool_call_id"], str(message["content"]))
        return read

    def observations(self) -> list[str]:
        """What the model read after each text (ReAct) tool call, in order, as first read;
        without the reminder of the tool format CrewAI appends after a few calls."""
        seen: dict[str, None] = {}
        for request in self.requests:
            for message in request:
                content = message.get("content")
                if message.get("role") == "assistant" and isinstance(content, str):
                    found = "\nObservation: " in content
                    if found:
                        seen.setdefault(content, None)
        return [content.partition("\nObservation: ")[2].split("\n\n\n")[0] for content in seen]


def calls(name: str, args: dict[str, Any] | str, *call_ids: str) -> list[dict[str, Any]]:
    """One model turn calling ``name`` natively with ``args`` (a mapping or JSON text), once
    per call id."""
    text = args if isinstance(args, str) else json.dumps(args)
    return [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}
        for call_id in call_ids
    ]


def action(name: str, args: dict[str, Any]) -> str:
    """One model turn calling ``name`` with ``args`` as text (CrewAI's ReAct format)."""
    return f"Thought: I call the tool\nAction: {name}\nAction Input: {json.dumps(args)}"


def crew_of(llm: ScriptedLLM, tools: list[Any]) -> Crew:
    """A crew of one agent with ``tools`` and one task, driven by ``llm``."""
    agent = Agent(
        role="billing clerk",
        goal="do what the task asks",
        backstory="a scripted clerk",
        llm=llm,
        tools=tools,
        verbose=False,
        max_iter=12,
    )
    task = Task(description="do it", expected_output="done", agent=agent)
    return Crew(agents=[agent], tasks=[task], verbose=False)
