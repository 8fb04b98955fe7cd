"""A tiny misbehaving HTTP backend on a raw loopback socket, for fault tests the simulator cannot stage.

`RawBackend(script)` listens on a free port in a thread; each connection's request is parsed (request
line, headers, Content-Length body), recorded in `.requests`, and handed with the socket to
`script(conn, request)`, which writes whatever bytes the test wants (half an event, a redirect, ...).
The connection is closed when the script returns. The gateway's own GETs (health probe, /metrics poll)
are answered with an empty 200 and not recorded.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import orjson


@dataclass(slots=True)
class RawRequest:
    line: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> dict:
        return orjson.loads(self.body)


Script = Callable[[socket.socket, RawRequest], None]


class RawBackend:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[RawRequest] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            request = _read_request(conn)
            if request is None:
                return
            if request.line.startswith("GET "):
                conn.sendall(response_head(200, {"Content-Length": "0"}))
                return
            self.requests.append(request)
            # OSError: the gateway hung up first; what the test looks at is the gateway's side.
            with contextlib.suppress(OSError):
                self.script(conn, request)

    def stop(self) -> None:
        self._listener.close()


def _read_request(conn: socket.socket) -> RawRequest | None:
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(65536)
        if not part:
            return None
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        part = conn.recv(65536)
        if not part:
            break
        body += part
    return RawRequest(line, headers, body)


def response_head(status: int, headers: dict[str, str], reason: str = "X") -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def json_reply(body: dict, status: int = 200) -> Script:
    payload = orjson.dumps(body)

    def script(conn: socket.socket, _request: RawRequest) -> None:
        head = {"Content-Type": "application/json", "Content-Length": str(len(payload))}
        conn.sendall(response_head(status, head) + payload)

    return script


def sse_reply(*writes: bytes) -> Script:
    """A streamed reply without Content-Length (close-delimited), then the connection closes."""

    def script(conn: socket.socket, _request: RawRequest) -> None:
        head = {"Content-Type": "text/event-stream", "Connection": "close"}
        conn.sendall(response_head(200, head))
        for data in writes:
            conn.sendall(data)

    return script


def chat_completion(content: str = "hi", **extra: object) -> dict:
    return {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 1,
        "model": "sim-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        **extra,
    }
