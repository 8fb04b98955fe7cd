"""create_app: everything the gateway runs on is built once in the lifespan and handed on as typed state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.routing import Route

from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.decision import Decider
from gateway.discovery import FileSource, KubernetesSource
from gateway.errors import GatewayError, install_error_handlers
from gateway.handler import CompletionHandler
from gateway.live import ConfigReloader, LiveBackends
from gateway.metrics import GatewayMetrics
from gateway.poller import Poller
from gateway.prefix import PrefixServices, build_prefix_services
from gateway.proxy import Proxy
from gateway.registry import BackendState, HealthEvent, Registry
from gateway.replanning import start_replanning
from gateway.replicas import start_shared_load
from gateway.retry import failing_statuses
from gateway.schemas import Kind
from gateway.upstream import Upstream
from scoring.catalog import load_catalog

log = logging.getLogger("hetgate")


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    metrics: GatewayMetrics
    registry: Registry
    handler: CompletionHandler
    models_body: bytes

    def reconfigure(self, config: GatewayConfig) -> None:
        """Apply what may change while serving (gateway/live.py): routing, limits, health settings."""
        self.config = config
        self.handler.decider.reconfigure(config)
        self.handler.max_body_bytes = config.limits.max_body_bytes
        self.handler.route_header = config.routing.route_header
        self.handler.proxy.config = config
        self.registry.health_settings = config.health


class CompletionEndpoint:
    """A raw ASGI endpoint (Starlette routes non-function endpoints straight through)."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state: GatewayState = scope["app"].state.gateway
        await state.handler(self.kind, scope, receive, send)


def _models_body(config: GatewayConfig) -> bytes:
    created = int(time.time())
    data = [
        {"id": m.name, "object": "model", "created": created, "owned_by": "hetgate"} for m in config.models
    ]
    return orjson.dumps({"object": "list", "data": data})


def _in_flight(backend: BackendState) -> float:
    return backend.in_flight


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    config: GatewayConfig = app.state.config
    metrics = GatewayMetrics()

    def on_health_change(backend: BackendState, event: HealthEvent) -> None:
        metrics.health_changes.labels(backend.id, event.value).inc()
        if event is HealthEvent.EJECTED:
            metrics.ejections.labels(backend.id).inc()
        log.warning("backend %s: %s", backend.id, event.value)

    registry = Registry(config, on_health_change)
    metrics.initialise(m.name for m in config.models)
    for backend in registry.backends.values():
        metrics.watch_backend(backend, partial(registry.available, backend))
    async with contextlib.AsyncExitStack() as resources:  # closed in reverse, also when start-up fails
        upstream = Upstream(config.timeouts, failing_statuses(config.retry), config.limits.max_response_bytes)
        resources.push_async_callback(upstream.close)
        prefix = await build_prefix_services(config, registry, metrics)
        if prefix:
            resources.push_async_callback(prefix.close)
        control_client = await resources.enter_async_context(httpx.AsyncClient())
        state = _gateway_state(config, metrics, registry, upstream, prefix)
        app.state.gateway = state
        poller = Poller(registry, control_client)
        poller.start()
        resources.push_async_callback(poller.stop)
        live = start_live_changes(state, prefix, control_client, app.state.config_path)
        resources.push_async_callback(_stop_tasks, live)
        yield


async def _stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _gateway_state(
    config: GatewayConfig,
    metrics: GatewayMetrics,
    registry: Registry,
    upstream: Upstream,
    prefix: PrefixServices | None,
) -> GatewayState:
    admission = Admission(config.admission, lambda reason: metrics.admission_rejections.labels(reason).inc())
    metrics.admission_active.set_function(lambda: admission.active)
    metrics.admission_queued.set_function(lambda: admission.queued)
    affinity = prefix.affinity if prefix else None
    handler = CompletionHandler(
        decider=Decider(config, registry, metrics, affinity),
        proxy=Proxy(config, registry, upstream, metrics),
        metrics=metrics,
        api_keys=config.auth.keys(),
        max_body_bytes=config.limits.max_body_bytes,
        route_header=config.routing.route_header,
        reject_internal_fields=config.limits.internal_fields == "reject",
        admission=admission if admission.enabled else None,  # no limits configured: no cost at all
    )
    return GatewayState(config, metrics, registry, handler, _models_body(config))


