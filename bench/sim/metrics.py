"""Prometheus text for the simulated backend, under vLLM 0.32's metric names and labels.

Written by hand rather than with prometheus_client: the server is the baseline of the gateway
overhead benchmark, and a scrape here is a few string joins. Latencies are in simulated seconds
(wall seconds x time_scale), what the simulated accelerator would report.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from bench.sim.engine_api import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
HELD_FOR_TRANSFER_METRIC = "hetgate:kv_blocks_held_for_transfer"


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}.0')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}.0')
        out.append(f"{name}_count{{{labels}}} {self.count}.0")
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        return out


@dataclass(slots=True)
class ServerMetrics:
    """What the HTTP layer observes; the engine's counters come from `EngineStats` at scrape time."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))

    def record_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


def render(stats: EngineStats, server: ServerMetrics, model_name: str, hash_algo: str = "sha256") -> str:
    labels = f'engine="0",model_name="{model_name}"'
    lines: list[str] = []

    def sample(name: str, kind: str, value: float, extra: str = "") -> None:
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{{{labels}{extra}}} {float(value)}")

    sample("vllm:num_requests_running", "gauge", stats.num_requests_running)
    sample("vllm:num_requests_waiting", "gauge", stats.num_requests_waiting)
    sample("vllm:kv_cache_usage_perc", "gauge", stats.kv_cache_usage_perc)
    sample("vllm:prefix_cache_queries_total", "counter", stats.prefix_cache_queries)
    sample("vllm:prefix_cache_hits_total", "counter", stats.prefix_cache_hits)
    sample("vllm:num_preemptions_total", "counter", stats.num_preemptions)
    sample("vllm:prompt_tokens_total", "counter", stats.prompt_tokens)
    sample("vllm:generation_tokens_total", "counter", stats.generation_tokens)
    lines.append("# TYPE vllm:prompt_tokens_by_source_total counter")
    for source, count in stats.prompt_tokens_by_source.items():
        lines.append(f'vllm:prompt_tokens_by_source_total{{{labels},source="{source}"}} {float(count)}')
    lines.append("# TYPE vllm:request_success_total counter")
    for reason, count in server.finished.items():
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(count)}')
    lines.extend(server.ttft.lines("vllm:time_to_first_token_seconds", labels))
    lines.extend(server.e2e.lines("vllm:e2e_request_latency_seconds", labels))
    cache_info = (
        f'block_size="{stats.block_size}",num_gpu_blocks="{stats.num_gpu_blocks}",'
        f'prefix_caching_hash_algo="{hash_algo}",'
        f'kv_cache_size_tokens="{stats.block_size * stats.num_gpu_blocks}"'
    )
    lines.append("# TYPE vllm:cache_config_info gauge")
    lines.append(f"vllm:cache_config_info{{{labels},{cache_info}}} 1.0")
    lines.append(f"# HELP {HELD_FOR_TRANSFER_METRIC} KV blocks pinned on this prefiller awaiting a P/D pull.")
    sample(HELD_FOR_TRANSFER_METRIC, "gauge", stats.kv_held_for_transfer_blocks)
    return "\n".join(lines) + "\n"
