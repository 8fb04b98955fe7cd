"""The shared prefix index in Redis: every gateway replica sees the same cached prefixes.

Layout (all keys under one `{prefix}` hash tag, so a Redis Cluster keeps them in one slot; no prompt
text is ever stored, only 64-bit block hashes). The scripts derive block keys from one packed argument
instead of declaring them in KEYS (redis-py spent 10+ ms encoding 2,000 key arguments): fine on a
single node and, thanks to the hash tag, within one cluster slot.
- `{prefix}:slots`: a hash, backend id -> its bit position ("slot"); `{prefix}:slots:next` (counter)
  and `{prefix}:slots:free` (slots of cleared backends, safe to reuse) go with it;
  `{prefix}:oldest`: backend id -> score of its oldest entry, so `match` expires only when needed.
- `{prefix}:<model>:<block_size>:<hash as 8 raw big-endian bytes>`: a bitmap (SETBIT), bit `slot` set
  when that backend holds the block. TTL refreshed on every write.
- `{prefix}:backend:<backend id>`: a sorted set of the block keys that backend holds, scored by the time
  they were recorded (head of a prompt scored newest, so the tail is evicted first). It carries the
  per-backend TTL and capacity (entries older than the TTL or beyond the capacity get their bit
  cleared) and lets `clear_backend` find its bits. It lives twice the TTL, so expired entries can still
  be found and cleared; if it is gone anyway while the slot is still mapped (its entries were never
  cleaned), the slot is retired and never reused, so stale bits can never be attributed to anyone.

`match` is ONE `EVALSHA` round trip. The script maps backend ids to slots, clears the requested
backends' expired entries, then walks the prompt's blocks in batches of 64: one BITOP AND (in C) tells
whether every backend still matching holds the whole batch; only a batch where some prefix ends is
read block by block (MGET), AND-ing each bitmap with the bits still alive, and the walk stops when no
bit is left. A hash per block with one field per backend was the first design: its walk costs one field
per backend per block and took seconds for a 32k-token prompt over 512 backends; see bench/index_bench.py.
Values read back are validated (slots must be integers in range; a block value that is not a string of
at most MAX_SLOTS/8 bytes counts as absent) and the reply is validated again here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.typing import EncodableT

from kvindex.hashing import BlockHashes
from kvindex.memory import DEFAULT_CAPACITY_BLOCKS

MAX_SLOTS = 65536  # backends ever mapped per key prefix; block bitmaps stay <= 8 KiB
_MGET_BATCH = 64  # blocks per BITOP/MGET batch inside the match script (Lua's unpack has a stack limit)

# Shared by every script. KEYS[1..4] are always: slots, slots:next, slots:free, oldest.
_COMMON = f"""
local SLOTS, NEXT, FREE, OLDEST = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local function valid_slot(value)
  local slot = tonumber(value)
  if slot and slot >= 0 and slot < {MAX_SLOTS} and slot == math.floor(slot) then return slot end
  return nil
end
local function forget(keys, slot)
  for _, key in ipairs(keys) do redis.pcall('SETBIT', key, slot, 0) end
end
local function note_oldest(zset, backend)
  local first = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  if first[2] then redis.call('HSET', OLDEST, backend, first[2]) else redis.call('HDEL', OLDEST, backend) end
end
-- Every bit of `slot` has been cleared: the slot may serve another backend.
local function release(backend, slot, ttl)
  redis.call('HDEL', SLOTS, backend)
  redis.call('HDEL', OLDEST, backend)
  redis.call('RPUSH', FREE, slot)
  redis.call('PEXPIRE', FREE, 2 * ttl)
end
local function block_key(space, blob, i)
  return space .. string.sub(blob, 8 * i - 7, 8 * i)
end
"""

# ARGV: now, ttl, backend-set prefix, key space, packed hashes, backend ids...
_MATCH = (
    _COMMON
    + f"""
