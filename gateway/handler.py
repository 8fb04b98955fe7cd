"""The hot path: /v1/chat/completions and /v1/completions as a raw ASGI callable.

FastAPI's request/response layers cost ~100 us a request (measured, proxy-stack-measurements.md), so the
two endpoints that carry traffic read the body and write the response on the ASGI interface directly. In
order: authorize, read the body under the size limit, check the fields we read (schemas.py), find the
model's pool, look up cached prefixes (the one awaited index call), plan, and proxy. Every error before
a backend is touched is an OpenAI-shaped JSON error.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.admission import Admission
from gateway.affinity import Affinity
from gateway.errors import BodyTooLarge, GatewayError, ModelNotFound, NoBackend, Unauthorized, UpstreamFailed
from gateway.metrics import GatewayMetrics
from gateway.proxy import Exchange, Proxy
from gateway.registry import ModelPool, Registry
from gateway.schemas import Kind, ParsedRequest, estimate_prompt_tokens, parse_body
from gateway.upstream import LegFailed
from scoring.types import Mode, Outcome, RequestFeatures, Router

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_SAFE_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


class ClientGone(Exception):
    """The client disconnected while we were still reading its request."""


class CompletionHandler:
    def __init__(
        self,
        registry: Registry,
        routers: dict[str, Router],
        proxy: Proxy,
        metrics: GatewayMetrics,
        affinity: Affinity | None,
        api_keys: tuple[str, ...],
        max_body_bytes: int,
        route_header: bool,
        needs_prompt_tokens: bool = True,
        admission: Admission | None = None,
    ) -> None:
        self.registry = registry
        self.routers = routers
        self.proxy = proxy
        self.metrics = metrics
        self.affinity = affinity
        self.key_digests = tuple(hashlib.sha256(k.encode()).digest() for k in api_keys)
        self.max_body_bytes = max_body_bytes
        self.route_header = route_header
        self.needs_prompt_tokens = needs_prompt_tokens
        self.admission = admission

    async def __call__(self, kind: Kind, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        headers = dict(scope["headers"])
        try:
            self.authorize(headers.get(b"authorization"))
            raw = await self._read_body(headers, receive)
            request = parse_body(raw, kind)
            pool = self.registry.pool(request.model)
            if pool is None:
                raise ModelNotFound(f"The model `{request.model}` does not exist.", "model")
        except ClientGone:
            return
        except GatewayError as error:
            self.metrics.requests.labels("_invalid", "none", str(error.status)).inc()
            await send_error(send, error, self.route_header)
            return
        exchange = Exchange(
            request=request,
            request_id=_request_id(headers.get(b"x-request-id")),
            started=started,
            route_header=self.route_header,
            upstream_body=_upstream_body(request, pool),
        )
        work = self._serve if self.admission is None else self._admitted
        await _cancel_on_disconnect(
            work(exchange, pool, send, headers), receive, self._count_disconnect(request)
        )

    def authorize(self, header: bytes | None) -> None:
        """Constant-time check against every configured key (none configured: open gateway)."""
        if not self.key_digests:
            return
        token = header[7:] if header and header[:7].lower() == b"bearer " else b""
        digest = hashlib.sha256(token).digest()
        matched = False
        for expected in self.key_digests:
            matched |= hmac.compare_digest(digest, expected)
        if not matched:
            raise Unauthorized("Missing or invalid API key.")

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge(f"The request body exceeds {self.max_body_bytes} bytes.")
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_body_bytes:
                raise BodyTooLarge(f"The request body exceeds {self.max_body_bytes} bytes.")
            parts.append(part)
            if not message.get("more_body"):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _admitted(self, ex: Exchange, pool: ModelPool, send: Send, headers: dict[bytes, bytes]) -> None:
        """Admission control (gateway/admission.py: 429 + Retry-After over a limit), then the request."""
        assert self.admission is not None
        try:
            ticket = await self.admission.admit(headers, ex.request)
        except GatewayError as error:
            await self._fail(ex, send, error)
            return
        try:
            await self._serve(ex, pool, send, headers)
        finally:
            ticket.release()

    async def _serve(self, ex: Exchange, pool: ModelPool, send: Send, headers: dict[bytes, bytes]) -> None:
        request = ex.request
        try:
            features, cached = await self._features(request, pool, headers)
            candidates = self.registry.candidates(pool, cached)
            plan = self.routers[request.model].plan(features, candidates)
            self.metrics.route_decisions.labels(request.model, plan.mode.value, plan.reason).inc()
            if not plan.aggregated:
                raise NoBackend("No healthy backend serves this model.")
            backends = pool.backends
            aggregated = [backends[i] for i in plan.aggregated]
            if plan.mode is Mode.PD:
                prefill = [backends[i] for i in plan.prefill]
                decode = [backends[i] for i in plan.decode]
                await self.proxy.disaggregated(ex, prefill, decode, aggregated, send)
            else:
                await self.proxy.aggregated(ex, aggregated, send)
        except LegFailed:
            await self._fail(ex, send, UpstreamFailed("The backend response broke."))
            return
        except GatewayError as error:
            await self._fail(ex, send, error)
            return
        if self.affinity is not None and ex.served:
            self.affinity.record(request, pool, features, ex.served)
        if ex.ttft_s and ex.mode == "aggregated":
            self._learn(ex, pool, features, cached)

    def _learn(self, ex: Exchange, pool: ModelPool, features: RequestFeatures, cached: Any) -> None:
        """Feed a measured TTFT back to the router (the cost policy corrects its model with it)."""
        backend = ex.served[0]
        row = pool.backends.index(backend)
        outcome = Outcome(
            backend_id=backend.id,
            mode=Mode.AGGREGATED,
            prompt_tokens=features.prompt_tokens,
            cached_tokens=0 if cached is None else int(cached[row]),
            output_tokens=0,
            ttft_s=ex.ttft_s,
            e2e_s=time.perf_counter() - ex.started,
        )
        self.routers[ex.request.model].observe(outcome)

    async def _features(
        self, request: ParsedRequest, pool: ModelPool, headers: dict[bytes, bytes]
    ) -> tuple[RequestFeatures, Any]:
        if self.affinity is None:
            # Only the `auto` split reads the prompt length: a plain balancer skips the estimate.
            tokens = estimate_prompt_tokens(request) if self.needs_prompt_tokens else 0
            return RequestFeatures(request.model, tokens, request.max_tokens, request.stream), None
        return await self.affinity.lookup(request, pool, headers)

    async def _fail(self, ex: Exchange, send: Send, error: GatewayError) -> None:
        self.metrics.requests.labels(ex.request.model, ex.mode, str(error.status)).inc()
        if not ex.responded:
            await send_error(send, error, self.route_header)

    def _count_disconnect(self, request: ParsedRequest) -> Callable[[], None]:
        return lambda: self.metrics.client_disconnects.labels(request.model).inc()


async def send_error(send: Send, error: GatewayError, route_header: bool) -> None:
    body = error.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.extend(error.headers)
    if route_header:
        headers.append((b"x-hetgate-route", b"mode=none"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _cancel_on_disconnect(
    work: Awaitable[None], receive: Receive, on_disconnect: Callable[[], None]
) -> None:
    """Run `work`; if the client disconnects first, cancel it (which aborts the upstream legs)."""
    task = asyncio.current_task()
    assert task is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        if not disconnected:
            raise
        task.uncancel()
        on_disconnect()
    finally:
        watcher.cancel()


def _request_id(header: bytes | None) -> str:
    """The client's X-Request-Id when safe to pass on (vLLM uses it as its internal id), else a new one."""
    if header is not None and _SAFE_REQUEST_ID.match(header):
        return header.decode()
    return os.urandom(16).hex()  # a random 128-bit id, without uuid4's object (a tenth of its cost)


def _upstream_body(request: ParsedRequest, pool: ModelPool) -> bytes:
    served = pool.model.upstream_name
    if served == request.model:
        return request.raw  # forwarded byte for byte: no re-serialisation on the common path
    request.body["model"] = served  # the P/D legs are built from the body too
    return orjson.dumps(request.body)
