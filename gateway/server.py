"""The HTTP server `hetgate serve` runs: uvicorn with httptools, plus the limits an edge proxy needs.

uvicorn's httptools protocol has no header size limit (httptools concatenates a header's pieces, so one
64 MiB header blocked the event loop for seconds), no header or body read timeout, and its
`limit_concurrency` answers a text/plain 503. `GuardedProtocol` adds, per connection and at the cost of a
few attribute checks per read:

  - header bytes and header count limits: 431 (OpenAI-shaped), counted on the raw bytes before the parser
    concatenates anything, so a huge header costs at most one socket read past the limit;
  - a header read timeout from the connection's (or request's) first byte: 408 (slowloris);
  - a body read timeout: the whole body must arrive within `body_timeout_s` of its headers: 408;
  - a cap on open connections per process: the request on a connection over the cap gets a 503 and the
    connection is closed, instead of new clients being reset once the process runs out of descriptors;
  - malformed requests get an OpenAI-shaped 400 instead of uvicorn's text/plain one.

The keep-alive idle timeout is uvicorn's own (`timeout_keep_alive`). A rejected connection lingers
(reading and discarding, as nginx's lingering close) for up to `LINGER_S` so the client can read the answer
rather than a reset while it is still sending.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from types import FrameType
from typing import Any, Protocol, runtime_checkable

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.supervisors import Multiprocess

from gateway.config import ServerConfig
from gateway.errors import error_body

log = logging.getLogger("hetgate")

LINGER_S = 2.0  # how long a rejected connection is still read (and discarded) before it is closed
_FD_HEADROOM = 64  # descriptors kept for listeners, logs, Redis, pollers

# Connection phases: reading a request's head, reading its body, or neither (idle or answering).
_IDLE, _HEAD, _BODY = 0, 1, 2

_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}
_REASONS[503] = "Service Unavailable"
_TYPES = {400: "BadRequestError", 408: "RequestTimeoutError", 431: "RequestHeaderFieldsTooLarge"}
_TYPES[503] = "ServiceUnavailableError"


class _Reject(Exception):
    """Raised from a parser callback: answer `status` and close the connection; `reason` is counted."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@runtime_checkable
class CountsRejections(Protocol):
    """An app that counts what the server's limits refused (gateway/app.py's HotPathApp)."""

    def count_rejection(self, reason: str) -> None: ...


def _uncounted(_reason: str) -> None:
    """For an app that does not count rejections."""


