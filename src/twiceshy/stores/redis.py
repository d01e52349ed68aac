"""``redis://``: a ledger on a Redis server, shared by many processes and machines (redis-py).

:class:`RedisStore` is the blocking store, :class:`AsyncRedisStore` its ``redis.asyncio`` twin;
:func:`open_redis` opens both for one URL. They share the Lua scripts, the key layout and the
conversion between hashes and records; only the I/O differs.

URLs:
    ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS) and
    ``unix:///path/to/redis.sock?db=0``, with redis-py's own query options (``socket_timeout``,
    ``client_name``, ``ssl_ca_certs``, ...) and these of twiceshy's, taken out of the URL before
    redis-py sees it: ``prefix`` (the key prefix, default ``twiceshy``), ``wait_replicas``,
    ``wait_timeout``, ``reread_interval`` and ``allow_eviction`` (see :class:`RedisStore` and
    "Eviction"). Example: ``redis://127.0.0.1:6379/0?prefix=shop&wait_replicas=1``. A store's
    ``repr()`` and its errors show the URL with its secrets as ``***`` (``redis://user:***@host``,
    ``?password=***``; see :func:`twiceshy.stores.redacted_url`).

Key layout:
    One hash per record, ``{prefix}:{<namespace>:<key>}:rec``, where namespace and key are
    percent-encoded (UTF-8, every byte outside ``A-Z a-z 0-9 _ . - ~`` as ``%XX``), so neither
    ``{``, ``}``, ``:`` nor a glob character of theirs can reach the key's structure. The part
    in braces is the Redis Cluster hash tag: everything of one record — the hash and its wake-up
    channel ``{prefix}:{<namespace>:<key>}:wake`` — lies in one hash slot, and every script
    touches exactly one key. The prefix may not contain braces. The hash fields are the
    :class:`~twiceshy.Record` fields by name (``namespace``, ``key``, ``fingerprint``, ``tool``,
    ``effect``, ``state``, ``fence``, ``owner``, ``lease_deadline``, ``attempts``, ``result``,
    ``error``, ``reason``, ``created_at``, ``updated_at``, ``expires_at``) plus ``write_id``, the
    token of the last guarded write (see "Lost replies"). A field that is ``None`` is absent, so
    ``None``, ``""`` and ``"null"`` stay three different values; times are seconds since the
    epoch written with 17 significant digits (exact doubles, sub-microsecond), fence and attempts
    as integers.

Round trips:
    A claim — won, lost, or a replay of a settled outcome — is one ``EVALSHA`` of
    :data:`CLAIM_SCRIPT`; every guarded write (completion, release, heartbeat, takeover,
    UNKNOWN, a reconciler's resolution) one ``EVALSHA`` of :data:`WRITE_SCRIPT`; a read one
    ``EVALSHA`` of :data:`READ_SCRIPT`. The scripts are loaded when the store opens, so the
    first call pays no ``NOSCRIPT`` detour (after a server restart, one call does).

Clock:
    With ``clock=None`` (the default) lease deadlines and expiry are on the server's clock: the
    scripts read ``TIME`` (allowed before writes since Redis 5 with effect replication, the only
    mode of Redis 7). With a ``clock`` callable (tests' fake clock) its reading is passed in
    ``ARGV[1]`` instead; it is the one code path either way. Every
    :class:`~twiceshy.Snapshot` carries the ``now`` the script used.

Retention:
    An outcome with a ttl is logically gone once ``expires_at <= now``; every script checks that,
    so a record past its retention is never answered, and a claim over a hash still present starts
    a new life with fence + 1 (once the hash is deleted — by Redis, or by
    :meth:`RedisStore.purge_expired` — the key starts again at fence 1, as in every store, since
    the old record no longer lives). On the server's clock a SUCCEEDED, FAILED or RELEASED record
    with a ttl also gets ``PEXPIREAT`` a grace of ``2 * socket_timeout + 1`` seconds after its
    ``expires_at`` (see "Lost replies"), so Redis frees the memory itself; CLAIMED and UNKNOWN
    records never carry a TTL (``PERSIST`` on every write to them). With a caller's clock no real
    TTL is set: that clock's timeline says nothing about when Redis's own clock will pass
    ``expires_at``, and a real TTL that fired before the logical expiry would forget an outcome
    that still counts (a retry would run the work again). Such records stay until
    :meth:`RedisStore.purge_expired` deletes them.

Eviction:
    A record Redis evicts is a record forgotten: an evicted claim or outcome lets the next call
    with its key run the work again, an UNSAFE tool included. Settled outcomes carry a real TTL
    (see "Retention"), so ``volatile-*`` policies evict them long before their retention, and
    ``allkeys-*`` policies also evict claims and UNKNOWN records. The store therefore reads the
    server's ``maxmemory-policy`` when it opens (``CONFIG GET``; where ``CONFIG`` is disabled or
    renamed, as on managed Redis, the ``maxmemory_policy`` line of ``INFO memory``) and raises
    :class:`EvictionPolicyRefused` for any policy but ``noeviction`` — whatever ``maxmemory`` is
    now, since it can be set at any time without a restart. A policy neither command can read
    (an ACL user with neither ``CONFIG`` nor ``INFO``) is refused too: the managed services'
    default is ``volatile-lru``, so an unknown policy is likely one that evicts, and a refusal
    costs one URL option while a silent second run of a payment cannot be undone. Whoever accepts
    the risk opens with ``allow_eviction=1`` (``allow_eviction=True``), logged as a WARNING each
    time it lets a store open that would otherwise be refused. The policy is checked once, at
    open: a change of it afterwards goes unseen. With ``noeviction`` a full server refuses
    writes instead: a call then fails with :class:`~twiceshy.StoreError` before its tool runs
    (or, if its outcome cannot be written, is left for the lease and UNKNOWN), and nothing that
    was recorded is forgotten.

Waiters:
    A guarded write that settles a record or moves it to a new fence ``PUBLISH``es on the record's
    wake channel in the same script, only when it applied (a ``PUBLISH`` that fails, e.g. for an
    ACL user without rights on the channel, never fails the write). Each store object has one
    subscriber connection and one reader thread (started on first wait, ended after a while without
    waiters), which dispatches messages to the waiters, sync and async alike (an async waiter is
    woken on its own event loop). A waiter subscribes, waits until the subscription is confirmed,
    and only then re-reads the record, so no wake-up is lost. A lost subscriber connection wakes
    every waiter to re-read and is re-established with backoff; besides, every waiter re-reads
    every ``reread_interval`` (1 s by default), and every wait is bounded by its timeout. A
    ``SUBSCRIBE`` the server refuses (Redis 7 ACL users get no channels by default) is logged once,
    on the ``twiceshy`` logger, and its waiters fall back to re-reading every ``reread_interval``.
    Plain ``PUBLISH`` is used, not Redis 7's sharded ``SPUBLISH``: one subscriber connection can
    then hear every channel whichever node it is on; the channel shares the record's hash tag, so
    moving to ``SPUBLISH`` with per-shard subscribers changes one word in the script.

Lost replies:
    redis-py's own retries are switched off: a command is sent once per attempt, by this module.
    When a connection drops or times out around a command, the store sends the same script once
    more on a fresh connection, which is safe for each of them: a claim recognises its own owner
    token (``won=True`` for the claim it already made); a write carries a random ``write_id`` that
    the script stores with the change, and a write whose id the record already shows answers
    ``won=True`` without applying anything again (the record shows exactly this write), even when
    the record has passed its retention in between (a short ttl): the write stands, and the caller
    must not take the missing record for a write that never happened. That is why Redis keeps an
    outcome's hash a grace past its ``expires_at``: the longest the second attempt can come after
    the first. Otherwise the guarded write is applied, once. If that second attempt fails too,
    :class:`~twiceshy.StoreUnavailable` is raised.

Errors:
    redis-py's ``ConnectionError`` and ``TimeoutError`` become
    :class:`~twiceshy.StoreUnavailable`, any other ``RedisError`` (and text that is not UTF-8)
    :class:`~twiceshy.StoreError`, chained from the original. A store fails fast: the
    constructor sends ``PING`` within ``socket_timeout`` and raises ``StoreUnavailable`` when
    nothing answers, so a ledger never runs a tool unprotected; it raises
    :class:`EvictionPolicyRefused` (a ``StoreError``) for a server that may evict records (see
    "Eviction"). A key under the prefix that is not a record of this store (a string, a list, a
    hash of someone else's) is skipped by :meth:`RedisStore.records` and
    :meth:`RedisStore.purge_expired` (counted in a DEBUG line of the ``twiceshy`` logger); read
    by its own name, it is an error, never "no record".

Guarantee level:
    Redis acknowledges a write before any replica has it. If the primary fails over right after a
    claim, the promoted replica may not have the claim, and a retry could claim the key again and
    run the work a second time; the same holds for a recorded outcome (a retry could run again
    instead of replaying). ``wait_replicas=N`` narrows that window at a latency cost: every claim
    and write is followed by ``WAIT N timeout`` on the same connection (pipelined: still one round
    trip, which now lasts until N replicas have the write), and when the command took effect but
    fewer replicas acknowledged within ``wait_timeout`` the store raises
    :class:`~twiceshy.StoreError` — the claim may stand on the primary, and no work runs. ``WAIT``
    bounds, but does not remove, the loss on failover (a replica that acknowledged may still not be
    the one promoted); on Redis >= 7.2 with AOF, ``WAITAOF`` additionally makes the write durable on
    disk before the work starts (not offered here: the target is 7.0). Without persistence (no RDB,
    no AOF) a restart of Redis forgets every record: claims, outcomes and UNKNOWNs alike, and a
    retry after it runs the work again. Where that is not acceptable, run Redis with AOF
    (``appendfsync always``) or use a ledger whose commits are durable (PostgreSQL, SQLite).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
)
from datetime import timedelta
from typing import Any, Final, Protocol, TypeVar, cast
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .._forks import reset_in_children
from .._records import Change, Effect, Record, Snapshot, State
from ..errors import EvictionPolicyRefused, StoreError, StoreUnavailable
from . import redacted_url

__all__ = [
    "CLAIM_SCRIPT",
    "PURGE_SCRIPT",
    "READ_SCRIPT",
    "WRITE_SCRIPT",
    "AsyncRedisStore",
    "EvictionPolicyRefused",
    "RedisStore",
    "open_redis",
]

# --------------------------------------------------------------------------------------------
# Lua. Every script touches one key, KEYS[1], the record's hash. ARGV[1] is always the clock:
# "" reads the server's TIME, anything else is the caller's clock in seconds. Each answers
# {won, now, record}: won is "1" or "0", now the clock the script used, then the record's hash
# as one JSON object of its fields, as they are after the script (no third item when there is
# no record).
# Numbers leave Lua only through string.format: Lua's own tostring keeps 14 digits.
# --------------------------------------------------------------------------------------------

_LUA_PRELUDE: Final = """
local function clock(arg)
  if arg == '' then
    local t = redis.call('TIME')
    return tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  return tonumber(arg)
