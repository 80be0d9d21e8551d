"""The Lua scripts that switch, renew, delete and describe one entry's versions atomically.

Each script touches one entry: its head and chunk keys, which share a hash tag and so one
Redis Cluster slot. Every key a script writes is passed in ``KEYS``, so Cluster routes a
script like any single-slot command and key-pattern ACLs apply as usual; only the describe
script builds key names, read-only: the chunk keys a head names, which nobody can know before
reading that head (they extend the head key, so they share its slot and its ACL pattern).
Heads are identified by their first ``HEADER_SIZE`` bytes, which carry the write's random id:
"the head is still the one I saw" is a byte comparison. Plain Lua 5.1 with no ``#!`` flags: Redis
>= 6.2, Valkey, and fakeredis with ``lupa``. No script allocates: values are written by plain
pipelined ``SET``s before, so a full Redis refuses those, never half a script.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from ec_redis.codec.format import (
    HEADER_SIZE,
    PART_BYTES_AT,
    PAYLOAD_LEN_AT,
    PRODUCER_LEN_AT,
    WRITE_ID_AT,
)
from ec_redis.tiers.layout import MAGIC_VERSION, MAX_CHUNKS, MIN_PART_BYTES, PROBE_BYTES

# swap replies: [SWAPPED] | [CONFLICT, head prefix, head length] | [INCOMPLETE, index]
# (index 0: the pending head, i: chunk i)
SWAPPED, CONFLICT, INCOMPLETE = 1, 0, 2
# delete replies: [DELETED, keys removed] | [CONFLICT, head prefix, head length]
DELETED = 1


def _lua_bytes(data: bytes) -> str:
    return '"' + "".join(f"\\{b}" for b in data) + '"'


_PRELUDE = f"""
local seen = redis.call('GETRANGE', KEYS[1], 0, {HEADER_SIZE - 1})
local function changed()
  return {{{CONFLICT}, redis.call('GETRANGE', KEYS[1], 0, {PROBE_BYTES - 1}),
          redis.call('STRLEN', KEYS[1])}}
end
"""

# Make a complete write the entry's current version. KEYS: head, the write's pending head,
# its n chunks, then the chunks of the version it replaces. ARGV: the head's first bytes as
# the writer saw them ("": any head without chunks), n, the entry's TTL in ms (0: none), the
# grace in ms, the channel to announce the entry on ("": none), the message, and the write's
# own head's first bytes: a head that already equals them means this very write was switched
# in by an earlier run whose reply was lost (redis-py then retried the call, which may have
# stored the write's keys again under the grace TTL), so the switch's TTLs are applied again
# and it answers SWAPPED. The new head
# value arrives by RENAME, not as an argument: a megabyte ARGV costs Redis milliseconds of Lua
# string handling, a RENAME nothing. The replaced chunks get the grace TTL, not an UNLINK: a
# reader may be fetching them right now. The announcement goes out in the same atomic step
# as the switch (last, and through pcall: a refused PUBLISH must not leave a half-done swap).
_SWAP = (
    _PRELUDE
    + f"""
local chunked = string.sub(seen, 1, 6) == {_lua_bytes(MAGIC_VERSION)}
  and #seen >= {PART_BYTES_AT + 8}
  and string.sub(seen, {PART_BYTES_AT + 1}, {PART_BYTES_AT + 8}) ~= {_lua_bytes(bytes(8))}
local n = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local function keep(first, last)
  for i = first, last do
    if i ~= 2 then
      if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
    end
  end
end
if seen == ARGV[7] then
  redis.call('UNLINK', KEYS[2])
  keep(1, n + 2)
  return {{{SWAPPED}}}
