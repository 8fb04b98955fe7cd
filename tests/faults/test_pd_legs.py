"""P/D as a transaction: a failed decode leg is retried on the next decode backend with the same transfer
parameters (the prefiller's KV is consumed, not left pinned), then falls back (`decode_failed`); a NIXL
prefill reply without transfer parameters is a named fallback, never a silent recompute."""

from __future__ import annotations

import socket

import httpx
import orjson
import pytest

from tests.faults.raw_backend import RawBackend, RawRequest, chat_completion, json_reply, response_head
from tests.integration.conftest import MODEL, backend, chat_body, config, gateway, metric, sim  # noqa: F401

HELD = "hetgate:kv_blocks_held_for_transfer"
PULLED = "vllm:prompt_tokens_by_source_total"
PROMPT = "a prompt long enough to fill a few KV blocks " * 8


def post(gw, **fields) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(PROMPT, **fields), timeout=15)


def pd_config(backends: list[dict], **routing) -> dict:
    # No active probes during the test: the request path alone must find the failing backend.
    return config(
        backends,
        routing={"disaggregation": "always", "policy": "least_load", **routing},
        health={"interval_s": 60},
    )


def test_failing_decode_is_retried_on_the_next_decode_with_the_same_params(sim, gateway):  # noqa: F811
    prefill, bad, good = sim(role="prefill"), sim(role="decode"), sim(role="decode")
    bad.set_faults({"error_status": 500})
    gw = gateway(
        pd_config(
            [
                backend(prefill, "p", ("prefill",), kv_connector="nixl"),
                backend(bad, "bad", ("decode",), kv_connector="nixl"),
                backend(good, "good", ("decode",), kv_connector="nixl"),
            ]
        )
    )
    for stream in (False, True, False):
        r = post(gw, stream=stream)
        assert r.status_code == 200
        assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=good"
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="bad", kind="status") >= 1
    # The retried decode pulled the prefiller's KV: nothing stays pinned there, and nothing fell back.
    assert metric(good.url, PULLED, source="external_kv_transfer") > 0
    assert metric(prefill.url, HELD) == 0
    assert metric(gw.url, "hetgate:pd_fallbacks_total") == 0
    retries = metric(gw.url, "hetgate:retries_total")
    assert retries >= 1
    assert metric(gw.url, "hetgate:pd_decode_recomputes_total") == retries  # `bad` answered each time


def test_unreachable_decode_is_retried_without_a_recompute(sim, gateway):  # noqa: F811
    prefill, good = sim(role="prefill"), sim(role="decode")
    dead = {
        "id": "dead",
        "url": "http://127.0.0.1:9",
        "model": MODEL,
        "accelerator": "h100-sxm",
        "roles": ["decode"],
        "kv_connector": "nixl",
    }
    gw = gateway(
        pd_config(
            [
                backend(prefill, "p", ("prefill",), kv_connector="nixl"),
                dead,
                backend(good, "good", ("decode",), kv_connector="nixl"),
            ]
        )
    )
    for _ in range(3):
        r = post(gw)
        assert r.status_code == 200
        assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=good"
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="dead", kind="connect") >= 1
    assert metric(gw.url, "hetgate:pd_decode_recomputes_total") == 0  # it never saw the parameters
    assert metric(prefill.url, HELD) == 0
    # Each failed attempt is in the gateway's log, as nginx's error log has it: the request's id, the
    # leg, the backend and how it failed; never the prompt.
    request_id = r.headers["x-request-id"]
    assert f"request {request_id}: decode leg on backend dead failed: connect (" in gw.log()
    assert PROMPT.split()[3] not in gw.log()


def test_decode_failed_falls_back_to_aggregated_and_says_so(sim, gateway):  # noqa: F811
    prefill, decode = sim(role="prefill"), sim(role="decode")
    decode.set_faults({"error_status": 500, "error_count": 1})  # the decode leg fails, then it recovers
    gw = gateway(
        pd_config(
            [
                backend(prefill, "p", ("prefill",), kv_connector="nixl"),
                backend(decode, "d", ("decode",), kv_connector="nixl"),
            ]
        )
    )
    r = post(gw)
    assert r.status_code == 200
    assert r.headers["x-hetgate-route"] == "mode=aggregated; backend=d; fallback=decode_failed"
    assert metric(gw.url, "hetgate:pd_fallbacks_total", to="aggregated", reason="decode_failed") == 1
    assert r.json()["usage"]["completion_tokens"] == 8


def test_decode_failed_with_fallback_off_fails_cleanly(sim, gateway):  # noqa: F811
    prefill, decode = sim(role="prefill"), sim(role="decode")
    decode.set_faults({"error_status": 500})
    gw = gateway(
        pd_config(
            [
                backend(prefill, "p", ("prefill",), kv_connector="nixl"),
                backend(decode, "d", ("decode",), kv_connector="nixl"),
            ],
            pd_fallback="fail",
        )
    )
    r = post(gw, stream=True)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == 502
    assert "decode_failed" in r.json()["error"]["message"]
    assert metric(gw.url, "hetgate:pd_fallbacks_total", to="fail", reason="decode_failed") == 1
    assert f"request {r.headers['x-request-id']}: decode leg on backend d failed: status 500" in gw.log()


