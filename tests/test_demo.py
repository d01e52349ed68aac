"""``twiceshy demo``: the re-enacted double charge, in process and as the console script."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

import servers
from twiceshy.cli.double_charge import DemoResult, print_report, run_demo


@pytest.fixture(scope="module")
def result() -> DemoResult:
    """One run of the demo on a fresh temporary SQLite ledger."""
    return run_demo()


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100", "PYTHONIOENCODING": "utf-8", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "twiceshy", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=60,
        check=False,
    )


DOUBLE_CHARGE = "the plain retry loop charged the customer twice for one purchase"
PROTECTED = "With twiceshy, one charge each"
RED, GREEN = "\x1b[1;31m", "\x1b[1;32m"  # bold red, bold green


def _row(output: str, title: str) -> tuple[int, int]:
    """The calls and charges printed on a table row."""
    match = re.search(rf"{re.escape(title)}\W+(\d+)\W+(\d+)\W", output)
    assert match is not None, output
    return int(match[1]), int(match[2])


def test_plain_retry_loop_charges_twice(result: DemoResult) -> None:
    """The plain loop's retry after a timeout makes a second charge at the provider."""
    plain = result.plain
    assert len(plain.charges) == 2
    assert [c.error for c in plain.calls] == ["TimeoutError", None]
    assert plain.calls[1].charge_id == plain.charges[1]


def test_keyed_tool_charges_once_and_the_retry_gets_the_first_charge(result: DemoResult) -> None:
    """The KEYED tool's retry sends the same key: one charge, and the retry returns its id."""
    keyed = result.keyed
    assert len(keyed.charges) == 1
    first, retry, again = keyed.calls
    assert first.error == "TimeoutError"
    assert first.created == keyed.charges
    assert retry.charge_id == keyed.charges[0]
    assert retry.reached_provider
    assert retry.created == ()
    assert again.charge_id == keyed.charges[0]


def test_keyed_tool_replays_from_the_ledger_without_the_provider(result: DemoResult) -> None:
    """A third call of the KEYED tool is answered by the ledger; the provider sees no request."""
    keyed = result.keyed
    assert keyed.later
    assert not keyed.calls[2].reached_provider
    assert keyed.requests == 2


def test_unsafe_tool_charges_once_and_is_never_run_again(result: DemoResult) -> None:
    """The UNSAFE tool ends in OutcomeUnknown, and its retry never reaches the provider."""
    unsafe = result.unsafe
    assert len(unsafe.charges) == 1
    assert [c.error for c in unsafe.calls] == ["OutcomeUnknown", "OutcomeUnknown"]
    assert unsafe.calls[0].reached_provider
    assert not unsafe.calls[1].reached_provider
    assert unsafe.requests == 1


def test_outcome_unknown_message_is_honest(result: DemoResult) -> None:
    """The message the model reads says the charge may have happened and invites no retry."""
    message = result.message
    assert message == result.unsafe.calls[0].message
    assert "try again" not in message.lower()
    assert re.search(r"may (or may not )?have (happened|taken effect)", message)


def test_result_says_the_story_came_out(result: DemoResult) -> None:
    """The demo's verdict is 2 / 1 / 1 charges, and it took well under ten seconds."""
    assert [len(act.charges) for act in result.acts] == [2, 1, 1]
    assert result.ok
    assert result.seconds < 10
    assert result.scope.startswith("demo-run-")


def test_report_prints_the_table_and_the_message(result: DemoResult) -> None:
    """The report shows every act with its counts, and the model's message in full."""
    out = io.StringIO()
    print_report(result, Console(file=out, width=100, color_system=None))
    text = out.getvalue()
    assert _row(text, "plain retry loop") == (2, 2)
    assert _row(text, "twiceshy, KEYED") == (3, 1)
    assert _row(text, "twiceshy, UNSAFE") == (2, 1)
    assert f"{result.plain.charges[1]}, charged AGAIN" in text
    assert " ".join(result.message.split()[:8]) in " ".join(text.split())


def _colour_report(result: DemoResult) -> str:
    out = io.StringIO()
    print_report(result, Console(file=out, width=120, force_terminal=True, color_system="standard"))
    return out.getvalue()


def _charges_cell(report: str, title: str) -> str:
    """The charges cell of an act's row, with its colour codes and without its padding."""
    line = next(line for line in report.splitlines() if title in line)
    return "".join(line.split("│")[3].split())


