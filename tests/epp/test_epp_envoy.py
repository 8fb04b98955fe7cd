"""`hetgate epp` behind a real Envoy: the EPP protocol end to end, on loopback, over simulated backends."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.ports import free_port
from bench.sim.simple_engine import SimpleEngineConfig
from tests.faults.raw_backend import RawBackend, chat_completion, json_reply
from tests.integration.conftest import MODEL, backend, chat_body, config, metric, route_parts

SLOW = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.05)
QUIET_HEALTH = {"interval_s": 60.0, "failure_threshold": 5}  # the EPP keeps believing a dead backend is up


def post(base: str, body: dict | None = None, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body or chat_body(), timeout=15)


def served_by(response: httpx.Response) -> str:
    return response.headers["x-hetgate-route"].split("backend=")[1].split(";")[0]


def endpoint(server) -> str:  # type: ignore[no-untyped-def]
    return server.url.removeprefix("http://")


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def pool_of(sim, epp, envoy, n=2, cfg_extra=None, epp_args=(), **envoy_kwargs):  # type: ignore[no-untyped-def]
    servers = [sim() for _ in range(n)]
    cfg = config([backend(s, f"b{i}") for i, s in enumerate(servers)], **(cfg_extra or {}))
    picker = epp(cfg, *epp_args)
    proxy = envoy(picker.grpc_port, [s.url for s in servers], **envoy_kwargs)
    return proxy, picker, servers


# -- routing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("full_duplex", [True, False], ids=["full-duplex", "buffered"])
def test_envoy_sends_each_request_where_the_epp_says(sim, epp, envoy, full_duplex):
    proxy, picker, servers = pool_of(sim, epp, envoy, full_duplex=full_duplex)
    routes = [served_by(post(proxy.url)) for _ in range(4)]
    assert routes == ["b0", "b1", "b0", "b1"]  # round robin, decided by the EPP, carried out by Envoy
    for server in servers:
        assert metric(server.url, "vllm:request_success_total") == 2
    # The served endpoint reached the EPP (its requests counter) and never the client.
    assert metric(picker.metrics_url, "hetgate:requests_total", mode="aggregated", status="200") == 4
    response = post(proxy.url)
    assert "x-gateway-destination-endpoint-served" not in response.headers
    assert response.json()["object"] == "chat.completion"


@pytest.mark.parametrize("full_duplex", [True, False], ids=["full-duplex", "buffered"])
def test_large_body_and_completions_pass_intact(sim, epp, envoy, full_duplex):
    server = sim(max_model_len=100_000)
    picker = epp(config([backend(server, "b0")]))
    proxy = envoy(picker.grpc_port, [server.url], full_duplex=full_duplex)
    prompt = "many-words " * 12_000  # ~130 KB: several 64 KiB chunks each way in full-duplex mode
    response = post(proxy.url, {"model": MODEL, "prompt": prompt, "max_tokens": 2}, "/v1/completions")
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] > 5_000
    assert metric(server.url, "vllm:prompt_tokens_total") == response.json()["usage"]["prompt_tokens"]


def test_original_dst_cluster_routes_on_the_header(sim, epp, envoy):
    servers = [sim() for _ in range(2)]
    cfg = config([backend(s, f"b{i}") for i, s in enumerate(servers)])
    picker = epp(cfg, "--max-endpoints", "1")  # ORIGINAL_DST reads one ip:port, not a list
    proxy = envoy(picker.grpc_port, [], template="envoy-original-dst.yaml")
    assert [served_by(post(proxy.url)) for _ in range(4)] == ["b0", "b1", "b0", "b1"]


def test_client_cannot_pick_the_endpoint(sim, epp, envoy):
    proxy, _, servers = pool_of(sim, epp, envoy)
    forged = {"x-gateway-destination-endpoint": endpoint(servers[1])}
    routes = [
        served_by(httpx.post(f"{proxy.url}/v1/chat/completions", json=chat_body(), headers=forged))
        for _ in range(2)
    ]
    assert routes == ["b0", "b1"]


def test_bodyless_requests_reach_a_backend(sim, epp, envoy):
    proxy, _, _ = pool_of(sim, epp, envoy)
    models = httpx.get(f"{proxy.url}/v1/models", timeout=10)
    assert models.status_code == 200
    assert models.json()["data"][0]["id"] == MODEL


# -- fallbacks and subsets ----------------------------------------------------------------------------------


def test_ranked_fallbacks_take_over_from_a_dead_endpoint(sim, epp, envoy):
    alive = sim()
    dead = {**backend(alive, "dead"), "url": dead_url()}
    cfg = config([dead, backend(alive, "alive")], health=QUIET_HEALTH)
    picker = epp(cfg)
    pool = [cfg["backends"][0]["url"], alive.url]
    proxy = envoy(picker.grpc_port, pool)
    routes = [served_by(post(proxy.url)) for _ in range(4)]
    assert routes == ["alive"] * 4  # half of them listed the dead one first; Envoy went down the list
    assert proxy.stats("cluster.pool.upstream_rq_retry")["cluster.pool.upstream_rq_retry"] >= 2
    # The EPP moved its in-flight count to what really served and saw all four succeed there.
    assert metric(picker.metrics_url, "hetgate:requests_total", status="200") == 4


def test_a_fallen_back_request_counts_on_the_endpoint_that_serves_it(sim, epp, envoy):
    """Envoy went down the list past a dead endpoint: the EPP moves the request's reservation to the one
    that answered. It matters while the EPP still follows the reply: a sampled stream (the EPP times its
    first chunk), whose reservation lasts until the stream ends."""
    alive = sim(simple_engine=SLOW)
    dead = {**backend(alive, "dead"), "url": dead_url()}
    cfg = config([dead, backend(alive, "alive")], routing={"policy": "cost"}, health=QUIET_HEALTH)
    cfg["models"][0]["spec"] = "deepseek-r1"
    picker = epp(cfg, "--calibrate-every", "1")
    proxy = envoy(picker.grpc_port, [cfg["backends"][0]["url"], alive.url], full_duplex=False)
    retries = "cluster.pool.upstream_rq_retry"
    fallen_back = 0
    for _ in range(4):
        before = proxy.stats(retries)[retries]
        body = chat_body(max_tokens=40, stream=True)  # ~2 s of tokens: in flight while we look
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=15) as response:
            served, predicted = route_parts(response.headers["x-hetgate-route"])
            assert served == "mode=aggregated; backend=alive"
            chunks = response.iter_raw()
            next(chunks)
            counts = {
                name: metric(picker.metrics_url, "hetgate:backend_in_flight", backend=name)
                for name in ("dead", "alive")
            }
            for _chunk in chunks:
                pass
        if proxy.stats(retries)[retries] > before:  # Envoy tried the dead endpoint first
            fallen_back += 1
            assert counts == {"dead": 0, "alive": 1}
            assert not predicted  # the plan priced the dead endpoint, not the one that served
        else:
            assert predicted["predicted_ttft_ms"] > 0, "the plan's prices travel in the route header"
    assert fallen_back >= 1
    assert metric(picker.metrics_url, "hetgate:epp_ttft_samples_total", backend="alive") == 4


def subset_filter(endpoints: list[str]) -> str:
    """A set_metadata filter before the EPP: the gateway's subset hint, as the protocol places it."""
    values = ", ".join(f'"{e}"' for e in endpoints)
    return (
        "          - name: envoy.filters.http.set_metadata\n"
        "            typed_config:\n"
        '              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n'
        "              metadata:\n"
        "              - metadata_namespace: envoy.lb.subset_hint\n"
        f"                value: {{x-gateway-destination-endpoint-subset: [{values}]}}\n"
        "          - name: envoy.filters.http.ext_proc\n"
    )


