"""What the DynamoDB store promises beyond the contract, shown against a real DynamoDB-protocol
server (dynalite on 127.0.0.1:4567, ``.ci/servers/dynalite.sh``).

Every test works under a key prefix of its own in the shared test table, or in a table of its
own that it deletes afterwards. The region and the fake credentials are the tests' own
(``servers.DYNAMODB_OPTIONS``); nothing here reaches AWS. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import pytest

import servers
import twiceshy
from fake_clock import FakeClock
from twiceshy import Change, Effect, State
from twiceshy.errors import LedgerNotFound, StoreError, StoreUnavailable
from twiceshy.stores import open_store
from twiceshy.stores.dynamodb import (
    SCHEMA_VERSION,
    AsyncDynamoDBStore,
    DynamoDBStore,
    open_dynamodb,
    split_url,
)

pytestmark = pytest.mark.dynamodb

NS = "tenant"
CLAIMED = frozenset({State.CLAIMED})
FORK = (
    multiprocessing.get_context("fork")
    if "fork" in multiprocessing.get_all_start_methods()
    else None
)
SECRET = "s3cr3t-" + "k" * 24


@pytest.fixture
def endpoint() -> str:
    """The test server's endpoint (skips, or fails in CI, without a server)."""
    return servers.require("dynamodb")


@pytest.fixture
def prefix(endpoint: str) -> Iterator[str]:
    """A key prefix of this test's own in the shared table; its items are deleted afterwards."""
    name = f"twiceshy-test-{secrets.token_hex(6)}"
    yield name
    servers.delete_dynamodb_prefix(name)


@pytest.fixture
def table(endpoint: str) -> Iterator[str]:
    """The name of a table of this test's own (not made yet); deleted afterwards if made."""
    name = f"twiceshy_test_{secrets.token_hex(6)}"
    yield name
    client = servers.dynamodb_client()
    with contextlib.suppress(client.exceptions.ResourceNotFoundException):
        client.delete_table(TableName=name)


@pytest.fixture
def stores(endpoint: str, prefix: str) -> Iterator[Callable[..., DynamoDBStore]]:
    """Make stores of the shared table under the test's prefix; all closed afterwards."""
    made: list[DynamoDBStore] = []

    def make(**options: Any) -> DynamoDBStore:
        settings: dict[str, Any] = {**servers.DYNAMODB_OPTIONS, "prefix": prefix, **options}
        store = DynamoDBStore(servers.DYNAMODB_TABLE, endpoint_url=endpoint, **settings)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def tables() -> set[str]:
    """The tables the server holds."""
    return set(servers.dynamodb_client().list_tables()["TableNames"])


def raw_item(pk: str, table: str = servers.DYNAMODB_TABLE) -> dict[str, Any] | None:
    """An item as DynamoDB holds it, read behind the store's back."""
    found: dict[str, Any] | None = (
        servers.dynamodb_client()
        .get_item(TableName=table, Key={"pk": {"S": pk}}, ConsistentRead=True)
        .get("Item")
    )
    return found


def claim(store: Any, key: str = "k", owner: str = "alice", lease: float = 30) -> Any:
    """Claim a key with fixed test values (blocking store)."""
    return store.claim(
        NS, key, fingerprint="fp", tool="charge", effect=Effect.UNSAFE, owner=owner, lease=lease
    )


