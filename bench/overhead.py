"""`hetgate bench overhead`: what the gateway adds to each request, against the backend hit directly.

One run starts simulated backends (zero simulated compute, so only the HTTP path is measured), a gateway in
aggregated mode and one in P/D mode, and drives every target with the same closed-loop load, interleaved
round by round so drift on a shared machine hits all targets alike. Reported per cell: latency p50/p99,
what the gateway added over the direct baseline of the same round shape, requests/s, and the gateway's
own CPU time per request (from /proc: the robust figure on a 2-core machine). `--target NAME=URL[@PID]`
adds any OpenAI-compatible router to the same table (its CPU is read when its PID is given). The
`floor` target is the least the named stack (uvicorn + aiohttp, `bench/floor_proxy.py`) can do: a
pass-through with no routing, checks or metrics, so what hetgate adds beyond it is hetgate's own. The
`envoy+epp` target is the other deployment shape: a real Envoy carries the bytes and `hetgate epp` picks
over ext_proc (deploy/envoy/envoy.yaml); its CPU is Envoy's plus the EPP's, each also listed on its own.
`envoy+floor-epp` is the same Envoy with `bench/epp_floor.py`, an ext_proc server that answers the same
messages with one fixed endpoint and does nothing else: the EPP's floor, what gRPC in Python costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from rich.console import Console
from rich.table import Table

from bench.harness import GatewayProcess, _children, _cpu_seconds
from bench.ports import free_port
from bench.sim.server import SimProcess

MODEL = "bench-model"
ZERO_TIMING = ["--ttft-base-s", "0", "--prefill-token-s", "0", "--tpot-s", "0", "--max-num-seqs", "1024"]


@dataclass(slots=True)
class Target:
    name: str
    url: str
    mode: str
    cpu: Callable[[], float] | None = None
    cpu_parts: dict[str, Callable[[], float]] = field(default_factory=dict)  # shown beside the total


@dataclass(slots=True)
class Cell:
    target: str
    mode: str
    stream: bool
    concurrency: int
    latencies_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    cpu_s: float = 0.0
    requests: int = 0
    errors: int = 0
    cpu_parts_s: dict[str, float] = field(default_factory=dict)


def request_body(stream: bool, max_tokens: int) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words please."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return json.dumps(body).encode()


async def drive(session: aiohttp.ClientSession, url: str, body: bytes, total: int, concurrency: int) -> Cell:
    cell = Cell("", "", False, concurrency)
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            cell.latencies_ms.append((time.perf_counter() - started) * 1000)
            cell.errors += not ok

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cell.elapsed_s = time.perf_counter() - started
    cell.requests = total
    return cell


async def run_cells(targets: list[Target], args: argparse.Namespace) -> list[Cell]:
    results: dict[tuple[str, str, bool, int], Cell] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for concurrency in args.concurrency:
            for stream in (False, True):
                body = request_body(stream, args.max_tokens)
                for _ in range(args.repeats):
                    for target in targets:  # interleaved: every target once per round
                        await _measure(session, target, body, stream, concurrency, args, results)
    return list(results.values())


async def _measure(
    session: aiohttp.ClientSession,
    target: Target,
    body: bytes,
    stream: bool,
    concurrency: int,
    args: argparse.Namespace,
    results: dict[tuple[str, str, bool, int], Cell],
) -> None:
    url = f"{target.url}/v1/chat/completions"
    await drive(session, url, body, min(concurrency * 2, 64), concurrency)  # warm connections
    cpu_before = target.cpu() if target.cpu else 0.0
    parts_before = {name: read() for name, read in target.cpu_parts.items()}
    cell = await drive(session, url, body, args.requests, concurrency)
    key = (target.name, target.mode, stream, concurrency)
    into = results.setdefault(key, Cell(target.name, target.mode, stream, concurrency))
    into.latencies_ms += cell.latencies_ms
    into.elapsed_s += cell.elapsed_s
    into.requests += cell.requests
    into.errors += cell.errors
    into.cpu_s += (target.cpu() - cpu_before) if target.cpu else 0.0
    for name, read in target.cpu_parts.items():
        into.cpu_parts_s[name] = into.cpu_parts_s.get(name, 0.0) + read() - parts_before[name]


def summarise(cells: list[Cell], has_cpu: set[str]) -> list[dict]:
    direct = {
        (c.stream, c.concurrency): np.percentile(c.latencies_ms, [50, 99])
        for c in cells
        if c.target == "direct"
    }
    rows = []
    for c in cells:
        p50, p99 = np.percentile(c.latencies_ms, [50, 99])
        base = direct[(c.stream, c.concurrency)]
        rows.append(
            {
                "target": c.target,
                "mode": c.mode,
                "stream": c.stream,
                "concurrency": c.concurrency,
                "p50_ms": round(float(p50), 3),
                "p99_ms": round(float(p99), 3),
                "added_p50_ms": round(float(p50 - base[0]), 3),
                "added_p99_ms": round(float(p99 - base[1]), 3),
                "cpu_us_per_request": round(c.cpu_s / c.requests * 1e6, 1) if c.target in has_cpu else None,
                "requests_per_s": round(c.requests / c.elapsed_s, 1),
                "errors": c.errors,
                "cpu_parts_us": {k: round(v / c.requests * 1e6, 1) for k, v in c.cpu_parts_s.items()},
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    table = Table(title="hetgate bench overhead (ms; CPU in us per request)")
    for name in (
        "target",
        "mode",
        "stream",
        "conc",
        "p50",
        "p99",
        "+p50",
        "+p99",
        "cpu us/req",
        "req/s",
        "err",
    ):
        table.add_column(name, justify="right")
    for r in rows:
        cpu = "-" if r["cpu_us_per_request"] is None else f"{r['cpu_us_per_request']:.0f}"
        table.add_row(
            r["target"], r["mode"], str(r["stream"]), str(r["concurrency"]), f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}", f"{r['added_p50_ms']:+.2f}", f"{r['added_p99_ms']:+.2f}", cpu,
            f"{r['requests_per_s']:.0f}", str(r["errors"]),
        )  # fmt: skip
    console = Console()
    console.print(table)
    for r in rows:
        if r["cpu_parts_us"]:
            parts = ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_parts_us"].items())
            console.print(f"{r['target']} stream={r['stream']} c={r['concurrency']}: cpu us/req {parts}")


def gateway_config(backends: list[dict], disaggregation: str) -> dict:
    return {
        "models": [{"name": MODEL}],
        "backends": backends,
        "routing": {"policy": "round_robin", "disaggregation": disaggregation},
        "health": {"interval_s": 5, "metrics_interval_s": 5},
    }


def _backend(id_: str, url: str, roles: list[str]) -> dict:
    return {
        "id": id_,
        "url": url,
        "model": MODEL,
        "accelerator": "h100-sxm",
        "roles": roles,
        "kv_connector": "nixl",
    }


class _FloorProcess:
    def __init__(self, upstream: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "bench.floor_proxy", upstream, str(self.port)]
        self.process = subprocess.Popen(command, start_new_session=True)

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.process.pid)


@contextlib.contextmanager
def _floor_proxy(upstream: str) -> Iterator[_FloorProcess]:
    floor = _FloorProcess(upstream)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", floor.port), timeout=0.2),
            ):
                break
            time.sleep(0.1)
        yield floor
    finally:
        floor.process.terminate()
        floor.process.wait(timeout=10)


def _envoy_epp(stack: contextlib.ExitStack, backend_url: str) -> list[Target]:
    """Envoy + `hetgate epp` in front of the same backend; no row when Envoy or the `epp` extra is missing."""
    from bench.epp_harness import EnvoyProcess, EppProcess, envoy_binary

    if envoy_binary() is None:
        print("envoy+epp: no envoy binary (scripts/test.sh installs it); row left out", file=sys.stderr)
        return []
    config = gateway_config([_backend("sim-0", backend_url, ["prefill", "decode"])], "never")
    endpoint = backend_url.removeprefix("http://")
    targets = []
    for name, epp in (
        ("envoy+epp", EppProcess(config)),
        ("envoy+floor-epp", EppProcess(config, ["--endpoint", endpoint], module="bench.epp_floor")),
    ):
        stack.enter_context(epp)
        envoy = stack.enter_context(EnvoyProcess(epp.grpc_port, [backend_url]))
        parts = {"envoy": envoy.cpu_seconds, "epp": epp.cpu_seconds}
        total = lambda envoy=envoy, epp=epp: envoy.cpu_seconds() + epp.cpu_seconds()  # noqa: E731
        targets.append(Target(name, envoy.url, "aggregated", total, parts))
    return targets


def _external_target(spec: str) -> Target:
    name, _, rest = spec.partition("=")
    url, _, pid = rest.partition("@")
    cpu = None
    if pid:
        pids = [int(pid)]
        cpu = lambda: sum(_cpu_seconds(p) for p in pids + _children(pids[0]))  # noqa: E731
    return Target(name, url.rstrip("/"), "external", cpu)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetgate bench overhead", description=__doc__)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 32, 128], help="concurrent clients per cell"
    )
    parser.add_argument("--requests", type=int, default=400, help="requests per cell and round")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--target", action="append", default=[], help="NAME=URL[@PID] of another router")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sim_args = ["--model", MODEL, *ZERO_TIMING]
    with (
        contextlib.ExitStack() as stack,
        SimProcess([*sim_args, "--role", "both"]) as direct,
        SimProcess([*sim_args, "--role", "prefill"]) as prefill,
        SimProcess([*sim_args, "--role", "decode"]) as decode,
        GatewayProcess(
            gateway_config([_backend("sim-0", direct.url, ["prefill", "decode"])], "never")
        ) as agg,
        GatewayProcess(
            gateway_config(
                [_backend("sim-p", prefill.url, ["prefill"]), _backend("sim-d", decode.url, ["decode"])],
                "always",
            )
        ) as pd,
    ):
        floor = stack.enter_context(_floor_proxy(direct.url))
        envoy_epp = _envoy_epp(stack, direct.url)
        targets = [
            Target("direct", direct.url, "direct"),
            Target("floor", floor.url, "aggregated", floor.cpu_seconds),
            Target("hetgate", agg.url, "aggregated", agg.cpu_seconds),
            Target("hetgate", pd.url, "pd", pd.cpu_seconds),
            *envoy_epp,
            *(_external_target(spec) for spec in args.target),
        ]
        cells = asyncio.run(run_cells(targets, args))
    has_cpu = {t.name for t in targets if t.cpu is not None}
    rows = summarise(cells, has_cpu)
    print_table(rows)
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "settings": vars(args) | {"json": str(args.json)}}, indent=1)
        )
    return 1 if any(r["errors"] for r in rows) else 0
