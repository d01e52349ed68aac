"""Records per second on a DynamoDB ledger, for the capacity plan (docs/stores/dynamodb.md).

    python benchmarks/dynamodb_capacity.py [--endpoint http://127.0.0.1:4567] [--seconds 5]

A *record* is one intent's claim and its outcome: the store's ``claim`` and the ``write`` that
records SUCCEEDED, two conditional ``UpdateItem`` requests. Measured for one blocking thread,
for several threads sharing one store, for async tasks sharing one event loop, and through a
``Ledger`` (a KEYED tool's first call: the whole protocol). Also: what one record's item
weighs (DynamoDB's item size, which sets the capacity units each request consumes) and the
requests a replay costs.

Only the endpoint given is used (by default dynalite on 127.0.0.1, started by
``.ci/servers/dynalite.sh start``), with fake credentials; everything the run writes is under a
prefix of its own and deleted at the end. Every case runs for ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import threading
import time
from typing import Any
from urllib.parse import urlencode

import twiceshy
from twiceshy import Change, Effect, State
from twiceshy.stores.dynamodb import AsyncDynamoDBStore, DynamoDBStore

TABLE = "twiceshy_bench"
CREDENTIALS = {
    "region": "us-east-1",
    "aws_access_key_id": "twiceshy-bench",
    "aws_secret_access_key": "twiceshy-bench-secret",
}
CLAIMED = frozenset({State.CLAIMED})
RESULT = '{"id":"ch_3PqB1x2eZvKYlo2C0a1b2c3d","amount":4900,"currency":"eur","status":"ok"}'


def one_record(store: DynamoDBStore, n: int, owner: str) -> None:
    """Claim a fresh key and record its outcome."""
    key = f"{owner}-{n:09d}"
    snap = store.claim(
        "bench", key, fingerprint="f" * 64, tool="charge", effect=Effect.KEYED, owner=owner,
        lease=30,
    )  # fmt: skip
    assert snap.won
    done = store.write(
        "bench", key, Change(1, CLAIMED, State.SUCCEEDED, owner=owner, result=RESULT, ttl=86400)
    )
    assert done.won


def threads(store: DynamoDBStore, count: int, seconds: float) -> tuple[float, float]:
    """Records per second of ``count`` threads sharing ``store``, and this process's CPU time
    per record (ms): what one client core can drive where the server is not the limit."""
    done = [0] * count
    stop = time.monotonic() + seconds

    def work(i: int) -> None:
        owner = f"t{i}-{secrets.token_hex(4)}"
        while time.monotonic() < stop:
            one_record(store, done[i], owner)
            done[i] += 1

    started, cpu = time.monotonic(), time.process_time()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(seconds + 60)
    records = sum(done)
    return records / (time.monotonic() - started), (time.process_time() - cpu) * 1000 / records


def tasks(store: AsyncDynamoDBStore, count: int, seconds: float) -> float:
    """Records per second of ``count`` tasks sharing ``store`` on one event loop."""

    async def work(owner: str, stop: float) -> int:
        n = 0
        while time.monotonic() < stop:
            key = f"{owner}-{n:09d}"
            snap = await store.claim(
                "bench", key, fingerprint="f" * 64, tool="charge", effect=Effect.KEYED,
                owner=owner, lease=30,
            )  # fmt: skip
            assert snap.won
            change = Change(1, CLAIMED, State.SUCCEEDED, owner=owner, result=RESULT, ttl=86400)
            assert (await store.write("bench", key, change)).won
            n += 1
        return n

    async def main() -> float:
        started = time.monotonic()
        stop = started + seconds
        owners = [f"a{i}-{secrets.token_hex(4)}" for i in range(count)]
        counts = await asyncio.gather(*(work(owner, stop) for owner in owners))
        await store.close()
        return sum(counts) / (time.monotonic() - started)

    return asyncio.run(main())


def ledger_calls(url: str, seconds: float) -> float:
    """First calls per second of a KEYED tool through a Ledger, one thread."""
    ledger = twiceshy.Ledger(url, counts_interval=None)

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(n: int) -> dict[str, Any]:
        return {"id": f"ch_{n}", "amount": 4900}

    n = 0
    scope = secrets.token_hex(4)
    started = time.monotonic()
    with twiceshy.run(scope):
        while time.monotonic() - started < seconds:
            charge(n)
            n += 1
    elapsed = time.monotonic() - started
    ledger.close()
    return n / elapsed


def item_size(item: dict[str, Any]) -> int:
    """An item's size as DynamoDB counts it: names and values in bytes (a Number is about one
    byte per two significant digits, plus one)."""
    size = 0
    for name, value in item.items():
        size += len(name.encode())
        if "S" in value:
            size += len(value["S"].encode())
        else:
            digits = value["N"].lstrip("-").replace(".", "").strip("0") or "0"
            size += math.ceil(len(digits) / 2) + 1
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", default="http://127.0.0.1:4567")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    prefix = f"bench-{secrets.token_hex(4)}"
    options = {"endpoint_url": args.endpoint, **CREDENTIALS, "prefix": prefix}
    store = DynamoDBStore(TABLE, **options)
    client = store._live_client()
    try:
        one_record(store, 0, "size")
        pk = store._core.layout.record_pk("bench", "size-000000000")
        item = client.get_item(TableName=TABLE, Key={"pk": {"S": pk}}, ConsistentRead=True)
        size = item_size(item["Item"])
        units = math.ceil(size / 1024)
        load = ", ".join(f"{n:.1f}" for n in os.getloadavg())
        print(f"endpoint {args.endpoint}, {args.seconds:g} s a case, load average {load}")
        print(f"one record's item: {size} bytes ({len(RESULT)}-byte result, 64-hex key)")
        print(f"  claim and outcome: 1 UpdateItem each, {units} WCU each")
        print(f"  replay: 1 UpdateItem that fails its condition ({units} WCU: charged all the")
        print("  same), and one GetItem (1 RCU) where the server does not answer the item")
        single, cpu = threads(store, 1, args.seconds)
        print(f"records/s, 1 thread:            {single:8.0f} (client CPU {cpu:.2f} ms a record)")
        many, cpu = threads(store, args.threads, args.seconds)
        print(
            f"records/s, {args.threads} threads, one store: {many:8.0f} (client CPU {cpu:.2f} ms)"
        )
        twin = AsyncDynamoDBStore.twin(store)
        concurrent = tasks(twin, args.threads, args.seconds)
        print(f"records/s, {args.threads} async tasks:       {concurrent:8.0f}")
        url = f"dynamodb://{TABLE}?" + urlencode(options)
        through = ledger_calls(url, args.seconds)
        print(f"first calls/s through a Ledger: {through:8.0f} (1 thread, KEYED)")
    finally:
        begins = f"{prefix}#"
        for page in client.get_paginator("scan").paginate(
            TableName=TABLE,
            FilterExpression="begins_with(pk, :p)",
            ExpressionAttributeValues={":p": {"S": begins}},
            ProjectionExpression="pk",
        ):
            for found in page["Items"]:
                client.delete_item(TableName=TABLE, Key={"pk": found["pk"]})
        store.close()


if __name__ == "__main__":
    main()