def test_subset_hint_limits_the_choice(sim, epp, envoy):
    servers = [sim() for _ in range(3)]
    cfg = config([backend(s, f"b{i}") for i, s in enumerate(servers)])
    picker = epp(cfg)
    allowed = [endpoint(servers[1]), endpoint(servers[2])]
    proxy = envoy(picker.grpc_port, [s.url for s in servers], extra_filters=subset_filter(allowed))
    assert {served_by(post(proxy.url)) for _ in range(6)} == {"b1", "b2"}


def test_subset_without_a_known_endpoint_is_503(sim, epp, envoy):
    servers = [sim() for _ in range(2)]
    picker = epp(config([backend(s, f"b{i}") for i, s in enumerate(servers)]))
    proxy = envoy(picker.grpc_port, [s.url for s in servers], extra_filters=subset_filter(["10.9.9.9:80"]))
    response = post(proxy.url)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "ServiceUnavailableError"
    assert metric(servers[0].url, "vllm:request_success_total") == 0


# -- immediate responses ------------------------------------------------------------------------------------


def test_no_healthy_backend_is_an_openai_503(sim, epp, envoy):
    # Without panic mode, as `serve` (tests/faults/test_health.py): with it, every backend takes traffic.
    no_panic = {"health": {"panic_threshold_percent": 0}}
    proxy, picker, servers = pool_of(sim, epp, envoy, cfg_extra=no_panic)
    for server in servers:
        server.stop()
    deadline = time.monotonic() + 10
    while metric(picker.metrics_url, "hetgate:backend_healthy") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    response = post(proxy.url)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and error["message"]


