"""Records per second (a claim and its outcome) on the ledgers past one machine, for the capacity
plan: a Redis Cluster, and PostgreSQL through PgBouncer — beside one Redis server and PostgreSQL
reached directly, measured the same way.

Each of ``--processes`` processes opens the ledger's store, and once all are ready they write
records for ``--seconds``: a claim of a new key, then its outcome (SUCCEEDED with a 24 h
retention), as a first call of a tool does. The figures are records a second summed over the
processes, with the median and 99th percentile of one claim + write. After the run the script
reads what a record costs where it is kept (Redis ``MEMORY USAGE`` of a sample of records;
the PostgreSQL table's size over its rows) and removes what it wrote.

Run from the repository root, with the servers of ``.ci/servers/`` started::

    .ci/servers/redis-cluster.sh start && .ci/servers/pgbouncer.sh start
    .venv/bin/python benchmarks/cluster_capacity.py --seconds 10 --processes 4

The machine the figures come from has 2 vCPUs shared with other sessions, and clients and
servers share them: the figures are a floor for what one client machine gets, not what the
servers can take.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import statistics
import time
from typing import Any

CTX = mp.get_context("spawn")

TARGETS = {
    "redis-cluster": "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103/?prefix={where}",
    # The cluster without its default wait for a replica: what wait_replicas=1 costs.
    "redis-cluster-wait0": (
        "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103/"
        "?prefix={where}&wait_replicas=0"
    ),
    "pgbouncer": "postgresql://postgres@127.0.0.1:6432/test?schema={where}&wakeups=poll",
    "redis": "redis://127.0.0.1:6379/0?prefix={where}",
    "postgres": "postgresql://postgres@127.0.0.1:5432/test?schema={where}",
}


def _writer(url: str, seconds: float, ready: Any, go: Any, out: Any) -> None:
    from twiceshy import Change, Effect, State
    from twiceshy.stores import open_store

    store, _ = open_store(url)
    claimed = frozenset({State.CLAIMED})
    tag = secrets.token_hex(4)
    latencies: list[float] = []
    try:
        ready.put(True)
        go.wait(120)
        deadline = time.monotonic() + seconds
        n = 0
        while (started := time.monotonic()) < deadline:
            key = f"{tag}-{n}"
            snap = store.claim(
                "bench", key, fingerprint="f", tool="t", effect=Effect.UNSAFE, owner=tag, lease=30
            )
            assert snap.won
            change = Change(1, claimed, State.SUCCEEDED, owner=tag, result='"ok"', ttl=86400.0)
            assert store.write("bench", key, change).won
            latencies.append(time.monotonic() - started)
            n += 1
        out.put((n, latencies))
    finally:
        store.close()


def measure(name: str, processes: int, seconds: float) -> dict[str, Any]:
    """Run the writers against one target; answer its figures."""
    where = f"bench_{secrets.token_hex(4)}"
    url = TARGETS[name].format(where=where)
    from twiceshy.stores import open_store

    open_store(url)[0].close()  # the table exists (PostgreSQL) before the clock starts
    ready, out, go = CTX.Queue(), CTX.Queue(), CTX.Event()
    procs = [
        CTX.Process(target=_writer, args=(url, seconds, ready, go, out)) for _ in range(processes)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    go.set()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    records = sum(n for n, _ in results)
    latencies = sorted(x for _, lat in results for x in lat)
    figures = {
        "records_per_second": records / seconds,
        "median_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
        "records": records,
    }
    figures["bytes_per_record"] = _footprint(name, where, records)
    _clean(name, where)
    return figures


def _footprint(name: str, where: str, records: int) -> float:
    """What one record costs where it is kept (sampled for Redis)."""
    if name.startswith("redis"):
        import redis
        from redis.cluster import RedisCluster

        client: Any = (
            RedisCluster(host="127.0.0.1", port=7101)
            if name.startswith("redis-cluster")
            else redis.Redis(host="127.0.0.1", port=6379)
        )
        try:
            sizes = []
            for key in client.scan_iter(match=f"{where}:*:rec", count=1000):
                sizes.append(client.memory_usage(key))
                if len(sizes) >= 200:
                    break
            return statistics.mean(sizes)
        finally:
            client.close()
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_total_relation_size(%s)", (f'"{where}"."records"',)
        ).fetchone()
    assert row is not None
    return float(row[0]) / records


def _clean(name: str, where: str) -> None:
    if name.startswith("redis"):
        import redis
        from redis.cluster import RedisCluster

        client: Any = (
            RedisCluster(host="127.0.0.1", port=7101)
            if name.startswith("redis-cluster")
            else redis.Redis(host="127.0.0.1", port=6379)
        )
        try:
            for key in list(client.scan_iter(match=f"{where}:*", count=1000)):
                client.delete(key)
        finally:
            client.close()
        return
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{where}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--targets", default=",".join(TARGETS))
    args = parser.parse_args()
    print(f"{args.processes} processes, {args.seconds:g} s each, claim + outcome per record")
    print(f"{'ledger':<21}{'records/s':>12}{'median ms':>12}{'p99 ms':>10}{'bytes/record':>14}")
    for name in args.targets.split(","):
        f = measure(name, args.processes, args.seconds)
        print(
            f"{name:<21}{f['records_per_second']:>12,.0f}{f['median_ms']:>12.2f}"
            f"{f['p99_ms']:>10.2f}{f['bytes_per_record']:>14,.0f}"
        )


if __name__ == "__main__":
    main()
