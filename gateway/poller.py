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
        # A probe decides only the probe state; passive (outlier) counts are not reset by a good probe.
        response = await self._get(backend, "/health")
        self.registry.probe_result(backend, response is not None and response.status_code == 200)
        self.registry.release_due()

    async def _scrape_metrics(self, backend: BackendState) -> None:
        # Health probing owns marking-down; on a failed scrape the last load stays (stale beats none).
        own_before = backend.own_counts()
        response = await self._get(backend, "/metrics")
        if response is not None and response.status_code == 200:
            backend.report(parse_vllm_metrics(response.text), own_before)

    async def _get(self, backend: BackendState, path: str) -> httpx.Response | None:
        try:
            return await self.client.get(
                backend.config.base_url + path,
                headers=_auth(backend),
                timeout=self.registry.health_settings.timeout_s,
            )
        except httpx.HTTPError:
            return None


def _auth(backend: BackendState) -> dict[str, str]:
    return {"Authorization": f"Bearer {backend.upstream_key}"} if backend.upstream_key else {}