def start_live_changes(
    state: GatewayState, prefix: PrefixServices | None, control: httpx.AsyncClient, config_path: Path | None
) -> list[asyncio.Task[None]]:
    """The background tasks that change the gateway while it serves: a discovery source, the load shared
    with other replicas, config reload."""
    live = LiveBackends(state, prefix)
    tasks: list[asyncio.Task[None]] = []
    discovery = state.config.discovery
    accelerators = load_catalog().accelerators
    if discovery.source == "file" and discovery.file is not None:
        path = discovery.file.path
        if config_path is not None and not path.is_absolute():
            path = config_path.parent / path
        source = FileSource(path, discovery.file.poll_s, state.config, live.submit, accelerators)
        source.poll(settle=False)  # the first snapshot before the first request
        tasks.append(asyncio.create_task(source.run(), name="discovery-file"))
    elif discovery.source == "kubernetes":
        kube = KubernetesSource(discovery.kubernetes, state.config, live.submit, accelerators, control)
        tasks.append(asyncio.create_task(kube.run(), name="discovery-kubernetes"))
    if state.metrics.multiprocess:
        tasks.append(asyncio.create_task(state.metrics.refresh_every(1.0), name="metrics-refresh"))
    shared = start_shared_load(state.registry, state.config.index, lambda: state.handler.decider.routers)
    if shared is not None:
        tasks.append(shared)
    replanning = start_replanning(lambda: state.handler.decider.routers)
    if replanning is not None:
        tasks.append(replanning)
    if config_path is not None:
        reloader = ConfigReloader(config_path, state, live, read=_read_config)
        reloader.install_signal()
        tasks.append(asyncio.create_task(reloader.watch(), name="config-reload"))
    return tasks


def _read_config(path: Path) -> GatewayConfig:
    from gateway.cli import read_config  # the same checks as `serve` at start

    return read_config(str(path))


def create_app(config: GatewayConfig, config_path: Path | None = None) -> FastAPI:
    # The API docs are served only by an open gateway: with API keys configured they are off (404), so
    # nothing about the deployment is public.
    docs = not config.auth.keys()
    app = FastAPI(
        title="hetgate",
        version="0.1.0",
        lifespan=_lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.config = config
    app.state.config_path = config_path
    app.state.draining = False  # set on SIGTERM (HotPathApp.begin_drain)
    install_error_handlers(app)
    app.router.routes.append(Route("/v1/chat/completions", CompletionEndpoint(Kind.CHAT), methods=["POST"]))
    app.router.routes.append(Route("/v1/completions", CompletionEndpoint(Kind.COMPLETIONS), methods=["POST"]))

    def state_of(request: Request) -> GatewayState:
        return request.app.state.gateway

    def authorized(request: Request) -> GatewayError | None:
        try:
            state_of(request).handler.authorize(request.headers.get("authorization", "").encode())
        except GatewayError as error:
            return error
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if error := authorized(request):
            return Response(error.body(), status_code=error.status, media_type="application/json")
        return Response(state_of(request).models_body, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        state = state_of(request)
        waiting = [m.name for m in state.config.models if not state.registry.any_ready(m.name)]
        draining = request.app.state.draining
        ready = not waiting and not draining
        return Response(
            orjson.dumps({"ready": ready, "draining": draining, "models_without_backend": waiting}),
            200 if ready else 503,
            media_type="application/json",
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if error := authorized(request):
            return Response(error.body(), status_code=error.status, media_type="application/json")
        return Response(state_of(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


class HotPathApp:
    """The ASGI app `hetgate serve` runs: the two traffic endpoints skip FastAPI's middleware stack
    (about 10 % of the gateway's CPU per request, profiled), everything else is plain FastAPI."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._hot = {Kind.CHAT.path: Kind.CHAT, Kind.COMPLETIONS.path: Kind.COMPLETIONS}

    def count_rejection(self, reason: str) -> None:
        """The server's limits refused a request before it got here (gateway/server.py)."""
        self.app.state.gateway.metrics.connection_rejections.labels(reason).inc()

    def begin_drain(self) -> None:
        """SIGTERM (gateway/server.py): report not ready, so traffic moves elsewhere before we stop."""
        self.app.state.draining = True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = self._hot.get(scope["path"])
            if kind is not None:
                await self.app.state.gateway.handler(kind, scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_asgi_app(config: GatewayConfig, config_path: Path | None = None) -> HotPathApp:
    return HotPathApp(create_app(config, config_path))
