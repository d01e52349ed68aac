"""``twiceshy ls / show / resolve / gc / stats`` on SQLite, PostgreSQL and Redis ledgers.

Every ledger is left in each state by real tool calls through ``twiceshy.Ledger``: a KEYED call
that succeeded, a call that failed for certain, an UNSAFE call whose outcome is unknown, a call
that certainly did not happen, and an owner killed with SIGKILL inside its tool (CLAIMED, with a
lease that lapses). The commands run as the user runs them: through click's runner against
``twiceshy.cli.main``, and as ``python -m twiceshy`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner, Result

import servers
import twiceshy
from twiceshy.cli import EXIT_BROKEN_PIPE, main
from twiceshy.stores import open_store

SCOPE = "run-1"
LEASE = 0.3

STORES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]


def _with_query(base: str, name: str, value: str) -> str:
    return f"{base}{'&' if '?' in base else '?'}{name}={value}"


@pytest.fixture(scope="module", params=STORES)
def ledger_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A ledger URL of each kind, isolated (its own file, schema or key prefix), cleaned up."""
    kind = request.param
    if kind == "sqlite":
        path = tmp_path_factory.mktemp("cli") / "ledger.db"
        store, _ = open_store(f"sqlite:///{path}")
        store.close()
        yield f"sqlite:///{path}"
    elif kind == "postgres":
        base = servers.require("postgres")
        schema = f"twiceshy_cli_{secrets.token_hex(6)}"
        yield _with_query(base, "schema", schema)
        servers.drop_schema(base, schema)
    else:
        base = servers.require("redis")
        prefix = f"twiceshy-cli-{secrets.token_hex(6)}"
        yield _with_query(base, "prefix", prefix)
        servers.delete_prefix(base, prefix)


def cli(url: str, namespace: str, *args: str) -> Result:
    """Run ``twiceshy ARGS --ledger URL --namespace NS`` in process."""
    runner = CliRunner(env={"COLUMNS": "160"})
    return runner.invoke(
        main, [*args, "--ledger", url, "--namespace", namespace], catch_exceptions=False
    )


def ok(result: Result) -> Result:
    """The result of a command that must have succeeded."""
    assert result.exit_code == 0, result.output
    return result


def one_line_error(result: Result, code: int) -> str:
    """The single stderr line of a command that failed with ``code``."""
    assert result.exit_code == code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output
    return lines[0]


def listed(url: str, namespace: str, *args: str) -> dict[str, dict[str, Any]]:
    """``ls --json``: the records by key."""
    return {r["key"]: r for r in json.loads(ok(cli(url, namespace, "ls", "--json", *args)).stdout)}


def shown(url: str, namespace: str, key: str) -> dict[str, Any]:
    """``show --json KEY``."""
    data: dict[str, Any] = json.loads(ok(cli(url, namespace, "show", key, "--json")).stdout)
    return data


class Declined(Exception):
    """The provider refused: certainly nothing happened but a failure."""


class Shop:
    """A shop's tools, protected by a ledger; counts how often each one really ran."""

    def __init__(self, url: str, namespace: str, *, ttl: float = 86400.0) -> None:
        self.ledger = ledger = twiceshy.Ledger(url, namespace=namespace)
        self.runs: Counter[str] = Counter()
        runs = self.runs

        @ledger.tool(effect=twiceshy.KEYED, ttl=ttl)
        def charge(amount: int) -> dict[str, str]:
            runs["charge"] += 1
            return {"id": "ch_ok"}

        @ledger.tool(effect=twiceshy.KEYED, definite=[Declined], ttl=ttl)
        def refund(amount: int) -> dict[str, str]:
            runs["refund"] += 1
            raise Declined("card declined")

        @ledger.tool(effect=twiceshy.UNSAFE)
        def wire(amount: int) -> dict[str, str]:
            runs["wire"] += 1
            if runs["wire"] == 1:
                raise TimeoutError("the bank did not answer")
            return {"id": f"wire_{runs['wire']}"}

        @ledger.tool(effect=twiceshy.UNSAFE, ttl=ttl)
        def mail(to: str) -> str:
            runs["mail"] += 1
            if runs["mail"] == 1:
                raise twiceshy.NotApplied("the mail server refused the message before sending")
            return "sent"

        @ledger.tool(effect=twiceshy.UNSAFE, lease=LEASE)
        def ship(order: str) -> str:
            runs["ship"] += 1
            return "shipped"

        self.charge, self.refund, self.wire, self.mail, self.ship = (
            charge,
            refund,
            wire,
            mail,
            ship,
        )

    keys: ClassVar[dict[str, str]] = {
        "succeeded": twiceshy.idempotency_key(SCOPE, "charge", {"amount": 4900}),
        "failed": twiceshy.idempotency_key(SCOPE, "refund", {"amount": 4900}),
        "unknown": twiceshy.idempotency_key(SCOPE, "wire", {"amount": 4900}),
        "released": twiceshy.idempotency_key(SCOPE, "mail", {"to": "ann@example.com"}),
        "claimed": twiceshy.idempotency_key(SCOPE, "ship", {"order": "o-1"}),
    }

    def call(self, tool: Callable[..., Any], *args: Any) -> Any:
        """Call a tool within the run's scope."""
        with twiceshy.run(SCOPE):
            return tool(*args)

    def park(self) -> None:
        """Leave a SUCCEEDED, a FAILED, an UNKNOWN and a RELEASED record, as real calls do."""
        assert self.call(self.charge, 4900) == {"id": "ch_ok"}
        self.fail_and_park()

    def fail_and_park(self) -> None:
        """The FAILED, UNKNOWN and RELEASED records."""
        with pytest.raises(Declined):
            self.call(self.refund, 4900)
        with pytest.raises(twiceshy.OutcomeUnknown):
            self.call(self.wire, 4900)
        with pytest.raises(twiceshy.NotApplied):
            self.call(self.mail, "ann@example.com")


_OWNER = """
import pathlib, sys, time, twiceshy
url, namespace, marker, lease = sys.argv[1:]
ledger = twiceshy.Ledger(url, namespace=namespace)
@ledger.tool(effect=twiceshy.UNSAFE, lease=float(lease))
def ship(order: str) -> str:
    pathlib.Path(marker).write_text("running")
    time.sleep(60)
    return "shipped"
with twiceshy.run("run-1"):
    ship("o-1")
"""


@contextmanager
def running_owner(
    url: str, namespace: str, tmp_path: Path, lease: float = LEASE
) -> Iterator[Callable[[], None]]:
    """A process inside the ``ship`` tool; answers a function that SIGKILLs it there."""
    marker = tmp_path / f"owner-{secrets.token_hex(4)}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER, url, namespace, str(marker), str(lease)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def kill() -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "the owner never entered its tool"
            time.sleep(0.01)
        yield kill
    finally:
        if proc.poll() is None:
            kill()
        assert proc.stderr is not None
        proc.stderr.close()


