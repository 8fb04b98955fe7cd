"""`hetgate demo` end to end: three cost-model simulators, the gateway, a short load, a summary."""

from __future__ import annotations

import subprocess
import sys


def test_demo_serves_a_short_load_without_failures():
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--requests", "8", "--concurrency", "4", "--port", "0",
         "--time-scale", "20"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "8/8 requests ok" in run.stdout
    assert "pd:" in run.stdout  # long prompts were split prefill -> decode
