"""/metrics carries vLLM 0.32's names and labels, and its counters move with traffic [observed list]."""

from __future__ import annotations

import httpx
from conformance_helpers import ConformanceTarget, metric_samples, metric_value, words

REQUIRED = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:cache_config_info",
]


def test_vllm_metric_names_and_labels(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    samples = metric_samples(client)
    missing = [name for name in REQUIRED if name not in samples]
    assert not missing, f"missing metrics: {missing}"
    labels, _ = samples["vllm:num_requests_running"][0]
    assert labels["model_name"] == conformance_target.model and "engine" in labels
    sources = {labels["source"] for labels, _ in samples["vllm:prompt_tokens_by_source_total"]}
    assert {"local_compute", "local_cache_hit", "external_kv_transfer"} <= sources
    cache_labels, value = samples["vllm:cache_config_info"][0]
    assert value == 1.0
    assert int(cache_labels["block_size"]) == conformance_target.block_size
    assert int(cache_labels["num_gpu_blocks"]) > 0
    usage = metric_value(samples, "vllm:kv_cache_usage_perc", model_name=conformance_target.model)
    assert 0.0 <= usage <= 1.0


def test_counters_follow_a_request(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    model = conformance_target.model
    before = metric_samples(client)
    request = {"model": model, "prompt": words(10, seed="metric"), "max_tokens": 3, "ignore_eos": True}
    usage = client.post("/v1/completions", json=request).json()["usage"]
    after = metric_samples(client)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, model_name=model, **labels) - metric_value(
            before, name, model_name=model, **labels
        )

    assert delta("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 3
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:prefix_cache_queries_total") == usage["prompt_tokens"]