def error_text(exc: BaseException) -> str:
    """str() and repr() of an exception and of every exception it was raised from or during."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None:
        parts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


# -- URLs and settings --------------------------------------------------------------------------


def test_url_options_become_the_stores_settings() -> None:
    """The table is the URL's host; every option is read by its type."""
    options = split_url(
        "dynamodb://my-ledger.v1?region=eu-west-1&endpoint_url=http%3A%2F%2F127.0.0.1%3A4567"
        "&prefix=shop&profile=ops&connect_timeout=2.5&read_timeout=7&max_attempts=5"
        "&poll_interval=0.5&create_timeout=30"
    )
    assert options == {
        "table": "my-ledger.v1",
        "region": "eu-west-1",
        "endpoint_url": "http://127.0.0.1:4567",
        "prefix": "shop",
        "profile": "ops",
        "connect_timeout": 2.5,
        "read_timeout": 7.0,
        "max_attempts": 5,
        "poll_interval": 0.5,
        "create_timeout": 30.0,
    }


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("dynamodb://?region=us-east-1", "expected dynamodb://TABLE"),
        ("dynamodb://t?region=us-east-1", "3 to 255"),
        ("dynamodb://ledger?regoin=us-east-1", "unknown option 'regoin'"),
        ("dynamodb://ledger?region=a&region=b", "repeats 'region'"),
        ("dynamodb://ledger?region=a&read_timeout=soon", "read_timeout= must be a number"),
        ("dynamodb://ledger?region=a&read_timeout=0", "read_timeout= must be a positive"),
        ("dynamodb://ledger?region=a&max_attempts=0", "max_attempts= must be at least 1"),
        ("dynamodb://ledger?region=a&prefix=a%23b", "must not contain '#'"),
        ("dynamodb://ledger?region=a&endpoint_url=127.0.0.1:4567", "http:// or https://"),
        ("dynamodb://ledger?region=a&aws_access_key_id=x", "go together"),
    ],
)
def test_bad_urls_are_refused_before_anything_is_sent(url: str, says: str, table: str) -> None:
    """A malformed URL raises ValueError naming what is wrong; no table is made."""
    pointed = url.replace("dynamodb://ledger", f"dynamodb://{table}") + (
        f"&endpoint_url={quote(servers.DYNAMODB_URL, safe='')}" if "endpoint_url" not in url else ""
    )
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        open_store(pointed)
    assert table not in tables()


