"""In-flight accounting is exact on every exit path: after clients leave at every phase, retries, fallbacks
and errors, `hetgate:backend_in_flight` is back to 0 for every backend (gateway/handler.py releases each
request's reservations in one `finally`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from bench.sim.simple_engine import SimpleEngineConfig
from tests.integration.conftest import MODEL, backend, chat_body, config, gateway, metric, sim  # noqa: F401


def in_flight(gw, family: str = "hetgate:backend_in_flight") -> dict[str, float]:
    """A per-backend gauge (`backend` label first) by backend id."""
    values = {}
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(family + "{"):
            series, _, value = line.rpartition(" ")
            values[series.split('backend="', 1)[1].split('"', 1)[0]] = float(value)
    return values


PENDING = "hetgate:backend_pending_decode_legs"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def all_zero(gw) -> bool:
    return all(v == 0 for v in in_flight(gw).values())


def abandon(gw, body: dict, after_s: float) -> None:
    """Send a request and hang up after `after_s` (before the response headers arrive)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=after_s))


def abandon_mid_stream(gw, body: dict) -> None:
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        next(r.iter_bytes())


def in_parallel(n: int, fn: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_disconnect_before_response_headers_leaves_nothing_in_flight(sim, gateway):  # noqa: F811
    a, b = sim(), sim()
    a.set_faults({"first_byte_delay_s": 1.5})
    b.set_faults({"first_byte_delay_s": 1.5})
    gw = gateway(config([backend(a, "a"), backend(b, "b")], routing={"policy": "least_load"}))
    waiter = threading.Thread(target=abandon, args=(gw, chat_body(), 1.0))
    waiter.start()
    # The metric is live: the request is counted while it waits for the backend.
    assert wait_until(lambda: sum(in_flight(gw).values()) == 1, 5)
    waiter.join()
    in_parallel(8, lambda: abandon(gw, chat_body(), 0.3))
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)
    assert metric(gw.url, "hetgate:client_disconnects_total") == 9


def test_disconnect_mid_stream_leaves_nothing_in_flight(sim, gateway):  # noqa: F811
    a = sim()
    gw = gateway(config([backend(a, "a")]))
    in_parallel(6, lambda: abandon_mid_stream(gw, chat_body(stream=True, max_tokens=3000)))
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)


def pd_gateway(sim, gateway, **routing):  # noqa: F811
    prefill, decode, spare = sim(role="prefill"), sim(role="decode"), sim(role="decode")
    cfg = config(
        [
            backend(prefill, "p", ("prefill",), kv_connector="nixl"),
            backend(decode, "d", ("decode",), kv_connector="nixl"),
            backend(spare, "d2", ("decode",), kv_connector="nixl"),
        ],
        routing={"disaggregation": "always", "policy": "least_load", **routing},
    )
    return gateway(cfg), prefill, decode, spare


def test_disconnect_during_pd_prefill_releases_both_legs(sim, gateway):  # noqa: F811
    gw, prefill, _, _ = pd_gateway(sim, gateway)
    prefill.set_faults({"first_byte_delay_s": 1.5})
    waiter = threading.Thread(target=abandon, args=(gw, chat_body(stream=True), 1.0))
    waiter.start()
    # Planned P/D: the prefill backend and the decode backend are both reserved during the prefill, and
    # the decode leg is pending there (its KV is not computed yet).
    assert wait_until(lambda: in_flight(gw)["p"] == 1 and in_flight(gw)["d"] + in_flight(gw)["d2"] == 1, 5)
    pending = in_flight(gw, PENDING)
    assert pending["p"] == 0 and pending["d"] + pending["d2"] == 1, pending
    waiter.join()
    in_parallel(6, lambda: abandon(gw, chat_body(stream=True), 0.3))
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)


