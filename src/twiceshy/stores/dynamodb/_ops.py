"""The DynamoDB ledger's operations, each written once as a generator of the requests it needs.

An operation yields a step — a :class:`Call` (one request: the client method's name and its
parameters) or a :class:`Pause` — and is sent the step's answer (the response dict), or has its
error thrown in. It decides everything else: what a failed condition means, when to read the
item that failed it, what is sent again, how a waiter polls, how the table is made. The
blocking and async stores only carry the steps to DynamoDB and back (``_stores.py``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar

from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

from ..._records import (
    CLOCK_TOLERANCE,
    FINAL_STATES,
    Change,
    Effect,
    Record,
    Snapshot,
    State,
    guard_holds,
    is_live,
    last_written,
    live_snapshot,
    make_snapshot,
)
from ...errors import LedgerNotFound, StoreError, StoreUnavailable
from ._core import Core
from ._errors import CONDITION_FAILED, NO_TABLE, TABLE_IN_USE, code
from ._items import PK, SCHEMA_PK, SCHEMA_VERSION, Item, Params, counts, record, select, written_by

log = logging.getLogger("twiceshy")

T = TypeVar("T")

ROUNDS: Final = 3  # a claim: its request, and a look again when its item vanished meanwhile
POLL_FIRST: Final = 0.005  # a waiter's first pause; it doubles up to the poll_interval
CREATE_POLL: Final = (0.05, 1.0)  # waiting for a new table to be ACTIVE: 50 ms doubling to 1 s


@dataclass(frozen=True, slots=True)
class Call:
    """One request: the client's method (``"update_item"``) and its parameters."""

    method: str
    params: Params


@dataclass(frozen=True, slots=True)
class Pause:
    """Sleep ``seconds`` (answered by ``None``)."""

    seconds: float


Step: TypeAlias = Call | Pause
Op: TypeAlias = Generator[Step, Any, T]


def _guarded(core: Core, what: str, attempt: Callable[[], Op[T]]) -> Op[T]:
    """Run ``attempt``; the SDK's errors become :class:`~twiceshy.StoreError`."""
    core.check_open()
    try:
        return (yield from attempt())
    except (ClientError, BotoCoreError, UnicodeError) as exc:
        raise core.errors.of(what, exc) from exc


def _item_that_failed(core: Core, pk: str, exc: BaseException) -> Op[Item | None]:
    """The item a conditional request failed on: answered with the error by DynamoDB, read
    (strongly consistent) from servers that do not answer it."""
    if code(exc) != CONDITION_FAILED:
        raise exc
    assert isinstance(exc, ClientError)
    carried: Item | None = exc.response.get("Item")
    if carried:
        return carried
    reply = yield Call("get_item", core.layout.get(pk))
    found: Item | None = reply.get("Item")
    return found


# -- the Store protocol -------------------------------------------------------------------------


