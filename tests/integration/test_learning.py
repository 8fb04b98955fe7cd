"""What the gateway learns from finished requests: the one outcome rule (`scoring/outcome.py`) the simulator
uses too, each leg credited to the backend that did it, published as `hetgate:cost_model_*` per backend."""

from __future__ import annotations

import httpx

from tests.integration.conftest import backend, chat_body, config, metric, route_parts


def cost_gateway(sim, gateway, split: bool):
    if split:
        p, d = sim(role="prefill"), sim(role="decode")
        backends = [
            backend(p, "p", ("prefill",), kv_connector="nixl"),
            backend(d, "d", ("decode",), kv_connector="nixl"),
        ]
    else:
        backends = [backend(sim(), "b")]
    cfg = config(backends, routing={"policy": "cost", "disaggregation": "always" if split else "never"})
    cfg["models"][0]["spec"] = "deepseek-r1"
    return gateway(cfg)


def stream(url: str, n: int = 3) -> list[str]:
    routes = []
    for _ in range(n):
        body = chat_body("a prompt of some length " * 30, max_tokens=6, stream=True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=15) as response:
            assert response.status_code == 200
            assert b"".join(response.iter_raw()).rstrip().endswith(b"data: [DONE]")
            routes.append(response.headers["x-hetgate-route"])
    return routes


def served_where_priced(routes: list[str], expected: str) -> None:
    """Every route names `expected` and carries the TTFT and TPOT its plan predicted for it."""
    for route in routes:
        served, predicted = route_parts(route)
        assert served == expected
        assert predicted["predicted_ttft_ms"] > 0 and predicted["predicted_tpot_ms"] > 0, route


def predicted_beside_observed(url: str, mode: str, n: int) -> None:
    """The predicted TTFT and TPOT histograms count the same streamed requests as the observed ones."""
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert metric(url, f"hetgate:{name}_count", mode=mode) == n
        assert metric(url, f"hetgate:predicted_{name}_count", mode=mode) == n


def test_a_split_stream_teaches_each_leg_to_its_backend(sim, gateway):
    gw = cost_gateway(sim, gateway, split=True)
    served_where_priced(stream(gw.url), "mode=pd; prefill=p; decode=d")
    predicted_beside_observed(gw.url, "pd", 3)
    # The prefill leg corrects the prefiller's compute, the decode leg the decoder's TPOT (1.0: nothing
    # learnt; 0: never published). Before, a split taught the gateway nothing.
    assert metric(gw.url, "hetgate:cost_model_error", backend="p") not in (0.0, 1.0)
    assert metric(gw.url, "hetgate:cost_model_tpot_error", backend="d") not in (0.0, 1.0)


def test_an_aggregated_stream_teaches_compute_and_tpot_and_a_plain_reply_nothing(sim, gateway):
    gw = cost_gateway(sim, gateway, split=False)
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("words " * 30, max_tokens=6), timeout=15)
    assert r.status_code == 200
    # Not streamed: no first-token time, nothing learnt, nothing published.
    assert metric(gw.url, "hetgate:cost_model_error", backend="b") == 0.0
    served_where_priced(stream(gw.url), "mode=aggregated; backend=b")
    predicted_beside_observed(gw.url, "aggregated", 3)
    assert metric(gw.url, "hetgate:cost_model_error", backend="b") not in (0.0, 1.0)
    assert metric(gw.url, "hetgate:cost_model_queue_error", backend="b") not in (0.0, 1.0)
    assert metric(gw.url, "hetgate:cost_model_tpot_error", backend="b") not in (0.0, 1.0)
    # Seconds, and possibly none after three prompts of one size (the compute takes what they cannot
    # tell apart): published, never negative.
    published = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert 'hetgate:cost_model_overhead_seconds{backend="b"}' in published
    assert metric(gw.url, "hetgate:cost_model_overhead_seconds", backend="b") >= 0.0


def test_a_request_retried_elsewhere_teaches_nothing(sim, gateway):
    """The plan priced the MI300X (its queue, its compute); a 503 there sends the request to the MI308X.
    Credited with the MI300X's prediction, the MI308X would learn the MI300X's roofline as its own."""
    fast, slow = sim(accelerator="mi300x"), sim(accelerator="mi308x")
    fast.set_faults({"error_status": 503})
    cfg = config(
        [
            backend(fast, "fast", accelerator="mi300x", gpus=8),
            backend(slow, "slow", accelerator="mi308x", gpus=8),
        ],
        routing={"policy": "cost", "disaggregation": "never"},
        health={"backpressure_cooldown_s": 0},  # a 503 would put it last for the next request
    )
    cfg["models"][0]["spec"] = "deepseek-r1"
    gw = gateway(cfg)
    for i in range(3):  # prompts that share no prefix: the MI308X's cache would draw the next one there
        body = chat_body(f"long prompt {i} " * 2000, max_tokens=6, stream=True)
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=15) as response:
            assert response.status_code == 200
            # Served elsewhere than priced: the route carries no prediction either.
            assert response.headers["x-hetgate-route"] == "mode=aggregated; backend=slow"
            assert b"".join(response.iter_raw()).rstrip().endswith(b"data: [DONE]")
    assert metric(gw.url, "hetgate:retries_total") == 3  # each one planned on the MI300X first
    assert metric(gw.url, "hetgate:cost_model_error", backend="slow") == 0.0  # never published