def test_no_region_is_refused_naming_the_option(
    endpoint: str, table: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """With no region anywhere, both stores raise ValueError saying to add region=."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    credentials = {k: v for k, v in servers.DYNAMODB_OPTIONS.items() if k != "region"}
    for make in (DynamoDBStore, AsyncDynamoDBStore):
        with pytest.raises(ValueError, match="region="):
            make(table, endpoint_url=endpoint, **credentials)
    assert table not in tables()


# -- the table -------------------------------------------------------------------------------


def test_the_table_is_made_on_first_use_on_demand_with_a_schema_version(table: str) -> None:
    """open_store makes the table (key pk, on-demand) and its schema item; the pair it opens."""
    store, twin = open_store(servers.dynamodb_url(table))
    try:
        assert type(store) is DynamoDBStore
        assert type(twin) is AsyncDynamoDBStore
        described = servers.dynamodb_client().describe_table(TableName=table)["Table"]
        assert described["TableStatus"] == "ACTIVE"
        assert described["KeySchema"] == [{"AttributeName": "pk", "KeyType": "HASH"}]
        assert described["AttributeDefinitions"] == [{"AttributeName": "pk", "AttributeType": "S"}]
        assert described["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
        schema = raw_item("#schema", table)
        assert schema is not None
        assert schema["version"] == {"N": "1"} == {"N": str(SCHEMA_VERSION)}
        assert claim(store).won
        assert asyncio.run(twin.get(NS, "k")).record is not None
    finally:
        asyncio.run(twin.close())
        store.close()


def test_stores_opened_together_on_a_new_table_make_it_once(table: str) -> None:
    """Four threads opening a table that is not there all open one ledger, and share records."""
    opened: list[DynamoDBStore] = []
    failures: list[BaseException] = []
    barrier = threading.Barrier(4)

    def open_one() -> None:
        try:
            barrier.wait(10)
            opened.append(DynamoDBStore.from_url(servers.dynamodb_url(table)))
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert failures == []
        assert len(opened) == 4
        assert claim(opened[0]).won
        assert not claim(opened[3], owner="bob").won
    finally:
        for store in opened:
            store.close()


def test_another_schema_version_is_refused(table: str) -> None:
    """A table whose schema item names another version is refused with StoreError."""
    DynamoDBStore.from_url(servers.dynamodb_url(table)).close()
    servers.dynamodb_client().put_item(
        TableName=table, Item={"pk": {"S": "#schema"}, "version": {"N": "99"}}
    )
    with pytest.raises(StoreError, match="schema version '99'; this twiceshy reads version 1"):
        DynamoDBStore.from_url(servers.dynamodb_url(table))


def test_a_table_of_another_shape_is_refused(table: str) -> None:
    """A table whose key is not the String pk is no ledger: StoreError, nothing written."""
    client = servers.dynamodb_client()
    client.create_table(
        TableName=table,
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "N"}],
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    client.get_waiter("table_exists").wait(
        TableName=table, WaiterConfig={"Delay": 1, "MaxAttempts": 30}
    )
    with pytest.raises(StoreError, match="the table's key is not the String 'pk'"):
        DynamoDBStore.from_url(servers.dynamodb_url(table))
    assert client.scan(TableName=table)["Items"] == []


def test_create_false_refuses_a_missing_table_and_makes_none(table: str) -> None:
    """create=False on a table that is not there raises LedgerNotFound; no table is made."""
    with pytest.raises(LedgerNotFound, match=rf"no twiceshy ledger at .*{table}.*no such table"):
        open_store(servers.dynamodb_url(table), create=False)
    assert table not in tables()

    async def first_call() -> None:
        store = AsyncDynamoDBStore.from_url(servers.dynamodb_url(table), create=False)
        try:
            await store.get(NS, "k")
        finally:
            await store.close()

    with pytest.raises(LedgerNotFound):
        asyncio.run(first_call())
    assert table not in tables()


def test_create_false_refuses_a_table_that_holds_no_ledger(table: str) -> None:
    """A table of the right shape without the schema item is no ledger: nothing is written."""
    client = servers.dynamodb_client()
    client.create_table(
        TableName=table,
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    client.get_waiter("table_exists").wait(
        TableName=table, WaiterConfig={"Delay": 1, "MaxAttempts": 30}
    )
    with pytest.raises(LedgerNotFound, match="holds no '#schema' item"):
        open_store(servers.dynamodb_url(table), create=False)
    assert client.scan(TableName=table)["Items"] == []
    DynamoDBStore.from_url(servers.dynamodb_url(table)).close()  # create=True adopts it
    assert raw_item("#schema", table) is not None
    open_dynamodb(servers.dynamodb_url(table), create=False)[0].close()


# -- items, clock and retention ------------------------------------------------------------------


def test_a_record_is_one_item_under_the_prefix(stores: Callable[..., DynamoDBStore]) -> None:
    """pk is prefix#r#namespace#key, percent-encoded; fields are attributes, None is absent."""
    store = stores()
    snap = store.claim(
        "a#b/ü", "k#1", fingerprint="fp", tool="t", effect=Effect.KEYED, owner="o", lease=30
    )
    assert snap.won
    pk = f"{store.prefix}#r#a%23b%2F%C3%BC#k%231"
    item = raw_item(pk)
    assert item is not None
    assert item["ns"] == {"S": "a#b/ü"}
    assert item["key"] == {"S": "k#1"}
    assert (item["state"], item["fence"], item["attempts"]) == (
        {"S": "claimed"},
        {"N": "1"},
        {"N": "1"},
    )
    for absent in ("result", "error", "reason", "expires_at", "ttl"):
        assert absent not in item
    assert store.get("a#b/ü", "k#1").record == snap.record


def test_leases_and_times_are_on_the_callers_clock(stores: Callable[..., DynamoDBStore]) -> None:
    """Without clock=, times are this machine's wall clock (DynamoDB offers none)."""
    store = stores()
    before = time.time()
    snap = claim(store, lease=12.5)
    after = time.time()
    assert snap.record is not None
    assert before <= snap.record.created_at <= after
    assert before + 12.5 <= (snap.record.lease_deadline or 0) <= after + 12.5


def test_expiry_is_checked_on_read_and_ttl_is_only_housekeeping(
    stores: Callable[..., DynamoDBStore],
) -> None:
    """Past expires_at the record is gone for every call though the item stays; ttl is set an
    hour later, and never on CLAIMED or UNKNOWN records."""
    clock = FakeClock()
    store = stores(clock=clock)
    claimed = claim(store)
    pk = f"{store.prefix}#r#{NS}#k"
    done = store.write(NS, "k", Change(1, CLAIMED, State.SUCCEEDED, owner="alice", ttl=10))
    assert done.won
    item = raw_item(pk)
    assert item is not None
    assert float(item["expires_at"]["N"]) == clock.now + 10
    assert item["ttl"] == {"N": str(math.ceil(clock.now + 10) + 3600)}
    clock.advance(10)
    assert store.get(NS, "k").record is None
    assert raw_item(pk) is not None  # dynalite, like DynamoDB before its TTL pass, still has it
    again = claim(store, owner="bob")
    assert again.won
    assert again.record is not None
    assert (again.record.fence, again.record.owner) == (2, "bob")
    assert "ttl" not in (raw_item(pk) or {})
    unknown = store.write(NS, "k", Change(2, CLAIMED, State.UNKNOWN, owner="bob", ttl=5))
    assert unknown.won
    assert "ttl" not in (raw_item(pk) or {})
    assert "expires_at" not in (raw_item(pk) or {})
    assert claimed.record is not None


def test_purge_deletes_the_expired_items(stores: Callable[..., DynamoDBStore]) -> None:
    """purge_expired deletes expired outcomes' items, and no other."""
    clock = FakeClock()
    store = stores(clock=clock)
    for key in ("gone", "kept"):
        claim(store, key)
    store.write(NS, "gone", Change(1, CLAIMED, State.SUCCEEDED, owner="alice", ttl=1))
    store.write(NS, "kept", Change(1, CLAIMED, State.SUCCEEDED, owner="alice", ttl=100))
    clock.advance(2)
    assert store.purge_expired(NS) == 1
    assert raw_item(f"{store.prefix}#r#{NS}#gone") is None
    assert raw_item(f"{store.prefix}#r#{NS}#kept") is not None


DAYS = 3 * 86_400.0
UNKNOWN = frozenset({State.UNKNOWN})


def test_an_expiry_written_on_a_clock_behind_counts_from_the_records_own_time(
    stores: Callable[..., DynamoDBStore],
) -> None:
    """An expiry (and ttl) written days behind counts from the record's own time; guards hold."""
    clock = FakeClock()
    right = stores(clock=clock)
    behind = stores(clock=clock.shifted(-DAYS))
    claim(right)
    clock.advance(10)
    marked = right.write(NS, "k", Change(1, CLAIMED, State.UNKNOWN, owner="alice"))
    assert marked.won
    stale = behind.write(NS, "k", Change(2, UNKNOWN, State.SUCCEEDED, result="1", ttl=60))
    assert not stale.won
    assert stale.record == marked.record
    done = behind.write(NS, "k", Change(1, UNKNOWN, State.SUCCEEDED, result="1", ttl=60))
    assert done.won
    assert done.record is not None
    assert done.record.expires_at == clock.now + 60
    assert done.record.updated_at == clock.now - DAYS  # the writer's own time, as it was
    item = raw_item(f"{right.prefix}#r#{NS}#k")
    assert item is not None
    assert item["ttl"] == {"N": str(math.ceil(clock.now + 60) + 3600)}
    clock.advance(59)
    assert right.get(NS, "k").record == done.record
    clock.advance(1)
    assert right.get(NS, "k").record is None  # past its ttl: the retention still ends


def test_a_record_written_ahead_of_the_reader_never_expires_for_it(
    stores: Callable[..., DynamoDBStore], caplog: pytest.LogCaptureFixture
) -> None:
    """A record written ahead of the reader, its expiry before that, is live until the clock
    passes its times: read, never claimed over nor purged, listed; the skew logged."""
    clock = FakeClock()
    store = stores(clock=clock)
    claim(store)
    store.write(NS, "k", Change(1, CLAIMED, State.SUCCEEDED, owner="alice", ttl=60))
    servers.dynamodb_client().update_item(
        TableName=servers.DYNAMODB_TABLE,
        Key={"pk": {"S": f"{store.prefix}#r#{NS}#k"}},
        UpdateExpression="SET created_at = :ahead, expires_at = :past",
        ExpressionAttributeValues={
            ":ahead": {"N": repr(clock.now + DAYS)},
            ":past": {"N": repr(clock.now - 1)},
        },
    )
    with caplog.at_level(logging.WARNING, logger="twiceshy"):
        found = store.get(NS, "k").record
    assert found is not None
    assert found.state is State.SUCCEEDED
    assert f"written {DAYS:.1f} s ahead of this process's clock" in caplog.text
    assert not claim(store, owner="bob").won
    assert store.purge_expired(NS) == 0
    assert store.expired(NS) == []
    assert store.records(NS) == [found]
    clock.advance(DAYS + 2)
    assert store.get(NS, "k").record is None
    assert store.purge_expired(NS) == 1


def test_text_that_is_not_utf8_raises_store_error(stores: Callable[..., DynamoDBStore]) -> None:
    """A lone surrogate cannot be stored: StoreError from UnicodeEncodeError, record unchanged."""
    store = stores()
    record = claim(store).record
    change = Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result='"\ud800"')
    with pytest.raises(StoreError, match="not UTF-8") as caught:
        store.write(NS, "k", change)
    assert isinstance(caught.value.__cause__, UnicodeEncodeError)
    assert store.get(NS, "k").record == record
    with pytest.raises(StoreError):
        store.get("lone \ud800 surrogate", "k")


