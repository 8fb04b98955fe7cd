"""The prefill ceiling: the SLO capacity of a cluster's prefill alone, with everything else ideal.

The decode ceiling (`bench.decode_ceiling`) makes prefill free and asks what the decoders allow. This
is its mirror: decoding is free, and the question is how many prompts the cluster can prefill within
their TTFT limits when they arrive as the scenario has them (in groups, in bursts of long prompts, as
turns of conversations that find their earlier turns cached). Where the TTFT limit is tight (5x the
prompt's unloaded prefill on the fastest backend) and the slow backends prefill more than 5x slower,
only the fast ones can take a long prompt in time, and a burst of them queues there.

A replay of the scenario at a given rate where:
- decoding takes no time and holds up no prefill; a request is done when its prefill ends, and that is
  its TTFT;
- every backend may prefill, decode-only ones included (they serve requests whole);
- a prefill takes its arithmetic alone (`scoring.cost.prefill_compute_time`: no weight reads, no fixed
  costs per step), which no batching of prompts beats; each backend prefills one prompt after another,
  first come first served, so the first of a group is not held up by the rest, as it is in a shared step;
- the prefix cache is ideal: once a prefill ends, its prompt is cached on every backend, for good (free
  transfer, no eviction), at the workload's block granularity with a partial last block included;
- each request goes to the backend where its prefill would end first;
- a request that would miss its TTFT limit on every backend is counted as missed and costs nothing: a
  router has to serve it somewhere, so leaving it out can only raise the ceiling.

Its SLO capacity (the highest rate at which >= 90 % of the requests meet their TTFT limit, bisected)
is an estimate, not a proof: holding requests back, or ordering a backend's queue by deadline, could do
better than first come first served. What it shows, beside the decode ceiling, is whether an aim is
out of reach for the prefill a cluster can do at all.

`python -m bench.prefill_ceiling --scenarios seed,azure-code@amd --requests 1000`
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.clusters import Cluster
from bench.rate_search import Arrivals, ceiling_command, highest_rate
from bench.workloads import Prompt
from scoring.cost import StepCoefficients


@dataclass(slots=True)
class _Cache:
    """The ideal prefix cache: per chain of the workload's blocks (a prompt's first j blocks), the
    prefills that computed it, as (when it ended, how many tokens of the chain it covered)."""

    computed: dict[tuple[int, ...], list[tuple[float, int]]] = field(default_factory=dict)

    @staticmethod
    def chains(prompt: Prompt) -> list[tuple[int, ...]]:
        blocks = -(-prompt.length // prompt.block_tokens)
        return [prompt.blocks[: j + 1] for j in range(blocks)]

    def cached(self, chains: list[tuple[int, ...]], prompt_len: int, at: float) -> int:
        """The tokens of a prompt cached at time `at` (the last one is always computed, as vLLM does)."""
        best = 0
        for chain in chains:
            covered = [tokens for ended, tokens in self.computed.get(chain, ()) if ended <= at]
            if not covered:
                break
            best = max(best, *covered)
        return min(best, prompt_len - 1)

    def add(self, chains: list[tuple[int, ...]], prompt: Prompt, ended: float) -> None:
        for j, chain in enumerate(chains):
            covered = min((j + 1) * prompt.block_tokens, prompt.length)
            self.computed.setdefault(chain, []).append((ended, covered))


def prefill_goodput(cluster: Cluster, scenario: Arrivals, rate: float, ttft_limits: np.ndarray) -> float:
    """The share of the scenario's requests, arriving at `rate`, whose prefill ends within their TTFT
    limit (`ttft_limits`, per request of the scenario) on the cluster's prefill alone (module docstring)."""
    requests = scenario.at_rate(rate)
    order = np.argsort([r.arrival_s for r in requests], kind="stable")
    coefficients = StepCoefficients.of(cluster.model, cluster.hardware(), cluster.efficiency)
    free_at = np.zeros(len(cluster.backends))
    cache = _Cache()
    met = 0
    for i in order:
        request = requests[i]
        chains = _Cache.chains(request.prompt)
        start = np.maximum(free_at, request.arrival_s)
        cached = np.array([cache.cached(chains, request.prompt_len, float(t)) for t in start], dtype=float)
        new = request.prompt_len - cached
        ends = start + coefficients.prefill_compute(new, cached)
        b = int(np.argmin(ends))
        if ends[b] - request.arrival_s <= ttft_limits[i]:
            met += 1
            free_at[b] = ends[b]
            cache.add(chains, request.prompt, float(ends[b]))
    return met / len(requests)


def prefill_ceiling(cluster: Cluster, scenario: Arrivals, ttft_limits: np.ndarray, goal: float) -> float:
    """The highest rate, in requests per second, at which `goal` of the scenario's requests meet their
    TTFT limits on the cluster's prefill alone (`prefill_goodput`); infinite where they meet them even
    all at once."""
    return highest_rate(lambda rate: prefill_goodput(cluster, scenario, rate, ttft_limits), goal)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.policies import Slo, get_scenario, scenario_prefill_ceiling

    def ceiling_of(name: str, requests: int, seed: int) -> float:
        return scenario_prefill_ceiling(get_scenario(name, requests, seed), Slo())

    doc = __doc__ or ""
    return ceiling_command(argv, "python -m bench.prefill_ceiling", doc, "prefill ceiling", ceiling_of)


if __name__ == "__main__":
    sys.exit(main())
