"""`hetgate plan --config CLUSTER.yaml --trace FILE`: which role each backend should play for this traffic.

Every assignment of roles (prefill, decode, both) to the config's backends that leaves at least one
backend able to prefill and one able to decode is priced by the cost model's SLO bound and fluid bound
(bench/clusters.py) on the trace's requests. The best few by SLO bound are then replayed in the
discrete-event simulator (the real router, `--policy`, default cost/auto) at fractions of both bounds,
and each gets an SLO capacity: the highest request rate at which >= 90 % of requests meet the SLO
(defaults as in `hetgate bench policies`). The recommendation is the assignment with the highest SLO
capacity (then the highest throughput); the table shows, per assignment, the predicted goodput (output
tokens/s within the SLO), throughput at the highest rate tried and the bounds beside them; below it,
where the recommended assignment's SLO bound prefills and decodes the requests (`slo_plan`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench import workloads as w
from bench.clusters import Cluster, fluid_bound, load_cluster, slo_plan
from bench.policies import (
    GOAL,
    SLO_RATE_FRACS,
    Row,
    Scenario,
    Slo,
    des_outcome,
    make_router,
    row_from,
    slo_capacity,
)
from bench.sim.des import Simulation
from scoring.types import Role

ROLE_CHOICES = {
    "both": frozenset({Role.PREFILL, Role.DECODE}),
    "prefill": frozenset({Role.PREFILL}),
    "decode": frozenset({Role.DECODE}),
}
RATE_FRACS = (0.05, 0.1, 0.2, 0.4, 0.7, 1.0)  # of each assignment's bound, as the benchmark's grid
MAX_ASSIGNMENTS = 729  # 3^6: beyond six backends the search is left to a smarter planner


@dataclass(slots=True)
class Assessment:
    roles: dict[str, str]
    bound_requests_per_s: float
    bound_output_tok_per_s: float
    slo_bound_requests_per_s: float = 0.0  # no policy's steady state serves more within the SLO
    # One plan that reaches the SLO bound: each backend's share of the requests' prefills and decodes
    # (`bench.clusters.SloPlan`).
    slo_bound_prefills: dict[str, float] = field(default_factory=dict)
    slo_bound_decodes: dict[str, float] = field(default_factory=dict)
    slo_capacity_requests_per_s: float = 0.0
    capacity_censored: bool = False
    goodput_output_tok_per_s: float = 0.0  # output tokens/s of the requests that met the SLO, at capacity
    throughput_output_tok_per_s: float = 0.0  # at the highest rate tried
    simulated: bool = False
    current: bool = False  # the roles the config file has now


def role_name(roles: frozenset[Role]) -> str:
    return next(name for name, r in ROLE_CHOICES.items() if r == roles)


def assignments(cluster: Cluster) -> list[tuple[frozenset[Role], ...]]:
    n = len(cluster.backends)
    if 3**n > MAX_ASSIGNMENTS:
        raise ValueError(f"{n} backends: too many role assignments to try (at most 6 backends)")
    out = []
    for combo in itertools.product(ROLE_CHOICES.values(), repeat=n):
        if any(Role.PREFILL in r for r in combo) and any(Role.DECODE in r for r in combo):
            out.append(combo)
    return out


def assess(
    cluster: Cluster,
    requests: Sequence[w.WorkloadRequest],
    policy: str,
    slo: Slo,
    top: int,
    fracs: Sequence[float] = RATE_FRACS,
) -> list[Assessment]:
    """Every assignment by SLO bound (then fluid bound); the `top` best and the config's own also through
    the simulator."""
    scored = []
    now = tuple(b.spec.roles for b in cluster.backends)
    ttft, tpot = slo.limits(cluster, requests)  # relative to the fastest hardware, whatever its roles
    for roles in assignments(cluster):
        candidate = cluster.with_roles(roles)
        bound = fluid_bound(candidate, requests)
        names = {b.spec.id: role_name(r) for b, r in zip(cluster.backends, roles, strict=True)}
        assessment = Assessment(names, bound.requests_per_s, bound.output_tok_per_s, current=roles == now)
        at_bound = slo_plan(candidate, requests, ttft, tpot, GOAL)
        assessment.slo_bound_requests_per_s = at_bound.requests_per_s
        assessment.slo_bound_prefills, assessment.slo_bound_decodes = at_bound.prefills, at_bound.decodes
        scored.append((candidate, assessment))
    # Ties in bound (a backend given both roles is never bounded lower) go to fewer roles: simpler to run.
    scored.sort(
        key=lambda x: (
            -round(x[1].slo_bound_requests_per_s, 3),
            -round(x[1].bound_requests_per_s, 3),
            _roles_count(x[1]),
        )
    )
    for k, (candidate, assessment) in enumerate(scored):
        if k < top or assessment.current:
            _simulate(candidate, requests, policy, (ttft, tpot), fracs, assessment)
    return [a for _, a in scored]


def _roles_count(a: Assessment) -> int:
    return sum(2 if r == "both" else 1 for r in a.roles.values())


def _simulate(
    cluster: Cluster,
    requests: Sequence[w.WorkloadRequest],
    policy: str,
    limits: tuple[np.ndarray, np.ndarray],
    fracs: Sequence[float],
    out: Assessment,
) -> None:
    """Replay `cluster` at the rates of both bounds; `limits` per request (TTFT, TPOT) as `Slo.limits`
    gives them, the same for every assignment."""
    scenario = Scenario("plan", cluster.name, tuple(requests), "trace")
    bound = fluid_bound(cluster, requests)
    # The fluid grid, and the SLO bound's where the SLO binds far below it.
    rates = {bound.requests_per_s * f for f in fracs} | {
        out.slo_bound_requests_per_s * f for f in SLO_RATE_FRACS
    }
    rows: list[Row] = []
    for rate in sorted(r for r in rates if r > 0):
        sim = Simulation(cluster.model, cluster.backends, make_router(cluster, policy), cluster.efficiency)
        result = sim.run(scenario.at_rate(rate))
        outcomes = [des_outcome(r) for r in result.records]
        extra = {"prefix_hit_rate": 0.0, "utilisation": {}, "wall_s": 0.0}
        rows.append(row_from(scenario, "des", rate, bound, policy, outcomes, limits, extra, cluster.ids))
    capacity, censored = slo_capacity(rows)
    passing = [r for r in rows if r.rate <= capacity + 1e-9]
    at_capacity = max(passing, key=lambda r: r.rate) if passing else None
    out.slo_capacity_requests_per_s = capacity
    out.capacity_censored = censored
    out.goodput_output_tok_per_s = (
        at_capacity.output_tok_per_s * at_capacity.goodput_frac if at_capacity else 0.0
    )
    out.throughput_output_tok_per_s = rows[-1].output_tok_per_s
    out.simulated = True


def recommend(assessed: Sequence[Assessment]) -> Assessment:
    simulated = [a for a in assessed if a.simulated] or list(assessed)
    return max(simulated, key=lambda a: (a.slo_capacity_requests_per_s, a.throughput_output_tok_per_s))


def print_plan(config: str, assessed: Sequence[Assessment], best: Assessment, shown: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    ids = list(best.roles)
    table = Table(title=f"hetgate plan: {config} (top {shown} by SLO bound; simulated ones first)")
    table.add_column("")
    for bid in ids:
        table.add_column(bid)
    columns = ("SLO capacity req/s", "SLO bound req/s", "goodput tok/s", "throughput tok/s", "bound req/s",
               "bound tok/s")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    ordered = sorted(assessed, key=lambda a: (not a.simulated, -a.slo_capacity_requests_per_s))[:shown]
    for a in ordered:
        mark = "*" if a.capacity_censored else ""
        sim = a.simulated
        table.add_row(
            "config" if a.current else "",
            *[a.roles[b] for b in ids],
            f"{a.slo_capacity_requests_per_s:.3g}{mark}" if sim else "-",
            f"{a.slo_bound_requests_per_s:.3g}",
            f"{a.goodput_output_tok_per_s:.0f}" if sim else "-",
            f"{a.throughput_output_tok_per_s:.0f}" if sim else "-",
            f"{a.bound_requests_per_s:.3g}",
            f"{a.bound_output_tok_per_s:.0f}",
        )
    console.print(table)
    roles = ", ".join(f"{b}: {r}" for b, r in best.roles.items())
    console.print(f"[bold]recommended roles[/bold]: {roles}")
    console.print(f"at its SLO bound, one plan {_shares(best)}")
    console.print(
        f"predicted: SLO capacity {best.slo_capacity_requests_per_s:.3g} requests/s"
        f"{' (at least: never missed)' if best.capacity_censored else ''}, goodput "
        f"{best.goodput_output_tok_per_s:.0f} output tok/s within the SLO, throughput "
        f"{best.throughput_output_tok_per_s:.0f} tok/s at the highest rate tried; SLO bound "
        f"{best.slo_bound_requests_per_s:.3g} requests/s; fluid bound "
        f"{best.bound_output_tok_per_s:.0f} tok/s ({best.bound_requests_per_s:.3g} requests/s)"
    )


def _shares(a: Assessment) -> str:
    """Where the SLO bound's plan prefills and decodes, as shares of the requests served."""

    def listed(shares: dict[str, float]) -> str:
        return ", ".join(f"{b} {share:.0%}" for b, share in shares.items())

    return f"prefills on {listed(a.slo_bound_prefills)}; decodes on {listed(a.slo_bound_decodes)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetgate plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="gateway config of the cluster (its first model)")
    parser.add_argument("--trace", required=True, help="Mooncake (JSON lines) or Azure (CSV) trace")
    parser.add_argument("--requests", type=int, default=200, help="requests of the trace to replay")
    parser.add_argument("--policy", default="cost/auto", help="policy/disaggregation the router runs")
    parser.add_argument("--top", type=int, default=4, help="assignments to simulate (best by SLO bound)")
    parser.add_argument("--slo-ttft-s", type=float, default=None)
    parser.add_argument("--slo-tpot-s", type=float, default=None)
    parser.add_argument("--json", default=None, help="write every assessment to this file")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        cluster = load_cluster(args.config, Path(args.config).stem)
        requests = w.load_trace(args.trace, limit=args.requests)
        assessed = assess(cluster, requests, args.policy, Slo(args.slo_ttft_s, args.slo_tpot_s), args.top)
    except (OSError, ValueError) as err:
        print(f"hetgate plan: {err}", file=sys.stderr)
        return 2
    best = recommend(assessed)
    print_plan(args.config, assessed, best, max(args.top, 8))
    if args.json:
        data = {"recommended": asdict(best), "assessments": [asdict(a) for a in assessed]}
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
