"""Prefill/decode over HTTP: a prefiller's `kv_transfer_params` (NIXL pull shape, A1 [observed])."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from conformance_helpers import ConformanceTarget, metric_samples, metric_value, token_prompt, words

# What a gateway's prefill leg sends (vllm-reference.md A1, step 2).
NIXL_REQUEST_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
OBSERVED_KEYS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
    "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens",
}  # fmt: skip
HELD_METRIC = "hetgate:kv_blocks_held_for_transfer"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


@pytest.fixture
def prefiller(conformance_target: ConformanceTarget) -> Iterator[httpx.Client]:
    if conformance_target.prefill_url is None:
        pytest.skip("no prefill-role server in this target")
    with httpx.Client(base_url=conformance_target.prefill_url, timeout=60) as http:
        yield http


Undecoded = list[tuple[str, dict[str, Any]]]  # (path, the decode leg's request) of prefills not decoded


@pytest.fixture
def undecoded(conformance_target: ConformanceTarget) -> Iterator[Undecoded]:
    """Prefills a check makes without decoding them, decoded at its end (one token, as prefilled) where
    the target has a decoder. Until a decoder pulls its KV, a real NIXL prefiller holds the request's
    blocks for the whole lease (120 s in the e2e servers), and its engine steps without pause all the
    while (docs/e2e.md): on two cores that likely starved the decoder of the next check (a `/metrics`
    read timed out after 60 s)."""
    legs: Undecoded = []
    yield legs
    if conformance_target.decode_url is None or not legs:
        return
    with httpx.Client(base_url=conformance_target.decode_url, timeout=300) as decoder:
        for path, request in legs:
            response = decoder.post(path, json=request)
            assert response.status_code == 200, f"releasing a prefill's KV failed: {response.text}"


def prefill(
    prefiller: httpx.Client,
    target: ConformanceTarget,
    request_id: str,
    undecoded: Undecoded | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """One prefill leg; `undecoded`: where to note it when the check does not decode it itself."""
    request = {
        "model": target.model,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": NIXL_REQUEST_PARAMS,
        **fields,
    }
    path = "/v1/chat/completions" if "messages" in fields else "/v1/completions"
    response = prefiller.post(path, json=request, headers={"X-Request-Id": request_id})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    if undecoded is not None:
        undecoded.append((path, {**request, "kv_transfer_params": body.get("kv_transfer_params")}))
    return body


def test_prefill_response_carries_nixl_pull_params(
    prefiller: httpx.Client, conformance_target: ConformanceTarget, undecoded: Undecoded
) -> None:
    prompt = token_prompt(prefiller, conformance_target, 4 * conformance_target.block_size, seed="pd")
    response = prefill(prefiller, conformance_target, "conf-pd-1", undecoded, prompt=prompt)
    params = response["kv_transfer_params"]
    assert set(params) >= OBSERVED_KEYS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"].startswith("cmpl-conf-pd-1")
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
    assert isinstance(params["remote_block_ids"], list) and all(
        isinstance(g, list) for g in params["remote_block_ids"]
    )
    assert isinstance(params["remote_port"], int) and params["remote_host"]
    assert params["tp_size"] >= 1 and params["transfer_mode"] == "pull"
    assert params["remote_num_tokens"] == response["usage"]["prompt_tokens"]
    assert response["usage"]["completion_tokens"] == 1


def test_chat_prefill_also_returns_params(
    prefiller: httpx.Client, conformance_target: ConformanceTarget, undecoded: Undecoded
) -> None:
    messages = [{"role": "user", "content": words(40, seed="pdchat")}]
    response = prefill(prefiller, conformance_target, "conf-pd-chat", undecoded, messages=messages)
    assert response["kv_transfer_params"]["do_remote_prefill"] is True


def test_decode_with_the_prefillers_params(
    prefiller: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    if conformance_target.decode_url is None:
        pytest.skip("no decode-role server in this target")
    prompt = token_prompt(prefiller, conformance_target, 4 * conformance_target.block_size, seed="pd-decode")
    params = prefill(prefiller, conformance_target, "conf-pd-2", prompt=prompt)["kv_transfer_params"]
    held_before = _held_blocks(prefiller) if conformance_target.simulator else 0.0
    request = {
        "model": conformance_target.model,
        "prompt": prompt,
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": params,
    }
    # A NIXL decoder on a 2-core host busy-polls beside its prefiller, and its API server has been seen
    # to answer nothing for two minutes (CI, stop 49): a slow host, not a wrong answer.
    with httpx.Client(base_url=conformance_target.decode_url, timeout=180) as decoder:
        before = _by_source(decoder)
        with decoder.stream(
            "POST", "/v1/completions", json=request, headers={"X-Request-Id": "conf-pd-2"}
        ) as r:
            assert r.status_code == 200
            text = r.read().decode()
        after = _by_source(decoder)
    assert text.endswith("data: [DONE]\n\n")
    # The decoder pulled the whole prompt and computed none of it (the counters are cumulative: deltas).
    moved = {source: after[source] - before[source] for source in after}
    assert moved == {"external_kv_transfer": len(prompt), "local_compute": 0, "local_cache_hit": 0}
    if conformance_target.simulator:
        # The simulator's stand-in for the NIXL pull tells the prefiller, which unpins the request's blocks.
        pulled = len(params["remote_block_ids"][0])
        assert _wait_for(lambda: _held_blocks(prefiller) == held_before - pulled)


def _by_source(server: httpx.Client) -> dict[str, float]:
    samples = metric_samples(server)
    sources = ("external_kv_transfer", "local_compute", "local_cache_hit")
    return {source: metric_value(samples, BY_SOURCE, source=source) for source in sources}


def _held_blocks(server: httpx.Client) -> float:
    return metric_value(metric_samples(server), HELD_METRIC)


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
