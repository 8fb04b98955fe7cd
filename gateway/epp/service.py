"""`hetgate epp`: the ext_proc gRPC server, its gRPC health services and a `/metrics` HTTP port.

Everything is built once here and handed on (no module-level state): the registry, poller and prefix
services exactly as `serve` builds them, the shared `Decider`, and the prefill runner for P/D plans.
Health follows the EPP protocol: `liveness` is SERVING while the process answers; `readiness` and the
ext_proc service name are SERVING while at least one backend of every model is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import grpc
import httpx
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.config import GatewayConfig
from gateway.decision import Decider
from gateway.epp.pd import PrefillRunner
from gateway.epp.picker import Picker, PickerSettings, Turn
from gateway.metrics import GatewayMetrics
from gateway.poller import Poller
from gateway.prefix import build_prefix_services
from gateway.registry import BackendState, HealthEvent, Registry
from gateway.replanning import start_replanning
from gateway.replicas import start_shared_load
from gateway.retry import RetryPolicy, failing_statuses
from gateway.upstream import Upstream

log = logging.getLogger("hetgate.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class Listen:
    host: str = "127.0.0.1"
    grpc_port: int = 9002
    metrics_port: int = 9090


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        turn = Turn(self.picker)
        try:
            async for message in request_iterator:
                for response in await turn.on(message):
                    yield response
        except Exception:
            # The stream fails; Envoy applies its failure mode (500, or routing without a pick).
            log.exception("ext_proc stream failed")
            raise
        finally:
            turn.close()


class Readiness:
    """Keeps `readiness` and the ext_proc health status in step with the backends' health."""

    def __init__(self, health: health_aio.HealthServicer) -> None:
        self.health = health
        self.registries: list[Registry] = []
        self._pending: set[asyncio.Task[None]] = set()

    def watch(self, registry: Registry) -> None:
        self.registries = [registry]

    def status(self) -> int:
        ready = all(r.any_ready(model) for r in self.registries for model in r.pools)
        return _SERVING if ready else _NOT_SERVING

    async def publish(self) -> None:
        status = self.status()
        for name in ("readiness", EXT_PROC_SERVICE):
            await self.health.set(name, status)

    def changed(self) -> None:
        task = asyncio.get_running_loop().create_task(self.publish())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


async def run(config: GatewayConfig, listen: Listen, settings: PickerSettings) -> None:
    metrics = GatewayMetrics()
    health = health_aio.HealthServicer()
    readiness = Readiness(health)
    registry = Registry(config, _health_hook(metrics, readiness))
    readiness.watch(registry)
    for backend in registry.backends.values():  # the same series as `serve`'s, refreshed at each scrape
        metrics.watch_backend(backend, partial(registry.available, backend))
    prefix = await build_prefix_services(config, registry, metrics)
    failing = failing_statuses(config.retry)
    upstream = Upstream(config.timeouts, failing, config.limits.max_response_bytes)
    decider = Decider(config, registry, metrics, prefix.affinity if prefix else None)
    retry_policy = RetryPolicy(config.retry, registry, metrics)
    prefill = PrefillRunner(registry, upstream, retry_policy, metrics)
    picker = Picker(config, registry, decider, prefill, retry_policy, failing, metrics, settings)
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    grpc_port = server.add_insecure_port(f"{listen.host}:{listen.grpc_port}")
    metrics_site = await _metrics_site(metrics, listen)
    # Other replicas' in-flight counts, shared as `serve` shares them (gateway/replicas.py).
    shared = start_shared_load(registry, config.index, lambda: decider.routers)
    replanning = start_replanning(lambda: decider.routers)
    try:
        async with httpx.AsyncClient() as control_client:
            poller = Poller(registry, control_client)
            poller.start()
            await server.start()
            await health.set("liveness", _SERVING)
            await readiness.publish()
            print(f"hetgate epp: grpc {listen.host}:{grpc_port} metrics :{listen.metrics_port}", flush=True)
            await _until_signalled()
            await health.enter_graceful_shutdown()
            await server.stop(grace=5)
            await poller.stop()
    finally:
        if shared is not None:
            shared.cancel()  # its own `finally` closes the Redis client
            await asyncio.gather(shared, return_exceptions=True)
        if replanning is not None:
            replanning.cancel()
            await asyncio.gather(replanning, return_exceptions=True)
        await metrics_site.cleanup()
        if prefix:
            await prefix.close()
        await upstream.close()


def _health_hook(
    metrics: GatewayMetrics, readiness: Readiness
) -> Callable[[BackendState, HealthEvent], None]:
    """As `serve`'s (gateway/app.py): count and log the change, then republish readiness."""

    def changed(backend: BackendState, event: HealthEvent) -> None:
        metrics.health_changes.labels(backend.id, event.value).inc()
        if event is HealthEvent.EJECTED:
            metrics.ejections.labels(backend.id).inc()
        log.warning("backend %s: %s", backend.id, event.value)
        readiness.changed()

    return changed


async def _metrics_site(metrics: GatewayMetrics, listen: Listen) -> web.AppRunner:
    async def scrape(_request: web.Request) -> web.Response:
        body = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def alive(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/health", alive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, listen.host, listen.metrics_port).start()
    return runner


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
