"""vLLM /metrics parsing and the P/D usage rewrite."""

from __future__ import annotations

import orjson

from gateway.sse import UsageRewriter
from gateway.stats import parse_vllm_metrics

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
"""


def test_parse_sums_engines_and_takes_the_fullest_cache():
    load = parse_vllm_metrics(METRICS)
    assert (load.running, load.waiting, load.kv_usage, load.prefix_hits) == (5.0, 4.0, 0.5, 512.0)


def test_parse_accepts_pre_0_10_names():
    assert parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="x"} 0.75\n').kv_usage == 0.75


def usage_event(cached: int) -> bytes:
    usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": cached}}
    return b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n"


def test_rewrite_json_sets_the_prefill_cached_tokens():
    body = orjson.dumps({"usage": {"prompt_tokens_details": {"cached_tokens": 640}}})
    out = orjson.loads(UsageRewriter(128).rewrite_json(body))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 128


def test_rewrite_leaves_bodies_without_details_alone():
    body = b'{"usage": {"prompt_tokens": 3, "prompt_tokens_details": null}}'
    assert UsageRewriter(1).rewrite_json(body) == body


def test_stream_rewrite_survives_events_split_across_chunks():
    stream = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' + usage_event(640) + b"data: [DONE]\n\n"
    rewriter = UsageRewriter(7)
    out = b"".join(rewriter.feed(stream[i : i + 13]) for i in range(0, len(stream), 13)) + rewriter.flush()
    events = [e for e in out.split(b"\n\n") if e]
    assert events[0] == b'data: {"choices":[{"delta":{"content":"a"}}]}'
    assert orjson.loads(events[1][6:])["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    assert events[2] == b"data: [DONE]"