end
if (ARGV[1] == '' and chunked) or (ARGV[1] ~= '' and seen ~= ARGV[1]) then return changed() end
for i = 2, n + 2 do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {{{INCOMPLETE}, i - 2}} end
end
redis.call('RENAME', KEYS[2], KEYS[1])
keep(1, n + 2)
for i = n + 3, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
if ARGV[5] ~= '' then redis.pcall('PUBLISH', ARGV[5], ARGV[6]) end
return {{{SWAPPED}}}
"""
)

# Slide the TTL of the chunks a reader just read, only while their version is current (so a
# reader never extends the life of a replaced version). KEYS: head, chunks. ARGV: the head's
# first bytes as read, the TTL in ms.
_RENEW = f"""
if redis.call('GETRANGE', KEYS[1], 0, {HEADER_SIZE - 1}) ~= ARGV[1] then return 0 end
for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
return 1
"""

# Compare-and-delete: UNLINK the head and the chunks read only if the head is still the one
# read; a newer version is never touched. KEYS: head, chunks. ARGV: the head's first bytes.
_DELETE = (
    _PRELUDE
    + f"""
if seen ~= ARGV[1] then return changed() end
local removed = 0
for i = 1, #KEYS do removed = removed + redis.call('UNLINK', KEYS[i]) end
return {{{DELETED}, removed}}
"""
)


# Say whether an entry is whole without moving its bytes: the head's first PROBE_BYTES and its
# length, and whether every chunk that head names is there, as a string (a chunk evicted under
# allkeys-lru leaves a head that no reader can use). KEYS: the head. Reply: [prefix, head
# length, chunks checked, index of the first missing chunk or 0]; "checked" is -1 for a header
# no reader follows (the caller rejects it anyway), 0 for a one-value entry or a missing head.
# The chunk keys are KeyBuilder.chunk's names, <head>:<write id, 16 hex digits>:c<i>, and their
# count is layout.chunk_count's; the caller checks that count against its own. A head of a
# foreign type answers with its error (WRONGTYPE), for that key alone.
_DESCRIBE = f"""
local prefix = redis.pcall('GETRANGE', KEYS[1], 0, {PROBE_BYTES - 1})
if type(prefix) == 'table' then return prefix end
if #prefix < {HEADER_SIZE} or string.sub(prefix, 1, 6) ~= {_lua_bytes(MAGIC_VERSION)} then
  return {{prefix, 0, 0, 0}}
end
local function u64(at)
  local v = 0
  for i = at + 8, at + 1, -1 do v = v * 256 + string.byte(prefix, i) end
  return v
end
local len = redis.call('STRLEN', KEYS[1])
local part = u64({PART_BYTES_AT})
if part == 0 then return {{prefix, len, 0, 0}} end
local producer = string.byte(prefix, {PRODUCER_LEN_AT + 1})
  + 256 * string.byte(prefix, {PRODUCER_LEN_AT + 2})
local rest = {HEADER_SIZE} + producer + u64({PAYLOAD_LEN_AT}) - len
if part < {MIN_PART_BYTES} or rest <= 0 then return {{prefix, len, -1, 0}} end
local n = math.floor(rest / part)
if n * part < rest then n = n + 1 end
if n > {MAX_CHUNKS} then return {{prefix, len, -1, 0}} end
local id = ''
for i = {WRITE_ID_AT + 8}, {WRITE_ID_AT + 1}, -1 do
  id = id .. string.format('%02x', string.byte(prefix, i))
end
for i = 1, n do
  if redis.call('TYPE', KEYS[1] .. ':' .. id .. ':c' .. i)['ok'] ~= 'string' then
    return {{prefix, len, n, i}}
  end
end
return {{prefix, len, n, 0}}
"""


class Script:
    """A Lua script run by its SHA1 (``EVALSHA``), falling back to ``EVAL`` when the server
    does not know it yet (``NOSCRIPT``: first use, a restart, ``SCRIPT FLUSH``)."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def command(self, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """The ``EVALSHA`` command, for a pipeline or a raw connection."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def run(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.execute_command(*self.command(keys, args))
        except NoScriptError:
            return self.eval(client, keys, args)

    def eval(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run it sending its text (the server caches it for the next ``EVALSHA``)."""
        return client.execute_command("EVAL", self.text, len(keys), *keys, *args)


SWAP = Script("swap", _SWAP)
RENEW = Script("renew", _RENEW)
DELETE = Script("delete", _DELETE)
DESCRIBE = Script("describe", _DESCRIBE)


def is_noscript(reply: object) -> bool:
    """Whether a pipelined reply is the server's "I do not know this script"."""
    return isinstance(reply, NoScriptError) or (
        isinstance(reply, Exception) and str(reply).startswith("NOSCRIPT")
    )
