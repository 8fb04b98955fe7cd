"""Opt-in: P/D through hetgate with NixlConnector between two CPU vLLM servers (UCX over loopback).

Not run by default (CI included): NIXL adds 68 MB to the venv, its workers busy-poll and on two
cores the first transfers took 3-30 s in our trials (vllm-reference.md B4). To run it:

    bash scripts/setup_vllm_env.sh --with-nixl
    HETGATE_E2E_NIXL=1 python -m pytest tests/e2e/test_pd_nixl.py

This is the connector that exercises hetgate's real P/D protocol: the prefill answer carries
``kv_transfer_params`` that hetgate must forward verbatim to the decoder.
"""

from __future__ import annotations

import os
from pathlib import Path

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
from vllm_server import KvTransfer, ServerSpec, VllmFleet, VllmServer, free_port

# Collected only with HETGATE_E2E_NIXL=1 (tests/e2e/conftest.py), so CI neither runs nor skips it.
pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 16
EXTERNAL = {"source": "external_kv_transfer"}


def nixl_spec(name: str, core: str) -> ServerSpec:
    env = (
        ("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
        ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port())),
        ("UCX_NET_DEVICES", "lo"),
    )
    transfer = KvTransfer("kv_both", connector="NixlConnector", buffer_device="cpu")
    return ServerSpec(name, kv_transfer=transfer, omp_threads_bind=core, extra_env=env)


@pytest.fixture(scope="module")
def nixl_specs() -> tuple[ServerSpec, ServerSpec]:
    cores = sorted(os.sched_getaffinity(0))
    return nixl_spec("nixl-prefill", str(cores[0])), nixl_spec("nixl-decode", str(cores[-1]))


@pytest.fixture
def nixl_servers(vllm_fleet: VllmFleet, nixl_specs: tuple[ServerSpec, ServerSpec]) -> list[VllmServer]:
    return vllm_fleet.acquire(nixl_specs)


def test_nixl_pd_through_hetgate(nixl_servers: list[VllmServer], start_gateway) -> None:
    prefill, decode = nixl_servers
    backends = [
        backend_entry(prefill, roles=["prefill"], kv_connector="nixl"),
        backend_entry(decode, roles=["decode"], kv_connector="nixl"),
    ]
    gateway = start_gateway(gateway_config(backends, disaggregation="always"), "pd-nixl")
    body = {"model": "tiny", "prompt": code_prompt(12), "max_tokens": MAX_TOKENS, "temperature": 0}
    before = metric_total(
        decode.base_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )

    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=300)

    assert response.status_code == 200, response.text
    route = route_fields(response.headers[ROUTE_HEADER])
    assert route == {"mode": "pd", "prefill": prefill.spec.name, "decode": decode.spec.name}
    after = metric_total(decode.base_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
    assert after - before >= 128
    reference = httpx.post(f"{prefill.base_url}/v1/completions", json=body, timeout=300).json()
    assert response.json()["choices"][0]["text"] == reference["choices"][0]["text"]


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
    result = run_conformance_suite(target, report, "test_conformance_pd.py")
    assert result.returncode == 0, f"P/D checks failed on real vLLM ({report}):\n{result.stdout[-6000:]}"
