"""Per-call cost on the PostgreSQL and Redis ledgers, beside the floor and a peer, in one run.

    python benchmarks/servers.py [--quick] [--records N] [--pin]

For each server store:

- *first call*: a KEYED tool's new intent (claim, run, record); *replay*: a retry of a recorded
  intent. The tool does nothing, so what is measured is twiceshy's own cost.
- *floor*: the same client doing the same number of raw round trips with the same rows: for
  PostgreSQL an INSERT of the claim and an UPDATE to the outcome, each its own committed
  transaction, in a table of the ledger's own shape (columns, key, indexes), with SHA-256 keys
  like the ledger's, and one primary-key SELECT of a whole record for a replay; for Redis an
  HSET of the claim's fields and an HSET of the outcome's, and one HGETALL of a whole record.
- *trivial*: the same number of round trips on a two-column table or a two-field hash.
- *CPU*: the first call, the replay and their floors again, each case's CPU per call on the
  client (this process) and on the server (PostgreSQL's processes, read from ``/proc``; Redis's
  own ``INFO cpu``): what the statements and scripts cost the server beside the floor's. Any
  other client of the same server in the meantime counts too: run it on a quiet machine.
- *peer*: Powertools for AWS Lambda's idempotency utility with its Redis persistence layer on the
  same Redis (outside Lambda: ``ssl=False``; it needs boto3 importable).
- *wake-up*: a waiter blocked on a running call, woken by the owner recording its outcome:
  the time from the owner's write returning to the waiter returning.
- *flat*: first call and replay again after the store holds ``--records`` other records.
- *remembered*: the replay on a ledger made with ``remember=``, which answers a process's
  retries of settled outcomes without a round trip; beside Powertools with its own local cache
  (``use_local_cache=True``), the like-for-like peer.
- *no store*: the same first call and replay on a ``memory://`` ledger, taking turns with the
  rest: twiceshy's own work with no I/O at all, set beside what a target of 1.1x the floor
  leaves for it (a tenth of the floor); and again with each call after 0.2 ms of sleep, as a
  call's own work follows a round trip's wait (on this kind of machine the same work then takes
  two to three times as long: caches and the CPU are cold again).

Medians of per-call times; the machine is shared, so compare ratios within one run. Only
127.0.0.1 is used; everything the run creates (a schema, a key prefix) is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import psycopg
import redis

import twiceshy
from twiceshy import Change, Effect, State

POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
REMEMBER = 256  # settled outcomes kept per process, for the remembered replay (as Powertools')


def timed(fn: Callable[[int], object], calls: int) -> list[int]:
    """Nanoseconds of ``calls`` calls of ``fn``, one by one."""
    out = []
    for i in range(calls):
        start = time.perf_counter_ns()
        fn(i)
        out.append(time.perf_counter_ns() - start)
    return out


def after_idle(fn: Callable[[int], object], calls: int, idle: float = 0.0002) -> float:
    """Median microseconds of ``fn`` when each call follows ``idle`` seconds of sleep, as a
    call's own work follows a round trip's wait (caches and the CPU are cold again then)."""
    out = []
    for i in range(calls):
        time.sleep(idle)
        start = time.perf_counter_ns()
        fn(i)
        out.append(time.perf_counter_ns() - start)
    return median_us(out)


def median_us(times: list[int]) -> float:
    """The median, in microseconds."""
    return statistics.median(times) / 1000


def postgres_cpu() -> float:
    """Seconds of CPU the local PostgreSQL server's processes have used (their backends, WAL
    writer and the rest), from ``/proc``: the server is on this machine, reached on loopback."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if not comm.read().startswith("postgres"):
                    continue
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def redis_cpu(client: redis.Redis) -> Callable[[], float]:
    """Seconds of CPU the Redis server has used, as its ``INFO cpu`` reports them."""

    def used() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    return used