local now, ttl, zprefix, space, blob = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local first_id = 6
local n_ids = #ARGV - first_id + 1
local counts, alive, owners, bytes = {{}}, {{}}, {{}}, {{}}
-- Small hashes are listpacks (linear lookups, up to 512 entries by default): for many ids, one
-- HGETALL pass beats HMGET's per-field scans (3 ms for 512 ids; see bench/index_bench.py).
local function fields_of(key)
  if n_ids <= 16 then return redis.call('HMGET', key, unpack(ARGV, first_id)) end
  local all, map, out = redis.call('HGETALL', key), {{}}, {{}}
  for j = 1, #all, 2 do map[all[j]] = all[j + 1] end
  for i = 1, n_ids do out[i] = map[ARGV[first_id + i - 1]] or false end
  return out
end
local mapped = fields_of(SLOTS)
local oldest = fields_of(OLDEST)
-- Expire lazily: only a backend whose oldest entry is past the TTL (or unknown) costs extra calls.
local function still_valid(id, slot, since)
  if since and since > now - ttl then return true end
  local zset = zprefix .. id
  local old = redis.call('ZRANGEBYSCORE', zset, '-inf', now - ttl, 'LIMIT', 0, 1000)
  if #old > 0 then
    forget(old, slot)
    redis.call('ZREM', zset, unpack(old))
  end
  if redis.call('EXISTS', zset) == 1 then
    note_oldest(zset, id)
    return true
  end
  if #old > 0 then
    release(id, slot, ttl)  -- we just cleared its last entries
  else
    redis.call('HDEL', SLOTS, id)  -- its set vanished uncleaned: retire the slot, never reuse it
    redis.call('HDEL', OLDEST, id)
  end
  return false
