"""Parse the few numbers routing needs from vLLM's Prometheus /metrics text.

A line scan, not a full Prometheus parser: vLLM's page is mostly histogram buckets we skip, and the
poller runs every second per backend. Values are summed over label sets (engines, DP ranks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# vLLM publishes its KV cache's size as labels of an info gauge (value 1), one sample per engine.
_CACHE_INFO = "vllm:cache_config_info"
_CACHE_LABEL = re.compile(r'\b(block_size|num_gpu_blocks)="(\d+)"')

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
    # Tokens the KV cache holds, over all engines (`vllm:cache_config_info`: num_gpu_blocks x
    # block_size); 0 where not published.
    kv_capacity_tokens: float = 0.0


def parse_vllm_metrics(text: str) -> VllmLoad:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == _CACHE_INFO:
            totals["kv_capacity_tokens"] = totals.get("kv_capacity_tokens", 0.0) + _cache_tokens(line)
            continue
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


def _cache_tokens(line: str) -> float:
    """The tokens one engine's KV cache holds, from its `vllm:cache_config_info` labels (0: not known,
    e.g. `num_gpu_blocks="None"` before the engine has profiled its memory)."""
    labels = dict(_CACHE_LABEL.findall(line.split("}", 1)[0]))
    return float(labels["block_size"]) * float(labels["num_gpu_blocks"]) if len(labels) == 2 else 0.0
