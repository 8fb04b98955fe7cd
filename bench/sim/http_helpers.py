"""Small pieces of the simulated server's HTTP layer: SSE framing with chunk faults, JSON replies and
errors shaped like vLLM's (FastAPI's), the API-key check."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from bench.sim.engine_api import SimRequest
from bench.sim.faults import RequestFaults
from bench.sim.protocol import ParsedRequest, RequestError


class StreamCut(Exception):
    """The fault plan cut this stream."""


class InjectedStreamError(Exception):
    """The fault plan fails this stream in-band."""


class SseWriter:
    """Writes `data: {json}\\n\\n` frames, applying the request's chunk faults."""

    def __init__(self, request: web.Request, response: web.StreamResponse, faults: RequestFaults) -> None:
        self._request, self._response, self._faults = request, response, faults
        self._sent = 0

    async def send(self, chunk: dict[str, Any]) -> None:
        await self._write(b"data: " + orjson.dumps(chunk) + b"\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self._response.write_eof()

    async def send_error(self, error: dict[str, Any]) -> None:
        """vLLM's mid-stream failure: an error event, then [DONE] (after the headers said 200)."""
        await self._response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        await self._response.write(b"data: [DONE]\n\n")
        await self._response.write_eof()

    async def _write(self, frame: bytes) -> None:
        faults = self._faults
        if faults.close_after_chunks is not None and self._sent >= faults.close_after_chunks:
            abort(self._request)
            raise StreamCut
        if faults.stream_error_after_chunks is not None and self._sent >= faults.stream_error_after_chunks:
            raise InjectedStreamError
        if faults.chunk_delay_s and self._sent:
            await asyncio.sleep(faults.chunk_delay_s)
        await self._response.write(frame)
        self._sent += 1


def abort(request: web.Request) -> web.StreamResponse:
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)  # never sent: the connection is gone


def response_id_of(sim_request: SimRequest, parsed: ParsedRequest) -> str:
    return sim_request.request_id.rsplit("-", 2)[0]


async def read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"JSON decode error: {exc}", err_type="Bad Request", param="body") from exc


def json_reply(body: Any, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


@web.middleware
async def not_found_as_fastapi(request: web.Request, handler: Any) -> web.StreamResponse:
    """FastAPI's bodies for unknown paths and methods, which clients of vLLM see."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_reply({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_reply({"detail": "Method Not Allowed"}, 405)


def require_api_key(key: str) -> Any:
    """vLLM's --api-key: every /v1 route needs the bearer token, else 401 {"error": "Unauthorized"}."""
    expected = f"Bearer {key}"

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1") and request.headers.get("Authorization") != expected:
            return json_reply({"error": "Unauthorized"}, 401)
        return await handler(request)

    return check
