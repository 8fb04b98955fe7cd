"""Gateway replicas that share the Redis store balance as one gateway does, and a crashed replica's
requests stop counting within the share's TTL."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable

import httpx

from bench.sim.simple_engine import SimpleEngineConfig
from tests.integration.conftest import backend, chat_body, config, metric
from tests.redis_server import redis_server_factory

__all__ = ["redis_server_factory"]

# Streams of ~6 s: every request of a test is still in flight when the next one is routed.
LONG = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.02)


def shared_config(sims: list, redis_url: str, share: bool = True) -> dict:
    return config(
        [backend(s, name) for s, name in zip(sims, "ab", strict=True)],
        routing={"policy": "least_load"},
        index={"store": "redis", "redis_url": redis_url, "key_prefix": "r", "share_load": share},
        # vLLM's own running counts (polled) would hide the gateways' view: poll them rarely here.
        health={"metrics_interval_s": 60},
    )


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def cluster_in_flight(gw) -> float:
    return metric(gw.url, "hetgate:backend_in_flight_cluster")


def open_streams(gateways: list, count: int, stack: contextlib.ExitStack) -> Counter[str]:
    """`count` long streams, sent to the gateways in turn; each is routed only once the gateway it goes
    to counts every stream already open. Returns how many each backend got."""
    client = stack.enter_context(httpx.Client(timeout=30))
    served: Counter[str] = Counter()
    for i in range(count):
        gw = gateways[i % len(gateways)]
        if len(gateways) > 1:
            until(lambda gw=gw, i=i: cluster_in_flight(gw) == i)
        body = chat_body(f"request {i}", stream=True, max_tokens=300)
        reply = stack.enter_context(client.stream("POST", f"{gw.url}/v1/chat/completions", json=body))
        assert reply.status_code == 200
        served[reply.headers["x-hetgate-route"].split("backend=")[1].split(";")[0]] += 1
    return served


def test_two_replicas_balance_as_one_gateway(sim, gateway, redis_server_factory):
    redis = redis_server_factory()
    sims = [sim(simple_engine=LONG), sim(simple_engine=LONG)]
    with contextlib.ExitStack() as stack:
        alone = open_streams([gateway(shared_config(sims, redis.url))], 6, stack)
    assert sorted(alone.values()) == [3, 3]

    replicas = [gateway(shared_config(sims, redis.url)), gateway(shared_config(sims, redis.url))]
    with contextlib.ExitStack() as stack:
        shared = open_streams(replicas, 6, stack)
    assert shared == alone

    # The same arrivals without sharing: each replica balances its own slice and both pile onto the
    # backend their rotation starts with.
    isolated = [gateway(shared_config(sims, redis.url, share=False)) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=30))
        served: Counter[str] = Counter()
        for i in range(6):
            body = chat_body(f"request {i}", stream=True, max_tokens=300)
            url = f"{isolated[i % 2].url}/v1/chat/completions"
            reply = stack.enter_context(client.stream("POST", url, json=body))
            served[reply.headers["x-hetgate-route"].split("backend=")[1].split(";")[0]] += 1
    assert sorted(served.values()) == [2, 4]


def hold_two_streams(stack: contextlib.ExitStack, url: str, observer) -> None:
    """Open two long streams through the gateway at `url` (held until `stack` closes) and wait until the
    replica `observer` counts both in the cluster's in-flight view."""
    client = stack.enter_context(httpx.Client(timeout=30))
    for i in range(2):
        body = chat_body(f"request {i}", stream=True, max_tokens=300)
        stack.enter_context(client.stream("POST", f"{url}/v1/chat/completions", json=body))
    until(lambda: cluster_in_flight(observer) == 2)


def test_a_crashed_replica_stops_counting_within_the_ttl(sim, gateway, redis_server_factory):
    redis = redis_server_factory()
    sims = [sim(simple_engine=LONG), sim(simple_engine=LONG)]
    survivor = gateway(shared_config(sims, redis.url))
    doomed = gateway(shared_config(sims, redis.url))
    with contextlib.ExitStack() as stack:
        hold_two_streams(stack, doomed.url, survivor)
        os.killpg(doomed.pid, signal.SIGKILL)
        started = time.monotonic()
        until(lambda: cluster_in_flight(survivor) == 0, timeout_s=10)
    assert time.monotonic() - started < 2.0 + 1.0  # share_ttl_s (2 s) plus a publication or two


def test_other_replicas_counts_fade_when_redis_is_gone(sim, gateway, redis_server_factory):
    """Redis down: a replica keeps the last counts it heard for share_ttl_s (other replicas keep its
    own as long), then balances on its own view, as a lone gateway would (gateway/replicas.py)."""
    redis = redis_server_factory()
    sims = [sim(simple_engine=LONG), sim(simple_engine=LONG)]
    survivor = gateway(shared_config(sims, redis.url))
    other = gateway(shared_config(sims, redis.url))
    with contextlib.ExitStack() as stack:
        hold_two_streams(stack, other.url, survivor)
        redis.kill()
        gone = time.monotonic()
        until(lambda: cluster_in_flight(survivor) == 0, timeout_s=10)
        faded_after = time.monotonic() - gone
        assert metric(other.url, "hetgate:backend_in_flight") == 2  # still running: only the view faded
    assert faded_after >= 1.0  # held for about share_ttl_s (2 s) first, not dropped at the first error
