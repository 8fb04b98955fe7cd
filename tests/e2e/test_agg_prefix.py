"""Prefix-aware routing on the real engine, judged by vLLM's own prefix-cache counters.

vLLM on CPU caches whole 128-token blocks, so every shared prefix here spans two full blocks
(9 lines of `code_prompt`, ~300 tokens) and the suffixes are short.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import (
    BLOCK_SIZE,
    ROUTE_HEADER,
    backend_entry,
    code_prompt,
    gateway_config,
    metric_total,
    prompt_token_count,
    reset_prefix_cache,
    route_fields,
)
from vllm_server import VllmServer

pytestmark = pytest.mark.e2e

PREFIXES = 3
REQUESTS_PER_PREFIX = 4
PREFIX_LINES = 9
# Longest wait for hetgate's subscriber to receive and apply the KV events of a request sent around it.
EVENT_TIMEOUT_S = 30.0


def kv_events(gateway_url: str, backend: str, what: str) -> float:
    return metric_total(gateway_url, "hetgate:kv_events_total", backend=backend, what=what)


def wait_for_kv_events(gateway_url: str, backend: str, what: str, above: float) -> None:
    """Poll hetgate's own counter until it has applied more than `above` events of this kind."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while kv_events(gateway_url, backend, what) <= above:
        assert time.monotonic() < deadline, f"no {what!r} KV event from {backend} reached hetgate"
        time.sleep(0.05)


def index_matched_tokens(gateway_url: str) -> float:
    """Prompt tokens the gateway's prefix index matched, summed over requests (longest match each)."""
    return metric_total(gateway_url, "hetgate:index_matched_tokens_total")


def total_prefix_hits(servers: list[VllmServer]) -> float:
    return sum(metric_total(server.base_url, "vllm:prefix_cache_hits_total") for server in servers)


def complete(base_url: str, prompt: str) -> httpx.Response:
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response


def cached_blocks_tokens(server: VllmServer, prefix: str) -> int:
    """Tokens of the prefix that fill whole blocks: what a later request can hit."""
    return prompt_token_count(server.base_url, prefix) // BLOCK_SIZE * BLOCK_SIZE


def send_shared_prefix_workload(gateway_url: str) -> list[str]:
    """Prefix-major order: each prefix's requests follow each other (round robin alternates them)."""
    prefixes = [code_prompt(PREFIX_LINES) for _ in range(PREFIXES)]
    for prefix in prefixes:
        for variant in range(REQUESTS_PER_PREFIX):
            complete(gateway_url, f"{prefix}# variant {variant}\n")
    return prefixes


def test_prefix_policy_hits_vllms_cache_more_than_round_robin(
    aggregated_servers: list[VllmServer], start_gateway, tiny_model: Path
) -> None:
    backends = [backend_entry(server) for server in aggregated_servers]
    hits: dict[str, float] = {}
    shareable: dict[str, int] = {}
    for policy in ("round_robin", "prefix"):
        for server in aggregated_servers:
            reset_prefix_cache(server.base_url)
        config = gateway_config(backends, tokenizer=tiny_model, policy=policy)
        gateway = start_gateway(config, f"prefix-vs-{policy}")
        before = total_prefix_hits(aggregated_servers)
        prefixes = send_shared_prefix_workload(gateway.url)
        hits[policy] = total_prefix_hits(aggregated_servers) - before
        gateway.stop()
        shareable[policy] = sum(cached_blocks_tokens(aggregated_servers[0], p) for p in prefixes)

    assert min(shareable.values()) >= PREFIXES * 2 * BLOCK_SIZE
    # Round robin computes every prefix on both backends; affinity computes it once.
    assert hits["round_robin"] <= shareable["round_robin"] * (REQUESTS_PER_PREFIX - 2)
    assert hits["prefix"] >= shareable["prefix"] * (REQUESTS_PER_PREFIX - 1)
    assert hits["prefix"] > hits["round_robin"]


def test_kv_events_point_hetgate_at_prefixes_cached_behind_its_back(
    aggregated_servers: list[VllmServer], start_gateway, tiny_model: Path
) -> None:
    """Prefixes are cached by requests sent straight to vLLM; only the KV events tell hetgate where."""
    backends = [
        backend_entry(
            server,
            kv_events={
                "endpoint": server.spec.kv_events.endpoint,
                "replay_endpoint": server.spec.kv_events.replay_endpoint,
                "topic": server.spec.kv_events.topic,
            },
        )
        for server in aggregated_servers
    ]
    for server in aggregated_servers:
        reset_prefix_cache(server.base_url)
    gateway = start_gateway(gateway_config(backends, tokenizer=tiny_model, policy="prefix"), "kv-events")

    first, second = aggregated_servers
    placement = [first, second, second, first]  # no load- or order-based policy guesses this
    prefixes = [code_prompt(PREFIX_LINES) for _ in placement]
    for prefix, server in zip(prefixes, placement, strict=True):
        stored = kv_events(gateway.url, server.spec.name, "stored")
        complete(server.base_url, f"{prefix}# seed\n")
        wait_for_kv_events(gateway.url, server.spec.name, "stored", above=stored)

    before = total_prefix_hits(aggregated_servers)
    routed = []
    for prefix in prefixes:
        response = complete(gateway.url, f"{prefix}# through hetgate\n")
        routed.append(route_fields(response.headers[ROUTE_HEADER])["backend"])
    hits = total_prefix_hits(aggregated_servers) - before

    assert routed == [server.spec.name for server in placement]
    assert hits >= sum(cached_blocks_tokens(first, prefix) for prefix in prefixes)

    # /reset_prefix_cache on the first server: vLLM announces AllBlocksCleared at its next engine step,
    # hetgate drops that backend's blocks, and keeps the second server's.
    reset_prefix_cache(first.base_url)
    complete(first.base_url, "# one step, so the engine publishes the clear\n")
    wait_for_kv_events(gateway.url, first.spec.name, "cleared", above=0)
    for prefix in prefixes[1:3]:
        response = complete(gateway.url, f"{prefix}# after the reset\n")
        assert route_fields(response.headers[ROUTE_HEADER])["backend"] == second.spec.name
    # The first server's prefixes are forgotten: the index matches none of their tokens any more (the
    # backend such a request lands on is the rotation's choice, so it proves nothing).
    for prefix in (prefixes[0], prefixes[3]):
        matched = index_matched_tokens(gateway.url)
        complete(gateway.url, f"{prefix}# after the reset\n")
        assert index_matched_tokens(gateway.url) == matched, "a cleared backend's blocks still match"