class Placement:
    """With ``--pin``: this process on the first CPU, the servers serving it on the others.

    A round trip on loopback costs about three times as much when the server's process runs on
    another CPU than the client's (a cross-CPU wake-up) as on the same one, and the scheduler
    decides that per connection: unpinned, a floor's connection and the ledger's pooled ones can
    land differently, and their ratio measures the placement. Pinned, every round trip crosses
    CPUs, as it crosses a network in production. The servers' affinity is restored at the end.
    """

    def __init__(self, enabled: bool) -> None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if enabled and len(cpus) < 2:
            raise SystemExit("--pin needs os.sched_setaffinity and two CPUs or more")
        self.enabled = enabled
        self.client, self.servers, self.all = {cpus[0]} if cpus else set(), set(cpus[1:]), cpus
        self.pinned: set[int] = set()

    def pin(self) -> None:
        """Pin this process, the PostgreSQL backends of the test database, and Redis."""
        if not self.enabled:
            return
        os.sched_setaffinity(0, self.client)
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchall()
        client = redis.Redis.from_url(REDIS)
        pids = [int(pid) for (pid,) in rows] + [int(client.info("server")["process_id"])]
        client.close()
        for pid in pids:
            try:
                os.sched_setaffinity(pid, self.servers)
                self.pinned.add(pid)
            except (ProcessLookupError, PermissionError):
                pass

    def restore(self) -> None:
        """Give every process pinned here all the CPUs again."""
        for pid in self.pinned:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(pid, self.all)
        if self.enabled:
            os.sched_setaffinity(0, self.all)


class Run:
    """One measurement's cases taking turns, round by round."""

    def __init__(self, rounds: int, calls: int, placement: Placement | None = None) -> None:
        self.rounds, self.calls = rounds, calls
        self.placement = placement or Placement(False)

    def interleave(self, cases: dict[str, Callable[[int], object]]) -> dict[str, float]:
        """Median per call of each case, the cases taking turns."""
        times: dict[str, list[int]] = {name: [] for name in cases}
        for fn in cases.values():
            timed(fn, 5)  # warm up: every pool has its connections now
        self.placement.pin()
        for _ in range(self.rounds):
            for name, fn in cases.items():
                times[name] += timed(fn, self.calls)
        return {name: median_us(t) for name, t in times.items()}

    def cpu(
        self, cases: dict[str, Callable[[int], object]], server: Callable[[], float]
    ) -> dict[str, float]:
        """Client and server CPU microseconds per call of each case, the cases taking turns:
        ``"<case> client cpu"`` (this process, ``time.process_time``) and ``"<case> server
        cpu"`` (``server()``, read before and after each case's calls)."""
        used = {name: [0.0, 0.0] for name in cases}
        calls = max(self.calls, 200)  # the server's clock ticks in hundredths of a second
        for _ in range(self.rounds):
            for name, fn in cases.items():
                client, on_server = time.process_time(), server()
                for i in range(calls):
                    fn(i)
                used[name][0] += time.process_time() - client
                used[name][1] += server() - on_server
        n = calls * self.rounds / 1e6
        out = {}
        for name, (client_s, server_s) in used.items():
            out[f"{name} client cpu"] = client_s / n
            out[f"{name} server cpu"] = server_s / n
        return out


def protected(ledger: twiceshy.Ledger) -> tuple[Callable[[int], object], Callable[[int], object]]:
    """(first call, replay) of a KEYED tool on ``ledger``."""

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int, customer: str) -> dict[str, object]:
        return {"id": "ch_1", "amount": amount, "customer": customer}

    return scoped_calls(twiceshy.run, charge)


def scoped_calls(
    scope: Callable[[str], contextlib.AbstractContextManager[object]],
    charge: Callable[[int, str], object],
) -> tuple[Callable[[int], object], Callable[[int], object]]:
    """(first call, replay) of ``charge(4900, "cus_1")`` inside ``scope(run)``: a new run for
    each first call, one run for every replay (called here once, so that it has its outcome)."""
    tag = f"bench-{secrets.token_hex(4)}"
    counter = iter(range(10**9))
    with scope(f"{tag}-replay"):
        charge(4900, "cus_1")

    def first(i: int) -> object:
        with scope(f"{tag}-{next(counter)}"):
            return charge(4900, "cus_1")

    def replay(i: int) -> object:
        with scope(f"{tag}-replay"):
            return charge(4900, "cus_1")

    return first, replay


RESULT_TEXT = '{"id":"ch_1","amount":4900,"customer":"cus_1"}'
"""The benchmarked tool's result as the ledger stores it."""