@pytest.mark.parametrize(
    ("body", "status"),
    [({"model": MODEL, "messages": []}, 400), ({"model": "nope", "messages": [{"role": "user"}]}, 404)],
    ids=["bad-request", "unknown-model"],
)
def test_bad_input_is_answered_before_any_backend(sim, epp, envoy, body, status):
    proxy, _, servers = pool_of(sim, epp, envoy)
    response = post(proxy.url, body)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert all(metric(s.url, "vllm:request_success_total") == 0 for s in servers)


def test_saturated_pool_sheds_with_429(sim, epp, envoy):
    server = sim(simple_engine=SLOW)
    cfg = config([backend(server, "b0", max_num_seqs=1)], health={"metrics_interval_s": 0.1})
    picker = epp(cfg, "--shed-at", "1.0")
    proxy = envoy(picker.grpc_port, [server.url])
    first: list[httpx.Response] = []
    long_request = threading.Thread(target=lambda: first.append(post(proxy.url, chat_body(max_tokens=30))))
    long_request.start()
    deadline = time.monotonic() + 10
    while metric(picker.metrics_url, "hetgate:backend_in_flight") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    shed = post(proxy.url)
    long_request.join()
    assert shed.status_code == 429
    assert shed.json()["error"]["type"] == "RateLimitError"
    assert first[0].status_code == 200
    # Room again once the first finished and the backend's polled load says so.
    deadline = time.monotonic() + 10
    while (status := post(proxy.url).status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 200


# -- streaming ----------------------------------------------------------------------------------------------


def test_streamed_reply_flows_chunk_by_chunk(sim, epp, envoy):
    server = sim(simple_engine=SLOW)
    picker = epp(config([backend(server, "slow")]))
    proxy = envoy(picker.grpc_port, [server.url])
    arrivals = []
    started = time.perf_counter()
    body = chat_body(max_tokens=16, stream=True)
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=15) as response:
        assert response.headers["x-hetgate-route"] == "mode=aggregated; backend=slow"
        for _chunk in response.iter_raw():
            arrivals.append(time.perf_counter() - started)
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:-1])]  # between token events
    assert len(arrivals) >= 16
    assert arrivals[-1] - arrivals[0] > 0.6 * 15 * SLOW.tpot_s  # spread out as generated: not buffered
    assert abs(statistics.median(gaps) - SLOW.tpot_s) < 0.02  # no stall added to each chunk


# -- prefill/decode -----------------------------------------------------------------------------------------


def pd_pool(sim, epp, envoy, full_duplex=True, prefill_alive=True, **routing):  # type: ignore[no-untyped-def]
    prefill, decode = sim(role="prefill"), sim(role="decode")
    p = backend(prefill, "p", ("prefill",), kv_connector="nixl")
    if not prefill_alive:
        prefill.stop()
    cfg = config(
        [p, backend(decode, "d", ("decode",), kv_connector="nixl")],
        routing={"disaggregation": "always", **routing},
        health=QUIET_HEALTH,
    )
    picker = epp(cfg)
    proxy = envoy(picker.grpc_port, [prefill.url, decode.url], full_duplex=full_duplex)
    return proxy, picker, prefill, decode


