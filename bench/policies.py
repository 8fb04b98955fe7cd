"""`hetgate bench policies`: routing policies side by side, scenarios x policies x request rates.

Every scenario is a workload on a cluster (a gateway config in configs/): the seed case; the shared traces
(Mooncake, Azure conv, Azure code) and the synthetic shared-system-prompt, bursty and long multi-turn
workloads on three mixed clusters (`amd`: the seed cluster, MI300X + 2x MI308X; `nvidia`: B200 + 2x H100;
`cpx`: Rubin CPX prefill + 2x H100); any `--trace FILE` on every cluster. Each runs under each policy
(round_robin, least_load, prefix, cost; disaggregation never and auto) at each request rate, in the
discrete-event simulator (`bench/sim/des.py`, the real router built as the gateway builds it). `--http`
replays a short check through the real gateway and `hetgate sim` backends instead (bench/policies_http.py).

Rates default to a sweep from light load to past saturation: fractions of the cluster's fluid bound for
that workload (bench/clusters.py), and of its SLO bound (the same LP under the SLO: no policy's steady
state serves more within it). A request meets the SLO when its TTFT <= `--slo-ttft-s` and its TPOT
<= `--slo-tpot-s`; by default 5x its prompt's unloaded TTFT and 3x the unloaded TPOT on the fastest backend.
SLO capacity (DistServe's goodput) is the highest rate at which >= 90 % of requests meet it, interpolated
linearly between the last swept rate that does and the first that does not. A full sweep then bisects
that interval `--refine` times per scenario and policy (2 by default: a grid point 1.5x apart from the
next left every policy's capacity an interpolation over the same cell, and goodput falls off a cliff,
not a line). A capacity above the SLO bound is flagged: the run ended before the queue that rate builds
showed (more `--requests` needed).

    hetgate bench policies [--quick] [--scenarios A,B] [--policies cost/auto,...]
                           [--rates R1,R2 | --rate-fracs F1,F2] [--refine N] [--requests N] [--trace FILE]
                           [--seeds N] [--json FILE] [--plot FILE] [--jobs J]
                           [--http [--target NAME=URL|NAME=COMMAND]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from bench import workloads as w
from bench.clusters import (
    CLUSTERS,
    Cluster,
    FluidBound,
    fluid_bound,
    load_cluster,
    slo_bound,
    with_calibrated_router,
)
from bench.decode_ceiling import decode_ceiling
from bench.prefill_ceiling import prefill_ceiling
from bench.sim.des import DesResult, Simulation
from bench.sim.scheduler import SchedulerCore, StepOutput
from scoring.cost import decode_step_time, prefill_time
from scoring.types import Router

POLICIES = tuple(
    f"{p}/{d}" for p in ("round_robin", "least_load", "prefix", "cost") for d in ("never", "auto")
)
GOAL = 0.9  # share of requests that must meet the SLO at a rate within the SLO capacity
# Fractions of the fluid bound's request rate. The bound assumes full decode batches, which a finite run
# rarely reaches, so the grid is dense at the low end, where the policies part ways.
RATE_FRACS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0, 1.3)
# Added to a full sweep, as fractions of the SLO bound: where the SLO binds far below the fluid bound
# (DeepSeek-R1 on the AMD cluster: a fifth of it), the fluid grid has one point below the capacities.
SLO_RATE_FRACS = (0.25, 0.5, 0.75, 1.0)
QUICK_RATE_FRACS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.2)
SYNTHETIC = ("sysprompt", "bursty", "multiturn")
TRACES = ("mooncake", "azure-conv", "azure-code")
QUICK_SCENARIOS = (
    "seed",
    "azure-conv@amd",
    "azure-conv@nvidia",
    "mooncake@cpx",
    "sysprompt@amd",
    "bursty@nvidia",
)


# --- scenarios ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Scenario:
    """A workload on a cluster. `arrivals` says how a rate is applied: `poisson`, `bursty` (groups of
    requests at one instant) or `trace` (the trace's own arrival pattern, compressed to the rate)."""

    name: str
    cluster: str
    requests: tuple[w.WorkloadRequest, ...]
    arrivals: str = "poisson"
    seed: int = 0  # the repetition (`workload`): its arrival draws, or its window of a trace

    def at_rate(self, rate: float) -> list[w.WorkloadRequest]:
        if self.arrivals == "bursty":
            return w.with_bursty_arrivals(self.requests, rate, burst_size=8, seed=self.seed)
        start = min(r.arrival_s for r in self.requests)
        duration = max(r.arrival_s for r in self.requests) - start
        if self.arrivals == "trace" and duration > 0:
            shifted = [replace(r, arrival_s=r.arrival_s - start) for r in self.requests]
            return w.with_speedup(shifted, rate / (len(self.requests) / duration))
        return w.with_poisson_arrivals(self.requests, rate, self.seed)


def workload(
    kind: str, n: int, trace: str | None = None, seed: int = 0
) -> tuple[list[w.WorkloadRequest], str]:
    """`n` requests of a workload kind, and how its arrivals are applied. Repetition `seed` of a trace is
    its `seed`-th window of `n` requests (a trace's arrivals are its own: another draw of them is another
    stretch of it); of the multi-turn chats, another draw of their sessions; the other kinds keep their
    requests and draw their arrivals with `seed` (`Scenario.at_rate`). Repetition 0 is the first window."""
    if kind == "seed":
        return w.fixed_lengths(n, 16384, 128, name="seed"), "poisson"
    if kind == "mooncake":
        return _window(w.mooncake_trace(limit=(seed + 1) * n), n, seed, kind), "trace"
    if kind in ("azure-conv", "azure-code"):
        return _window(w.azure_trace(kind.split("-")[1], limit=(seed + 1) * n), n, seed, kind), "trace"
    if kind == "sysprompt":
        return w.shared_system_prompts(n, system_prompts=4, system_tokens=2048, user_tokens=256), "poisson"
    if kind == "bursty":
        return w.shared_system_prompts(
            n, system_prompts=8, system_tokens=1024, user_tokens=512, seed=1
        ), "bursty"
    if kind == "multiturn":
        turns = 8
        return w.multi_turn_chats(max(1, n // turns), turns, think_time_s=20.0, seed=seed)[:n], "trace"
    if kind == "trace" and trace:
        return _window(w.load_trace(trace, limit=(seed + 1) * n), n, seed, trace), "trace"
    raise ValueError(f"unknown workload {kind!r}")


def _window(requests: list[w.WorkloadRequest], n: int, seed: int, name: str) -> list[w.WorkloadRequest]:
    """The `seed`-th run of `n` requests of a trace loaded up to its end (`Scenario.at_rate` re-bases the
    arrivals). A trace too short for it is an error, not a shorter run."""
    if seed and len(requests) < (seed + 1) * n:
        raise ValueError(
            f"{name}: {len(requests)} requests, too few for repetition {seed} of {n} "
            f"(use fewer --seeds or --requests)"
        )
    return requests[seed * n : (seed + 1) * n]


def scenario_names(traces: Sequence[str] = ()) -> list[str]:
    names = ["seed"]
    for kind in (*TRACES, *SYNTHETIC):
        names += [f"{kind}@{c}" for c in CLUSTERS]
    for path in traces:
        names += [f"trace:{path}@{c}" for c in CLUSTERS]
    return names


def build_scenario(name: str, n: int, seed: int = 0) -> Scenario:
    if name == "seed":
        requests, arrivals = workload("seed", n)
        return Scenario(name, "amd", tuple(requests), arrivals, seed)
    kind, _, cluster = name.rpartition("@")
    if cluster not in CLUSTERS:
        raise ValueError(f"scenario {name!r}: cluster must be one of {', '.join(CLUSTERS)}")
    trace = kind.removeprefix("trace:") if kind.startswith("trace:") else None
    requests, arrivals = workload("trace" if trace else kind, n, trace, seed)
    return Scenario(name, cluster, tuple(requests), arrivals, seed)


@cache
def cluster_named(name: str) -> Cluster:
    return load_cluster(CLUSTERS[name], name)


# --- SLO ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None  # None: relative to the prompt's unloaded figure (see `limits`)
    tpot_s: float | None = None
    ttft_factor: float = 5.0
    tpot_factor: float = 3.0

    def limits(
        self, cluster: Cluster, requests: Sequence[w.WorkloadRequest]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per request: (TTFT limit, TPOT limit) in seconds. Unloaded = alone on an idle backend, no cache;
        the fastest backend for each (prefill on a prefill backend, decode on a decode backend)."""
        prompts = np.array([r.prompt_len for r in requests], dtype=float)
        outputs = np.array([r.max_tokens for r in requests], dtype=float)
        if self.ttft_s is not None and self.tpot_s is not None:
            return np.full(len(requests), self.ttft_s), np.full(len(requests), self.tpot_s)
        hw, model, eff = cluster.hardware(), cluster.model, cluster.efficiency
        ttft = np.empty(len(requests))
        tpot = np.empty(len(requests))
        for k, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
            ttft[k] = float(np.min(prefill_time(model, hw, p, 0, eff)))
            tpot[k] = float(np.min(decode_step_time(model, hw, 1, p + o / 2, eff)))
        return (
            np.full(len(requests), self.ttft_s) if self.ttft_s is not None else ttft * self.ttft_factor,
            np.full(len(requests), self.tpot_s) if self.tpot_s is not None else tpot * self.tpot_factor,
        )


# --- one measured point ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Row:
    scenario: str
    cluster: str
    mode: str  # des, http, or the name of an external router
    rate: float
    rate_frac: float  # rate over the fluid bound's request rate
    policy: str
    requests: int
    completed: int
    output_tok_per_s: float  # first arrival to last token (see `output_throughput`)
    goodput_frac: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p90_s: float
    prefix_hit_rate: float
    pd_share: float
    utilisation: dict[str, float]
    requests_per_backend: dict[str, int]
    wall_s: float
    # Median of measured over predicted TTFT and TPOT, over the completed requests whose plan was priced
    # (`cost`: the prediction the plan was chosen by); None for policies that predict nothing.
    ttft_over_predicted_p50: float | None = None
    tpot_over_predicted_p50: float | None = None
    seed: int = 0  # the repetition (`Scenario.seed`)


@dataclass(slots=True)
class Outcome:
    """What one request measured, the same whether it came from the DES or over HTTP."""

    ok: bool
    arrival_s: float
    first_token_s: float
    finish_s: float
    output_tokens: int
    pd: bool
    backends: tuple[str, ...]  # the backends that worked on it (prefill first for a split)
    predicted_ttft_s: float = math.nan  # what its plan predicted (nan: not priced)
    predicted_tpot_s: float = math.nan


def row_from(
    scenario: Scenario,
    mode: str,
    rate: float,
    bound: FluidBound,
    policy: str,
    outcomes: Sequence[Outcome],
    limits: tuple[np.ndarray, np.ndarray],
    extra: dict[str, Any],
    backend_ids: Sequence[str],
) -> Row:
    """Aggregate per-request outcomes into a row; `extra` brings prefix_hit_rate, utilisation, wall_s."""
    ok = [o for o in outcomes if o.ok]
    ttft = np.array([o.first_token_s - o.arrival_s for o in ok]) if ok else np.array([np.inf])
    tpot = np.array([_tpot(o) for o in ok]) if ok else np.array([np.inf])
    meets = [
        o.ok and o.first_token_s - o.arrival_s <= t_lim and (o.output_tokens < 2 or _tpot(o) <= p_lim)
        for o, t_lim, p_lim in zip(outcomes, limits[0], limits[1], strict=True)
    ]
    per_backend: dict[str, int] = dict.fromkeys(backend_ids, 0)
    for o in ok:
        per_backend[o.backends[-1]] = per_backend.get(o.backends[-1], 0) + 1
    tpot_ok = tpot[np.isfinite(tpot)]
    ttft_ratio, tpot_ratio = _over_predicted(ok)
    return Row(
        scenario=scenario.name,
        cluster=scenario.cluster,
        mode=mode,
        rate=round(rate, 4),
        rate_frac=round(rate / bound.requests_per_s, 3) if bound.requests_per_s else 0.0,
        policy=policy,
        requests=len(outcomes),
        completed=len(ok),
        output_tok_per_s=output_throughput(outcomes),
        goodput_frac=sum(meets) / max(len(outcomes), 1),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_p90_s=float(np.percentile(tpot_ok, 90)) if tpot_ok.size else 0.0,
        pd_share=sum(o.pd for o in ok) / max(len(ok), 1),
        requests_per_backend=per_backend,
        ttft_over_predicted_p50=ttft_ratio,
        tpot_over_predicted_p50=tpot_ratio,
        **extra,
    )


def output_throughput(outcomes: Sequence[Outcome]) -> float:
    """Output tokens of the completed requests over the run, first arrival to last token (as `vllm bench
    serve` reports it). A finite run ends with a drain that lowers it; runs long enough to reach a steady
    queue (`--requests`) bring it to the cluster's capacity past saturation."""
    ok = [o for o in outcomes if o.ok]
    if not ok:
        return 0.0
    start = min(o.arrival_s for o in outcomes)
    end = max(o.finish_s for o in ok)
    return sum(o.output_tokens for o in ok) / (end - start) if end > start else 0.0


def _over_predicted(ok: Sequence[Outcome]) -> tuple[float | None, float | None]:
    """Medians of measured over predicted TTFT and TPOT among `ok` (None where nothing was predicted)."""
    ttft = [(o.first_token_s - o.arrival_s) / o.predicted_ttft_s for o in ok if o.predicted_ttft_s > 0]
    tpot = [_tpot(o) / o.predicted_tpot_s for o in ok if o.predicted_tpot_s > 0 and o.output_tokens > 1]
    return (
        round(float(np.median(ttft)), 3) if ttft else None,
        round(float(np.median(tpot)), 3) if tpot else None,
    )


def _tpot(o: Outcome) -> float:
    return (o.finish_s - o.first_token_s) / (o.output_tokens - 1) if o.output_tokens > 1 else float("nan")


# --- discrete-event mode --------------------------------------------------------------------------------
class _TimedCore(SchedulerCore):
    """A simulated engine that adds up the time its steps take (its busy time, for utilisation)."""

    def __init__(self, config: Any, timer: Any) -> None:
        super().__init__(config, timer)
        self.busy_s = 0.0

    def step(self, now: float) -> StepOutput:
        out = super().step(now)
        if not out.idle:
            self.busy_s += out.end_s - out.start_s
        return out


class _TimedSimulation(Simulation):
    def _engine(self, backend: Any, hardware: Any) -> SchedulerCore:
        core = super()._engine(backend, hardware)  # the engine as the simulator configures it, timed
        return _TimedCore(core.config, core.timer)


def make_router(cluster: Cluster, policy: str) -> Router:
    """The router the gateway would build for this cluster's config with this policy."""
    from gateway.decision import build_routers

    name, _, split = policy.partition("/")
    routing = cluster.config.routing.model_copy(update={"policy": name, "disaggregation": split or "never"})
    config = cluster.config.model_copy(update={"routing": routing})
    return build_routers(config)[cluster.config.models[0].name]


def run_des(scenario: Scenario, rate: float, policy: str, slo: Slo, calibrated_router: bool = False) -> Row:
    cluster = cluster_named(scenario.cluster)
    requests = scenario.at_rate(rate)
    routed = with_calibrated_router(cluster) if calibrated_router else cluster
    sim = _TimedSimulation(cluster.model, cluster.backends, make_router(routed, policy), cluster.efficiency)
    started = time.perf_counter()
    result = sim.run(requests)
    wall = time.perf_counter() - started
    outcomes = [des_outcome(r) for r in result.records]
    extra = {
        "prefix_hit_rate": _hit_rate(result),
        "utilisation": _utilisation(sim, result),
        "wall_s": round(wall, 3),
    }
    bound = scenario_bound(scenario)
    limits = slo.limits(cluster, scenario.requests)
    row = row_from(scenario, "des", rate, bound, policy, outcomes, limits, extra, cluster.ids)
    row.seed = scenario.seed
    return row


def des_outcome(r: Any) -> Outcome:
    ok = not r.error and r.finish_s == r.finish_s
    backends = (r.prefill_backend, r.backend) if r.prefill_backend else (r.backend,)
    return Outcome(
        ok, r.arrival_s, r.first_token_s, r.finish_s, r.output_tokens, bool(r.prefill_backend), backends,
        r.predicted_ttft_s, r.predicted_tpot_s,
    )  # fmt: skip


def _hit_rate(result: DesResult) -> float:
    """vLLM's prefix cache hit rate summed over the backends (a split request is looked up on both)."""
    hits = sum(s["prefix_cache_hits"] for s in result.engine_stats.values())
    queries = sum(s["prompt_tokens"] for s in result.engine_stats.values())
    return hits / queries if queries else 0.0


def _utilisation(sim: Simulation, result: DesResult) -> dict[str, float]:
    """Per backend: the share of the run (first arrival to last token) its engine spent in steps."""
    span = max(result.makespan_s, 1e-9)
    busy = [core.busy_s if isinstance(core, _TimedCore) else 0.0 for core in sim.engines]
    return {spec.id: round(b / span, 3) for spec, b in zip(sim.specs, busy, strict=True)}


_BOUNDS: dict[tuple[str, int, int], FluidBound] = {}  # per process: (scenario, requests, seed) -> its bound
_SLO_BOUNDS: dict[tuple[str, int, int, Slo], float] = {}  # (scenario, requests, seed, SLO) -> its SLO bound
_DECODE_CEILINGS: dict[tuple[str, int, int, Slo], float] = {}  # the same -> its decode ceiling
_PREFILL_CEILINGS: dict[tuple[str, int, int, Slo], float] = {}  # the same -> its prefill ceiling


def scenario_bound(scenario: Scenario) -> FluidBound:
    key = (scenario.name, len(scenario.requests), scenario.seed)
    if key not in _BOUNDS:
        _BOUNDS[key] = fluid_bound(cluster_named(scenario.cluster), scenario.requests)
    return _BOUNDS[key]


# --- SLO capacity ---------------------------------------------------------------------------------------
def slo_capacity(rows: Sequence[Row]) -> tuple[float, bool]:
    """(capacity, censored): the highest rate with goodput >= GOAL, interpolated up to the first rate that
    misses it; censored when even the highest rate swept meets it (the capacity is at least that). 0 when
    the lowest rate already misses it (nothing below it was measured, so nothing is claimed)."""
    points, k = _first_miss(rows)
    if k is None:
        return points[-1][0] if points else 0.0, True
    if k == 0:
        return 0.0, False
    (last_rate, last_good), (rate, good) = points[k - 1], points[k]
    share = (last_good - GOAL) / (last_good - good)
    return last_rate + share * (rate - last_rate), False


def crossing(rows: Sequence[Row]) -> tuple[float, float] | None:
    """The rates `slo_capacity` interpolates between: the last that meets GOAL before the first that does
    not. None without both (nothing met it, or everything did)."""
    points, k = _first_miss(rows)
    return (points[k - 1][0], points[k][0]) if k else None


def _first_miss(rows: Sequence[Row]) -> tuple[list[tuple[float, float]], int | None]:
    """(rate, goodput) by rate, and the index of the first that misses GOAL (None: none does)."""
    points = sorted((r.rate, r.goodput_frac) for r in rows)
    return points, next((k for k, (_, good) in enumerate(points) if good < GOAL), None)


REFINE_CLOSE = 1.05  # an interval narrower than this (hi/lo) is not bisected further
# One point: scenario, requests, rate, policy, SLO, seed, and whether the router starts calibrated.
Task = tuple[str, int, float, str, Slo, int, bool]


def refinements(plan: Plan, rows: Sequence[Row]) -> list[Task]:
    """One more point per scenario and policy: the middle of its crossing interval, where it is still
    wider than `REFINE_CLOSE`."""
    tasks = []
    for name, policy, seed in sorted({(r.scenario, r.policy, r.seed) for r in rows}):
        found = crossing([r for r in rows if (r.scenario, r.policy, r.seed) == (name, policy, seed)])
        if found is not None and found[1] > REFINE_CLOSE * found[0]:
            rate = round(0.5 * (found[0] + found[1]), 4)
            tasks.append(plan.task(name, rate, policy, seed))
    return tasks


def capacities(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """SLO capacity per scenario x policy, with cost's ratios over round_robin and prefix (same split
    setting, and best of both settings). With repetitions (`Row.seed`), each is taken per repetition,
    whose policies all saw the same requests at the same times; an entry has their mean and their range
    (`capacity_range`, `ratio_range`: [lowest, highest]), a ratio the mean of the paired ratios."""
    table: dict[tuple[str, str, int, str], tuple[float, bool]] = {}
    for key in sorted({(r.scenario, r.mode, r.seed, r.policy) for r in rows}):
        table[key] = slo_capacity([r for r in rows if (r.scenario, r.mode, r.seed, r.policy) == key])
    out = []
    for scenario, mode in sorted({(s, m) for s, m, _, _ in table}):
        seeds = sorted({k for s, m, k, _ in table if (s, m) == (scenario, mode)})
        runs = [
            {p: c for (s, m, k, p), c in table.items() if (s, m, k) == (scenario, mode, seed)}
            for seed in seeds
        ]
        policies = sorted({p for caps in runs for p in caps})
        per_policy = {p: [caps[p][0] for caps in runs if p in caps] for p in policies}
        entry: dict[str, Any] = {
            "scenario": scenario,
            "mode": mode,
            "seeds": seeds,
            "capacity": {p: round(float(np.mean(c)), 4) for p, c in per_policy.items()},
            "capacity_range": {p: [round(min(c), 4), round(max(c), 4)] for p, c in per_policy.items()},
            "censored": sorted(p for p in policies if any(caps[p][1] for caps in runs if p in caps)),
        }
        paired: dict[str, list[float | None]] = {}
        for caps in runs:
            for name, ratio in _ratios(caps).items():
                paired.setdefault(name, []).append(ratio)
        entry["ratios"] = {name: _mean_ratio(r) for name, r in paired.items()}
        entry["ratio_range"] = {name: _ratio_range(r) for name, r in paired.items()}
        out.append(entry)
    return out


def _ratios(caps: dict[str, tuple[float, bool]]) -> dict[str, float | None]:
    """`cost` over round_robin and prefix in one run: per split setting, and best over best; and each
    policy's `auto` over its `never` (the aim: splitting never loses)."""
    ratios: dict[str, float | None] = {}
    for base in ("round_robin", "prefix"):
        for split in ("never", "auto"):
            ratios[f"cost/{base} ({split})"] = _ratio(caps, f"cost/{split}", f"{base}/{split}")
        ratios[f"cost/{base} (best)"] = _best_ratio(caps, "cost", base)
    for policy in ("round_robin", "prefix", "cost"):
        ratios[f"{policy} auto/never"] = _ratio(caps, f"{policy}/auto", f"{policy}/never")
    return ratios


def _mean_ratio(ratios: Sequence[float | None]) -> float | None:
    """The mean of one ratio over the repetitions; None where any repetition has none (neither policy
    met the SLO), infinite where any has an infinite one."""
    if not ratios or any(r is None for r in ratios):
        return None
    return round(float(np.mean([float(r) for r in ratios if r is not None])), 3)


def _ratio_range(ratios: Sequence[float | None]) -> list[float] | None:
    known = [float(r) for r in ratios if r is not None]
    return [min(known), max(known)] if known and len(known) == len(ratios) else None


def _ratio(caps: dict[str, tuple[float, bool]], a: str, b: str) -> float | None:
    if a not in caps or b not in caps:
        return None
    return _divide(caps[a][0], caps[b][0])


def _best_ratio(caps: dict[str, tuple[float, bool]], a: str, b: str) -> float | None:
    best_a = max((c for p, (c, _) in caps.items() if p.startswith(a + "/")), default=None)
    best_b = max((c for p, (c, _) in caps.items() if p.startswith(b + "/")), default=None)
    if best_a is None or best_b is None:
        return None
    return _divide(best_a, best_b)


def _divide(a: float, b: float) -> float | None:
    """a / b; infinite when only b is 0 (the baseline never met the SLO), None when both are."""
    if b > 0:
        return round(a / b, 3)
    return math.inf if a > 0 else None


# --- the sweep ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    scenarios: list[str]
    policies: list[str]
    requests: int
    rate_fracs: tuple[float, ...] = RATE_FRACS
    rates: tuple[float, ...] = ()  # absolute rates, the same for every scenario (overrides rate_fracs)
    slo: Slo = field(default_factory=Slo)
    slo_fracs: tuple[float, ...] = ()  # more rates, as fractions of each scenario's SLO bound
    refine: int = 0  # bisections of each policy's crossing interval after the grid (`refinements`)
    seeds: int = 1  # repetitions of every scenario (`workload`), each swept and refined on its own
    # The `cost` router's roofline starts at the simulated cluster's efficiency instead of its defaults.
    calibrated_router: bool = False

    def task(self, scenario: str, rate: float, policy: str, seed: int) -> Task:
        """One point of this plan, as a simulator process runs it (`_job`)."""
        return (scenario, self.requests, rate, policy, self.slo, seed, self.calibrated_router)


def rates_for(plan: Plan, scenario: Scenario) -> list[float]:
    if plan.rates:
        return list(plan.rates)
    peak = scenario_bound(scenario).requests_per_s
    rates = {round(peak * f, 4) for f in plan.rate_fracs}
    if plan.slo_fracs:
        slo = scenario_slo_bound(scenario, plan.slo)
        rates |= {round(slo * f, 4) for f in plan.slo_fracs if slo > 0}
    return sorted(rates)


def scenario_slo_bound(scenario: Scenario, slo: Slo) -> float:
    key = (scenario.name, len(scenario.requests), scenario.seed, slo)
    if key not in _SLO_BOUNDS:
        cluster = cluster_named(scenario.cluster)
        ttft, tpot = slo.limits(cluster, scenario.requests)
        _SLO_BOUNDS[key] = slo_bound(cluster, scenario.requests, ttft, tpot, GOAL)
    return _SLO_BOUNDS[key]


def scenario_decode_ceiling(scenario: Scenario, slo: Slo) -> float:
    """`bench.decode_ceiling`: the scenario's SLO capacity on its decoders alone, all else ideal."""
    key = (scenario.name, len(scenario.requests), scenario.seed, slo)
    if key not in _DECODE_CEILINGS:
        cluster = cluster_named(scenario.cluster)
        limits = slo.limits(cluster, scenario.requests)
        _DECODE_CEILINGS[key] = decode_ceiling(cluster, scenario, limits, GOAL)
    return _DECODE_CEILINGS[key]


def scenario_prefill_ceiling(scenario: Scenario, slo: Slo) -> float:
    """`bench.prefill_ceiling`: the scenario's SLO capacity on its prefill alone, all else ideal."""
    key = (scenario.name, len(scenario.requests), scenario.seed, slo)
    if key not in _PREFILL_CEILINGS:
        cluster = cluster_named(scenario.cluster)
        ttft_limits, _ = slo.limits(cluster, scenario.requests)
        _PREFILL_CEILINGS[key] = prefill_ceiling(cluster, scenario, ttft_limits, GOAL)
    return _PREFILL_CEILINGS[key]


def _job(args: Task) -> Row:
    name, n, rate, policy, slo, seed, calibrated = args
    return run_des(get_scenario(name, n, seed), rate, policy, slo, calibrated)


@cache
def get_scenario(name: str, n: int, seed: int = 0) -> Scenario:
    return build_scenario(name, n, seed)


def sweep(plan: Plan, jobs: int = 1, progress: Callable[[Row], None] | None = None) -> list[Row]:
    """The grid (every scenario x rate x policy), then `plan.refine` rounds of `refinements`."""
    tasks: list[Task] = []
    for name in plan.scenarios:
        for seed in range(plan.seeds):
            scenario = get_scenario(name, plan.requests, seed)
            for rate in rates_for(plan, scenario):
                tasks += [plan.task(name, rate, policy, seed) for policy in plan.policies]
    rows = _run(tasks, jobs, progress)
    for _ in range(plan.refine):
        more = refinements(plan, rows)
        if not more:
            break
        rows += _run(more, jobs, progress)
    return rows


def _run(tasks: list[Task], jobs: int, progress: Callable[[Row], None] | None) -> list[Row]:
    rows: list[Row] = []
    if jobs <= 1:
        for task in tasks:
            rows.append(_job(task))
            if progress:
                progress(rows[-1])
        return rows
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for row in pool.map(_job, tasks, chunksize=1):
            rows.append(row)
            if progress:
                progress(row)
    return rows


def report(plan: Plan, rows: Sequence[Row]) -> dict[str, Any]:
    bounds, slo_bounds, ceilings, prefill_ceilings = {}, {}, {}, {}
    for name in plan.scenarios:  # over the repetitions, the mean (a trace's windows differ)
        scenarios = [get_scenario(name, plan.requests, seed) for seed in range(plan.seeds)]
        fluid = [scenario_bound(s) for s in scenarios]
        bounds[name] = {
            "requests_per_s": round(float(np.mean([b.requests_per_s for b in fluid])), 4),
            "output_tok_per_s": round(float(np.mean([b.output_tok_per_s for b in fluid])), 2),
        }
        slo_bounds[name] = round(float(np.mean([scenario_slo_bound(s, plan.slo) for s in scenarios])), 4)
        ceiling = float(np.mean([scenario_decode_ceiling(s, plan.slo) for s in scenarios]))
        ceilings[name] = round(ceiling, 4) if math.isfinite(ceiling) else None  # None: never decode-bound
        ceiling = float(np.mean([scenario_prefill_ceiling(s, plan.slo) for s in scenarios]))
        prefill_ceilings[name] = round(ceiling, 4) if math.isfinite(ceiling) else None
    return {
        "plan": {
            "scenarios": plan.scenarios,
            "policies": plan.policies,
            "requests": plan.requests,
            "rate_fracs": list(plan.rate_fracs),
            "rates": list(plan.rates),
            "slo": asdict(plan.slo),
            "goal": GOAL,
            "seeds": plan.seeds,
            "router_efficiency": "cluster" if plan.calibrated_router else "default",
        },
        "fluid_bound": bounds,
        "slo_bound": slo_bounds,  # requests/s: no policy's steady state serves more within the SLO
        # requests/s on the decoders alone, prefill and transfer free (`bench.decode_ceiling`): an
        # estimate that, unlike the bounds, sees requests arriving in groups
        "decode_ceiling": ceilings,
        # requests/s on the prefill alone, decoding free (`bench.prefill_ceiling`); None as above
        "prefill_ceiling": prefill_ceilings,
        "rows": [asdict(r) for r in rows],
        "capacity": _against_limits(
            _flag_transients(capacities(rows), slo_bounds),
            {"SLO bound": slo_bounds, "decode ceiling": ceilings, "prefill ceiling": prefill_ceilings},
        ),
    }


def _flag_transients(entries: list[dict[str, Any]], slo_bounds: dict[str, float]) -> list[dict[str, Any]]:
    """Name the policies whose SLO capacity lies above the scenario's SLO bound: no steady state serves
    that rate, so the run ended before the queue it builds showed (too few requests for that rate)."""
    for entry in entries:
        bound = slo_bounds.get(entry["scenario"], float("inf"))
        entry["above_slo_bound"] = sorted(p for p, c in entry["capacity"].items() if c > bound)
    return entries


AIMS = (("2x round_robin", "round_robin", 2.0), ("1.3x prefix", "prefix", 1.3))  # issue 8's capacity aims


def _against_limits(
    entries: list[dict[str, Any]], limits: Mapping[str, Mapping[str, float | None]]
) -> list[dict[str, Any]]:
    """Put each capacity aim beside the lowest of the scenario's limits (the SLO bound and the two
    ceilings): `lowest_limit` (its name and requests/s), `cost`'s best capacity as a share of it, and
    per aim the capacity it needs, whether `cost` has it, and that capacity as a share of the limit
    (above 1: no router reaches it, as far as the limits tell)."""
    for entry in entries:
        known = {n: x for n, v in limits.items() if (x := v.get(entry["scenario"])) is not None}
        caps = entry["capacity"]
        cost = _best(caps, "cost")
        if not known or cost is None:
            continue
        name = min(known, key=known.__getitem__)
        lowest = known[name]
        entry["lowest_limit"] = {"name": name, "requests_per_s": lowest}
        entry["cost_share_of_lowest"] = round(cost / lowest, 3)
        aims = {}
        for aim, base, factor in AIMS:
            baseline = _best(caps, base)
            if baseline is not None:
                needs = factor * baseline
                aims[aim] = {
                    "needs": round(needs, 4),
                    "met": cost >= needs,
                    "share": round(needs / lowest, 3),
                }
        entry["aims"] = aims
    return entries


def _best(caps: dict[str, float], family: str) -> float | None:
    """The best capacity among a policy family's split settings (`cost/never`, `cost/auto`, ...)."""
    return max((c for p, c in caps.items() if p.startswith(family + "/")), default=None)


# --- output ---------------------------------------------------------------------------------------------
def print_report(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    rows = data["rows"]
    table = Table(title="policies: one row per scenario x rate x policy", show_lines=False)
    columns = (
        "scenario mode rate xbound policy tok/s bound goodput ttft_p50 p90 p99 tpot_p90 hit pd "
        "ttft/pred tpot/pred util"
    )
    for col in columns.split():
        table.add_column(col, justify="left" if col in ("scenario", "policy", "mode", "util") else "right")
    for r in rows:
        bound = data["fluid_bound"][r["scenario"]]["output_tok_per_s"]
        util = " ".join(f"{v:.2f}" for v in r["utilisation"].values())
        table.add_row(
            r["scenario"], r["mode"], f"{r['rate']:.3g}", f"{r['rate_frac']:.2f}", r["policy"],
            f"{r['output_tok_per_s']:.0f}", f"{bound:.0f}", f"{r['goodput_frac']:.2f}",
            f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p90_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
            f"{r['tpot_p90_s'] * 1000:.0f}ms", f"{r['prefix_hit_rate']:.2f}", f"{r['pd_share']:.2f}",
            _fmt(r.get("ttft_over_predicted_p50")), _fmt(r.get("tpot_over_predicted_p50")), util,
        )  # fmt: skip
    console.print(table)
    cap = Table(
        title=f"SLO capacity (requests/s at which >= {GOAL:.0%} meet the SLO; * = at least, never missed; "
        "! = above the SLO bound: a transient, too few requests for that rate)"
    )
    named = data["plan"]["policies"]
    # External routers (`--target`) have their own mode and column.
    policies = named + sorted({p for e in data["capacity"] for p in e["capacity"]} - set(named))
    cap.add_column("scenario")
    cap.add_column("mode")
    for p in policies:
        cap.add_column(p, justify="right")
    cap.add_column("cost/rr best", justify="right")
    cap.add_column("cost/prefix best", justify="right")
    cap.add_column("cost auto/never", justify="right")
    cap.add_column("SLO bound", justify="right")
    cap.add_column("decode ceiling", justify="right")
    cap.add_column("prefill ceiling", justify="right")
    for entry in data["capacity"]:
        spans, ratios = entry.get("capacity_range", {}), entry["ratios"]
        cells = [
            f"{entry['capacity'][p]:.3g}{_span(spans.get(p), '.3g')}{'*' if p in entry['censored'] else ''}"
            f"{'!' if p in entry.get('above_slo_bound', ()) else ''}"
            if p in entry["capacity"]
            else "-"
            for p in policies
        ]
        best = [
            _fmt(ratios.get(name)) + _span(entry.get("ratio_range", {}).get(name), ".2f")
            for name in ("cost/round_robin (best)", "cost/prefix (best)", "cost auto/never")
        ]
        cap.add_row(
            entry["scenario"], entry["mode"], *cells, *best,
            f"{data.get('slo_bound', {}).get(entry['scenario'], float('nan')):.3g}",
            _fmt(data.get("decode_ceiling", {}).get(entry["scenario"]), ".3g"),
            _fmt(data.get("prefill_ceiling", {}).get(entry["scenario"]), ".3g"),
        )  # fmt: skip
    console.print(cap)
    _print_aims(console, data["capacity"])
    if data["plan"].get("seeds", 1) > 1:
        console.print(
            f"Means over {data['plan']['seeds']} repetitions (lowest-highest); a ratio is the mean of "
            "the ratios within each repetition."
        )


def _print_aims(console: Any, entries: list[dict[str, Any]]) -> None:
    """Issue 8's capacity aims beside the lowest limit (`_against_limits`)."""
    from rich.table import Table

    rows = [e for e in entries if "aims" in e]
    if not rows:
        return
    table = Table(title="aims against the lowest limit (met, or what they need as a share of the limit)")
    for col in ("scenario", "lowest limit", "cost/lowest", *(aim for aim, _, _ in AIMS)):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for e in rows:
        limit = e["lowest_limit"]
        cells = [
            "-" if aim not in e["aims"] else "met" if e["aims"][aim]["met"]
            else f"{e['aims'][aim]['needs']:.3g}, {e['aims'][aim]['share']:.0%}"
            for aim, _, _ in AIMS
        ]  # fmt: skip
        lowest = f"{limit['requests_per_s']:.3g} ({limit['name']})"
        table.add_row(e["scenario"], lowest, f"{e['cost_share_of_lowest']:.2f}", *cells)
    console.print(table)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else f"{x:{spec}}"


def _span(span: Sequence[float] | None, spec: str) -> str:
    """` (lo-hi)` where repetitions disagree, else nothing."""
    if not span or span[0] == span[1]:
        return ""
    return f" ({span[0]:{spec}}-{span[1]:{spec}})"


def plot(data: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["scenario"], r["mode"]) for r in data["rows"]})
    cols = min(3, len(groups))
    nrows = -(-len(groups) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False)
    for ax, (scenario, mode) in zip(axes.flat, groups, strict=False):
        for policy in data["plan"]["policies"]:
            pts = sorted(
                (r["rate"], r["goodput_frac"])
                for r in data["rows"]
                if (r["scenario"], r["mode"], r["policy"]) == (scenario, mode, policy)
            )
            if pts:
                style = "--" if policy.endswith("/auto") else "-"
                ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=policy)
        ax.axhline(GOAL, color="grey", lw=0.8)
        ax.set_title(f"{scenario} ({mode})", fontsize=9)
        ax.set_xlabel("requests/s")
        ax.set_ylabel("share meeting the SLO")
        ax.set_ylim(0, 1.05)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetgate bench policies", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a CI-sized subset (6 scenarios, 6 rates, 50 requests)")
    add("--scenarios", default=None, help="comma-separated names (default: all; see --list)")
    add("--list", action="store_true", help="print the scenario names and exit")
    add("--policies", default=",".join(POLICIES), help="comma-separated policy/disaggregation pairs")
    add("--rates", default=None, help="comma-separated absolute rates (requests/s) for every scenario")
    add("--rate-fracs", default=None, help="comma-separated fractions of each scenario's fluid bound")
    add("--requests", type=int, default=None, help="requests per point (default 300; --quick 50)")
    add(
        "--refine",
        type=int,
        default=None,
        help="bisections of each policy's SLO-capacity interval after the grid (default 2; --quick: 0)",
    )
    add(
        "--trace",
        action="append",
        default=[],
        help="a Mooncake or Azure trace file, replayed on every cluster",
    )
    add("--slo-ttft-s", type=float, default=None, help="TTFT limit (default: 5x the prompt's unloaded TTFT)")
    add("--slo-tpot-s", type=float, default=None, help="TPOT limit (default: 3x the unloaded TPOT)")
    add(
        "--router-efficiency",
        choices=("default", "cluster"),
        default="default",
        help="where the cost router's roofline starts: the cost model's defaults (it learns the rest "
        "online, as a gateway does) or the simulated cluster's own efficiency (a router calibrated "
        "beforehand, `routing.cost` in its config); the simulator always runs the cluster's",
    )
    add("--json", default=None, help="write rows, capacities and bounds to this file")
    add("--plot", default=None, help="draw goodput vs rate per policy (PNG)")
    add("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel simulator processes")
    add(
        "--http",
        action="store_true",
        help="also through the real gateway and `hetgate sim` backends, compared with the DES "
        "(default: seed case, 12 requests, 0.3x the bound)",
    )
    add("--time-scale", type=float, default=1.0, help="--http: simulated seconds per wall second")
    add(
        "--target",
        action="append",
        default=[],
        help="--http: NAME=URL of an external router to compare, or NAME=COMMAND to start it per point "
        "({port}, {workers} filled in)",
    )
    add(
        "--seeds",
        type=int,
        default=1,
        help="repetitions of every scenario: arrivals drawn anew, or a trace's next --requests window "
        "(capacities and ratios: mean and range)",
    )
    add("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(list(argv))


def plan_from(args: argparse.Namespace) -> Plan:
    fracs: tuple[float, ...]
    if args.http and not args.quick:  # real processes in real time: a short check, not a sweep
        scenarios, requests, fracs = ["seed"], args.requests or 12, (0.3,)
    elif args.quick:
        scenarios = list(QUICK_SCENARIOS) + [f"trace:{t}@amd" for t in args.trace]
        requests, fracs = args.requests or 50, QUICK_RATE_FRACS
    else:
        scenarios, requests, fracs = scenario_names(args.trace), args.requests or 300, RATE_FRACS
    # A full sweep on its default grid also samples each scenario's SLO bound.
    slo_fracs = SLO_RATE_FRACS if not (args.http or args.quick or args.rate_fracs or args.rates) else ()
    if args.scenarios:
        scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    known = set(scenario_names(args.trace))
    unknown = [s for s in scenarios if s not in known and not s.startswith("trace:")]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(unknown)}; try --list")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policy {', '.join(bad)}; choose from {', '.join(POLICIES)}")
    if args.rate_fracs:
        fracs = tuple(float(x) for x in args.rate_fracs.split(","))
    rates = tuple(float(x) for x in args.rates.split(",")) if args.rates else ()
    slo = Slo(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s)
    refine = args.refine if args.refine is not None else (0 if args.http or args.quick else 2)
    if args.seeds < 1 or (args.http and args.seeds > 1):
        raise SystemExit("--seeds takes a count of at least 1, and more than 1 only without --http")
    calibrated = args.router_efficiency == "cluster"
    if args.http and calibrated:
        raise SystemExit("--router-efficiency cluster is for the simulator's sweeps, not --http")
    return Plan(scenarios, policies, requests, fracs, rates, slo, slo_fracs, refine, args.seeds, calibrated)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        print("\n".join(scenario_names(args.trace)))
        return 0
    plan = plan_from(args)
    started = time.perf_counter()

    def progress(row: Row) -> None:
        if not args.quiet:
            print(
                f"  {row.scenario:<22} {row.policy:<18} rate {row.rate:8.3g} ({row.rate_frac:.2f}x bound): "
                f"{row.output_tok_per_s:9.1f} tok/s, goodput {row.goodput_frac:.2f}",
                file=sys.stderr,
                flush=True,
            )

    agreements: list[dict[str, Any]] = []
    if args.http:
        from bench.policies_http import agreement, http_sweep

        rows = http_sweep(plan, args.time_scale, args.target, progress)
        des = sweep(plan, args.jobs, progress)  # the same points in the simulator, to compare
        by_point = {(r.scenario, r.rate, r.policy): r for r in des}
        for h in rows:
            d = by_point.get((h.scenario, h.rate, h.policy))
            if d is not None:
                point = {"scenario": h.scenario, "rate": h.rate, "policy": h.policy}
                agreements.append({**point, **agreement(d, h)})
        rows += des
    else:
        rows = sweep(plan, args.jobs, progress)
    data = report(plan, rows)
    if agreements:
        data["http_vs_des"] = agreements
    data["wall_s"] = round(time.perf_counter() - started, 1)
    print_report(data)
    for a in agreements:
        figures = ", ".join(f"{k} {v:.1%}" for k, v in a.items() if isinstance(v, float) and k != "rate")
        print(f"HTTP vs DES, {a['scenario']} {a['policy']} at {a['rate']:.3g}/s: {figures}")
    print(f"{len(rows)} rows in {data['wall_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