class HetgateUvicornConfig(uvicorn.Config):
    """uvicorn's config plus our limits; pickled whole into each worker process."""

    def __init__(self, *args: Any, server_limits: ServerConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_limits = server_limits


def rejection(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, with an OpenAI-shaped error body."""
    body = error_body(status, message, _TYPES[status])
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header/body limits and timeouts and a connection cap."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any], **kw: Any):
        super().__init__(config, server_state, app_state, **kw)
        assert isinstance(config, HetgateUvicornConfig)
        limits = config.server_limits
        self.max_header_bytes = limits.max_header_bytes
        self.max_headers = limits.max_headers
        self.header_timeout_s = limits.header_timeout_s
        self.body_timeout_s = limits.body_timeout_s
        self.max_connections = limits.max_connections
        self.phase = _HEAD  # a new connection must send a request head in time
        self.head_bytes = 0  # raw bytes of the current head in earlier reads (an upper bound)
        self.chunk_len = 0  # bytes in the read being parsed
        self.over_cap = False
        self.rejected = False
        self.timer: asyncio.TimerHandle | None = None
        app = config.loaded_app
        self.count_rejection = app.count_rejection if isinstance(app, CountsRejections) else _uncounted

    # -- connection events ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.over_cap = len(self.connections) > self.max_connections
        self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.rejected:
            return  # lingering: read and drop until closed
        self._unset_keepalive_if_required()
        self.chunk_len = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:
            cause = error.__context__
            if isinstance(cause, _Reject):
                self._reject(cause.status, cause.reason, cause.message)
            else:
                self._reject(400, "malformed", "Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            pass  # as uvicorn without websockets: served as plain HTTP/1.1 (curl --http2 asks for h2c)
        except httptools.HttpParserError:
            self._reject(400, "malformed", "Invalid HTTP request received.")
            return
        # Timers are armed only when a read leaves a head or body incomplete (rare): a request that arrives
        # in one read costs no timer at all.
        if self.phase == _HEAD:
            # Still in a head: count the raw bytes before httptools has to concatenate any more of them.
            self.head_bytes += len(data)
            if self.head_bytes > self.max_header_bytes:
                self._reject(
                    431, "header_too_large", f"The request head exceeds {self.max_header_bytes} bytes."
                )
            elif self.timer is None:
                self._arm(self.header_timeout_s)
        elif self.phase == _BODY and self.timer is None:
            self._arm(self.body_timeout_s)  # the body did not arrive with its head: it has a deadline

    # -- parser callbacks ----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.phase = _HEAD
        self.head_bytes = 0

    def on_headers_complete(self) -> None:
        if self.timer is not None:
            self._disarm()
        if len(self.headers) > self.max_headers:
            raise _Reject(431, "too_many_headers", f"The request has more than {self.max_headers} headers.")
        if self.head_bytes + self.chunk_len > self.max_header_bytes and self._head_size() > (
            self.max_header_bytes
        ):
            # The head completed within one large read, so the raw-byte count never saw it whole.
            raise _Reject(431, "header_too_large", f"The request head exceeds {self.max_header_bytes} bytes.")
        if self.over_cap:
            raise _Reject(503, "connection_limit", "The gateway is at its connection limit; retry shortly.")
        self.phase = _BODY
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.phase = _IDLE
        if self.timer is not None:
            self._disarm()
        super().on_message_complete()

    def _head_size(self) -> int:
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    # -- timers and rejection ------------------------------------------------------------------------
    def _arm(self, delay_s: float) -> None:
        self._disarm()
        self.timer = self.loop.call_later(delay_s, self._on_timer)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self) -> None:
        self.timer = None
        if self.rejected or self.transport.is_closing():
            return
        if self.phase == _HEAD:
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm(self.header_timeout_s)  # a pipelined head waits on us, not on the client
                return
            self._reject(408, "header_timeout", "The request head was not received in time.")
        elif self.phase == _BODY:
            if self.cycle is not None and self.cycle.response_started:
                self.transport.close()  # answered without the rest of the body (413): just stop waiting
            elif self.flow.read_paused:
                self._arm(self.body_timeout_s)  # the application is not reading: we are the slow side
            else:
                self._reject(408, "body_timeout", "The request body was not received in time.")

    def _reject(self, status: int, reason: str, message: str) -> None:
        """Answer and close; keep reading (discarding) a short while so the client sees the answer."""
        self._disarm()
        self.rejected = True
        self.count_rejection(reason)
        if self.transport.is_closing():
            return
        self.transport.write(rejection(status, message))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.timer = self.loop.call_later(LINGER_S, self.transport.close)


def raise_fd_limit() -> int:
    """Raise the open-file soft limit to the hard limit (connections are descriptors); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def check_fd_budget(limits: ServerConfig, fd_limit: int) -> None:
    """Each proxied request holds two descriptors (client and backend): warn if the cap cannot be met."""
    needed = 2 * limits.max_connections + _FD_HEADROOM
    if fd_limit != resource.RLIM_INFINITY and needed > fd_limit:
        log.warning(
            "server.max_connections=%d needs about %d open files but the limit is %d: "
            "new clients may be reset before the cap answers 503",
            limits.max_connections,
            needed,
            fd_limit,
        )


@runtime_checkable
class Drainable(Protocol):
    """An app that can stop reporting ready (gateway/app.py's HotPathApp)."""

    def begin_drain(self) -> None: ...


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful drain, as a load balancer's backend should stop.

    The first SIGTERM (or SIGINT) turns `/ready` to 503 at once while requests keep being served for
    `drain_grace_s`, so load balancers and Kubernetes endpoints take this process out before it stops
    listening; then uvicorn's own shutdown closes the listener, lets requests in flight finish for up to
    `drain_timeout_s`, and exits. A second signal exits at once, as uvicorn does.
    """

    draining = False
    _loop: asyncio.AbstractEventLoop | None = None  # set once serving: signals arrive on another stack

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        self._loop.call_soon_threadsafe(self._begin_drain, sig, frame)

    def _begin_drain(self, sig: int, frame: FrameType | None) -> None:
        app = self.config.loaded_app
        if isinstance(app, Drainable):
            app.begin_drain()
        assert isinstance(self.config, HetgateUvicornConfig)
        grace = self.config.server_limits.drain_grace_s
        log.warning("draining: not ready now, closing the listener in %.1f s", grace)
        assert self._loop is not None
        self._loop.call_later(grace, super().handle_exit, sig, frame)


def serve(app: str, host: str, port: int, workers: int, log_level: str, limits: ServerConfig) -> None:
    """uvicorn.run, with our protocol class and limits (the config is pickled into each worker)."""
    check_fd_budget(limits, raise_fd_limit())
    config = HetgateUvicornConfig(
        app,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http=GuardedProtocol,
        ws="none",
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # X-Forwarded-* from clients is not trusted; nothing here reads it
        server_header=False,
        log_level=log_level,
        timeout_keep_alive=limits.keepalive_timeout_s,
        timeout_graceful_shutdown=max(1, round(limits.drain_timeout_s)),
        server_limits=limits,
    )
    server = DrainingServer(config)
    if workers > 1:
        Multiprocess(config, sockets=[config.bind_socket()]).run()
    else:
        server.run()
    if workers == 1 and not server.started:
        raise SystemExit(3)  # uvicorn's STARTUP_FAILURE
