"""Clusters for the policy benchmark and the planner: a gateway config file read into simulated backends,
and the cost model's fluid bound on what those backends can serve for a given workload.

The fluid bound is a linear program over per-backend request rates: backend i prefills `p_i` and decodes
`d_i` requests per second (only in the roles the config allows; a decode-only backend prefills at most
the requests it serves whole), its time shares add up to at most 1, and every decoded request was
prefilled somewhere (KV transfer free). Each request's work is priced by the same
`scoring.cost.step_time` that times the simulator, at the engine's best case: prefill in full chunks of
`max_num_batched_tokens` (weights read once per chunk, step overhead shared), only the tokens no earlier
request of the workload already computed (an ideal, cluster-wide prefix cache), and decode at the largest
batch the KV cache and `max_num_seqs` allow. No queueing and no prefill/decode interference: no policy can
beat it, so measured throughput above it is a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.seed_case import FITTED
from bench.sim.des import SimBackend
from bench.workloads import WorkloadRequest
from gateway.config import CostKnobs, GatewayConfig
from scoring.catalog import Catalog, ModelSpec, load_catalog
from scoring.cost import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Hardware,
    causal_pairs,
    kv_capacity_tokens,
    prefill_time,
    step_time,
)
from scoring.types import BackendSpec, Role

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The benchmark's clusters by short name. The seed cluster runs at the efficiency fitted to its published
# single-server figures (bench/seed_case.py); the others at the cost model's defaults.
CLUSTERS = {
    "amd": CONFIGS / "seed-case.yaml",
    "nvidia": CONFIGS / "nvidia-b200-h100.yaml",
    "cpx": CONFIGS / "nvidia-rubin-cpx.yaml",
}
EFFICIENCY = {"amd": FITTED}
MAX_NUM_BATCHED_TOKENS = 8192  # the simulator's (and vLLM's) default chunk


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    config: GatewayConfig
    model: ModelSpec
    backends: tuple[SimBackend, ...]
    efficiency: Efficiency

    @property
    def ids(self) -> list[str]:
        return [b.spec.id for b in self.backends]

    def hardware(self) -> Hardware:
        return Hardware.of(
            [b.accelerator for b in self.backends],
            [b.spec.gpus for b in self.backends],
            self.model.compute_dtype,
        )

    def with_roles(self, roles: Sequence[frozenset[Role]]) -> Cluster:
        """The same servers with other roles (the planner tries assignments)."""
        backends = tuple(
            replace(b, spec=replace(b.spec, roles=r)) for b, r in zip(self.backends, roles, strict=True)
        )
        configs = tuple(
            c.model_copy(update={"roles": r}) for c, r in zip(self.config.backends, roles, strict=True)
        )
        return replace(self, backends=backends, config=self.config.model_copy(update={"backends": configs}))


def with_calibrated_router(cluster: Cluster) -> Cluster:
    """The same cluster, its `cost` router's roofline starting at the efficiency the simulator runs (a
    router calibrated beforehand: `routing.cost`) instead of the cost model's defaults."""
    cost = CostKnobs(mfu=cluster.efficiency.mfu, bw_util=cluster.efficiency.bw_util)
    routing = cluster.config.routing.model_copy(update={"cost": cost})
    return replace(cluster, config=cluster.config.model_copy(update={"routing": routing}))


def load_cluster(path: str | Path, name: str | None = None, catalog: Catalog | None = None) -> Cluster:
    """A gateway config file (its first model and that model's backends) as simulated backends."""
    from gateway.cli import read_config

    catalog = catalog or load_catalog()
    config = read_config(str(path), load_tokenizers=False)
    served = config.models[0]
    model = catalog.model(served.spec or served.name)
    backends = tuple(
        SimBackend(
            BackendSpec(b.id, served.name, b.accelerator, b.gpus, b.roles, b.max_num_seqs, b.block_size),
            catalog.accelerator(b.accelerator),
        )
        for b in config.backends_of(served.name)
    )
    name = name or Path(path).stem
    return Cluster(name, config, model, backends, EFFICIENCY.get(name, DEFAULT_EFFICIENCY))


