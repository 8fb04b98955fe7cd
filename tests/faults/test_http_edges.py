"""The smaller promises at the HTTP edge: framework errors are OpenAI-shaped, the API docs are not public
when keys are configured, an HTTP/1.0 client gets a reply it can read, and an oversized backend reply is
cut with a 502 instead of being buffered whole."""

from __future__ import annotations

import socket

import httpx
import orjson
import pytest

from tests.faults.raw_backend import RawBackend, RawRequest, chat_completion, json_reply, response_head
from tests.integration.conftest import MODEL, backend, chat_body, config, gateway, sim  # noqa: F401


def assert_openai_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status


def test_docs_need_no_key_on_an_open_gateway_and_are_off_with_keys(sim, gateway):  # noqa: F811
    server = sim()
    open_gw = gateway(config([backend(server, "a")]))
    assert httpx.get(f"{open_gw.url}/openapi.json").status_code == 200
    keyed = gateway(config([backend(server, "a")], auth={"api_keys": ["sk-right"]}))
    auth = {"Authorization": "Bearer sk-right"}
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_openai_error(httpx.get(f"{keyed.url}{path}"), 404)
        assert_openai_error(httpx.get(f"{keyed.url}{path}", headers=auth), 404)


def test_framework_errors_are_openai_shaped(sim, gateway):  # noqa: F811
    gw = gateway(config([backend(sim(), "a")]))
    assert_openai_error(httpx.get(f"{gw.url}/v1/nothing-here"), 404)
    assert_openai_error(httpx.get(f"{gw.url}/v1/chat/completions"), 405)
    assert_openai_error(httpx.post(f"{gw.url}/v1/models"), 405)
    assert_openai_error(httpx.delete(f"{gw.url}/health"), 405)


def http10(url: str, body: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        reply = b""
        while part := conn.recv(65536):
            reply += part
    return reply


@pytest.mark.parametrize("stream", [True, False])
def test_http10_client_gets_a_reply_without_chunked_framing(sim, gateway, stream):  # noqa: F811
    gw = gateway(config([backend(sim(), "a")]))
    reply = http10(gw.url, orjson.dumps(chat_body(stream=stream)))
    head, _, body = reply.partition(b"\r\n\r\n")
    headers = head.lower().split(b"\r\n")
    assert headers[0].startswith(b"http/1.1 200") or headers[0].startswith(b"http/1.0 200")
    assert not any(h.startswith(b"transfer-encoding") for h in headers)
    length = [int(h.split(b":")[1]) for h in headers if h.startswith(b"content-length")]
    assert length == [len(body)]
    if stream:
        assert body.endswith(b"data: [DONE]\n\n")
    else:
        assert orjson.loads(body)["object"] == "chat.completion"


def big_reply(content_length: bool):
    payload = orjson.dumps(chat_completion("x" * 20_000))

    def script(conn: socket.socket, _request: RawRequest) -> None:
        head = {"Content-Type": "application/json", "Connection": "close"}
        if content_length:
            head["Content-Length"] = str(len(payload))
        conn.sendall(response_head(200, head))
        for i in range(0, len(payload), 4096):
            conn.sendall(payload[i : i + 4096])

    return script


@pytest.mark.parametrize("content_length", [True, False])
def test_an_oversized_backend_reply_is_cut_with_a_502(gateway, content_length):  # noqa: F811
    server = RawBackend(big_reply(content_length))
    small = RawBackend(json_reply(chat_completion("fits")))
    try:
        raw = {"model": MODEL, "accelerator": "h100-sxm"}
        gw = gateway(config([{"id": "big", "url": server.url, **raw}], limits={"max_response_bytes": 16384}))
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
        assert_openai_error(r, 502)
        assert "max_response_bytes" in r.json()["error"]["message"]
        fits = gateway(
            config([{"id": "small", "url": small.url, **raw}], limits={"max_response_bytes": 16384})
        )
        assert httpx.post(f"{fits.url}/v1/chat/completions", json=chat_body(), timeout=10).status_code == 200
    finally:
        server.stop()
        small.stop()
