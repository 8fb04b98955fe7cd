"""The compiled kernels of the request path (`scoring/jit.py`): the warm-up the gateway runs before it
serves compiles every kernel for the argument types routing calls it with, so no request waits for a
compile (~15 s cold), nor does the event loop. Checked in a fresh interpreter: signatures compiled by
the warm-up, then routing through the registry (as the gateway does) and through the simulator, and
the prefix index's calls (kvindex/holders.py), which must add none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, json
import numpy as np
import kvindex
from scoring.cost_policy import compile_kernels
from scoring.jit import KERNELS

def compiled():
    return [len(k.signatures) if hasattr(k, "signatures") else len(k.types) for k in KERNELS]

compile_kernels()
kvindex.compile_kernels()
warm = compiled()

from bench import policies
from bench.route_bench import cluster_config, MODEL
from gateway.registry import Registry
from scoring.catalog import load_catalog
from scoring.load import leg_load
from scoring.router import build_router
from scoring.types import RequestFeatures

registry = Registry(cluster_config(8))
pool = registry.pools[MODEL]
for i, backend in enumerate(pool.backends):
    registry.reserve(backend, leg_load("aggregated", 9000 * i, 64, 0, prefill_s=0.5))
    if i % 2:
        registry.reserve(backend, leg_load("decode", 4000, 64, 0, kv_due_s=registry.now() + 0.1))
for policy in ("cost", "prefix", "least_load", "round_robin"):
    for split in ("never", "auto", "always"):
        knobs = {"model": load_catalog().model(MODEL)} if policy == "cost" else {}
        router = build_router(policy, split, **knobs)
        cached = np.arange(8, dtype=np.int64) * 512
        router.plan(RequestFeatures(MODEL, 4096, 128), registry.candidates(pool, cached))
scenario = policies.build_scenario("bursty@nvidia", 40)
for policy in ("cost/auto", "cost/never", "prefix/auto", "round_robin/never"):
    policies.run_des(scenario, 5.0, policy, policies.Slo())
from kvindex import build_index
from kvindex.prompt import PromptHasher

async def index_calls():
    index = build_index("memory")
    hasher = PromptHasher(MODEL, [16, 32, 64])  # 64-token blocks: hashed by the library
    hasher.features({"messages": [{"role": "user", "content": "x" * 9000}]}, "chat")
    hashes = hasher.features({"prompt": list(range(4096))}, "completions")[1][16]
    ids = [f"b{i}" for i in range(70)]  # masks of two words
    for i, backend_id in enumerate(ids):
        await index.record(MODEL, 16, hashes[: 4 * i], backend_id)
    await index.record(MODEL, 16, list(range(9)), "b1")  # KV events' hashes are ints
    await index.match(MODEL, 16, hashes, [*ids, "unknown"])
    await index.remove(MODEL, 16, hashes[:3].tolist(), "b2")
    await index.clear_backend("b3")
    await index.match(MODEL, 16, np.frombuffer(hashes.tobytes(), np.uint64), ids)  # read-only
    await index.match(MODEL, 16, hashes[::2], ids)  # strided

asyncio.run(index_calls())
names = [str(getattr(k, "__name__", k)) for k in KERNELS]
print(json.dumps({"warm": warm, "after": compiled(), "names": names}))
"""


def test_routing_after_the_warm_up_compiles_nothing_more() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    warm = dict(zip(result["names"], result["warm"], strict=False))  # the ufunc's name comes first
    # The kernels routing calls from Python (the others are compiled into them).
    scoring = ("_load_rows", "_plan_kernel", "rotated")
    assert all(warm[name] >= 1 for name in (*scoring, "_add", "_drop", "_walk", "_rehash", "_chain"))
    counts = zip(result["names"], result["warm"], result["after"], strict=True)
    grew = [name for name, before, after in counts if after != before]
    assert grew == [], f"kernels compiled after the warm-up: {grew}"