def test_a_decode_leg_stops_pending_when_its_prefill_leg_ends(sim, gateway):  # noqa: F811
    """From the prefill leg's reply on, the decode leg is on its way to the decoder (it queues there in
    order): it no longer counts as pending, while the decoder takes its time to the first byte."""
    gw, _, decode, spare = pd_gateway(sim, gateway)
    for backend_sim in (decode, spare):
        backend_sim.set_faults({"first_byte_delay_s": 1.5})
    waiter = threading.Thread(target=abandon, args=(gw, chat_body(stream=True), 1.0))
    waiter.start()
    assert wait_until(lambda: in_flight(gw)["p"] == 0 and in_flight(gw)["d"] + in_flight(gw)["d2"] == 1, 5)
    pending = in_flight(gw, PENDING)
    waiter.join()
    assert set(pending.values()) == {0.0}, pending
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)


def test_disconnect_during_pd_decode_stream(sim, gateway):  # noqa: F811
    gw, _, _, _ = pd_gateway(sim, gateway)
    in_parallel(4, lambda: abandon_mid_stream(gw, chat_body(stream=True, max_tokens=3000)))
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)


def test_a_finished_prefill_leg_gives_its_backend_back_during_the_decode(sim, gateway):  # noqa: F811
    """The prefill's work ends with its reply: a decode that streams for minutes does not keep the
    prefill backend looking busy to the next request's ranking (gateway/proxy.py)."""
    gw, _, _, _ = pd_gateway(sim, gateway)
    body = chat_body(stream=True, max_tokens=3000)
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r,
    ):
        assert r.headers["x-hetgate-route"].startswith("mode=pd; prefill=p; ")
        chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
        next(chunks)
        flights = in_flight(gw)
        assert flights["p"] == 0, flights
        assert flights["d"] + flights["d2"] == 1, flights
        pending = in_flight(gw, PENDING)  # the decode leg went out with the KV: no longer pending
        assert set(pending.values()) == {0.0}, pending
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)
    assert set(in_flight(gw, PENDING).values()) == {0.0}


def test_retries_fallbacks_and_errors_leave_nothing_in_flight(sim, gateway):  # noqa: F811
    gw, prefill, decode, _ = pd_gateway(sim, gateway)
    decode.set_faults({"error_status": 500})  # decode retried on d2
    statuses = {httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10).status_code
                for _ in range(4)}  # fmt: skip
    prefill.set_faults({"error_status": 503})  # falls back to aggregated
    statuses |= {httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10).status_code
                 for _ in range(4)}  # fmt: skip
    assert statuses == {200}  # d's 500s were retried on d2; the prefill's 503s fell back to aggregated
    assert metric(gw.url, "hetgate:pd_fallbacks_total", to="aggregated", reason="prefill_failed") == 4
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)


def test_connection_refused_retry_releases_the_dead_backend(sim, gateway):  # noqa: F811
    good = sim()
    dead = {"id": "dead", "url": "http://127.0.0.1:9", "model": MODEL, "accelerator": "h100-sxm"}
    gw = gateway(config([dead, backend(good, "good")], health={"interval_s": 60}))
    in_parallel(6, lambda: httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10))
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="dead", kind="connect") >= 1
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)


def test_a_failed_attempt_counts_on_its_backend_until_the_request_ends(sim, gateway):  # noqa: F811
    """A backend that fails fast must not look idle to least-load while its request is served elsewhere
    (gateway/proxy.py): its attempt's reservation is held until the request ends, then released."""
    bad = sim()
    bad.set_faults({"error_status": 500})
    good = sim(simple_engine=SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.02))
    gw = gateway(config([backend(bad, "bad"), backend(good, "good")]))  # round robin: bad first
    body = chat_body(stream=True, max_tokens=100)
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert "backend=good" in r.headers["x-hetgate-route"]
        chunks = r.iter_bytes()  # one iterator: a dropped one closes the response
        next(chunks)
        assert in_flight(gw) == {"bad": 1.0, "good": 1.0}
        for _ in chunks:
            pass
    assert metric(gw.url, "hetgate:retries_total") == 1
    assert wait_until(lambda: all_zero(gw)), in_flight(gw)