@pytest.mark.parametrize("full_duplex", [True, False], ids=["full-duplex", "buffered"])
def test_pd_runs_prefill_in_the_epp_and_hands_kv_to_decode(sim, epp, envoy, full_duplex):
    proxy, picker, prefill, decode = pd_pool(sim, epp, envoy, full_duplex)
    response = post(proxy.url, chat_body("a long shared prompt " * 50))
    assert response.status_code == 200
    assert response.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=d"
    assert response.json()["usage"]["completion_tokens"] == 8
    assert metric(prefill.url, "vllm:generation_tokens_total") == 1  # the EPP's max_tokens=1 leg
    # The rewritten body (with kv_transfer_params, and a matching content-length) reached the decode pod.
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert metric(picker.metrics_url, "hetgate:route_decisions_total", mode="pd", reason="executed") == 1


def test_pd_stream_through_envoy(sim, epp, envoy):
    proxy, _, _, decode = pd_pool(sim, epp, envoy)
    body = chat_body("tell me a story " * 30, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=15) as response:
        text = b"".join(response.iter_raw()).decode()
    assert response.status_code == 200
    assert text.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":8' in text
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0


def test_failed_prefill_falls_back_to_aggregated(sim, epp, envoy):
    proxy, picker, _, decode = pd_pool(sim, epp, envoy, prefill_alive=False)
    response = post(proxy.url)
    assert response.status_code == 200
    assert response.headers["x-hetgate-route"] == "mode=aggregated; backend=d; fallback=prefill_failed"
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert metric(picker.metrics_url, "hetgate:pd_fallbacks_total", to="aggregated") == 1


def test_failed_prefill_without_fallback_is_502(sim, epp, envoy):
    proxy, _, _, decode = pd_pool(sim, epp, envoy, prefill_alive=False, pd_fallback="fail")
    response = post(proxy.url)
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "BadGatewayError"
    assert metric(decode.url, "vllm:request_success_total") == 0


@pytest.mark.parametrize("fallback", ["aggregated", "fail"])
def test_nixl_prefill_without_transfer_params_is_a_named_fallback(sim, epp, envoy, fallback):
    """As in `serve` (tests/faults/test_pd_legs.py): a decode pod without the prefiller's KV handle would
    recompute the whole prompt, so that is a fallback, named, never a P/D route."""
    prefiller = RawBackend(json_reply(chat_completion()))  # a 200 without kv_transfer_params
    decode = sim(role="decode")
    try:
        prefill = {**backend(decode, "p", ("prefill",), kv_connector="nixl"), "url": prefiller.url}
        cfg = config(
            [prefill, backend(decode, "d", ("decode",), kv_connector="nixl")],
            routing={"disaggregation": "always", "pd_fallback": fallback},
            health=QUIET_HEALTH,
        )
        picker = epp(cfg)
        proxy = envoy(picker.grpc_port, [decode.url])
        response = post(proxy.url)
        # The prefill leg asked for a transfer (NIXL's block): the prefiller was a real P/D leg.
        assert prefiller.requests[0].json()["kv_transfer_params"]["do_remote_decode"] is True
    finally:
        prefiller.stop()
    fallbacks = metric(picker.metrics_url, "hetgate:pd_fallbacks_total", to=fallback, reason="no_kv_params")
    assert fallbacks == 1
    assert metric(picker.metrics_url, "hetgate:route_decisions_total", mode="pd", reason="executed") == 0
    if fallback == "fail":
        assert response.status_code == 502
        assert "no_kv_params" in response.json()["error"]["message"]
        assert metric(decode.url, "vllm:request_success_total") == 0
        return
    assert response.status_code == 200
    assert response.headers["x-hetgate-route"] == "mode=aggregated; backend=d; fallback=no_kv_params"
    assert response.json()["usage"]["completion_tokens"] == 8