def same_row(prefix: str, n: int) -> tuple[Any, ...]:
    """A CLAIMED record as the ledger writes it: SHA-256 key and fingerprint, an owner token."""
    key = (
        "replayed" if prefix == "replayed" else hashlib.sha256(f"{prefix}:{n}".encode()).hexdigest()
    )
    fingerprint = hashlib.sha256(key.encode()).hexdigest()
    now = time.time()
    owner = f"{fingerprint[:16]}.{os.getpid()}.{n}"
    return (
        "",
        key,
        fingerprint,
        "charge",
        "keyed",
        "claimed",
        1,
        owner,
        now + 30,
        1,
        None,
        None,
        None,
        now,
        now,
        None,
        None,
    )


def same_fields(prefix: str, n: int) -> dict[str, Any]:
    """:func:`same_row` as the fields of a Redis hash (no field for a missing value)."""
    names = [field.name for field in dataclasses.fields(twiceshy.Record)]
    return {k: v for k, v in zip(names, same_row(prefix, n), strict=True) if v is not None}


def _waiter(store: Any, key: str, waiting: threading.Event, woke: list[int]) -> None:
    waiting.set()
    store.wait("", key, 1, 10.0)
    woke.append(time.perf_counter_ns())


def wake_up(ledger: twiceshy.Ledger, trials: int) -> float:
    """Median ms from an owner's recording write returning to a blocked waiter returning."""
    store, other = ledger.store, twiceshy.Ledger(ledger.url).store
    delays = []
    for i in range(trials):
        key = f"wake-{secrets.token_hex(6)}-{i}"
        snap = store.claim(
            "", key, fingerprint="f", tool="t", effect=Effect.KEYED, owner="owner", lease=30
        )
        assert snap.won
        woke: list[int] = []
        waiting = threading.Event()
        thread = threading.Thread(target=_waiter, args=(other, key, waiting, woke))
        thread.start()
        waiting.wait(5)
        time.sleep(0.02)  # let the waiter block
        store.write(
            "", key, Change(1, frozenset({State.CLAIMED}), State.SUCCEEDED, owner="owner", ttl=60)
        )
        written = time.perf_counter_ns()
        thread.join(10)
        delays.append(woke[0] - written)
    other.close()
    return statistics.median(delays) / 1e6


def core_cases(
    first: Callable[[int], object],
    replay: Callable[[int], object],
    floor_first: Callable[[int], object],
    floor_read: Callable[[int], object],
) -> dict[str, Callable[[int], object]]:
    """The four cases every table compares, by the names the tables read them by."""
    return {"first": first, "replay": replay, "floor first": floor_first, "floor read": floor_read}


def measure_full(
    run: Run,
    first: Callable[[int], object],
    replay: Callable[[int], object],
    floor_first: Callable[[int], object],
    floor_read: Callable[[int], object],
) -> dict[str, float]:
    """The first call, the replay and their floors again, once the store is full."""
    full = run.interleave(core_cases(first, replay, floor_first, floor_read))
    return {f"{name} full": value for name, value in full.items()}


def no_store() -> tuple[twiceshy.Ledger, dict[str, Callable[[int], object]]]:
    """A ``memory://`` ledger and its first call and replay, as cases to interleave."""
    ledger = twiceshy.Ledger("memory://")
    first, replay = protected(ledger)
    return ledger, {"no store first": first, "no store replay": replay}


def idle_costs(nothing: dict[str, Callable[[int], object]], run: Run) -> dict[str, float]:
    """The no-store first call and replay again, each call after a short idle."""
    return {f"{name} idle": after_idle(fn, run.rounds * run.calls) for name, fn in nothing.items()}


