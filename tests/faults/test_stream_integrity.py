"""Broken streams stay well formed: errors land on event boundaries, nothing follows [DONE], and a stream
that ends without [DONE] is reported in band, never passed on as complete."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import orjson

from tests.faults.raw_backend import RawBackend, RawRequest, response_head, sse_reply
from tests.integration.conftest import MODEL, backend, chat_body, config, gateway, sim  # noqa: F401

EVENT = (
    b'data: {"id":"e","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
)
DONE = b"data: [DONE]\n\n"


def raw(server: RawBackend) -> dict:
    return {"id": "raw", "url": server.url, "model": MODEL, "accelerator": "h100-sxm"}


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_through(gateway, script) -> bytes:  # noqa: F811
    server = RawBackend(script)
    try:
        gw = gateway(config([raw(server)]))
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), timeout=10)
        assert r.status_code == 200
        return r.content
    finally:
        server.stop()


def assert_well_formed(body: bytes) -> list[bytes]:
    """Every event is a whole `data:` line that parses; [DONE] comes once, last."""
    assert body.endswith(b"\n\n")
    events = body.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events), events
    assert events.count(b"data: [DONE]") == 1 and events[-1] == b"data: [DONE]", events
    for event in events[:-1]:
        orjson.loads(event[6:])
    return events


def test_backend_dying_mid_event_gets_the_error_on_an_event_boundary(gateway):  # noqa: F811
    def script(conn: socket.socket, _request: RawRequest) -> None:
        conn.sendall(
            response_head(200, {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})
        )
        conn.sendall(chunked(EVENT + EVENT[:30]))  # one whole event and the start of the next
        conn.shutdown(socket.SHUT_RDWR)  # dies mid-event, mid-chunked-body

    events = assert_well_formed(stream_through(gateway, script))
    assert events[0] + b"\n\n" == EVENT
    assert "error" in orjson.loads(events[-2][6:])
    assert len(events) == 3  # the partial event was dropped, not glued to the error


def test_stream_ending_without_done_becomes_an_in_band_error(gateway):  # noqa: F811
    events = assert_well_formed(stream_through(gateway, sse_reply(EVENT, EVENT)))
    assert len(events) == 4
    error = orjson.loads(events[-2][6:])["error"]
    assert "[DONE]" in error["message"] and error["code"] == 502


def test_nothing_is_sent_after_done(gateway):  # noqa: F811
    body = stream_through(
        gateway, sse_reply(EVENT, DONE + b'data: {"late": 1}\n\n', b'data: {"later": 2}\n\n')
    )
    assert body == EVENT + DONE


def test_the_reply_ends_at_done_even_if_the_backend_keeps_the_stream_open(gateway):  # noqa: F811
    """[DONE] ends the client's reply at once: a backend that leaves its stream open after it is not
    waited for (its idle timeout would otherwise land an error after [DONE])."""
    release = threading.Event()

    def script(conn: socket.socket, _request: RawRequest) -> None:
        conn.sendall(
            response_head(200, {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})
        )
        conn.sendall(chunked(EVENT + DONE))
        release.wait(30)  # open, silent, until the test is over

    server = RawBackend(script)
    try:
        gw = gateway(config([raw(server)], timeouts={"idle_s": 1.0}))
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), timeout=10)
        assert r.content == EVENT + DONE
    finally:
        release.set()
        server.stop()


def test_events_split_across_chunks_arrive_whole(gateway):  # noqa: F811
    def script(conn: socket.socket, _request: RawRequest) -> None:
        conn.sendall(
            response_head(200, {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})
        )
        for piece in (EVENT[:10], EVENT[10:] + EVENT[:50], EVENT[50:], DONE[:7], DONE[7:]):
            conn.sendall(chunked(piece))
            time.sleep(0.02)  # separate reads on the gateway's side
        conn.sendall(b"0\r\n\r\n")

    assert stream_through(gateway, script) == EVENT + EVENT + DONE


def test_an_event_over_the_size_limit_ends_the_stream_in_band(gateway):  # noqa: F811
    """A backend event that grows past limits.max_response_bytes without ending is not buffered on: the
    client gets the events before it, then the error and [DONE]."""
    huge = b'data: {"id":"e","choices":[{"delta":{"content":"' + b"x" * 40_000
    server = RawBackend(sse_reply(EVENT, huge[:20_000], huge[20_000:]))
    try:
        gw = gateway(config([raw(server)], limits={"max_response_bytes": 16384}))
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), timeout=10)
    finally:
        server.stop()
    assert r.status_code == 200
    events = assert_well_formed(r.content)
    assert len(events) == 3 and events[0] + b"\n\n" == EVENT
    assert "max_response_bytes" in orjson.loads(events[1][6:])["error"]["message"]


def test_pd_stream_cut_by_the_decode_backend_ends_cleanly(sim, gateway):  # noqa: F811
    prefill, decode = sim(role="prefill"), sim(role="decode")
    decode.set_faults({"close_after_chunks": 3})
    cfg = config(
        [
            backend(prefill, "p", ("prefill",), kv_connector="nixl"),
            backend(decode, "d", ("decode",), kv_connector="nixl"),
        ],
        routing={"disaggregation": "always"},
    )
    gw = gateway(cfg)
    body = chat_body(stream=True, max_tokens=20, stream_options={"include_usage": True})
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
    # Under load the cut can come before the decode's first byte reached the gateway: that is retried,
    # here as the named fallback (which the fault then cuts too).
    assert r.headers["x-hetgate-route"] in (
        "mode=pd; prefill=p; decode=d",
        "mode=aggregated; backend=d; fallback=decode_failed",
    )
    events = assert_well_formed(r.content)
    assert "error" in orjson.loads(events[-2][6:])
