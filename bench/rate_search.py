"""The highest request rate at which a replay meets a goal: shared by the ceilings
(`bench.decode_ceiling`, `bench.prefill_ceiling`), each of which replays a scenario with one part of
the serving made ideal."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from bench.workloads import WorkloadRequest

if TYPE_CHECKING:
    from bench.policies import Scenario, Slo

_BISECT_STEPS = 12  # the capacity to ~0.05 % of the first bracket
_ALL_AT_ONCE = 1e12  # requests/s: every request within a nanosecond


class Arrivals(Protocol):
    """A workload whose arrivals can be set to a rate (`bench.policies.Scenario`)."""

    def at_rate(self, rate: float) -> list[WorkloadRequest]: ...


def highest_rate(goodput_at: Callable[[float], float], goal: float) -> float:
    """The highest rate, in requests per second, at which `goodput_at(rate)` (the share of requests
    meeting their SLO) reaches `goal`: doubled from 1 until it misses, then bisected. Infinite where
    the requests meet it even all at once (too few of them to fill what the replay models)."""
    if goodput_at(_ALL_AT_ONCE) >= goal:
        return math.inf
    lo, hi = 0.0, 1.0
    while goodput_at(hi) >= goal:
        lo, hi = hi, hi * 2.0
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2.0
        if goodput_at(mid) >= goal:
            lo = mid
        else:
            hi = mid
    return lo


def ceiling_command(
    argv: Sequence[str] | None, prog: str, doc: str, what: str, ceiling_of: Callable[[Scenario, Slo], float]
) -> int:
    """The command line of a ceiling module: `ceiling_of(scenario, Slo())` (`bench.policies`'
    `scenario_decode_ceiling` or `scenario_prefill_ceiling`) for each scenario named, printed as
    `<scenario> <what> <ceiling> requests/s`, and optionally written as JSON."""
    from bench.policies import Slo, get_scenario  # not at import: bench.policies imports the ceilings

    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument(
        "--scenarios", required=True, help="comma-separated, as `hetgate bench policies` names them"
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--seed", type=int, default=0, help="the repetition (`hetgate bench policies --seeds`)"
    )
    parser.add_argument("--json", help="also write {scenario: ceiling} here")
    args = parser.parse_args(argv)
    ceilings = {}
    for name in args.scenarios.split(","):
        ceilings[name] = round(ceiling_of(get_scenario(name, args.requests, args.seed), Slo()), 3)
        print(f"{name:20s} {what} {ceilings[name]:8.3f} requests/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ceilings, f, indent=1)
    return 0
