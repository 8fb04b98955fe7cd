"""One HTTP leg to one backend, on aiohttp's client (3-10x cheaper per request than httpx in the project's
measurements of both on the same proxy loop).

Deadlines: `connect_s` to open a connection, `ttfb_s` until the response headers arrive, then `idle_s`
between two body chunks. There is deliberately no limit on a response's total duration: a long generation
that keeps streaming is healthy. Low-level errors are translated here, at one boundary, into `LegFailed`.

Backends are never followed elsewhere: a 3xx is an upstream error (a redirect would re-send the prompt to
a host the configuration does not name). A non-streamed body is read up to `max_response_bytes`, never
buffered whole beyond it.

Legs to one backend are written in the order they were opened (`SendOrder`): vLLM admits waiting
requests first come, first served, and the cost policy books each prefill behind those it planned
before (scoring/cost_policy.py `_join`). Without it, a leg that needed a new connection (a burst
beyond the pooled ones) could reach the backend after a leg opened later on a pooled connection
(docs/policies.md, twelfth pass).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractStreamWriter

from gateway.config import Timeouts
from gateway.registry import BackendState, Reservation

_ERROR_BODY_BYTES = 64 * 1024  # a backend's error body relayed to the client is at most this long


class LegFailed(Exception):
    """A leg that produced no usable response. `retryable`: it failed before the response headers, so
    another backend may be tried if `retry.retry_on` says so (gateway/retry.py)."""

    def __init__(
        self, kind: str, retryable: bool, status: int = 502, body: bytes | None = None, detail: str = ""
    ) -> None:
        super().__init__(kind)
        self.kind = kind  # connect | reset | timeout | status | redirect | payload | too_large
        self.retryable = retryable
        self.status = status
        self.body = body
        self.detail = detail  # for the log: the low-level error's class (no message: it may name hosts)

    def describe(self) -> str:
        """One phrase for the gateway's log: `reset (ServerDisconnectedError)`, `status 500`."""
        what = f"status {self.status}" if self.kind == "status" else self.kind
        return f"{what} ({self.detail})" if self.detail else what


