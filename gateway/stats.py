"""Parse the few numbers routing needs from vLLM's Prometheus /metrics text.

A line scan, not a full Prometheus parser: vLLM's page is mostly histogram buckets we skip, and the
poller runs every second per backend. Values are summed over label sets (engines, DP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

_WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # releases before vLLM 0.10
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits",
}


@dataclass(frozen=True, slots=True)
class VllmLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


def parse_vllm_metrics(text: str) -> VllmLoad:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = _WANTED.get(name)
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        # Usage is a fraction per engine: the fullest engine is the one that will queue.
        combine = max if field == "kv_usage" else float.__add__
        totals[field] = combine(totals.get(field, 0.0), value)
    return VllmLoad(**totals)