def test_a_result_too_large_for_an_item_names_the_bound(
    stores: Callable[..., DynamoDBStore],
) -> None:
    """An outcome beyond DynamoDB's 400 KB item raises StoreError naming max_result_bytes."""
    store = stores()
    record = claim(store).record
    change = Change(1, CLAIMED, State.SUCCEEDED, owner="alice", result='"' + "x" * 420_000 + '"')
    with pytest.raises(StoreError, match="max_result_bytes"):
        store.write(NS, "k", change)
    assert store.get(NS, "k").record == record


def test_a_count_flush_sent_twice_is_added_once(stores: Callable[..., DynamoDBStore]) -> None:
    """The same flush (one id) sent again, as after a lost answer, adds nothing."""
    store = stores()
    params = store._core.layout.add_counts(NS, {("charge", "executed"): 2}, "flush-1")
    client = servers.dynamodb_client()
    client.update_item(**params)
    with pytest.raises(client.exceptions.ConditionalCheckFailedException):
        client.update_item(**params)
    store.add_counts(NS, {("charge", "executed"): 1})
    assert store.counts(NS) == {("charge", "executed"): 3}


def test_an_async_keyed_tool_replays_across_event_loops(endpoint: str, prefix: str) -> None:
    """An async KEYED tool through Ledger(dynamodb://...) runs once and replays, each call on
    an event loop of its own (each loop's client closed with it)."""
    ledger = twiceshy.Ledger(servers.dynamodb_url(prefix=prefix), counts_interval=None)
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.KEYED)
    async def send_mail(to: str, idempotency_key: str | None = None) -> dict[str, str]:
        assert idempotency_key is not None
        runs.append(idempotency_key)
        await asyncio.sleep(0.01)
        return {"id": f"m_{len(runs)}", "to": to}

    twin = ledger.async_store
    assert isinstance(twin, AsyncDynamoDBStore)
    clients: list[Any] = []

    async def call() -> dict[str, str]:
        with twiceshy.run("async-run"):
            answer = await send_mail("a@example.com")
        clients.append(twin._clients[asyncio.get_running_loop()].client)
        return answer

    try:
        first = asyncio.run(call())
        assert asyncio.run(call()) == first == {"id": "m_1", "to": "a@example.com"}
        assert runs == [twiceshy.idempotency_key("async-run", "send_mail", {"to": "a@example.com"})]
        assert len(clients) == 2
        assert clients[0] is not clients[1]
        # Each loop's client (its aiohttp sessions) was closed when its loop shut down.
        assert [c._endpoint.http_session._sessions for c in clients] == [None, None]
    finally:
        ledger.close()


