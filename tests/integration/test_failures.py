"""Every failure rule of the gateway, against simulated backends told to fail, stall or die."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.integration.conftest import MODEL, backend, chat_body, config, metric


def post(gw, body: dict, path: str = "/v1/chat/completions", **kwargs) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=kwargs.pop("timeout", 15), **kwargs)


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


def requests_seen(server) -> float:
    return metric(server.url, "vllm:request_success_total") + metric(server.url, "vllm:prompt_tokens_total")


# -- bad input: refused before any backend is touched ------------------------------------------------------


@pytest.fixture
def one(sim, gateway):
    server = sim()
    gw = gateway(config([backend(server, "a")], limits={"max_body_bytes": 4096}))
    return gw, server


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b'{"model": "sim-model", "messages": [', 400, None),
        (orjson.dumps({"model": "sim-model", "messages": [], "max_tokens": 3}), 400, "messages"),
        (orjson.dumps(chat_body(max_tokens=-1)), 400, "max_tokens"),
        (orjson.dumps(chat_body(model="gpt-9")), 404, "model"),
        (orjson.dumps(chat_body("x" * 10_000)), 413, None),
    ],
)
def test_bad_input_gets_an_openai_error_before_any_backend(one, raw, status, param):
    gw, server = one
    r = httpx.post(f"{gw.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, status)
    assert requests_seen(server) == 0


def test_chunked_body_over_the_limit_is_413(one):
    gw, server = one

    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(f"{gw.url}/v1/chat/completions", content=chunks())
    assert r.status_code == 413
    assert requests_seen(server) == 0


# -- retries: only before the first byte, on what retry.retry_on names (default: connection, 5xx, 429) -----


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_retryable_status_goes_to_the_next_backend(sim, gateway, status):
    bad, good = sim(), sim()
    bad.set_faults({"error_status": status})
    gw = gateway(config([backend(bad, "bad"), backend(good, "good")]))
    for _ in range(2):  # round robin starts on either backend; both requests must succeed
        r = post(gw, chat_body())
        assert r.status_code == 200
        assert r.headers["x-hetgate-route"] == "mode=aggregated; backend=good"
    assert metric(gw.url, "hetgate:retries_total") == 1  # exactly one of the two started on `bad`
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="bad", kind="status") == 1


@pytest.mark.parametrize("status", [400, 409])
def test_other_statuses_are_relayed_not_retried(sim, gateway, status):
    bad, good = sim(), sim()
    bad.set_faults({"error_status": status})
    gw = gateway(config([backend(bad, "bad"), backend(good, "good")], routing={"policy": "least_load"}))
    statuses = {post(gw, chat_body()).status_code for _ in range(4)}
    assert status in statuses  # the backend's own answer reached the client
    assert requests_seen(good) > 0 and 200 in statuses  # least_load alternates idle backends
    assert metric(gw.url, "hetgate:retries_total") == 0


def test_connection_refused_is_retried_elsewhere(sim, gateway):
    good = sim()
    dead = {"id": "dead", "url": "http://127.0.0.1:9", "model": MODEL, "accelerator": "h100-sxm"}
    gw = gateway(config([dead, backend(good, "good")], health={"interval_s": 60}))
    for _ in range(4):
        r = post(gw, chat_body())
        assert r.status_code == 200
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="dead", kind="connect") >= 1


def test_with_the_retry_budget_spent_only_refused_connections_are_retried(sim, gateway):
    """A refused connection cost no backend any work, so its retry takes no budget (gateway/retry.py);
    a 500's retry does, and with none left the backend's answer is relayed."""
    none_left = {"budget_percent": 0, "min_retry_concurrency": 0}
    good = sim()
    dead = {"id": "dead", "url": "http://127.0.0.1:9", "model": MODEL, "accelerator": "h100-sxm"}
    gw = gateway(config([dead, backend(good, "good")], retry=none_left, health={"interval_s": 60}))
    assert [post(gw, chat_body()).status_code for _ in range(4)] == [200] * 4
    assert metric(gw.url, "hetgate:retries_total") == 2  # round robin put `dead` first twice
    assert metric(gw.url, "hetgate:retry_budget_exhausted_total") == 0

    bad = sim()
    bad.set_faults({"error_status": 500})
    gw = gateway(config([backend(bad, "bad"), backend(good, "good")], retry=none_left))
    assert sorted(post(gw, chat_body()).status_code for _ in range(4)) == [200, 200, 500, 500]
    assert metric(gw.url, "hetgate:retries_total") == 0
    assert metric(gw.url, "hetgate:retry_budget_exhausted_total") == 2


def test_all_backends_failing_gives_the_last_error(sim, gateway):
    a, b = sim(), sim()
    a.set_faults({"error_status": 503})
    b.set_faults({"error_status": 503})
    gw = gateway(config([backend(a, "a"), backend(b, "b")]))
    r = post(gw, chat_body())
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "simulated fault"  # the backend's own answer, relayed
    for name in ("a", "b"):  # both were tried before giving up
        assert metric(gw.url, "hetgate:upstream_errors_total", backend=name, kind="status") == 1
    assert metric(gw.url, "hetgate:retries_total") == 1


def test_stall_before_first_byte_is_retried_elsewhere(sim, gateway):
    slow, fast = sim(), sim()
    slow.set_faults({"first_byte_delay_s": 3})
    gw = gateway(config([backend(slow, "slow"), backend(fast, "fast")], timeouts={"ttfb_s": 0.5}))
    statuses = [post(gw, chat_body()).status_code for _ in range(2)]
    assert statuses == [200, 200]
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="slow", kind="timeout") == 1


def test_stall_before_first_byte_is_a_504_when_timeouts_are_not_retried(sim, gateway):
    slow, fast = sim(), sim()
    slow.set_faults({"first_byte_delay_s": 3})
    cfg = config(
        [backend(slow, "slow"), backend(fast, "fast")],
        timeouts={"ttfb_s": 0.5},
        retry={"retry_on": ["connect-failure"]},
    )
    gw = gateway(cfg)
    statuses = [post(gw, chat_body()).status_code for _ in range(2)]
    assert sorted(statuses) == [200, 504]


# -- after the first byte: in-band errors, never a silent truncation ---------------------------------------


def test_backend_dying_mid_stream_ends_with_an_sse_error(sim, gateway):
    server = sim()
    server.set_faults({"close_after_chunks": 2})
    gw = gateway(config([backend(server, "a")]))
    r = post(gw, chat_body(stream=True, max_tokens=20))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert len(events) == 4  # the two chunks sent, then the gateway's error and [DONE]
    assert all(orjson.loads(e)["object"] == "chat.completion.chunk" for e in events[:2])
    assert "error" in orjson.loads(events[-2])
    assert events[-1] == "[DONE]"
    assert metric(gw.url, "hetgate:requests_total", status="502") == 1  # counted as failed, not served


def test_stall_between_chunks_ends_with_an_sse_error(sim, gateway):
    server = sim()
    server.set_faults({"chunk_delay_s": 3})
    gw = gateway(config([backend(server, "a")], timeouts={"idle_s": 0.5}))
    started = time.monotonic()
    r = post(gw, chat_body(stream=True, max_tokens=20))
    assert time.monotonic() - started < 3
    assert "error" in orjson.loads(sse_events(r.text)[-2])
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="a", kind="timeout") == 1


def test_long_generation_has_no_total_time_limit(sim, gateway):
    server = sim()
    gw = gateway(config([backend(server, "a")], timeouts={"idle_s": 0.5, "ttfb_s": 0.5}))
    # 400 tokens at 2 ms each: 0.8 s in total, longer than every deadline, never idle for long.
    r = post(gw, chat_body(stream=True, max_tokens=400, stream_options={"include_usage": True}))
    usage = orjson.loads(sse_events(r.text)[-2])["usage"]
    assert usage["completion_tokens"] == 400


# -- client disconnects cancel the upstream request --------------------------------------------------------


def test_client_disconnect_aborts_the_backend_request(sim, gateway):
    server = sim()
    gw = gateway(config([backend(server, "a")]))
    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST", f"{gw.url}/v1/chat/completions", json=chat_body(stream=True, max_tokens=5000)
        ) as r,
    ):
        next(r.iter_bytes())
    deadline = time.monotonic() + 5
    while (
        not metric(server.url, "vllm:request_success_total", finished_reason="abort")
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert metric(server.url, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(server.url, "vllm:request_success_total", finished_reason="length") == 0
    assert metric(gw.url, "hetgate:client_disconnects_total") == 1


def test_client_disconnect_during_prefill_cancels_both_legs(sim, gateway):
    prefill, decode = sim(role="prefill"), sim(role="decode")
    prefill.set_faults({"first_byte_delay_s": 30})
    cfg = config(
        [
            backend(prefill, "p", ("prefill",), kv_connector="nixl"),
            backend(decode, "d", ("decode",), kv_connector="nixl"),
        ],
        routing={"disaggregation": "always"},
    )
    gw = gateway(cfg)
    with pytest.raises(httpx.ReadTimeout):
        post(gw, chat_body(stream=True), timeout=0.5)
    # The prefill stalls for 30 s: only a cancelled request gives both reservations back within 10 s
    # (one left running would hold the decode backend until its decode leg ended).
    deadline = time.monotonic() + 10
    while metric(gw.url, "hetgate:client_disconnects_total") != 1 or metric(
        gw.url, "hetgate:backend_in_flight"
    ):
        assert time.monotonic() < deadline, "the abandoned P/D request was not cancelled"
        time.sleep(0.05)
    assert requests_seen(decode) == 0  # the decode leg never started


# -- P/D as a transaction ----------------------------------------------------------------------------------


def pd_config(prefill, decode, **routing):
    return config(
        [
            backend(prefill, "p", ("prefill",), kv_connector="nixl"),
            backend(decode, "d", ("decode",), kv_connector="nixl"),
        ],
        routing={"disaggregation": "always", **routing},
    )


def test_failed_prefill_falls_back_to_aggregated_and_says_so(sim, gateway):
    prefill, decode = sim(role="prefill"), sim(role="decode")
    prefill.set_faults({"error_status": 503})
    gw = gateway(pd_config(prefill, decode))
    r = post(gw, chat_body())
    assert r.status_code == 200
    assert r.headers["x-hetgate-route"] == "mode=aggregated; backend=d; fallback=prefill_failed"
    assert metric(gw.url, "hetgate:pd_fallbacks_total", to="aggregated") == 1
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


def test_failed_prefill_with_fallback_off_fails_cleanly(sim, gateway):
    prefill, decode = sim(role="prefill"), sim(role="decode")
    prefill.set_faults({"error_status": 503})
    gw = gateway(pd_config(prefill, decode, pd_fallback="fail"))
    r = post(gw, chat_body())
    assert r.status_code == 502
    assert r.json()["error"]["code"] == 502
    assert requests_seen(decode) == 0
    assert metric(gw.url, "hetgate:pd_fallbacks_total", to="fail") == 1


def test_decode_failed_fallback_leaves_out_the_unreachable_decode_backend(sim, gateway):
    """No retries: the decode leg tries only the first decode backend, which refuses the connection; the
    fallback to aggregated serving skips it (it was just found unreachable) and goes to the next one."""
    prefill, spare = sim(role="prefill"), sim(role="decode")
    dead = {**backend(spare, "dead", ("decode",), kv_connector="nixl"), "url": "http://127.0.0.1:9"}
    cfg = config(
        [
            backend(prefill, "p", ("prefill",), kv_connector="nixl"),
            dead,
            backend(spare, "spare", ("decode",), kv_connector="nixl"),
        ],
        routing={"disaggregation": "always", "policy": "least_load"},
        retry={"num_retries": 0},
        health={"interval_s": 60},  # no probe takes `dead` out: the request path alone must
    )
    gw = gateway(cfg)
    routes = [post(gw, chat_body()) for _ in range(3)]
    assert [r.status_code for r in routes] == [200] * 3
    fallbacks = [r for r in routes if "fallback" in r.headers["x-hetgate-route"]]
    assert {r.headers["x-hetgate-route"] for r in routes} <= {
        "mode=pd; prefill=p; decode=spare",
        "mode=aggregated; backend=spare; fallback=decode_failed",
    }
    assert fallbacks, "the dead decode backend was never tried first"
    # `dead` was tried once per fallback (the decode leg), never again by the fallback itself.
    connects = metric(gw.url, "hetgate:upstream_errors_total", backend="dead", kind="connect")
    assert connects == len(fallbacks)
    assert metric(gw.url, "hetgate:pd_fallbacks_total", reason="decode_failed") == len(fallbacks)
    assert metric(gw.url, "hetgate:retries_total") == 0


# -- health: passive ejection, active probes, return after the ejection time (more in tests/faults) ---------


def test_failing_backend_is_marked_down_then_recovers(sim, gateway):
    flaky, good = sim(), sim()
    outlier = {"consecutive_gateway_failure": 2, "base_ejection_time_s": 3}
    health = {"interval_s": 60, "outlier": outlier}
    gw = gateway(config([backend(flaky, "flaky"), backend(good, "good")], health=health))
    flaky.set_faults({"error_status": 502})
    for _ in range(6):
        assert post(gw, chat_body()).status_code == 200
    assert metric(gw.url, "hetgate:backend_healthy", backend="flaky") == 0
    assert metric(gw.url, "hetgate:backend_ejections_total", backend="flaky") == 1
    flaky.set_faults({})
    deadline = time.monotonic() + 10  # base_ejection_time_s: then it takes traffic again
    routes: list[str] = []
    while "mode=aggregated; backend=flaky" not in routes and time.monotonic() < deadline:
        routes.append(post(gw, chat_body()).headers["x-hetgate-route"])
        time.sleep(0.1)
    assert "mode=aggregated; backend=flaky" in routes
    assert metric(gw.url, "hetgate:backend_healthy", backend="flaky") == 1


def test_active_health_probe_marks_down_and_ready_reflects_it(sim, gateway):
    server = sim()
    gw = gateway(config([backend(server, "a")]))
    assert httpx.get(f"{gw.url}/ready").status_code == 200
    server.set_faults({"health_status": 503})
    until_ready_is(gw, 503)
    server.set_faults({})
    until_ready_is(gw, 200)


def until_ready_is(gw, status: int, timeout_s: float = 10.0) -> None:
    """Polls /ready until it answers `status` (probes run every 0.2 s here)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{gw.url}/ready").status_code != status:
        assert time.monotonic() < deadline, f"/ready never answered {status}"
        time.sleep(0.05)


