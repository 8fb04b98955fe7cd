"""The floor of the named stack: the least a Python proxy on uvicorn + aiohttp can do per request.

A raw ASGI callable that reads the body, forwards it to one backend with aiohttp's client and returns the
reply (non-streamed whole, streamed chunk by chunk). No routing, no checks, no metrics. `hetgate bench
overhead` runs it beside hetgate, so the table shows how much of hetgate's cost is the stack's own.

    python -m bench.floor_proxy UPSTREAM_URL PORT
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn


class FloorProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.upstream + scope["path"], data=body, headers=headers) as response:
            content_type = response.headers.get("Content-Type", "application/json").encode()
            start = {"type": "http.response.start", "status": response.status}
            await send({**start, "headers": [(b"content-type", content_type)]})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main(argv: list[str]) -> int:
    upstream, port = argv[0], int(argv[1])
    uvicorn.run(
        FloorProxy(upstream), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
        access_log=False, log_level="warning", lifespan="on",
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
