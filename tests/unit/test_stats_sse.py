"""vLLM /metrics parsing and the P/D usage rewrite."""

from __future__ import annotations

import orjson
import pytest

from gateway.sse import EventCutter, EventTooLarge, UsageRewriter
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
    rewriter, cutter = UsageRewriter(7), EventCutter(1024)
    out = b"".join(
        rewriter.rewrite_events(cutter.feed(stream[i : i + 13])) for i in range(0, len(stream), 13)
    )
    assert cutter.done and cutter.partial == b""
    events = [e for e in out.split(b"\n\n") if e]
    assert events[0] == b'data: {"choices":[{"delta":{"content":"a"}}]}'
    assert orjson.loads(events[1][6:])["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    assert events[2] == b"data: [DONE]"


def test_cutter_passes_whole_events_and_holds_the_partial_one():
    cutter = EventCutter(1024)
    assert cutter.feed(b'data: {"a"') == b""
    assert cutter.feed(b':1}\n\ndata: {"b') == b'data: {"a":1}\n\n'
    assert cutter.partial == b'data: {"b'
    assert cutter.feed(b'":2}\n\n') == b'data: {"b":2}\n\n'
    assert not cutter.done


def test_cutter_stops_at_done_even_within_a_chunk():
    cutter = EventCutter(1024)
    assert cutter.feed(b"data: {}\n\ndata: [DONE]\n\ndata: {}\n\n") == b"data: {}\n\ndata: [DONE]\n\n"
    assert cutter.done
    assert cutter.feed(b"data: {}\n\n") == b""


def test_cutter_does_not_take_done_inside_another_line_for_the_end():
    cutter = EventCutter(1024)
    assert cutter.feed(b'data: {"x": "data: [DONE]\n\n') == b'data: {"x": "data: [DONE]\n\n'
    assert not cutter.done


def test_cutter_refuses_an_event_that_never_ends():
    cutter = EventCutter(16)
    cutter.feed(b"data: 0123456789")
    with pytest.raises(EventTooLarge):
        cutter.feed(b"0123456789")


def test_cutter_passes_on_the_whole_events_before_one_that_never_ends():
    cutter = EventCutter(16)
    assert cutter.feed(b"data: 1\n\ndata: 0123456789abcdefghij") == b"data: 1\n\n"
    assert cutter.overflowed and not cutter.done
    with pytest.raises(EventTooLarge):
        cutter.feed(b"more")