def _forked_claim(store: DynamoDBStore, out: Any) -> None:
    snap = claim(store, "from-child", owner="child")
    out.put((snap.won, store._pid == os.getpid()))
    store.close()


@pytest.mark.skipif(FORK is None, reason="needs the fork start method")
def test_a_forked_child_uses_a_client_of_its_own(stores: Callable[..., DynamoDBStore]) -> None:
    """A store used in a forked child makes its own client there and leaves the parent's be."""
    assert FORK is not None
    store = stores()
    assert claim(store).won  # the parent's client holds a connection now
    out = FORK.Queue()
    child = FORK.Process(target=_forked_claim, args=(store, out))
    child.start()
    try:
        assert out.get(timeout=30) == (True, True)
    finally:
        child.join(30)
    assert child.exitcode == 0
    found = store.get(NS, "from-child").record
    assert found is not None
    assert found.owner == "child"
    assert claim(store, "after").won  # the parent's client still works after the child closed


# -- errors: the server down, credentials, secrets ---------------------------------------------


def test_an_unreachable_endpoint_fails_fast_naming_what_to_check(table: str) -> None:
    """Nothing listening: StoreUnavailable within seconds, naming endpoint_url= and region=;
    the async store's first call alike."""
    url = servers.dynamodb_url(table).replace(
        quote(servers.DYNAMODB_URL, safe=""), quote("http://127.0.0.1:1", safe="")
    )
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="endpoint_url= and region=") as caught:
        DynamoDBStore.from_url(url + "&max_attempts=2&connect_timeout=1")
    assert time.monotonic() - started < 10
    assert "127.0.0.1:1" in str(caught.value)

    async def first_call() -> None:
        store = AsyncDynamoDBStore.from_url(url + "&max_attempts=2&connect_timeout=1")
        try:
            await store.get(NS, "k")
        finally:
            await store.close()

    with pytest.raises(StoreUnavailable, match="endpoint_url="):
        asyncio.run(first_call())


