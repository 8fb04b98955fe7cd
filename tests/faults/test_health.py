"""Health under faults: what a client's requests, a broken backend or an overloaded pool can do to it.

Real processes: a `hetgate serve` gateway in front of simulated vLLM backends told (by fault plans) to
answer 500/503, stall, or drop connections, while /health keeps answering 200.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.conftest import backend, chat_body, config, metric


def post(gw, **fields) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(**fields), timeout=15)


def route_of(response: httpx.Response) -> str:
    return response.headers.get("x-hetgate-route", "")


def healthy(gw, backend_id: str) -> float:
    return metric(gw.url, "hetgate:backend_healthy", backend=backend_id)


def test_requests_that_fail_on_every_backend_do_not_get_backends_ejected(sim, gateway):
    servers = [sim() for _ in range(3)]
    poison = 5  # each backend fails the next 5 requests it gets: as a request whose content breaks vLLM
    for server in servers:
        server.set_faults({"error_status": 500, "error_count": poison})
    outlier = {"consecutive_5xx": 2, "max_ejection_percent": 100}  # counting them would eject everyone
    gw = gateway(config([backend(s, f"b{i}") for i, s in enumerate(servers)], health={"outlier": outlier}))
    for _ in range(poison):
        assert post(gw).status_code == 500  # tried on all three, relayed
    assert metric(gw.url, "hetgate:upstream_errors_total", kind="status") == 3 * poison
    statuses = [post(gw).status_code for _ in range(30)]
    assert statuses == [200] * 30
    assert metric(gw.url, "hetgate:backend_ejections_total") == 0
    assert [healthy(gw, f"b{i}") for i in range(3)] == [1, 1, 1]


def test_dropped_connections_count_at_once_even_when_every_backend_drops_them(sim, gateway):
    """The contrast to the test above: a connection that breaks before the headers is the backend's
    fault whatever the request contained (gateway/retry.py `blame`), so it counts with no peer to compare."""
    servers = [sim() for _ in range(2)]
    for server in servers:
        server.set_faults({"close_after_chunks": 0})  # reset before any byte
    outlier = {"consecutive_gateway_failure": 2, "max_ejection_percent": 100}
    gw = gateway(config([backend(s, f"b{i}") for i, s in enumerate(servers)], health={"outlier": outlier}))
    for _ in range(2):
        assert post(gw).status_code == 502  # tried on both, failed on both
    assert metric(gw.url, "hetgate:upstream_errors_total", kind="reset") == 4
    # Both reached the threshold; one backend always stays (gateway/outlier.py `max_ejected`: n - 1).
    assert metric(gw.url, "hetgate:backend_ejections_total") == 1
    assert sorted(healthy(gw, f"b{i}") for i in range(2)) == [0, 1]


def test_backend_failing_every_generation_with_a_good_health_probe_is_ejected(sim, gateway):
    bad, good1, good2 = sim(), sim(), sim()
    bad.set_faults({"error_status": 500})  # /health stays 200, probed every 0.2 s
    gw = gateway(config([backend(bad, "bad"), backend(good1, "good1"), backend(good2, "good2")]))
    responses = [post(gw) for _ in range(30)]
    assert [r.status_code for r in responses] == [200] * 30  # its 500s were retried elsewhere
    assert all("backend=bad" not in route_of(r) for r in responses)
    assert metric(gw.url, "hetgate:backend_ejections_total", backend="bad") == 1
    # consecutive_5xx (5) failures, then no more traffic: probes answering 200 did not reset the count
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="bad") == 5
    assert metric(gw.url, "hetgate:retries_total") >= 5
    assert healthy(gw, "bad") == 0
    assert httpx.get(f"{gw.url}/ready").status_code == 200


def test_no_more_than_max_ejection_percent_are_ejected(sim, gateway):
    servers = [sim() for _ in range(4)]
    servers[0].set_faults({"error_status": 500})
    servers[1].set_faults({"error_status": 500})
    gw = gateway(config([backend(s, f"b{i}") for i, s in enumerate(servers)]))  # 10 %: one of four
    statuses = [post(gw).status_code for _ in range(40)]
    assert statuses == [200] * 40
    assert metric(gw.url, "hetgate:backend_ejections_total") == 1
    assert sorted(healthy(gw, f"b{i}") for i in range(4)) == [0, 1, 1, 1]
    # the one over the cap is still counted (and retried around): it goes as soon as there is room
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="b0") > 5 or (
        metric(gw.url, "hetgate:upstream_errors_total", backend="b1") > 5
    )


def test_ejected_backend_returns_after_the_ejection_time(sim, gateway):
    bad, good = sim(), sim()
    bad.set_faults({"error_status": 500})
    outlier = {"consecutive_5xx": 2, "base_ejection_time_s": 3}
    gw = gateway(config([backend(bad, "bad"), backend(good, "good")], health={"outlier": outlier}))
    for _ in range(20):
        assert post(gw).status_code == 200
        if metric(gw.url, "hetgate:backend_ejections_total", backend="bad"):
            break
    ejected_at = time.monotonic()
    assert metric(gw.url, "hetgate:backend_ejections_total", backend="bad") == 1
    while time.monotonic() - ejected_at < 1.5:  # well inside the ejection: nothing goes to it
        assert route_of(post(gw)) == "mode=aggregated; backend=good"
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="bad") == 2
    bad.set_faults({})
    deadline = time.monotonic() + 15
    routes: list[str] = []
    while "mode=aggregated; backend=bad" not in routes and time.monotonic() < deadline:
        routes.append(route_of(post(gw)))
        time.sleep(0.05)
    assert "mode=aggregated; backend=bad" in routes
    assert time.monotonic() - ejected_at >= 1.5
    assert healthy(gw, "bad") == 1
    while not metric(gw.url, "hetgate:backend_health_changes_total", backend="bad", event="returned"):
        assert time.monotonic() < deadline  # the poller's next round tells
        time.sleep(0.05)


def test_time_to_first_byte_timeouts_are_retried_and_eject_the_staller(sim, gateway):
    slow, good1, good2 = sim(), sim(), sim()
    slow.set_faults({"first_byte_delay_s": 5})
    cfg = config(
        [backend(slow, "slow"), backend(good1, "good1"), backend(good2, "good2")],
        timeouts={"ttfb_s": 0.3},
        health={"outlier": {"consecutive_gateway_failure": 2}},
    )
    gw = gateway(cfg)
    assert [post(gw).status_code for _ in range(15)] == [200] * 15
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="slow", kind="timeout") == 2
    assert metric(gw.url, "hetgate:backend_ejections_total", backend="slow") == 1


def test_connection_drops_before_the_headers_are_retried_and_counted_at_once(sim, gateway):
    dropper, good = sim(), sim()
    dropper.set_faults({"close_after_chunks": 0})
    cfg = config(
        [backend(dropper, "dropper"), backend(good, "good")],
        health={"outlier": {"consecutive_gateway_failure": 2}},
    )
    gw = gateway(cfg)
    assert [post(gw).status_code for _ in range(10)] == [200] * 10
    assert metric(gw.url, "hetgate:upstream_errors_total", backend="dropper", kind="reset") == 2
    assert metric(gw.url, "hetgate:backend_ejections_total", backend="dropper") == 1


def test_overload_503s_are_backpressure_not_ill_health(sim, gateway):
    a, b = sim(), sim()
    for server in (a, b):
        server.set_faults({"error_status": 503})  # every generation refused, /health 200
    gw = gateway(config([backend(a, "a"), backend(b, "b")]))  # probes every 0.2 s
    stop = threading.Event()
    client_statuses: list[int] = []

    def client() -> None:
        with httpx.Client(timeout=15) as http:
            while not stop.is_set():
                r = http.post(f"{gw.url}/v1/chat/completions", json=chat_body())
                client_statuses.append(r.status_code)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    ready: list[int] = []
    try:
        with httpx.Client(timeout=5) as http:
            until = time.monotonic() + 10
            while time.monotonic() < until:
                ready.append(http.get(f"{gw.url}/ready").status_code)
                time.sleep(0.05)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    assert len(ready) > 20 and set(ready) == {200}
    assert client_statuses and set(client_statuses) == {503}  # the backends' answer, after a retry
    assert metric(gw.url, "hetgate:retries_total") > 0
    assert metric(gw.url, "hetgate:backend_health_changes_total") == 0
    assert metric(gw.url, "hetgate:backend_ejections_total") == 0
    for server in (a, b):
        server.set_faults({})
    assert post(gw).status_code == 200  # nothing was taken out: served at once


@pytest.mark.parametrize(("cooldown_s", "retries"), [(30.0, 1), (0.0, 3)])
def test_a_backend_that_answered_503_is_tried_last_while_it_cools_down(sim, gateway, cooldown_s, retries):
    busy, free = sim(), sim()
    busy.set_faults({"error_status": 503})
    # Two failures would eject a backend: its 503s, served by a peer, must not count as failures.
    outlier = {"consecutive_gateway_failure": 2, "consecutive_5xx": 2}
    health = {"backpressure_cooldown_s": cooldown_s, "outlier": outlier}
    gw = gateway(config([backend(busy, "busy"), backend(free, "free")], health=health))
    statuses = [post(gw).status_code for _ in range(6)]  # round robin puts "busy" first every other time
    assert statuses == [200] * 6
    assert metric(gw.url, "hetgate:retries_total") == retries  # cooling: only the first request met it
    assert metric(gw.url, "hetgate:backend_ejections_total") == 0
    assert healthy(gw, "busy") == 1


@pytest.mark.parametrize(("panic_threshold_percent", "served"), [(50, 200), (0, 503)])
def test_panic_mode_routes_to_all_when_too_few_backends_answer_their_probes(
    sim, gateway, panic_threshold_percent, served
):
    a, b = sim(), sim()
    for server in (a, b):
        server.set_faults({"health_status": 503})  # probes fail; generations would still be served
    health = {"panic_threshold_percent": panic_threshold_percent}
    gw = gateway(config([backend(a, "a"), backend(b, "b")], health=health))
    deadline = time.monotonic() + 10
    while httpx.get(f"{gw.url}/ready").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric(gw.url, "hetgate:backend_health_changes_total", event="probe_down") == 2
    statuses = [post(gw).status_code for _ in range(4)]
    assert statuses == [served] * 4  # panic: to every backend; without it: "No healthy backend"