def test_failed_prefill_attempt_is_retried_on_the_next_prefill_backend(sim, epp, envoy):
    dead, prefill, decode = sim(role="prefill"), sim(role="prefill"), sim(role="decode")
    backends = [
        backend(dead, "p0", ("prefill",), kv_connector="nixl"),
        backend(prefill, "p1", ("prefill",), kv_connector="nixl"),
        backend(decode, "d", ("decode",), kv_connector="nixl"),
    ]
    dead.stop()
    cfg = config(backends, routing={"disaggregation": "always"}, health=QUIET_HEALTH)
    picker = epp(cfg)
    proxy = envoy(picker.grpc_port, [prefill.url, decode.url])
    routes = [post(proxy.url).headers["x-hetgate-route"] for _ in range(2)]
    # Round robin puts the dead prefiller first once; the retry policy (as serve's) moves on to p1.
    assert routes == ["mode=pd; prefill=p1; decode=d"] * 2
    assert metric(picker.metrics_url, "hetgate:retries_total") == 1
    assert metric(picker.metrics_url, "hetgate:upstream_errors_total", backend="p0", kind="connect") == 1
    assert metric(picker.metrics_url, "hetgate:pd_fallbacks_total") == 0


def test_a_failed_prefill_attempt_counts_on_its_backend_until_the_request_ends(sim, epp, envoy):
    """As in `serve` (tests/faults/test_inflight_accounting.py): the prefiller that refused the leg keeps
    the request's reservation while the decode runs, then gives it back."""
    dead, prefill, decode = sim(role="prefill"), sim(role="prefill"), sim(role="decode", simple_engine=SLOW)
    backends = [
        backend(dead, "p0", ("prefill",), kv_connector="nixl"),
        backend(prefill, "p1", ("prefill",), kv_connector="nixl"),
        backend(decode, "d", ("decode",), kv_connector="nixl"),
    ]
    dead.stop()
    picker = epp(config(backends, routing={"disaggregation": "always"}, health=QUIET_HEALTH))
    proxy = envoy(picker.grpc_port, [prefill.url, decode.url])

    def in_flight(name: str) -> float:
        return metric(picker.metrics_url, "hetgate:backend_in_flight", backend=name)

    seen: dict[str, float] = {}
    for _ in range(2):  # round robin puts the dead prefiller first for one of the two
        replies: list[httpx.Response] = []
        body = chat_body(max_tokens=40)  # ~2 s of decoding, not streamed: the EPP holds it until the end
        request = threading.Thread(target=lambda r=replies, b=body: r.append(post(proxy.url, b)))
        request.start()
        deadline = time.monotonic() + 10
        while request.is_alive() and not seen:
            failed = metric(picker.metrics_url, "hetgate:upstream_errors_total", backend="p0")
            if failed and in_flight("d") == 1:
                seen = {name: in_flight(name) for name in ("p0", "p1", "d")}
                # The decode leg went out with p1's KV: no longer pending on d (its reply comes later).
                seen["pending"] = metric(
                    picker.metrics_url, "hetgate:backend_pending_decode_legs", backend="d"
                )
            assert time.monotonic() < deadline
            time.sleep(0.02)
        request.join()
        assert replies[0].headers["x-hetgate-route"] == "mode=pd; prefill=p1; decode=d"
    assert seen == {"p0": 1, "p1": 0, "d": 1, "pending": 0}  # p1's leg is over; p0's failed try counts
    deadline = time.monotonic() + 10
    while metric(picker.metrics_url, "hetgate:backend_in_flight") > 0:
        assert time.monotonic() < deadline, "a reservation was never released"
        time.sleep(0.05)


