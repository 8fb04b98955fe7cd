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
- each backend prefills as vLLM schedules it: first come first served, in steps of
  `max_num_batched_tokens` (a long prompt in chunks, short ones sharing a step, all of a step's prompts
  done at its end), each step timed by the step formula at the benchmark's efficiency (weights read
  once per step);
- the prefix cache is ideal: once a prefill ends, its prompt is cached on every backend, for good (free
  transfer, no eviction), at the workload's block granularity with a partial last block included;
- each request goes to the backend where its prefill would end first, given what is queued there;
- a request that would miss its TTFT limit on every backend is counted as missed and costs nothing: a
  router has to serve it somewhere, so leaving it out can only raise the ceiling.

Its SLO capacity (the highest rate at which >= 90 % of the requests meet their TTFT limit, bisected)
is an estimate, not a proof: holding requests back, or ordering a backend's queue by deadline, could do
better than first come first served. What it shows, beside the decode ceiling, is whether an aim is
out of reach for the prefill a cluster can do at all.

`python -m bench.prefill_ceiling --scenarios seed,azure-code@amd --requests 1000`
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from bench.clusters import MAX_NUM_BATCHED_TOKENS, Cluster
from bench.rate_search import Arrivals, ceiling_command, highest_rate
from bench.workloads import Prompt
from scoring.cost import ScalarStepTime, causal_pairs


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


@dataclass(slots=True)
class _Queued:
    """A prompt on a backend's prefill queue."""

    index: int  # in the scenario's order
    left: int  # tokens still to prefill
    done: int  # tokens already in its KV (cached or prefilled in earlier chunks)


_Step = tuple[float, float, list[_Queued]]  # a planned step: start, end, the queue left after it


@dataclass(slots=True)
class _Prefiller:
    """One backend's prefill in the replay: FCFS chunked prefill, steps of `budget` tokens, each timed
    by the step formula (`ScalarStepTime`). `queue` is what waits at `free_at`, when the last step that
    began before the latest arrival ends; the steps after it are re-planned with every arrival, since a
    prompt joining the last step lengthens it for the prompts already in it, as in vLLM."""

    step_s: ScalarStepTime
    budget: int
    free_at: float = 0.0
    queue: list[_Queued] = field(default_factory=list)

    def plan(self, queue: list[_Queued], start: float) -> tuple[list[_Step], dict[int, float]]:
        """The steps that drain `queue` from time `start` with no further arrivals, and when each
        prompt's last chunk ends."""
        queue = [replace(q) for q in queue]
        steps: list[_Step] = []
        ends: dict[int, float] = {}
        t = start
        while queue:
            budget, pairs, tokens, finished = self.budget, 0.0, 0, []
            for q in queue:
                n = min(q.left, budget)
                if n <= 0:
                    break
                pairs += float(causal_pairs(n, q.done))
                tokens, budget = tokens + n, budget - n
                q.left, q.done = q.left - n, q.done + n
                if q.left == 0:
                    finished.append(q.index)
            end = t + self.step_s(tokens, pairs, 0, 0)
            ends.update(dict.fromkeys(finished, end))
            queue = [q for q in queue if q.left > 0]
            steps.append((t, end, [replace(q) for q in queue]))  # a snapshot: later steps go on
            t = end
        return steps, ends

    def commit(self, now: float) -> None:
        """Fix the steps that begin before `now`: they run as planned whatever arrives later."""
        steps, _ = self.plan(self.queue, self.free_at)
        for start, end, left in steps:
            if start >= now:
                break
            self.free_at, self.queue = end, left

    def start_at(self, now: float) -> float:
        """When a prompt arriving `now` could be in a step: the next step boundary, or now if idle."""
        return self.free_at if self.queue else max(self.free_at, now)

    def add(self, prompt: _Queued, now: float) -> None:
        self.free_at = self.start_at(now)
        self.queue.append(prompt)


def prefill_goodput(cluster: Cluster, scenario: Arrivals, rate: float, ttft_limits: np.ndarray) -> float:
    """The share of the scenario's requests, arriving at `rate`, whose prefill ends within their TTFT
    limit (`ttft_limits`, per request of the scenario) on the cluster's prefill alone (module docstring)."""
    requests = scenario.at_rate(rate)
    order = np.argsort([r.arrival_s for r in requests], kind="stable")
    hw = cluster.hardware()
    prefillers = [
        _Prefiller(ScalarStepTime(cluster.model, hw.row(b), cluster.efficiency), MAX_NUM_BATCHED_TOKENS)
        for b in range(len(cluster.backends))
    ]
    cache = _Cache()
    finish: dict[int, float] = {}  # per request placed, when its prefill ends (as last re-planned)
    for i in order:
        request, now = requests[i], requests[i].arrival_s
        chains = _Cache.chains(request.prompt)
        cached = cache.cached(chains, request.prompt_len, now)
        prompt = _Queued(int(i), request.prompt_len - cached, cached)  # `plan` works on copies
        best: tuple[float, int, dict[int, float]] = (math.inf, -1, {})
        for b, prefiller in enumerate(prefillers):
            prefiller.commit(now)
            _, ends = prefiller.plan([*prefiller.queue, prompt], prefiller.start_at(now))
            if ends[prompt.index] < best[0]:
                best = (ends[prompt.index], b, ends)
        end, b, ends = best
        if end - now <= ttft_limits[i]:
            prefillers[b].add(prompt, now)
            finish.update(ends)
            cache.add(chains, request.prompt, end)
    met = sum(finish[i] - requests[i].arrival_s <= ttft_limits[i] for i in finish)
    return met / len(requests)


def prefill_ceiling(cluster: Cluster, scenario: Arrivals, ttft_limits: np.ndarray, goal: float) -> float:
    """The highest rate, in requests per second, at which `goal` of the scenario's requests meet their
    TTFT limits on the cluster's prefill alone (`prefill_goodput`); infinite where they meet them even
    all at once."""
    return highest_rate(lambda rate: prefill_goodput(cluster, scenario, rate, ttft_limits), goal)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.policies import scenario_prefill_ceiling

    return ceiling_command(
        argv, "python -m bench.prefill_ceiling", __doc__ or "", "prefill ceiling", scenario_prefill_ceiling
    )


if __name__ == "__main__":
    sys.exit(main())
