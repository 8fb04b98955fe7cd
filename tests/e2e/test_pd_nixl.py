"""P/D through hetgate with NixlConnector between two real CPU vLLM servers (UCX over loopback).

This is the connector that exercises hetgate's real P/D protocol: the prefill answer carries
``kv_transfer_params`` that hetgate must forward verbatim to the decoder, which then pulls the KV
blocks from the prefiller over NIXL. Runs by default (scripts/test.sh installs NIXL with
``scripts/setup_vllm_env.sh --with-nixl``); ``HETGATE_E2E_NIXL=0`` leaves it out explicitly.

Proof that the KV moved and was not recomputed comes from the decoder's own counters:
``vllm:prompt_tokens_by_source_total`` splits its prompt tokens into ``external_kv_transfer`` (pulled
from the prefiller) and ``local_compute``; NIXL's own ``vllm:nixl_num_failed_transfers_total`` stays 0.
Greedy output must equal the aggregated (one-server) output.

Why the servers are configured as they are (docs/e2e.md, "NIXL on two CPU cores"): see
`bench/vllm_server.py`'s `nixl_spec`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import (
    BLOCK_SIZE,
    ROUTE_HEADER,
    backend_entry,
    code_prompt,
    gateway_config,
    metric_total,
    route_fields,
    run_conformance_suite,
)
from vllm_server import (
    SETUP_HINT,
    ServerSpec,
    VllmFleet,
    VllmServer,
    log_tail,
    make_first_handshake,
    nixl_spec,
)

from bench.harness import GatewayProcess

pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 16
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"


@pytest.fixture(scope="module")
def nixl_specs(vllm_venv: Path) -> tuple[ServerSpec, ServerSpec]:
    probe = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", "import nixl._api"], capture_output=True)
    if probe.returncode != 0:
        pytest.fail(f"NIXL is not installed in {vllm_venv}: run bash {SETUP_HINT} --with-nixl", pytrace=False)
    cores = sorted(os.sched_getaffinity(0))
    return (
        nixl_spec("nixl-prefill", "kv_producer", str(cores[0])),
        nixl_spec("nixl-decode", "kv_consumer", str(cores[-1])),
    )


# (prefiller pid, decoder pid) of each pair whose first NIXL handshake is made: the tests of hetgate
# start on a pair past it (`make_first_handshake`, docs/e2e.md)
_HANDSHAKEN: set[tuple[int, int]] = set()


@pytest.fixture
def nixl_servers(vllm_fleet: VllmFleet, nixl_specs: tuple[ServerSpec, ServerSpec]) -> list[VllmServer]:
    prefill, decode = vllm_fleet.acquire(nixl_specs)
    pair = (process_id(prefill), process_id(decode))
    if pair not in _HANDSHAKEN:
        make_first_handshake(prefill, decode)
        _HANDSHAKEN.add(pair)
    return [prefill, decode]


def process_id(server: VllmServer) -> int:
    assert server.process is not None, f"{server.spec.name} is not running"
    return server.process.pid


def decode_counters(decode: VllmServer) -> tuple[float, float, float]:
    """(tokens pulled over NIXL, tokens computed locally, failed NIXL transfers) on the decoder."""
    return (
        metric_total(decode.base_url, BY_SOURCE, source="external_kv_transfer"),
        metric_total(decode.base_url, BY_SOURCE, source="local_compute"),
        metric_total(decode.base_url, FAILED_TRANSFERS),
    )


def aggregated_completion(server: VllmServer, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def start_pd_gateway(
    start_gateway: Callable[[dict[str, Any], str], GatewayProcess],
    prefill: VllmServer,
    decode: VllmServer,
    name: str,
) -> GatewayProcess:
    """hetgate in front of the pair, splitting every request: prefill on one, decode on the other."""
    backends = [
        backend_entry(prefill, roles=["prefill"], kv_connector="nixl"),
        backend_entry(decode, roles=["decode"], kv_connector="nixl"),
    ]
    return start_gateway(gateway_config(backends, disaggregation="always"), name)


def test_nixl_pd_through_hetgate_pulls_the_kv_instead_of_recomputing(
    nixl_servers: list[VllmServer], start_gateway
) -> None:
    prefill, decode = nixl_servers
    gateway = start_pd_gateway(start_gateway, prefill, decode, "pd-nixl")
    body = {"model": "tiny", "prompt": code_prompt(12), "max_tokens": MAX_TOKENS, "temperature": 0}
    pulled_before, computed_before, failed_before = decode_counters(decode)

    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=300)

    assert response.status_code == 200, (response.text, gateway.log())
    route = route_fields(response.headers[ROUTE_HEADER])
    # A fallback (`decode_failed`) says the decode leg failed: the gateway's log says why.
    assert route == {"mode": "pd", "prefill": prefill.spec.name, "decode": decode.spec.name}, (
        gateway.log(),
        log_tail(decode.log_path),
    )
    pulled_after, computed_after, failed_after = decode_counters(decode)
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    pulled, computed = pulled_after - pulled_before, computed_after - computed_before
    # The decoder counts the whole prompt as pulled over NIXL and computes none of it itself.
    assert (pulled, computed) == (prompt_tokens, 0), (pulled, computed, prompt_tokens)
    assert failed_after == failed_before
    reference = aggregated_completion(prefill, body)
    assert response.json()["choices"][0]["text"] == reference["choices"][0]["text"]


def test_nixl_pd_streamed_chat_matches_aggregated_greedy_output(
    nixl_servers: list[VllmServer], start_gateway
) -> None:
    prefill, decode = nixl_servers
    gateway = start_pd_gateway(start_gateway, prefill, decode, "pd-nixl-chat")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": code_prompt(12)}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    pulled_before, computed_before, failed_before = decode_counters(decode)

    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=300,
    ) as response:
        assert response.status_code == 200, (response.read(), gateway.log())
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]

    assert lines[-1] == "data: [DONE]"
    chunks = [httpx.Response(200, content=line[len("data: ") :]).json() for line in lines[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    pulled_after, computed_after, failed_after = decode_counters(decode)
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert (pulled_after - pulled_before, computed_after - computed_before) == (prompt_tokens, 0)
    assert failed_after == failed_before
    reference = httpx.post(f"{prefill.base_url}/v1/chat/completions", json=body, timeout=300)
    assert reference.status_code == 200, reference.text
    assert text == reference.json()["choices"][0]["message"]["content"]


PD_CHECKS = {
    "test_conformance_pd.py::test_prefill_response_carries_nixl_pull_params",
    "test_conformance_pd.py::test_chat_prefill_also_returns_params",
    "test_conformance_pd.py::test_decode_with_the_prefillers_params",
}


def test_conformance_pd_checks_pass_against_nixl_vllm(nixl_servers: list[VllmServer], e2e_logs: Path) -> None:
    prefill, decode = nixl_servers
    target = {
        "base_url": prefill.base_url,
        "model": "tiny",
        "block_size": BLOCK_SIZE,
        "prefill_url": prefill.base_url,
        "decode_url": decode.base_url,
        "simulator": False,
    }
    report = e2e_logs / "conformance-pd-nixl.txt"
    outcome = run_conformance_suite(target, report, "test_conformance_pd.py")
    detail = f"{outcome.summary()} ({report}):\n{outcome.output[-6000:]}"
    assert outcome.returncode == 0, f"P/D checks failed on real vLLM: {detail}"
    assert not outcome.skipped and not outcome.failed, detail
    assert set(outcome.passed) == PD_CHECKS, detail