def wait_lapsed(url: str, namespace: str, key: str) -> dict[str, Any]:
    """Wait until the record's lease has lapsed on the store's clock; answer ``show --json``."""
    deadline = time.monotonic() + 10
    while True:
        record = shown(url, namespace, key)
        if record["lease_lapsed"]:
            return record
        assert time.monotonic() < deadline, record
        time.sleep(0.05)


@pytest.fixture(scope="module")
def parked(ledger_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A namespace holding one record in every state, the crashed owner's lease lapsed.

    The SUCCEEDED record is made at least 1.2 s before the others (for ``--since``).
    """
    namespace = f"parked-{secrets.token_hex(4)}"
    shop = Shop(ledger_url, namespace)
    started = time.monotonic()
    shop.call(shop.charge, 4900)
    with running_owner(ledger_url, namespace, tmp_path_factory.mktemp("owner")) as kill:
        kill()
    time.sleep(max(0.0, 1.2 - (time.monotonic() - started)))
    shop.fail_and_park()
    wait_lapsed(ledger_url, namespace, Shop.keys["claimed"])
    yield ledger_url, namespace
    shop.ledger.close()


@pytest.fixture
def shop(ledger_url: str) -> Iterator[Shop]:
    """A shop on the ledger, in a namespace of its own, with its records parked."""
    shop = Shop(ledger_url, f"t-{secrets.token_hex(4)}")
    shop.park()
    yield shop
    shop.ledger.close()


# -- ls -----------------------------------------------------------------------------------------


def test_ls_lists_every_state(parked: tuple[str, str]) -> None:
    """``ls --json`` shows the five records with their states, tools and effects."""
    url, ns = parked
    records = listed(url, ns)
    assert {key: r["state"] for key, r in records.items()} == {
        key: state for state, key in Shop.keys.items()
    }
    claimed = records[Shop.keys["claimed"]]
    assert (claimed["tool"], claimed["effect"], claimed["lease_lapsed"]) == ("ship", "unsafe", True)
    assert records[Shop.keys["succeeded"]]["result"] == {"id": "ch_ok"}
    assert records[Shop.keys["failed"]]["error"]["message"] == "card declined"
    assert all(r["namespace"] == ns and r["fence"] == 1 for r in records.values())
    assert all(
        datetime.fromisoformat(r["created_at"]).utcoffset() is not None for r in records.values()
    )


def test_ls_table_shows_short_keys_and_states(parked: tuple[str, str]) -> None:
    """The table has a row per record: the key's first 12 characters, tool and state."""
    url, ns = parked
    out = ok(cli(url, ns, "ls")).stdout
    for state, key in Shop.keys.items():
        line = next(line for line in out.splitlines() if key[:12] in line)
        assert state in line
        assert key[:13] not in out
    assert "claimed (lease lapsed)" in out
    assert f"5 records in namespace {ns!r}" in out


def test_ls_shows_why_a_record_is_unknown(parked: tuple[str, str]) -> None:
    """The table's reason column gives the UNKNOWN record's reason, and nothing for the others."""
    url, ns = parked
    lines = ok(cli(url, ns, "ls")).stdout.splitlines()
    assert next(line for line in lines if line.split()[:1] == ["key"]).split()[-1] == "reason"
    unknown = next(line for line in lines if Shop.keys["unknown"][:12] in line)
    assert unknown.rstrip().endswith("TimeoutError: the bank did not answer")
    others = [line for line in lines if any(k[:12] in line for k in Shop.keys.values())]
    assert len(others) == 5
    assert [line for line in others if "Error" in line] == [unknown]


def test_ls_filters(parked: tuple[str, str]) -> None:
    """--state (repeated, any case), --tool, --limit and --since select the right records."""
    url, ns = parked
    keys = Shop.keys
    assert set(listed(url, ns, "--state", "unknown")) == {keys["unknown"]}
    both = listed(url, ns, "--state", "SUCCEEDED", "--state", "failed")
    assert set(both) == {keys["succeeded"], keys["failed"]}
    assert set(listed(url, ns, "--tool", "ship")) == {keys["claimed"]}
    assert listed(url, ns, "--tool", "nosuch") == {}
    newest = json.loads(ok(cli(url, ns, "ls", "--json", "--limit", "2")).stdout)
    everything = json.loads(ok(cli(url, ns, "ls", "--json")).stdout)
    assert newest == everything[:2]
    assert [r["created_at"] for r in everything] == sorted(
        (r["created_at"] for r in everything), reverse=True
    )
    # The SUCCEEDED record is >= 1.2 s older than the FAILED, UNKNOWN and RELEASED ones.
    old = datetime.fromisoformat(everything[-1]["created_at"]).timestamp()
    assert everything[-1]["key"] == keys["succeeded"]
    since = f"{time.time() - old - 0.6:.3f}s"
    recent = listed(url, ns, "--since", since)
    assert keys["succeeded"] not in recent
    assert {keys["failed"], keys["unknown"], keys["released"]} <= set(recent)
    assert len(listed(url, ns, "--since", "1h")) == 5


def test_ls_help_says_records_have_no_scope() -> None:
    """``ls`` offers no --scope, and its help says why."""
    out = ok(CliRunner().invoke(main, ["ls", "--help"])).stdout
    assert "--scope" not in out.partition("Options:")[2]
    assert "do not keep the scope" in " ".join(out.split())


# -- show ---------------------------------------------------------------------------------------


def test_show_prints_the_whole_record(parked: tuple[str, str]) -> None:
    """``show PREFIX`` prints the full key, fingerprint, state, error and reason."""
    url, ns = parked
    key = Shop.keys["unknown"]
    out = ok(cli(url, ns, "show", key[:10])).stdout
    record = shown(url, ns, key)
    for text in (key, record["fingerprint"], "wire", "unsafe", "unknown", record["owner"]):
        assert text in out
    assert "builtins.TimeoutError: the bank did not answer" in out
    assert "reason" in out
    assert "not a history" in out
    flat = " ".join(out.split())
    assert f"`twiceshy resolve {key[:16]} --released`" in flat  # how to clear it
    assert "--succeeded" in flat
    assert "call twiceshy.point_of_no_return() in it where its effect starts" in flat
    assert record["reason"] == "TimeoutError: the bank did not answer"
    assert record["error"] == {
        "type": "builtins.TimeoutError",
        "message": "the bank did not answer",
    }


def test_show_tells_how_a_keyed_tool_blind_to_its_key_could_have_been_retried(
    ledger_url: str,
) -> None:
    """A KEYED tool that never handed its key on is shown with the fix (hand the provider
    current_key()), not with the point-of-no-return advice for UNSAFE tools."""
    namespace = f"blind-{secrets.token_hex(4)}"
    ledger = twiceshy.Ledger(ledger_url, namespace=namespace)

    @ledger.tool(effect=twiceshy.KEYED, attempts=1)
    def charge(amount: int) -> str:
        raise TimeoutError("the provider did not answer")

    with twiceshy.run("run-blind"), pytest.raises(twiceshy.OutcomeUnknown):
        charge(4900)
    ledger.close()
    key = charge.twiceshy.key_for({"amount": 4900}, scope="run-blind")  # type: ignore[attr-defined]
    flat = " ".join(ok(cli(ledger_url, namespace, "show", key)).stdout.split())
    assert "did not hand its idempotency key to its provider" in flat
    assert "twiceshy.current_key()" in flat
    assert "point_of_no_return" not in flat


def test_show_prints_the_arguments_the_record_kept(parked: tuple[str, str]) -> None:
    """``show`` and ``show --json`` give the call's arguments (which amount); ``ls --json`` too."""
    url, ns = parked
    key = Shop.keys["unknown"]
    out = ok(cli(url, ns, "show", key)).stdout
    lines = out.splitlines()
    at = lines.index("arguments")
    assert " ".join(" ".join(lines[at + 1 : at + 4]).split()) == '{ "amount": 4900 }'
    assert shown(url, ns, key)["args"] == {"amount": 4900}
    assert listed(url, ns)[Shop.keys["released"]]["args"] == {"to": "ann@example.com"}


def test_show_prints_the_arguments_escaped(ledger_url: str) -> None:
    """Kept arguments holding an OSC sequence are shown escaped; a tool keeping none says so."""
    ns = f"args-{secrets.token_hex(4)}"
    with twiceshy.Ledger(ledger_url, namespace=ns) as ledger:
        kept = ledger.guard("mail", effect=twiceshy.KEYED)
        bare = ledger.guard("fax", effect=twiceshy.KEYED, keep_args=False)
        kept.call({"to": f"ann{OSC}"}, lambda: "sent", key="k-kept")
        bare.call({"to": "bob"}, lambda: "sent", key="k-bare")
    out = no_controls(ok(terminal(ledger_url, ns, "show", "k-kept")).stdout)
    assert r'"to": "ann\u001b]0;pwned\u0007"' in out
    assert no_controls(ok(terminal(ledger_url, ns, "show", "k-kept", "--json")).stdout)
    assert shown(ledger_url, ns, "k-kept")["args"] == {"to": f"ann{OSC}"}
    out = ok(cli(ledger_url, ns, "show", "k-bare")).stdout
    assert "arguments    not kept (keep_args=False" in out
    assert shown(ledger_url, ns, "k-bare")["args"] is None


def test_show_prints_result_and_lease(parked: tuple[str, str]) -> None:
    """A SUCCEEDED record shows its result as JSON; a crashed owner's record its lapsed lease."""
    url, ns = parked
    out = ok(cli(url, ns, "show", Shop.keys["succeeded"])).stdout
    assert '"id": "ch_ok"' in out
    assert "twiceshy resolve" not in out  # nothing to clear
    out = ok(cli(url, ns, "show", Shop.keys["claimed"][:8])).stdout
    assert "lapsed, deadline" in out
    claimed = shown(url, ns, Shop.keys["claimed"])
    assert claimed["state"] == "claimed"
    assert claimed["lease_deadline"] is not None
    assert claimed["attempts"] == 1
    assert claimed["owner"]


def test_show_refuses_an_ambiguous_prefix(ledger_url: str) -> None:
    """A prefix of several keys is refused by name; the full key is found."""
    ns = f"t-{secrets.token_hex(4)}"
    with twiceshy.Ledger(ledger_url, namespace=ns) as ledger:
        note = ledger.guard("note", effect=twiceshy.KEYED)
        note.call({"n": 1}, lambda: 1, key="order-2024-0001")
        note.call({"n": 2}, lambda: 2, key="order-2024-0002")
    line = one_line_error(cli(ledger_url, ns, "show", "order-2024"), 1)
    assert "ambiguous" in line
    assert "order-2024-0001" in line
    assert "order-2024-0002" in line
    assert shown(ledger_url, ns, "order-2024-0002")["result"] == 2
    out = ok(cli(ledger_url, ns, "ls")).stdout
    assert "order-2024-0001" in out


# -- resolve ------------------------------------------------------------------------------------


def test_resolve_succeeded_is_replayed_and_never_runs(shop: Shop, ledger_url: str) -> None:
    """An UNKNOWN record resolved as succeeded: the next call replays the result, runs nothing."""
    ns = shop.ledger.namespace
    key = Shop.keys["unknown"]
    out = ok(cli(ledger_url, ns, "resolve", key[:16], "--succeeded", '{"id": "ch_1"}')).stdout
    assert f"resolved {key}: unknown -> succeeded" in out
    assert shown(ledger_url, ns, key)["state"] == "succeeded"
    assert shop.runs["wire"] == 1
    assert shop.call(shop.wire, 4900) == {"id": "ch_1"}
    assert shop.call(shop.wire, 4900) == {"id": "ch_1"}
    assert shop.runs["wire"] == 1


def test_resolve_released_lets_the_next_call_run_once(shop: Shop, ledger_url: str) -> None:
    """An UNKNOWN record resolved as released: the next call runs exactly once."""
    ns = shop.ledger.namespace
    key = Shop.keys["unknown"]
    ok(cli(ledger_url, ns, "resolve", key, "--released"))
    assert shown(ledger_url, ns, key)["state"] == "released"
    assert shop.call(shop.wire, 4900) == {"id": "wire_2"}
    assert shop.call(shop.wire, 4900) == {"id": "wire_2"}
    assert shop.runs["wire"] == 2
    record = shown(ledger_url, ns, key)
    assert (record["state"], record["fence"]) == ("succeeded", 2)


def test_resolve_failed_is_replayed_as_the_error(shop: Shop, ledger_url: str) -> None:
    """An UNKNOWN record resolved as failed: the next call gets that error and runs nothing."""
    ns = shop.ledger.namespace
    key = Shop.keys["unknown"]
    ok(cli(ledger_url, ns, "resolve", key, "--failed", "the bank says: no transfer", "--ttl", "1h"))
    record = shown(ledger_url, ns, key)
    assert record["error"] == {"type": "twiceshy.resolve", "message": "the bank says: no transfer"}
    with pytest.raises(twiceshy.ReplayedError, match="the bank says: no transfer"):
        shop.call(shop.wire, 4900)
    assert shop.runs["wire"] == 1


def test_resolve_refuses_settled_records(shop: Shop, ledger_url: str) -> None:
    """Resolving a SUCCEEDED, FAILED or RELEASED record fails and changes nothing."""
    ns = shop.ledger.namespace
    for state in ("succeeded", "failed", "released"):
        key = Shop.keys[state]
        before = shown(ledger_url, ns, key)
        line = one_line_error(cli(ledger_url, ns, "resolve", key, "--released"), 1)
        assert f"already {state}" in line
        assert shown(ledger_url, ns, key) == before
    assert shop.call(shop.charge, 4900) == {"id": "ch_ok"}
    assert shop.runs["charge"] == 1


def test_resolve_usage_errors(shop: Shop, ledger_url: str) -> None:
    """Not exactly one outcome, or a --succeeded that is not JSON, is a usage error (2)."""
    ns = shop.ledger.namespace
    key = Shop.keys["unknown"]
    for args in ([], ["--released", "--failed", "x"], ["--succeeded", "{id: 1}"]):
        result = cli(ledger_url, ns, "resolve", key, *args)
        assert result.exit_code == 2, result.output
    assert cli(ledger_url, ns, "resolve", key, "--succeeded", "NaN").exit_code == 2
    assert shown(ledger_url, ns, key)["state"] == "unknown"


def test_resolve_that_loses_a_race_writes_nothing(
    shop: Shop, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the record changes between the read and the fenced write, resolve fails (1)."""
    import twiceshy.cli.resolving as cli_module

    ns = shop.ledger.namespace
    key = Shop.keys["unknown"]
    find = cli_module.find_record

    raced: list[Result] = []

    def find_then_someone_else_resolves(store: Any, namespace: str, prefix: str) -> Any:
        found = find(store, namespace, prefix)
        # Another operator resolves the same record between our read and our write.
        monkeypatch.setattr(cli_module, "find_record", find)
        raced.append(cli(ledger_url, ns, "resolve", key, "--released"))
        return found

    monkeypatch.setattr(cli_module, "find_record", find_then_someone_else_resolves)
    line = one_line_error(cli(ledger_url, ns, "resolve", key, "--succeeded", '"late"'), 1)
    assert "lost a race" in line
    assert ok(raced[0]).stdout.startswith(f"resolved {key}: unknown -> released")
    monkeypatch.undo()
    record = shown(ledger_url, ns, key)
    assert (record["state"], record["result"]) == ("released", None)


def test_resolve_force_settles_a_crashed_owner(ledger_url: str, tmp_path: Path) -> None:
    """A claimed record: refused while the owner lives and without --force; forced once lapsed."""
    shop = Shop(ledger_url, f"t-{secrets.token_hex(4)}")
    ns = shop.ledger.namespace
    key = Shop.keys["claimed"]
    try:
        # A longer lease here: the heartbeat must keep it live while the command looks at it.
        with running_owner(ledger_url, ns, tmp_path, lease=1.0) as kill:
            line = one_line_error(cli(ledger_url, ns, "resolve", key, "--force", "--released"), 1)
            assert "live lease" in line
            line = one_line_error(cli(ledger_url, ns, "resolve", key, "--released"), 1)
            assert "--force" in line
            kill()
        wait_lapsed(ledger_url, ns, key)
        line = one_line_error(cli(ledger_url, ns, "resolve", key, "--released"), 1)
        assert "lease has lapsed" in line
        assert shown(ledger_url, ns, key)["state"] == "claimed"
        out = ok(cli(ledger_url, ns, "resolve", key, "--force", "--released")).stdout
        assert "claimed -> released" in out
        assert shop.call(shop.ship, "o-1") == "shipped"
        assert shop.call(shop.ship, "o-1") == "shipped"
        assert shop.runs["ship"] == 1
    finally:
        shop.ledger.close()


# -- gc and stats -------------------------------------------------------------------------------


def test_gc_removes_expired_outcomes_only(ledger_url: str, tmp_path: Path) -> None:
    """gc removes outcomes past a tiny ttl, never the UNKNOWN or the crashed CLAIMED record."""
    shop = Shop(ledger_url, f"t-{secrets.token_hex(4)}", ttl=0.3)
    other = Shop(ledger_url, f"other-{secrets.token_hex(4)}", ttl=0.3)
    ns = shop.ledger.namespace
    keys = Shop.keys
    try:
        with running_owner(ledger_url, ns, tmp_path) as kill:
            shop.park()  # charge, refund and mail keep their outcome 0.3 s; wire is UNKNOWN
            other.call(other.charge, 4900)
            kill()
        wait_lapsed(ledger_url, ns, keys["claimed"])
        time.sleep(0.4)
        dry = ok(cli(ledger_url, ns, "gc", "--dry-run")).stdout
        assert "nothing removed" in dry
        assert "2 claimed or unknown records, never removed" in dry
        would = int(dry.split("gc would remove ")[1].split()[0])
        verbose = ok(cli(ledger_url, ns, "gc", "--dry-run", "-v")).stdout
        named = {key for state, key in keys.items() if key in verbose}
        out = ok(cli(ledger_url, ns, "gc")).stdout
        removed = int(out.split()[1])
        assert out.startswith(f"removed {removed} expired outcome")
        if "redis" in ledger_url:
            assert 0 <= removed <= would <= 3  # Redis expires them itself (PEXPIREAT)
        else:
            assert would == removed == 3  # the dry runs removed nothing
            assert named == {keys["succeeded"], keys["failed"], keys["released"]}
            assert f"  {keys['succeeded']}  charge  succeeded, expired " in verbose
        assert "removed 0 expired outcomes" in ok(cli(ledger_url, ns, "gc")).stdout
        everywhere = ok(cli(ledger_url, ns, "gc", "--all-namespaces")).stdout
        if "redis" not in ledger_url:
            assert everywhere == "removed 1 expired outcome from every namespace\n"
        left = listed(ledger_url, ns)
        assert {key: r["state"] for key, r in left.items()} == {
            keys["unknown"]: "unknown",
            keys["claimed"]: "claimed",
        }
        assert left[keys["claimed"]]["lease_lapsed"] is True
        assert listed(ledger_url, other.ledger.namespace) == {}
    finally:
        shop.ledger.close()
        other.ledger.close()


def test_gc_verbose_needs_dry_run(ledger_url: str) -> None:
    """``gc -v`` without ``--dry-run`` is a usage error (exit 2), not a purge."""
    result = cli(ledger_url, "t", "gc", "-v")
    assert result.exit_code == 2, result.output
    assert "Error: -v names what --dry-run would remove; add --dry-run" in result.stderr
    assert "removed" not in result.stdout


def test_stats_counts_by_state_and_tool(parked: tuple[str, str]) -> None:
    """``stats`` counts one record per state and per tool."""
    url, ns = parked
    data = json.loads(ok(cli(url, ns, "stats", "--json")).stdout)
    assert data["records"] == 5
    assert data["by_state"] == dict.fromkeys(
        ("claimed", "succeeded", "failed", "released", "unknown"), 1
    )
    assert {tool: c["records"] for tool, c in data["by_tool"].items()} == dict.fromkeys(
        ("charge", "refund", "wire", "mail", "ship"), 1
    )
    assert data["by_tool"]["wire"]["by_state"]["unknown"] == 1
    out = ok(cli(url, ns, "stats")).stdout
    assert "5 live records" in out
    row = next(line for line in out.splitlines() if "all tools" in line)
    assert row.split()[2:] == ["1", "1", "1", "1", "1", "5"]


_CALLER = """
import sys, twiceshy
url, namespace, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
with twiceshy.Ledger(url, namespace=namespace) as ledger:
    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> dict:
        return {"id": "ch_1"}
    with twiceshy.run("run-1"):
        for _ in range(calls):
            charge(4900)
"""


def test_stats_counts_duplicates_answered_across_processes(ledger_url: str) -> None:
    """Two processes retrying one intent: ``stats`` sums one run and every replay of both."""
    ns = f"dup-{secrets.token_hex(4)}"
    for calls in (3, 4):
        subprocess.run(
            [sys.executable, "-c", _CALLER, ledger_url, ns, str(calls)], check=True, timeout=60
        )
    data = json.loads(ok(cli(ledger_url, ns, "stats", "--json")).stdout)
    assert data["calls"] == {"charge": {"executed": 1, "replayed": 6}}
    assert data["duplicates_answered"] == {"replayed": 6, "joined": 0, "waited": 0, "total": 6}
    assert data["ran"] == {"charge": 1}
    out = ok(cli(ledger_url, ns, "stats")).stdout
    assert "calls by how they were answered: 7" in out
    assert "duplicates answered without running again: 6 (6 replayed, 0 joined, 0 waited)" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["charge"] and "6" in line)
    assert row.split()[-4:] == ["1", "6", "0", "0"]


def test_stats_counts_the_calls_that_ran_beside_their_answers(ledger_url: str) -> None:
    """A tool that ran once and then answered unknown twice: ``stats`` says it ran once."""
    ns = f"ran-{secrets.token_hex(4)}"
    runs = 0
    with twiceshy.Ledger(ledger_url, namespace=ns) as ledger:

        @ledger.tool(effect=twiceshy.UNSAFE)
        def fax(text: str) -> None:
            nonlocal runs
            runs += 1
            raise TimeoutError("no answer")

        for _ in range(3):
            with twiceshy.run(SCOPE), pytest.raises(twiceshy.OutcomeUnknown):
                fax("hello")
    assert runs == 1
    data = json.loads(ok(cli(ledger_url, ns, "stats", "--json")).stdout)
    assert data["calls"] == {"fax": {"unknown": 3}}
    assert data["ran"] == {"fax": 1}
    out = ok(cli(ledger_url, ns, "stats")).stdout
    assert "calls that ran the tool: 1" in out
    assert "calls by how they were answered: 3" in out
    lines = [line.split() for line in out.splitlines()]
    at = lines.index(next(words for words in lines if words[:2] == ["tool", "ran"]))
    row = next(words for words in lines[at:] if words[:1] == ["fax"])
    by_column = dict(zip(lines[at], row, strict=True))
    assert (by_column["ran"], by_column["unknown"], by_column["executed"]) == ("1", "3", "0")


# -- errors and the real command ----------------------------------------------------------------


def test_unknown_key_is_one_line_and_exit_1(ledger_url: str) -> None:
    """An unknown key is refused with one line and exit code 1, by show and by resolve."""
    ns = f"t-{secrets.token_hex(4)}"
    for args in (["show", "feedface"], ["resolve", "feedface", "--released"]):
        line = one_line_error(cli(ledger_url, ns, *args), 1)
        assert "no record with a key starting 'feedface'" in line


@pytest.mark.parametrize(
    ("url", "code", "words"),
    [
        pytest.param("nosuch://x", 2, "bad ledger URL nosuch://x", id="bad-url"),
        pytest.param("memory://", 2, "inside one process", id="memory"),
        pytest.param("redis://127.0.0.1:1/0", 3, "unreachable", id="unreachable"),
        pytest.param("sqlite:////nonexistent/twiceshy/l.db", 3, "no ledger file", id="no-file"),
        pytest.param("postgresql://[::1/test", 2, "bad ledger URL", id="bad-ipv6"),
        pytest.param("redis://127.0.0.1:1/0?bogus=1", 2, "bad ledger URL", id="redis-param"),
    ],
)
def test_ledger_errors_are_one_line(url: str, code: int, words: str) -> None:
    """A bad URL (2) or a ledger that cannot be reached (3): one line, no traceback."""
    for command in (["ls"], ["show", "abc"], ["gc"], ["stats"]):
        assert words in one_line_error(cli(url, "", *command), code)


def test_a_mistyped_sqlite_url_names_the_absolute_path_and_the_slash_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ledger sqlite:///var/lib/x.db`` with no ./var/lib: the file looked for, and the rule."""
    monkeypatch.chdir(tmp_path)
    line = one_line_error(cli("sqlite:///var/lib/billing/l.db", "", "ls"), 3)
    assert f"no ledger file at {str(tmp_path / 'var/lib/billing/l.db')!r}" in line
    assert "sqlite:///relative/x.db (three slashes) is relative to the working directory" in line
    assert "sqlite:////absolute/x.db (four slashes) is absolute" in line
    assert list(tmp_path.iterdir()) == []


def test_password_is_not_printed() -> None:
    """A password in the ledger URL never reaches the terminal, even in a URL urlsplit refuses."""
    line = one_line_error(cli("redis://:hunter2@127.0.0.1:1/0", "", "ls"), 3)
    assert "hunter2" not in line
    assert "***" in line
    line = one_line_error(cli("postgresql://u:hunter2@[::1/test", "", "ls"), 2)
    assert "hunter2" not in line
    assert "***" in line


# Every command that opens a ledger (reconcile's tools use a memory:// ledger of their own).
LEDGER_COMMANDS = [
    ["ls"],
    ["show", "abc"],
    ["resolve", "abc", "--released"],
    ["gc"],
    ["stats"],
    ["reconcile", "reconcile_tools:tools"],
]


@pytest.mark.postgres
def test_no_command_creates_a_postgres_ledger(pg: tuple[str, str]) -> None:
    """A URL naming a schema with no ledger: exit 1, one line, and the schema is not created."""
    url, schema = pg
    for command in LEDGER_COMMANDS:
        line = one_line_error(cli(f"{url}?schema={schema}", "", *command), 1)
        where = urlsplit(url)
        assert line.startswith(
            f"Error: no twiceshy ledger at {where.netloc.rpartition('@')[2]}{where.path}: "
        ), line
        assert f'"{schema}"."records"' in line
    with psycopg.connect(url) as conn:
        found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
        assert found.fetchone() is None


def test_no_command_writes_into_another_applications_sqlite_file(tmp_path: Path) -> None:
    """A URL naming another application's SQLite file: exit 1, one line, not a byte changed."""
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    finally:
        conn.close()
    before = path.read_bytes()
    for command in LEDGER_COMMANDS:
        line = one_line_error(cli(f"sqlite:///{path}", "", *command), 1)
        assert line.startswith(f"Error: no twiceshy ledger at {str(path)!r}: the file holds no ")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["app.db"]


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["stats"]], ids=" ".join)
def test_a_reader_that_goes_away_ends_the_command_quietly(
    tmp_path: Path, command: list[str]
) -> None:
    """``twiceshy ls | head -1``: the console script ends with exit 141 and prints nothing."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    store, _ = open_store(url)
    try:
        for i in range(200):
            store.claim(
                "",
                f"k{i:03}",
                fingerprint="fp",
                tool="charge",
                effect=twiceshy.KEYED,
                owner="o",
                lease=600.0,
            )
    finally:
        store.close()
    script = shutil.which("twiceshy", path=os.path.dirname(sys.executable))
    assert script is not None, "the twiceshy console script is not installed"
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [script, *command, "--ledger", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader goes away before the first line is written
    _, err = proc.communicate(timeout=60)
    assert err == b""
    assert proc.returncode == EXIT_BROKEN_PIPE == 141


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    env.pop("TWICESHY_LEDGER", None)
    return subprocess.run(
        [sys.executable, "-m", "twiceshy", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_python_m_twiceshy(parked: tuple[str, str]) -> None:
    """``python -m twiceshy`` lists and shows records, and fails an unknown key in one line."""
    url, ns = parked
    done = _script("ls", "--json", "--ledger", url, "--namespace", ns)
    assert done.returncode == 0, done.stderr
    assert {r["state"] for r in json.loads(done.stdout)} == set(Shop.keys)
    done = _script("show", Shop.keys["unknown"][:12], "--ledger", url, "--namespace", ns)
    assert done.returncode == 0, done.stderr
    assert Shop.keys["unknown"] in done.stdout
    done = _script("show", "feedface", "--ledger", url, "--namespace", ns)
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_python_m_twiceshy_ledger_from_the_environment() -> None:
    """``TWICESHY_LEDGER`` names the ledger; an unreachable one exits 3 with one line."""
    env = {**os.environ, "TWICESHY_LEDGER": "redis://127.0.0.1:1/0"}
    done = subprocess.run(
        [sys.executable, "-m", "twiceshy", "stats"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "redis://127.0.0.1:1/0" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("url", "code", "words"),
    [
        pytest.param("nosuch://x", 2, "bad ledger URL", id="bad-url"),
        pytest.param("redis://:hunter2@127.0.0.1:1/0", 3, "unreachable", id="unreachable"),
        pytest.param("redis://:hunter2@127.0.0.1:1/0?bogus=1", 2, "bad ledger URL", id="param"),
        pytest.param(
            "postgresql://postgres:hunter2@127.0.0.1:1/test", 3, "cannot be reached", id="pg"
        ),
        pytest.param(
            "postgresql://postgres@127.0.0.1:1/test?password=hunter2",
            3,
            "cannot be reached",
            id="pg-query",
        ),
        pytest.param("redis://127.0.0.1:1/0?password=hunter2", 3, "unreachable", id="redis-query"),
        pytest.param(
            "postgersql://u@h/test?password=hunter2", 2, "unknown ledger URL", id="scheme"
        ),
    ],
)
def test_demo_ledger_errors_follow_the_exit_codes(url: str, code: int, words: str) -> None:
    """``demo --ledger``: a bad URL exits 2, an unreachable ledger 3; one line, no password."""
    result = CliRunner().invoke(main, ["demo", "--ledger", url], catch_exceptions=False)
    line = one_line_error(result, code)
    assert words in line
    assert "hunter2" not in result.output


# -- what reaches the terminal ------------------------------------------------------------------

OSC = "\x1b]0;pwned\x07"  # sets the terminal's title
CSI = "\x1b[2J"  # clears the screen
C1 = "\x9b31m"  # U+009B, a CSI in one character: turns the text red
HOSTILE_TOOL = f"wire{OSC}{C1}"
# What the commands show instead: each control character as an escape.
SHOWN_TOOL = r"wire\x1b]0;pwned\x07\u009b31m"
HOSTILE_KEYS = {
    "unknown": f"hostile-{CSI}-unknown",
    "succeeded": "hostile-succeeded",
    "failed": "hostile-failed",
    "text": f"hostile-{OSC}-text",
}


def terminal(url: str, namespace: str, *args: str) -> Result:
    """Run a command as on a terminal, where click strips no escape sequence; no rich colours."""
    runner = CliRunner(env={"COLUMNS": "200", "FORCE_COLOR": None, "TTY_COMPATIBLE": None})
    return runner.invoke(
        main,
        [*args, "--ledger", url, "--namespace", namespace],
        color=True,
        catch_exceptions=False,
    )


def no_controls(text: str) -> str:
    """``text``, which must hold no character a terminal acts on (newlines aside)."""
    found = {f"{ord(c):#04x}" for c in text if c != "\n" and (c < " " or "\x7f" <= c <= "\x9f")}
    assert not found, (found, text)
    return text


@pytest.fixture
def hostile(ledger_url: str) -> tuple[str, str]:
    """A namespace whose records carry OSC, CSI and C1 sequences in their tool name, keys,
    owner, error messages, reasons and results, left by real calls and by the store's API."""
    ns = f"hostile-{secrets.token_hex(4)}"
    with twiceshy.Ledger(ledger_url, namespace=ns) as ledger:
        unsafe = ledger.guard(HOSTILE_TOOL, effect=twiceshy.UNSAFE)
        keyed = ledger.guard(HOSTILE_TOOL, effect=twiceshy.KEYED, definite=[Declined])

        def timeout() -> None:
            raise TimeoutError(f"the bank {OSC}did not answer{C1}")

        def decline() -> None:
            raise Declined(f"card {CSI}declined{C1}")

        with pytest.raises(twiceshy.OutcomeUnknown):
            unsafe.call({"n": 1}, timeout, key=HOSTILE_KEYS["unknown"])
        result = {"id": f"ch{OSC}{C1}"}
        assert keyed.call({"n": 2}, lambda: result, key=HOSTILE_KEYS["succeeded"]) == result
        with pytest.raises(Declined):
            keyed.call({"n": 3}, decline, key=HOSTILE_KEYS["failed"])
    # A result that is not JSON at all, by an owner named with an OSC: only the store's API
    # writes those.
    store, _ = open_store(ledger_url)
    try:
        key = HOSTILE_KEYS["text"]
        claimed = store.claim(
            ns,
            key,
            fingerprint="fp",
            tool=HOSTILE_TOOL,
            effect=twiceshy.KEYED,
            owner=f"owner{OSC}",
            lease=60.0,
        )
        assert claimed.won
        done = store.write(
            ns,
            key,
            twiceshy.Change(
                fence=1,
                from_states=frozenset({twiceshy.State.CLAIMED}),
                to=twiceshy.State.SUCCEEDED,
                result=f"plain {CSI}text{C1}",
                ttl=3600.0,
            ),
        )
        assert done.won
    finally:
        store.close()
    return ledger_url, ns


