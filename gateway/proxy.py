"""Execute a RoutePlan: aggregated with retries, or prefill/decode as one transaction with fallbacks.

Rules (what nginx and Envoy promise: retry only before the first byte, in-band errors after it):
- Retry on the next backend of the plan only before any byte reached the client, as `retry` says
  (gateway/retry.py: `retry_on`, `num_retries`, retry budget); each attempt's outcome feeds outlier detection.
- Once bytes were sent, a failure ends the stream on an event boundary with vLLM's in-band
  `data: {"error": ...}` event and `data: [DONE]`; nothing follows `[DONE]`; a backend stream that ends
  without `[DONE]` was cut and is reported the same way (gateway/sse.py cuts the events).
- P/D: the prefill leg is non-streamed with max_tokens=1; its `kv_transfer_params` go verbatim into the
  decode leg; both legs share one X-Request-Id. A decode leg that fails (connection, 5xx) is retried on
  the next decode backend with the same parameters, so the prefiller's KV is consumed rather than left
  pinned. If the prefill fails, a NIXL prefiller returns no transfer parameters, or every decode try
  fails, the request falls back to aggregated serving (or fails cleanly, per `routing.pd_fallback`),
  counted in metrics with its reason and named in the route header.
- Reservations: each attempt reserves its backend (Registry.reserve) in `Exchange.reservations`; a finished
  prefill leg gives its own back at once, and the handler releases all of them in one `finally`
  (gateway/handler.py), whatever way the request ends. A failed attempt keeps its reservation until then:
  the backend that failed counts as busy with the request a peer now serves, so a least-load ranking
  does not read a backend that fails fast as free capacity and send it the next requests too (in
  `hetgate bench soak`, a backend answering 500 drew 10 requests in 75 ms and their retries overran
  the retry budget; gRPC's weighted round robin penalises errors as load for the same reason).
- A client that disconnects cancels this coroutine; closing the upstream response aborts the backend's work.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config import GatewayConfig
from gateway.decision import route_text
from gateway.errors import GatewayError, NoBackend, UpstreamFailed, sse_error_event
from gateway.metrics import GatewayMetrics
from gateway.registry import BackendState, Registry, Reservation
from gateway.retry import RetryPolicy
from gateway.schemas import ParsedRequest
from gateway.sse import EventCutter, EventTooLarge, UsageRewriter
from gateway.upstream import Leg, LegFailed, Upstream
from scoring.load import kv_due, leg_load
from scoring.types import LegLoad, Prediction

Send = Callable[[dict[str, Any]], Awaitable[None]]
PredictionFor = Callable[[Sequence[BackendState]], Prediction | None]
LoadOf = Callable[[BackendState, str, float], LegLoad]


def _nothing() -> None:
    return None


def _unpriced(backends: Sequence[BackendState]) -> Prediction | None:
    return None


def _unplanned(backend: BackendState, leg: str, kv_due_s: float) -> LegLoad:
    return leg_load(leg, 0, 1, 0, kv_due_s)  # no plan, no estimate: the leg counts, its work is unknown


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
# After [DONE], read at most this much for this long to keep the connection; else close it.
_DRAIN_BYTES = 64 * 1024
_DRAIN_S = 1.0


@dataclass(slots=True)
class Exchange:
    """One client request on its way through the gateway."""

    request: ParsedRequest
    request_id: str
    started: float
    route_header: bool
    upstream_body: bytes
    # What a leg puts on a backend (`Decision.leg_load`: the plan's tokens, cache and predicted prefill).
    load_of: LoadOf = _unplanned
    predicted: PredictionFor = _unpriced  # the plan's prediction, if it priced the backends that served
    measured: Callable[[], None] = _nothing  # a stream's times are in: teach the router (the handler's)
    # The backends in `served` answered: they hold the prompt's prefix from now on (the handler's).
    opened: Callable[[], None] = _nothing
    served: list[BackendState] = field(default_factory=list)
    mode: str = "aggregated"
    responded: bool = False  # True once the status line went out: errors must then travel in-band
    ttft_s: float = 0.0  # streamed responses: time to the first chunk sent to the client
    prefill_done_s: float = 0.0  # split: when the prefill leg's result came (perf_counter)
    finished_s: float = 0.0  # streamed responses: when the last event went out, if the stream completed
    events: int = 0  # SSE data events of a completed stream, [DONE] included
    reservations: list[Reservation] = field(default_factory=list)

    def release_all(self) -> None:
        """Give back every reservation this request took (the handler's `finally` calls it)."""
        for reservation in self.reservations:
            reservation.release()


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
        leg = await self._open_first(ex, order, ex.request.kind.path, ex.upstream_body, "aggregated")
        ex.mode = "aggregated"
        ex.served = [leg.backend]
        ex.opened()
        await self._relay(ex, leg, send, note, rewrite_cached=None)

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
        # The decode backend is spoken for from the moment the split is planned, not after the prefill,
        # with its KV due when the plan expects the prefill to end.
        due = kv_due(ex.predicted([prefill[0], decode[0]]), self.registry.now())
        planned = self._reserve(ex, decode[0], "decode", due)
        try:
            done = await self._prefill(ex, prefill)
        except GatewayError:
            planned.release()
            await self._fall_back(ex, fallback, send, "prefill_failed")
            return
        planned.prefill_done()  # its KV is computed: the decode leg goes out now
        if done.kv_transfer_params is None and done.backend.config.kv_connector == "nixl":
            # The decode backend would recompute the whole prompt: say so instead of calling it P/D.
            planned.release()
            await self._fall_back(ex, fallback, send, "no_kv_params")
            return
        body = dict(ex.request.body)
        if done.kv_transfer_params is not None:
            body["kv_transfer_params"] = done.kv_transfer_params
        unreachable: list[BackendState] = []
        try:
            leg = await self._open_first(
                ex, decode, ex.request.kind.path, orjson.dumps(body), "decode", planned, unreachable
            )
        except GatewayError:
            # A decode backend that answered (e.g. a 500 after a failed KV pull) may still serve the
            # request aggregated; one that could not be reached is left out.
            order = [b for b in fallback if b not in unreachable]
            await self._fall_back(ex, order, send, "decode_failed")
            return
        ex.mode = "pd"
        ex.served = [done.backend, leg.backend]
        ex.opened()
        self.metrics.route_decisions.labels(model, "pd", "executed").inc()
        await self._relay(ex, leg, send, "", rewrite_cached=done.cached_tokens)

    async def _prefill(self, ex: Exchange, order: Sequence[BackendState]) -> Prefilled:
        body = dict(ex.request.body)
        for key in _DROPPED_ON_PREFILL:
            body.pop(key, None)
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        encoded: dict[bool, bytes] = {}

        def body_for(backend: BackendState) -> bytes:
            # Encoded when a backend of its kind is tried first: a 16k-token prompt is ~70 us of orjson,
            # and most requests never try a second kind.
            nixl = backend.config.kv_connector == "nixl"
            if nixl not in encoded:
                params = {"kv_transfer_params": NIXL_PREFILL_PARAMS} if nixl else {}
                encoded[nixl] = orjson.dumps({**body, **params})
            return encoded[nixl]

        leg = await self._open_first(ex, order, ex.request.kind.path, body_for, "prefill")
        try:
            raw = await self._read_tracked(ex, leg)
        except LegFailed:
            raise UpstreamFailed("The prefill leg broke.") from None
        finally:
            assert leg.reservation is not None
            leg.reservation.release()  # the prefill's work is over; the decode may run for minutes
        if leg.response.status != 200:
            self._note_failure(ex, leg.backend, LegFailed("status", False, leg.response.status))
            raise UpstreamFailed("The prefill leg failed.")
        ex.prefill_done_s = time.perf_counter()
        return _prefilled(leg.backend, raw)

    async def _fall_back(self, ex: Exchange, order: Sequence[BackendState], send: Send, why: str) -> None:
        model = ex.request.model
        if self.config.routing.pd_fallback == "fail" or not order:
            self.metrics.fallbacks.labels(model, "fail", why).inc()
            raise UpstreamFailed(f"Prefill/decode serving failed ({why}) and no fallback is allowed.")
        self.metrics.fallbacks.labels(model, "aggregated", why).inc()
        await self.aggregated(ex, order, send, note=f"; fallback={why}")

    # -- shared machinery -----------------------------------------------------------------------------------

    def _reserve(
        self, ex: Exchange, backend: BackendState, leg: str, kv_due_s: float = math.nan
    ) -> Reservation:
        reservation = self.registry.reserve(backend, ex.load_of(backend, leg, kv_due_s))
        ex.reservations.append(reservation)
        return reservation

    async def _open_first(
        self,
        ex: Exchange,
        order: Sequence[BackendState],
        path: str,
        body: bytes | Callable[[BackendState], bytes],
        leg_kind: str,
        planned: Reservation | None = None,
        unreachable: list[BackendState] | None = None,
    ) -> Leg:
        """Open the leg on the first backend that answers; retries follow the rules in the module doc.

        A decode leg also moves on after a 5xx (the next decode backend gets the same transfer parameters);
        `planned` is the reservation taken for the first backend when the request was planned; backends
        that refused the connection are added to `unreachable` when given.
        """
        last: LegFailed | None = None
        answered = False  # a decode backend saw these transfer parameters (it may have consumed the KV)
        with self.retry_policy.attempts(ex.request_id, leg_kind) as tries:
            for i, backend in enumerate(order):
                if i > 0:
                    self.metrics.retries.labels(ex.request.model).inc()
                    if answered:
                        self.metrics.decode_recomputes.labels(ex.request.model).inc()
                data = body if isinstance(body, bytes) else body(backend)
                if i == 0 and planned is not None and planned.backend is backend:
                    reservation = planned
                else:
                    if i == 0 and planned is not None:
                        planned.release()  # planned on a backend this leg does not start on
                    reservation = self._reserve(ex, backend, leg_kind)
                try:
                    leg = await self.upstream.open(backend, path, data, ex.request_id)
                    if leg_kind == "decode":
                        await self._check_decode(ex, leg)
                except LegFailed as failure:
                    tries.failed(backend, failure)  # its reservation stays until the request ends
                    answered = answered or (leg_kind == "decode" and failure.kind != "connect")
                    if unreachable is not None and failure.kind == "connect":
                        unreachable.append(backend)
                    last = failure
                    if not (failure.retryable and tries.should_retry(failure, i + 1, len(order))):
                        break
                    continue
                tries.succeeded(backend, leg.response.status)
                leg.reservation = reservation
                return leg
        raise _final_error(last)

    async def _check_decode(self, ex: Exchange, leg: Leg) -> None:
        """A decode leg that fails before the client saw a byte moves on to the next decode backend: a
        reply that breaks while it is read (client not streaming), a stream that ends or breaks before
        its first byte. (A 5xx never gets here: Upstream.open raises it, gateway/retry.py
        `failing_statuses`.)"""
        try:
            if not ex.request.stream:
                leg.body = await self.upstream.read(leg)
            elif leg.response.status == 200 and not await self.upstream.first_bytes(leg):
                raise LegFailed("payload", retryable=True)
        except LegFailed as failure:
            raise LegFailed(failure.kind, retryable=failure.kind == "payload") from None

    def _note_failure(self, ex: Exchange, backend: BackendState, failure: LegFailed) -> None:
        self.retry_policy.note(backend, failure, ex.request_id)

    async def _read_tracked(self, ex: Exchange, leg: Leg) -> bytes:
        try:
            return await self.upstream.read(leg)
        except LegFailed as failure:
            self._note_failure(ex, leg.backend, failure)
            raise

    async def _relay(self, ex: Exchange, leg: Leg, send: Send, note: str, rewrite_cached: int | None) -> None:
        """Send the chosen leg's response to the client, streamed if the client asked for a stream; the
        route header names `ex.served` (and `note`, e.g. why a split fell back)."""
        headers = [(b"content-type", leg.response.headers.get("Content-Type", "application/json").encode())]
        if ex.route_header:
            route = route_text(ex.served, ex.predicted(ex.served), note)
            headers.append((b"x-hetgate-route", route.encode()))
        headers.append((b"x-request-id", ex.request_id.encode()))
        status = leg.response.status
        if ex.request.stream and status == 200:
            await self._stream(ex, leg, send, headers, rewrite_cached)
            return
        body = leg.body if leg.body is not None else await self._read_tracked(ex, leg)
        if rewrite_cached is not None and status == 200:
            body = UsageRewriter(rewrite_cached).rewrite_json(body)
        ex.responded = True
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self._observe(ex, status)  # before the response ends, as `_stream` does
        await send({"type": "http.response.body", "body": body})

    async def _stream(
        self,
        ex: Exchange,
        leg: Leg,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        rewrite_cached: int | None,
    ) -> None:
        rewriter = UsageRewriter(rewrite_cached) if rewrite_cached is not None else None
        cutter = EventCutter(self.config.limits.max_response_bytes)
        chunks = self.upstream.chunks(leg)
        first_at = 0.0
        events = 0
        failure: LegFailed | None = None
        ex.responded = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            async for chunk in chunks:
                whole = cutter.feed(chunk)
                if not whole:
                    continue
                if not first_at:
                    first_at = time.perf_counter()
                    ex.ttft_s = first_at - ex.started
                    if leg.reservation is not None:
                        leg.reservation.first_token()
                if rewriter is not None:
                    whole = rewriter.rewrite_events(whole)
                events += whole.count(b"data: ")
                await send({"type": "http.response.body", "body": whole, "more_body": True})
                if cutter.done:
                    break
                if cutter.overflowed:
                    raise EventTooLarge
            if not cutter.done:
                failure = LegFailed("truncated", retryable=False)
        except EventTooLarge:
            failure = LegFailed("too_large", retryable=False)
        except LegFailed as error:
            failure = error
        finally:
            if not cutter.done:
                leg.response.close()  # aborts the backend's generation (client gone, or stream broke)
                await chunks.aclose()
        if failure is None:
            self.registry.record_success(leg.backend)
            ex.finished_s, ex.events = time.perf_counter(), events
        else:
            # The partial event (cutter.partial) is dropped: the error starts on an event boundary.
            self._note_failure(ex, leg.backend, failure)
            message = _STREAM_ERRORS.get(failure.kind, "The backend stream broke.")
            await send({"type": "http.response.body", "body": sse_error_event(message), "more_body": True})
        # Counted before the response ends: a client that reads the end and scrapes /metrics finds it.
        self._observe(ex, 200 if failure is None else 502, first_at, events)
        await send({"type": "http.response.body", "body": b""})
        if failure is None:
            await self._drain(leg, chunks)

    async def _drain(self, leg: Leg, chunks: AsyncGenerator[bytes, None]) -> None:
        """After [DONE] (the client is served): read the backend's last bytes so its connection is reused;
        a backend that keeps writing is cut off."""
        if leg.reservation is not None:
            leg.reservation.release()
        if leg.response.content.at_eof():  # the usual case: the body's end came with [DONE]
            await chunks.aclose()
            return
        drained = 0
        try:
            async with asyncio.timeout(_DRAIN_S):
                async for chunk in chunks:
                    drained += len(chunk)
                    if drained > _DRAIN_BYTES:
                        break
        except (LegFailed, TimeoutError):
            drained = _DRAIN_BYTES + 1
        finally:
            if drained > _DRAIN_BYTES:
                leg.response.close()
            await chunks.aclose()

    def _observe(self, ex: Exchange, status: int, first_at: float = 0.0, events: int = 0) -> None:
        now = time.perf_counter()
        model, mode = ex.request.model, ex.mode
        self.metrics.requests.labels(model, mode, str(status)).inc()
        self.metrics.e2e.labels(model, mode).observe(now - ex.started)
        if not first_at:
            return
        predicted = ex.predicted(ex.served)
        self.metrics.first_token(model, mode, first_at - ex.started, predicted)
        if events > 2:
            self.metrics.token_gap(model, mode, (now - first_at) / (events - 2), predicted)
        ex.measured()


_STREAM_ERRORS = {
    "truncated": "The backend stream ended before [DONE].",
    "too_large": "A backend stream event exceeds limits.max_response_bytes.",
    "timeout": "The backend stream stalled.",
}


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