# -- keys ------------------------------------------------------------------------------------------------


def test_gateway_keys_are_checked(sim, gateway):
    server = sim()
    gw = gateway(config([backend(server, "a")], auth={"api_keys": ["sk-right"]}))
    assert post(gw, chat_body()).status_code == 401
    assert post(gw, chat_body(), headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    assert post(gw, chat_body(), headers={"Authorization": "Bearer sk-right"}).status_code == 200
    assert httpx.get(f"{gw.url}/v1/models").status_code == 401
    assert httpx.get(f"{gw.url}/health").status_code == 200
    assert requests_seen(server) > 0


def test_each_backend_gets_its_own_key_and_the_client_key_stays_here(sim, gateway, monkeypatch):
    a, b = sim(api_key="sk-backend-a"), sim(api_key="sk-backend-b")
    monkeypatch.setenv("HG_TEST_KEY_B", "sk-backend-b")
    cfg = config(
        [backend(a, "a", api_key="sk-backend-a"), backend(b, "b", api_key_env="HG_TEST_KEY_B")],
        auth={"api_keys": ["sk-client"]},
    )
    gw = gateway(cfg)
    for _ in range(4):  # both backends: each accepts only its own key, never the client's
        r = post(gw, chat_body(), headers={"Authorization": "Bearer sk-client"})
        assert r.status_code == 200
    assert requests_seen(a) > 0 and requests_seen(b) > 0
    direct = httpx.post(
        f"{a.url}/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-client"}
    )
    assert direct.status_code == 401  # so the gateway's 200s prove it did not forward the client key
