"""bench/locustfile.py drives a real gateway without a single failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import backend, config, metric

LOCUSTFILE = Path(__file__).resolve().parents[2] / "bench" / "locustfile.py"


def test_locust_load_through_the_gateway(sim, gateway):
    a, b = sim(), sim()
    gw = gateway(config([backend(a, "a"), backend(b, "b")], routing={"policy": "least_load"}))
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", gw.url, "--headless",
         "-u", "4", "-r", "4", "-t", "4s", "--only-summary", "--exit-code-on-error", "1"],
        capture_output=True, text=True, timeout=60, env={"HETGATE_MAX_TOKENS": "4", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert metric(gw.url, "hetgate:requests_total", status="200") >= 10
    assert metric(gw.url, "hetgate:requests_total") == metric(gw.url, "hetgate:requests_total", status="200")
