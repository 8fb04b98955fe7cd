"""The hot path: /v1/chat/completions and /v1/completions as a raw ASGI callable.

FastAPI's request/response layers cost ~100 us a request (measured, proxy-stack-measurements.md), so the
two endpoints that carry traffic read the body and write the response on the ASGI interface directly. In
order: authorize, read the body under the size limit, check the fields we read (schemas.py), find the
model's pool, decide (gateway/decision.py, the same decision `hetgate epp` makes: features and the one
awaited index lookup, SLO headers, candidates, plan), and proxy; afterwards record what the backends now
hold and let a router that learns learn. Every error before a backend is touched is an OpenAI-shaped
JSON error.

Nothing a client sends steers the infrastructure: fields only the gateway may set (`INTERNAL_FIELDS`) are
removed from the body (or refused, `limits.internal_fields`), and no client header is forwarded (the
upstream request carries only headers the gateway builds: content type, a checked X-Request-Id, the
backend's own key). The request's backend reservations are released in one place, `_serve`'s `finally`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.admission import Admission
from gateway.decision import Decider, Decision, Served, SloOverride
from gateway.decision import slo_override as _slo_override
from gateway.errors import BadRequest, BodyTooLarge, GatewayError, Unauthorized, UpstreamFailed
from gateway.metrics import GatewayMetrics
from gateway.proxy import Exchange, Proxy
from gateway.registry import ModelPool
from gateway.schemas import Kind, ParsedRequest, parse_body
from gateway.upstream import LegFailed
from scoring.types import Mode

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_SAFE_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")
# Body fields only the gateway may set: with real vLLM, kv_transfer_params tells a decode node which host
# to pull KV from (a client could aim it at any host, or at another request's KV).
INTERNAL_FIELDS = ("kv_transfer_params",)
_LEG_ERRORS = {
    "too_large": "The backend response exceeds limits.max_response_bytes.",
    "timeout": "The backend response stalled.",
}


class ClientGone(Exception):
    """The client disconnected while we were still reading its request."""


class CompletionHandler:
    def __init__(
        self,
        decider: Decider,
        proxy: Proxy,
        metrics: GatewayMetrics,
        api_keys: tuple[str, ...],
        max_body_bytes: int,
        route_header: bool,
        reject_internal_fields: bool = False,
        admission: Admission | None = None,
    ) -> None:
        self.decider = decider
        self.proxy = proxy
        self.metrics = metrics
        self.key_digests = tuple(hashlib.sha256(k.encode()).digest() for k in api_keys)
        self.max_body_bytes = max_body_bytes
        self.route_header = route_header
        self.reject_internal_fields = reject_internal_fields
        self.admission = admission

    async def __call__(self, kind: Kind, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        headers = dict(scope["headers"])
        if scope.get("http_version") == "1.0":
            send = Http10Send(send)  # an HTTP/1.0 client cannot read chunked framing
        try:
            self.authorize(headers.get(b"authorization"))
            raw = await self._read_body(headers, receive)
            request = parse_body(raw, kind)
            slo = _slo_override(headers)
            pool = self.decider.pool_of(request)
            upstream_body = self._upstream_body(request, pool)
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
            upstream_body=upstream_body,
        )
        work = self._serve if self.admission is None else self._admitted
        await _cancel_on_disconnect(
            work(exchange, pool, send, headers, slo), receive, self._count_disconnect(request)
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

    async def _admitted(
        self,
        ex: Exchange,
        pool: ModelPool,
        send: Send,
        headers: dict[bytes, bytes],
        slo: SloOverride = (None, None),
    ) -> None:
        """Admission control (gateway/admission.py: 429 + Retry-After over a limit), then the request."""
        assert self.admission is not None
        try:
            ticket = await self.admission.admit(headers, ex.request)
        except GatewayError as error:
            await self._fail(ex, send, error)
            return
        try:
            await self._serve(ex, pool, send, headers, slo)
        finally:
            ticket.release()

    def _upstream_body(self, request: ParsedRequest, pool: ModelPool) -> bytes:
        """The body sent upstream: the client's bytes unless a field must go or the model is renamed."""
        body = request.body
        internal = [name for name in INTERNAL_FIELDS if name in body]  # dict lookups, no byte scan
        if internal and self.reject_internal_fields:
            raise BadRequest(f"'{internal[0]}' may only be set by the gateway.", internal[0])
        for name in internal:
            del body[name]  # the P/D legs are built from the body too
        served = pool.model.upstream_name
        if served == request.model and not internal:
            return request.raw  # forwarded byte for byte: no re-serialisation on the common path
        body["model"] = served
        return orjson.dumps(body)

    async def _serve(
        self,
        ex: Exchange,
        pool: ModelPool,
        send: Send,
        headers: dict[bytes, bytes],
        slo: SloOverride = (None, None),
    ) -> None:
        try:
            await self._route(ex, pool, send, headers, slo)
        finally:
            ex.release_all()  # the one place a request's reservations end, however it ended
            self.metrics.legs_ended(r.backend for r in ex.reservations)

    async def _route(
        self, ex: Exchange, pool: ModelPool, send: Send, headers: dict[bytes, bytes], slo: SloOverride
    ) -> None:
        try:
            decision = await self.decider.decide(ex.request, pool, headers, slo, started=ex.started)
            ex.load_of = decision.leg_load
            ex.predicted = decision.prediction_for
            ex.measured = lambda: self._learn(ex, decision)
            # Recorded when the backends answer, not when the reply ends: a conversation's next turn, or
            # a sibling sharing the prompt, may arrive while this one still streams (the EPP records at
            # the response headers too; SGLang's cache_aware at the routing decision).
            ex.opened = lambda: self.decider.served(decision, ex.served)
            if decision.plan.mode is Mode.PD:
                aggregated = decision.aggregated  # the fallback order
                await self.proxy.disaggregated(ex, decision.prefill, decision.decode, aggregated, send)
            else:
                await self.proxy.aggregated(ex, decision.aggregated, send)
        except LegFailed as failure:
            message = _LEG_ERRORS.get(failure.kind, "The backend response broke.")
            await self._fail(ex, send, UpstreamFailed(message))
        except GatewayError as error:
            await self._fail(ex, send, error)

    def _learn(self, ex: Exchange, decision: Decision) -> None:
        """What a streamed request's times teach the router (the proxy calls it through `ex.measured`
        before the stream's end goes out, so a client that read the end finds what it taught)."""
        if ex.ttft_s and ex.served:
            completed = ex.finished_s > 0 and ex.events > 2  # [DONE] and at least two tokens
            served = Served(
                tuple(ex.served),
                ex.started + ex.ttft_s,
                ex.finished_s if completed else math.nan,
                ex.events - 1 if completed else 0,
                ex.prefill_done_s or math.nan,
            )
            self.decider.learn(decision, served)

    async def _fail(self, ex: Exchange, send: Send, error: GatewayError) -> None:
        self.metrics.requests.labels(ex.request.model, ex.mode, str(error.status)).inc()
        if not ex.responded:
            await send_error(send, error, self.route_header, ex.request_id)

    def _count_disconnect(self, request: ParsedRequest) -> Callable[[], None]:
        return lambda: self.metrics.client_disconnects.labels(request.model).inc()


async def send_error(send: Send, error: GatewayError, route_header: bool, request_id: str = "") -> None:
    """The OpenAI-shaped error; once the request has an id (it was valid), the id the gateway's log names
    it by, as a successful reply carries it."""
    body = error.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.extend(error.headers)
    if route_header:
        headers.append((b"x-hetgate-route", b"mode=none"))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
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


class Http10Send:
    """Holds a streamed response for an HTTP/1.0 client and sends it whole, with Content-Length.

    uvicorn frames a response without Content-Length as chunked whatever the client's version, and an
    HTTP/1.0 client cannot read that. Replies that already carry Content-Length pass straight through.
    """

    def __init__(self, send: Send) -> None:
        self._send = send
        self._start: dict[str, Any] | None = None
        self._parts: list[bytes] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            if any(name == b"content-length" for name, _ in message.get("headers", ())):
                await self._send(message)
            else:
                self._start = message
            return
        if self._start is None:
            await self._send(message)
            return
        self._parts.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = b"".join(self._parts)
        headers = [*self._start["headers"], (b"content-length", str(len(body)).encode())]
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