def test_every_reservation_is_released(sim, epp, envoy):
    proxy, picker, prefill, _ = pd_pool(sim, epp, envoy)
    assert post(proxy.url).status_code == 200  # P/D: a prefill leg in the EPP, the decode via Envoy
    prefill.stop()
    replies: list[httpx.Response] = []
    slow = threading.Thread(target=lambda: replies.append(post(proxy.url, chat_body(max_tokens=1500))))
    slow.start()  # the prefill fails: served aggregated by d, held there until Envoy has its answer
    deadline = time.monotonic() + 10
    while metric(picker.metrics_url, "hetgate:backend_in_flight", backend="d") < 1:
        assert time.monotonic() < deadline and slow.is_alive(), "d was never reserved"
        time.sleep(0.02)
    slow.join()
    assert replies[0].headers["x-hetgate-route"].endswith("fallback=prefill_failed")
    deadline = time.monotonic() + 10
    while metric(picker.metrics_url, "hetgate:backend_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(picker.metrics_url, "hetgate:backend_in_flight") == 0


# -- the EPP itself failing ---------------------------------------------------------------------------------


# Each failure mode with the body mode docs/epp.md pairs it with: fail-open needs BUFFERED, because in
# FULL_DUPLEX_STREAMED Envoy has already streamed the body into the broken gRPC stream and cannot replay it
# (a 500 in CI when the stream broke after the first chunk went out).
@pytest.mark.parametrize("allow", [False, True], ids=["fail-closed", "fail-open"])
def test_epp_down(sim, epp, envoy, allow):
    proxy, picker, _ = pool_of(sim, epp, envoy, failure_mode_allow=allow, full_duplex=not allow)
    assert post(proxy.url).status_code == 200
    picker.stop(hard=True)
    response = post(proxy.url)
    if allow:  # Envoy serves without a pick: the pool's round robin, no hetgate route
        assert response.status_code == 200
        assert "x-hetgate-route" not in response.headers
    else:
        assert response.status_code >= 500


def load(url: str, stop: threading.Event, statuses: list[int]) -> None:
    with httpx.Client(timeout=15) as session:
        while not stop.is_set():
            statuses.append(session.post(f"{url}/v1/chat/completions", json=chat_body()).status_code)


def restart_under_load(proxy, picker) -> Counter[int]:  # type: ignore[no-untyped-def]
    stop = threading.Event()
    statuses: list[int] = []  # appended by 4 client threads (list.append is atomic)

    def answered(count: int) -> None:
        deadline = time.monotonic() + 30
        while len(statuses) < count:
            assert time.monotonic() < deadline, f"{len(statuses)} of {count} requests answered"
            time.sleep(0.02)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, proxy.url, stop, statuses) for _ in range(4)]
        answered(4)  # traffic flows before the kill...
        picker.stop(hard=True)  # killed mid-traffic
        picker.start()  # same ports: Envoy reconnects by itself
        answered(len(statuses) + 8)  # ...and after the restart
        stop.set()
        for future in futures:
            future.result()
    return Counter(statuses)


def test_epp_restart_under_load_fail_open_loses_no_request(sim, epp, envoy):
    # Buffered mode: Envoy keeps the body, so a request whose EPP stream broke still goes out.
    proxy, picker, _ = pool_of(sim, epp, envoy, failure_mode_allow=True, full_duplex=False)
    statuses = restart_under_load(proxy, picker)
    assert statuses[200] > 4
    assert statuses == {200: statuses[200]}
    assert "x-hetgate-route" in post(proxy.url).headers  # picking again after the restart


def test_epp_restart_under_load_fail_closed_answers_every_request(sim, epp, envoy):
    proxy, picker, _ = pool_of(sim, epp, envoy)
    statuses = restart_under_load(proxy, picker)
    assert statuses[200] > 4
    assert set(statuses) <= {200, 500}  # each answered (no hang): routed, or refused while it was down
    after = post(proxy.url)
    assert after.status_code == 200 and "x-hetgate-route" in after.headers


# -- one brain, two shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["prefix", "least_load"])
def test_same_decisions_as_serve(sim, epp, envoy, gateway, policy):
    """One request at a time, each shape sends each prompt to the same backend. `prefix` (as
    sglang-router 0.3.2) sends a prompt no backend holds beyond the others to the least loaded, the
    first of equal loads, so an idle cluster serves one request at a time on b0 in both shapes;
    `least_load` turns through equal backends, so there the choice moves."""
    servers = [sim() for _ in range(3)]
    cfg = config([backend(s, f"b{i}") for i, s in enumerate(servers)], routing={"policy": policy})
    families = ("alpha", "beta", "gamma")
    prompts = [f"{family} " * 200 + f"question {i}" for i in range(4) for family in families]
    served = gateway(cfg)
    via_serve = [served_by(post(served.url, chat_body(p))) for p in prompts]
    served.stop()
    picker = epp(cfg)
    proxy = envoy(picker.grpc_port, [s.url for s in servers])
    via_epp = [served_by(post(proxy.url, chat_body(p))) for p in prompts]
    assert via_epp == via_serve
    expected = ["b0"] * len(prompts) if policy == "prefix" else [f"b{i % 3}" for i in range(len(prompts))]
    assert via_serve == expected


