"""Gateway replicas (and `--workers`) that balance as one: in-flight counts shared through Redis.

Every `interval_s` this process publishes its in-flight count per backend and learns the sum of every
other live replica's (`kvindex/load_share.py`, one Redis round trip); the router's load then counts the
whole cluster's requests, not this process's slice. Redis down or slow: the remote counts fade to zero
after `ttl_s`, and each replica balances on what it sees itself, as a lone gateway would.
"""

from __future__ import annotations

import asyncio
import logging
import os

from gateway.config import IndexConfig
from gateway.registry import Registry
from kvindex.load_share import LoadShare

log = logging.getLogger("hetgate.replicas")


class SharedLoad:
    def __init__(self, registry: Registry, share: LoadShare, interval_s: float, ttl_s: float) -> None:
        self.registry = registry
        self.share = share
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.failures = 0
        self._last_ok = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self.tick(loop.time())
                await asyncio.sleep(self.interval_s)
        finally:
            await self.share.close()

    async def tick(self, now: float) -> None:
        own = {b.id: b.in_flight for b in self.registry.backends.values()}
        try:
            async with asyncio.timeout(self.interval_s + 0.5):
                others = await self.share.exchange(own)
            self._last_ok = now
        except Exception as error:  # the share is a hint, as the index is: never fail on it
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("shared load unavailable (%s): using this process's view", type(error).__name__)
            if now - self._last_ok <= self.ttl_s:
                return  # keep the last counts a while, as other replicas keep ours
            others = {}
        for backend in self.registry.backends.values():
            backend.remote_in_flight = others.get(backend.id, 0)


def start_shared_load(registry: Registry, index: IndexConfig) -> asyncio.Task[None] | None:
    """The load sharing of `serve` and `epp` alike: with the Redis store and `index.share_load`, a task
    that publishes this process's in-flight counts and reads every other replica's into `registry`
    (the one writer of `remote_in_flight`); None when the configuration shares nothing."""
    if index.store != "redis" or not index.share_load:
        return None
    share = LoadShare.from_url(index.redis_url, index.key_prefix, replica_id(), index.share_ttl_s)
    shared = SharedLoad(registry, share, index.share_interval_s, index.share_ttl_s)
    return asyncio.create_task(shared.run(), name="shared-load")


def replica_id() -> str:
    """Unique per process: host name (the pod name in Kubernetes), pid and a random suffix."""
    return f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
