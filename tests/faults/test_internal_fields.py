"""Nothing a client sends steers the infrastructure: internal body fields, headers, backend redirects."""

from __future__ import annotations

import socket

import httpx
import orjson
import pytest

from tests.faults.raw_backend import RawBackend, RawRequest, chat_completion, json_reply, response_head
from tests.integration.conftest import MODEL, backend, chat_body, config, gateway, metric, sim  # noqa: F401

STEERING = {
    "do_remote_prefill": True,
    "remote_host": "10.0.0.99",
    "remote_port": 5600,
    "remote_engine_id": "x",
    "remote_request_id": "someone-elses",
    "remote_block_ids": [[1]],
}


def raw(server: RawBackend, id_: str = "raw", **extra) -> dict:
    return {"id": id_, "url": server.url, "model": MODEL, "accelerator": "h100-sxm", **extra}


@pytest.fixture
def capture():
    server = RawBackend(json_reply(chat_completion()))
    yield server
    server.stop()


def test_kv_transfer_params_are_stripped_and_nothing_else_changes(capture, gateway):  # noqa: F811
    gw = gateway(config([raw(capture)]))
    body = chat_body(kv_transfer_params=STEERING, temperature=0.5, some_vendor_field={"a": 1})
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200
    forwarded = capture.requests[-1].json()
    assert "kv_transfer_params" not in forwarded
    assert forwarded == {k: v for k, v in body.items() if k != "kv_transfer_params"}


def test_a_body_without_internal_fields_is_forwarded_byte_for_byte(capture, gateway):  # noqa: F811
    gw = gateway(config([raw(capture)]))
    # Odd spacing and key order survive only if the gateway did not re-serialise the body.
    sent = (
        b'{"model":"sim-model",  "messages":[{"role":"user","content":"kv_transfer_params?"}]'
        b' ,"max_tokens":3}'
    )
    r = httpx.post(
        f"{gw.url}/v1/chat/completions", content=sent, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200
    assert capture.requests[-1].body == sent


def test_an_escaped_field_name_is_stripped_too(capture, gateway):  # noqa: F811
    gw = gateway(config([raw(capture)]))
    sent = (
        b'{"model":"sim-model","messages":[{"role":"user","content":"x"}],"kv_transfer\\u005fparams":{"a":1}}'
    )
    r = httpx.post(
        f"{gw.url}/v1/chat/completions", content=sent, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200
    assert "kv_transfer_params" not in capture.requests[-1].json()


def test_reject_mode_answers_400_before_any_backend(capture, gateway):  # noqa: F811
    gw = gateway(config([raw(capture)], limits={"internal_fields": "reject"}))
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x", "kv_transfer_params": {}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"
    assert r.json()["error"]["code"] == 400
    assert capture.requests == []
    assert httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200


def test_stripped_in_pd_too(sim, gateway):  # noqa: F811
    """A client's params never reach the decode leg: the prefill leg's own are sent, or none."""
    prefill, decode = sim(role="prefill"), sim(role="decode")
    cfg = config(
        [
            backend(prefill, "p", ("prefill",), kv_connector="nixl"),
            backend(decode, "d", ("decode",), kv_connector="nixl"),
        ],
        routing={"disaggregation": "always"},
    )
    gw = gateway(cfg)
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(kv_transfer_params=STEERING), timeout=10)
    assert r.status_code == 200
    assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=d"
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0


def test_client_headers_never_reach_the_backend(capture, gateway):  # noqa: F811
    gw = gateway(config([raw(capture, api_key="sk-backend")], auth={"api_keys": ["sk-client"]}))
    headers = {
        "Authorization": "Bearer sk-client",
        "X-Gateway-Destination-Endpoint": "10.0.0.99:8000",
        "X-Hetgate-Route": "mode=pd; prefill=evil",
        "X-Forwarded-Host": "evil.example",
        "X-Data-Parallel-Rank": "3",
        "Cookie": "session=secret",
        "X-Request-Id": "client-id-1",
    }
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers=headers, timeout=10)
    assert r.status_code == 200
    sent = capture.requests[-1].headers
    assert sent["authorization"] == "Bearer sk-backend"
    assert sent["x-request-id"] == "client-id-1"
    gateway_built = {"authorization", "x-request-id", "content-type", "content-length", "host", "accept"}
    assert set(sent) <= gateway_built, set(sent) - gateway_built


def test_an_unsafe_request_id_is_replaced_by_a_fresh_one(capture, gateway):  # noqa: F811
    """vLLM uses X-Request-Id as its internal id: only a short id of plain characters is passed on."""
    gw = gateway(config([raw(capture)]))
    for unsafe in ("../other-request", "x" * 129, "id with spaces"):
        headers = {"X-Request-Id": unsafe}
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers=headers, timeout=10)
        assert r.status_code == 200
        sent = capture.requests[-1].headers["x-request-id"]
        assert sent != unsafe and len(sent) == 32 and int(sent, 16) >= 0  # 128 random bits, in hex
        assert r.headers["x-request-id"] == sent  # the client learns the id its request ran under


def test_a_backend_redirect_is_never_followed(sim, gateway):  # noqa: F811
    target = RawBackend(json_reply(chat_completion("redirected")))

    def redirect(conn: socket.socket, _request: RawRequest) -> None:
        head = {"Location": f"{target.url}/v1/chat/completions", "Content-Length": "0"}
        conn.sendall(response_head(307, head))

    redirecting = RawBackend(redirect)
    try:
        gw = gateway(config([raw(redirecting, "redirecting")]))
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
        assert r.status_code == 502
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert target.url not in r.text
        assert len(redirecting.requests) == 1
        assert target.requests == []  # the prompt never went to the other host
        assert metric(gw.url, "hetgate:upstream_errors_total", backend="redirecting", kind="redirect") == 1
    finally:
        target.stop()
        redirecting.stop()


def test_a_redirecting_backend_is_skipped_for_a_good_one(sim, gateway):  # noqa: F811
    good = sim()

    def redirect(conn: socket.socket, _request: RawRequest) -> None:
        conn.sendall(
            response_head(302, {"Location": good.url + "/v1/chat/completions", "Content-Length": "0"})
        )

    redirecting = RawBackend(redirect)
    try:
        gw = gateway(config([raw(redirecting, "redirecting"), backend(good, "good")]))
        for _ in range(2):
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
            assert r.status_code == 200
            assert r.headers["x-hetgate-route"] == "mode=aggregated; backend=good"
        assert orjson.loads(r.content)["object"] == "chat.completion"
    finally:
        redirecting.stop()
