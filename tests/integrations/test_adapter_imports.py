"""Every framework adapter imported without its framework: an ImportError naming the extra.

Each import runs in a fresh interpreter in which the framework's package cannot be imported
(``sys.modules[name] = None``), so these run wherever twiceshy does, frameworks installed or not.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

#: adapter module -> (the framework's package it imports first, the extra that installs it)
ADAPTERS = {
    "openai_agents": ("agents", "openai-agents"),
    "langchain": ("langchain", "langchain"),
    "pydantic_ai": ("pydantic_ai", "pydantic-ai"),
    "mcp": ("mcp", "mcp"),
    "fastmcp": ("fastmcp", "fastmcp"),
    "google_adk": ("google.adk", "google-adk"),
    "llama_index": ("llama_index", "llama-index"),
    "strands": ("strands", "strands"),
    "crewai": ("crewai", "crewai"),
    "claude_agent_sdk": ("claude_agent_sdk", "claude-agent-sdk"),
}

IMPORT = """
import sys
sys.modules[{package!r}] = None
try:
    import twiceshy.integrations.{adapter}
except ImportError as exc:
    print(type(exc).__name__, exc, sep=": ")
else:
    print("imported")
"""


@pytest.mark.parametrize(("adapter", "package", "extra"), [(a, *v) for a, v in ADAPTERS.items()])
def test_an_adapter_without_its_framework_names_the_extra(
    adapter: str, package: str, extra: str
) -> None:
    """Importing an adapter whose framework is missing says which extra to install."""
    code = IMPORT.format(package=package, adapter=adapter)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.startswith(f"ImportError: twiceshy.integrations.{adapter} needs ")
    assert f"pip install 'twiceshy[{extra}]'" in done.stdout
