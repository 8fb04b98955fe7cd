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
    kv_capacity_tokens,
    step_time,
)
from scoring.slo_plan import Servers, Traffic, solve_slo_plan
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
    """The most requests per second any policy could serve with `goal` of them within their SLO, and where
    that plan prefills and decodes them: `scoring.slo_plan`'s LP over the whole workload, each request's
    cached tokens those of an ideal cluster-wide prefix cache (`new_tokens`)."""
    new, cached = new_tokens(requests)
    traffic = Traffic(
        new + cached,
        cached,
        np.array([r.max_tokens for r in requests], dtype=float),
        ttft_limits,
        tpot_limits,
    )
    plan = solve_slo_plan(plan_servers(cluster), traffic, goal)
    return SloPlan(
        plan.requests_per_s,
        {i: float(x) for i, x in zip(cluster.ids, plan.prefills, strict=True)},
        {i: float(x) for i, x in zip(cluster.ids, plan.decodes, strict=True)},
    )


def plan_servers(cluster: Cluster) -> Servers:
    specs = [b.spec for b in cluster.backends]
    return Servers.of(cluster.model, cluster.hardware(), cluster.efficiency, specs)
