"""The Lua of the Redis ledger: every script it runs, and the contract of their keys and arguments.

Every script touches one key, ``KEYS[1]``, the record's hash, and ``ARGV[1]`` is always the clock:
``""`` reads the server's ``TIME``, anything else is the caller's clock in seconds. Each but
:data:`PURGE_SCRIPT` answers ``{won, now, record}``: ``won`` is ``"1"`` or ``"0"``, ``now`` the
clock the script used, then the record's hash as one JSON object of its fields as they are after
the script (no third item when there is no record). Numbers leave Lua only through
``string.format``: Lua's own ``tostring`` keeps 14 digits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Final

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
--       [6] effect, [7] owner, [8] lease (seconds), [9] the call's arguments (absent: none).
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
local fields = {
  'namespace', ARGV[2], 'key', ARGV[3], 'fingerprint', ARGV[4], 'tool', ARGV[5],
  'effect', ARGV[6], 'state', 'claimed', 'fence', int(fence), 'owner', ARGV[7],
  'lease_deadline', num(now + tonumber(ARGV[8])), 'attempts', '1',
  'created_at', num(now), 'updated_at', num(now)}
if ARGV[9] ~= nil then
  fields[#fields + 1] = 'args'
  fields[#fields + 1] = ARGV[9]
end
return reply('1', now, hset(KEYS[1], fields))
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


@dataclass(frozen=True, slots=True)
class Lua:
    """A script and its SHA-1, the name ``EVALSHA`` calls it by."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


CLAIM: Final = Lua(CLAIM_SCRIPT)
WRITE: Final = Lua(WRITE_SCRIPT)
READ: Final = Lua(READ_SCRIPT)
PURGE: Final = Lua(PURGE_SCRIPT)
SCRIPTS: Final = (CLAIM, WRITE, READ, PURGE)
"""Loaded when a store opens, so that a first call pays no ``NOSCRIPT`` detour."""
