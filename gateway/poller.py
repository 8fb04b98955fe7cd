"""Background pollers of each backend's /health and /metrics.

The control plane: httpx (speed does not matter here), never on the request path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from gateway.registry import BackendState, Registry
from gateway.stats import parse_vllm_metrics

log = logging.getLogger("hetgate.poller")


class Poller:
    def __init__(self, registry: Registry, client: httpx.AsyncClient) -> None:
        self.registry = registry
        self.client = client
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        settings = self.registry.health_settings
        self._tasks = [
            asyncio.create_task(self._every(settings.interval_s, self._probe_health), name="health-poller"),
            asyncio.create_task(
                self._every(settings.metrics_interval_s, self._scrape_metrics), name="metrics-poller"
            ),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _every(self, interval_s: float, poll_one: Callable[[BackendState], Awaitable[None]]) -> None:
        while True:
            await asyncio.gather(*(poll_one(b) for b in self.registry.backends.values()))
            await asyncio.sleep(interval_s)

    async def _probe_health(self, backend: BackendState) -> None:
        try:
            response = await self.client.get(
                f"{backend.config.base_url}/health",
                headers=_auth(backend),
                timeout=self.registry.health_settings.timeout_s,
            )
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self.registry.record_success(backend)
        else:
            self.registry.record_failure(backend)

    async def _scrape_metrics(self, backend: BackendState) -> None:
        try:
            response = await self.client.get(
                f"{backend.config.base_url}/metrics",
                headers=_auth(backend),
                timeout=self.registry.health_settings.timeout_s,
            )
        except httpx.HTTPError:
            return  # health probing owns marking-down; stale load is better than none
        if response.status_code == 200:
            backend.load = parse_vllm_metrics(response.text)


def _auth(backend: BackendState) -> dict[str, str]:
    return {"Authorization": f"Bearer {backend.upstream_key}"} if backend.upstream_key else {}