def claim(
    core: Core,
    namespace: str,
    key: str,
    *,
    fingerprint: str,
    tool: str,
    effect: Effect,
    owner: str,
    lease: float,
    args: str | None = None,
) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.claim`: one conditional ``UpdateItem``."""

    def attempt() -> Op[Snapshot]:
        pk = core.layout.record_pk(namespace, key)
        for _ in range(ROUNDS):
            now = core.now()
            params = core.layout.claim(
                pk,
                namespace,
                key,
                fingerprint=fingerprint,
                tool=tool,
                effect=effect,
                owner=owner,
                deadline=now + lease,
                now=now,
                args=args,
            )
            try:
                reply = yield Call("update_item", params)
            except ClientError as exc:
                item = yield from _item_that_failed(core, pk, exc)
            else:
                return make_snapshot(record(reply["Attributes"]), now, True)
            # A live record stood in the way. Sent again after a lost answer (by the SDK), a
            # claim meets the record it made itself: its owner token tells.
            at = core.now()
            found = None if item is None else record(item)
            if found is not None and is_live(found, at, CLOCK_TOLERANCE):
                core.skew.saw(found, at)
                won = found.state is State.CLAIMED and found.owner == owner
                return make_snapshot(found, at, won)
            # Deleted or expired since the condition failed: claim again.
        raise StoreError(f"DynamoDB ledger could not settle the claim of {namespace!r}/{key!r}")

    return (yield from _guarded(core, "claim", attempt))


def write(core: Core, namespace: str, key: str, change: Change) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.write`: one ``UpdateItem`` whose condition is the guard.

    A write carries a random ``write_id`` and refuses to apply twice: sent again by the SDK
    after its answer was lost, it fails its condition on the item it made, and recognises it.

    An expiry is counted from the caller's clock, unless the record was written later than that
    (by more than the clock tolerance): counted from the caller's clock, the others would find
    the outcome expired before it was written. The condition refuses such a record, and the
    write is sent again counted from the record's time, under the same guard.
    """
    write_id = secrets.token_hex(12)

    def attempt() -> Op[Snapshot]:
        pk = core.layout.record_pk(namespace, key)
        now = core.now()
        if not change.from_states:
            item = (yield Call("get_item", core.layout.get(pk))).get("Item")
        else:
            since = now
            for _ in range(ROUNDS):
                params = core.layout.write(pk, change, now, write_id, since)
                try:
                    reply = yield Call("update_item", params)
                except ClientError as exc:
                    item = yield from _item_that_failed(core, pk, exc)
                else:
                    written = record(reply["Attributes"])
                    core.skew.moved(written, since - now)
                    core.skew.saw(written, now)
                    return make_snapshot(written, now, True)
                later = _written_after(item, change, now, since, write_id)
                if later is None:
                    break
                since = later
        if written_by(item, write_id):
            # Ours, applied by an earlier attempt; answered as written even if its record has
            # expired since (a retention near 0): answered as gone, the caller would claim
            # afresh and run the work a second time.
            return make_snapshot(record(item), now, True)
        found = None if item is None else record(item)
        snap = live_snapshot(found, now, CLOCK_TOLERANCE)
        if snap.record is not None:
            core.skew.saw(snap.record, now)
        return snap

    return (yield from _guarded(core, "write", attempt))


def _written_after(
    item: Item | None, change: Change, now: float, since: float, write_id: str
) -> float | None:
    """When ``item`` failed a write's condition only because it was written more than the
    clock tolerance after ``since``, the time it was written (the expiry is to be counted from
    it); else ``None``: its guard failed, and the record answers as it is."""
    if item is None or written_by(item, write_id):
        return None
    found = record(item)
    if change.to not in FINAL_STATES or change.ttl is None:
        return None  # no expiry is written: the times are not in the condition
    latest = last_written(found)
    if latest <= since + CLOCK_TOLERANCE:
        return None
    if not is_live(found, now, CLOCK_TOLERANCE) or not guard_holds(found, change, now):
        return None
    return latest


def get(core: Core, namespace: str, key: str) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.get`: one strongly consistent ``GetItem``."""

    def attempt() -> Op[Snapshot]:
        reply = yield Call("get_item", core.layout.get(core.layout.record_pk(namespace, key)))
        now = core.now()
        item = reply.get("Item")
        found = None if item is None else record(item)
        snap = live_snapshot(found, now, CLOCK_TOLERANCE)
        if snap.record is not None:
            core.skew.saw(snap.record, now)
        return snap

    return (yield from _guarded(core, "read", attempt))


def wait(core: Core, namespace: str, key: str, fence: int, timeout: float) -> Op[Snapshot]:
    """See :meth:`twiceshy.stores.Store.wait`: reads, with pauses of 5 ms doubling up to the
    ``poll_interval``, until the record leaves "CLAIMED under ``fence``" or time is up."""
    deadline = time.monotonic() + max(timeout, 0.0)
    pause = POLL_FIRST
    while True:
        snap = yield from get(core, namespace, key)
        found = snap.record
        left = deadline - time.monotonic()
        if found is None or found.state is not State.CLAIMED or found.fence != fence or left <= 0:
            return snap
        yield Pause(min(pause, left))
        pause = min(pause * 2, core.poll_interval)


