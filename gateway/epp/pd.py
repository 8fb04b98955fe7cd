"""Prefill/decode in EPP mode: the EPP runs the prefill leg itself, then hands Envoy the decode request.

Envoy carries one upstream request per client request, so the split happens here, as AIBrix's gateway
plugin does: the EPP sends the prefill leg (non-streamed, `max_tokens=1`, vLLM's NIXL block on a `nixl`
backend) over aiohttp, reads the `kv_transfer_params` it returns, and rewrites the client's body so the
decode pod that Envoy calls next pulls the KV instead of recomputing it. Both legs carry Envoy's
`x-request-id`. The transaction rules are `serve`'s: a prefill attempt that fails or times out is retried
on the next prefill backend as `retry` says (gateway/retry.py: the same `retry_on`, `num_retries`, budget,
and the same blame feeding outlier detection); a prefill leg that still failed falls back to aggregated
serving (or fails with 502 when `routing.pd_fallback: fail`), counted in `hetgate:pd_fallbacks`; a failed
decode pod is retried by Envoy on the next decode endpoint of the list. Each prefill attempt reserves its
backend (Registry.reserve) into the caller's list, whose owner (the stream's Turn) releases it on every
exit path; the runner gives it back as soon as the leg's answer is read. The other design, llm-d's, leaves the
prefill leg to a sidecar next to each decode pod, told where to prefill by `x-prefiller-host-port`
(docs/epp.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import GatewayError, UpstreamFailed
from gateway.metrics import GatewayMetrics
from gateway.proxy import NIXL_PREFILL_PARAMS
from gateway.registry import BackendState, Registry, Reservation
from gateway.retry import RetryPolicy
from gateway.schemas import ParsedRequest
from gateway.upstream import Leg, LegFailed, Upstream
from scoring.types import LegLoad

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
        self, registry: Registry, upstream: Upstream, retry_policy: RetryPolicy, metrics: GatewayMetrics
    ) -> None:
        self.registry = registry
        self.upstream = upstream
        self.retry_policy = retry_policy
        self.metrics = metrics

    async def run(
        self,
        request: ParsedRequest,
        order: Sequence[BackendState],
        request_id: str,
        load_of: Callable[[BackendState], LegLoad],
        held: list[Reservation],
    ) -> Prefilled:
        """The prefill leg on the first prefill backend that answers 200, retried as `retry` says; each
        attempt's reservation (`load_of` its backend) goes into `held`. Raises GatewayError."""
        path = request.kind.path
        with self.retry_policy.attempts(request_id, "prefill") as tries:
            for i, backend in enumerate(order):
                if i > 0:
                    self.metrics.retries.labels(request.model).inc()
                reservation = self.registry.reserve(backend, load_of(backend))
                held.append(reservation)
                data = prefill_body(request.body, backend.config.kv_connector)
                try:
                    leg = await self.upstream.open(backend, path, data, request_id)
                except LegFailed as failure:
                    # Its reservation stays until the request ends, as in `serve` (gateway/proxy.py): a
                    # backend that fails fast must not look idle to the next request's ranking.
                    tries.failed(backend, failure)
                    if failure.retryable and tries.should_retry(failure, i + 1, len(order)):
                        continue
                    break
                tries.succeeded(backend, leg.response.status)
                try:
                    return await self._answer(leg, request_id)
                finally:
                    reservation.release()  # the prefill's work is over; the decode may run for minutes
        raise UpstreamFailed("The prefill leg failed.")

    async def _answer(self, leg: Leg, request_id: str) -> Prefilled:
        """The opened leg's result; a body that breaks or a non-200 answer fails the leg (no retry: the
        backend answered, as `serve`'s prefill leg)."""
        try:
            raw = await self.upstream.read(leg)
        except LegFailed as failure:
            self.retry_policy.note(leg.backend, failure, request_id)
            raise UpstreamFailed("The prefill leg broke.") from None
        if leg.response.status != 200:
            self.retry_policy.note(leg.backend, LegFailed("status", False, leg.response.status), request_id)
            raise UpstreamFailed("The prefill leg failed.")
        return Prefilled(leg.backend, _kv_params(raw))


def _kv_params(raw: bytes) -> dict[str, Any] | None:
    try:
        response = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    params = response.get("kv_transfer_params") if isinstance(response, dict) else None
    return params if isinstance(params, dict) else None


def fallback_error(reason: str) -> GatewayError:
    return UpstreamFailed(f"Prefill/decode serving failed ({reason}) and no fallback is allowed.")
