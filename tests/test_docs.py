"""The README's promises that are checked by machine: its commands, and CI running them."""

from __future__ import annotations

import doctest
import re
import tomllib
from pathlib import Path

import twiceshy
from twiceshy import State
from twiceshy._rules import TRANSITIONS

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
    assert tests.endswith("python -m pytest -n 2 --dist loadscope")


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run calls the README's test command verbatim."""
    _, tests = readme_commands()
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_package_docstring_example_runs() -> None:
    """The example in twiceshy's own docstring runs as shown."""
    failures, tried = doctest.testmod(twiceshy, verbose=False)
    assert tried > 0
    assert failures == 0


DOCS_SITE = "https://twiceshy.readthedocs.io/en/latest/"
REPOSITORY = "https://github.com/twiceshy/twiceshy"


def test_readme_links_work_on_pypi() -> None:
    """Every README link is absolute (PyPI resolves no relative one) and names a page that is."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    assert [link for link in links if not link.startswith("https://")] == []
    for link in links:
        if link.startswith(DOCS_SITE):
            page = link.removeprefix(DOCS_SITE).split("#")[0].strip("/")
            assert (ROOT / "docs" / f"{page or 'index'}.md").is_file(), link
        elif link.startswith(f"{REPOSITORY}/blob/main/"):
            assert (ROOT / link.removeprefix(f"{REPOSITORY}/blob/main/")).exists(), link


def test_package_metadata_names_the_project_pages() -> None:
    """pyproject.toml carries the project's addresses, its licence and PyPI's classifiers."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["urls"] == {
        "Homepage": REPOSITORY,
        "Documentation": "https://twiceshy.readthedocs.io",
        "Repository": REPOSITORY,
        "Changelog": f"{DOCS_SITE}changelog/",
        "Issues": f"{REPOSITORY}/issues",
    }
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "Operating System :: OS Independent" in project["classifiers"]
    # PyPI refuses an upload with both a licence expression and a licence classifier.
    assert [c for c in project["classifiers"] if c.startswith("License ::")] == []
    assert (ROOT / "docs" / "changelog.md").read_text().strip() == '--8<-- "CHANGELOG.md"'


def _diagram() -> dict[tuple[State | None, State | None], frozenset[str]]:
    """The edges of docs/states.md's Mermaid diagram, with who may take each."""
    page = (ROOT / "docs" / "states.md").read_text()
    (block,) = re.findall(r"```mermaid\n(.*?)```", page, re.S)

    def state(name: str) -> State | None:
        return None if name == "NONE" else State[name]

    edges = {}
    for source, to, who in re.findall(r"^ *(\w+) --> (\w+): (.+)$", block, re.M):
        edge = (state(source), state(to))
        assert edge not in edges, edge
        edges[edge] = frozenset(w.strip() for w in who.split(","))
    return edges


def test_the_states_diagram_draws_every_transition_and_only_those() -> None:
    """docs/states.md's diagram has exactly TRANSITIONS' edges and writers, plus expiry."""
    drawn = _diagram()
    expiry = {edge for edge, who in drawn.items() if who == {"expiry"}}
    assert expiry == {(State.SUCCEEDED, None), (State.FAILED, None), (State.RELEASED, None)}
    table = {edge: frozenset(a.name.lower() for a in who) for edge, who in TRANSITIONS.items()}
    assert {edge: who for edge, who in drawn.items() if edge not in expiry} == table
