"""What a new user meets first: the command without its extra, a mistyped ledger path, the logs.

- ``pip install twiceshy`` (no ``cli`` extra): ``twiceshy demo``, ``twiceshy --help`` and
  ``python -m twiceshy`` answer one line naming the extra, exit 2, no traceback. Shown with click
  and rich made unimportable in the project's own environment (the console script pip wrote),
  and, marked slow, from a wheel built from this tree and installed into a fresh environment
  that holds nothing else.
- A mistyped SQLite path is refused before anything is made; the default ledger's own directory
  is still made.
- The one logging line the docs give makes an unknown outcome's warning appear; without it,
  nothing is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import twiceshy
from twiceshy.stores import default_url
from twiceshy.stores.sqlite import LedgerDirectoryNotFound

ROOT = Path(__file__).resolve().parent.parent
HINT = "pip install 'twiceshy[cli]'"

# Run first in a process: click and rich cannot be imported, as after `pip install twiceshy`.
_WITHOUT_CLICK = "import sys\nsys.modules['click'] = None\nsys.modules['rich'] = None\n"


def _run(
    argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, check=False, env=env, cwd=cwd
    )


def _assert_names_the_extra(done: subprocess.CompletedProcess[str]) -> None:
    """One line on stderr naming the extra, exit 2, nothing else."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"twiceshy: the command line needs the cli extra: {HINT} (")


def _entry_point() -> str:
    """The console script as pyproject.toml declares it (``module:function``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return str(project["scripts"]["twiceshy"])


@pytest.fixture
def without_click(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import click or rich (a ``sitecustomize`` on the path)."""
    (tmp_path / "sitecustomize.py").write_text(_WITHOUT_CLICK)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.parametrize("args", [["demo"], ["--help"], []], ids=["demo", "help", "bare"])
def test_the_console_script_without_the_cli_extra_names_it(
    args: list[str], without_click: dict[str, str]
) -> None:
    """The ``twiceshy`` script pip installed, without click and rich: one line, exit 2."""
    script = shutil.which("twiceshy", path=os.path.dirname(sys.executable))
    assert script is not None, "the console script is not installed beside this Python"
    assert f"from {_entry_point().replace(':', ' import ')}" in Path(script).read_text()
    _assert_names_the_extra(_run([script, *args], env=without_click))


@pytest.mark.parametrize("args", [["demo"], ["--help"], []], ids=["demo", "help", "bare"])
def test_python_m_twiceshy_without_the_cli_extra_names_it(
    args: list[str], without_click: dict[str, str]
) -> None:
    """``python -m twiceshy``, without click and rich: one line naming the extra, exit 2."""
    _assert_names_the_extra(_run([sys.executable, "-m", "twiceshy", *args], env=without_click))


def test_the_library_imports_without_the_cli_extra(without_click: dict[str, str]) -> None:
    """Without click, ``import twiceshy.cli`` works; its other names raise naming the extra."""
    code = (
        "import twiceshy, twiceshy.cli\n"
        "try:\n"
        "    from twiceshy.cli import BadUsage\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = _run([sys.executable, "-c", code], env=without_click)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"twiceshy.cli.BadUsage needs the cli extra: {HINT} (")


@pytest.mark.slow
def test_a_wheel_installed_without_extras_names_the_cli_extra(tmp_path: Path) -> None:
    """The PyPI path: this tree's wheel in an environment with nothing else; the script says it."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]
    built = _run([*pip, "wheel", *offline, "-w", str(tmp_path), str(ROOT)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("twiceshy-*.whl")
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    install = [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    installed = _run(install)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Nothing but the standard library and twiceshy: click is not there, the library works.
    probe = "import importlib.util, twiceshy; print(importlib.util.find_spec('click'))"
    looked = _run([str(python), "-c", probe], env=env, cwd=tmp_path)
    assert looked.stdout.strip() == "None", looked.stdout + looked.stderr
    for argv in ([venv / "bin" / "twiceshy", "demo"], [venv / "bin" / "twiceshy", "--help"]):
        _assert_names_the_extra(_run([str(a) for a in argv], env=env, cwd=tmp_path))
    _assert_names_the_extra(_run([str(python), "-m", "twiceshy"], env=env, cwd=tmp_path))


# -- a mistyped SQLite path -------------------------------------------------------------------


def test_a_mistyped_sqlite_path_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sqlite:///var/lib/billing/ledger.db`` (three slashes, relative): refused, nothing made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LedgerDirectoryNotFound) as caught:
        twiceshy.Ledger("sqlite:///var/lib/billing/ledger.db")
    assert list(tmp_path.iterdir()) == []
    message = str(caught.value)
    assert repr(str(tmp_path / "var" / "lib" / "billing" / "ledger.db")) in message
    assert "sqlite:///relative/x.db (three slashes)" in message
    assert "sqlite:////absolute/x.db (four slashes) is absolute" in message
    assert isinstance(caught.value, twiceshy.StoreError)


def test_the_default_ledger_makes_its_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Ledger()`` with no URL on a fresh machine: the state directory is made, the tool runs."""
    monkeypatch.delenv("TWICESHY_LEDGER", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_url() == f"sqlite:///{tmp_path}/state/twiceshy/ledger.db"
    ran = []
    with twiceshy.Ledger(counts_interval=None) as ledger:

        @ledger.tool(effect=twiceshy.UNSAFE)
        def send(text: str) -> str:
            ran.append(text)
            return text

        with twiceshy.run("first-meeting"):
            assert send("hi") == "hi"
            assert send("hi") == "hi"
    assert ran == ["hi"]
    assert (tmp_path / "state" / "twiceshy" / "ledger.db").is_file()


# -- logging ----------------------------------------------------------------------------------

_UNKNOWN_OUTCOME = """
import twiceshy

ledger = twiceshy.Ledger("memory://")


@ledger.tool(effect=twiceshy.UNSAFE)
def send_fax(number: str) -> str:
    raise TimeoutError("the fax line dropped")


with twiceshy.run("run-1"):
    try:
        send_fax("+1 555 0100")
    except twiceshy.OutcomeUnknown:
        print("caller got OutcomeUnknown")
"""


def _logging_line(path: Path) -> str:
    """The line the page gives for showing twiceshy's log records."""
    lines = re.findall(r"^logging\.basicConfig\(.*$", path.read_text(), re.M)
    assert len(lines) == 1, (path, lines)
    return lines[0]


def _unknown_outcome(setup: str) -> subprocess.CompletedProcess[str]:
    code = f"import logging\n{setup}\n{_UNKNOWN_OUTCOME}"
    return _run([sys.executable, "-c", code])


def test_the_docs_logging_line_shows_an_unknown_outcome_warning() -> None:
    """The one logging line of docs/observability.md and the README shows the unknown warning."""
    line = _logging_line(ROOT / "docs" / "observability.md")
    assert _logging_line(ROOT / "README.md") == line
    done = _unknown_outcome(line)
    assert done.stdout == "caller got OutcomeUnknown\n", done.stderr
    assert re.search(r"WARNING:twiceshy:twiceshy: send_fax unknown key=[0-9a-f]{64}", done.stderr)
    assert "twiceshy resolve" in done.stderr


def test_the_logger_level_alone_prints_nothing() -> None:
    """``getLogger("twiceshy").setLevel(DEBUG)`` without a handler: not even the warning prints."""
    done = _unknown_outcome('logging.getLogger("twiceshy").setLevel(logging.DEBUG)')
    assert done.stdout == "caller got OutcomeUnknown\n", done.stderr
    assert done.stderr == ""
