"""What one routing decision costs on the request path: index lookup, Candidates, plan.

For a prompt of `--tokens` tokens (block size 16) over `--backends` backends of a mixed cluster (MI300X
and MI308X, DeepSeek-R1, every backend may prefill and decode), with backend i holding the first
(i mod 8 + 1)/8 of the prompt in a `kvindex.MemoryIndex` and some reserved work on each:
- `lookup`: the awaited `index.match` over all backends (as `gateway/affinity.py` calls it);
- `candidates`: `ModelPool.candidates` (the registry's columns through the load formula; a quarter of
  the backends have a split decode leg due);
- `plan`: the policy's `plan` (`cost` prices 64 aggregated plans and the splits among each side's
  shortlist, `scoring/cost_policy.py` `_split`);
- `decision`: the three together, what the gateway adds per request after hashing the prompt (hashing
  is measured by `hetgate bench index`).
Each figure: p50 and p99 over `--calls` decisions, in microseconds, the median of `--rounds` rounds
(the policies alternate round by round, each round after `--warmup` uncounted decisions). Ratio
baseline in the same run: `round_robin`'s plan on the same candidates.

    python -m bench.route_bench [--tokens 32768] [--backends 64] [--calls 1000] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import GatewayConfig
from gateway.registry import Registry
from kvindex.memory import MemoryIndex
from kvindex.prompt import PromptHasher
from scoring.catalog import load_catalog
from scoring.load import leg_load
from scoring.router import build_router
from scoring.types import RequestFeatures

MODEL = "deepseek-r1"
BLOCK = 16
PARTS = ("lookup", "candidates", "plan", "decision")


def cluster_config(backends: int) -> GatewayConfig:
    rows = [
        {
            "id": f"b{i}",
            "url": f"http://127.0.0.1:{9000 + i}",
            "model": MODEL,
            "accelerator": "mi300x" if i % 3 == 0 else "mi308x",
            "gpus": 8,
            "roles": ["prefill", "decode"],
        }
        for i in range(backends)
    ]
    return GatewayConfig.model_validate({"models": [{"name": MODEL, "spec": MODEL}], "backends": rows})


def percentiles(samples: list[float]) -> dict[str, float]:
    us = np.asarray(samples) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = cluster_config(args.backends)
    registry = Registry(config)
    pool = registry.pools[MODEL]
    ids = [b.id for b in pool.backends]
    # Real chained 64-bit block hashes, in the uint64 array the gateway's hashing step makes.
    hasher = PromptHasher(MODEL, [BLOCK])
    hashes = hasher.features({"prompt": [(i * 7919) % 50_000 for i in range(args.tokens)]}, "completions")[1][
        BLOCK
    ]
    index = MemoryIndex()
    for i, backend_id in enumerate(ids):
        await index.record(MODEL, BLOCK, hashes[: len(hashes) * (i % 8 + 1) // 8], backend_id)
    for i, backend in enumerate(pool.backends):  # some work reserved on every backend
        for _ in range(i % 4):
            # priced, as `cost` plans them (8,000 tokens fit in a step: no progress is credited)
            registry.reserve(backend, leg_load("aggregated", 8000, 256, 0, prefill_s=0.5))
        if i % 4 == 1:  # and split decode legs due on a quarter of them (priced by `cost`)
            registry.reserve(backend, leg_load("decode", 8000, 256, 0, kv_due_s=registry.now()))
    request = RequestFeatures(MODEL, args.tokens, 256, False, {BLOCK: hashes})
    routers = {
        "cost": build_router("cost", "auto", model=load_catalog().model(MODEL)),
        "prefix": build_router("prefix", "auto"),
        "round_robin": build_router("round_robin", "auto"),
    }

    async def one_round(router: Any, calls: int) -> dict[str, list[float]]:
        parts: dict[str, list[float]] = {part: [] for part in PARTS}
        for _ in range(calls):
            t0 = time.perf_counter()
            counts = await index.match(MODEL, BLOCK, hashes, ids)
            cached = np.minimum(np.asarray(counts, dtype=np.int64) * BLOCK, args.tokens)
            t1 = time.perf_counter()
            candidates = registry.candidates(pool, cached)
            t2 = time.perf_counter()
            router.plan(request, candidates)
            t3 = time.perf_counter()
            for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                parts[part].append(seconds)
        return parts

    # Policies alternate round by round, so a slow spell of the (shared, virtual) machine falls on
    # all of them; each figure is the median over rounds of that round's percentile.
    rounds: dict[str, list[dict[str, list[float]]]] = {name: [] for name in routers}
    for _ in range(args.rounds):
        for name, router in routers.items():
            await one_round(router, args.warmup)
            rounds[name].append(await one_round(router, args.calls))
    rows = {
        name: {part: _median_percentiles([r[part] for r in measured]) for part in PARTS}
        for name, measured in rounds.items()
    }
    return {"tokens": args.tokens, "backends": args.backends, "calls": args.calls, "rounds": args.rounds,
            "policies": rows}  # fmt: skip


def _median_percentiles(rounds: list[list[float]]) -> dict[str, float]:
    figures = [percentiles(samples) for samples in rounds]
    return {key: float(np.median([f[key] for f in figures])) for key in ("p50_us", "p99_us")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.route_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--backends", type=int, default=64)
    parser.add_argument("--calls", type=int, default=1000, help="decisions per policy and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=100, help="decisions before each round, not counted")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    shape = f"{args.tokens}-token prompt, {args.backends} backends"
    print(f"{shape}, {args.rounds} rounds of {args.calls} decisions (microseconds, median of the rounds)")
    print(f"{'policy':<12}{'part':<12}{'p50':>10}{'p99':>10}")
    for policy, parts in result["policies"].items():
        for part, figures in parts.items():
            print(f"{policy:<12}{part:<12}{figures['p50_us']:>10.0f}{figures['p99_us']:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
