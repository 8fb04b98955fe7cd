"""Two `hetgate epp` replicas, each behind its own real Envoy, sharing one real Redis: they route as one
EPP would, because each counts the requests the other holds in flight (gateway/replicas.py, as `serve`).

The backends differ in capacity (3 and 2 sequences), so `least_load` has a tie only at the first request:
every later decision is forced by the load the deciding replica sees, and the whole route sequence can be
compared, not just the totals. Non-streamed replies of ~6 s keep every request in flight (the EPP holds a
reservation until the response headers, which come with the whole reply) until the last one is routed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from bench.epp_harness import EnvoyProcess, EppProcess
from bench.sim.simple_engine import SimpleEngineConfig
from tests.epp.test_epp_envoy import served_by
from tests.integration.conftest import backend, chat_body, config, metric
from tests.redis_server import redis_server_factory

__all__ = ["redis_server_factory"]

LONG = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.02)
REQUESTS = 5  # fills both backends exactly: 3 + 2


@dataclass(frozen=True, slots=True)
class Replica:
    epp: EppProcess
    envoy: EnvoyProcess


def replica_config(sims: list, redis_url: str, key_prefix: str, share: bool) -> dict:
    return config(
        [backend(sims[0], "a", max_num_seqs=3), backend(sims[1], "b", max_num_seqs=2)],
        routing={"policy": "least_load"},
        index={"store": "redis", "redis_url": redis_url, "key_prefix": key_prefix, "share_load": share},
        # vLLM's own running counts (polled) would hide the EPPs' view: poll them rarely here.
        health={"metrics_interval_s": 60},
    )


def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.05)


def own_in_flight(replicas: list[Replica]) -> float:
    return sum(metric(r.epp.metrics_url, "hetgate:backend_in_flight") for r in replicas)


def cluster_in_flight(replica: Replica) -> float:
    return metric(replica.epp.metrics_url, "hetgate:backend_in_flight_cluster")


def route_in_turn(replicas: list[Replica], wait_for_share: bool) -> list[str]:
    """REQUESTS long requests, sent through the replicas in turn, each once every earlier one holds its
    reservation (and, with `wait_for_share`, once the replica it goes to counts all of them). Returns the
    backend of each, in order."""
    with ThreadPoolExecutor(REQUESTS) as pool, httpx.Client(timeout=30) as client:
        replies = []
        for i in range(REQUESTS):
            target = replicas[i % len(replicas)]
            until(lambda i=i: own_in_flight(replicas) == i, f"the EPPs hold {i} reservations")
            if wait_for_share:
                until(lambda i=i, t=target: cluster_in_flight(t) == i, f"the replica counts all {i}")
            body = chat_body(f"request {i}", max_tokens=300)
            replies.append(pool.submit(client.post, f"{target.envoy.url}/v1/chat/completions", json=body))
        assert all(r.result().status_code == 200 for r in replies)
        return [served_by(r.result()) for r in replies]


def test_two_epp_replicas_route_as_one(sim, epp, envoy, redis_server_factory):
    redis = redis_server_factory()
    sims = [sim(simple_engine=LONG), sim(simple_engine=LONG)]
    pool = [s.url for s in sims]

    def replicas(count: int, key_prefix: str, share: bool) -> list[Replica]:
        started = []
        for _ in range(count):
            picker = epp(replica_config(sims, redis.url, key_prefix, share))
            started.append(Replica(picker, envoy(picker.grpc_port, pool)))
        return started

    alone = route_in_turn(replicas(1, "alone", share=True), wait_for_share=True)
    assert sorted(alone) == ["a", "a", "a", "b", "b"]  # by capacity, 3 : 2

    pair = route_in_turn(replicas(2, "pair", share=True), wait_for_share=True)
    assert pair == alone

    # The control: the same arrivals without sharing. Each replica balances its own slice, so they
    # decide differently (the second replica's first request goes to `a`, already busy).
    apart = route_in_turn(replicas(2, "apart", share=False), wait_for_share=False)
    assert apart != alone
