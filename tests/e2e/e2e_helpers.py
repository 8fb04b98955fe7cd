"""Small helpers shared by the end-to-end tests: prompts, vLLM metrics, hetgate's route header."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import httpx
from prometheus_client.parser import text_string_to_metric_families
from vllm_server import REPO_ROOT, VllmServer

ROUTE_HEADER = "x-hetgate-route"
BLOCK_SIZE = 128  # vLLM's CPU default; prefixes shorter than this never hit the cache


def code_prompt(lines: int, tag: str | None = None) -> str:
    """Python-like text (what the tiny tokenizer was trained on), unique per call unless tagged.

    About 34 tokens a line on the tiny model's tokenizer: 9 lines fill two 128-token blocks.
    """
    tag = tag or uuid.uuid4().hex[:12]
    return "".join(
        f"def handler_{tag}_{i}(request, value={i}):\n    return request.process(value + {i})\n"
        for i in range(lines)
    )


def metric_total(base_url: str, name: str, **labels: str) -> float:
    """Sum of one vLLM metric's samples whose labels include ``labels`` (counters: pass ``*_total``)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def prompt_token_count(base_url: str, prompt: str) -> int:
    response = httpx.post(f"{base_url}/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30)
    response.raise_for_status()
    return response.json()["count"]


def route_fields(header: str) -> dict[str, str]:
    """``mode=aggregated; backend=agg-a`` -> {"mode": "aggregated", "backend": "agg-a"}."""
    fields = {}
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        fields[key] = value
    return fields


def reset_prefix_cache(base_url: str) -> None:
    """Empty vLLM's prefix cache (needs VLLM_SERVER_DEV_MODE=1, which the launcher sets)."""
    response = httpx.post(f"{base_url}/reset_prefix_cache", timeout=30)
    response.raise_for_status()


def backend_entry(server: VllmServer, **overrides: Any) -> dict[str, Any]:
    """One `backends:` item of hetgate's configuration for a running vLLM server."""
    entry: dict[str, Any] = {
        "id": server.spec.name,
        "url": server.base_url,
        "model": "tiny",
        "accelerator": "cpu",
        "block_size": BLOCK_SIZE,
        "max_num_seqs": 16,
    }
    entry.update(overrides)
    return entry


def gateway_config(
    backends: list[dict[str, Any]], tokenizer: Path | None = None, **routing: Any
) -> dict[str, Any]:
    return {
        "models": [{"name": "tiny", "tokenizer": str(tokenizer) if tokenizer else None}],
        "backends": backends,
        "routing": {"policy": "round_robin", "disaggregation": "never", **routing},
        # Every timer here is wall time, and on a shared 2-core CI host the gateway can go unscheduled
        # for tens of seconds (docs/e2e.md, "A starved gateway"): a CI run failed the NIXL decode leg as
        # `connect (ConnectionTimeoutError)` at 2 s, and again at 10 s, its probes down with it, while
        # the decoder itself answered. No test here needs a probe to notice a death quickly (the
        # failover test turns probing off), so probes and connects wait as long as a first byte may.
        "health": {"interval_s": 1.0, "timeout_s": 60.0, "failure_threshold": 2},
        "timeouts": {"connect_s": 60.0, "ttfb_s": 120.0, "idle_s": 60.0},
        "server": {"header_timeout_s": 60.0, "body_timeout_s": 120.0},
    }


@dataclass(frozen=True)
class SuiteOutcome:
    """What a child pytest run of the conformance suite did, read from its JUnit XML report."""

    returncode: int
    output: str  # the child's stdout and stderr, also written to the report file
    passed: tuple[str, ...]  # test ids, e.g. "test_conformance_pd.py::test_chat_prefill_also_returns_params"
    skipped: dict[str, str]  # test id -> skip reason
    failed: tuple[str, ...]  # failures and errors

    def summary(self) -> str:
        return f"{len(self.passed)} passed, {len(self.skipped)} skipped, {len(self.failed)} failed"


def run_conformance_suite(target: dict[str, Any], report: Path, *paths: str) -> SuiteOutcome:
    """tests/conformance (or some of its files) in a child pytest aimed at ``target``.

    The child keeps the suite's fixtures apart from ours; ``HETGATE_CONFORMANCE_TARGET`` is the
    suite's documented way to point it at a live server. Its whole report is written to ``report``,
    its JUnit XML beside it (``.xml``), from which the passed, skipped and failed checks are read.
    """
    suite = [str(REPO_ROOT / "tests" / "conformance" / path) for path in paths or ("",)]
    junit = report.with_suffix(".xml")
    junit.unlink(missing_ok=True)
    env = {**os.environ, "HETGATE_CONFORMANCE_TARGET": json.dumps(target)}
    options = ["-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *suite, *options],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    report.write_text(output)
    if not junit.exists():
        return SuiteOutcome(result.returncode, output, (), {}, ("(no JUnit report written)",))
    return _outcome_from_junit(result.returncode, output, junit)


def _outcome_from_junit(returncode: int, output: str, junit: Path) -> SuiteOutcome:
    passed: list[str] = []
    skipped: dict[str, str] = {}
    failed: list[str] = []
    for case in ElementTree.parse(junit).iter("testcase"):
        # classname "tests.conformance.test_conformance_pd", name "test_x" -> "test_conformance_pd.py::test_x"
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        skip = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(test_id)
        elif skip is not None:
            skipped[test_id] = skip.get("message", "")
        else:
            passed.append(test_id)
    return SuiteOutcome(returncode, output, tuple(passed), skipped, tuple(failed))