def postgres(run: Run, records: int) -> dict[str, float]:
    """Measure the PostgreSQL ledger and its floor."""
    schema = f"twiceshy_bench_{secrets.token_hex(4)}"
    prefix = secrets.token_hex(8)
    ledger = twiceshy.Ledger(f"{POSTGRES}?schema={schema}")
    first, replay = protected(ledger)
    remembering = twiceshy.Ledger(f"{POSTGRES}?schema={schema}", remember=REMEMBER)
    _, remembered = protected(remembering)
    memory, nothing = no_store()
    conn = psycopg.connect(POSTGRES, autocommit=True)
    # The same rows in a table of the ledger's own shape (its columns, key and indexes).
    conn.execute(f"CREATE TABLE {schema}.floor (LIKE {schema}.records INCLUDING ALL)")
    conn.execute(f"CREATE TABLE {schema}.trivial (k text PRIMARY KEY, v text)")
    conn.execute(f"INSERT INTO {schema}.trivial VALUES ('replayed', 'x')")
    insert = f"INSERT INTO {schema}.floor VALUES ({', '.join(['%s'] * len(same_row('', 0)))})"
    update = (
        f"UPDATE {schema}.floor SET state = 'succeeded', result = %s, lease_deadline = NULL,"
        " updated_at = %s, expires_at = %s"
        " WHERE namespace = '' AND key = %s AND fence = 1 AND state = 'claimed'"
    )
    conn.execute(insert, same_row("replayed", 0))
    counter = iter(range(10**9))

    def floor_first(i: int) -> None:
        row = same_row(prefix, next(counter))
        conn.execute(insert, row)
        conn.execute(update, (RESULT_TEXT, row[14], row[14] + 86400, row[1]))

    def floor_read(i: int) -> None:
        conn.execute(
            f"SELECT * FROM {schema}.floor WHERE namespace = '' AND key = %s", ("replayed",)
        ).fetchone()

    def trivial_first(i: int) -> None:
        k = f"k{next(counter)}"
        conn.execute(f"INSERT INTO {schema}.trivial VALUES (%s, 'claimed')", (k,))
        conn.execute(f"UPDATE {schema}.trivial SET v = 'done' WHERE k = %s", (k,))

    def trivial_read(i: int) -> None:
        conn.execute(f"SELECT * FROM {schema}.trivial WHERE k = 'replayed'").fetchone()

    try:
        out = run.interleave(
            {
                "first": first,
                "replay": replay,
                "floor first": floor_first,
                "floor read": floor_read,
                "trivial first": trivial_first,
                "trivial read": trivial_read,
                "remembered": remembered,
                **nothing,
            }
        )
        out.update(idle_costs(nothing, run))
        out.update(run.cpu(core_cases(first, replay, floor_first, floor_read), postgres_cpu))
        out["wake ms"] = wake_up(ledger, 30)
        conn.execute(
            f"""INSERT INTO {schema}.records
            SELECT '', md5(i::text), 'f', 'bulk', 'keyed', 'succeeded', 1, 'o', NULL, 1, '{{}}',
                   NULL, NULL, extract(epoch from now()), extract(epoch from now()), NULL
            FROM generate_series(1, %s) AS i""",
            (records,),
        )
        conn.execute(f"ANALYZE {schema}.records")
        out.update(measure_full(run, first, replay, floor_first, floor_read))
    finally:
        ledger.close()
        remembering.close()
        memory.close()
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
        conn.close()
    return out


def redis_store(run: Run, records: int) -> dict[str, float]:
    """Measure the Redis ledger, its floor and Powertools."""
    prefix = f"twiceshy-bench-{secrets.token_hex(4)}"
    ledger = twiceshy.Ledger(f"{REDIS}?prefix={prefix}")
    first, replay = protected(ledger)
    remembering = twiceshy.Ledger(f"{REDIS}?prefix={prefix}", remember=REMEMBER)
    _, remembered = protected(remembering)
    memory, nothing = no_store()
    client = redis.Redis.from_url(REDIS)
    client.hset(f"{prefix}:floor:replayed", mapping=same_fields("replayed", 0))
    client.hset(f"{prefix}:trivial:replayed", mapping={"state": "succeeded", "result": "{}"})
    counter = iter(range(10**9))

    def floor_first(i: int) -> None:
        fields = same_fields(prefix, next(counter))
        name = f"{prefix}:floor:{fields['key']}"
        client.hset(name, mapping=fields)
        client.hset(
            name,
            mapping={
                "state": "succeeded",
                "result": RESULT_TEXT,
                "updated_at": fields["created_at"],
                "expires_at": fields["created_at"] + 86400,
                "write_id": fields["owner"],
            },
        )

    def floor_read(i: int) -> None:
        client.hgetall(f"{prefix}:floor:replayed")

    def trivial_first(i: int) -> None:
        k = f"{prefix}:trivial:{next(counter)}"
        client.hset(k, mapping={"state": "claimed", "owner": "o"})
        client.hset(k, mapping={"state": "succeeded", "result": "{}"})

    def trivial_read(i: int) -> None:
        client.hgetall(f"{prefix}:trivial:replayed")

    _, pt_first, pt_replay = powertools(local_cache=False)
    _, _, pt_cached = powertools(local_cache=True)
    try:
        out = run.interleave(
            {
                "first": first,
                "replay": replay,
                "floor first": floor_first,
                "floor read": floor_read,
                "trivial first": trivial_first,
                "trivial read": trivial_read,
                "powertools first": pt_first,
                "powertools replay": pt_replay,
                "remembered": remembered,
                "powertools cached": pt_cached,
                **nothing,
            }
        )
        out.update(idle_costs(nothing, run))
        out.update(
            run.cpu(
                {
                    **core_cases(first, replay, floor_first, floor_read),
                    "powertools first": pt_first,
                    "powertools replay": pt_replay,
                },
                redis_cpu(client),
            )
        )
        out["wake ms"] = wake_up(ledger, 30)
        store: Any = ledger.store
        pipe = client.pipeline(transaction=False)
        now = time.time()
        for i in range(records):
            name = store._core.names("", f"bulk-{i}")[0]  # the store's own key layout
            pipe.hset(
                name,
                mapping={
                    "namespace": "",
                    "key": f"bulk-{i}",
                    "fingerprint": "f",
                    "tool": "bulk",
                    "effect": "keyed",
                    "state": "succeeded",
                    "fence": 1,
                    "owner": "o",
                    "attempts": 1,
                    "result": "{}",
                    "created_at": now,
                    "updated_at": now,
                },
            )
            if i % 10_000 == 9_999:
                pipe.execute()
        pipe.execute()
        out.update(measure_full(run, first, replay, floor_first, floor_read))
    finally:
        ledger.close()
        remembering.close()
        memory.close()
        for batch in _batches(client.scan_iter(match=f"{prefix}*", count=10_000)):
            client.delete(*batch)
        for batch in _batches(client.scan_iter(match="bench-powertools*", count=10_000)):
            client.delete(*batch)
        client.close()
    return out


