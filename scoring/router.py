"""The router: filters -> ranking policy -> aggregated or prefill/decode plan.

A plan is built in three steps, all pure and vectorised over the model's backends:

1. **Filter.** Only healthy backends take part. Aggregated serving prefers backends with the decode role
   (a prefill-only pool is kept for prompts); when none is healthy, any healthy backend serves.
2. **Rank.** A `Ranker` orders the eligible backends best-first: `round_robin`, `least_load` (requests in
   flight or queued, divided by capacity), or `prefix` (SGLang's cache-aware policy, `scoring/prefix.py`).
   The whole order is kept: entries after the first are the fallbacks the proxy tries on failure.
3. **Split or not.** `never` serves aggregated. `always` splits whenever a prefill backend distinct from the
   chosen decode backend is healthy. `auto` splits when the prompt tokens the decode backend does not
   already hold reach `pd_min_prompt_tokens` (below that, shipping KV costs more than recomputing it;
   1,024 unless configured), and the prefill backend holds no less of the prompt than the decode
   backend (else the split recomputes what the decoder holds).
   Decode is picked first (like llm-d), so a decode backend that holds the prefix keeps it.

The `cost` policy (`scoring/cost_policy.py`) replaces steps 2-3: it prices every aggregated and split
plan in seconds and returns the plan itself (`Ranker.judges_split`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from scoring.jit import kernel
from scoring.types import Candidates, Disaggregation, Mode, Outcome, RequestFeatures, RoutePlan


class Ranker(Protocol):
    """Orders the backends in `mask` best-first; returns their indices.

    What a policy uses is declared, not discovered:
    - `uses_prefix_index`: it reads `Candidates.cached_tokens` (the gateway and the simulator look the
      prompt up in the prefix index only for such policies);
    - `uses_work`: it reads the work columns of `Candidates` (`prefill_tokens`, `prefill_len`,
      `decode_seqs`, `context_tokens`); for the others the registry leaves them zero, which saves the
      request path the load formula's numpy work (see `gateway/registry.py`);
    - `judges_split`: `choose` prices whole plans (aggregated on b; prefill on p, decode on d) and
      returns the plan itself; `PlanningRouter` then only hands it the split setting;
    - `learns`: `observe` corrects the policy with measured outcomes (otherwise it does nothing);
    - `split_gate_tokens`: under `auto`, the prompt tokens a decode backend must lack before a split
      is considered, when the configuration sets no `pd_min_prompt_tokens`;
    - `replans`: `replan` solves, off the request path, a plan from the traffic it has seen (`cost`:
      where new conversations decode, `scoring.conversations`); its owner calls it now and then.
    """

    name: str
    uses_prefix_index: bool
    uses_work: bool
    judges_split: bool
    learns: bool
    split_gate_tokens: int
    replans: bool

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray: ...

    def choose(self, request: RequestFeatures, candidates: Candidates, split: SplitSettings) -> RoutePlan: ...

    def observe(self, outcome: Outcome) -> None: ...

    def correction(self, backend_id: str) -> float: ...

    def queue_correction(self, backend_id: str) -> float: ...

    def tpot_correction(self, backend_id: str) -> float: ...

    def overhead(self, backend_id: str) -> float: ...

    def calibration(self) -> dict[str, float]: ...

    def blend_calibration(self, others: Mapping[str, Sequence[float]]) -> None: ...

    def replan(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SplitSettings:
    disaggregation: Disaggregation = Disaggregation.NEVER
    pd_min_prompt_tokens: int = 1024


class Rotation:
    """Turns through equal choices: each call starts `indices` one place further (the one rotation
    helper of every policy; stable sorts after it then break ties differently on every request). A
    compiled kernel that rotates row sets itself takes its turns from `turn` (`rotated`)."""

    __slots__ = ("turn",)

    def __init__(self) -> None:
        self.turn = 0  # the next turn's number

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        return rotated(indices, self.take())

    def take(self) -> int:
        """The next turn, spent."""
        turn = self.turn
        self.turn += 1
        return turn


@kernel
def rotated(indices: np.ndarray, turn: int) -> np.ndarray:
    """`indices` started `turn` places further, wrapping round (`Rotation`)."""
    if indices.size < 2:
        return indices
    k = turn % indices.size
    return np.concatenate((indices[k:], indices[:k]))


class SimpleRanker:
    """Defaults for rankers that only `rank`: no prefix index, no plans, no learning."""

    name = ""
    uses_prefix_index = False
    uses_work = False
    judges_split = False
    learns = False
    replans = False
    # Below this many tokens to ship, a count-based policy's split moves more KV than it saves prefill.
    split_gate_tokens = 1024

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def choose(self, request: RequestFeatures, candidates: Candidates, split: SplitSettings) -> RoutePlan:
        raise NotImplementedError(f"{self.name} does not price plans")

    def observe(self, outcome: Outcome) -> None:
        """Nothing to learn."""

    def correction(self, backend_id: str) -> float:
        return 1.0

    def queue_correction(self, backend_id: str) -> float:
        return 1.0

    def tpot_correction(self, backend_id: str) -> float:
        return 1.0

    def overhead(self, backend_id: str) -> float:
        return 0.0

    def calibration(self) -> dict[str, float]:
        return {}

    def blend_calibration(self, others: Mapping[str, Sequence[float]]) -> None:
        """Nothing learnt, nothing to blend."""

    def replan(self) -> None:
        """No plan to solve."""


class RoundRobin(SimpleRanker):
    name = "round_robin"

    def __init__(self) -> None:
        self._rotate = Rotation()

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        return self._rotate(mask.nonzero()[0])


class LeastLoad(SimpleRanker):
    """Lowest requests in flight or queued per unit of capacity first; ties rotate so equal backends
    share the load."""

    name = "least_load"

    def __init__(self) -> None:
        self._rotate = Rotation()

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        return least_load_order(self._rotate(mask.nonzero()[0]), candidates)


def least_load_order(rotated: np.ndarray, candidates: Candidates) -> np.ndarray:
    """`rotated` by load / capacity, ties kept in the given order (capacity >= 1: max_num_seqs)."""
    utilisation = (candidates.load / candidates.capacity)[rotated]
    return rotated[np.argsort(utilisation, kind="stable")]


class PlanningRouter:
    """Implements the `Router` protocol on top of any `Ranker`."""

    def __init__(self, ranker: Ranker, split: SplitSettings, prefill_ranker: Ranker | None = None) -> None:
        self.ranker = ranker
        # Prefill backends are ranked by an instance of their own: a shared rotation would advance twice
        # per split plan and, with two decode backends, always land on the same one.
        self.prefill_ranker = prefill_ranker or ranker
        self.split = split
        self.name = ranker.name
        self.uses_prefix_index = ranker.uses_prefix_index
        self.uses_work = ranker.uses_work
        self.learns = ranker.learns
        self.replans = ranker.replans

    def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
        if self.ranker.judges_split:
            return self.ranker.choose(request, candidates, self.split)
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
        decodes = self._decode_order(candidates, aggregated)
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
        if self.split.disaggregation is Disaggregation.AUTO and self._split_adds_prefill(
            candidates, prefill[0], decode
        ):
            return RoutePlan(mode=Mode.AGGREGATED, aggregated=aggregated, reason="split_adds_prefill")
        return RoutePlan(mode=Mode.PD, aggregated=aggregated, prefill=prefill, decode=decodes, reason="split")

    @staticmethod
    def _split_adds_prefill(candidates: Candidates, prefill: int, decode: int) -> bool:
        """A split would recompute what the decoder holds: the prefill backend holds less of the prompt,
        and the decoder may prefill (an explicit decode-only role is respected). Where every backend
        may prefill, a conversation's next turn was split off its holder and prefilled from scratch
        elsewhere (`prefix/auto` on multi-turn chats over B200 + 2x H100: 1.25 requests/s SLO
        capacity against 6.70 with this rule; docs/policies.md, thirty-fifth pass)."""
        cached = candidates.cached_tokens
        return bool(candidates.can_prefill[decode] and cached[prefill] < cached[decode])

    @staticmethod
    def _decode_order(candidates: Candidates, aggregated: tuple[int, ...]) -> tuple[int, ...]:
        """Decode backends best-first, in the aggregated order: decode is picked first, like llm-d and
        SGLang's P/D router (its decode policy is the main one), so a decode backend that holds the
        prefix keeps it."""
        order = tuple(i for i in aggregated if candidates.can_decode[i])
        return order or aggregated

    def observe(self, outcome: Outcome) -> None:
        """Passes what a finished request leg measured to rankers that learn (the cost policy)."""
        for ranker in {id(r): r for r in (self.ranker, self.prefill_ranker)}.values():
            if ranker.learns:
                ranker.observe(outcome)

    def correction(self, backend_id: str) -> float:
        return self.ranker.correction(backend_id)

    def queue_correction(self, backend_id: str) -> float:
        return self.ranker.queue_correction(backend_id)

    def tpot_correction(self, backend_id: str) -> float:
        return self.ranker.tpot_correction(backend_id)

    def overhead(self, backend_id: str) -> float:
        return self.ranker.overhead(backend_id)

    def calibration(self) -> dict[str, float]:
        return self.ranker.calibration()

    def blend_calibration(self, others: Mapping[str, Sequence[float]]) -> None:
        for ranker in {id(r): r for r in (self.ranker, self.prefill_ranker)}.values():
            if ranker.learns:
                ranker.blend_calibration(others)

    def replan(self) -> None:
        for ranker in {id(r): r for r in (self.ranker, self.prefill_ranker)}.values():
            if ranker.replans:
                ranker.replan()


def build_ranker(policy: str, **knobs: Any) -> Ranker:
    if policy == "round_robin":
        return RoundRobin()
    if policy == "least_load":
        return LeastLoad()
    if policy == "prefix":
        from scoring.prefix import CacheAware  # the prefix policy lives with its long explanation

        return CacheAware(**knobs)
    if policy == "cost":
        from scoring.cost_policy import CostRanker

        return CostRanker(**knobs)
    raise ValueError(f"unknown routing policy {policy!r}")


def build_router(
    policy: str,
    disaggregation: str | Disaggregation = Disaggregation.NEVER,
    pd_min_prompt_tokens: int | None = None,
    **knobs: Any,
) -> PlanningRouter:
    """The router of one policy; `pd_min_prompt_tokens` None: the policy's own `split_gate_tokens`."""
    ranker = build_ranker(policy, **knobs)
    gate = ranker.split_gate_tokens if pd_min_prompt_tokens is None else pd_min_prompt_tokens
    split = SplitSettings(Disaggregation(disaggregation), gate)
    simple_split = split.disaggregation is not Disaggregation.NEVER and not ranker.judges_split
    return PlanningRouter(ranker, split, build_ranker(policy, **knobs) if simple_split else None)