def test_ls_and_stats_show_escape_sequences_escaped(hostile: tuple[str, str]) -> None:
    """``ls`` and ``stats`` print no OSC, CSI or C1 sequence of a tool name or key, but its
    escaped text."""
    url, ns = hostile
    out = no_controls(ok(terminal(url, ns, "ls")).stdout)
    assert out.count(SHOWN_TOOL) == 4
    assert r"hostile-\x1b[2J " in out  # the key's first 12 characters
    # The unknown record's reason, escaped, then cut to 40 characters.
    assert r"TimeoutError: the bank \x1b]0;pwned\x07…" in out
    assert "did not answer" not in out
    out = no_controls(ok(terminal(url, ns, "stats")).stdout)
    row = next(line for line in out.splitlines() if SHOWN_TOOL in line)
    assert row.split()[1:] == ["0", "2", "1", "0", "1", "4"]


def test_show_prints_escape_sequences_escaped(hostile: tuple[str, str]) -> None:
    """``show`` prints a record's tool, key, owner, error, reason and result escaped."""
    url, ns = hostile
    out = no_controls(ok(terminal(url, ns, "show", HOSTILE_KEYS["unknown"])).stdout)
    assert SHOWN_TOOL in out
    assert r"hostile-\x1b[2J-unknown" in out
    rows = {line.partition(" ")[0]: line.partition(" ")[2].strip() for line in out.splitlines()}
    message = r"TimeoutError: the bank \x1b]0;pwned\x07did not answer\u009b31m"
    assert rows["error"] == f"builtins.{message}"
    assert rows["reason"] == message
    out = no_controls(ok(terminal(url, ns, "show", HOSTILE_KEYS["failed"])).stdout)
    assert r"card \x1b[2Jdeclined\u009b31m" in out
    out = no_controls(ok(terminal(url, ns, "show", HOSTILE_KEYS["succeeded"])).stdout)
    assert r'"id": "ch\u001b]0;pwned\u0007\u009b31m"' in out  # JSON escapes, as in --json
    out = no_controls(ok(terminal(url, ns, "show", HOSTILE_KEYS["text"])).stdout)
    assert r"owner\x1b]0;pwned\x07" in out
    assert r"plain \x1b[2Jtext\u009b31m" in out


