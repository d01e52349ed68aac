"""``twiceshy reconcile``, ``twiceshy.reconcilers.stripe_like``, and what a reconciler's answer
means for the calls that come after it (it happened: never run again).

Records are left UNKNOWN by real UNSAFE calls whose provider (a double, ``tests/reconcile_tools``)
times out after creating the object, or before; the command imports the tools as the user names
them and settles the records of the ledger it is given, on SQLite, PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import servers
import twiceshy
from reconcile_tools import PROVIDER_ENV, Provider, make_tools
from twiceshy import State
from twiceshy.cli import main
from twiceshy.reconcilers import stripe_like
from twiceshy.stores import open_store

ROOT = Path(__file__).resolve().parent.parent
SCOPE = "run-1"
TOOLS = "tests.reconcile_tools:tools"


def _with_query(base: str, name: str, value: str) -> str:
    return f"{base}{'&' if '?' in base else '?'}{name}={value}"


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
        pytest.param("redis", id="redis", marks=pytest.mark.redis),
    ]
)
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A ledger URL of each kind, isolated (its own file, schema or key prefix), cleaned up."""
    kind = request.param
    if kind == "sqlite":
        path = tmp_path / "ledger.db"
        store, _ = open_store(f"sqlite:///{path}")
        store.close()
        yield f"sqlite:///{path}"
    elif kind == "postgres":
        base = servers.require("postgres")
        schema = f"twiceshy_rec_{secrets.token_hex(6)}"
        url = _with_query(base, "schema", schema)
        store, _ = open_store(url)  # a ledger that exists, as the commands expect
        store.close()
        yield url
        servers.drop_schema(base, schema)
    else:
        base = servers.require("redis")
        prefix = f"twiceshy-rec-{secrets.token_hex(6)}"
        yield _with_query(base, "prefix", prefix)
        servers.delete_prefix(base, prefix)


