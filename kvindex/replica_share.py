"""What every gateway process and replica shares through Redis, so they act as one: per-backend load
(`ReplicaShare.exchange`: in-flight counts) and what their routers learnt (`exchange_values`: calibration).

Each replica publishes, every interval, its own values, and reads what every other live replica
published: ONE `EVALSHA` round trip per interval and kind, off the request path (a request never waits
on Redis for this). Layout, under the deployment's `{prefix}` hash tag, per kind (`load`, or
`calibration:<model>`):

- `{prefix}:<kind>:replicas`: a sorted set, replica id -> the time (ms) it last published;
- `{prefix}:<kind>:<replica id>`: a hash, field -> that replica's value.

A replica's hash expires `ttl_s` after its last publication and its entry in the set is dropped at
the first publication of anyone after that, so a crashed replica's values fade within `ttl_s`. The
clock is Redis's own (`TIME`), so replicas need no agreement on time.
"""

from __future__ import annotations

import math
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


class ReplicaShare:
    def __init__(
        self, client: aioredis.Redis, key_prefix: str, replica_id: str, ttl_s: float, kind: str = "load"
    ) -> None:
        self._client = client
        self._key_prefix, self._ttl_s = key_prefix, ttl_s
        prefix = "{" + key_prefix + "}:" + kind + ":"
        self._keys = [prefix + "replicas", prefix + replica_id]
        self._replica = replica_id
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._publish = client.register_script(_PUBLISH)

    @classmethod
    def from_url(
        cls,
        url: str,
        key_prefix: str,
        replica_id: str,
        ttl_s: float,
        kind: str = "load",
        socket_timeout_s: float = 0.5,
    ) -> ReplicaShare:
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, key_prefix, replica_id, ttl_s, kind)

    def for_kind(self, kind: str) -> ReplicaShare:
        """The same replica sharing another kind of value over the same connection."""
        return ReplicaShare(self._client, self._key_prefix, self._replica, self._ttl_s, kind)

    async def exchange(self, own: Mapping[str, int]) -> dict[str, int]:
        """Publish this replica's in-flight counts; return the sum of every other live replica's."""
        others: dict[str, int] = {}
        for backend_id, value in await self._exchange({b: c for b, c in own.items() if c}):
            try:
                count = int(value)
            except ValueError:
                continue  # a value we did not write: ignore it rather than trust it
            if 0 < count < 1_000_000:
                others[backend_id] = others.get(backend_id, 0) + count
        return others

    async def exchange_values(self, own: Mapping[str, float]) -> dict[str, list[float]]:
        """Publish this replica's values; return every other live replica's, per field (finite ones)."""
        others: dict[str, list[float]] = {}
        for field, value in await self._exchange({f: repr(v) for f, v in own.items()}):
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                others.setdefault(field, []).append(number)
        return others

    async def _exchange(self, own: Mapping[str, str | int]) -> list[tuple[str, str]]:
        args: list[str | int] = [self._replica, self._ttl_ms]
        for field, value in own.items():
            args += [field, value]
        reply = await self._publish(keys=self._keys, args=args)
        pairs = []
        for i in range(0, len(reply) - 1, 2):
            field, value = (x.decode() if isinstance(x, bytes) else str(x) for x in reply[i : i + 2])
            if field:
                pairs.append((field, value))
        return pairs

    async def close(self) -> None:
        await self._client.aclose()
