"""A real redis-server for tests, started on a free loopback port and stopped afterwards.

`redis_server` is a session fixture; `redis_server_factory` gives tests their own server to kill, pause
(SIGSTOP) or restart. Without a redis-server binary the tests skip, unless `CI` is set: then they fail,
so CI can never pass by silently not testing Redis.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from bench.ports import free_port


def redis_binary() -> str:
    """The redis-server path, or skip (fail under CI) with the reason."""
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must run the Redis tests", pytrace=False)
        pytest.skip(reason)
    return binary


class RedisServer:
    """One redis-server process: no persistence, loopback only, its own port."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, attempts: int = 3) -> None:
        for _ in range(attempts):
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "yes",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.stop()
            self.port = free_port()  # lost the port to someone else: try another
        raise RuntimeError("redis-server did not start")

    def _wait_ready(self, timeout_s: float = 10.0) -> bool:
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """Terminate (resuming it first if it was paused) and reap."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def sync_client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(redis_binary())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[[], RedisServer]]:
    started: list[RedisServer] = []

    def start() -> RedisServer:
        server = RedisServer(redis_binary())
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