end
for i = 1, n_ids do
  counts[i] = 0
  local slot = valid_slot(mapped[i])
  if slot and still_valid(ARGV[first_id + i - 1], slot, tonumber(oldest[i])) then
    local b = math.floor(slot / 8) + 1
    if not alive[b] then
      alive[b] = 0
      bytes[#bytes + 1] = b
    end
    alive[b] = bit.bor(alive[b], 2 ^ (7 - slot % 8))
    owners[slot] = owners[slot] or {{}}
    table.insert(owners[slot], i)
  end
end
local function settle(b, dropped, depth)
  for j = 0, 7 do
    if bit.band(dropped, 2 ^ (7 - j)) ~= 0 then
      for _, i in ipairs(owners[(b - 1) * 8 + j]) do counts[i] = depth end
    end
  end
end
local n_blocks = #blob / 8
if #bytes == 0 then return counts end
local depth, done = 0, false
-- Fast path: BITOP AND over a whole batch (in C). If every alive bit survives the batch, nobody's
-- prefix ends inside it and its blocks need not be read one by one. An oversized (invalid) block value
-- makes the AND oversized too, which sends the batch down the validating slow path.
local scratch = SLOTS .. ':and'
local function batch_survives(names)
  local ok = redis.pcall('BITOP', 'AND', scratch, unpack(names))
  if type(ok) == 'table' and ok.err then return false end
  redis.call('PEXPIRE', scratch, 1000)  -- deleted below; the TTL only guards against a failed script
  local all = redis.call('GET', scratch)
  if not all or #all > {MAX_SLOTS // 8} then return false end
  for _, b in ipairs(bytes) do
    local mask = alive[b]
    if mask ~= 0 and bit.band(mask, string.byte(all, b) or 0) ~= mask then return false end
  end
  return true
end
local function block_by_block(values)
  for _, value in ipairs(values) do
    if type(value) ~= 'string' or #value > {MAX_SLOTS // 8} then value = '' end
    local any = false
    for _, b in ipairs(bytes) do
      local mask = alive[b]
      if mask ~= 0 then
        local held = bit.band(mask, string.byte(value, b) or 0)
        if held ~= mask then settle(b, bit.bxor(mask, held), depth) end
        alive[b] = held
        if held ~= 0 then any = true end
      end
    end
    if not any then
      done = true
      return
    end
    depth = depth + 1
  end
end
for batch = 0, n_blocks - 1, {_MGET_BATCH} do
  local names = {{}}
  for k = batch + 1, math.min(batch + {_MGET_BATCH}, n_blocks) do
    names[#names + 1] = block_key(space, blob, k)
  end
  if batch_survives(names) then
    depth = depth + #names
  else
    block_by_block(redis.call('MGET', unpack(names)))  -- a key of another type reads as nil
    if done then
      redis.call('DEL', scratch)
      return counts
    end
  end
end
redis.call('DEL', scratch)
for _, b in ipairs(bytes) do settle(b, alive[b], depth) end
return counts
"""
)

# KEYS[5] = the backend's set. ARGV: backend, now, ttl, capacity, key space, packed hashes.
_RECORD = (
    _COMMON
    + f"""
local backend, now, ttl, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local space, blob, zset = ARGV[5], ARGV[6], KEYS[5]
local slot = valid_slot(redis.call('HGET', SLOTS, backend))
if slot and redis.call('EXISTS', zset) == 0 then slot = nil end  -- vanished uncleaned: retire
if not slot then
  slot = valid_slot(redis.call('LPOP', FREE)) or (redis.call('INCR', NEXT) - 1)
  if slot >= {MAX_SLOTS} then return redis.error_reply('no free backend slot') end
  redis.call('HSET', SLOTS, backend, slot)
end
local n = #blob / 8
for i = 1, n do
  local key = block_key(space, blob, i)
  local written = redis.pcall('SETBIT', key, slot, 1)
  if type(written) == 'table' and written.err then
    redis.call('DEL', key)  -- not a bitmap (foreign or corrupt value): replace it
    redis.call('SETBIT', key, slot, 1)
  end
  redis.call('PEXPIRE', key, ttl)
  redis.call('ZADD', zset, now + (n - i) / n, key)  -- the head newest: the tail is evicted first
end
forget(redis.call('ZRANGEBYSCORE', zset, '-inf', now - ttl), slot)
redis.call('ZREMRANGEBYSCORE', zset, '-inf', now - ttl)
local size = redis.call('ZCARD', zset)
if size > cap then
  forget(redis.call('ZRANGE', zset, 0, size - cap - 1), slot)
  redis.call('ZREMRANGEBYRANK', zset, 0, size - cap - 1)
end
note_oldest(zset, backend)
for _, key in ipairs({{SLOTS, NEXT, FREE, OLDEST, zset}}) do redis.call('PEXPIRE', key, 2 * ttl) end
return size
"""
)

# KEYS[5] = the backend's set. ARGV: backend, ttl, key space, packed hashes.
_REMOVE = (
    _COMMON
    + """
local backend, ttl, space, blob, zset = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], KEYS[5]
local slot = valid_slot(redis.call('HGET', SLOTS, backend))
if not slot then return 0 end
for i = 1, #blob / 8 do
  local key = block_key(space, blob, i)
  redis.pcall('SETBIT', key, slot, 0)
  redis.call('ZREM', zset, key)
end
if redis.call('EXISTS', zset) == 0 then release(backend, slot, ttl) end
return #blob / 8
"""
)

# KEYS[5] = the backend's set. ARGV: backend, batch, ttl. Clears at most `batch` entries per call so
# one call never blocks Redis for long; the slot is released once all its bits are cleared.
_CLEAR = (
    _COMMON
    + """
local backend, batch, ttl, zset = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), KEYS[5]
local slot = valid_slot(redis.call('HGET', SLOTS, backend))
if not slot then
  redis.call('DEL', zset)
  redis.call('HDEL', OLDEST, backend)
  return 0
end
local keys = redis.call('ZRANGE', zset, 0, batch - 1)
if #keys > 0 then
  forget(keys, slot)
  redis.call('ZREM', zset, unpack(keys))
  return #keys