def test_nixl_prefill_without_transfer_params_is_a_named_fallback(sim, gateway):  # noqa: F811
    prefiller = RawBackend(json_reply(chat_completion()))  # a 200 without kv_transfer_params
    decode = sim(role="decode")
    try:
        gw = gateway(
            pd_config(
                [
                    {
                        **backend(decode, "p"),
                        "url": prefiller.url,
                        "roles": ["prefill"],
                        "kv_connector": "nixl",
                    },
                    backend(decode, "d", ("decode",), kv_connector="nixl"),
                ]
            )
        )
        r = post(gw)
        assert r.status_code == 200
        assert r.headers["x-hetgate-route"] == "mode=aggregated; backend=d; fallback=no_kv_params"
        assert metric(gw.url, "hetgate:pd_fallbacks_total", to="aggregated", reason="no_kv_params") == 1
        assert metric(gw.url, "hetgate:route_decisions_total", mode="pd", reason="executed") == 0
        # The prefill leg asked for a transfer (NIXL's block), so the prefiller was a real P/D leg.
        assert prefiller.requests[0].json()["kv_transfer_params"]["do_remote_decode"] is True
    finally:
        prefiller.stop()


def test_decode_reply_that_breaks_before_the_client_saw_it_is_retried(sim, gateway):  # noqa: F811
    def broken(conn: socket.socket, _request: RawRequest) -> None:
        conn.sendall(response_head(200, {"Content-Type": "application/json", "Content-Length": "5000"}))
        conn.sendall(b'{"id": "chatcmpl-broken", "choi')
        conn.shutdown(socket.SHUT_RDWR)

    breaking = RawBackend(broken)
    prefill, good = sim(role="prefill"), sim(role="decode")
    try:
        raw = {"url": breaking.url, "roles": ["decode"], "kv_connector": "nixl"}
        gw = gateway(
            pd_config(
                [
                    backend(prefill, "p", ("prefill",), kv_connector="nixl"),
                    {**backend(good, "broken"), **raw},
                    backend(good, "good", ("decode",), kv_connector="nixl"),
                ]
            )
        )
        for _ in range(3):
            r = post(gw)
            assert r.status_code == 200
            assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=good"
            assert r.json()["usage"]["completion_tokens"] == 8
        assert len(breaking.requests) >= 1
        # The broken decode received the prefill's transfer parameters, the same ones `good` then used.
        assert breaking.requests[0].json()["kv_transfer_params"]["remote_port"] == int(
            prefill.url.rsplit(":", 1)[1]
        )
        assert metric(gw.url, "hetgate:upstream_errors_total", backend="broken", kind="payload") >= 1
    finally:
        breaking.stop()


def test_decode_stream_that_dies_before_its_first_byte_is_retried(sim, gateway):  # noqa: F811
    def dies(conn: socket.socket, _request: RawRequest) -> None:
        conn.sendall(
            response_head(200, {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})
        )
        conn.shutdown(socket.SHUT_RDWR)

    dying = RawBackend(dies)
    prefill, good = sim(role="prefill"), sim(role="decode")
    try:
        raw = {"url": dying.url, "roles": ["decode"], "kv_connector": "nixl"}
        gw = gateway(
            pd_config(
                [
                    backend(prefill, "p", ("prefill",), kv_connector="nixl"),
                    {**backend(good, "dying"), **raw},
                    backend(good, "good", ("decode",), kv_connector="nixl"),
                ]
            )
        )
        for _ in range(3):
            r = post(gw, stream=True)
            assert r.status_code == 200
            assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=good"
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
        assert len(dying.requests) >= 1
        assert metric(gw.url, "hetgate:upstream_errors_total", backend="dying", kind="payload") >= 1
    finally:
        dying.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_the_prefill_leg_asks_for_one_token_and_its_cache_hits_are_reported(sim, gateway, stream):  # noqa: F811
    """The prefill leg computes the prompt and nothing more: non-streamed, max_tokens (and
    max_completion_tokens) 1, without the stream's own options; the decode leg gets the client's request.
    The client's usage reports the prompt tokens the prefiller found cached (the decode's own count
    says nothing about the prompt's computation)."""
    usage = {"prompt_tokens": 60, "completion_tokens": 1, "total_tokens": 61}
    prefiller = RawBackend(
        json_reply(chat_completion(usage={**usage, "prompt_tokens_details": {"cached_tokens": 48}}))
    )
    decode = sim(role="decode")
    try:
        prefill = {**backend(decode, "p", ("prefill",), kv_connector="shared-storage"), "url": prefiller.url}
        gw = gateway(pd_config([prefill, backend(decode, "d", ("decode",), kv_connector="shared-storage")]))
        fields: dict = {"max_completion_tokens": 8, "min_tokens": 2}
        if stream:
            fields["stream_options"] = {"include_usage": True}
        r = post(gw, stream=stream, **fields)
        assert r.status_code == 200
        assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=d"
        leg = prefiller.requests[0].json()
    finally:
        prefiller.stop()
    assert (leg["stream"], leg["max_tokens"], leg["max_completion_tokens"]) == (False, 1, 1)
    assert not {"stream_options", "min_tokens", "kv_transfer_params"} & set(leg)
    assert leg["messages"] == chat_body(PROMPT)["messages"]
    assert metric(decode.url, "vllm:generation_tokens_total") == 8  # the client's max_tokens, decoded
    if stream:
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.startswith("data: {")]
        client_usage = orjson.loads(events[-1])["usage"]
    else:
        client_usage = r.json()["usage"]
    assert client_usage["completion_tokens"] == 8
    assert client_usage["prompt_tokens_details"]["cached_tokens"] == 48
