"""Gateway replicas (and `--workers`) that act as one: in-flight counts and calibration shared through Redis.

Every `interval_s` this process publishes its in-flight count per backend and learns the sum of every
other live replica's (`kvindex/replica_share.py`, one Redis round trip); the router's load then counts the
whole cluster's requests, not this process's slice. Redis down or slow: the remote counts fade to zero
after `ttl_s`, and each replica balances on what it sees itself, as a lone gateway would.

Every `CALIBRATION_INTERVAL_S`, each model's router that learns (`cost`) publishes its corrections and
blends in the other replicas' (`Router.blend_calibration`), one round trip per model: a replica sees only
its share of the outcomes, and a new one starts from what the others learnt instead of the roofline.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping

from gateway.config import IndexConfig
from gateway.registry import Registry
from kvindex.replica_share import ReplicaShare
from scoring.types import Router

log = logging.getLogger("hetgate.replicas")
CALIBRATION_INTERVAL_S = 2.0


class SharedLoad:
    def __init__(
        self,
        registry: Registry,
        share: ReplicaShare,
        interval_s: float,
        ttl_s: float,
        routers: Callable[[], Mapping[str, Router]] = dict,
    ) -> None:
        self.registry = registry
        self.share = share
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.routers = routers  # read at each exchange: a config reload replaces them
        self.failures = 0
        self._last_ok = 0.0
        self._next_calibration = 0.0
        self._calibration_shares: dict[str, ReplicaShare] = {}

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
            backend.set_remote_in_flight(others.get(backend.id, 0))
        if now >= self._next_calibration:
            self._next_calibration = now + CALIBRATION_INTERVAL_S
            await self.share_calibration()

    async def share_calibration(self) -> None:
        """Publish each learning router's corrections and blend in the other replicas'."""
        for model, router in self.routers().items():
            if not router.learns:
                continue
            share = self._calibration_shares.get(model)
            if share is None:
                share = self._calibration_shares[model] = self.share.for_kind(f"calibration:{model}")
            try:
                async with asyncio.timeout(self.interval_s + 0.5):
                    others = await share.exchange_values(router.calibration())
            except Exception as error:  # a hint, as the load is: each replica keeps its own meanwhile
                log.warning("shared calibration unavailable (%s)", type(error).__name__)
                return
            router.blend_calibration(others)


def start_shared_load(
    registry: Registry, index: IndexConfig, routers: Callable[[], Mapping[str, Router]] = dict
) -> asyncio.Task[None] | None:
    """The sharing of `serve` and `epp` alike: with the Redis store and `index.share_load`, a task that
    publishes this process's in-flight counts and reads every other replica's into `registry` (the one
    writer of `remote_in_flight`), and shares the calibration of `routers()`; None when the
    configuration shares nothing."""
    if index.store != "redis" or not index.share_load:
        return None
    share = ReplicaShare.from_url(index.redis_url, index.key_prefix, replica_id(), index.share_ttl_s)
    shared = SharedLoad(registry, share, index.share_interval_s, index.share_ttl_s, routers)
    return asyncio.create_task(shared.run(), name="shared-load")


def replica_id() -> str:
    """Unique per process: host name (the pod name in Kubernetes), pid and a random suffix."""
    return f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
