"""Prefill/decode in EPP mode: the EPP runs the prefill leg itself, then hands Envoy the decode request.

Envoy carries one upstream request per client request, so the split happens here, as AIBrix's gateway
plugin does: the EPP sends the prefill leg (non-streamed, `max_tokens=1`, vLLM's NIXL block on a `nixl`
backend) over aiohttp, reads the `kv_transfer_params` it returns, and rewrites the client's body so the
decode pod that Envoy calls next pulls the KV instead of recomputing it. Both legs carry Envoy's
`x-request-id`. The transaction rules are `serve`'s: a failed prefill leg falls back to aggregated serving
(or fails with 502 when `routing.pd_fallback: fail`), counted in `hetgate:pd_fallbacks`; a failed decode
pod is retried by Envoy on the next decode endpoint of the list. The other design, llm-d's, leaves the
prefill leg to a sidecar next to each decode pod, told where to prefill by `x-prefiller-host-port`
(docs/epp.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.config import GatewayConfig
from gateway.errors import GatewayError, UpstreamFailed
from gateway.metrics import GatewayMetrics
from gateway.proxy import NIXL_PREFILL_PARAMS
from gateway.registry import BackendState, Registry
from gateway.schemas import ParsedRequest
from gateway.upstream import LegFailed, Upstream

_DROPPED_ON_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(frozen=True, slots=True)
class Prefilled:
    backend: BackendState
    kv_transfer_params: dict[str, Any] | None


def prefill_body(body: dict[str, Any], connector: str) -> bytes:
    leg = {k: v for k, v in body.items() if k not in _DROPPED_ON_PREFILL}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    if connector == "nixl":
        leg["kv_transfer_params"] = NIXL_PREFILL_PARAMS
    return orjson.dumps(leg)


def decode_body(body: dict[str, Any], done: Prefilled) -> bytes:
    """The client's request for the decode pod, carrying the prefiller's KV handle verbatim."""
    if done.kv_transfer_params is None:  # e.g. shared-storage connectors: nothing to hand over
        return orjson.dumps(body)
    return orjson.dumps({**body, "kv_transfer_params": done.kv_transfer_params})


class PrefillRunner:
    def __init__(
        self, config: GatewayConfig, registry: Registry, upstream: Upstream, metrics: GatewayMetrics
    ) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.metrics = metrics

    async def run(self, request: ParsedRequest, order: Sequence[BackendState], request_id: str) -> Prefilled:
        """The prefill leg on the first prefill backend that answers 200. Raises GatewayError."""
        for backend in order[: self.config.limits.max_attempts]:
            try:
                return await self._once(request, backend, request_id)
            except LegFailed as failure:
                self.metrics.upstream_errors.labels(backend.id, failure.kind).inc()
                if failure.status != 429:  # a busy backend is not a broken one
                    self.registry.record_failure(backend)
        raise UpstreamFailed("The prefill leg failed.")

    async def _once(self, request: ParsedRequest, backend: BackendState, request_id: str) -> Prefilled:
        data = prefill_body(request.body, backend.config.kv_connector)
        self.registry.begin(backend)
        try:
            leg = await self.upstream.open(backend, request.kind.path, data, request_id)
            raw = await self.upstream.read(leg)
            if leg.response.status != 200:
                raise LegFailed("status", False, leg.response.status)
        finally:
            self.registry.end(backend)
        self.registry.record_success(backend)
        return Prefilled(backend, _kv_params(raw))


def _kv_params(raw: bytes) -> dict[str, Any] | None:
    try:
        response = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    params = response.get("kv_transfer_params") if isinstance(response, dict) else None
    return params if isinstance(params, dict) else None


def fallback_error(reason: str) -> GatewayError:
    return UpstreamFailed(f"Prefill/decode serving failed ({reason}) and no fallback is allowed.")
