"""Starting a simulated vLLM backend: in the caller's loop, in a thread, or as a process.

    async with SimServer(SimServerConfig(model="m")) as sim: ...sim.url...      # in the test's loop
    with start_in_thread(SimServerConfig(model="m")) as sim: ...sim.url...      # own thread and loop
    with SimProcess(["--model", "m"]) as sim: ...sim.url...                     # own process

The server itself is bench/sim/http_server.py, its settings bench/sim/server_config.py; their public
names are importable from here too, where callers have always found them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from bench.sim.faults import FaultPlan
from bench.sim.http_server import SimServer
from bench.sim.server_config import ROLES, SimServerConfig, build_engine

__all__ = [
    "READY_PREFIX",
    "ROLES",
    "SimProcess",
    "SimServer",
    "SimServerConfig",
    "SimThread",
    "build_engine",
    "serve_forever",
    "start_in_thread",
]

READY_PREFIX = "SIM_READY "


class SimThread:
    """A SimServer running on its own event loop in a daemon thread (for sync tests and tools)."""

    def __init__(self, config: SimServerConfig | None = None) -> None:
        self.server = SimServer(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-server", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> SimThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            raise
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's loop (engine and fault state are not thread-safe)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def set_faults(self, plan: FaultPlan | dict[str, Any]) -> None:
        self.call(lambda: self.server.set_faults(plan))

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SimThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_in_thread(config: SimServerConfig | None = None, **fields: Any) -> SimThread:
    """Start a simulated backend in a thread; `fields` are SimServerConfig fields. Stop it with .stop()
    or use it as a context manager."""
    if fields:
        config = SimServerConfig(**fields) if config is None else _replace(config, fields)
    return SimThread(config).start()


def _replace(config: SimServerConfig, fields: dict[str, Any]) -> SimServerConfig:
    return SimServerConfig(**{**{name: getattr(config, name) for name in config.__slots__}, **fields})


class SimProcess:
    """`python -m bench.sim.cli ARGS --port 0` as a child process; `.url` once it is serving."""

    def __init__(self, args: list[str], startup_timeout_s: float = 30.0) -> None:
        self.args = list(args)
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> SimProcess:
        args = self.args if "--port" in self.args else [*self.args, "--port", "0"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.sim.cli", *args],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.url = _read_ready_line(self.process, self.startup_timeout_s)
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _read_ready_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    stdout = process.stdout
    assert stdout is not None
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.extend(_ready_urls(stdout)), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not result:
        process.kill()
        process.wait()
        raise RuntimeError(
            f"simulated backend did not start within {timeout_s} s (exit code {process.returncode})"
        )
    return result[0]


def _ready_urls(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith(READY_PREFIX):
            yield line[len(READY_PREFIX) :].split()[0]
            return


async def serve_forever(config: SimServerConfig, ready: Callable[[SimServer], None] | None = None) -> None:
    """Run until cancelled (the CLI's loop)."""
    async with SimServer(config) as server:
        if ready is not None:
            ready(server)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