def _scan(core: Core, params: Params) -> Op[list[Item]]:
    """Every item a Scan finds, page after page."""
    items: list[Item] = []
    start: Item | None = None
    while True:
        page = yield Call(
            "scan", params if start is None else {**params, "ExclusiveStartKey": start}
        )
        items += page.get("Items", [])
        start = page.get("LastEvaluatedKey")
        if not start:
            return items


def _readable(items: Iterable[Item]) -> list[Record]:
    """The records among scanned items, skipping what is not one (someone else's item)."""
    found: list[Record] = []
    skipped: list[str] = []
    for item in items:
        try:
            found.append(record(item))
        except StoreError:
            skipped.append(str(item.get(PK, {}).get("S")))
    if skipped:
        log.debug(
            "DynamoDB ledger: skipped %d item(s) under the prefix that are not records, e.g. %s",
            len(skipped),
            ", ".join(repr(s) for s in skipped[:5]),
        )
    return found


def records(
    core: Core,
    namespace: str,
    *,
    states: Iterable[State] | None = None,
    tool: str | None = None,
    limit: int | None = None,
) -> Op[list[Record]]:
    """See :meth:`twiceshy.stores.Store.records`.

    A strongly consistent ``Scan`` of the table, for operators: its cost grows with the whole
    table, not with the namespace.
    """

    def attempt() -> Op[list[Record]]:
        items = yield from _scan(core, core.layout.scan(core.layout.records_pk(namespace)))
        found = [r for r in _readable(items) if r.namespace == namespace]
        return select(found, core.now(), states, tool, limit)

    return (yield from _guarded(core, "records", attempt))


def expired(core: Core, namespace: str | None = None) -> Op[list[Record]]:
    """See :meth:`twiceshy.stores.ExpiredOutcomes.expired`: the ``Scan`` of a purge, whole
    items, deleting nothing."""

    def attempt() -> Op[list[Record]]:
        now = core.now()
        begins = core.layout.records_pk(namespace)
        items = yield from _scan(core, core.layout.scan(begins, expired_at=now, whole=True))
        found = [
            r
            for r in _readable(items)
            if (namespace is None or r.namespace == namespace)
            and r.state in FINAL_STATES
            and not is_live(r, now, CLOCK_TOLERANCE)
        ]
        found.sort(key=lambda r: (r.namespace, r.expires_at or 0.0, r.key))
        return found

    return (yield from _guarded(core, "expired", attempt))


def purge_expired(core: Core, namespace: str | None = None) -> Op[int]:
    """See :meth:`twiceshy.stores.Store.purge_expired`.

    A ``Scan`` for expired outcomes, then one conditional ``DeleteItem`` each (a record claimed
    again in between is no longer expired, and stays). DynamoDB's TTL deletes them too, within
    days of their ``ttl``, where the table has TTL enabled.
    """

    def attempt() -> Op[int]:
        now = core.now()
        begins = core.layout.records_pk(namespace)
        items = yield from _scan(core, core.layout.scan(begins, expired_at=now))
        deleted = 0
        for item in items:
            try:
                yield Call("delete_item", core.layout.purge(item[PK]["S"], now))
            except ClientError as exc:
                if code(exc) != CONDITION_FAILED:
                    raise
                continue
            deleted += 1
        return deleted

    return (yield from _guarded(core, "purge", attempt))


# -- the CallCounts protocol --------------------------------------------------------------------


def add_counts(core: Core, namespace: str, counts: Mapping[tuple[str, str], int]) -> Op[None]:
    """See :meth:`twiceshy.stores.CallCounts.add_counts`: one ``UpdateItem`` of ``ADD``s.

    The flush carries an id it sets on the item: sent again after a lost answer, it fails its
    condition and is not added twice (unless another flush landed in between).
    """
    flush_id = secrets.token_hex(12)

    def attempt() -> Op[None]:
        if not counts:
            return
        try:
            yield Call("update_item", core.layout.add_counts(namespace, counts, flush_id))
        except ClientError as exc:
            if code(exc) != CONDITION_FAILED:
                raise

    return (yield from _guarded(core, "count", attempt))


