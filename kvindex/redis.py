"""The shared prefix index in Redis: every gateway replica sees the same cached prefixes.

Layout (all keys under one `{prefix}` hash tag, so a Redis Cluster keeps them in one slot and the Lua
scripts may touch any of them; no prompt text is ever stored, only 64-bit block hashes):
- `{prefix}:<model>:<block_size>:<hash as 16 hex>`: a hash, field = backend id, value = expiry in
  epoch milliseconds. The key's own TTL is refreshed on every write.
- `{prefix}:backend:<backend id>`: a sorted set of the block keys that backend holds, scored by the time
  they were recorded (head of a prompt scored newest, so the tail is evicted first); it enforces the
  backend's capacity in blocks and lets `clear_backend` find its entries. It has a TTL too.

`match` is ONE `EVALSHA` round trip: the script walks the prompt's blocks in order, asking each block's
hash only for the backends still matching (HMGET), and stops when none is left. Values read back are
validated in the script (an expiry must be a number within now + TTL; anything else counts as absent)
and the reply is validated again here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvindex.memory import DEFAULT_CAPACITY_BLOCKS

_MATCH = """
local now = tonumber(ARGV[1])
local horizon = now + tonumber(ARGV[2])
local ids, counts, alive = {}, {}, {}
for i = 3, #ARGV do
  ids[#ids + 1] = ARGV[i]
  counts[#counts + 1] = 0
  alive[#alive + 1] = #ids
end
for depth = 1, #KEYS do
  local fields = {}
  for j = 1, #alive do fields[j] = ids[alive[j]] end
  local values = redis.pcall('HMGET', KEYS[depth], unpack(fields))
  if type(values) ~= 'table' or values.err then break end
  local still = {}
  for j = 1, #alive do
    local expiry = tonumber(values[j])
    if expiry and expiry > now and expiry <= horizon then
      counts[alive[j]] = depth
      still[#still + 1] = alive[j]
    end
  end
  alive = still
  if #alive == 0 then break end
end
return counts
"""

_RECORD = """
local backend, now, ttl, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local zset, n = KEYS[1], #KEYS
for i = 2, n do
  local key = KEYS[i]
  local written = redis.pcall('HSET', key, backend, now + ttl)
  if type(written) == 'table' and written.err then
    redis.call('DEL', key)  -- not a hash (foreign or corrupt value): replace it
    redis.call('HSET', key, backend, now + ttl)
  end
  redis.call('PEXPIRE', key, ttl)
  redis.call('ZADD', zset, now + (n - i) / n, key)
end
redis.call('PEXPIRE', zset, ttl)
local function forget(keys)
  for _, key in ipairs(keys) do redis.pcall('HDEL', key, backend) end
end
forget(redis.call('ZRANGEBYSCORE', zset, '-inf', now - ttl))
redis.call('ZREMRANGEBYSCORE', zset, '-inf', now - ttl)
local size = redis.call('ZCARD', zset)
if size > cap then
  forget(redis.call('ZRANGE', zset, 0, size - cap - 1))
  redis.call('ZREMRANGEBYRANK', zset, 0, size - cap - 1)
end
return size
"""

_REMOVE = """
for i = 2, #KEYS do
  redis.pcall('HDEL', KEYS[i], ARGV[1])
  redis.call('ZREM', KEYS[1], KEYS[i])
end
return #KEYS - 1
"""

# Clears at most ARGV[2] entries per call so one call never blocks Redis for long.
_CLEAR = """
local keys = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
for _, key in ipairs(keys) do redis.pcall('HDEL', key, ARGV[1]) end
if #keys > 0 then redis.call('ZREM', KEYS[1], unpack(keys)) end
return #keys
"""

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
        self, model: str, block_size: int, hashes: Sequence[int], backend_ids: Sequence[str]
    ) -> list[int]:
        if not hashes or not backend_ids:
            return [0] * len(backend_ids)
        keys = self._block_keys(model, block_size, hashes)
        reply = await self._match(keys=keys, args=[_now_ms(), self._ttl_ms, *backend_ids])
        return _validated_counts(reply, len(backend_ids), len(hashes))

    async def record(self, model: str, block_size: int, hashes: Sequence[int], backend_id: str) -> None:
        if not hashes:
            return
        capacity = self._capacities.get(backend_id, self._default_capacity)
        keys = [self._backend_key(backend_id), *self._block_keys(model, block_size, hashes)]
        await self._record(keys=keys, args=[backend_id, _now_ms(), self._ttl_ms, capacity])

    async def remove(self, model: str, block_size: int, hashes: Sequence[int], backend_id: str) -> None:
        if hashes:
            keys = [self._backend_key(backend_id), *self._block_keys(model, block_size, hashes)]
            await self._remove(keys=keys, args=[backend_id])

    async def clear_backend(self, backend_id: str) -> None:
        zset = self._backend_key(backend_id)
        while await self._clear(keys=[zset], args=[backend_id, _CLEAR_BATCH]):
            pass

    async def close(self) -> None:
        await self._client.aclose()

    def _block_keys(self, model: str, block_size: int, hashes: Sequence[int]) -> list[str]:
        space = f"{self._prefix}:{model}:{block_size}:"
        return [f"{space}{h:016x}" for h in hashes]

    def _backend_key(self, backend_id: str) -> str:
        return f"{self._prefix}:backend:{backend_id}"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _validated_counts(reply: object, n_backends: int, n_blocks: int) -> list[int]:
    if not isinstance(reply, list) or len(reply) != n_backends:
        raise InvalidReply("match reply has the wrong shape")
    if not all(type(c) is int and 0 <= c <= n_blocks for c in reply):
        raise InvalidReply("match reply holds an out-of-range count")
    return reply
