"""/metrics carries vLLM 0.32's names and labels, and its counters move with traffic [observed list]."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from conformance_helpers import ConformanceTarget, metric_samples, metric_value, token_prompt, words

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


Samples = dict[str, list[tuple[dict[str, str], float]]]


def delta_of(before: Samples, after: Samples, model: str) -> Callable[..., float]:
    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, model_name=model, **labels) - metric_value(
            before, name, model_name=model, **labels
        )

    return delta


def test_counters_follow_a_request(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    model = conformance_target.model
    before = metric_samples(client)
    request = {"model": model, "prompt": words(10, seed="metric"), "max_tokens": 3, "ignore_eos": True}
    usage = client.post("/v1/completions", json=request).json()["usage"]
    delta = delta_of(before, metric_samples(client), model)

    assert delta("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 3
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:prefix_cache_queries_total") == usage["prompt_tokens"]


def test_prefix_cache_counters_count_a_repeated_prompts_hit(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    """The second time a prompt comes, its whole blocks are hits (the last token is always computed)."""
    size = conformance_target.block_size
    prompt = token_prompt(client, conformance_target, 3 * size + 5, seed="metric-hit")
    request = {"model": conformance_target.model, "prompt": prompt, "max_tokens": 1}
    assert client.post("/v1/completions", json=request).status_code == 200  # caches three blocks
    before = metric_samples(client)
    usage = client.post("/v1/completions", json=request).json()["usage"]
    delta = delta_of(before, metric_samples(client), conformance_target.model)

    hit = 3 * size
    assert delta("vllm:prefix_cache_queries_total") == len(prompt)
    assert delta("vllm:prefix_cache_hits_total") == hit
    by_source = "vllm:prompt_tokens_by_source_total"
    assert delta(by_source, source="local_cache_hit") == hit
    assert delta(by_source, source="local_compute") == len(prompt) - hit
    assert delta(by_source, source="external_kv_transfer") == 0
    if conformance_target.prompt_tokens_details:
        assert usage["prompt_tokens_details"]["cached_tokens"] == hit
