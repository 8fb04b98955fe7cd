"""How the vLLM launcher's start wait ends, with real child processes standing in for vLLM's start-up."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.ports import free_port
from bench.vllm_server import START_MARK, ServerStartError, VllmServer, nixl_spec, wait_for_health


def _child(log_path: Path, script: str) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        log.write(f"{START_MARK}00:00:00: stand-in\n".encode())
        log.flush()
        return subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)


def test_a_bind_failure_in_a_live_process_ends_the_wait_at_once(tmp_path):
    log_path = tmp_path / "server.log"
    # A NIXL decoder whose side-channel thread cannot bind logs this and then waits forever.
    process = _child(
        log_path,
        "print('zmq.error.ZMQError: Address already in use', flush=True)\nimport time; time.sleep(60)",
    )
    started = time.monotonic()
    try:
        with pytest.raises(ServerStartError, match="could not bind a port"):
            wait_for_health(process, f"http://127.0.0.1:{free_port()}/health", log_path, "decoder", 30.0)
        assert time.monotonic() - started < 10.0  # not the 30 s timeout
    finally:
        process.kill()
        process.wait()


def test_a_bind_failure_of_an_earlier_start_does_not_fail_the_next(tmp_path):
    log_path = tmp_path / "server.log"
    first = _child(log_path, "print('OSError: [Errno 98] Address already in use', flush=True)")
    first.wait()
    second = _child(log_path, "import time; time.sleep(60)")  # alive, never healthy
    try:
        with pytest.raises(ServerStartError, match="not healthy after 3 s"):
            wait_for_health(second, f"http://127.0.0.1:{free_port()}/health", log_path, "decoder", 3.0)
    finally:
        second.kill()
        second.wait()


def test_each_start_of_a_nixl_server_takes_a_new_side_channel_port(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # exits at once: no vllm module here
    server = VllmServer(nixl_spec("decoder", "kv_consumer", "0"), tmp_path, tmp_path / "logs", venv=venv)
    ports = []
    for _ in range(2):
        server.start()
        ports.append(server.side_channel_port)
        assert server.environment()["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(server.side_channel_port)
        server.stop()
    assert ports[0] != ports[1] and 0 not in ports