def _batches(keys: Any, size: int = 10_000) -> Any:
    batch: list[Any] = []
    for key in keys:
        batch.append(key)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def powertools(
    *, local_cache: bool, prefix: str = "bench-powertools"
) -> tuple[Any, Callable[[int], object], Callable[[int], object]]:
    """(layer, first call, replay) of Powertools' ``idempotent_function`` on the same Redis.

    It keys one keyword argument, so the run travels in the data beside the tool's arguments.
    """
    logging.getLogger("aws_lambda_powertools").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
            RedisCachePersistenceLayer,
        )

        layer = RedisCachePersistenceLayer(host="127.0.0.1", port=6379, ssl=False)
    config = IdempotencyConfig(
        expires_after_seconds=3600, use_local_cache=local_cache, local_cache_max_items=REMEMBER
    )

    @idempotent_function(
        data_keyword_argument="data", persistence_store=layer, config=config, key_prefix=prefix
    )
    def charge(data: dict[str, Any]) -> dict[str, Any]:
        return {"id": "ch_1", "amount": data["amount"], "customer": data["customer"]}

    counter = iter(range(10**9))
    tag = secrets.token_hex(4)

    def call(run: str) -> object:
        # Outside Lambda it warns about the remaining time on every call.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return charge(data={"amount": 4900, "customer": "cus_1", "run": run})

    call(f"{tag}-replay")
    return (
        layer,
        lambda i: call(f"{tag}-{next(counter)}"),
        lambda i: call(f"{tag}-replay"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, for a smoke run")
    parser.add_argument("--records", type=int, default=1_000_000, help="records for 'flat'")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="this process on one CPU, the servers on the others (see Placement)",
    )
    args = parser.parse_args()
    placement = Placement(args.pin)
    run = Run(2, 20, placement) if args.quick else Run(6, 60, placement)
    records = min(args.records, 10_000) if args.quick else args.records
    try:
        results = {"postgres": postgres(run, records), "redis": redis_store(run, records)}
    finally:
        placement.restore()
    if args.pin:
        print(f"pinned: this process on CPU {placement.client}, the servers on {placement.servers}")
    print(f"median per call in microseconds; {run.rounds} rounds of {run.calls} calls per case")
    header = (
        f"{'store':<9} {'call':<7} {'twiceshy':>9} {'floor':>7} {'ratio':>6}"
        f" {'trivial':>8} {'ratio':>6} {f'@{records:,}':>12} {'floor':>7} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        for call, floor_name in (("first", "floor first"), ("replay", "floor read")):
            ours, floor, full, full_floor = (
                r[call],
                r[floor_name],
                r[f"{call} full"],
                r[f"{floor_name} full"],
            )
            trivial = r["trivial first" if call == "first" else "trivial read"]
            print(
                f"{name:<9} {call:<7} {ours:>9.0f} {floor:>7.0f} {ours / floor:>6.2f}"
                f" {trivial:>8.0f} {ours / trivial:>6.2f} {full:>12.0f} {full_floor:>7.0f}"
                f" {full / full_floor:>6.2f}"
            )
    print(
        "floor: the same round trips writing and reading the same rows as the ledger (a table of"
        " its shape, SHA-256 keys);\ntrivial: the same number of round trips on a two-column"
        " table / a two-field hash."
    )
    print()
    print("CPU per call in microseconds, the cases taking turns (client: this process; server:")
    print("the PostgreSQL server's processes from /proc, Redis's INFO cpu):")
    header = (
        f"  {'store':<9} {'call':<7} {'client':>7} {'floor':>7} {'ratio':>6}"
        f" {'server':>7} {'floor':>7} {'ratio':>6}"
    )
    print(header)
    for name, r in results.items():
        for call, floor_name in (("first", "floor first"), ("replay", "floor read")):
            ours_c, floor_c = r[f"{call} client cpu"], r[f"{floor_name} client cpu"]
            ours_s, floor_s = r[f"{call} server cpu"], r[f"{floor_name} server cpu"]
            # Below one clock tick over the whole case (a quick run), no ratio can be read.
            server_ratio = f"{ours_s / floor_s:.2f}" if floor_s > 0 else "-"
            print(
                f"  {name:<9} {call:<7} {ours_c:>7.0f} {floor_c:>7.0f} {ours_c / floor_c:>6.2f}"
                f" {ours_s:>7.0f} {floor_s:>7.0f} {server_ratio:>6}"
            )
    r = results["redis"]
    print(
        f"  Powertools on Redis: first call {r['powertools first client cpu']:.0f} client,"
        f" {r['powertools first server cpu']:.0f} server; replay"
        f" {r['powertools replay client cpu']:.0f} client,"
        f" {r['powertools replay server cpu']:.0f} server"
    )
    print()
    for name, r in results.items():
        print(f"{name}: waiter woken {r['wake ms']:.2f} ms after the owner's write returned")
    r = results["redis"]
    print()
    print("Powertools for AWS Lambda (idempotent_function, Redis layer) on the same Redis:")
    print(
        f"  first call {r['powertools first']:.0f} us, replay {r['powertools replay']:.0f} us;"
        f" twiceshy's replay is {r['powertools replay'] / r['replay']:.1f}x faster,"
        f" its first call {r['powertools first'] / r['first']:.1f}x"
    )
    print()
    print(
        "What 1.1x the floor leaves for twiceshy's work, beside that work alone with no store"
        " (memory://, in the same rounds):"
    )
    print(
        f"  {'store':<9} {'call':<7} {'floor':>7} {'leaves':>7} {'used':>7} {'no store':>9}"
        f" {'after idle':>11}"
    )
    for name, r in results.items():
        for call, floor_name in (("first", "floor first"), ("replay", "floor read")):
            floor = r[floor_name]
            print(
                f"  {name:<9} {call:<7} {floor:>7.0f} {floor * 0.1:>7.0f} {r[call] - floor:>7.0f}"
                f" {r[f'no store {call}']:>9.0f} {r[f'no store {call} idle']:>11.0f}"
            )
    print(
        "  leaves: a tenth of the floor; used: twiceshy's time beyond the floor; no store: the"
        " same call on memory://,\n  back to back, and after idle: each after 0.2 ms of sleep,"
        " as a call's work follows a round trip.\n  Where 'no store' exceeds 'leaves', no store"
        " could meet 1.1x."
    )
    r = results["redis"]
    print()
    print(f"Remembered replay (Ledger(remember={REMEMBER})), no round trip:")
    for name, res in results.items():
        print(
            f"  {name}: {res['remembered']:.0f} us, {res['remembered'] / res['trivial read']:.2f}"
            f" of one round trip (trivial read {res['trivial read']:.0f} us)"
        )
    print(
        f"  Powertools replay {r['powertools replay']:.0f} us is"
        f" {r['powertools replay'] / r['remembered']:.1f}x twiceshy's remembered replay;"
        f" Powertools with its local cache {r['powertools cached']:.0f} us,"
        f" {r['powertools cached'] / r['remembered']:.1f}x"
    )


if __name__ == "__main__":
    main()
