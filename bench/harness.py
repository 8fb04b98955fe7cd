"""Run a real gateway process on loopback, for benchmarks, the demo and integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.ports import free_port


class GatewayProcess:
    """`hetgate serve` as a child process on a free port; `.url` once `/health` answers."""

    def __init__(
        self,
        config: dict[str, Any],
        workers: int = 1,
        startup_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
        work_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.workers = workers
        self.startup_timeout_s = startup_timeout_s
        self.env = env or {}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        # The config and log live in `work_dir` when given (kept after stop, e.g. test logs), else in a
        # temporary folder removed on stop.
        self._dir = None if work_dir else tempfile.TemporaryDirectory(prefix="hetgate-")
        folder = work_dir or Path(self._dir.name if self._dir else "")
        folder.mkdir(parents=True, exist_ok=True)
        self.config_path = folder / "gateway.yaml"
        self.log_path = folder / "gateway.log"

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> GatewayProcess:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config_path)]
        command += ["--port", str(self.port), "--workers", str(self.workers)]
        with self.log_path.open("wb") as log:
            # A session of its own: stop() ends the workers too, even if the supervisor is gone.
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gateway did not answer /health within {self.startup_timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def cpu_seconds(self) -> float:
        """User + system CPU of the gateway and its worker processes (from /proc)."""
        return sum(_cpu_seconds(pid) for pid in [self.pid, *_children(self.pid)])

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group is left
        self.process.wait()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
