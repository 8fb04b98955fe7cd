"""Execute a RoutePlan: aggregated with retries, or prefill/decode as one transaction with fallbacks.

Rules (see `../shared/docs/reliability-anchors.md`):
- Retry on the next backend of the plan only before any byte reached the client, as `retry` says
  (gateway/retry.py: `retry_on`, `num_retries`, retry budget); each attempt's outcome feeds outlier detection.
- Once bytes were sent, a failure ends the stream with vLLM's in-band `data: {"error": ...}` event.
- P/D: the prefill leg is non-streamed with max_tokens=1; its `kv_transfer_params` go verbatim into the
  decode leg; both legs share one X-Request-Id. If a leg fails, the request falls back to aggregated
  serving (or fails cleanly, per `routing.pd_fallback`), counted in metrics and named in the route header.
- A client that disconnects cancels this coroutine; closing the upstream response aborts the backend's work.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config import GatewayConfig
from gateway.errors import GatewayError, NoBackend, UpstreamFailed, sse_error_event
from gateway.metrics import GatewayMetrics
from gateway.registry import BackendState, Registry
from gateway.retry import RetryPolicy
from gateway.schemas import ParsedRequest
from gateway.sse import UsageRewriter
from gateway.upstream import Leg, LegFailed, Upstream

Send = Callable[[dict[str, Any]], Awaitable[None]]

# vLLM's NIXL connectors expect this block on the prefill leg (vllm-reference.md A1).
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_DROPPED_ON_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(slots=True)
class Exchange:
    """One client request on its way through the gateway."""

    request: ParsedRequest
    request_id: str
    started: float
    route_header: bool
    upstream_body: bytes
    served: list[BackendState] = field(default_factory=list)
    mode: str = "aggregated"
    responded: bool = False  # True once the status line went out: errors must then travel in-band
    ttft_s: float = 0.0  # streamed responses: time to the first chunk sent to the client


@dataclass(slots=True)
class Prefilled:
    backend: BackendState
    kv_transfer_params: dict[str, Any] | None
    cached_tokens: int | None


class Proxy:
    def __init__(
        self, config: GatewayConfig, registry: Registry, upstream: Upstream, metrics: GatewayMetrics
    ) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.metrics = metrics
        self.retry_policy = RetryPolicy(config.retry, registry, metrics)

    # -- aggregated -----------------------------------------------------------------------------------------

    async def aggregated(
        self, ex: Exchange, order: Sequence[BackendState], send: Send, note: str = ""
    ) -> None:
        leg = await self._open_first(ex, order, ex.request.kind.path, ex.upstream_body)
        ex.mode = "aggregated"
        ex.served = [leg.backend]
        route = f"mode=aggregated; backend={leg.backend.id}{note}"
        await self._relay(ex, leg, send, route, rewrite_cached=None)

    # -- prefill/decode -------------------------------------------------------------------------------------

    async def disaggregated(
        self,
        ex: Exchange,
        prefill: Sequence[BackendState],
        decode: Sequence[BackendState],
        fallback: Sequence[BackendState],
        send: Send,
    ) -> None:
        model = ex.request.model
        try:
            done = await self._prefill(ex, prefill)
        except GatewayError:
            await self._fall_back(ex, fallback, send, "prefill_failed")
            return
        body = dict(ex.request.body)
        if done.kv_transfer_params is not None:
            body["kv_transfer_params"] = done.kv_transfer_params
        try:
            leg = await self._open_first(ex, decode, ex.request.kind.path, orjson.dumps(body))
        except GatewayError:
            await self._fall_back(ex, [b for b in fallback if b not in decode], send, "decode_failed")
            return
        ex.mode = "pd"
        ex.served = [done.backend, leg.backend]
        route = f"mode=pd; prefill={done.backend.id}; decode={leg.backend.id}"
        self.metrics.route_decisions.labels(model, "pd", "executed").inc()
        await self._relay(ex, leg, send, route, rewrite_cached=done.cached_tokens)

    async def _prefill(self, ex: Exchange, order: Sequence[BackendState]) -> Prefilled:
        body = dict(ex.request.body)
        for key in _DROPPED_ON_PREFILL:
            body.pop(key, None)
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        plain = orjson.dumps(body)
        nixl = orjson.dumps({**body, "kv_transfer_params": NIXL_PREFILL_PARAMS})
        leg = await self._open_first(
            ex, order, ex.request.kind.path, lambda b: nixl if b.config.kv_connector == "nixl" else plain
        )
        try:
            raw = await self._read_tracked(leg)
        except LegFailed:
            raise UpstreamFailed("The prefill leg broke.") from None
        if leg.response.status != 200:
            self._note_failure(leg.backend, LegFailed("status", False, leg.response.status))
            raise UpstreamFailed("The prefill leg failed.")
        return _prefilled(leg.backend, raw)

    async def _fall_back(self, ex: Exchange, order: Sequence[BackendState], send: Send, why: str) -> None:
        model = ex.request.model
        if self.config.routing.pd_fallback == "fail" or not order:
            self.metrics.fallbacks.labels(model, "fail").inc()
            raise UpstreamFailed(f"Prefill/decode serving failed ({why}) and no fallback is allowed.")
        self.metrics.fallbacks.labels(model, "aggregated").inc()
        await self.aggregated(ex, order, send, note=f"; fallback={why}")

    # -- shared machinery -----------------------------------------------------------------------------------

    async def _open_first(
        self,
        ex: Exchange,
        order: Sequence[BackendState],
        path: str,
        body: bytes | Callable[[BackendState], bytes],
    ) -> Leg:
        """Open the leg on the first backend that answers; retries follow the rules in the module doc."""
        last: LegFailed | None = None
        with self.retry_policy.attempts() as tries:
            for i, backend in enumerate(order):
                if i > 0:
                    self.metrics.retries.labels(ex.request.model).inc()
                data = body if isinstance(body, bytes) else body(backend)
                self.registry.begin(backend)
                try:
                    leg = await self.upstream.open(backend, path, data, ex.request_id)
                except LegFailed as failure:
                    self.registry.end(backend)
                    tries.failed(backend, failure)
                    last = failure
                    if not (failure.retryable and tries.should_retry(failure, i + 1, len(order))):
                        break
                    continue
                tries.succeeded(backend, leg.response.status)
                return leg
        raise _final_error(last)

    def _note_failure(self, backend: BackendState, failure: LegFailed) -> None:
        self.retry_policy.note(backend, failure)

    async def _read_tracked(self, leg: Leg) -> bytes:
        try:
            return await self.upstream.read(leg)
        except LegFailed as failure:
            self._note_failure(leg.backend, failure)
            raise
        finally:
            self.registry.end(leg.backend)

    async def _relay(
        self, ex: Exchange, leg: Leg, send: Send, route: str, rewrite_cached: int | None
    ) -> None:
        """Send the chosen leg's response to the client, streamed if the client asked for a stream."""
        headers = [(b"content-type", leg.response.headers.get("Content-Type", "application/json").encode())]
        if ex.route_header:
            headers.append((b"x-hetgate-route", route.encode()))
        headers.append((b"x-request-id", ex.request_id.encode()))
        status = leg.response.status
        if ex.request.stream and status == 200:
            await self._stream(ex, leg, send, headers, rewrite_cached)
            return
        body = await self._read_tracked(leg)
        if rewrite_cached is not None and status == 200:
            body = UsageRewriter(rewrite_cached).rewrite_json(body)
        ex.responded = True
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._observe(ex, status)

    async def _stream(
        self,
        ex: Exchange,
        leg: Leg,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        rewrite_cached: int | None,
    ) -> None:
        rewriter = UsageRewriter(rewrite_cached) if rewrite_cached is not None else None
        first_at = 0.0
        events = 0
        status = 200
        finished = False
        try:
            ex.responded = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            async for chunk in self.upstream.chunks(leg):
                if rewriter is not None:
                    chunk = rewriter.feed(chunk)
                if not first_at:
                    first_at = time.perf_counter()
                    ex.ttft_s = first_at - ex.started
                events += chunk.count(b"data: ")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
            self.registry.record_success(leg.backend)
        except LegFailed as failure:
            self._note_failure(leg.backend, failure)
            status = 502
            error = sse_error_event("The backend stream broke.")
            await send({"type": "http.response.body", "body": error, "more_body": True})
        finally:
            self.registry.end(leg.backend)
            if not finished:
                leg.response.close()  # aborts the backend's generation (client gone, or stream broke)
        if rewriter is not None:
            await send({"type": "http.response.body", "body": rewriter.flush(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        self._observe(ex, status, first_at, events)

    def _observe(self, ex: Exchange, status: int, first_at: float = 0.0, events: int = 0) -> None:
        now = time.perf_counter()
        model, mode = ex.request.model, ex.mode
        self.metrics.requests.labels(model, mode, str(status)).inc()
        self.metrics.e2e.labels(model, mode).observe(now - ex.started)
        if first_at:
            self.metrics.ttft.labels(model, mode).observe(first_at - ex.started)
            if events > 2:
                self.metrics.tpot.labels(model, mode).observe((now - first_at) / (events - 2))


def _prefilled(backend: BackendState, raw: bytes) -> Prefilled:
    try:
        response = orjson.loads(raw)
    except orjson.JSONDecodeError:
        response = {}
    usage = response.get("usage") if isinstance(response, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    params = response.get("kv_transfer_params") if isinstance(response, dict) else None
    return Prefilled(backend, params if isinstance(params, dict) else None, cached)


def _final_error(last: LegFailed | None) -> GatewayError:
    if last is None:
        return NoBackend("No healthy backend serves this model.")
    if last.kind == "timeout":
        return UpstreamFailed("The backend did not answer in time.", status=504)
    if last.kind == "status" and last.body is not None:
        return RelayedError(last.status, last.body)
    return UpstreamFailed("No backend could serve the request.")


class RelayedError(GatewayError):
    """The last backend's own error response (e.g. 503 overloaded), passed on as nginx does."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__("upstream error", status=status)
        self.raw = body
        self.type = "ServiceUnavailableError"

    def body(self) -> bytes:
        return self.raw
