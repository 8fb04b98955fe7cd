"""`hetgate bench cache`: prefix-cache hit rate and TTFT per routing policy, on a real trace.

Replays Mooncake's synthetic trace (`bench/data/traces/mooncake_synthetic_trace.jsonl`, shared
512-token blocks by `hash_ids`, real arrival times) through the discrete-event simulator
(`bench/sim/des.py`), which runs the real `scoring` routers against simulated vLLM engines with their
own prefix caches. For each policy it reports the engines' prefix hit rate (cached / prompt tokens),
TTFT p50/p90 and output throughput; `round_robin`, run on the same requests, is the baseline every
ratio refers to.

Two ways the `prefix` policy can learn what engines hold (`--index`):
- `precise`: the engines' true cache contents, as the gateway sees them with vLLM's KV events;
- `approximate`: a `kvindex.MemoryIndex` the router feeds itself (each routed prompt is recorded on the
  chosen backend, capacity = the engine's KV blocks), as the gateway does without KV events.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench import workloads
from bench.sim.des import DesResult, SimBackend, Simulation, make_backends
from kvindex.memory import MemoryIndex
from scoring.catalog import load_catalog
from scoring.router import build_router
from scoring.types import Candidates, Mode, Outcome, RequestFeatures, Role, RoutePlan, Router

BOTH = frozenset({Role.PREFILL, Role.DECODE})
POLICIES = ("round_robin", "least_load", "prefix")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetgate bench cache", description=__doc__)
    parser.add_argument("--trace", type=Path, default=None, help="default: Mooncake's synthetic trace")
    parser.add_argument("--limit", type=int, default=1500, help="first N requests of the trace")
    parser.add_argument("--speedup", type=float, default=1.0, help="compress arrival times N times")
    # Eight MI300X hold ~1.2M tokens of KV each: enough to keep the trace's reuse (on 4x H100 the
    # caches turn over faster than prompts come back, and no policy finds much to hit).
    parser.add_argument("--backends", type=int, default=8, help="simulated engines (one server each)")
    parser.add_argument("--accelerator", default="mi300x", help="of every engine (configs/accelerators.yaml)")
    parser.add_argument("--model", default="llama-3.1-8b", help="model served (configs/models.yaml)")
    parser.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    parser.add_argument(
        "--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="routing policies compared"
    )
    parser.add_argument(
        "--index",
        choices=("precise", "approximate", "both"),
        default="both",
        help="prefix policy's index: fed by KV events (precise), by its own decisions (approximate)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    return parser.parse_args(argv)


class ApproximateIndexRouter:
    """Routes with a prefix index fed only by its own decisions (no KV events), like the gateway."""

    def __init__(self, inner: Router, index: MemoryIndex) -> None:
        self.inner = inner
        self.index = index
        self.name = f"{inner.name}+approx"
        self.uses_prefix_index = False  # it looks prefixes up itself, in its own index
        self.learns = inner.learns
        self.replans = inner.replans
        self.uses_work = inner.uses_work

    def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
        cached = np.zeros(len(candidates), dtype=np.int64)
        for i, spec in enumerate(candidates.specs):
            hashes = request.block_hashes.get(spec.block_size, ())
            count = self.index.match_now(request.model, spec.block_size, hashes, [spec.id])[0]
            cached[i] = min(count * spec.block_size, request.prompt_tokens)
        plan = self.inner.plan(request, dataclasses.replace(candidates, cached_tokens=cached))
        chosen = plan.prefill[:1] + plan.decode[:1] if plan.mode == Mode.PD else plan.aggregated[:1]
        for i in chosen:  # once served, the backend holds the prompt's blocks
            spec = candidates.specs[i]
            hashes = request.block_hashes.get(spec.block_size, ())
            self.index.record_now(request.model, spec.block_size, hashes, spec.id)
        return plan

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def correction(self, backend_id: str) -> float:
        return self.inner.correction(backend_id)

    def queue_correction(self, backend_id: str) -> float:
        return self.inner.queue_correction(backend_id)

    def tpot_correction(self, backend_id: str) -> float:
        return self.inner.tpot_correction(backend_id)

    def overhead(self, backend_id: str) -> float:
        return self.inner.overhead(backend_id)

    def calibration(self) -> dict[str, float]:
        return self.inner.calibration()

    def blend_calibration(self, others: Mapping[str, Sequence[float]]) -> None:
        self.inner.blend_calibration(others)

    def replan(self) -> None:
        self.inner.replan()


def run_policy(
    policy: str, index: str, args: argparse.Namespace, requests: Sequence[workloads.WorkloadRequest]
) -> DesResult:
    catalog = load_catalog()
    model = catalog.model(args.model)
    accelerator = catalog.accelerator(args.accelerator)
    backends: list[SimBackend] = make_backends(
        [(f"b{i}", accelerator, 1, BOTH) for i in range(args.backends)], model.name,
        block_size=args.block_size,
    )  # fmt: skip
    router: Router = build_router(policy)
    if index == "approximate":
        memory = MemoryIndex()
        router = ApproximateIndexRouter(router, memory)
        sim = Simulation(model, backends, router, prefix_lookup=False)
        for spec, engine in zip(sim.specs, sim.engines, strict=True):
            memory.set_capacity(spec.id, engine.config.num_gpu_blocks)
        return sim.run(requests)
    return Simulation(model, backends, router).run(requests)


def row_of(policy: str, index: str, result: DesResult) -> dict[str, Any]:
    prompt = sum(r.prompt_len for r in result.records)
    summary = result.summary()
    return {
        "policy": policy,
        "index": index,
        "hit_rate": sum(r.cached_tokens for r in result.records) / max(prompt, 1),
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p90_s": summary["ttft_p90_s"],
        "output_tok_s": summary["output_tok_s"],
        "completed": summary["completed"],
        "requests": summary["requests"],
        "sim_wall_s": summary["wall_s"],
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if r["policy"] == "round_robin"), None)
    for r in rows:
        for key in ("ttft_p50_s", "ttft_p90_s", "output_tok_s"):
            r[f"{key}_vs_rr"] = r[key] / base[key] if base and base[key] else float("nan")


def print_table(rows: list[dict[str, Any]], trace: dict[str, float], console: Console) -> None:
    title = (
        f"Mooncake trace: {trace['requests']:.0f} requests, mean prompt {trace['mean_prompt_tokens']:.0f} "
        f"tokens, {trace['duration_s']:.0f} s; ratios vs round_robin"
    )
    table = Table(title=title)
    for column in ("policy", "index", "hit rate", "TTFT p50 s", "TTFT p90 s", "out tok/s", "p50 vs rr",
                   "p90 vs rr", "done"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["policy"], r["index"], f"{r['hit_rate']:.1%}",
            f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p90_s']:.3f}",
            f"{r['output_tok_s']:.0f}", f"{r['ttft_p50_s_vs_rr']:.2f}x", f"{r['ttft_p90_s_vs_rr']:.2f}x",
            f"{r['completed']}/{r['requests']}",
        )  # fmt: skip
    console.print(table)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    requests = workloads.mooncake_trace(args.trace, limit=args.limit)
    if args.speedup != 1.0:
        requests = workloads.with_speedup(requests, args.speedup)
    indexes = ("precise", "approximate") if args.index == "both" else (args.index,)
    rows = []
    for policy in args.policies:
        # Policies blind to the prefix index behave the same with either index: run them once.
        for index in indexes if policy == "prefix" else ("none",):
            rows.append(row_of(policy, index, run_policy(policy, index, args, requests)))
    add_ratios(rows)
    trace = workloads.summarize(requests)
    print_table(rows, trace, Console(width=120))
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"rows": rows, "trace": trace, "settings": settings}, indent=1))
    return 0 if all(r["completed"] == r["requests"] for r in rows) else 1
