"""The vLLM protocol conformance suite (tests/conformance), run against a real vLLM server.

The suite is written for hetgate's simulator and takes any live target from
``HETGATE_CONFORMANCE_TARGET`` (see tests/conformance/conftest.py). Running it in a child pytest keeps
its fixtures and ours apart; a failure here shows the child's report, i.e. where the simulator and
real vLLM disagree (a fix for the simulator, or for the suite's expectations).

The P/D checks of the suite expect NIXL-style ``kv_transfer_params``; the e2e servers use
ExampleConnector (no params), so no prefill/decode URLs are given and the suite skips those here;
the opt-in test_pd_nixl.py runs them against NixlConnector servers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import BLOCK_SIZE, run_conformance_suite
from vllm_server import SERVED_MODEL_NAME, VllmServer

pytestmark = pytest.mark.e2e


def target_for(server: VllmServer) -> dict[str, object]:
    events = server.spec.kv_events
    return {
        "base_url": server.base_url,
        "model": SERVED_MODEL_NAME,
        "block_size": BLOCK_SIZE,
        "prompt_tokens_details": True,
        "kv_events_endpoint": events.endpoint if events else None,
        "kv_events_topic": events.topic if events else "",
        "kv_replay_endpoint": events.replay_endpoint if events else None,
        "simulator": False,
    }


def test_conformance_suite_passes_against_real_vllm(
    aggregated_servers: list[VllmServer], e2e_logs: Path
) -> None:
    report = e2e_logs / "conformance-real-vllm.txt"
    result = run_conformance_suite(target_for(aggregated_servers[0]), report)
    assert result.returncode == 0, f"suite failed on real vLLM ({report}):\n{result.stdout[-6000:]}"