end
local function num(x) return string.format('%.17g', x) end
local function int(x) return string.format('%d', x) end
local function opt(arg)
  if arg == '' then return nil end
  return string.sub(arg, 2)
end
local function fields(flat)
  local f = {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  return f
end
local function hset(name, flat)
  -- Write the fields of a flat {field, value, ...} list; answer them as a table.
  redis.call('HSET', name, unpack(flat))
  return fields(flat)
end
local function reply(won, now, f)
  -- The record (a table of its fields, or nil) travels as one JSON object: a client decodes
  -- one string much faster than thirty, and gets the fields by name at once.
  if f == nil then return {won, num(now)} end
  return {won, num(now), cjson.encode(f)}
end
local function record(name)
  local flat = redis.call('HGETALL', name)
  if #flat == 0 then return nil end
  return fields(flat)
end
local function live(f, now)
  return f.expires_at == nil or tonumber(f.expires_at) > now
end
"""

CLAIM_SCRIPT: Final = (
    _LUA_PRELUDE
    + """
-- Claim a key, or answer its live record unchanged.
-- KEYS[1]: the record's hash.
-- ARGV: [1] clock ("" = TIME), [2] namespace, [3] key, [4] fingerprint, [5] tool,
--       [6] effect, [7] owner, [8] lease (seconds).
-- A live record is answered as it is, won when it is CLAIMED by this owner (a retry of a claim
-- whose reply was lost). A missing or expired one is replaced by a fresh CLAIMED record: fence 1,
-- or the expired record's fence + 1. Claims never carry a TTL.
local now = clock(ARGV[1])
local f = record(KEYS[1])
local fence = 1
if f ~= nil then
  if live(f, now) then
    local won = '0'
    if f.state == 'claimed' and f.owner == ARGV[7] then won = '1' end
    return reply(won, now, f)
  end
  fence = tonumber(f.fence) + 1
  redis.call('DEL', KEYS[1])
end
-- The hash was deleted or never existed: these fields are the whole record.
return reply('1', now, hset(KEYS[1], {
  'namespace', ARGV[2], 'key', ARGV[3], 'fingerprint', ARGV[4], 'tool', ARGV[5],
  'effect', ARGV[6], 'state', 'claimed', 'fence', int(fence), 'owner', ARGV[7],
  'lease_deadline', num(now + tonumber(ARGV[8])), 'attempts', '1',
  'created_at', num(now), 'updated_at', num(now)}))
"""
)
"""Claim-or-return in one round trip (see the KEYS/ARGV contract in its text)."""

WRITE_SCRIPT: Final = (
    _LUA_PRELUDE
    + """
-- Apply one guarded change (twiceshy._records.guard_holds + apply_change), or nothing.
-- KEYS[1]: the record's hash.
-- ARGV: [1] clock ("" = TIME), [2] write id (random, one per write), [3] wake channel,
--       [4] fence, [5] allowed states as ",s1,s2,", [6] to, [7] owner guard, [8] lapsed "1"/"0",
--       [9] new owner, [10] lease (seconds), [11] count attempt "1"/"0", [12] result,
--       [13] error, [14] reason, [15] ttl (seconds), [16] real expiry: "" for none, else
--       "=" + how long past expires_at Redis keeps the hash (seconds; PEXPIREAT).
--       Optional values ([7], [9], [10], [12] to [15]) are "" for none, else "=" + the value.
-- A record whose write id is ARGV[2] already shows this very write: it answers won, changing
-- nothing, even past its retention (the second attempt of a write whose reply was lost may come
-- after a short ttl: it must learn that its write stands, not that the record is gone).
-- Publishes on the wake channel when the record settles or changes fence.
local now = clock(ARGV[1])
local f = record(KEYS[1])
if f ~= nil and f.write_id == ARGV[2] then return reply('1', now, f) end
if f == nil or not live(f, now) then return reply('0', now, nil) end
if tonumber(f.fence) ~= tonumber(ARGV[4])
    or not string.find(ARGV[5], ',' .. f.state .. ',', 1, true) then
  return reply('0', now, f)
end
local owner = opt(ARGV[7])
if owner ~= nil and f.owner ~= owner then return reply('0', now, f) end
if ARGV[8] == '1' and (f.lease_deadline == nil or tonumber(f.lease_deadline) > now) then
  return reply('0', now, f)
end

local to = ARGV[6]
local final = to == 'succeeded' or to == 'failed' or to == 'released'
local new_owner = opt(ARGV[9])
local lease = opt(ARGV[10])
local ttl = opt(ARGV[15])
local grace = opt(ARGV[16])
local set = {'state', to, 'updated_at', num(now), 'write_id', ARGV[2]}
local unset = {}
local function put(name, value)
  if value == nil then
    unset[#unset + 1] = name
  else
    set[#set + 1] = name
    set[#set + 1] = value
  end
end
if new_owner ~= nil then
  put('fence', int(tonumber(f.fence) + 1))
  put('owner', new_owner)
end
if new_owner ~= nil or ARGV[11] == '1' then put('attempts', int(tonumber(f.attempts) + 1)) end
if to == 'claimed' then
  if lease ~= nil then put('lease_deadline', num(now + tonumber(lease))) end
else
  put('lease_deadline', nil)
end
if to == 'succeeded' then put('result', opt(ARGV[12])) else put('result', nil) end
if to == 'failed' or to == 'unknown' then put('error', opt(ARGV[13])) else put('error', nil) end
if to == 'unknown' then put('reason', opt(ARGV[14])) else put('reason', nil) end
local expires = nil
if final and ttl ~= nil then expires = now + tonumber(ttl) end
if expires ~= nil then put('expires_at', num(expires)) else put('expires_at', nil) end

redis.call('HSET', KEYS[1], unpack(set))
for i = 1, #set, 2 do f[set[i]] = set[i + 1] end
if #unset > 0 then
  redis.call('HDEL', KEYS[1], unpack(unset))
  for _, name in ipairs(unset) do f[name] = nil end
end
if expires ~= nil and grace ~= nil then
  local at = math.ceil((expires + tonumber(grace)) * 1000)
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', at))
else
  redis.call('PERSIST', KEYS[1])
end
-- pcall: the write above stands whatever PUBLISH does (Redis never rolls a script back), and a
-- user without rights on the channel (Redis 7 ACLs grant none by default) must still get the
-- write's answer; its waiters then see the change at their next re-read.
if to ~= 'claimed' or new_owner ~= nil then redis.pcall('PUBLISH', ARGV[3], to) end
-- f is the hash as written: its fields before, with set's written and unset's removed.
return reply('1', now, f)
"""
)
"""One guarded write in one round trip (see the KEYS/ARGV contract in its text)."""

READ_SCRIPT: Final = (
    _LUA_PRELUDE
    + """
-- Read a record with the clock that judges it.
-- KEYS[1]: the record's hash. ARGV: [1] clock ("" = TIME).
local now = clock(ARGV[1])
return reply('0', now, record(KEYS[1]))
"""
)
"""A read with the store's clock in one round trip."""

PURGE_SCRIPT: Final = (
    _LUA_PRELUDE
    + """
-- Delete a SUCCEEDED, FAILED or RELEASED record past its retention; answer 1 if deleted.
-- KEYS[1]: the record's hash. ARGV: [1] clock ("" = TIME).
-- A key that is no hash is someone else's (HGET on it would fail the whole purge): left alone.
local now = clock(ARGV[1])
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return 0 end
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'succeeded' and state ~= 'failed' and state ~= 'released' then return 0 end
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires_at'))
if not expires or expires > now then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
)
"""Delete one expired outcome, never a CLAIMED or UNKNOWN record."""

_SCRIPTS: Final = (CLAIM_SCRIPT, WRITE_SCRIPT, READ_SCRIPT, PURGE_SCRIPT)

# --------------------------------------------------------------------------------------------

T = TypeVar("T")

log = logging.getLogger("twiceshy")

_URL_OPTIONS: Final = frozenset(
    {"prefix", "wait_replicas", "wait_timeout", "reread_interval", "allow_eviction"}
)
_BOOLEANS: Final = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_SAFE_POLICY: Final = "noeviction"
_SHOWN_SKIPPED: Final = 5  # how many names of keys that are no records a DEBUG line shows
_SCAN_COUNT: Final = 500
_IDLE_SUBSCRIBER: Final = 10.0  # seconds without waiters before the reader thread ends
_READ_POLL: Final = 0.5  # the reader thread's longest sleep between checks of its state
_BACKOFF_FIRST: Final = 0.05
_BACKOFF_CAP: Final = 1.0
_GLOB_SPECIAL: Final = frozenset("*?[]\\")

_EFFECTS: Final = {e.value: e for e in Effect}
_STATES: Final = {s.value: s for s in State}


def _seconds(value: float | timedelta, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds >= 0:
        raise ValueError(f"{name}= must be a non-negative number of seconds")
    return seconds


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _quote(text: str) -> str:
    # Keys are hex digests: letters and digits are never quoted, and the check is much cheaper.
    if text.isascii() and text.isalnum():
        return text
    return quote(text, safe="")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in text)


def _opt(value: str | None) -> str:
    """An optional text for a script: "" for none, "=" + the text otherwise."""
    return "" if value is None else "=" + value


def _num(value: float | None) -> str:
    return "" if value is None else "=" + repr(float(value))


def _float(value: str | None) -> float | None:
    return None if value is None else float(value)


def _record(fields: Mapping[str, str]) -> Record:
    try:
        return Record(
            namespace=fields["namespace"],
            key=fields["key"],
            fingerprint=fields["fingerprint"],
            tool=fields["tool"],
            effect=_EFFECTS[fields["effect"]],
            state=_STATES[fields["state"]],
            fence=int(fields["fence"]),
            owner=fields["owner"],
            lease_deadline=_float(fields.get("lease_deadline")),
            attempts=int(fields["attempts"]),
            result=fields.get("result"),
            error=fields.get("error"),
            reason=fields.get("reason"),
            created_at=float(fields["created_at"]),
            updated_at=float(fields["updated_at"]),
            expires_at=_float(fields.get("expires_at")),
        )
    except (KeyError, ValueError) as exc:
        raise StoreError(f"Redis ledger: unreadable record {dict(fields)!r}: {exc}") from exc


def _snapshot(reply: object) -> Snapshot:
    """A script's answer ``{won, now, field, value, ...}`` as a snapshot of the live record
    (or of the record a won write wrote)."""
    if not isinstance(reply, list) or len(reply) < 2:
        raise StoreError(f"Redis ledger: unexpected script answer {reply!r}")
    now = float(reply[1])
    won = reply[0] in (b"1", "1")
    record = None
    if len(reply) == 3:
        try:
            fields = json.loads(reply[2])
        except ValueError as exc:
            raise StoreError(f"Redis ledger: unreadable script answer {reply!r}") from exc
        if not isinstance(fields, dict):
            raise StoreError(f"Redis ledger: unexpected script answer {reply!r}")
        record = _record(fields)
        # A record past its retention is no record; one this command just wrote is answered.
        if not won and record.expires_at is not None and record.expires_at <= now:
            record = None
    elif len(reply) != 2:
        raise StoreError(f"Redis ledger: unexpected script answer {reply!r}")
    return Snapshot(record, now, won)


def _settled(snap: Snapshot, fence: int) -> bool:
    record = snap.record
    return record is None or record.state is not State.CLAIMED or record.fence != fence


def _select(
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


def _readable(names: list[Any], replies: list[Any]) -> list[Record]:
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
            found.append(_record({_text(k): _text(v) for k, v in reply.items()}))
        except (StoreError, UnicodeError):
            skipped.append(_shown(name))
    if skipped:
        log.debug(
            "Redis ledger: skipped %d key(s) under the prefix that are not records, e.g. %s",
            len(skipped),
            ", ".join(repr(n) for n in skipped[:_SHOWN_SKIPPED]),
        )
    return found


def _unavailable(what: str, exc: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"Redis ledger unreachable ({what}): {exc}")


def _store_error(what: str, exc: BaseException) -> StoreError:
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return _unavailable(what, exc)
    if isinstance(exc, UnicodeError):
        return StoreError(f"Redis ledger cannot store text that is not UTF-8 ({what}): {exc}")
    return StoreError(f"Redis ledger failed ({what}): {exc}")


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """Take twiceshy's own options out of a Redis URL.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL.

    Returns:
        The URL redis-py is given, and the options as keyword arguments of :class:`RedisStore`.

    Raises:
        ValueError: an option has no valid value, or is repeated.
    """
    # Only the query is rebuilt: urlunsplit would turn "unix:///path" into "unix:/path".
    base, _, rest = url.partition("?")
    query, hash_sign, fragment = rest.partition("#")
    kept: list[tuple[str, str]] = []
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _URL_OPTIONS:
            kept.append((name, value))
            continue
        if name in options:
            raise ValueError(f"Redis ledger URL repeats {name!r}")
        if name == "allow_eviction":
            if value.lower() not in _BOOLEANS:
                raise ValueError(
                    f"Redis ledger URL option allow_eviction={value!r}: expected 1 (accept a "
                    "server that may evict records) or 0"
                )
            options[name] = _BOOLEANS[value.lower()]
            continue
        try:
            options[name] = int(value) if name == "wait_replicas" else value
            if name in ("wait_timeout", "reread_interval"):
                options[name] = float(value)
        except ValueError:
            raise ValueError(f"Redis ledger URL option {name}={value!r} is not a number") from None
    kept_query = urlencode(kept, quote_via=quote)
    plain = base + ("?" + kept_query if kept_query else "") + hash_sign + fragment
    return plain, options


def _eviction_policy(client: redis.Redis) -> tuple[str | None, str]:
    """The server's ``maxmemory-policy``, or ``None`` and why it could not be read."""
    why: list[str] = []
    try:
        reply = cast(Mapping[Any, Any], client.config_get("maxmemory-policy"))
        found = {_text(k): _text(v) for k, v in reply.items()}
    except ResponseError as exc:  # disabled or renamed (managed Redis), or not granted (ACL)
        why.append(f"CONFIG GET: {exc}")
    else:
        if found.get("maxmemory-policy"):
            return found["maxmemory-policy"].lower(), ""
        why.append("CONFIG GET answered no maxmemory-policy")
    try:
        policy = client.info("memory").get("maxmemory_policy")
    except ResponseError as exc:
        why.append(f"INFO: {exc}")
    else:
        if policy:
            return str(policy).lower(), ""
        why.append("INFO memory shows no maxmemory_policy")
    return None, "; ".join(why)


# -- settings and the subscriber, shared by the sync and async stores -----------------------


class _Watch(Protocol):
    """A waiter, as the subscriber sees it; called from the reader thread."""

    def ready(self) -> None:
        """The channel's subscription is confirmed: wake-ups from now on arrive."""

    def wake(self) -> None:
        """A message arrived on the channel."""

    def lost(self) -> None:
        """The subscription was lost: look again now, and wait for it to be back."""


class _PubSubConnection(Protocol):
    """The part of a redis-py connection the subscriber uses."""

    def connect(self) -> None: ...
    def disconnect(self) -> None: ...
    def send_command(self, *args: bytes) -> None: ...
    def can_read(self, timeout: float = 0) -> bool: ...
    def read_response(
        self, *, disconnect_on_error: bool = True, push_request: bool = False
    ) -> object: ...


class _Channel:
    __slots__ = ("confirmed", "watches")

    def __init__(self) -> None:
        self.watches: set[_Watch] = set()
        self.confirmed = False


class _Subscriber:
    """One pub/sub connection and its reader thread, dispatching messages to waiters.

    Waiters subscribe from their own threads (a short send under the lock); only the reader
    thread reads. Replies to SUBSCRIBE and UNSUBSCRIBE come in the order the commands were
    sent, which :attr:`_sent` mirrors, so a confirmation is matched to the subscription it
    confirms even when a channel is unsubscribed and subscribed again in between.
    """

    def __init__(self, connect: Callable[[], _PubSubConnection], name: str) -> None:
        self._connect = connect
        self._name = name
        self._lock = threading.Lock()
        self._conn: _PubSubConnection | None = None
        self._broken = False
        self._answered = False  # the current connection has answered a command
        self._refusal_logged = False
        self._channels: dict[bytes, _Channel] = {}
        self._sent: deque[tuple[bytes, _Channel | None]] = deque()
        self._thread: threading.Thread | None = None
        self._idle_since: float | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def watching(self, channel: bytes, watch: _Watch) -> Iterator[None]:
        """Register a waiter on a channel for the duration of the block."""
        with self._lock:
            if self._stop.is_set():
                raise StoreError("Redis ledger is closed")
            entry = self._channels.get(channel)
            if entry is None:
                entry = self._channels[channel] = _Channel()
                self._send(b"SUBSCRIBE", channel, entry)
            entry.watches.add(watch)
            if entry.confirmed:
                watch.ready()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                entry.watches.discard(watch)
                if not entry.watches and self._channels.get(channel) is entry:
                    del self._channels[channel]
                    self._send(b"UNSUBSCRIBE", channel, None)

    def _send(self, command: bytes, channel: bytes, entry: _Channel | None) -> None:
        """Send one (UN)SUBSCRIBE if connected; called with the lock held."""
        conn = self._conn
        if conn is None or self._broken:
            return  # the reader subscribes every registered channel when it connects
        try:
            conn.send_command(command, channel)
        except Exception:
            # The reader notices at its next look and starts over on a new connection.
            self._broken = True
            return
        self._sent.append((channel, entry))

    def close(self, timeout: float) -> None:
        """Stop the reader thread and close the connection (idempotent)."""
        with self._lock:
            self._stop.set()
            conn, self._conn = self._conn, None
            thread = self._thread
            for entry in self._channels.values():
                for watch in entry.watches:
                    watch.lost()
        if conn is not None:
            conn.disconnect()  # wakes the reader at once
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the reader thread -----------------------------------------------------------------

    def _run(self) -> None:
        delay = _BACKOFF_FIRST
        while not self._stop.is_set():
            if self._retire_if_idle(wait=False):
                return
            conn = self._connect()
            try:
                conn.connect()
                if not self._install(conn):
                    return
                self._read(conn)
                return  # stopped, or idle long enough
            except Exception:
                # The connection failed: the waiters were told (_uninstall); start over after
                # a pause.
                pass
            finally:
                self._uninstall(conn)
            # The pause grows until a connection answers: one that fails before it ever
            # answered (connected, then refused or cut at once) must not be retried at once.
            if self._answered:
                delay = _BACKOFF_FIRST
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, _BACKOFF_CAP)

    def _retire_if_idle(self, *, wait: bool) -> bool:
        """End the thread when no waiter came for a while; a later waiter starts a new one."""
        with self._lock:
            if self._channels or self._sent:
                self._idle_since = None
                return False
            now = time.monotonic()
            if self._idle_since is None:
                self._idle_since = now
            if now - self._idle_since < (_IDLE_SUBSCRIBER if wait else 0.0):
                return False
            self._thread = None
            self._conn = None
            self._idle_since = None
            return True

    def _install(self, conn: _PubSubConnection) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._conn, self._broken, self._answered = conn, False, False
            self._sent.clear()
            for channel, entry in self._channels.items():
                entry.confirmed = False
                self._send(b"SUBSCRIBE", channel, entry)
            return True

    def _uninstall(self, conn: _PubSubConnection) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
                self._sent.clear()
                for entry in self._channels.values():
                    entry.confirmed = False
                    for watch in entry.watches:
                        watch.lost()
        conn.disconnect()

    def _read(self, conn: _PubSubConnection) -> None:
        """Dispatch messages until the connection fails (raises), a stop, or a long idle."""
        while not self._stop.is_set():
            with self._lock:
                if self._broken:
                    raise RedisConnectionError("a subscription could not be sent")
            if self._retire_if_idle(wait=True):
                return
            if not conn.can_read(timeout=_READ_POLL):
                continue
            try:
                # RESP3 (redis-py's default) delivers pub/sub as push frames: ask for them.
                message = conn.read_response(disconnect_on_error=False, push_request=True)
            except ResponseError as exc:
                self._refused(exc)
                continue
            self._dispatch(message)

    def _refused(self, exc: ResponseError) -> None:
        """The server refused the oldest command sent (e.g. ``NOPERM`` for the channel).

        The connection stays: it answers in order, and other channels may be allowed. The
        waiters of a refused channel are let read at once and then every re-read interval,
        since no wake-up will come for them; the channel is asked for again only when a waiter
        comes after they have all left.
        """
        with self._lock:
            if not self._sent:
                raise RedisError(f"pub/sub error with no command waiting: {exc}") from exc
            self._answered = True
            channel, sent_for = self._sent.popleft()
            if sent_for is None or self._channels.get(channel) is not sent_for:
                return  # an UNSUBSCRIBE, or a subscription nobody waits on any more
            sent_for.confirmed = True  # as far as the waiters can go: read, then re-read
            for watch in sent_for.watches:
                watch.ready()
            first, self._refusal_logged = not self._refusal_logged, True
        if first:
            log.warning(
                "Redis ledger: the server refuses to SUBSCRIBE to %s (%s); waiters for a call "
                "running elsewhere will not be woken, and re-read the record every "
                "reread_interval instead. Grant the ledger's user its channels (ACL: "
                "&<prefix>:*) to wake them at once.",
                channel.decode(errors="replace"),
                exc,
            )

    def _dispatch(self, message: object) -> None:
        if not isinstance(message, list) or len(message) < 2:
            return  # not ours (a server notice redis-py's parser already handled)
        # Bytes, unless the URL asked redis-py to decode (decode_responses=true).
        kind, channel = (part.encode() if isinstance(part, str) else part for part in message[:2])
        with self._lock:
            self._answered = True
            if kind == b"message":
                entry = self._channels.get(channel)
                for watch in entry.watches if entry is not None else ():
                    watch.wake()
                return
            if kind not in (b"subscribe", b"unsubscribe"):
                return
            if not self._sent or self._sent[0][0] != channel:
                raise RedisError(f"pub/sub reply out of order: {message!r}")
            _, sent_for = self._sent.popleft()
            if (
                kind == b"subscribe"
                and sent_for is not None
                and (self._channels.get(channel) is sent_for)
            ):
                sent_for.confirmed = True
                for watch in sent_for.watches:
                    watch.ready()


class _ThreadWatch:
    """A blocking waiter's events."""

    __slots__ = ("confirmed", "woken")

    def __init__(self) -> None:
        self.confirmed = threading.Event()
        self.woken = threading.Event()

    def ready(self) -> None:
        self.confirmed.set()

    def wake(self) -> None:
        self.woken.set()

    def lost(self) -> None:
        self.confirmed.clear()
        self.woken.set()


class _LoopWatch:
    """An async waiter's events, set on its own loop from the reader thread."""

    __slots__ = ("confirmed", "loop", "woken")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.confirmed = asyncio.Event()
        self.woken = asyncio.Event()

    def _soon(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(fn)

    def ready(self) -> None:
        self._soon(self.confirmed.set)

    def wake(self) -> None:
        self._soon(self.woken.set)

    def lost(self) -> None:
        self._soon(self.confirmed.clear)
        self._soon(self.woken.set)


class _Core:
    """What a store and its twin share: settings, key layout, the sync client, the subscriber."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        clock: Callable[[], float] | None,
        socket_timeout: float | timedelta,
        wait_replicas: int,
        wait_timeout: float | timedelta,
        reread_interval: float | timedelta,
        client_name: str | None,
        allow_eviction: bool,
    ) -> None:
        if set(dict(parse_qsl(urlsplit(url).query))) & _URL_OPTIONS:
            raise ValueError(
                f"{redacted_url(url)!r} carries twiceshy options: open it with "
                "RedisStore.from_url() or open_redis(), or pass them as keyword arguments"
            )
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a Redis ledger prefix must not contain braces: {prefix!r}")
        if wait_replicas < 0:
            raise ValueError("wait_replicas= must not be negative")
        self.url = url
        self.prefix = prefix
        self.clock = clock
        self.socket_timeout = _seconds(socket_timeout, "socket_timeout")
        self.wait_replicas = wait_replicas
        self.wait_ms = max(1, round(_seconds(wait_timeout, "wait_timeout") * 1000))
        self.reread = _seconds(reread_interval, "reread_interval")
        if self.reread <= 0:
            raise ValueError("reread_interval= must be positive")
        if wait_replicas > 0 and self.wait_ms / 1000 >= self.socket_timeout:
            # The reply to the pipelined WAIT comes only after wait_timeout: on a socket that
            # gives up first, every write with a lagging replica would end as a lost reply.
            raise ValueError(
                "wait_timeout= must be shorter than socket_timeout= when wait_replicas= is set"
            )
        # How long Redis keeps an outcome's hash past its expires_at: the second attempt of a
        # write whose reply was lost comes at most one socket_timeout (the lost answer) plus one
        # (a new connection) after the first, and must still find the write it recognises.
        self.expiry_grace = 2 * self.socket_timeout + 1.0
        self.client_name = client_name
        self.allow_eviction = allow_eviction
        self.closed = False
        self._lock = threading.Lock()
        self._subscriber: _Subscriber | None = None
        reset_in_children(self)
        self.pool = redis.ConnectionPool.from_url(url, **self.connection_options(Retry))
        self.client = redis.Redis(connection_pool=self.pool)
        try:
            self.client.ping()
            self._check_eviction(*_eviction_policy(self.client))
            for text in _SCRIPTS:
                self.client.script_load(text)
        except EvictionPolicyRefused:
            self.pool.disconnect()
            raise
        except (RedisError, OSError) as exc:
            self.pool.disconnect()
            raise _store_error(f"open {self.safe_url}", exc) from exc
        except TypeError as exc:
            # redis-py hands a query parameter it does not know to its connection class, which
            # refuses it when the first connection is made.
            self.pool.disconnect()
            raise ValueError(f"Redis ledger URL {self.safe_url}: {exc}") from None

    def _check_eviction(self, policy: str | None, why: str) -> None:
        """Refuse a server that may evict records, unless ``allow_eviction`` accepts it."""
        if policy == _SAFE_POLICY:
            return
        consequence = (
            "an evicted claim or outcome lets a retry run the work again, an UNSAFE tool included"
        )
        if policy is None:
            risk = f"its maxmemory-policy cannot be read ({why})"
            remedy = "Let the ledger's user read it (ACL: +info), and make sure it is noeviction"
        else:
            risk = f"maxmemory-policy is {policy}, which lets Redis evict the ledger's records"
            remedy = (
                "Set it to noeviction: CONFIG SET maxmemory-policy noeviction, and "
                "maxmemory-policy noeviction in redis.conf to keep it across restarts (on "
                "managed Redis, in the server's parameters)"
            )
        if self.allow_eviction:
            log.warning(
                "Redis ledger %s: %s, and allow_eviction=1 accepts it: %s.",
                self.safe_url,
                risk,
                consequence,
            )
            return
        raise EvictionPolicyRefused(
            f"Redis ledger {self.safe_url}: {risk}; {consequence}. {remedy}; or add "
            "allow_eviction=1 to the ledger URL to accept the risk."
        )

    def connection_options(self, retry: type[Retry] | type[AsyncRetry]) -> dict[str, Any]:
        options: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "health_check_interval": 0,
            # The store decides what is sent again after a lost connection: never redis-py.
            "retry": retry(NoBackoff(), 0),
        }
        if not self.url.lower().startswith("unix:"):
            options["socket_keepalive"] = True  # a TCP option: a Unix socket refuses it
        if self.client_name is not None:
            options["client_name"] = self.client_name
        return options

    @property
    def safe_url(self) -> str:
        """The URL with its secrets shown as ``***`` (see :func:`twiceshy.stores.redacted_url`)."""
        return redacted_url(self.url)

    # -- names and arguments (no I/O) -------------------------------------------------------

    def names(self, namespace: str, key: str) -> tuple[str, str]:
        """The record's hash and its wake channel."""
        tag = f"{self.prefix}:{{{_quote(namespace)}:{_quote(key)}}}"
        return f"{tag}:rec", f"{tag}:wake"

    def channel(self, namespace: str, key: str) -> bytes:
        """The record's wake channel, as the subscriber matches it."""
        try:
            return self.names(namespace, key)[1].encode()
        except UnicodeError as exc:
            raise _store_error("wait", exc) from exc

    def counts_name(self, namespace: str) -> str:
        """The hash of a namespace's call counts (outside every record's pattern)."""
        return f"{self.prefix}:counts:{{{_quote(namespace)}}}"

    def pattern(self, namespace: str | None) -> str:
        """A SCAN pattern for the records of one namespace, or of every namespace."""
        inner = "*" if namespace is None else f"{_quote(namespace)}:*"
        return f"{_glob_escape(self.prefix)}:{{{inner}}}:rec"

    def now_arg(self) -> str:
        return "" if self.clock is None else repr(float(self.clock()))

    def claim_args(
        self,
        namespace: str,
        key: str,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
    ) -> list[str]:
        now = self.now_arg()
        return [now, namespace, key, fingerprint, tool, effect.value, owner, repr(float(lease))]

    def write_args(self, channel: str, change: Change, write_id: str) -> list[str]:
        states = "," + ",".join(sorted(s.value for s in change.from_states)) + ","
        return [
            self.now_arg(),
            write_id,
            channel,
            str(int(change.fence)),
            states,
            change.to.value,
            _opt(change.owner),
            "1" if change.lapsed else "0",
            _opt(change.new_owner),
            _num(change.lease),
            "1" if change.count_attempt else "0",
            _opt(change.result),
            _opt(change.error),
            _opt(change.reason),
            _num(change.ttl),
            _num(self.expiry_grace) if self.clock is None else "",
        ]

    def scan_now(self, server_time: tuple[int, int] | None) -> float:
        if server_time is None:
            return float(cast(Callable[[], float], self.clock)())
        seconds, micros = server_time
        return seconds + micros / 1_000_000

    def check_replicas(self, what: str, acked: object) -> None:
        if not isinstance(acked, int) or acked < self.wait_replicas:
            raise StoreError(
                f"Redis ledger: the {what} took effect on the primary, but only {acked} of "
                f"{self.wait_replicas} replicas acknowledged it within {self.wait_ms} ms; a "
                "failover now could lose it"
            )

    # -- the subscriber ---------------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise StoreError(f"Redis ledger {self.safe_url} is closed")

    def _after_fork_in_child(self) -> None:
        """In a forked child: a lock no parent thread holds, and no parent's subscriber.

        The parent's reader thread does not exist here, and its lock may have been held at the
        fork. Its connection is left alone, never closed from here (redis-py shuts down no
        socket of another process); the child's first waiter starts a subscriber of its own.
        """
        self._lock = threading.Lock()
        self._subscriber = None

    def subscriber(self) -> _Subscriber:
        with self._lock:
            self.check_open()
            if self._subscriber is None:
                pool = self.pool

                def connect() -> _PubSubConnection:
                    return cast(_PubSubConnection, pool.connection_class(**pool.connection_kwargs))

                self._subscriber = _Subscriber(connect, "twiceshy-redis-subscriber")
            return self._subscriber

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            subscriber.close(self.socket_timeout + 1.0)
        self.client.close()
        self.pool.disconnect()


# -- the blocking store ---------------------------------------------------------------------


class RedisStore:
    """A :class:`~twiceshy.stores.Store` on a Redis server (redis-py, blocking).

    Thread-safe: one store serves every thread of a process (a pool of connections).

    Args:
        url: ``redis://host:port/db``, ``rediss://...`` or ``unix:///path.sock`` (redis-py's
            query options allowed; twiceshy's own go through :meth:`from_url`).
        prefix: the first part of every key; it must not contain braces.
        clock: the store's clock (seconds since the epoch); ``None`` uses the server's ``TIME``.
        socket_timeout: how long to wait to connect, and for any answer.
        wait_replicas: after each claim and write that took effect, wait until this many
            replicas acknowledged it (``WAIT``), else raise :class:`~twiceshy.StoreError`.
        wait_timeout: how long ``WAIT`` may take; shorter than ``socket_timeout`` when
            ``wait_replicas`` is set.
        reread_interval: how often a waiter re-reads the record when no wake-up arrives.
        client_name: the name of every connection (``CLIENT SETNAME``), for operators.
        allow_eviction: open even where the server's ``maxmemory-policy`` may evict records
            (or cannot be read), logging a WARNING: an evicted claim or outcome lets a retry
            run the work again (see "Eviction" in the module's docstring).

    Raises:
        StoreUnavailable: the server does not answer ``PING`` within ``socket_timeout``.
        EvictionPolicyRefused: the server may evict records, and ``allow_eviction`` is not set.
        StoreError: the server answers, but refuses (authentication, scripts disabled...).
        ValueError: a setting is out of range, or the URL carries twiceshy options.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "twiceshy",
        clock: Callable[[], float] | None = None,
        socket_timeout: float | timedelta = 5.0,
        wait_replicas: int = 0,
        wait_timeout: float | timedelta = 1.0,
        reread_interval: float | timedelta = 1.0,
        client_name: str | None = None,
        allow_eviction: bool = False,
    ) -> None:
        self._core = _Core(
            url,
            prefix=prefix,
            clock=clock,
            socket_timeout=socket_timeout,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
            reread_interval=reread_interval,
            client_name=client_name,
            allow_eviction=allow_eviction,
        )
        client = self._core.client
        self._claim = client.register_script(CLAIM_SCRIPT)
        self._write = client.register_script(WRITE_SCRIPT)
        self._read = client.register_script(READ_SCRIPT)
        self._purge = client.register_script(PURGE_SCRIPT)

    @classmethod
    def from_url(cls, url: str, *, clock: Callable[[], float] | None = None) -> RedisStore:
        """Open the store a URL names, with twiceshy's options in its query.

        ``prefix``, ``wait_replicas``, ``wait_timeout``, ``reread_interval`` and
        ``allow_eviction`` (``1`` or ``0``) are taken out of the query; the rest is redis-py's
        (e.g. ``client_name``, ``socket_timeout``).

        Raises:
            ValueError: an option has no valid value.
            StoreUnavailable: the server cannot be reached.
            EvictionPolicyRefused: the server may evict records (see "Eviction").
        """
        redis_url, options = split_url(url)
        return cls(redis_url, clock=clock, **options)

    def __repr__(self) -> str:
        return f"RedisStore({self._core.safe_url!r}, prefix={self._core.prefix!r})"

    @property
    def prefix(self) -> str:
        """The first part of every key of this store."""
        return self._core.prefix

    def key_names(self, namespace: str, key: str) -> tuple[str, str]:
        """The Redis names of a record: its hash and its wake-up channel."""
        return self._core.names(namespace, key)

    # -- I/O ---------------------------------------------------------------------------------

    def _run(self, what: str, op: Callable[[], T]) -> T:
        """Run ``op``; after a lost connection, once more on a fresh one (see "Lost replies")."""
        self._core.check_open()
        try:
            return op()
        except (RedisConnectionError, RedisTimeoutError):
            pass  # every command sent here is safe to send again; see the module docstring
        except (RedisError, UnicodeError) as exc:
            raise _store_error(what, exc) from exc
        try:
            return op()
        except (RedisError, UnicodeError) as exc:
            raise _store_error(what, exc) from exc

    def _eval(self, script: Script, key: str, args: list[str], what: str) -> Any:
        """Run a script that may change the record; ``WAIT`` for replicas when asked to."""
        core = self._core
        if core.wait_replicas == 0:
            return script(keys=[key], args=args)
        for attempt in (1, 2):
            pipe = core.client.pipeline(transaction=False)
            pipe.evalsha(script.sha, 1, key, *args)
            pipe.wait(core.wait_replicas, core.wait_ms)
            try:
                reply, acked = pipe.execute()
            except NoScriptError:
                if attempt == 2:
                    raise
                script.sha = core.client.script_load(script.script)
                continue
            if _snapshot(reply).won:
                core.check_replicas(what, acked)
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the Store protocol -----------------------------------------------------------------

    def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
    ) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`: one ``EVALSHA`` of :data:`CLAIM_SCRIPT`."""

        def op() -> Snapshot:
            rec, _ = self._core.names(namespace, key)
            args = self._core.claim_args(namespace, key, fingerprint, tool, effect, owner, lease)
            return _snapshot(self._eval(self._claim, rec, args, "claim"))

        return self._run("claim", op)

    def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`: one ``EVALSHA`` of :data:`WRITE_SCRIPT`."""
        write_id = secrets.token_hex(12)  # the same on the second attempt: it recognises itself

        def op() -> Snapshot:
            rec, channel = self._core.names(namespace, key)
            args = self._core.write_args(channel, change, write_id)
            return _snapshot(self._eval(self._write, rec, args, "write"))

        return self._run("write", op)

    def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`: one ``EVALSHA`` of :data:`READ_SCRIPT`."""

        def op() -> Snapshot:
            rec, _ = self._core.names(namespace, key)
            return _snapshot(self._read(keys=[rec], args=[self._core.now_arg()]))

        return self._run("read", op)

    def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`.

        Subscribes to the record's wake channel, re-reads once subscribed, then sleeps until a
        wake-up, the re-read interval, or the timeout.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout <= 0:
            return self.get(namespace, key)
        core = self._core
        channel = core.channel(namespace, key)
        watch = _ThreadWatch()
        with core.subscriber().watching(channel, watch):
            while True:
                watch.woken.clear()
                left = deadline - time.monotonic()
                # Read only once subscribed (no lost wake-up); unsubscribed, read every interval.
                confirmed = watch.confirmed.wait(max(0.0, min(left, core.reread)))
                snap = self.get(namespace, key)
                left = deadline - time.monotonic()
                if _settled(snap, fence) or left <= 0:
                    return snap
                if confirmed:
                    watch.woken.wait(min(left, core.reread))

    def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`twiceshy.stores.Store.records`.

        A ``SCAN`` over the namespace's keys: meant for operators, its cost grows with the
        whole keyspace of the database.
        """

        def op() -> list[Record]:
            core = self._core
            # SCAN ends after one pass over the keyspace; names are read in batches.
            names = list(core.client.scan_iter(match=core.pattern(namespace), count=_SCAN_COUNT))
            found: list[Record] = []
            for start in range(0, len(names), _SCAN_COUNT):
                found += self._hashes(names[start : start + _SCAN_COUNT])
            now = core.scan_now(core.client.time() if core.clock is None else None)
            return _select(found, namespace, now, states, tool, limit)

        return self._run("records", op)

    def _hashes(self, names: list[Any]) -> list[Record]:
        if not names:
            return []
        pipe = self._core.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        return _readable(names, pipe.execute(raise_on_error=False))

    def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`twiceshy.stores.Store.purge_expired`.

        On the server's clock Redis expires outcomes itself; this finds what a caller's clock
        has expired (and any outcome Redis has not yet reclaimed).
        """

        def op() -> int:
            core = self._core
            names = list(core.client.scan_iter(match=core.pattern(namespace), count=_SCAN_COUNT))
            count = 0
            for start in range(0, len(names), _SCAN_COUNT):
                count += self._purge_batch(names[start : start + _SCAN_COUNT])
            return count

        return self._run("purge", op)

    def _purge_batch(self, names: list[Any]) -> int:
        core = self._core
        for attempt in (1, 2):
            pipe = core.client.pipeline(transaction=False)
            for name in names:
                pipe.evalsha(self._purge.sha, 1, name, core.now_arg())
            try:
                return sum(int(n) for n in pipe.execute())
            except NoScriptError:
                if attempt == 2:
                    raise
                self._purge.sha = core.client.script_load(PURGE_SCRIPT)
        raise AssertionError("unreachable")  # pragma: no cover

    def add_counts(self, namespace: str, counts: Mapping[tuple[str, str], int]) -> None:
        """See :meth:`twiceshy.stores.CallCounts.add_counts`: ``HINCRBY``s in one ``MULTI``.

        Not sent again after a lost connection (it may have been applied): the error is raised,
        and whether to send these counts again is the caller's choice.
        """
        core = self._core
        core.check_open()
        if not counts:
            return
        name = core.counts_name(namespace)
        try:
            pipe = core.client.pipeline(transaction=True)
            for (tool, outcome), n in counts.items():
                pipe.hincrby(name, json.dumps([tool, outcome]), n)
            pipe.execute()
        except (RedisError, UnicodeError) as exc:
            raise _store_error("count", exc) from exc

    def counts(self, namespace: str) -> dict[tuple[str, str], int]:
        """See :meth:`twiceshy.stores.CallCounts.counts`."""

        def op() -> dict[tuple[str, str], int]:
            found = self._core.client.hgetall(self._core.counts_name(namespace))
            out: dict[tuple[str, str], int] = {}
            for field, n in found.items():
                tool, outcome = json.loads(field)
                out[(str(tool), str(outcome))] = int(n)
            return out

        return self._run("counts", op)

    def close(self) -> None:
        """Stop the subscriber and close every connection (idempotent).

        An :class:`AsyncRedisStore` opened with it by :func:`open_redis` closes with it.
        """
        self._core.close()


# -- the async store ------------------------------------------------------------------------


class _LoopClient:
    """The ``redis.asyncio`` client of one event loop, closed when that loop shuts down."""

    __slots__ = ("claim", "client", "guard", "purge", "read", "write")

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.claim = client.register_script(CLAIM_SCRIPT)
        self.write = client.register_script(WRITE_SCRIPT)
        self.read = client.register_script(READ_SCRIPT)
        self.purge = client.register_script(PURGE_SCRIPT)
        self.guard: AsyncGenerator[None, None] | None = None


async def _close_with_loop(client: redis.asyncio.Redis) -> AsyncGenerator[None, None]:
    """An async generator whose end closes ``client``.

    Event loops close the async generators started on them when they shut down
    (``asyncio.run`` does), so a client left open by its user is closed on its own loop, where
    its connections live, instead of leaking them when the loop goes away.
    """
    try:
        yield
    finally:
        await client.aclose()


class AsyncRedisStore:
    """An :class:`~twiceshy.stores.AsyncStore` on a Redis server (``redis.asyncio``).

    The arguments are those of :class:`RedisStore`; the constructor blocks (at most
    ``socket_timeout``) to check that the server answers. Each event loop gets its own
    connection pool, closed when that loop shuts down (``asyncio.run`` does this) or by
    :meth:`close`. Waiters share one subscriber thread with the store's other waiters.

    Raises:
        StoreUnavailable: the server does not answer ``PING`` within ``socket_timeout``.
        EvictionPolicyRefused: the server may evict records, and ``allow_eviction`` is not set.
        ValueError: a setting is out of range.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "twiceshy",
        clock: Callable[[], float] | None = None,
        socket_timeout: float | timedelta = 5.0,
        wait_replicas: int = 0,
        wait_timeout: float | timedelta = 1.0,
        reread_interval: float | timedelta = 1.0,
        client_name: str | None = None,
        allow_eviction: bool = False,
    ) -> None:
        core = _Core(
            url,
            prefix=prefix,
            clock=clock,
            socket_timeout=socket_timeout,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
            reread_interval=reread_interval,
            client_name=client_name,
            allow_eviction=allow_eviction,
        )
        self._setup(core, owns_core=True)

    def _setup(self, core: _Core, *, owns_core: bool) -> None:
        self._core = core
        self._owns_core = owns_core
        self._clients: dict[asyncio.AbstractEventLoop, _LoopClient] = {}
        self._clients_lock = threading.Lock()
        self._inherited: list[_LoopClient] = []
        reset_in_children(self)

    def _after_fork_in_child(self) -> None:
        """In a forked child: a lock no parent thread holds, and none of the parent's clients.

        redis.asyncio does not tell processes apart, so a child on a loop of its parent's would
        share the parent's sockets. They are kept, unused and never closed: closing them from
        here (their loop's async generators would, once collected) could end the parent's
        sessions (a TLS close).
        """
        self._clients_lock = threading.Lock()
        self._inherited += self._clients.values()
        self._clients = {}

    @classmethod
    def from_url(cls, url: str, *, clock: Callable[[], float] | None = None) -> AsyncRedisStore:
        """Open the store a URL names, with twiceshy's options in its query (see
        :meth:`RedisStore.from_url`)."""
        redis_url, options = split_url(url)
        return cls(redis_url, clock=clock, **options)

    @classmethod
    def twin(cls, store: RedisStore) -> AsyncRedisStore:
        """An async store sharing ``store``'s settings and subscriber; closed with it."""
        twin = cls.__new__(cls)
        twin._setup(store._core, owns_core=False)
        return twin

    def __repr__(self) -> str:
        return f"AsyncRedisStore({self._core.safe_url!r}, prefix={self._core.prefix!r})"

    async def _loop_client(self) -> _LoopClient:
        self._core.check_open()
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            entry = self._clients.get(loop)
            if entry is not None:
                return entry
            for old in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[old]
            core = self._core
            pool = redis.asyncio.ConnectionPool.from_url(
                core.url, **core.connection_options(AsyncRetry)
            )
            entry = self._clients[loop] = _LoopClient(redis.asyncio.Redis.from_pool(pool))
        guard = _close_with_loop(entry.client)
        await anext(guard)
        entry.guard = guard
        return entry

    async def _run(self, what: str, op: Callable[[_LoopClient], Awaitable[T]]) -> T:
        """Run ``op``; after a lost connection, once more on a fresh one (see "Lost replies")."""
        entry = await self._loop_client()
        try:
            return await op(entry)
        except (RedisConnectionError, RedisTimeoutError):
            pass  # every command sent here is safe to send again; see the module docstring
        except (RedisError, UnicodeError) as exc:
            raise _store_error(what, exc) from exc
        try:
            return await op(entry)
        except (RedisError, UnicodeError) as exc:
            raise _store_error(what, exc) from exc

    async def _eval(
        self, entry: _LoopClient, script: Any, key: str, args: list[str], what: str
    ) -> Any:
        core = self._core
        if core.wait_replicas == 0:
            return await script(keys=[key], args=args)
        for attempt in (1, 2):
            pipe = entry.client.pipeline(transaction=False)
            pipe.evalsha(script.sha, 1, key, *args)
            pipe.wait(core.wait_replicas, core.wait_ms)
            try:
                reply, acked = await pipe.execute()
            except NoScriptError:
                if attempt == 2:
                    raise
                script.sha = await entry.client.script_load(script.script)
                continue
            if _snapshot(reply).won:
                core.check_replicas(what, acked)
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def claim(
        self,
        namespace: str,
        key: str,
        *,
        fingerprint: str,
        tool: str,
        effect: Effect,
        owner: str,
        lease: float,
    ) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.claim`."""
        core = self._core

        async def op(entry: _LoopClient) -> Snapshot:
            rec, _ = core.names(namespace, key)
            args = core.claim_args(namespace, key, fingerprint, tool, effect, owner, lease)
            return _snapshot(await self._eval(entry, entry.claim, rec, args, "claim"))

        return await self._run("claim", op)

    async def write(self, namespace: str, key: str, change: Change) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.write`."""
        core = self._core
        write_id = secrets.token_hex(12)

        async def op(entry: _LoopClient) -> Snapshot:
            rec, channel = core.names(namespace, key)
            args = core.write_args(channel, change, write_id)
            return _snapshot(await self._eval(entry, entry.write, rec, args, "write"))

        return await self._run("write", op)

    async def get(self, namespace: str, key: str) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.get`."""
        core = self._core

        async def op(entry: _LoopClient) -> Snapshot:
            rec, _ = core.names(namespace, key)
            return _snapshot(await entry.read(keys=[rec], args=[core.now_arg()]))

        return await self._run("read", op)

    async def wait(self, namespace: str, key: str, fence: int, timeout: float) -> Snapshot:
        """See :meth:`twiceshy.stores.Store.wait`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        if timeout <= 0:
            return await self.get(namespace, key)
        core = self._core
        channel = core.channel(namespace, key)
        watch = _LoopWatch(loop)
        with core.subscriber().watching(channel, watch):
            while True:
                watch.woken.clear()
                left = deadline - loop.time()
                # Read only once subscribed (no lost wake-up); unsubscribed, read every interval.
                if not watch.confirmed.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            watch.confirmed.wait(), max(0.0, min(left, core.reread))
                        )
                confirmed = watch.confirmed.is_set()
                snap = await self.get(namespace, key)
                left = deadline - loop.time()
                if _settled(snap, fence) or left <= 0:
                    return snap
                if confirmed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(watch.woken.wait(), min(left, core.reread))

    async def records(
        self,
        namespace: str,
        *,
        states: Iterable[State] | None = None,
        tool: str | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """See :meth:`RedisStore.records`."""
        core = self._core

        async def op(entry: _LoopClient) -> list[Record]:
            client = entry.client
            names = [
                n async for n in client.scan_iter(match=core.pattern(namespace), count=_SCAN_COUNT)
            ]
            found: list[Record] = []
            for start in range(0, len(names), _SCAN_COUNT):
                batch = names[start : start + _SCAN_COUNT]
                pipe = client.pipeline(transaction=False)
                for name in batch:
                    pipe.hgetall(name)
                found += _readable(batch, await pipe.execute(raise_on_error=False))
            now = core.scan_now(await client.time() if core.clock is None else None)
            return _select(found, namespace, now, states, tool, limit)

        return await self._run("records", op)

    async def purge_expired(self, namespace: str | None = None) -> int:
        """See :meth:`RedisStore.purge_expired`."""
        core = self._core

        async def op(entry: _LoopClient) -> int:
            client = entry.client
            names = [
                n async for n in client.scan_iter(match=core.pattern(namespace), count=_SCAN_COUNT)
            ]
            count = 0
            for name in names:
                count += int(await entry.purge(keys=[name], args=[core.now_arg()]))
            return count

        return await self._run("purge", op)

    async def close(self) -> None:
        """Close this loop's connections; a store opened on its own also stops its subscriber.

        Pools of other event loops close when their loops shut down.
        """
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            entry = self._clients.pop(loop, None)
        if entry is not None and entry.guard is not None:
            await entry.guard.aclose()
        if self._owns_core:
            await asyncio.to_thread(self._core.close)


def open_redis(url: str) -> tuple[RedisStore, AsyncRedisStore]:
    """Open the blocking and async stores a ``redis://`` URL names, sharing one subscriber.

    Closing the blocking store closes the pair.

    Raises:
        ValueError: a twiceshy option in the URL has no valid value.
        StoreUnavailable: the server does not answer.
        EvictionPolicyRefused: the server may evict records, and the URL does not accept it.
    """
    store = RedisStore.from_url(url)
    return store, AsyncRedisStore.twin(store)