def test_json_output_is_exact_and_escaped(hostile: tuple[str, str]) -> None:
    """``--json`` prints every control character as a JSON escape; the values read back exact."""
    url, ns = hostile
    out = no_controls(ok(terminal(url, ns, "ls", "--json")).stdout)
    assert r"\u001b]0;pwned\u0007\u009b31m" in out
    records = {r["key"]: r for r in json.loads(out)}
    assert set(records) == set(HOSTILE_KEYS.values())
    assert {r["tool"] for r in records.values()} == {HOSTILE_TOOL}
    unknown = records[HOSTILE_KEYS["unknown"]]
    assert unknown["reason"] == f"TimeoutError: the bank {OSC}did not answer{C1}"
    assert records[HOSTILE_KEYS["succeeded"]]["result"] == {"id": f"ch{OSC}{C1}"}
    assert records[HOSTILE_KEYS["text"]]["result"] == f"plain {CSI}text{C1}"
    assert records[HOSTILE_KEYS["text"]]["owner"] == f"owner{OSC}"
    out = no_controls(ok(terminal(url, ns, "show", "--json", HOSTILE_KEYS["failed"])).stdout)
    assert json.loads(out)["error"]["message"] == f"card {CSI}declined{C1}"
    out = no_controls(ok(terminal(url, ns, "stats", "--json")).stdout)
    assert json.loads(out)["by_tool"][HOSTILE_TOOL]["records"] == 4


