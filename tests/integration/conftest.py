"""Real servers on loopback: simulated vLLM backends (in threads) behind a real `hetgate serve` process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from bench.harness import GatewayProcess
from bench.sim.server import SimServerConfig, SimThread, start_in_thread
from bench.sim.simple_engine import SimpleEngineConfig

MODEL = "sim-model"
FAST = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.002)

SimFactory = Callable[..., SimThread]
GatewayFactory = Callable[..., GatewayProcess]


@pytest.fixture
def sim() -> Iterator[SimFactory]:
    """Start simulated backends: `sim(role="prefill", ...)`; all are stopped after the test."""
    started: list[SimThread] = []

    def start(**fields: Any) -> SimThread:
        fields.setdefault("simple_engine", FAST)
        fields.setdefault("enable_prompt_tokens_details", True)
        server = start_in_thread(SimServerConfig(model=MODEL), **fields)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def backend(
    server: SimThread, id_: str, roles: tuple[str, ...] = ("prefill", "decode"), **extra: Any
) -> dict:
    return {
        "id": id_,
        "url": server.url,
        "model": MODEL,
        "accelerator": "h100-sxm",
        "roles": list(roles),
        **extra,
    }


def config(backends: list[dict], **sections: Any) -> dict:
    base: dict[str, Any] = {
        "models": [{"name": MODEL}],
        "backends": backends,
        "routing": {"policy": "round_robin", "disaggregation": "never"},
        "timeouts": {"connect_s": 1.0, "ttfb_s": 5.0, "idle_s": 5.0},
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


@pytest.fixture
def gateway() -> Iterator[GatewayFactory]:
    started: list[GatewayProcess] = []

    def start(cfg: dict, **kwargs: Any) -> GatewayProcess:
        process = GatewayProcess(cfg, **kwargs).start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series (all label sets matching `labels`) scraped from base_url/metrics."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        series_name = series.split("{", 1)[0]
        if series_name != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def chat_body(content: str = "Hello there, how are you today?", **fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def route_parts(header: str) -> tuple[str, dict[str, float]]:
    """An `x-hetgate-route` value split into how the request was served and what its plan predicted
    (`predicted_ttft_ms`, `predicted_tpot_ms`, present when a pricing policy priced those backends)."""
    served, predicted = [], {}
    for part in header.split("; "):
        key, _, value = part.partition("=")
        if key.startswith("predicted_"):
            predicted[key] = float(value)
        else:
            served.append(part)
    return "; ".join(served), predicted