end
release(backend, slot, ttl)
return 0
"""
)

_CLEAR_BATCH = 5000


class InvalidReply(ValueError):
    """Redis answered something that is not a valid match result."""


class RedisIndex:
    """`PrefixIndex` over `redis.asyncio`; wrap it in `GuardedIndex` on the request path."""

    def __init__(
        self,
        client: aioredis.Redis,
        key_prefix: str = "hetgate",
        ttl_s: float = 600.0,
        capacity_blocks: Mapping[str, int] | None = None,
        default_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ) -> None:
        self._client = client
        self._prefix = "{" + key_prefix + "}"
        slots = self._prefix + ":slots"
        self._shared = [slots, slots + ":next", slots + ":free", self._prefix + ":oldest"]
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._capacities = dict(capacity_blocks or {})
        self._default_capacity = default_capacity_blocks
        self._match = client.register_script(_MATCH)
        self._record = client.register_script(_RECORD)
        self._remove = client.register_script(_REMOVE)
        self._clear = client.register_script(_CLEAR)

    @classmethod
    def from_url(cls, url: str, socket_timeout_s: float = 0.5, **kwargs: object) -> RedisIndex:
        """A client with every deadline set (redis-py's defaults wait forever) and no hidden retries."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=30,
        )
        return cls(client, **kwargs)  # type: ignore[arg-type]

    def set_capacity(self, backend_id: str, blocks: int) -> None:
        """Takes effect at the backend's next record."""
        self._capacities[backend_id] = blocks

    async def match(
        self, model: str, block_size: int, hashes: BlockHashes, backend_ids: Sequence[str]
    ) -> list[int]:
        if len(hashes) == 0 or not backend_ids:
            return [0] * len(backend_ids)
        space, blob = self._space(model, block_size), _pack(hashes)
        args: list[EncodableT] = [_now_ms(), self._ttl_ms, self._backend_key(""), space, blob, *backend_ids]
        reply = await self._match(keys=self._shared, args=args)
        return _validated_counts(reply, len(backend_ids), len(hashes))

    async def record(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        if len(hashes) == 0:
            return
        capacity = self._capacities.get(backend_id, self._default_capacity)
        args: list[EncodableT] = [
            backend_id,
            _now_ms(),
            self._ttl_ms,
            capacity,
            self._space(model, block_size),
            _pack(hashes),
        ]
        await self._record(keys=[*self._shared, self._backend_key(backend_id)], args=args)

    async def remove(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        if len(hashes):
            args: list[EncodableT] = [backend_id, self._ttl_ms, self._space(model, block_size), _pack(hashes)]
            await self._remove(keys=[*self._shared, self._backend_key(backend_id)], args=args)

    async def clear_backend(self, backend_id: str) -> None:
        keys = [*self._shared, self._backend_key(backend_id)]
        while await self._clear(keys=keys, args=[backend_id, _CLEAR_BATCH, self._ttl_ms]):
            pass

    async def close(self) -> None:
        await self._client.aclose()

    def _space(self, model: str, block_size: int) -> str:
        """Block keys are this prefix followed by the block hash as 8 raw big-endian bytes."""
        return f"{self._prefix}:{model}:{block_size}:"

    def _backend_key(self, backend_id: str) -> str:
        return f"{self._prefix}:backend:{backend_id}"


def _pack(hashes: BlockHashes) -> bytes:
    """All block hashes as one argument: building thousands of key arguments in redis-py cost more
    than the whole script (10+ ms for a 32k-token prompt)."""
    return np.asarray(hashes, dtype=">u8").tobytes()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _validated_counts(reply: object, n_backends: int, n_blocks: int) -> list[int]:
    if not isinstance(reply, list) or len(reply) != n_backends:
        raise InvalidReply("match reply has the wrong shape")
    if not all(type(c) is int and 0 <= c <= n_blocks for c in reply):
        raise InvalidReply("match reply holds an out-of-range count")
    return reply