def test_missing_credentials_are_named(
    endpoint: str, table: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """No credentials anywhere: StoreError saying where credentials come from; nothing made."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata service
    with pytest.raises(StoreError, match="AWS_ACCESS_KEY_ID") as caught:
        DynamoDBStore(table, endpoint_url=endpoint, region="us-east-1")
    assert not isinstance(caught.value, StoreUnavailable)
    assert table not in tables()


def test_reprs_and_errors_never_show_a_secret(endpoint: str, prefix: str, table: str) -> None:
    """repr() shows the settings without credentials; no error shows the secret key, the
    session token or an endpoint's password."""
    url = servers.dynamodb_url(
        prefix=prefix, aws_secret_access_key=SECRET, aws_session_token=SECRET + "-token"
    )
    store, twin = open_dynamodb(url)
    try:
        assert repr(store) == (
            f"DynamoDBStore('{servers.DYNAMODB_TABLE}', region='us-east-1', "
            f"endpoint_url='{endpoint}', prefix='{prefix}')"
        )
        assert repr(twin) == repr(store).replace("DynamoDBStore", "AsyncDynamoDBStore", 1)
    finally:
        store.close()
    failures: list[BaseException] = []
    with pytest.raises(StoreError) as closed:
        store.get(NS, "k")
    failures.append(closed.value)
    down = quote("http://127.0.0.1:1", safe="")
    with_password = quote(f"http://user:{SECRET}@127.0.0.1:1", safe="")
    for attempt in (
        lambda: open_store(url.replace(quote(endpoint, safe=""), down) + "&max_attempts=1"),
        lambda: open_store(url.replace(quote(endpoint, safe=""), with_password)),
        lambda: open_store(url + "&bogus=1"),
        lambda: open_store(url + "&read_timeout=soon"),
        lambda: open_store(url + "&aws_secret_access_key=again"),
    ):
        with pytest.raises((StoreError, ValueError)) as failed:
            attempt()
        failures.append(failed.value)
    assert isinstance(failures[1], StoreUnavailable)
    assert "must not carry a user or password: 'http://user:***@127.0.0.1:1'" in str(failures[2])
    assert "aws_secret_access_key=***" in str(failures[3])
    for failure in failures:
        assert SECRET not in error_text(failure)
