"""The router: filters -> ranking policy -> aggregated or prefill/decode plan.

A plan is built in three steps, all pure and vectorised over the model's backends:

1. **Filter.** Only healthy backends take part. Aggregated serving prefers backends with the decode role
   (a prefill-only pool is kept for prompts); when none is healthy, any healthy backend serves.
2. **Rank.** A `Ranker` orders the eligible backends best-first: `round_robin`, `least_load` (in-flight plus
   waiting, divided by capacity), or `prefix` (cache affinity with a load guard, `scoring/prefix.py`). The
   whole order is kept: entries after the first are the fallbacks the proxy tries on failure.
3. **Split or not.** `never` serves aggregated. `always` splits whenever a prefill backend distinct from the
   chosen decode backend is healthy. `auto` splits when the prompt tokens the decode backend does not
   already hold reach `pd_min_prompt_tokens` (below that, shipping KV costs more than recomputing it);
   with the `cost` policy it then splits only when prefill elsewhere plus the KV transfer is predicted
   to reach the first token sooner than prefill on the decode backend itself.
   Decode is picked first (like llm-d), so a decode backend that holds the prefix keeps it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from scoring.types import Candidates, Disaggregation, Mode, Outcome, RequestFeatures, RoutePlan


class Ranker(Protocol):
    """Orders the backends in `mask` best-first; returns their indices."""

    name: str

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        return _rotated(np.flatnonzero(mask), next(self._turn))


class LeastLoad:
    """Lowest (in-flight + waiting) / capacity first; ties rotate so equal backends share the load."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        rotated = _rotated(np.flatnonzero(mask), next(self._turn))
        utilisation = (candidates.load / candidates.capacity)[rotated]  # capacity >= 1 (max_num_seqs)
        return rotated[np.argsort(utilisation, kind="stable")]


def _rotated(indices: np.ndarray, turn: int) -> np.ndarray:
    """`indices` starting at position turn mod size (np.roll's result at a fraction of its cost)."""
    if indices.size < 2:
        return indices
    k = turn % indices.size
    return np.concatenate((indices[k:], indices[:k]))


@dataclass(frozen=True, slots=True)
class SplitSettings:
    disaggregation: Disaggregation = Disaggregation.NEVER
    pd_min_prompt_tokens: int = 1024


class PlanningRouter:
    """Implements the `Router` protocol on top of any `Ranker`."""

    def __init__(self, ranker: Ranker, split: SplitSettings, prefill_ranker: Ranker | None = None) -> None:
        self.ranker = ranker
        # Prefill backends are ranked by an instance of their own: a shared rotation would advance twice
        # per split plan and, with two decode backends, always land on the same one.
        self.prefill_ranker = prefill_ranker or ranker
        self.split = split
        self.name = ranker.name

    def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
        healthy = candidates.healthy
        aggregated = tuple(self.ranker.rank(request, candidates, healthy & candidates.can_decode).tolist())
        if not aggregated:  # no healthy decode backend: any healthy one serves
            aggregated = tuple(self.ranker.rank(request, candidates, healthy).tolist())
        if not aggregated:
            return RoutePlan(mode=Mode.AGGREGATED, reason="no_healthy_backend")
        if self.split.disaggregation is Disaggregation.NEVER:
            return RoutePlan(mode=Mode.AGGREGATED, aggregated=aggregated, reason="never")
        return self._maybe_split(request, candidates, aggregated)

    def _maybe_split(
        self, request: RequestFeatures, candidates: Candidates, aggregated: tuple[int, ...]
    ) -> RoutePlan:
        decodes = self._decode_order(request, candidates, aggregated)
        decode = decodes[0]
        prefill_mask = candidates.healthy & candidates.can_prefill
        prefill_mask[decode] = False
        if not prefill_mask.any():
            return RoutePlan(mode=Mode.AGGREGATED, aggregated=aggregated, reason="no_prefill_backend")
        if self.split.disaggregation is Disaggregation.AUTO:
            uncached = request.prompt_tokens - int(candidates.cached_tokens[decode])
            if uncached < self.split.pd_min_prompt_tokens:
                return RoutePlan(mode=Mode.AGGREGATED, aggregated=aggregated, reason="short_prompt")
        prefill = tuple(self.prefill_ranker.rank(request, candidates, prefill_mask).tolist())
        if self.split.disaggregation is Disaggregation.AUTO and not self._split_pays(
            request, candidates, prefill[0], decode
        ):
            return RoutePlan(mode=Mode.AGGREGATED, aggregated=aggregated, reason="split_costlier")
        return RoutePlan(mode=Mode.PD, aggregated=aggregated, prefill=prefill, decode=decodes, reason="split")

    def _decode_order(
        self, request: RequestFeatures, candidates: Candidates, aggregated: tuple[int, ...]
    ) -> tuple[int, ...]:
        """Decode backends best-first. A ranker that predicts decode costs (`cost`) orders them by time per
        output token; ranking them by time to first token would make the decode pick the prefill pick too,
        and no split could ever pay. Other rankers keep the aggregated order."""
        rank_decode = getattr(self.ranker, "rank_decode", None)
        if rank_decode is not None:
            mask = candidates.healthy & candidates.can_decode
            order = tuple(rank_decode(request, candidates, mask).tolist())
        else:
            order = tuple(i for i in aggregated if candidates.can_decode[i])
        return order or aggregated

    def _split_pays(
        self, request: RequestFeatures, candidates: Candidates, prefill: int, decode: int
    ) -> bool:
        """Rankers that predict costs (`cost`) judge each split; the others split above the threshold."""
        judge = getattr(self.prefill_ranker, "split_pays", None)
        return judge is None or judge(request, candidates, prefill, decode)

    def observe(self, outcome: Outcome) -> None:
        """Passes what a finished request measured to rankers that learn (the cost policy)."""
        for ranker in {id(r): r for r in (self.ranker, self.prefill_ranker)}.values():
            learn = getattr(ranker, "observe", None)
            if learn is not None:
                learn(outcome)


def build_ranker(policy: str, **knobs: Any) -> Ranker:
    if policy == "round_robin":
        return RoundRobin()
    if policy == "least_load":
        return LeastLoad()
    if policy == "prefix":
        from scoring.prefix import PrefixRouter  # the prefix policy lives with its long explanation

        return PrefixRouter(**knobs)
    if policy == "cost":
        from scoring.cost_policy import CostRanker

        return CostRanker(**knobs)
    raise ValueError(f"unknown routing policy {policy!r}")


def build_router(
    policy: str,
    disaggregation: str | Disaggregation = Disaggregation.NEVER,
    pd_min_prompt_tokens: int = 1024,
    **knobs: Any,
) -> PlanningRouter:
    split = SplitSettings(Disaggregation(disaggregation), pd_min_prompt_tokens)
    prefill_ranker = None if split.disaggregation is Disaggregation.NEVER else build_ranker(policy, **knobs)
    return PlanningRouter(build_ranker(policy, **knobs), split, prefill_ranker)
