"""The vLLM protocol conformance suite (tests/conformance), run against a real vLLM server.

The suite is written for hetgate's simulator and takes any live target from
``HETGATE_CONFORMANCE_TARGET`` (see tests/conformance/conftest.py). Running it in a child pytest keeps
its fixtures and ours apart; a failure here shows the child's report, i.e. where the simulator and
real vLLM disagree (a fix for the simulator, or for the suite's expectations).

The run must count: every collected check passes except the P/D checks, which are skipped here
and only here, by name and reason (they need a NIXL prefiller and decoder; test_pd_nixl.py runs them
against real NixlConnector servers). A check that starts skipping, or a suite that collects nothing,
fails this test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import BLOCK_SIZE, SuiteOutcome, run_conformance_suite
from vllm_server import SERVED_MODEL_NAME, VllmServer

pytestmark = pytest.mark.e2e

NO_PREFILLER = "no prefill-role server in this target"
# The only checks allowed to skip against one aggregated server, with the reason each must give.
EXPECTED_SKIPS = {
    "test_conformance_pd.py::test_prefill_response_carries_nixl_pull_params": NO_PREFILLER,
    "test_conformance_pd.py::test_chat_prefill_also_returns_params": NO_PREFILLER,
    "test_conformance_pd.py::test_decode_with_the_prefillers_params": NO_PREFILLER,
}
# The suite held 37 checks when this was written; fewer means checks were lost, not that they pass.
MIN_CHECKS = 37


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
    outcome = run_conformance_suite(target_for(aggregated_servers[0]), report)
    assert_counted(outcome, report)


def assert_counted(outcome: SuiteOutcome, report: Path) -> None:
    detail = f"{outcome.summary()} ({report}):\n{outcome.output[-6000:]}"
    assert not outcome.failed, f"suite failed on real vLLM: {outcome.failed}; {detail}"
    assert outcome.returncode == 0, detail
    assert outcome.skipped == EXPECTED_SKIPS, f"unexpected skips; {detail}"
    assert len(outcome.passed) + len(outcome.skipped) >= MIN_CHECKS, detail
    print(f"conformance against real vLLM: {outcome.summary()}")