# -- health -------------------------------------------------------------------------------------------------


def health_of(port: int, service: str) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def test_grpc_health_follows_the_backends(sim, epp):
    from grpc_health.v1 import health_pb2

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    server = sim()
    picker = epp(config([backend(server, "b0")]))
    services = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
    assert [health_of(picker.grpc_port, s) for s in services] == [serving] * 3
    server.stop()
    deadline = time.monotonic() + 10
    while health_of(picker.grpc_port, "readiness") == serving and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [health_of(picker.grpc_port, s) for s in services] == [serving, not_serving, not_serving]


def test_sampled_streams_feed_ttft_and_tpot_to_the_cost_model_and_stay_intact(sim, epp, envoy):
    server = sim(simple_engine=SLOW)
    cfg = config([backend(server, "b0")], routing={"policy": "cost"})  # a policy that learns
    cfg["models"][0]["spec"] = "deepseek-r1"
    picker = epp(cfg, "--calibrate-every", "2")
    # Envoy honours a mode override only when neither body mode is full-duplex.
    proxy = envoy(picker.grpc_port, [server.url], full_duplex=False)
    texts = []
    for _ in range(4):
        body = chat_body(max_tokens=6, stream=True)
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=15) as response:
            texts.append(b"".join(response.iter_raw()).decode())
    post(proxy.url)  # not streamed: never sampled
    assert metric(picker.metrics_url, "hetgate:epp_ttft_samples_total", backend="b0") == 2
    # The two samples' TTFT and TPOT beside what their plans predicted, as `serve` publishes every
    # stream's: the EPP follows a sampled reply to its end.
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert metric(picker.metrics_url, f"hetgate:{name}_count") == 2
        assert metric(picker.metrics_url, f"hetgate:predicted_{name}_count") == 2
    mean_tpot = metric(picker.metrics_url, "hetgate:time_per_output_token_seconds_sum") / 2
    assert 0.6 * SLOW.tpot_s < mean_tpot < 2 * SLOW.tpot_s  # the engine's pace, as the EPP saw it
    assert all(t.count("data: ") == 8 and t.rstrip().endswith("data: [DONE]") for t in texts)
    # What it learnt is published as serve publishes it (1.0 would mean nothing was learnt).
    assert metric(picker.metrics_url, "hetgate:cost_model_error", backend="b0") not in (0.0, 1.0)
    assert metric(picker.metrics_url, "hetgate:cost_model_tpot_error", backend="b0") not in (0.0, 1.0)


def test_harness_refuses_fail_open_with_a_streamed_body():
    from bench.epp_harness import EnvoyProcess

    with pytest.raises(ValueError, match="BUFFERED"):
        EnvoyProcess(1, [], failure_mode_allow=True, full_duplex=True)


# -- the floor EPP of `hetgate bench overhead` (bench/epp_floor.py) ----------------------------------------


@pytest.mark.parametrize("full_duplex", [True, False], ids=["full-duplex", "buffered"])
def test_the_floor_epp_routes_every_request_to_its_one_endpoint(sim, envoy, full_duplex):
    from bench.epp_harness import EppProcess

    used, unused = sim(max_model_len=100_000), sim()
    args = ["--endpoint", endpoint(used)]
    with EppProcess({}, args, module="bench.epp_floor") as floor:
        proxy = envoy(floor.grpc_port, [used.url, unused.url], full_duplex=full_duplex)
        prompt = "many-words " * 12_000  # several chunks each way in full-duplex mode
        long = post(proxy.url, {"model": MODEL, "prompt": prompt, "max_tokens": 2}, "/v1/completions")
        statuses = [post(proxy.url).status_code for _ in range(3)]
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] > 5_000
    assert statuses == [200] * 3
    assert metric(used.url, "vllm:request_success_total") == 4
    assert metric(unused.url, "vllm:request_success_total") == 0
