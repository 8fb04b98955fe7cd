"""The decode ceiling: the SLO capacity of a cluster's decoders alone, with everything else ideal.

`hetgate bench policies` reports two bounds, the fluid bound and the SLO bound (`bench.clusters`). Both
are fluid: they take the traffic as a steady stream, so a trace whose requests arrive in groups (the
`bursty` workload: eight at one instant) gets the same bound as the same requests arriving one by one.
Real decoders see the groups. Each request holds a place in a decode batch for its whole output, a
batch's step lengthens with every sequence in it, and the TPOT limit caps how many sequences a backend
can run at once. When groups overlap, every decoder is over that cap at the same time, and no placement
of the requests avoids it.

This module measures that alone. A replay of the scenario at a given rate where:
- prefill takes no time, holds up no decode and costs no decoder anything, and KV moves for free: each
  request starts decoding at its arrival (its first token is the prefill's);
- every backend that may decode steps its running sequences at `decode_step_time` for its batch and
  their context (each sequence at its prompt plus half its output, as the SLO limits take it), with
  the benchmark's efficiency (the simulator's);
- each arriving request goes to the decoder whose step, with it added, is the shortest (the placement
  that spreads the batches; a request never moves once placed); while every decoder runs
  `max_num_seqs` sequences it waits, first come first served, and that wait is its TTFT;
- a request meets its SLO when its TTFT and its TPOT are within their limits;
- KV capacity is not counted: vLLM holds a shared prefix once, so the full context of every request
  would overstate what a batch needs (it put sysprompt@cpx's ceiling below what `cost` measures).

Its SLO capacity (the highest rate at which >= 90 % of the requests meet their limits, bisected) is
an estimate, not a proof: a router could in principle do better by holding requests back while a group
drains (the TTFT limit allows a fraction of a second, against seconds of decoding), or by placing them
with foresight. What it shows is how far prefill, transfer and placement are from being the limit: a
policy at the ceiling has nothing left to win but what the arrivals allow.

`python -m bench.decode_ceiling --scenarios bursty@amd,sysprompt@amd --requests 1000`
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.clusters import Cluster
from bench.rate_search import Arrivals, ceiling_command, highest_rate
from scoring.cost import Hardware, decode_step_time
from scoring.types import Role


@dataclass(slots=True)
class _Decoders:
    """The cluster's decoders in the replay: per backend, what it runs and what it may hold."""

    cluster: Cluster
    hw: Hardware  # the cluster's, built once (`Cluster.hardware` builds it anew on every call)
    seqs_cap: np.ndarray  # vLLM's max_num_seqs (0 where the backend does not decode)
    batch: np.ndarray  # sequences running
    context: np.ndarray  # their context in tokens (each at its prompt plus half its output)

    @classmethod
    def of(cls, cluster: Cluster) -> _Decoders:
        decodes = np.array([Role.DECODE in b.spec.roles for b in cluster.backends])
        seqs = np.array([b.spec.max_num_seqs for b in cluster.backends], dtype=float)
        zeros = np.zeros(len(cluster.backends))
        return cls(cluster, cluster.hardware(), np.where(decodes, seqs, 0.0), zeros.copy(), zeros.copy())

    def steps(self, extra_seqs: float = 0.0, extra_context: float = 0.0) -> np.ndarray:
        c = self.cluster
        step = decode_step_time(
            c.model, self.hw, np.maximum(self.batch + extra_seqs, 1.0), self.context + extra_context,
            c.efficiency,
        )  # fmt: skip
        return np.asarray(step, dtype=float)

    def place(self, context: float) -> int:
        """The decoder whose step, with this request added, is shortest among those with a free
        sequence slot (-1: none)."""
        room = self.batch < self.seqs_cap
        if not room.any():
            return -1
        b = int(np.argmin(np.where(room, self.steps(1.0, context), np.inf)))
        self.batch[b], self.context[b] = self.batch[b] + 1, self.context[b] + context
        return b

    def leave(self, b: int, context: float) -> None:
        self.batch[b], self.context[b] = self.batch[b] - 1, max(self.context[b] - context, 0.0)


def decode_goodput(
    cluster: Cluster, scenario: Arrivals, rate: float, limits: tuple[np.ndarray, np.ndarray]
) -> float:
    """The share of the scenario's requests, arriving at `rate`, that meet their SLO on the cluster's
    decoders alone (module docstring); `limits`: per request of the scenario, its TTFT and TPOT limits."""
    requests = scenario.at_rate(rate)
    order = np.argsort([r.arrival_s for r in requests], kind="stable")
    arrivals = np.array([requests[i].arrival_s for i in order])
    outputs = np.array([max(requests[i].max_tokens - 1, 0) for i in order], dtype=float)
    context = np.array([requests[i].prompt_len + requests[i].max_tokens / 2 for i in order])
    ttft_limits, tpot_limits = limits[0][order], limits[1][order]
    decoders = _Decoders.of(cluster)
    placed = np.zeros(len(requests), dtype=np.int64)
    started = np.zeros(len(requests))
    left = outputs.copy()  # decode steps each request still has to run
    running = np.zeros(len(requests), dtype=bool)
    waiting: deque[int] = deque()  # arrived, no decoder with room yet (vLLM's waiting queue)
    met = 0
    now = 0.0
    k = 0
    while k < len(requests) or running.any() or waiting:
        per_step = decoders.steps()[placed]
        ends = np.where(running, now + left * per_step, np.inf)
        done = int(np.argmin(ends))
        arriving = k < len(requests) and arrivals[k] <= ends[done]
        then = arrivals[k] if arriving else float(ends[done])
        if not np.isfinite(then):
            raise RuntimeError("a request fits no decoder even on an idle cluster")
        left[running] -= (then - now) / per_step[running]
        now = then
        if arriving:
            waiting.append(k)
            k += 1
        else:
            running[done], left[done] = False, 0.0
            decoders.leave(int(placed[done]), context[done])
            tpot = (now - started[done]) / outputs[done] if outputs[done] else 0.0
            met += started[done] - arrivals[done] <= ttft_limits[done] and tpot <= tpot_limits[done]
        while waiting:
            b = decoders.place(context[waiting[0]])
            if b < 0:
                break
            i = waiting.popleft()
            placed[i], started[i], running[i] = b, now, True
    return met / len(requests)


def decode_ceiling(
    cluster: Cluster, scenario: Arrivals, limits: tuple[np.ndarray, np.ndarray], goal: float
) -> float:
    """The highest rate, in requests per second, at which `goal` of the scenario's requests meet their
    `limits` (`decode_goodput`); infinite where they meet them even all at once (too few requests to
    fill the decoders)."""
    return highest_rate(lambda rate: decode_goodput(cluster, scenario, rate, limits), goal)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.policies import scenario_decode_ceiling

    return ceiling_command(
        argv, "python -m bench.decode_ceiling", __doc__ or "", "decode ceiling", scenario_decode_ceiling
    )


if __name__ == "__main__":
    sys.exit(main())
