"""Prefill/decode through the gateway on simulated vLLM backends speaking vLLM's P/D protocol."""

from __future__ import annotations

import httpx
import openai
import orjson

from tests.integration.conftest import MODEL, backend, chat_body, config, metric, route_parts


def pd_gateway(sim, gateway, connector="nixl", **routing):
    prefill, decode = sim(role="prefill"), sim(role="decode")
    cfg = config(
        [
            backend(prefill, "p", ("prefill",), kv_connector=connector),
            backend(decode, "d", ("decode",), kv_connector=connector),
        ],
        routing={"disaggregation": "always", **routing},
    )
    return gateway(cfg), prefill, decode


def test_split_request_runs_both_legs_and_reports_prefill_cached_tokens(sim, gateway):
    gw, prefill, decode = pd_gateway(sim, gateway)
    long_prompt = "shared system prompt words " * 60
    for _ in range(2):  # the second request finds the prompt cached on the prefiller
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(long_prompt), timeout=10)
    assert r.status_code == 200
    assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=d"
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # The decode server loaded the prompt from the prefiller instead of computing it.
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert metric(prefill.url, "vllm:generation_tokens_total") == 2  # max_tokens=1 per prefill leg


def test_split_stream_with_usage_through_openai_client(sim, gateway):
    gw, _, decode = pd_gateway(sim, gateway)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me a story " * 20}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    client.close()
    assert chunks[-1].usage.completion_tokens == 5
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0


def test_shared_storage_connector_sends_no_kv_params(sim, gateway):
    gw, _, decode = pd_gateway(sim, gateway, connector="shared-storage")
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "abc " * 40, "max_tokens": 3})
    assert r.status_code == 200
    assert r.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=d"
    # Without kv_transfer_params the prefill server sees a plain request: nothing is held for transfer.
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


def test_auto_splits_long_prompts_only(sim, gateway):
    gw, _, _ = pd_gateway(sim, gateway, disaggregation="auto", pd_min_prompt_tokens=200)
    short = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("hi"), timeout=10)
    long = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("word " * 2000), timeout=10)
    assert short.headers["x-hetgate-route"] == "mode=aggregated; backend=d"
    assert long.headers["x-hetgate-route"] == "mode=pd; prefill=p; decode=d"


def test_route_header_can_be_turned_off(sim, gateway):
    gw, _, _ = pd_gateway(sim, gateway, route_header=False)
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
    assert r.status_code == 200
    assert "x-hetgate-route" not in r.headers
    assert orjson.loads(r.content)["object"] == "chat.completion"


def test_cost_policy_sends_long_prompts_to_the_compute_rich_backend(sim, gateway):
    fast, slow = sim(accelerator="mi300x"), sim(accelerator="mi308x")
    cfg = config(
        [
            backend(fast, "mi300x-0", accelerator="mi300x", gpus=8),
            backend(slow, "mi308x-0", accelerator="mi308x", gpus=8),
        ],
        routing={"policy": "cost"},
    )
    cfg["models"][0]["spec"] = "deepseek-r1"
    gw = gateway(cfg)
    routes = [
        httpx.post(
            f"{gw.url}/v1/chat/completions", json=chat_body("long prompt " * 2000), timeout=10
        ).headers["x-hetgate-route"]
        for _ in range(3)
    ]
    parts = [route_parts(route) for route in routes]
    assert [served for served, _ in parts] == ["mode=aggregated; backend=mi300x-0"] * 3
    # The plan's own prices travel with it: a 2,000-word prompt's prefill takes milliseconds at least.
    for _, predicted in parts:
        assert predicted["predicted_ttft_ms"] > 1.0 and predicted["predicted_tpot_ms"] > 0.0


def test_auto_serves_a_turn_whole_on_its_holder_when_a_split_would_prefill_it_from_scratch(sim, gateway):
    """Both backends may do both roles. A conversation's first turn is short and is served whole on
    b0; its next turn lacks more than the gate there, but b1 holds none of it: a split would prefill the
    whole history again on b1, so the turn is served whole on b0 (`PlanningRouter._split_adds_prefill`).
    A new prompt, held nowhere, is still split."""
    sims = [sim(role="both"), sim(role="both")]
    backends = [backend(s, f"b{i}", kv_connector="nixl") for i, s in enumerate(sims)]
    routing = {"policy": "prefix", "disaggregation": "auto", "pd_min_prompt_tokens": 300}
    gw = gateway(config(backends, routing=routing))
    history = " ".join(f"h{j}" for j in range(200))
    first = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(history), timeout=10)
    assert first.headers["x-hetgate-route"].startswith("mode=aggregated; backend=b0")
    turn = chat_body(history)
    turn["messages"] += [{"role": "assistant", "content": "yes"}, {"role": "user", "content": "w " * 800}]
    second = httpx.post(f"{gw.url}/v1/chat/completions", json=turn, timeout=10)
    assert second.status_code == 200
    assert second.headers["x-hetgate-route"].startswith("mode=aggregated; backend=b0")
    fresh = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("n " * 1600), timeout=10)
    assert fresh.headers["x-hetgate-route"].startswith("mode=pd")
