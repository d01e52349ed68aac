"""The README's promises that are checked by machine: its commands, and CI running them."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import twiceshy

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The shell commands of the README's first two code blocks."""
    blocks = re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    return [block.strip() for block in blocks[:2]]


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    """The README's first two commands install and run the demo, then the whole test suite."""
    demo, tests = readme_commands()
    assert demo.endswith("twiceshy demo")
    assert "pip install -e '.[cli]'" in demo
    assert "pip install -e '.[test]'" in tests
    assert tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run calls the README's test command verbatim."""
    _, tests = readme_commands()
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_package_docstring_example_runs() -> None:
    """The example in twiceshy's own docstring runs as shown."""
    failures, tried = doctest.testmod(twiceshy, verbose=False)
    assert tried > 0
    assert failures == 0