def test_errors_and_resolve_show_escape_sequences_escaped(hostile: tuple[str, str]) -> None:
    """An ambiguous prefix's error line and ``resolve``'s report print keys and tools escaped."""
    url, ns = hostile
    result = terminal(url, ns, "show", "hostile-")
    line = no_controls(one_line_error(result, 1))
    assert r"(hostile-\x1b]0;, hostile-fail, hostile-succ, hostile-\x1b[2J)" in line
    result = terminal(url, ns, "resolve", HOSTILE_KEYS["unknown"], "--succeeded", f'"{C1}"')
    out = no_controls(ok(result).stdout)
    assert rf"resolved hostile-\x1b[2J-unknown: unknown -> succeeded (tool {SHOWN_TOOL}," in out
    assert r'result: "\u009b31m"' in out


def test_reconcile_shows_escape_sequences_escaped(
    hostile: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reconcile`` prints the tool, key and a reconciler's error escaped."""
    url, ns = hostile
    module = f"hostile_reconciler_{secrets.token_hex(4)}"
    (tmp_path / f"{module}.py").write_text(
        "import twiceshy\n"
        "def ask(key, arguments):\n"
        f"    raise RuntimeError({f'the provider {OSC}failed{C1}'!r})\n"
        "ledger = twiceshy.Ledger('memory://')\n"
        f"tools = [ledger.guard({HOSTILE_TOOL!r}, effect=twiceshy.UNSAFE, reconcile=ask)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        out = no_controls(ok(terminal(url, ns, "reconcile", f"{module}:tools")).stdout)
    finally:
        sys.modules.pop(module, None)
    assert SHOWN_TOOL in out
    assert r"hostile-\x1b[2J " in out
    assert r"RuntimeError: the provider \x1b]0;pwned\x07failed\u009b31m" in out


def test_a_result_nested_too_deeply_is_shown_as_text(tmp_path: Path) -> None:
    """A stored result nested deeper than Python's parser goes: shown as text, no traceback."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    deep = "[" * 100_000 + "]" * 100_000
    store, _ = open_store(url)
    try:
        store.claim(
            "", "deep", fingerprint="fp", tool="t", effect=twiceshy.KEYED, owner="o", lease=60
        )
        change = twiceshy.Change(
            fence=1,
            from_states=frozenset({twiceshy.State.CLAIMED}),
            to=twiceshy.State.SUCCEEDED,
            result=deep,
            ttl=3600.0,
        )
        assert store.write("", "deep", change).won
    finally:
        store.close()
    assert deep in "".join(ok(cli(url, "", "show", "deep")).stdout.split())  # folded lines
    assert json.loads(ok(cli(url, "", "ls", "--json")).stdout)[0]["result"] == deep


# -- secrets ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "code"),
    [
        pytest.param("postgresql://u:hunter2@127.0.0.1:1/test", 3, id="pg-user-part"),
        pytest.param("postgresql://u@127.0.0.1:1/test?password=hunter2", 3, id="pg-query"),
        pytest.param("postgresql://u@127.0.0.1:1/test?sslpassword=hunter2", 3, id="pg-ssl"),
        pytest.param("postgresql://u:hunt%65r2@127.0.0.1:1/test", 3, id="pg-encoded"),
        pytest.param("postgresql://u:hunter2/x@127.0.0.1:1/test", 3, id="pg-unencoded-slash"),
        pytest.param("postgresql://u@127.0.0.1:1/test?password=hunter2&bogus=1", 2, id="pg-param"),
        pytest.param("redis://:hunter2@127.0.0.1:1/0", 3, id="redis-user-part"),
        pytest.param("redis://127.0.0.1:1/0?password=hunter2", 3, id="redis-query"),
        pytest.param("redis://127.0.0.1:1/0?password=hunter2&bogus=1", 2, id="redis-param"),
        pytest.param("postgersql://u:hunter2@127.0.0.1/test", 2, id="scheme-user-part"),
        pytest.param("postgersql://u@127.0.0.1/test?password=hunter2", 2, id="scheme-query"),
        pytest.param("host=127.0.0.1 password=hunter2", 2, id="scheme-libpq-string"),
        pytest.param("postgresql://u@[::1/test?password=hunter2", 2, id="unparsable"),
        pytest.param("memory://?password=hunter2", 2, id="memory"),
        pytest.param("sqlite:////nonexistent/twiceshy/l.db?password=hunter2", 3, id="no-file"),
    ],
)
def test_no_error_line_shows_a_password(url: str, code: int) -> None:
    """Whatever the URL's failure, no command's error line shows its password, in the user part
    or as a query parameter, as written or percent-decoded."""
    for command in LEDGER_COMMANDS:
        result = cli(url, "", *command)
        line = one_line_error(result, code)
        assert "hunter2" not in result.output
        assert "hunt%65r2" not in result.output
        assert "***" in line


@pytest.mark.postgres
@pytest.mark.parametrize("form", ["user-part", "query"])
def test_ledger_not_found_shows_no_password(pg: tuple[str, str], form: str) -> None:
    """No twiceshy ledger at a PostgreSQL URL with a password: the error line hides it."""
    base, schema = pg
    parts = urlsplit(base)
    if form == "user-part":
        netloc = f"{parts.username or 'postgres'}:hunter2@{parts.hostname}:{parts.port or 5432}"
        url = urlunsplit(parts._replace(netloc=netloc))
    else:
        url = _with_query(base, "password", "hunter2")
    url = _with_query(url, "schema", schema)
    result = cli(url, "", "ls")
    line = one_line_error(result, 1)
    assert line.startswith("Error: no twiceshy ledger at ")
    assert "hunter2" not in result.output
    assert "***" in line


def test_the_ledger_from_the_environment_shows_no_password() -> None:
    """``TWICESHY_LEDGER`` with a password: the error line hides it."""
    runner = CliRunner(env={"TWICESHY_LEDGER": "redis://127.0.0.1:1/0?password=hunter2"})
    result = runner.invoke(main, ["stats"], catch_exceptions=False)
    assert "password=***" in one_line_error(result, 3)
    assert "hunter2" not in result.output


def test_a_target_that_quotes_a_url_shows_no_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconcile target failing with an error that quotes a URL: its secrets are hidden."""
    module = f"leaky_target_{secrets.token_hex(4)}"
    (tmp_path / f"{module}.py").write_text(
        "raise RuntimeError('cannot reach postgresql://app:hunter2@db/x?token=hunter2')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = CliRunner()
    result = runner.invoke(main, ["reconcile", f"{module}:tools", "--ledger", "memory://"])
    line = one_line_error(result, 1)
    assert "postgresql://app:***@db/x?token=***" in line
    assert "hunter2" not in result.output


def test_a_lapse_marked_unknown_is_not_released_within_its_grace(ledger_url: str) -> None:
    """An unknown outcome marked when its owner's lease lapsed is shown as such, and
    ``resolve --released`` refuses it within ``--grace`` (the owner may only be paused);
    ``--force``, or a grace that has passed, releases it."""
    ns = f"lapse-{secrets.token_hex(4)}"
    with twiceshy.Ledger(ledger_url, namespace=ns, counts_interval=None) as ledger:
        guard = ledger.guard("wire", effect=twiceshy.UNSAFE, wait=0.0)
        keys = []
        for amount in (1, 2):
            key = guard.key_for({"amount": amount}, scope="run-1")
            fingerprint = guard.bind({"amount": amount}).identity(None, "wire")[1]
            claim = ledger.store.claim(
                ns,
                key,
                fingerprint=fingerprint,
                tool="wire",
                effect=twiceshy.UNSAFE,
                owner="paused-process",
                lease=0.05,
            )
            assert claim.won
            keys.append(key)
        time.sleep(0.2)  # both leases lapse on the store's clock
        for amount in (1, 2):
            with twiceshy.run("run-1"), pytest.raises(twiceshy.OutcomeUnknown):
                guard.call({"amount": amount}, lambda: None)
    out = " ".join(ok(cli(ledger_url, ns, "show", keys[0])).stdout.split())
    assert "unknown (a lapsed lease)" in out
    assert "the owner may only have been paused and may still take effect" in out
    refused = one_line_error(cli(ledger_url, ns, "resolve", keys[0], "--released"), 1)
    assert "a lapse is not a crash" in refused
    assert shown(ledger_url, ns, keys[0])["state"] == "unknown"
    ok(cli(ledger_url, ns, "resolve", keys[0], "--released", "--force"))
    assert shown(ledger_url, ns, keys[0])["state"] == "released"
    ok(cli(ledger_url, ns, "resolve", keys[1], "--released", "--grace", "0s"))
    assert shown(ledger_url, ns, keys[1])["state"] == "released"