def test_report_paints_the_double_charge_red_and_the_protected_acts_green(
    result: DemoResult,
) -> None:
    """The plain loop's two charges and its second charge are red; KEYED's and UNSAFE's 1 green."""
    report = _colour_report(result)
    assert _charges_cell(report, "plain retry loop").startswith(f"{RED}2")
    assert _charges_cell(report, "twiceshy, KEYED").startswith(f"{GREEN}1")
    assert _charges_cell(report, "twiceshy, UNSAFE").startswith(f"{GREEN}1")
    assert f"{RED}{result.plain.charges[1]}" in report  # the second charge's id, in red
    # The verdict: the double charge is the failure, in red, not "as expected"; then twiceshy's.
    assert f"{RED}Without twiceshy, the plain retry loop charged the customer twice" in report
    assert f"{GREEN}{PROTECTED}" in report
    plain = " ".join(_plain(report).split())
    assert DOUBLE_CHARGE in plain
    assert "as expected" not in plain


def _plain(report: str) -> str:
    return re.sub(r"\x1b\[[\d;]*m", "", report)


def test_report_explains_the_keyed_third_call(result: DemoResult) -> None:
    """The KEYED row's third call is the model's later call, answered by the ledger alone."""
    report = " ".join(_plain(_colour_report(result)).split())
    assert f"{result.keyed.charges[0]}, replayed (a later call)" in report
    assert (
        "KEYED, third call: later in the run the model calls the tool again (it read the timeout "
        "in its history). Same arguments, same intent: the ledger answers with the first "
        "charge, and the provider never sees the call."
    ) in report


def test_report_says_so_when_the_story_does_not_come_out(result: DemoResult) -> None:
    """A run whose counts are off (one charge in the plain loop) is reported in red, not as told."""
    plain = dataclasses.replace(result.plain, charges=result.plain.charges[:1])
    report = _colour_report(dataclasses.replace(result, plain=plain))
    assert f"{RED}The demo did not come out as told: charges at the provider 1 / 1 / 1" in report
    assert DOUBLE_CHARGE not in _plain(report)


def test_console_script_runs_the_demo() -> None:
    """``python -m twiceshy demo`` exits 0 and prints the table with the expected counts."""
    done = _script("demo")
    assert done.returncode == 0, done.stderr
    assert _row(done.stdout, "plain retry loop") == (2, 2)
    assert _row(done.stdout, "twiceshy, KEYED") == (3, 1)
    assert _row(done.stdout, "twiceshy, UNSAFE") == (2, 1)
    assert "OutcomeUnknown" in done.stdout
    said = " ".join(done.stdout.split())
    assert DOUBLE_CHARGE in said
    assert PROTECTED in said
    assert done.stderr == ""


def test_console_script_reuses_a_persistent_ledger(tmp_path: Path) -> None:
    """Two runs in a row on one SQLite ledger file both tell the full story."""
    url = "sqlite:///" + str(tmp_path / "l.db")
    for _ in range(2):
        done = _script("demo", "--ledger", url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert DOUBLE_CHARGE in " ".join(done.stdout.split())
        assert url in done.stdout.replace("\n", "")
    assert (tmp_path / "l.db").exists()


def test_console_script_refuses_an_unknown_ledger_url() -> None:
    """An unknown ledger URL is a short error and a non-zero exit, not a traceback."""
    done = _script("demo", "--ledger", "nosuch://x")
    assert done.returncode != 0
    assert "nosuch://x" in done.stderr
    assert "Traceback" not in done.stderr


def test_report_never_prints_the_ledger_password() -> None:
    """A password in ``--ledger URL`` appears neither in the result nor in the printed report."""
    out = io.StringIO()
    result = run_demo("memory://demo:hunter2@ledger.example", console=Console(file=out, width=200))
    assert result.ok
    assert "hunter2" not in result.ledger_url
    assert "hunter2" not in out.getvalue()
    assert "memory://demo:***@ledger.example" in out.getvalue()
    out = io.StringIO()
    result = run_demo("memory://ledger.example?password=hunter2", console=Console(file=out))
    assert result.ok
    assert "hunter2" not in result.ledger_url
    assert "hunter2" not in out.getvalue()


@pytest.fixture(params=["postgres", "redis"])
def server_ledger(request: pytest.FixtureRequest) -> Iterator[str]:
    """A loopback PostgreSQL or Redis ledger URL with its own schema or prefix, removed after."""
    base = servers.require(request.param)
    name = f"twiceshy_demo_{secrets.token_hex(6)}"
    if request.param == "postgres":
        yield f"{base}?schema={name}"
        servers.drop_schema(base, name)
    else:
        yield f"{base}?prefix={name}"
        servers.delete_prefix(base, name)


def test_console_script_runs_on_server_ledgers(server_ledger: str) -> None:
    """``demo --ledger URL`` tells the full story on a PostgreSQL and a Redis ledger too."""
    done = _script("demo", "--ledger", server_ledger)
    assert done.returncode == 0, done.stdout + done.stderr
    assert DOUBLE_CHARGE in " ".join(done.stdout.split())
