"""One HTTP request's life on one ext_proc stream, as the Endpoint Picker sees it.

    request headers  -> buffered mode: continue at once (the route rides on the body response);
                        full-duplex mode: held until the body is in, then answered with the route
    request body     -> parse the fields routing reads, decide (gateway/decision.py, shared with `serve`),
                        shed or reject, run the prefill leg of a P/D plan, answer the endpoints
    response headers -> the endpoint that served: reservation moved to it, outlier verdict, index record,
                        route header
    stream closed    -> every reservation released

Reservations are `serve`'s (Registry.reserve with the LegLoad of `scoring/load.py`): the endpoint Envoy is
sent to first is reserved when the route is answered (for a P/D plan, the decode pod before the prefill
leg runs), and moved if Envoy fell back to a later endpoint. The Turn is their one owner: `close` (the
gRPC stream's `finally`) releases all of them however the stream ended. The served response feeds
outlier detection through the same `retry` policy as `serve` (gateway/retry.py: 429/503 are backpressure,
a 5xx no peer served is not counted). Errors before a backend is touched are immediate OpenAI-shaped
responses.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import Counter

from gateway.config import GatewayConfig
from gateway.decision import Decider, Decision, Served, route_text, slo_override
from gateway.epp import protocol
from gateway.epp.pd import PrefillRunner, decode_body, fallback_error
from gateway.errors import BodyTooLarge, GatewayError, ModelNotFound, NoBackend
from gateway.metrics import GatewayMetrics
from gateway.registry import BackendState, ModelPool, Registry, Reservation
from gateway.retry import RetryPolicy
from gateway.schemas import Kind, parse_body
from gateway.upstream import LegFailed
from scoring.load import kv_due
from scoring.types import Mode

log = logging.getLogger("hetgate.epp")

_FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_KINDS = {Kind.CHAT.path: Kind.CHAT, Kind.COMPLETIONS.path: Kind.COMPLETIONS}


class Shed(GatewayError):
    """The request was dropped because every eligible backend is full (the EPP protocol's 429)."""

    status = 429
    type = "RateLimitError"


@dataclass(frozen=True, slots=True)
class PickerSettings:
    shed_at: float | None = None  # shed when even the least busy backend's load/capacity reaches this
    max_endpoints: int = 0  # endpoints in the answer (0: all ranked; 1 for proxies without fallbacks)
    # One streamed reply in this many is sent through the EPP chunk by chunk, to measure its TTFT and
    # TPOT for the cost model; 0: never. Each chunk costs a gRPC round trip, so it stays a sample.
    calibrate_every: int = 0


def endpoint_of(backend: BackendState) -> str:
    url = backend.config.url
    return f"{url.host}:{url.port}"


class Picker:
    """What every stream shares: the decision, the registry and the prefill runner."""

    def __init__(
        self,
        config: GatewayConfig,
        registry: Registry,
        decider: Decider,
        prefill: PrefillRunner,
        retry_policy: RetryPolicy,
        failing_statuses: frozenset[int],
        metrics: GatewayMetrics,
        settings: PickerSettings,
    ) -> None:
        self.config = config
        self.registry = registry
        self.decider = decider
        self.prefill = prefill
        self.retry_policy = retry_policy
        self.failing_statuses = failing_statuses  # what `serve`'s Upstream counts as a failed attempt
        self.metrics = metrics
        self.settings = settings
        self.calibrations = Counter(
            "hetgate:epp_ttft_samples",
            "Streamed replies whose first chunk the EPP timed for the cost model",
            ["backend"],
            registry=metrics.registry,
        )
        self.by_endpoint = {endpoint_of(b): b for b in registry.backends.values()}
        self._streams = 0

    def sample_stream(self, model: str) -> bool:
        every = self.settings.calibrate_every
        if not every or not self.decider.routers[model].learns:
            return False
        self._streams += 1
        return self._streams % every == 0

    def endpoints(self, order: list[BackendState]) -> str:
        limit = self.settings.max_endpoints or len(order)
        return ",".join(endpoint_of(b) for b in order[:limit])


class Turn:
    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: dict[str, bytes] = {}
        self.subset: frozenset[str] | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.full_duplex = False
        self.routed = False
        self.decision: Decision | None = None
        self.reservations: list[Reservation] = []  # every one this request took; released in `close`
        self.holding: Reservation | None = None  # the endpoint Envoy was sent to (or served from)
        self.prefilled: BackendState | None = None
        self.mode = "aggregated"
        self.note = ""
        self.timing: SampledStream | None = None  # a sampled stream, timed chunk by chunk
        self._id = ""  # `request_id`

    async def on(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._on_headers(message)
        if kind == "request_body":
            return await self._on_body(message.request_body)
        if kind == "request_trailers":  # full-duplex mode: trailers end the body too
            routed = [] if self.routed else await self._route()
            return [*routed, protocol.request_trailers()]
        if kind == "response_headers":
            return [self._on_response(message)]
        if kind == "response_body":
            self._sampled_chunk(message.response_body)
            return [protocol.pass_response_body()]
        if kind == "response_trailers":
            return [protocol.pass_response_trailers()]
        return []

    def close(self) -> None:
        """The stream ended (response done, client gone or Envoy reset): give back every reservation."""
        self._learn_sampled()  # a sampled reply cut short: its TTFT alone
        for reservation in self.reservations:
            reservation.release()
        self.holding = None

    # -- request ------------------------------------------------------------------------------------------

    def _on_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = protocol.header_map(message.request_headers)
        self.subset = protocol.subset_of(message)
        self.full_duplex = message.protocol_config.request_body_mode == _FULL_DUPLEX
        declared = self.headers.get("content-length", b"")
        limit = self.picker.config.limits.max_body_bytes
        if declared.isdigit() and int(declared) > limit:
            return [self._reject(BodyTooLarge(f"The request body exceeds {limit} bytes."))]
        if message.request_headers.end_of_stream:
            return [self._bodyless()]
        return [] if self.full_duplex else [protocol.continue_headers()]

    async def _on_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.size += len(body.body)
        limit = self.picker.config.limits.max_body_bytes
        if self.size > limit:
            return [self._reject(BodyTooLarge(f"The request body exceeds {limit} bytes."))]
        self.parts.append(body.body)
        if not body.end_of_stream:
            return []  # full-duplex mode: keep buffering; Envoy holds the request meanwhile
        return await self._route()

    async def _route(self) -> list[pb.ProcessingResponse]:
        self.routed = True
        raw = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        started = time.perf_counter()
        try:
            decision = await self._decide(raw, started)
            order, body = await self._execute(decision)
        except GatewayError as error:
            return [self._reject(error)]
        endpoints = self.picker.endpoints(order)
        mutation = protocol.destination_mutation(endpoints, None if body is None else len(body))
        if self.full_duplex:
            return [protocol.routed_headers(mutation, endpoints), *protocol.streamed_body(body or raw)]
        return [protocol.routed_body(mutation, endpoints, body)]

    async def _decide(self, raw: bytes, started: float) -> Decision:
        kind = _KINDS.get(self.headers.get(":path", b"").split(b"?", 1)[0].decode("latin-1"))
        if kind is None:
            raise ModelNotFound("Only /v1/chat/completions and /v1/completions are routed by model.")
        request = parse_body(raw, kind)
        headers = {k.encode(): v for k, v in self.headers.items()}
        slo = slo_override(headers)
        pool = self.picker.decider.pool_of(request)
        decider = self.picker.decider
        decision = await decider.decide(request, pool, headers, slo, self._eligible(pool), started)
        shed_at = self.picker.settings.shed_at
        if shed_at is not None and decision.utilisation(decision.plan.aggregated) >= shed_at:
            raise Shed("Every backend of this model is at capacity; retry later.")
        return decision

    def _eligible(self, pool: ModelPool) -> np.ndarray | None:
        if self.subset is None:
            return None
        mask = np.fromiter((endpoint_of(b) in self.subset for b in pool.backends), bool, len(pool.backends))
        if not mask.any():
            raise NoBackend("No endpoint of the allowed subset serves this model.")
        return mask

    async def _execute(self, decision: Decision) -> tuple[list[BackendState], bytes | None]:
        """The endpoints to hand Envoy, best first, and the rewritten body (None: forward it as is)."""
        request, pool = decision.request, decision.pool
        body = request.body
        renamed = pool.model.upstream_name != request.model
        if renamed:
            body = {**body, "model": pool.model.upstream_name}
        self.decision = decision
        if decision.plan.mode is not Mode.PD:
            self._hold(decision.aggregated[0], "aggregated")
            return decision.aggregated, _dumps(body) if renamed else None
        # The decode pod is spoken for from the moment the split is planned, not after the prefill, with
        # its KV due when the plan expects the prefill to end.
        due = kv_due(
            decision.prediction_for([decision.prefill[0], decision.decode[0]]), self.picker.registry.now()
        )
        self._hold(decision.decode[0], "decode", due)
        try:
            done = await self.picker.prefill.run(
                request,
                decision.prefill,
                self.request_id(),
                lambda backend: decision.leg_load(backend, "prefill"),
                self.reservations,
            )
        except GatewayError:
            return self._fall_back(decision, "prefill_failed"), _dumps(body) if renamed else None
        assert self.holding is not None
        self.holding.prefill_done()  # its KV is computed: Envoy sends the decode leg now
        if done.kv_transfer_params is None and done.backend.config.kv_connector == "nixl":
            # The decode pod would recompute the whole prompt: say so instead of calling it P/D (as serve).
            return self._fall_back(decision, "no_kv_params"), _dumps(body) if renamed else None
        self.mode, self.prefilled = "pd", done.backend
        self.picker.metrics.route_decisions.labels(request.model, "pd", "executed").inc()
        return decision.decode, decode_body(body, done)

    def _fall_back(self, decision: Decision, why: str) -> list[BackendState]:
        model = decision.request.model
        self._release_hold()
        if self.picker.config.routing.pd_fallback == "fail":
            self.picker.metrics.fallbacks.labels(model, "fail", why).inc()
            raise fallback_error(why)
        self.picker.metrics.fallbacks.labels(model, "aggregated", why).inc()
        self.note = f"; fallback={why}"
        self._hold(decision.aggregated[0], "aggregated")
        return decision.aggregated

    def _bodyless(self) -> pb.ProcessingResponse:
        """GET /v1/models and the like: any available backend answers (least in flight first)."""
        registry = self.picker.registry
        ready = [b for b in registry.backends.values() if registry.available(b)]
        if not ready:
            return self._reject(NoBackend("No healthy backend is available."))
        ready.sort(key=lambda b: b.in_flight)
        endpoints = self.picker.endpoints(ready)
        self.routed = True
        return protocol.routed_headers(protocol.destination_mutation(endpoints, None), endpoints)

    def request_id(self) -> str:
        """The request's id (the client's X-Request-Id, else a new one), the same for its every leg."""
        if not self._id:
            rid = self.headers.get("x-request-id")
            self._id = rid.decode("latin-1") if rid else os.urandom(16).hex()
        return self._id

    def _reject(self, error: GatewayError) -> pb.ProcessingResponse:
        model = self.decision.request.model if self.decision else "_invalid"
        self.picker.metrics.requests.labels(model, "none", str(error.status)).inc()
        return protocol.immediate(error)

    def _hold(self, backend: BackendState, leg: str, kv_due_s: float = math.nan) -> None:
        """Reserve `backend` for the leg Envoy carries (aggregated | decode), instead of any earlier one."""
        assert self.decision is not None
        self._release_hold()
        self.holding = self.picker.registry.reserve(backend, self.decision.leg_load(backend, leg, kv_due_s))
        self.reservations.append(self.holding)

    def _release_hold(self) -> None:
        if self.holding is not None:
            self.holding.release()
            self.holding = None

    # -- response -----------------------------------------------------------------------------------------

    def _on_response(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        headers = protocol.header_map(message.response_headers)
        served_at = protocol.served_of(message, headers)
        backend = self.picker.by_endpoint.get(served_at) if served_at else None
        decision = self.decision
        if decision is not None and backend not in decision.pool.backends:
            backend = None  # not a backend of this model: nothing of it to account for
        if decision is not None and backend is not None:
            self._served(decision, backend, headers.get(":status", b"200"))
            if self.prefilled is not None and self.holding is not None:
                # Envoy shows a decode leg's body only when sampled: its response headers are the
                # nearest sign that vLLM took it, so it no longer counts as waiting there.
                self.holding.first_token()
        route = self._route_text(backend) if self.picker.config.routing.route_header else None
        reply = protocol.response_headers(route, strip_served=protocol.SERVED in headers)
        if backend is not None and self._calibrates(decision, headers):
            self.timing = SampledStream(backend)
            reply.mode_override.response_body_mode = ProcessingMode.BodySendMode.STREAMED
        elif decision is not None and not decision.request.stream and self.holding is not None:
            self.holding.prefill_done()  # a whole reply: the backend's prefill is long over
        return reply

    def _calibrates(self, decision: Decision | None, headers: dict[str, bytes]) -> bool:
        """Streamed aggregated replies only (`serve` learns from the same ones), one in N."""
        return (
            decision is not None
            and self.prefilled is None
            and decision.request.stream
            and headers.get(":status") == b"200"
            and self.picker.sample_stream(decision.request.model)
        )

    def _sampled_chunk(self, body: pb.HttpBody) -> None:
        """A chunk of a sampled reply: the first is its TTFT (the prefill is over then); the last, with
        the events counted between, its TPOT. Both are learnt at the end, as `serve` learns them."""
        timing, decision = self.timing, self.decision
        if timing is None or decision is None:
            return
        now = time.perf_counter()
        if timing.add(body.body, now):
            if self.holding is not None:
                self.holding.prefill_done()
            self.picker.calibrations.labels(timing.backend.id).inc()
        if body.end_of_stream:
            timing.finish_s = now
            self._learn_sampled()

    def _learn_sampled(self) -> None:
        """Teach the cost model what the sampled reply measured, and publish it beside the plan's
        prediction in `serve`'s TTFT and TPOT histograms; once, when it ends or is cut short."""
        timing, decision = self.timing, self.decision
        self.timing = None
        if timing is None or decision is None or not timing.first_token_s:
            return
        served = timing.served()
        self.picker.decider.learn(decision, served)
        model, backends = decision.request.model, served.backends
        predicted = decision.prediction_for(backends)
        metrics = self.picker.metrics
        metrics.first_token(model, "aggregated", timing.first_token_s - decision.started, predicted)
        if served.output_tokens > 1:
            gap = (served.finish_s - served.first_token_s) / (served.output_tokens - 1)
            metrics.token_gap(model, "aggregated", gap, predicted)

    def _served(self, decision: Decision, backend: BackendState, status: bytes) -> None:
        if self.holding is None or backend is not self.holding.backend:
            # Envoy fell back to a later endpoint of the list. Why the earlier ones failed (a refused
            # connection, or a 429/503 that is only backpressure) Envoy does not say, so they are not blamed.
            self._hold(backend, "decode" if self.prefilled is not None else "aggregated")
        self._verdict(backend, int(status) if status.isdigit() else 502)
        legs = [self.prefilled, backend] if self.prefilled is not None else [backend]
        self.picker.decider.served(decision, legs)
        self.picker.metrics.requests.labels(decision.request.model, self.mode, status.decode()).inc()

    def _verdict(self, backend: BackendState, status: int) -> None:
        """Outlier detection as `serve` feeds it: the status seen as `serve`'s Upstream would see it,
        judged by the same rules (gateway/retry.py `blame`); no other backend served this request."""
        leg = "decode" if self.prefilled is not None else "aggregated"
        with self.picker.retry_policy.attempts(self.request_id(), leg) as tries:
            if status in self.picker.failing_statuses:
                tries.failed(backend, LegFailed("status", True, status))
            else:
                tries.succeeded(backend, status)

    def _route_text(self, backend: BackendState | None) -> str | None:
        if backend is None or self.decision is None:
            return None
        served = [backend] if self.prefilled is None else [self.prefilled, backend]
        return route_text(served, self.decision.prediction_for(served), self.note)


class SampledStream:
    """The timing of one sampled reply's SSE body as Envoy streams it to the EPP: when its first chunk
    came, how many events it carried (`data: ` counted across chunk boundaries), and whether it ended
    with [DONE] (a complete stream: then its output tokens are its events less [DONE], `serve`'s rule)."""

    __slots__ = ("_tail", "backend", "done", "events", "finish_s", "first_token_s")

    def __init__(self, backend: BackendState) -> None:
        self.backend = backend
        self.first_token_s = 0.0
        self.finish_s = 0.0
        self.events = 0
        self.done = False
        self._tail = b""  # the last bytes of the previous chunk: an event's `data: ` may straddle two

    def add(self, chunk: bytes, now: float) -> bool:
        """Count one chunk in; True for the first chunk with bytes in it."""
        first = not self.first_token_s and bool(chunk)
        if first:
            self.first_token_s = now
        # The tail's last 5 bytes cannot hold a whole `data: `, so no event is counted twice; its 11
        # cannot hold a whole `data: [DONE]`.
        self.events += (self._tail[-(len(_EVENT) - 1) :] + chunk).count(_EVENT)
        seen = self._tail + chunk
        self.done = self.done or _DONE in seen
        self._tail = seen[-(len(_DONE) - 1) :]
        return first

    def served(self) -> Served:
        completed = self.done and self.finish_s > 0 and self.events > 2  # [DONE] and two tokens or more
        return Served(
            (self.backend,),
            self.first_token_s,
            self.finish_s if completed else math.nan,
            self.events - 1 if completed else 0,
        )


_EVENT = b"data: "
_DONE = b"data: [DONE]"


def _dumps(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)
