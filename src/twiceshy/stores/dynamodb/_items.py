"""The ledger's items in a DynamoDB table, and every request the store sends (no I/O).

A record is one item. Its partition key ``pk`` (a String, the table's only key) is
``<prefix>#r#<namespace>#<key>``, namespace and key percent-encoded (UTF-8, each byte outside
``A-Z a-z 0-9 _ . - ~`` as ``%XX``), so that no ``#`` of theirs can change the key's structure;
the prefix may not hold ``#``. A namespace's call counts are the item ``<prefix>#c#<namespace>``
and the table's schema version the item ``#schema``, which no prefix can reach. The record's
fields are attributes of the same names (``ns`` for the namespace), ``None`` being an absent
attribute, so ``None``, ``""`` and ``"null"`` stay three values; times are Numbers written as
the shortest text that reads back as the same double. Besides the fields an item holds
``write_id``, the token of the guarded write that made it (a write sent again after a lost
answer recognises itself by it), and ``ttl``, whole seconds since the epoch for DynamoDB's own
expiry. Every condition and update expression is built here, with every attribute named through
``ExpressionAttributeNames`` (``state``, ``key``, ``ttl`` and others are reserved words). Why
each is shaped as it is: ``docs/stores/dynamodb.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final
from urllib.parse import quote

from ..._records import (
    CLOCK_TOLERANCE,
    FINAL_STATES,
    Change,
    Effect,
    Record,
    State,
    is_live,
    make_record,
)
from ...errors import StoreError

SCHEMA_VERSION: Final = 1
"""The item layout this version reads (the ``#schema`` item's ``version``)."""

PK: Final = "pk"
SCHEMA_PK: Final = "#schema"
TTL_GRACE: Final = 3600
"""Seconds past ``expires_at`` at which DynamoDB's TTL may delete a settled item. The record is
gone for twiceshy at ``expires_at`` already; the grace keeps the item for the store's second
look at a write whose answer was lost (and absorbs the difference between the clocks)."""

COUNT_PREFIX: Final = "n:"
"""The counts item holds one Number attribute per (tool, outcome): ``n:`` + ``[tool, outcome]``
as JSON."""

Item = dict[str, Any]
Params = dict[str, Any]

_FIELDS: Final = (
    "ns",
    "key",
    "fingerprint",
    "tool",
    "effect",
    "state",
    "fence",
    "owner",
    "lease_deadline",
    "attempts",
    "result",
    "error",
    "reason",
    "created_at",
    "updated_at",
    "expires_at",
    "args",
)
_TIMES: Final = ("created_at", "updated_at", "expires_at")
_EFFECTS: Final = {e.value: e for e in Effect}
_STATES: Final = {s.value: s for s in State}


def _names(*fields: str) -> dict[str, str]:
    return {f"#{field}": field for field in fields}


_CLAIM_NAMES: Final = _names(PK, *_FIELDS, "ttl", "write_id")
# A claim writes every attribute: over an expired record it starts a new life, keeping only
# the fence (which goes up by one; a new item starts at 1).
_CLAIM_SETS: Final = (
    "SET #ns = :ns, #key = :key, #fingerprint = :fingerprint, #tool = :tool, "
    "#effect = :effect, #state = :claimed, #fence = if_not_exists(#fence, :zero) + :one, "
    "#owner = :owner, #lease_deadline = :deadline, #attempts = :one, #created_at = :now, "
    "#updated_at = :now"
)
_CLAIM_REMOVES: Final = " REMOVE #result, #error, #reason, #expires_at, #ttl, #write_id"
# With the call's arguments, or without (an expired record's are removed with the rest).
_CLAIM_UPDATE: Final = _CLAIM_SETS + _CLAIM_REMOVES + ", #args"
_CLAIM_UPDATE_ARGS: Final = _CLAIM_SETS + ", #args = :args" + _CLAIM_REMOVES
# Past its retention at :now, and not written after :soon (now plus the clock tolerance), which
# only a clock ahead of the caller's can have done (is_live with a tolerance). A comparison with
# an absent attribute is false: CLAIMED and UNKNOWN records, which have no expires_at, never are.
_EXPIRED: Final = "(#expires_at <= :now AND #created_at <= :soon AND #updated_at <= :soon)"
# No item, or one past its retention.
_CLAIM_CONDITION: Final = "attribute_not_exists(#pk) OR " + _EXPIRED


def quoted(text: str) -> str:
    """A namespace or key as it stands in a partition key (raises on text that is not UTF-8)."""
    # Keys are hex digests: letters and digits are never quoted, and the check is much cheaper.
    if text.isascii() and text.isalnum():
        return text
    return quote(text, safe="")


def text(value: str) -> dict[str, str]:
    """A String attribute value; text that is not UTF-8 raises ``UnicodeEncodeError`` here,
    before anything is sent (the JSON that carries it would hide it as an escape)."""
    value.encode("utf-8")
    return {"S": value}


def number(value: float) -> dict[str, str]:
    """A Number attribute value: the shortest text that reads back as the same double."""
    return {"N": repr(float(value))}


def integer(value: int) -> dict[str, str]:
    """A whole Number attribute value."""
    return {"N": str(int(value))}


def _float(item: Item, name: str) -> float | None:
    value = item.get(name)
    return None if value is None else float(value["N"])


def _text(item: Item, name: str) -> str | None:
    value = item.get(name)
    return None if value is None else str(value["S"])


def record(item: Item) -> Record:
    """The record an item holds; :class:`~twiceshy.StoreError` if it holds none."""
    try:
        return make_record(  # the fields in Record's order
            item["ns"]["S"],
            item["key"]["S"],
            item["fingerprint"]["S"],
            item["tool"]["S"],
            _EFFECTS[item["effect"]["S"]],
            _STATES[item["state"]["S"]],
            int(item["fence"]["N"]),
            item["owner"]["S"],
            _float(item, "lease_deadline"),
            int(item["attempts"]["N"]),
            _text(item, "result"),
            _text(item, "error"),
            _text(item, "reason"),
            float(item["created_at"]["N"]),
            float(item["updated_at"]["N"]),
            _float(item, "expires_at"),
            _text(item, "args"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        shown = _text(item, PK) if isinstance(item, dict) else None
        raise StoreError(f"DynamoDB ledger: unreadable record {shown!r}: {exc!r}") from exc


def written_by(item: Item | None, write_id: str) -> bool:
    """Whether ``item`` is what the write carrying ``write_id`` left."""
    return item is not None and _text(item, "write_id") == write_id


def counts(item: Item | None) -> dict[tuple[str, str], int]:
    """A namespace's call counts from its item."""
    found: dict[tuple[str, str], int] = {}
    for name, value in (item or {}).items():
        if name.startswith(COUNT_PREFIX):
            tool, outcome = json.loads(name[len(COUNT_PREFIX) :])
            found[(str(tool), str(outcome))] = int(value["N"])
    return found


class Layout:
    """The items of one table under one prefix, and the requests that read and write them."""

    __slots__ = ("prefix", "table")

    def __init__(self, table: str, prefix: str) -> None:
        self.table = table
        self.prefix = prefix

    # -- names --------------------------------------------------------------------------------

    def record_pk(self, namespace: str, key: str) -> str:
        """The partition key of a record."""
        return f"{self.prefix}#r#{quoted(namespace)}#{quoted(key)}"

    def records_pk(self, namespace: str | None) -> str:
        """What the partition keys of a namespace's records (or of all of them) begin with."""
        return f"{self.prefix}#r#" + ("" if namespace is None else f"{quoted(namespace)}#")

    def counts_pk(self, namespace: str) -> str:
        """The partition key of a namespace's call counts."""
        return f"{self.prefix}#c#{quoted(namespace)}"

    # -- requests ---------------------------------------------------------------------------

    def get(self, pk: str) -> Params:
        """GetItem, strongly consistent."""
        return {"TableName": self.table, "Key": {PK: text(pk)}, "ConsistentRead": True}

    def claim(
        self,
        pk: str,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        deadline: float,
        now: float,
        args: str | None = None,
    ) -> Params:
        """The claim: one conditional UpdateItem that inserts, or replaces an expired record."""
        params: Params = {
            "TableName": self.table,
            "Key": {PK: text(pk)},
            "UpdateExpression": _CLAIM_UPDATE if args is None else _CLAIM_UPDATE_ARGS,
            "ConditionExpression": _CLAIM_CONDITION,
            "ExpressionAttributeNames": _CLAIM_NAMES,
            "ExpressionAttributeValues": {
                ":ns": text(namespace),
                ":key": text(key),
                ":fingerprint": text(fingerprint),
                ":tool": text(tool),
                ":effect": text(effect.value),
                ":claimed": text(State.CLAIMED.value),
                ":zero": integer(0),
                ":one": integer(1),
                ":owner": text(owner),
                ":deadline": number(deadline),
                ":now": number(now),
                ":soon": number(now + CLOCK_TOLERANCE),
            },
            "ReturnValues": "ALL_NEW",
            # DynamoDB answers the item that failed the condition with its error, saving a read
            # on every replay; servers that do not (dynalite) are read after a failure.
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
        if args is not None:
            params["ExpressionAttributeValues"][":args"] = text(args)
        return params

    def write(
        self, pk: str, change: Change, now: float, write_id: str, since: float | None = None
    ) -> Params:
        """A guarded write: one UpdateItem whose condition is the change's guard.

        ``change.from_states`` must not be empty (no write can start from no state). An expiry
        is counted from ``since`` (``now`` when not given), and only while the record was last
        written no more than the clock tolerance after it: DynamoDB cannot take the later of two
        times in an update, so a writer whose clock is behind the record's fails the condition,
        and is sent again with ``since`` at the record's time (``_ops.write``).
        """
        to = change.to
        bump = change.new_owner is not None
        values: dict[str, Any] = {
            ":fence": integer(change.fence),
            ":now": number(now),
            ":soon": number(now + CLOCK_TOLERANCE),
            ":to": text(to.value),
            ":write_id": text(write_id),
        }
        used = {"created_at", "fence", "state", "expires_at", "write_id", "updated_at"}
        states = sorted(s.value for s in change.from_states)
        for n, state in enumerate(states):
            values[f":from{n}"] = text(state)
        condition = [
            "#fence = :fence",
            f"#state IN ({', '.join(f':from{n}' for n in range(len(states)))})",
            # Past its retention a record is gone, whatever its guard says.
            f"NOT {_EXPIRED}",
            # A write already applied, sent again after its answer was lost, applies nothing.
            "(attribute_not_exists(#write_id) OR #write_id <> :write_id)",
        ]
        if change.owner is not None:
            condition.append("#owner = :owner")
            values[":owner"] = text(change.owner)
            used.add("owner")
        if change.lapsed:
            # An absent deadline compares false: a record without a lease never lapses.
            condition.append("#lease_deadline <= :now")
            used.add("lease_deadline")

        sets = ["#state = :to", "#updated_at = :now", "#write_id = :write_id"]
        removes: list[str] = []
        if bump:
            sets += ["#fence = :new_fence", "#owner = :new_owner"]
            values[":new_fence"] = integer(change.fence + 1)
            values[":new_owner"] = text(change.new_owner or "")
            used.add("owner")
        if bump or change.count_attempt:
            sets.append("#attempts = #attempts + :one")
            values[":one"] = integer(1)
            used.add("attempts")
        if to is not State.CLAIMED:
            removes.append("#lease_deadline")
            used.add("lease_deadline")
        elif change.lease is not None:
            sets.append("#lease_deadline = :deadline")
            values[":deadline"] = number(now + change.lease)
            used.add("lease_deadline")
        for name, keep, value in (
            ("result", to is State.SUCCEEDED, change.result),
            ("error", to is State.FAILED or to is State.UNKNOWN, change.error),
            ("reason", to is State.UNKNOWN, change.reason),
        ):
            used.add(name)
            if keep and value is not None:
                sets.append(f"#{name} = :{name}")
                values[f":{name}"] = text(value)
            else:
                removes.append(f"#{name}")
        used.add("ttl")
        if to in FINAL_STATES and change.ttl is not None:
            start = now if since is None else since
            condition.append("#created_at <= :latest AND #updated_at <= :latest")
            values[":latest"] = number(start + CLOCK_TOLERANCE)
            expires = start + change.ttl
            sets += ["#expires_at = :expires_at", "#ttl = :ttl"]
            values[":expires_at"] = number(expires)
            values[":ttl"] = integer(math.ceil(expires) + TTL_GRACE)
        else:
            removes += ["#expires_at", "#ttl"]
        update = "SET " + ", ".join(sets) + (" REMOVE " + ", ".join(removes) if removes else "")
        return {
            "TableName": self.table,
            "Key": {PK: text(pk)},
            "UpdateExpression": update,
            "ConditionExpression": " AND ".join(condition),
            "ExpressionAttributeNames": _names(*sorted(used)),
            "ExpressionAttributeValues": values,
            "ReturnValues": "ALL_NEW",
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }

    def scan(self, begins: str, *, expired_at: float | None = None, whole: bool = False) -> Params:
        """A strongly consistent Scan for the items whose key begins with ``begins``; with
        ``expired_at``, only those past their retention then, and only their keys (or, with
        ``whole``, the whole items)."""
        params: Params = {
            "TableName": self.table,
            "ConsistentRead": True,
            "FilterExpression": "begins_with(#pk, :begins)",
            "ExpressionAttributeNames": _names(PK),
            "ExpressionAttributeValues": {":begins": text(begins)},
        }
        if expired_at is not None:
            params["FilterExpression"] += " AND " + _EXPIRED
            params["ExpressionAttributeNames"] = _names(PK, *_TIMES)
            params["ExpressionAttributeValues"][":now"] = number(expired_at)
            params["ExpressionAttributeValues"][":soon"] = number(expired_at + CLOCK_TOLERANCE)
            if not whole:
                params["ProjectionExpression"] = "#pk"
        return params

    def purge(self, pk: str, now: float) -> Params:
        """DeleteItem of an expired record, only while it still is one."""
        return {
            "TableName": self.table,
            "Key": {PK: text(pk)},
            "ConditionExpression": _EXPIRED,
            "ExpressionAttributeNames": _names(*_TIMES),
            "ExpressionAttributeValues": {
                ":now": number(now),
                ":soon": number(now + CLOCK_TOLERANCE),
            },
        }

    def add_counts(
        self, namespace: str, counts: Mapping[tuple[str, str], int], flush_id: str
    ) -> Params:
        """One UpdateItem adding every count of a flush (all or none), recognising itself."""
        names = {"#ns": "ns", "#flush": "flush"}
        values: dict[str, Any] = {":ns": text(namespace), ":flush": text(flush_id)}
        adds = []
        for n, ((tool, outcome), count) in enumerate(sorted(counts.items())):
            names[f"#c{n}"] = COUNT_PREFIX + json.dumps([tool, outcome])
            values[f":c{n}"] = integer(count)
            adds.append(f"#c{n} :c{n}")
        return {
            "TableName": self.table,
            "Key": {PK: text(self.counts_pk(namespace))},
            "UpdateExpression": "SET #ns = :ns, #flush = :flush ADD " + ", ".join(adds),
            "ConditionExpression": "attribute_not_exists(#flush) OR #flush <> :flush",
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
        }

    # -- the table ----------------------------------------------------------------------------

    def create_table(self) -> Params:
        """CreateTable: the one String key ``pk``, on-demand capacity."""
        return {
            "TableName": self.table,
            "AttributeDefinitions": [{"AttributeName": PK, "AttributeType": "S"}],
            "KeySchema": [{"AttributeName": PK, "KeyType": "HASH"}],
            "BillingMode": "PAY_PER_REQUEST",
        }

    def enable_ttl(self) -> Params:
        """UpdateTimeToLive on the ``ttl`` attribute."""
        return {
            "TableName": self.table,
            "TimeToLiveSpecification": {"Enabled": True, "AttributeName": "ttl"},
        }

    def put_schema(self, now: float) -> Params:
        """PutItem of the ``#schema`` item, unless one is there."""
        return {
            "TableName": self.table,
            "Item": {
                PK: text(SCHEMA_PK),
                "version": integer(SCHEMA_VERSION),
                "created_at": number(now),
            },
            "ConditionExpression": "attribute_not_exists(#pk)",
            "ExpressionAttributeNames": _names(PK),
        }


def select(
    found: Iterable[Record],
    now: float,
    states: Iterable[State] | None,
    tool: str | None,
    limit: int | None,
) -> list[Record]:
    """What ``records()`` answers from one namespace's records: live ones, newest first."""
    wanted = None if states is None else frozenset(states)
    chosen = [
        r
        for r in found
        if is_live(r, now, CLOCK_TOLERANCE)
        and (wanted is None or r.state in wanted)
        and (tool is None or r.tool == tool)
    ]
    chosen.sort(key=lambda r: (-r.created_at, r.key))
    return chosen if limit is None else chosen[: max(limit, 0)]
