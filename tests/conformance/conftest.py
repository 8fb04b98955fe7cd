"""The target of the vLLM protocol conformance suite: the simulator by default, or any live server.

The suite (tests/conformance/test_*.py) only talks HTTP and ZMQ to a `ConformanceTarget`, so the same
checks run against hetgate's simulated backend and against a real vLLM:

* By default the session starts simulated backends in-process: one aggregated server (role both,
  `--enable-prompt-tokens-details`, KV events connecting to an endpoint the test binds, replay on),
  used as the prefiller too, and one decode-role server.
* `HETGATE_CONFORMANCE_TARGET='{"base_url": "http://127.0.0.1:8100", "model": "tiny", ...}'` (JSON with
  the fields of `ConformanceTarget`) points the suite at a running server instead; absent optional
  parts (`prefill_url`, `decode_url`, `kv_events_endpoint`, `kv_replay_endpoint`) skip their tests.
  A live vLLM needs `--enable-prefix-caching --enable-prompt-tokens-details --enable-server-load-tracking`
  (as bench/vllm_server.py starts it): without the last, its /load stays 0.
* Or override the `conformance_target` fixture in a closer conftest.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.ports import free_port
from bench.sim.kv_events import KVEventsConfig
from bench.sim.server import SimServerConfig, start_in_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite's helper module

from conformance_helpers import ConformanceTarget

TARGET_ENV = "HETGATE_CONFORMANCE_TARGET"


def _target_from_env() -> ConformanceTarget | None:
    raw = os.environ.get(TARGET_ENV)
    return ConformanceTarget(**json.loads(raw)) if raw else None


@pytest.fixture(scope="session")
def conformance_target() -> Iterator[ConformanceTarget]:
    external = _target_from_env()
    if external is not None:
        yield external
        return
    events_endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    kv_events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=events_endpoint,
        replay_endpoint=replay_endpoint,
        topic="kv-events",
    )
    main = SimServerConfig(
        model="sim-conformance", max_model_len=2048, enable_prompt_tokens_details=True, kv_events=kv_events
    )
    decode = SimServerConfig(model="sim-conformance", max_model_len=2048, role="decode")
    with start_in_thread(main) as sim, start_in_thread(decode) as decoder:
        yield ConformanceTarget(
            base_url=sim.url,
            model="sim-conformance",
            prefill_url=sim.url,
            decode_url=decoder.url,
            kv_events_endpoint=events_endpoint,
            kv_events_topic="kv-events",
            kv_replay_endpoint=replay_endpoint,
            simulator=True,
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Against the built-in simulator, which has every optional part, a skipped check is a failure: the
    suite could otherwise pass with its P/D or KV-event checks silently gone. (A live target's run is
    counted by whoever started it: tests/e2e/test_agg_conformance.py names the skips it allows.)"""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and _target_from_env() is None:
        report.outcome = "failed"
        report.longrepr = f"skipped against the built-in simulator: {report.longrepr}"


@pytest.fixture
def client(conformance_target: ConformanceTarget) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=conformance_target.base_url, timeout=60) as http:
        yield http
