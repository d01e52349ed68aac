"""Redis's answers read as twiceshy's: records, snapshots, listings and errors (no I/O)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final

from redis.exceptions import (
    AskError,
    ClusterError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._records import Effect, Record, Snapshot, State, make_record, make_snapshot
from ...errors import StoreError, StoreUnavailable

log = logging.getLogger("twiceshy")

_EFFECTS: Final = {e.value: e for e in Effect}
_STATES: Final = {s.value: s for s in State}
_SHOWN_SKIPPED: Final = 5  # how many names of keys that are no records a DEBUG line shows


def decoded(value: bytes | str) -> str:
    """A reply's text, whether redis-py decoded it or not."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _float(value: str | None) -> float | None:
    return None if value is None else float(value)


def record(fields: Mapping[str, str]) -> Record:
    """The record a hash's fields hold; :class:`~twiceshy.StoreError` if they hold none."""
    try:
        return make_record(  # the fields in Record's order
            fields["namespace"],
            fields["key"],
            fields["fingerprint"],
            fields["tool"],
            _EFFECTS[fields["effect"]],
            _STATES[fields["state"]],
            int(fields["fence"]),
            fields["owner"],
            _float(fields.get("lease_deadline")),
            int(fields["attempts"]),
            fields.get("result"),
            fields.get("error"),
            fields.get("reason"),
            float(fields["created_at"]),
            float(fields["updated_at"]),
            _float(fields.get("expires_at")),
            fields.get("args"),
        )
    except (KeyError, ValueError) as exc:
        raise StoreError(f"Redis ledger: unreadable record {dict(fields)!r}: {exc}") from exc


def snapshot(reply: object) -> Snapshot:
    """A script's answer ``{won, now, record}`` as a snapshot of the live record (or of the
    record a won write wrote)."""
    if not isinstance(reply, list) or len(reply) < 2:
        raise StoreError(f"Redis ledger: unexpected script answer {reply!r}")
    now = float(reply[1])
    won = reply[0] in (b"1", "1")
    found = None
    if len(reply) == 3:
        try:
            fields = json.loads(reply[2])
        except ValueError as exc:
            raise StoreError(f"Redis ledger: unreadable script answer {reply!r}") from exc
        if not isinstance(fields, dict):
            raise StoreError(f"Redis ledger: unexpected script answer {reply!r}")
        found = record(fields)
        # A record past its retention is no record; one this command just wrote is answered.
        if not won and found.expires_at is not None and found.expires_at <= now:
            found = None
    elif len(reply) != 2:
        raise StoreError(f"Redis ledger: unexpected script answer {reply!r}")
    return make_snapshot(found, now, won)


def settled(snap: Snapshot, fence: int) -> bool:
    """Whether a waiter for ``fence`` is done: the record is gone, settled or moved on."""
    found = snap.record
    return found is None or found.state is not State.CLAIMED or found.fence != fence


def select(
    found: Iterable[Record],
    namespace: str,
    now: float,
    states: Iterable[State] | None,
    tool: str | None,
    limit: int | None,
) -> list[Record]:
    """What ``records()`` answers from the records a scan found: live ones, newest first."""
    wanted = None if states is None else frozenset(states)
    chosen = [
        r
        for r in found
        if r.namespace == namespace
        and (r.expires_at is None or r.expires_at > now)
        and (wanted is None or r.state in wanted)
        and (tool is None or r.tool == tool)
    ]
    chosen.sort(key=lambda r: (-r.created_at, r.key))
    return chosen if limit is None else chosen[: max(limit, 0)]


def _shown(name: bytes | str) -> str:
    """A key's name for a log line, whatever its bytes."""
    return name.decode(errors="backslashreplace") if isinstance(name, bytes) else name


def readable(names: list[Any], replies: list[Any]) -> list[Record]:
    """The records among ``HGETALL`` replies (``raise_on_error=False``), skipping what is not one.

    A key under the prefix may be someone else's: a string or a list (``WRONGTYPE``), or a hash
    without a record's fields. Listing skips it, so that one foreign key cannot hide every
    record from ``twiceshy ls`` and the reconciler; any other error is raised.
    """
    found: list[Record] = []
    skipped: list[str] = []
    for name, reply in zip(names, replies, strict=True):
        if isinstance(reply, ResponseError):
            if not str(reply).startswith("WRONGTYPE"):
                raise reply
            skipped.append(_shown(name))
            continue
        if not reply:
            continue  # deleted between the scan and the read
        try:
            found.append(record({decoded(k): decoded(v) for k, v in reply.items()}))
        except (StoreError, UnicodeError):
            skipped.append(_shown(name))
    if skipped:
        log.debug(
            "Redis ledger: skipped %d key(s) under the prefix that are not records, e.g. %s",
            len(skipped),
            ", ".join(repr(n) for n in skipped[:_SHOWN_SKIPPED]),
        )
    return found


def counts(found: Mapping[Any, Any]) -> dict[tuple[str, str], int]:
    """A namespace's call counts from its hash (fields ``[tool, outcome]`` as JSON)."""
    out: dict[tuple[str, str], int] = {}
    for field, n in found.items():
        tool, outcome = json.loads(field)
        out[(str(tool), str(outcome))] = int(n)
    return out


def store_error(what: str, exc: BaseException) -> StoreError:
    """The :class:`~twiceshy.StoreError` for a failure of redis-py (or of text not UTF-8).

    A cluster that is down, failing over or moving the slot counts as unreachable.
    """
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return StoreUnavailable(f"Redis ledger unreachable ({what}): {exc}")
    if isinstance(exc, ClusterError | TryAgainError | AskError | RedisClusterException):
        return StoreUnavailable(f"Redis cluster ledger unavailable ({what}): {exc}")
    if isinstance(exc, UnicodeError):
        return StoreError(f"Redis ledger cannot store text that is not UTF-8 ({what}): {exc}")
    return StoreError(f"Redis ledger failed ({what}): {exc}")
