"""Fixtures for the end-to-end tests: real vLLM on CPU (tiny random model) behind a real hetgate.

Prerequisite (CI runs it first, via scripts/test.sh): ``scripts/setup_vllm_env.sh`` builds the vLLM
venv and the tiny model. Missing pieces make the fixtures fail (never skip) with that command.

vLLM servers live in one session-wide ``VllmFleet`` (at most two processes, ~3 GB each); tests ask
for the set they need and get running servers, restarted if a previous test killed one. Test files
are named so that those sharing servers run next to each other (aggregated pair first, P/D last).
Logs: ``$HETGATE_E2E_LOGS`` if set, else a pytest temporary folder (named in every failure).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_tiny_model import default_model_dir, is_complete
from vllm_server import (
    SETUP_HINT,
    KvEvents,
    KvTransfer,
    ServerSpec,
    VllmFleet,
    VllmServer,
    default_venv,
    free_port,
)

from bench.harness import GatewayProcess

# Real P/D over NixlConnector runs by default (scripts/test.sh installs NIXL). HETGATE_E2E_NIXL=0 leaves
# it out explicitly (not collected, so it cannot pass by skipping); without NIXL it fails, naming the fix.
collect_ignore = ["test_pd_nixl.py"] if os.environ.get("HETGATE_E2E_NIXL") == "0" else []


def _cpu_for(index: int) -> str:
    """Pin each server's worker to its own core when there are enough (VLLM_CPU_OMP_THREADS_BIND)."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[index % len(cores)])


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    venv = default_venv()
    stamp = venv / ".hetgate-ready"
    if not (venv / "bin" / "python").exists() or not stamp.exists():
        pytest.fail(f"no ready vLLM venv at {venv}; set it up with: bash {SETUP_HINT}", pytrace=False)
    return venv


@pytest.fixture(scope="session")
def tiny_model(vllm_venv: Path) -> Path:
    model_dir = default_model_dir()
    if not is_complete(model_dir):
        builder = Path(__file__).with_name("build_tiny_model.py")
        result = subprocess.run(
            [str(vllm_venv / "bin" / "python"), str(builder), "--out", str(model_dir)],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        if result.returncode != 0 or not is_complete(model_dir):
            pytest.fail(
                f"could not build the tiny model in {model_dir} (run: bash {SETUP_HINT}):\n"
                f"{result.stderr[-3000:]}",
                pytrace=False,
            )
    return model_dir


@pytest.fixture(scope="session")
def e2e_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("HETGATE_E2E_LOGS")
    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        return Path(configured)
    return tmp_path_factory.mktemp("e2e-logs")


_FLEETS: list[VllmFleet] = []  # the session's fleet, for the hook below


@pytest.fixture(scope="session")
def vllm_fleet(tiny_model: Path, vllm_venv: Path, e2e_logs: Path) -> Iterator[VllmFleet]:
    fleet = VllmFleet(model_dir=tiny_model, log_dir=e2e_logs, venv=vllm_venv, max_running=2)
    _FLEETS.append(fleet)
    try:
        yield fleet
    finally:
        fleet.stop_all()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last end-to-end test, stop the vLLM servers at once rather than at the end of the
    session: their engines busy-poll the CPU and would slow every test that follows."""
    here = Path(__file__).resolve().parent
    if nextitem is None or here not in Path(str(nextitem.path)).resolve().parents:
        for fleet in _FLEETS:
            fleet.stop_all()


@pytest.fixture(scope="session")
def aggregated_specs() -> tuple[ServerSpec, ServerSpec]:
    """Two plain servers publishing KV events to endpoints a consumer (hetgate, a test) may bind."""
    return tuple(
        ServerSpec(
            name=name,
            kv_events=KvEvents(
                endpoint=f"tcp://127.0.0.1:{free_port()}",
                replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
            ),
            omp_threads_bind=_cpu_for(index),
        )
        for index, name in enumerate(("agg-a", "agg-b"))
    )


@pytest.fixture
def aggregated_servers(
    vllm_fleet: VllmFleet, aggregated_specs: tuple[ServerSpec, ServerSpec]
) -> list[VllmServer]:
    return vllm_fleet.acquire(aggregated_specs)


@pytest.fixture(scope="session")
def pd_specs(e2e_logs: Path) -> tuple[ServerSpec, ServerSpec]:
    """A prefill producer and a decode consumer sharing one ExampleConnector folder."""
    shared = e2e_logs / "kv-shared"
    shared.mkdir(exist_ok=True)
    return (
        ServerSpec("pd-prefill", kv_transfer=KvTransfer("kv_producer", shared), omp_threads_bind=_cpu_for(0)),
        ServerSpec("pd-decode", kv_transfer=KvTransfer("kv_consumer", shared), omp_threads_bind=_cpu_for(1)),
    )


@pytest.fixture
def pd_servers(vllm_fleet: VllmFleet, pd_specs: tuple[ServerSpec, ServerSpec]) -> list[VllmServer]:
    return vllm_fleet.acquire(pd_specs)


GatewayFactory = Callable[[dict[str, Any], str], GatewayProcess]


@pytest.fixture
def start_gateway(e2e_logs: Path) -> Iterator[GatewayFactory]:
    """Start `hetgate serve` on a config dict; every gateway started here stops after the test."""
    started: list[GatewayProcess] = []

    def start(config: dict[str, Any], name: str) -> GatewayProcess:
        gateway = GatewayProcess(config, work_dir=e2e_logs / f"hetgate-{name}")
        started.append(gateway)
        return gateway.start()

    try:
        yield start
    finally:
        for gateway in started:
            gateway.stop()
