"""The Redis prefix index across gateway processes, and the gateway when Redis dies or freezes."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.integration.conftest import backend, chat_body, config, metric
from tests.redis_server import redis_server_factory

__all__ = ["redis_server_factory"]


def prefix_config(sims, redis_url: str, deadline_ms: float = 20) -> dict:
    return config(
        [backend(s, f"b{i}") for i, s in enumerate(sims)],
        routing={"policy": "prefix"},
        index={"store": "redis", "redis_url": redis_url, "deadline_ms": deadline_ms, "key_prefix": "t"},
    )


def conversation(i: int) -> str:
    return f"conversation {i}: " + " ".join(f"w{i}x{j}" for j in range(300))


def route(gw, prompt: str) -> str:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(prompt, max_tokens=2), timeout=10)
    assert r.status_code == 200
    return r.headers["x-hetgate-route"]


def test_two_gateways_share_one_index(sim, gateway, redis_server_factory):
    redis = redis_server_factory()
    sims = [sim(), sim(), sim()]
    first = gateway(prefix_config(sims, redis.url))
    second = gateway(prefix_config(sims, redis.url))
    for i in range(6):  # a chance match would need 6 coin flips in a row (1 in 729 with 3 backends)
        chosen = route(first, conversation(i))
        time.sleep(0.05)  # the record is written right after the response
        assert route(second, conversation(i) + " and a follow-up question") == chosen


def test_workers_of_one_serve_share_the_index(sim, gateway, redis_server_factory):
    redis = redis_server_factory()
    sims = [sim(), sim(), sim()]
    gw = gateway(prefix_config(sims, redis.url), workers=2)
    for i in range(4):
        routes = set()
        for turn in range(4):  # new connections each time: the kernel spreads them over the workers
            routes.add(route(gw, conversation(i) + f" turn {turn}"))
            time.sleep(0.05)
        assert len(routes) == 1


def _load(gw, seconds: float) -> list[tuple[int, float]]:
    """Requests from 4 threads for `seconds`: (status, latency) of each."""
    stop_at = time.monotonic() + seconds

    def loop(worker: int) -> list[tuple[int, float]]:
        out = []
        with httpx.Client(timeout=10) as client:
            i = 0
            while time.monotonic() < stop_at:
                started = time.monotonic()
                body = chat_body(conversation(worker * 1000 + i % 7), max_tokens=2)
                status = client.post(f"{gw.url}/v1/chat/completions", json=body).status_code
                out.append((status, time.monotonic() - started))
                i += 1
        return out

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return [r for rs in pool.map(loop, range(4)) for r in rs]


@pytest.mark.parametrize("failure", ["kill", "pause"])
def test_redis_failure_under_load_fails_no_request(sim, gateway, redis_server_factory, failure):
    redis = redis_server_factory()
    gw = gateway(prefix_config([sim(), sim()], redis.url))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, gw, 3.0)
        time.sleep(0.8)
        redis.kill() if failure == "kill" else redis.pause()
        results = load.result()
    if failure == "pause":
        redis.resume()
    statuses = {s for s, _ in results}
    assert statuses == {200}
    # Without the deadline a frozen Redis would hold every request; with it they wait ~20 ms at most
    # for the index (the rest is the simulated generation and a shared 2-core machine).
    assert max(latency for _, latency in results) < 1.5
    assert metric(gw.url, "hetgate:index_errors_total") > 0


def test_index_recovers_when_redis_returns(sim, gateway, redis_server_factory):
    redis = redis_server_factory()
    sims = [sim(), sim(), sim()]
    gw = gateway(prefix_config(sims, redis.url))
    redis.pause()
    assert route(gw, conversation(1)).startswith("mode=aggregated")
    errors = metric(gw.url, "hetgate:index_errors_total")
    assert errors > 0
    redis.resume()
    time.sleep(1.2)  # the guard retries the store after retry_after_s
    for i in range(20, 24):
        chosen = route(gw, conversation(i))
        time.sleep(0.05)
        assert route(gw, conversation(i) + " again") == chosen
