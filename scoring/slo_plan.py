"""The SLO plan: the most requests per second any router could serve with `goal` of them within their
SLO, and where that plan prefills and decodes them, from a fluid LP of vLLM's chunked-prefill steps.

Written once, used three ways: `hetgate bench policies`' SLO bound and `hetgate plan` solve it over a
whole trace (`bench.clusters.slo_plan`), and the `cost` policy solves it over the traffic it has seen to
place new conversations (`scoring.conversations`).

Each backend spends shares of its time on step shapes (a decode batch of b sequences, a prefill chunk of
c tokens, both at once as vLLM mixes them), each timed by `scoring.cost.step_time`. Constraints:
- a request prefills only where its unloaded TTFT (its cached tokens cached, no queue) meets its limit;
- the steps a backend's decoded tokens ride average at most the `goal` quantile of the TPOT limits (per
  token, so a large batch counts as many times as it has sequences): prefill chunks in those steps
  stretch every decode's TPOT (vLLM's chunked prefill), so a backend that prefills a lot decodes little
  within the SLO;
- up to 1 - `goal` of the requests may miss, and they cost nothing.
Optimistic (no queueing, time shared freely between step shapes, KV transfer free, the mean context and
prompt per token): no policy's steady-state SLO capacity exceeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scoring.catalog import ModelSpec
from scoring.cost import Efficiency, Hardware, causal_pairs, kv_capacity_tokens, prefill_time, step_time
from scoring.types import BackendSpec, Role

_BATCHES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_CHUNKS = (0, 256, 512, 1024, 2048, 4096, 8192)
_NO_LIMIT_S = 1e30  # a limit this long or longer is none
StepShapes = list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per backend: (batch, chunk, seconds)


@dataclass(frozen=True, slots=True)
class Servers:
    """The backends, one row each, as the plan needs them."""

    model: ModelSpec
    hw: Hardware
    efficiency: Efficiency
    can_prefill: np.ndarray  # bool
    can_decode: np.ndarray  # bool
    max_num_seqs: np.ndarray

    @classmethod
    def of(
        cls, model: ModelSpec, hw: Hardware, efficiency: Efficiency, specs: Sequence[BackendSpec]
    ) -> Servers:
        """The rows of `hw`, with the roles and batch limits of `specs` (in the same order)."""
        return cls(
            model,
            hw,
            efficiency,
            np.array([Role.PREFILL in s.roles for s in specs]),
            np.array([Role.DECODE in s.roles for s in specs]),
            np.array([s.max_num_seqs for s in specs], dtype=float),
        )


@dataclass(frozen=True, slots=True)
class Traffic:
    """The requests to plan for, one entry each."""

    prompt: np.ndarray  # prompt tokens
    cached: np.ndarray  # of them, held in some prefix cache when it arrives
    outputs: np.ndarray  # output tokens (max_tokens)
    ttft_limits: np.ndarray  # seconds
    tpot_limits: np.ndarray


@dataclass(frozen=True, slots=True)
class PlanShares:
    """The plan's rate, and per backend row its share of the served requests' prefills and decodes (all
    zero when nothing can be served). An LP's optimum need not be unique; these are the solver's."""

    requests_per_s: float
    prefills: np.ndarray
    decodes: np.ndarray


def solve_slo_plan(servers: Servers, traffic: Traffic, goal: float = 0.9) -> PlanShares:
    """The LP of the module docstring."""
    from scipy.optimize import linprog  # imported when first solved: `serve` starts without it

    hw, model, eff = servers.hw, servers.model, servers.efficiency
    n = len(servers.can_prefill)
    can_p, can_d = servers.can_prefill, servers.can_decode
    cached = np.minimum(traffic.cached, traffic.prompt - 1)
    new = traffic.prompt - cached
    outputs = float(np.mean(traffic.outputs))
    # A decode-only backend prefills the requests it serves whole.
    unloaded = np.asarray(prefill_time(model, hw, new[:, None], cached[:, None], eff))
    ttft_ok = (unloaded <= traffic.ttft_limits[:, None]) & (can_p | can_d)
    # Requests with the same TTFT-feasible backends form one group: x[g, i] = group g's prefills on i.
    groups, member = np.unique(ttft_ok, axis=0, return_inverse=True)
    member = member.ravel()
    share = np.bincount(member, minlength=len(groups)) / len(new)
    group_new = np.array([new[member == g].mean() for g in range(len(groups))])
    context = float(np.mean(traffic.prompt)) + outputs / 2
    shapes = step_shapes(servers, context, float(np.sum(causal_pairs(new, cached)) / max(new.sum(), 1.0)))
    # A router with no TPOT objective plans with an infinite target: no TPOT constraint then.
    lenient = float(np.quantile(np.minimum(traffic.tpot_limits, _NO_LIMIT_S), goal))
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
        if lenient < _NO_LIMIT_S:  # its decoded tokens' mean step within the limit:
            tpot = row()  # sum(tokens x (step - limit)) <= 0
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
        return PlanShares(0.0, np.zeros(n), np.zeros(n))
    prefills = np.clip([lp.x[i:nx:n].sum() for i in range(n)], 0.0, None)  # -0.0 and the like
    decodes = np.clip(lp.x[nx : nx + n], 0.0, None)
    return PlanShares(float(lp.x[-1]), prefills / prefills.sum(), decodes / decodes.sum())


def step_shapes(servers: Servers, context: float, pairs_per_token: float) -> StepShapes:
    """Per backend, the step shapes it may run: (decode batch, prefill chunk tokens, seconds) arrays.
    Batches up to what its KV cache and max_num_seqs hold at the mean `context`; a chunk's attention at
    the traffic's mean (query, key) pairs per prompt token; the empty shape (0, 0) left out."""
    hw, model, eff = servers.hw, servers.model, servers.efficiency
    most = np.minimum(servers.max_num_seqs.astype(float), kv_capacity_tokens(model, hw, eff) // context)
    grid = [(b, c) for b in _BATCHES for c in _CHUNKS if b or c]
    batch = np.array([b for b, _ in grid], dtype=float)
    chunk = np.array([c for _, c in grid], dtype=float)
    seconds = np.asarray(
        step_time(model, hw, chunk[:, None], chunk[:, None] * pairs_per_token, batch[:, None],
                  batch[:, None] * context, eff)
    )  # fmt: skip
    shapes = []
    for i in range(len(servers.can_prefill)):
        fits = batch <= most[i]
        shapes.append((batch[fits], chunk[fits], seconds[fits, i]))
    return shapes