def read_counts(core: Core, namespace: str) -> Op[dict[tuple[str, str], int]]:
    """See :meth:`twiceshy.stores.CallCounts.counts`."""

    def attempt() -> Op[dict[tuple[str, str], int]]:
        reply = yield Call("get_item", core.layout.get(core.layout.counts_pk(namespace)))
        return counts(reply.get("Item"))

    return (yield from _guarded(core, "counts", attempt))


# -- opening ------------------------------------------------------------------------------------


def open_ledger(core: Core, *, create: bool) -> Op[None]:
    """Check the table's schema item; make the table (and the item) where there is none.

    Raises:
        LedgerNotFound: with ``create=False``, no table, or a table that holds no ledger.
        StoreError: the table is not a twiceshy ledger this version reads.
    """

    def attempt() -> Op[None]:
        try:
            reply = yield Call("get_item", core.layout.get(SCHEMA_PK))
        except ClientError as exc:
            if code(exc) == "ValidationException":
                raise StoreError(
                    f"DynamoDB ledger {core.errors.where}: the table's key is not the String "
                    f"{PK!r} of a twiceshy ledger ({core.errors.scrub(str(exc))}); name "
                    "another table"
                ) from exc
            if code(exc) != NO_TABLE:
                raise
            if not create:
                raise LedgerNotFound(
                    f"no twiceshy ledger at DynamoDB {core.errors.where}: there is no such "
                    "table (a table name or region mistyped?)"
                ) from None
            yield from _create_table(core)
            reply = {}
        item = reply.get("Item")
        if item is None:
            if not create:
                raise LedgerNotFound(
                    f"no twiceshy ledger at DynamoDB {core.errors.where}: the table holds no "
                    f"{SCHEMA_PK!r} item (another application's table?)"
                )
            try:
                yield Call("put_item", core.layout.put_schema(core.now()))
            except ClientError as exc:
                if code(exc) != CONDITION_FAILED:
                    raise
            item = (yield Call("get_item", core.layout.get(SCHEMA_PK))).get("Item") or {}
        found = item.get("version", {}).get("N")
        if found != str(SCHEMA_VERSION):
            raise StoreError(
                f"DynamoDB ledger {core.errors.where} has schema version {found!r}; this "
                f"twiceshy reads version {SCHEMA_VERSION}"
            )

    yield from _guarded(core, "open", attempt)
    core.schema_ready = True


def _create_table(core: Core) -> Op[None]:
    """Create the table (on-demand), wait until it is ACTIVE, and enable TTL on it."""
    layout = core.layout
    try:
        yield Call("create_table", layout.create_table())
    except ClientError as exc:
        if code(exc) != TABLE_IN_USE:  # another process is creating it: wait for it alike
            raise
    deadline = time.monotonic() + core.create_timeout
    pause, longest = CREATE_POLL
    while True:
        try:
            status = (yield Call("describe_table", {"TableName": layout.table}))["Table"][
                "TableStatus"
            ]
        except ClientError as exc:
            if code(exc) != NO_TABLE:  # just created, not yet visible everywhere
                raise
            status = None
        if status == "ACTIVE":
            break
        if time.monotonic() + pause > deadline:
            raise StoreUnavailable(
                f"DynamoDB ledger {core.errors.where}: the new table is {status or 'not there'}"
                f" after {core.create_timeout:g} s (create_timeout=)"
            )
        yield Pause(pause)
        pause = min(pause * 2, longest)
    try:
        yield Call("update_time_to_live", layout.enable_ttl())
    except ClientError as exc:
        # Housekeeping only: expiry is checked on every read, so without TTL expired outcomes
        # stay until purge_expired() (twiceshy gc) deletes them.
        log.warning(
            "DynamoDB ledger %s: TTL could not be enabled on the attribute 'ttl' (%s); expired "
            "outcomes stay until `twiceshy gc` deletes them, or until TTL is enabled",
            core.errors.where,
            core.errors.scrub(str(exc)),
        )