# --- the fluid bound ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FluidBound:
    requests_per_s: float  # the most requests per second the cluster can complete
    output_tok_per_s: float
    prefill_share: dict[str, float]  # per backend: share of its time spent prefilling at the bound
    decode_share: dict[str, float]


def new_tokens(requests: Sequence[WorkloadRequest]) -> tuple[np.ndarray, np.ndarray]:
    """(new, cached) prompt tokens per request under an ideal cluster-wide prefix cache: the leading
    content blocks some earlier request of the workload already had are cached."""
    seen: set[tuple[int, ...]] = set()
    new = np.empty(len(requests))
    cached = np.empty(len(requests))
    for k, r in enumerate(requests):
        blocks, hit = r.prompt.blocks, 0
        needed = -(-r.prompt_len // r.prompt.block_tokens)
        while hit < needed - 1 and blocks[: hit + 1] in seen:
            hit += 1
        seen.update(blocks[: i + 1] for i in range(needed))
        cached[k] = min(hit * r.prompt.block_tokens, r.prompt_len - 1)
        new[k] = r.prompt_len - cached[k]
    return new, cached


def fluid_bound(cluster: Cluster, requests: Sequence[WorkloadRequest]) -> FluidBound:
    """The LP of the module docstring, for this workload's mix of prompt and output lengths."""
    from scipy.optimize import linprog

    hw, model, eff = cluster.hardware(), cluster.model, cluster.efficiency
    n = len(cluster.backends)
    new, cached = new_tokens(requests)
    outputs = np.array([r.max_tokens for r in requests], dtype=float)
    chunk = float(MAX_NUM_BATCHED_TOKENS)
    # Per backend: seconds per prefilled token in a full chunk, and the attention of each prompt on top.
    per_token = np.asarray(step_time(model, hw, chunk, 0.0, 0, 0, eff)) / chunk
    pairs = float(np.mean(new * cached + new * (new + 1) / 2))
    attention = np.asarray(step_time(model, hw, chunk, pairs, 0, 0, eff)) - per_token * chunk
    prefill_s = per_token * float(new.mean()) + attention
    # Decode at the largest batch that fits, each sequence at its mean context over its output.
    context = float(np.mean([r.prompt_len for r in requests]) + outputs.mean() / 2)
    seqs = np.array([b.spec.max_num_seqs for b in cluster.backends], dtype=float)
    batch = np.maximum(1.0, np.minimum(seqs, kv_capacity_tokens(model, hw, eff) // context))
    per_output = np.asarray(step_time(model, hw, 0, 0, batch, batch * context, eff)) / batch
    decode_s = per_output * float(outputs.mean())
    can_p = np.array([Role.PREFILL in b.spec.roles for b in cluster.backends])
    can_d = np.array([Role.DECODE in b.spec.roles for b in cluster.backends])
    cost = np.concatenate([np.zeros(n), -np.ones(n)])
    busy = np.hstack([np.diag(prefill_s), np.diag(decode_s)])
    # A decode-only backend still prefills what it serves aggregated (the router sends it whole requests),
    # but nobody else's: p_i <= d_i.
    own = np.hstack([np.eye(n), -np.eye(n)])[~can_p & can_d]
    balance = np.concatenate([np.ones(n), -np.ones(n)])[None, :]
    bounds = [(0, None if ok else 0) for ok in np.concatenate([can_p | can_d, can_d])]
    a_ub = np.vstack([busy, own])
    b_ub = np.concatenate([np.ones(n), np.zeros(len(own))])
    lp = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=balance, b_eq=[0.0], bounds=bounds)
    if lp.status != 0:
        return FluidBound(0.0, 0.0, dict.fromkeys(cluster.ids, 0.0), dict.fromkeys(cluster.ids, 0.0))
    p, d = lp.x[:n], lp.x[n:]
    rate = float(d.sum())
    return FluidBound(
        rate,
        rate * float(outputs.mean()),
        {i: float(x) for i, x in zip(cluster.ids, p * prefill_s, strict=True)},
        {i: float(x) for i, x in zip(cluster.ids, d * decode_s, strict=True)},
    )


# --- the SLO bound ----------------------------------------------------------------------------------------
_BATCHES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_CHUNKS = (0, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True, slots=True)
class SloPlan:
    """The SLO bound and one plan that reaches it (`slo_plan`): per backend, its share of the served
    requests' prefills and of their decodes. An LP's optimum need not be unique; this is the solver's."""

    requests_per_s: float
    prefills: dict[str, float]
    decodes: dict[str, float]


def slo_bound(
    cluster: Cluster,
    requests: Sequence[WorkloadRequest],
    ttft_limits: np.ndarray,
    tpot_limits: np.ndarray,
    goal: float = 0.9,
) -> float:
    """`slo_plan`'s rate."""
    return slo_plan(cluster, requests, ttft_limits, tpot_limits, goal).requests_per_s


def slo_plan(
    cluster: Cluster,
    requests: Sequence[WorkloadRequest],
    ttft_limits: np.ndarray,
    tpot_limits: np.ndarray,
    goal: float = 0.9,
) -> SloPlan:
    """The most requests per second any policy could serve with `goal` of them within their SLO: a fluid
    LP of vLLM's chunked-prefill steps under the SLO, so no policy's steady-state SLO capacity exceeds it;
    and where that plan prefills and decodes them.

    Each backend spends shares of its time on step shapes (a decode batch of b sequences, a prefill chunk
    of c tokens, both at once as vLLM mixes them), each timed by `scoring.cost.step_time`. Constraints:
    - a request prefills only where its unloaded TTFT (ideal prefix cache, no queue) meets its limit;
    - the steps a backend's decoded tokens ride average at most the `goal` quantile of the TPOT limits
      (per token, so a large batch counts as many times as it has sequences): prefill chunks in those
      steps stretch every decode's TPOT (vLLM's chunked prefill), so a backend that prefills a lot
      decodes little within the SLO;
    - up to 1 - `goal` of the requests may miss, and they cost nothing.
    Optimistic (no queueing, time shared freely between step shapes, KV transfer free, the mean context
    and prompt per token), like the fluid bound."""
    from scipy.optimize import linprog

    hw, model, eff = cluster.hardware(), cluster.model, cluster.efficiency
    n = len(cluster.backends)
    new, cached = new_tokens(requests)
    outputs = float(np.mean([r.max_tokens for r in requests]))
    can_p = np.array([Role.PREFILL in b.spec.roles for b in cluster.backends])
    can_d = np.array([Role.DECODE in b.spec.roles for b in cluster.backends])
    # A decode-only backend prefills the requests it serves whole.
    unloaded = np.asarray(prefill_time(model, hw, new[:, None], cached[:, None], eff))
    ttft_ok = (unloaded <= ttft_limits[:, None]) & (can_p | can_d)
    # Requests with the same TTFT-feasible backends form one group: x[g, i] = group g's prefills on i.
    groups, member = np.unique(ttft_ok, axis=0, return_inverse=True)
    member = member.ravel()
    share = np.bincount(member, minlength=len(groups)) / len(requests)
    group_new = np.array([new[member == g].mean() for g in range(len(groups))])
    shapes = _step_shapes(cluster, requests, new, cached, outputs)  # per backend: (b, c, seconds)
    lenient = float(np.quantile(tpot_limits, goal))
    # Variables: x (groups x backends), d (decodes/s per backend), y (time share per backend and shape), rate.
    nx = len(groups) * n
    counts = [len(seconds) for _, _, seconds in shapes]
    y_at = np.cumsum([0, *counts])[:-1] + nx + n
    size = nx + n + sum(counts) + 1
    ub_rows: list[np.ndarray] = []
    ub: list[float] = []

    def row() -> np.ndarray:
        return np.zeros(size)

    for i, (batch, chunk, seconds) in enumerate(shapes):
        ys = slice(y_at[i], y_at[i] + len(seconds))
        time_row = row()
        time_row[ys] = 1.0
        ub_rows.append(time_row)  # its time
        ub.append(1.0)
        prefill = row()  # the prompt tokens it prefills fit in its steps' chunks
        prefill[i:nx:n] = group_new
        prefill[ys] = -chunk / seconds
        ub_rows.append(prefill)
        ub.append(0.0)
        decode = row()  # the tokens it decodes fit in its steps' batches
        decode[nx + i] = outputs
        decode[ys] = -batch / seconds
        ub_rows.append(decode)
        ub.append(0.0)
        tpot = row()  # its decoded tokens' mean step time within the limit: sum(tokens x (step - limit)) <= 0
        tpot[ys] = batch * (1.0 - lenient / seconds)
        ub_rows.append(tpot)
        ub.append(0.0)
        if can_d[i] and not can_p[i]:  # prefills only what it decodes itself
            own = row()
            own[i:nx:n], own[nx + i] = 1.0, -1.0
            ub_rows.append(own)
            ub.append(0.0)
    for g in range(len(groups)):  # a group is served at most at its arrival rate
        served_g = row()
        served_g[g * n : (g + 1) * n], served_g[-1] = 1.0, -share[g]
        ub_rows.append(served_g)
        ub.append(0.0)
    served = row()  # at least `goal` of the arrivals served
    served[:nx], served[-1] = -1.0, goal
    ub_rows.append(served)
    ub.append(0.0)
    decoded = row()  # every served request decoded somewhere
    decoded[:nx], decoded[nx : nx + n] = 1.0, -1.0
    bounds = [(0.0, None if groups[g, i] else 0.0) for g in range(len(groups)) for i in range(n)]
    bounds += [(0.0, None if ok else 0.0) for ok in can_d]
    bounds += [(0.0, None)] * (size - nx - n)
    cost = row()
    cost[-1] = -1.0
    lp = linprog(
        cost, A_ub=np.vstack(ub_rows), b_ub=np.array(ub), A_eq=decoded[None, :], b_eq=[0.0], bounds=bounds
    )
    if lp.status != 0 or lp.x[-1] <= 0:
        return SloPlan(0.0, dict.fromkeys(cluster.ids, 0.0), dict.fromkeys(cluster.ids, 0.0))
    prefills = np.clip([lp.x[i:nx:n].sum() for i in range(n)], 0.0, None)  # -0.0 and the like
    decodes = np.clip(lp.x[nx : nx + n], 0.0, None)
    return SloPlan(
        float(lp.x[-1]),
        {i: float(x) for i, x in zip(cluster.ids, prefills / prefills.sum(), strict=True)},
        {i: float(x) for i, x in zip(cluster.ids, decodes / decodes.sum(), strict=True)},
    )


def _step_shapes(
    cluster: Cluster,
    requests: Sequence[WorkloadRequest],
    new: np.ndarray,
    cached: np.ndarray,
    outputs: float,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per backend, the step shapes it may run: (decode batch, prefill chunk tokens, seconds) arrays.
    Batches up to what its KV cache and max_num_seqs hold at the mean context; a chunk's attention at the
    workload's mean (query, key) pairs per prompt token; the empty shape (0, 0) left out."""
    hw, model, eff = cluster.hardware(), cluster.model, cluster.efficiency
    context = float(np.mean([r.prompt_len for r in requests]) + outputs / 2)
    pairs_per_token = float(np.sum(causal_pairs(new, cached)) / max(new.sum(), 1.0))
    most = np.array([b.spec.max_num_seqs for b in cluster.backends], dtype=float)
    most = np.minimum(most, kv_capacity_tokens(model, hw, eff) // context)
    grid = [(b, c) for b in _BATCHES for c in _CHUNKS if b or c]
    batch = np.array([b for b, _ in grid], dtype=float)
    chunk = np.array([c for _, c in grid], dtype=float)
    seconds = np.asarray(
        step_time(model, hw, chunk[:, None], chunk[:, None] * pairs_per_token, batch[:, None],
                  batch[:, None] * context, eff)
    )  # fmt: skip
    shapes = []
    for i in range(len(cluster.backends)):
        fits = batch <= most[i]
        shapes.append((batch[fits], chunk[fits], seconds[fits, i]))
    return shapes