class IdleWatchdog:
    """Calls `on_idle` when a read has waited more than `idle_s`.

    One timer per stream, re-armed only when it fires: a deadline per chunk (asyncio.timeout) cost more
    CPU than the rest of the relay. Time the consumer spends writing to a slow client does not count.
    """

    def __init__(self, idle_s: float, on_idle: Callable[[], object]) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle_s = idle_s
        self._on_idle = on_idle
        self._since = self._loop.time()
        self._active = False
        self.fired = False
        self._handle = self._loop.call_at(self._since + idle_s, self._check)

    def reading(self) -> None:
        self._since = self._loop.time()
        self._active = True

    def paused(self) -> None:
        self._active = False

    def cancel(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        if self._active and now >= self._since + self._idle_s:
            self.fired = True
            self._on_idle()
            return
        due = self._since + self._idle_s if self._active else now + self._idle_s
        self._handle = self._loop.call_at(due, self._check)


@dataclass(slots=True)
class Leg:
    backend: BackendState
    response: aiohttp.ClientResponse
    reservation: Reservation | None = None  # set by the proxy, which took it
    body: bytes | None = None  # a non-streamed reply the proxy already read (P/D decode legs)
    head: bytes = b""  # the first bytes of a stream, read before the client saw any (P/D decode legs)


class SendOrder:
    """Each backend's legs take turns to write their request, in the order they were opened.

    A leg waits only while the one opened before it to the same backend has not written its body yet:
    with a pooled connection that is one step of the event loop, with a new one the connect. Only the
    backends with a leg waiting or writing have an entry."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Future[None]] = {}

    def take(self, backend_id: str) -> tuple[asyncio.Future[None] | None, asyncio.Future[None]]:
        """The turn of the leg opened before (None: none is still writing) and this leg's own."""
        ahead = self._last.get(backend_id)
        mine = asyncio.get_running_loop().create_future()
        self._last[backend_id] = mine
        return ahead, mine

    def __len__(self) -> int:
        """The backends with a leg waiting or writing."""
        return len(self._last)

    def end(
        self, backend_id: str, turn: asyncio.Future[None], ahead: asyncio.Future[None] | None = None
    ) -> None:
        """The leg's request is written, or it will never be: the next leg may write once `ahead` (the
        turn this leg waited for, when it gave up waiting) has ended too, so the order holds. Idempotent."""
        if ahead is not None and not ahead.done():
            ahead.add_done_callback(lambda _: self.end(backend_id, turn))
            return
        if not turn.done():
            turn.set_result(None)
        if self._last.get(backend_id) is turn:
            del self._last[backend_id]


class _InTurn(aiohttp.BytesPayload):
    """A request body that ends its leg's turn (`SendOrder`) once aiohttp has written it to the
    connection (and drained it below the transport's high-water mark)."""

    def __init__(self, body: bytes, written: Callable[[], None]) -> None:
        super().__init__(body, content_type="application/json")
        self._written = written

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        try:
            await super().write_with_length(writer, content_length)
        finally:
            self._written()


class Upstream:
    def __init__(
        self,
        timeouts: Timeouts,
        failing_statuses: frozenset[int],
        max_response_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.timeouts = timeouts
        self.failing_statuses = failing_statuses  # answered as LegFailed("status"): see gateway/retry.py
        self.max_response_bytes = max_response_bytes
        self.order = SendOrder()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=300
            ),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        await self.session.close()

    async def open(self, backend: BackendState, path: str, body: bytes, request_id: str) -> Leg:
        """Send the request; return once the status and headers are in. Raises LegFailed."""
        headers = {"X-Request-Id": request_id}
        if backend.upstream_key:
            headers["Authorization"] = f"Bearer {backend.upstream_key}"
        ahead, turn = self.order.take(backend.id)
        written = functools.partial(self.order.end, backend.id, turn)
        try:
            async with asyncio.timeout(self.timeouts.ttfb_s):
                if ahead is not None:
                    await asyncio.shield(ahead)  # a leg that gives up waiting does not end that turn
                response = await self.session.post(
                    backend.config.base_url + path,
                    data=_InTurn(body, written),
                    headers=headers,
                    allow_redirects=False,
                )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as error:
            raise LegFailed("connect", retryable=True, detail=type(error).__name__) from None
        except aiohttp.ClientError as error:
            raise LegFailed("reset", retryable=True, detail=type(error).__name__) from None
        except TimeoutError:
            raise LegFailed("timeout", retryable=True, status=504, detail="no headers in ttfb_s") from None
        finally:
            # A leg that failed or was cancelled before writing must not hold up the next for longer
            # than the legs ahead of it.
            self.order.end(backend.id, turn, ahead)
        status = response.status
        if status in self.failing_statuses:
            reply = await self._read_quietly(response)
            raise LegFailed("status", retryable=True, status=status, body=reply)
        if 300 <= status < 400:
            response.close()  # its body and Location header never reach the client
            raise LegFailed("redirect", retryable=True)
        return Leg(backend, response)

    async def read(self, leg: Leg) -> bytes:
        """The whole body of a non-streamed response, at most `max_response_bytes` of it."""
        try:
            async with asyncio.timeout(self.timeouts.idle_s):
                return await _read_bounded(leg.response, self.max_response_bytes)
        except (aiohttp.ClientError, TimeoutError) as error:
            leg.response.close()
            detail = "no body in idle_s" if isinstance(error, TimeoutError) else type(error).__name__
            raise LegFailed("payload", retryable=False, detail=detail) from None
        except asyncio.CancelledError:
            leg.response.close()  # the client left: abort the backend's work too
            raise

    async def first_bytes(self, leg: Leg) -> bytes:
        """The stream's first chunk (kept in `leg.head` for `chunks`); b"" when it ended without any."""
        try:
            async with asyncio.timeout(self.timeouts.idle_s):
                leg.head = await leg.response.content.readany()
        except aiohttp.ClientError as error:
            leg.response.close()
            raise LegFailed("payload", retryable=False, detail=type(error).__name__) from None
        except TimeoutError:
            leg.response.close()
            raise LegFailed("timeout", retryable=False, detail="no first chunk in idle_s") from None
        except asyncio.CancelledError:
            leg.response.close()  # the client left: abort the backend's work too
            raise
        return leg.head

    async def chunks(self, leg: Leg) -> AsyncGenerator[bytes, None]:
        """Body chunks as they arrive; waiting more than `idle_s` for the next one ends the leg."""
        if leg.head:
            yield leg.head
        content = leg.response.content
        watchdog = IdleWatchdog(self.timeouts.idle_s, leg.response.close)
        try:
            while True:
                watchdog.reading()
                try:
                    chunk = await content.readany()
                except aiohttp.ClientError as error:
                    leg.response.close()
                    if watchdog.fired:
                        raise LegFailed("timeout", retryable=False, detail="no chunk in idle_s") from None
                    raise LegFailed("payload", retryable=False, detail=type(error).__name__) from None
                watchdog.paused()
                if not chunk:
                    return
                yield chunk
        finally:
            watchdog.cancel()

    @staticmethod
    async def _read_quietly(response: aiohttp.ClientResponse) -> bytes | None:
        try:
            async with asyncio.timeout(1.0):
                return await _read_bounded(response, _ERROR_BODY_BYTES)
        except (aiohttp.ClientError, TimeoutError, LegFailed):
            response.close()
            return None
        except asyncio.CancelledError:
            response.close()
            raise


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or LegFailed("too_large") as soon as it is known to exceed `limit` bytes."""
    declared = response.content_length
    if declared is not None and declared <= limit:
        return await response.read()  # the common case: one call, no copies
    if declared is not None:
        response.close()
        raise LegFailed("too_large", retryable=False)
    parts: list[bytes] = []
    size = 0
    while chunk := await response.content.readany():
        size += len(chunk)
        if size > limit:
            response.close()
            raise LegFailed("too_large", retryable=False)
        parts.append(chunk)
    response.release()
    return b"".join(parts)
