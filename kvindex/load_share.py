"""Per-backend load shared by every gateway process and replica through Redis, so they balance as one.

Each replica publishes, every `interval_s`, how many requests it has in flight on each backend, and
reads what every other live replica published: ONE `EVALSHA` round trip per interval, off the request
path (a request never waits on Redis for this). Layout, under the deployment's `{prefix}` hash tag:

- `{prefix}:load:replicas`: a sorted set, replica id -> the time (ms) it last published;
- `{prefix}:load:<replica id>`: a hash, backend id -> that replica's in-flight count.

A replica's hash expires `ttl_s` after its last publication and its entry in the set is dropped at
the first publication of anyone after that, so a crashed replica's counts fade within `ttl_s`. The
clock is Redis's own (`TIME`), so replicas need no agreement on time.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

_PUBLISH = """
local replicas, own, me = KEYS[1], KEYS[2], ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('DEL', own)
if #ARGV > 3 then
  redis.call('HSET', own, unpack(ARGV, 3, #ARGV))
  redis.call('PEXPIRE', own, ttl_ms)
end
redis.call('ZADD', replicas, now_ms, me)
redis.call('ZREMRANGEBYSCORE', replicas, '-inf', now_ms - ttl_ms)
redis.call('PEXPIRE', replicas, ttl_ms * 10)
local out = {}
local prefix = string.sub(own, 1, #own - #me)
for _, other in ipairs(redis.call('ZRANGE', replicas, 0, -1)) do
  if other ~= me then
    local fields = redis.call('HGETALL', prefix .. other)
    for i = 1, #fields, 2 do
      out[#out + 1] = fields[i]
      out[#out + 1] = fields[i + 1]
    end
  end
end
return out
"""


class LoadShare:
    def __init__(self, client: aioredis.Redis, key_prefix: str, replica_id: str, ttl_s: float) -> None:
        self._client = client
        prefix = "{" + key_prefix + "}:load:"
        self._keys = [prefix + "replicas", prefix + replica_id]
        self._replica = replica_id
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._publish = client.register_script(_PUBLISH)

    @classmethod
    def from_url(
        cls, url: str, key_prefix: str, replica_id: str, ttl_s: float, socket_timeout_s: float = 0.5
    ) -> LoadShare:
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, key_prefix, replica_id, ttl_s)

    async def exchange(self, own: Mapping[str, int]) -> dict[str, int]:
        """Publish this replica's in-flight counts; return the sum of every other live replica's."""
        args: list[str | int] = [self._replica, self._ttl_ms]
        for backend_id, count in own.items():
            if count:
                args += [backend_id, count]
        reply = await self._publish(keys=self._keys, args=args)
        others: dict[str, int] = {}
        for i in range(0, len(reply) - 1, 2):
            backend_id = reply[i].decode() if isinstance(reply[i], bytes) else str(reply[i])
            try:
                count = int(reply[i + 1])
            except ValueError:
                continue  # a value we did not write: ignore it rather than trust it
            if backend_id and 0 < count < 1_000_000:
                others[backend_id] = others.get(backend_id, 0) + count
        return others

    async def close(self) -> None:
        await self._client.aclose()
