"""Builds the prefix-cache services when the configuration needs them, and nothing otherwise.

A pure load balancer (`round_robin`/`least_load`, no `auto` split, no KV events) hashes nothing and never
touches an index: the request path stays as short as a plain proxy's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.affinity import Affinity
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import BackendState, ModelPool, Registry
from kvindex import GuardedIndex, PromptHasher, build_index, failure_counter
from kvindex.events import KVEventSubscriber
from kvindex.tokenizer import ChatTokenizer

log = logging.getLogger("hetgate.prefix")


@dataclass(slots=True)
class PrefixServices:
    affinity: Affinity
    index: Any
    subscribers: list[Any] = field(default_factory=list)

    async def close(self) -> None:
        for subscriber in self.subscribers:
            await subscriber.stop()
        await self.affinity.drain()
        await self.index.close()

    async def backends_changed(
        self,
        registry: Registry,
        added: list[BackendState],
        removed: list[BackendState],
        metrics: GatewayMetrics,
    ) -> None:
        """Follow a new backend set: hash for the block sizes now served, stop the KV-event subscriptions of
        removed backends (forgetting what they held) and start those of added ones."""
        for name, pool in registry.pools.items():
            hasher = self.affinity.hashers[name]
            if hasher.block_sizes != pool.block_sizes:
                self.affinity.hashers[name] = PromptHasher(name, pool.block_sizes, hasher.tokenizer)
        gone = {b.id for b in removed}
        for subscriber in [s for s in self.subscribers if s.backend_id in gone]:
            self.subscribers.remove(subscriber)
            await subscriber.stop(forget=True)
        for backend in added:
            if backend.config.kv_events:
                subscriber = _subscriber(
                    backend, self.index, self.affinity.hashers[backend.config.model], metrics
                )
                await subscriber.start()
                self.subscribers.append(subscriber)
                self.affinity.precise_backends |= {backend.id}


def needs_prefix(config: GatewayConfig) -> bool:
    routing = config.routing
    return (
        routing.policy in ("prefix", "cost")
        or routing.disaggregation == "auto"
        or any(b.kv_events is not None for b in config.backends)
    )


async def build_prefix_services(
    config: GatewayConfig, registry: Registry, metrics: GatewayMetrics
) -> PrefixServices | None:
    if not needs_prefix(config):
        return None
    settings = config.index
    index = build_index(
        settings.store,
        redis_url=settings.redis_url,
        key_prefix=settings.key_prefix,
        ttl_s=settings.ttl_s,
        deadline_ms=settings.deadline_ms,
        on_failure=failure_counter(metrics.index_errors),
    )
    hashers = {name: _hasher(pool) for name, pool in registry.pools.items()}
    subscribers = [
        _subscriber(b, index, hashers[b.config.model], metrics)
        for b in registry.backends.values()
        if b.config.kv_events
    ]
    precise = {s.backend_id for s in subscribers}
    affinity = Affinity(
        index, hashers, settings.tenant_salt_header, precise_backends=precise, metrics=metrics
    )
    services = PrefixServices(affinity, index, subscribers)
    await _warm_up(index, registry)
    try:
        for subscriber in subscribers:
            await subscriber.start()
    except Exception:
        await services.close()
        raise
    return services


async def _warm_up(index: GuardedIndex, registry: Registry) -> None:
    """Open the store's connection (and load Redis's scripts) before traffic arrives: a cold first call
    can outlast the request deadline and would trip the guard for every request of the next second."""
    pool = next((p for p in registry.pools.values() if p.backends), None)
    if pool is None:  # discovery has found no backend yet
        return
    try:
        async with asyncio.timeout(2.0):
            await index.store.match(pool.model.name, pool.block_sizes[0], [0], [pool.backends[0].id])
    except Exception as error:  # a store that is down at start-up is the guard's business later
        log.warning("prefix index store not reachable at start-up: %s", type(error).__name__)


def _subscriber(
    backend: BackendState, index: GuardedIndex, hasher: PromptHasher, metrics: GatewayMetrics
) -> KVEventSubscriber:
    events = backend.config.kv_events
    assert events is not None
    if hasher.tokenizer is None:
        log.warning(
            "backend %s publishes KV events but model %s has no tokenizer configured: event hashes "
            "(token ids) cannot meet request hashes (text); set models[].tokenizer",
            backend.id,
            backend.config.model,
        )
    return KVEventSubscriber(
        backend.id,
        backend.config.model,
        events.endpoint,
        index,
        hasher,
        topic=events.topic,
        replay_endpoints=events.replay_endpoint,
        host=backend.config.url.host or "127.0.0.1",
        on_event=lambda what: metrics.kv_events.labels(backend.id, what).inc(),
    )


def _hasher(pool: ModelPool) -> PromptHasher:
    tokenizer = ChatTokenizer.load(pool.model.tokenizer) if pool.model.tokenizer else None
    return PromptHasher(pool.model.name, pool.block_sizes, tokenizer)