@pytest.fixture
def provider(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Provider:
    """The provider double of this test, seen by the tools in this process and in subprocesses."""
    path = tmp_path / "provider.json"
    monkeypatch.setenv(PROVIDER_ENV, str(path))
    monkeypatch.chdir(ROOT)  # `tests.reconcile_tools` is imported from the current directory
    return Provider(path)


@dataclass
class Parked:
    """A ledger with UNKNOWN records of every kind, and their keys by name."""

    url: str
    namespace: str
    provider: Provider
    keys: dict[str, str]

    def state(self, name: str) -> twiceshy.State | None:
        """The state of the record ``name`` in the ledger."""
        store, _ = open_store(self.url)
        try:
            record = store.get(self.namespace, self.keys[name]).record
        finally:
            store.close()
        return None if record is None else record.state

    def call(self, tool: str, amount: int) -> Any:
        """Call a tool through a fresh ``Ledger`` on the URL, in the scope of the parked calls."""
        with twiceshy.Ledger(self.url, namespace=self.namespace) as ledger:
            tools = make_tools(ledger)
            with twiceshy.run(SCOPE):
                return tools[tool](amount)


def _park(url: str, namespace: str, provider: Provider) -> Parked:
    """Leave one UNKNOWN record per case through real calls whose provider times out."""
    cases = {
        "found": ("charge", 1, "after"),  # created, then the answer was lost
        "absent": ("charge", 2, "before"),  # never created; the provider cannot be sure
        "released": ("wire", 3, "before"),  # never created; the provider is authoritative
        "broken": ("refund", 4, "after"),  # its reconciler raises
        "manual": ("mail", 5, "after"),  # no reconciler at all
    }
    keys: dict[str, str] = {}
    with twiceshy.Ledger(url, namespace=namespace) as ledger:
        tools = make_tools(ledger)
        for name, (tool, amount, when) in cases.items():
            before = {r.key for r in ledger.store.records(namespace, tool=tool)}
            provider.time_out(when)
            with twiceshy.run(SCOPE), pytest.raises(twiceshy.OutcomeUnknown):
                tools[tool](amount)
            (keys[name],) = {r.key for r in ledger.store.records(namespace, tool=tool)} - before
    parked = Parked(url, namespace, provider, keys)
    assert {parked.state(name) for name in keys} == {twiceshy.State.UNKNOWN}
    return parked


@pytest.fixture
def parked(ledger_url: str, provider: Provider) -> Parked:
    """A ledger of each kind with UNKNOWN records of every kind."""
    return _park(ledger_url, f"ns-{secrets.token_hex(4)}", provider)


def cli(parked: Parked, *args: str) -> Result:
    """Run ``twiceshy reconcile ARGS --ledger URL --namespace NS`` in process."""
    runner = CliRunner(env={"COLUMNS": "160"})
    return runner.invoke(
        main,
        ["reconcile", *args, "--ledger", parked.url, "--namespace", parked.namespace],
        catch_exceptions=False,
    )


def rows(result: Result) -> dict[str, dict[str, Any]]:
    """The ``--json`` rows of a successful run, by key."""
    assert result.exit_code == 0, result.output
    return {r["key"]: r for r in json.loads(result.stdout)}


def test_found_becomes_succeeded_and_is_replayed(parked: Parked) -> None:
    """An object found at the provider settles the record SUCCEEDED; the next call replays it."""
    found = rows(cli(parked, TOOLS, "--json"))[parked.keys["found"]]
    assert found["result"] == "succeeded"
    assert found["state"] == "succeeded"
    assert parked.state("found") is twiceshy.State.SUCCEEDED
    runs = parked.provider.runs("charge")
    (obj,) = [o for o in parked.provider.objects.values() if o["amount"] == 1]
    assert parked.call("charge", 1) == obj
    assert parked.provider.runs("charge") == runs


def test_absent_stays_unknown(parked: Parked) -> None:
    """Nothing found at a provider that cannot be sure leaves the record UNKNOWN."""
    absent = rows(cli(parked, TOOLS, "--json"))[parked.keys["absent"]]
    assert absent["result"] == "still unknown"
    assert absent["error"] is None
    assert parked.state("absent") is twiceshy.State.UNKNOWN


def test_absent_at_an_authoritative_provider_is_released_and_runs_once(parked: Parked) -> None:
    """With ``absent_means_not_applied``, nothing found releases the record; it then runs once."""
    released = rows(cli(parked, TOOLS, "--json"))[parked.keys["released"]]
    assert released["result"] == "released"
    assert parked.state("released") is twiceshy.State.RELEASED
    runs = parked.provider.runs("wire")
    first = parked.call("wire", 3)
    assert parked.call("wire", 3) == first
    assert parked.provider.runs("wire") == runs + 1
    assert parked.state("released") is twiceshy.State.SUCCEEDED


def test_reconciler_that_raises_is_reported_and_leaves_unknown(parked: Parked) -> None:
    """A reconciler that raises is reported as an error; its record stays UNKNOWN. It was
    given the arguments its record kept."""
    found = rows(cli(parked, TOOLS, "--json"))
    broken = found[parked.keys["broken"]]
    assert broken["result"] == "error"
    assert broken["error"] == "ConnectionError: provider API unreachable, asked about {'amount': 4}"
    assert parked.state("broken") is twiceshy.State.UNKNOWN
    assert parked.keys["manual"] not in found  # a tool without reconciler is not asked
    assert parked.state("manual") is twiceshy.State.UNKNOWN


def test_table_names_every_result(parked: Parked) -> None:
    """Without ``--json`` a table gives each record's key, tool and result."""
    result = cli(parked, TOOLS)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for word in ("succeeded", "released", "still unknown", "error", "ConnectionError"):
        assert word in out
    assert parked.keys["found"][:12] in out
    assert "asked about 4 unknown records" in out


def test_dry_run_asks_nothing(parked: Parked) -> None:
    """``--dry-run`` lists the records that would be asked about and settles none."""
    found = rows(cli(parked, TOOLS, "--dry-run", "--json"))
    assert {found[parked.keys[n]]["result"] for n in ("found", "absent", "released", "broken")} == {
        "would ask"
    }
    assert len(found) == 4
    assert {parked.state(n) for n in parked.keys} == {twiceshy.State.UNKNOWN}


def test_guards_and_several_targets(parked: Parked) -> None:
    """Targets may name ``Guard`` objects, single tools, and several targets at once."""
    found = rows(
        cli(parked, "tests.reconcile_tools:guards", "tests.reconcile_tools:refund", "--json")
    )
    assert {r["tool"] for r in found.values()} == {"charge", "wire", "refund"}
    assert parked.state("found") is twiceshy.State.SUCCEEDED


def test_nothing_parked_says_so(ledger_url: str, provider: Provider) -> None:
    """A ledger with no unknown records of the tools says so and exits 0."""
    result = cli(Parked(ledger_url, "empty", provider, {}), TOOLS)
    assert result.exit_code == 0, result.output
    assert "no unknown records" in result.stdout


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("tests.no_such_module:tools", "cannot import"),
        ("tests.reconcile_tools", "not module:attribute"),
        ("tests.reconcile_tools:nope", "has no attribute"),
        ("tests.reconcile_tools:unreconciled", "no protected tool with a reconcile"),
        ("tests.reconcile_tools:not_tools", "is not a tool protected by twiceshy"),
    ],
)
def test_bad_target_is_one_line_and_exit_1(
    target: str, words: str, tmp_path: Path, provider: Provider
) -> None:
    """A target that cannot be imported or names no tool with a reconciler: one line, exit 1."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    store, _ = open_store(url)
    store.close()
    result = cli(Parked(url, "", provider, {}), target)
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert words in lines[0]


def test_python_m_twiceshy_reconcile(tmp_path: Path, provider: Provider) -> None:
    """``python -m twiceshy reconcile`` in a subprocess settles the records of its ledger."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    parked = _park(url, "", provider)
    done = subprocess.run(
        [sys.executable, "-m", "twiceshy", "reconcile", TOOLS, "--ledger", url, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, PROVIDER_ENV: str(provider.path)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = {r["key"]: r["result"] for r in json.loads(done.stdout)}
    assert found[parked.keys["found"]] == "succeeded"
    assert found[parked.keys["released"]] == "released"
    assert found[parked.keys["absent"]] == "still unknown"
    assert found[parked.keys["broken"]] == "error"
    assert parked.state("found") is twiceshy.State.SUCCEEDED
    runs = provider.runs("charge")
    assert parked.call("charge", 1)["metadata"]["twiceshy_key"] == parked.keys["found"]
    assert provider.runs("charge") == runs


# -- stripe_like --------------------------------------------------------------------------------


def _objects(**by_key: Mapping[str, Any]) -> Any:
    def find(key: str) -> Mapping[str, Any] | None:
        return by_key.get(key)

    return find


@pytest.mark.parametrize("status", ["succeeded", "processing", "requires_capture"])
def test_stripe_like_found_and_succeeded_happened(status: str) -> None:
    """A found object in a succeeded state is ``Happened`` with the object as the result."""
    obj = {"id": "pi_1", "status": status}
    reconcile = stripe_like(_objects(k=obj))
    assert reconcile("k", None) == twiceshy.Happened(obj)


@pytest.mark.parametrize("status", ["canceled", "requires_payment_method", "failed"])
def test_stripe_like_found_but_failed_did_not_happen(status: str) -> None:
    """A found object in a failed state means the effect did not take place."""
    reconcile = stripe_like(_objects(k={"id": "pi_1", "status": status}))
    assert reconcile("k", {"amount": 1}) == twiceshy.DidNotHappen()


def test_stripe_like_absent_cannot_tell() -> None:
    """Nothing found is ``None`` (cannot tell) by default."""
    assert stripe_like(_objects())("k", None) is None


def test_stripe_like_absent_at_an_authoritative_provider_did_not_happen() -> None:
    """With ``absent_means_not_applied=True``, nothing found is ``DidNotHappen``."""
    reconcile = stripe_like(_objects(), absent_means_not_applied=True)
    assert reconcile("k", None) == twiceshy.DidNotHappen()


def test_stripe_like_find_that_raises_cannot_tell(caplog: pytest.LogCaptureFixture) -> None:
    """A lookup that raises is ``None`` (even for an authoritative provider), and is logged."""

    def find(key: str) -> Mapping[str, Any] | None:
        raise ConnectionError("down")

    with caplog.at_level(logging.WARNING, logger="twiceshy"):
        assert stripe_like(find, absent_means_not_applied=True)("k", None) is None
    assert "looking up key k" in caplog.text


def test_stripe_like_custom_succeeded_and_result() -> None:
    """``succeeded=`` decides what took effect; ``result=`` makes the stored result."""
    obj = {"id": "ch_1", "paid": True, "status": "weird"}
    reconcile = stripe_like(
        _objects(k=obj), succeeded=lambda o: bool(o["paid"]), result=lambda o: o["id"]
    )
    assert reconcile("k", None) == twiceshy.Happened("ch_1")
    unpaid = stripe_like(_objects(k={**obj, "paid": False}), succeeded=lambda o: bool(o["paid"]))
    assert unpaid("k", None) == twiceshy.DidNotHappen()


@pytest.mark.parametrize("status", ["requires_action", "requires_confirmation", "pending", None])
def test_stripe_like_found_in_an_unsettled_or_unknown_state_is_never_did_not_happen(
    status: str | None,
) -> None:
    """An object still under way, or in a state it does not know, is never "did not happen".

    A PaymentIntent waiting for 3-D Secure may still be paid, a pending charge is being paid:
    releasing either would run the tool again beside it.
    """
    obj = {"id": "py_1"} if status is None else {"id": "py_1", "status": status}
    answer = stripe_like(_objects(k=obj))("k", None)
    assert answer != twiceshy.DidNotHappen()
    assert answer is None or answer == twiceshy.Happened(obj)


def test_stripe_like_succeeded_may_answer_cannot_tell() -> None:
    """A ``succeeded=`` that answers ``None`` leaves the doubt standing."""
    reconcile = stripe_like(_objects(k={"id": "x"}), succeeded=lambda o: None)
    assert reconcile("k", None) is None


def test_stripe_like_with_an_async_lookup_settles_an_async_tool() -> None:
    """An async ``find`` (an async provider client) reconciles an async tool's parked call."""
    objects: dict[str, dict[str, Any]] = {}
    runs: list[int] = []

    async def find(key: str) -> Mapping[str, Any] | None:
        await asyncio.sleep(0)
        return objects.get(key)

    ledger = twiceshy.Ledger("memory://")

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=stripe_like(find))
    async def charge(amount: int) -> dict[str, Any]:
        runs.append(amount)
        key = twiceshy.current_key()
        assert key is not None
        objects[key] = {"id": "pi_1", "status": "succeeded", "amount": amount}
        raise TimeoutError("the provider did not answer")

    async def calls() -> tuple[Any, Any]:
        with twiceshy.run(SCOPE):
            with pytest.raises(twiceshy.OutcomeUnknown):
                await charge(5)
            return await charge(5), await charge(5)

    first, second = asyncio.run(calls())
    assert first == second == {"id": "pi_1", "status": "succeeded", "amount": 5}
    assert runs == [5]


def test_stripe_like_with_an_async_lookup_is_refused_for_a_sync_tool() -> None:
    """A sync tool cannot await an async ``find``: refused when the tool is decorated."""

    async def find(key: str) -> Mapping[str, Any] | None:
        return None

    ledger = twiceshy.Ledger("memory://")
    with pytest.raises(TypeError, match="sync reconcile"):

        @ledger.tool(effect=twiceshy.UNSAFE, reconcile=stripe_like(find))
        def charge(amount: int) -> None:
            pass


def test_stripe_like_async_lookup_that_raises_cannot_tell(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An async lookup that raises is ``None``, and is logged."""

    async def find(key: str) -> Mapping[str, Any] | None:
        raise ConnectionError("down")

    with caplog.at_level(logging.WARNING, logger="twiceshy"):
        answer = asyncio.run(stripe_like(find, absent_means_not_applied=True)("k", None))
    assert answer is None
    assert "looking up key k" in caplog.text


# -- a reconciler's answer, for the calls that come after it ------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_an_unsafe_intent_reconciled_as_happened_with_no_retention_never_reruns(
    kind: str, tmp_path: Path
) -> None:
    """A reconciler said the UNSAFE intent happened: the same call must not run it again."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}" if kind == "sqlite" else "memory://"
    ledger = twiceshy.Ledger(url, counts_interval=None)
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.UNSAFE, ttl=0, reconcile=lambda k, a: twiceshy.Happened("sent"))
    def send(to: str) -> str:
        runs.append(1)
        if len(runs) == 1:
            raise TimeoutError("the provider did not answer")
        return "sent a second time"

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            send("ada")
        assert send("ada") == "sent"  # the reconciler's answer
    assert runs == [1]
    ledger.close()


def test_a_reconciler_whose_result_cannot_be_stored_records_it_happened() -> None:
    """It says the call happened, with a result that has no JSON form: recorded as done, and
    every later call is told that it ran (never that the outcome is unknown, never a rerun)."""
    ledger = twiceshy.Ledger("memory://", counts_interval=None)
    runs: list[int] = []

    def reconcile(key: str, arguments: Any) -> twiceshy.Happened:
        return twiceshy.Happened({"took": object()})

    @ledger.tool(effect=twiceshy.UNSAFE, reconcile=reconcile)
    def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        raise TimeoutError("the gateway did not answer")

    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.OutcomeUnknown):
            charge(4900)
        for _ in range(2):
            with pytest.raises(twiceshy.ResultNotStorable, match="already ran"):
                charge(4900)
    (record,) = ledger.store.records("")
    assert record.state is State.SUCCEEDED
    assert runs == [4900]
