"""The dashboard and the alert rules work on real data: a real Prometheus scrapes a real gateway (in front
of simulated vLLM backends, under a mixed load with P/D, streams and a prefix index), and every dashboard
query and every rule expression returns a series through Prometheus's HTTP API. `promtool check rules`
must pass too."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.harness import GatewayProcess
from bench.ports import free_port
from bench.sim.server import SimServerConfig, SimThread, start_in_thread
from bench.sim.simple_engine import SimpleEngineConfig

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "hetgate.json"
RULES = REPO / "deploy" / "prometheus" / "hetgate-rules.yaml"
MODEL = "sim-model"
FAST = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.002)
# A comparison with a number at the end of an alert: what remains is the value the alert watches.
_THRESHOLD = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*[0-9.]+\s*$")


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (panel["title"], target["expr"])
        for panel in panels
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_rules(promtool: str) -> None:
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules())} rules found" in done.stdout


def test_dashboard_covers_traffic_routing_backends_and_index() -> None:
    rows = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Routing", "Backends by accelerator", "Prefix index"]


@pytest.fixture
def cluster() -> Iterator[GatewayProcess]:
    """A prefill and a decode backend (simulated) behind a gateway that splits, keeps a prefix index and
    prices its plans (`cost`, so the predicted-TTFT panels have data)."""
    sims: list[SimThread] = []
    for role in ("both", "decode"):
        sims.append(
            start_in_thread(
                SimServerConfig(model=MODEL),
                role=role,
                simple_engine=FAST,
                enable_prompt_tokens_details=True,
            )
        )
    backends = [
        {"id": "p0", "url": sims[0].url, "model": MODEL, "accelerator": "mi300x", "gpus": 8,
         "roles": ["prefill"], "kv_connector": "nixl"},
        {"id": "d0", "url": sims[1].url, "model": MODEL, "accelerator": "mi308x", "gpus": 8,
         "roles": ["decode"], "kv_connector": "nixl"},
    ]  # fmt: skip
    config = {
        "models": [{"name": MODEL, "spec": "deepseek-r1"}],
        "backends": backends,
        "routing": {"policy": "cost", "disaggregation": "always"},
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
    }
    gateway = GatewayProcess(config).start()
    try:
        yield gateway
    finally:
        gateway.stop()
        for sim in sims:
            sim.stop()


@pytest.fixture
def prometheus_api(prometheus: str, cluster: GatewayProcess, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    target = cluster.url.removeprefix("http://")
    # The shipped rules, evaluated every second instead of every 30 s (so the test waits seconds).
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(RULES.read_text().replace("interval: 30s", "interval: 1s"))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules_file)],
        "scrape_configs": [{"job_name": "hetgate", "static_configs": [{"targets": [target]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        _wait_for(lambda: httpx.get(f"{api}/status/runtimeinfo", timeout=1).status_code == 200, 30)
        yield api
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _wait_for(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError("timed out")


def _send_mixed_load(url: str, rounds: int) -> None:
    system = "You are a careful assistant who answers briefly. " * 30  # shared prefix, long enough to split
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(rounds):
            long = {"role": "user", "content": system + f"question {i}"}
            short = {"role": "user", "content": f"hi {i}"}
            for messages, stream in (([long], True), ([short], True), ([long], False), ([short], False)):
                body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream}
                reply = client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text


def _series(api: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{api}/query", params={"query": expr}, timeout=5).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def test_every_dashboard_query_and_rule_returns_data(cluster: GatewayProcess, prometheus_api: str) -> None:
    api = prometheus_api
    # Load spread over several scrapes, so rate() windows have two samples or more.
    for _ in range(6):
        _send_mixed_load(cluster.url, rounds=3)
        time.sleep(1)
    queries = [(title, expr.replace("[$__rate_interval]", "[1m]").replace("$model", ".*"))
               for title, expr in dashboard_queries()]  # fmt: skip
    recorded = [(r["record"], r["record"]) for r in rules() if "record" in r]
    alerts = [(r["alert"], _THRESHOLD.sub("", r["expr"].strip())) for r in rules() if "alert" in r]
    empty: list[str] = []
    deadline = time.monotonic() + 60  # recording rules are evaluated on their group's interval
    for name, expr in [*queries, *recorded, *alerts]:
        while not _series(api, expr):
            if time.monotonic() > deadline:
                empty.append(f"{name}: {expr}")
                break
            _send_mixed_load(cluster.url, rounds=1)
            time.sleep(1)
    assert not empty, "queries without data:\n" + "\n".join(empty)
    # The load really exercised what the panels show (a panel's `or vector(0)` alone would not do).
    values = dict(queries)
    for title in ("P/D share of served requests", "Index hit rate (longest cached prefix / prompt tokens)"):
        assert float(_series(api, values[title])[0]["value"][1]) > 0, title
    health = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
    broken = [r["name"] for g in health for r in g["rules"] if r["health"] != "ok"]
    assert not broken
