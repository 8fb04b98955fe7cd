"""Prefix policy: cache affinity with a load guard.

The algorithm
-------------
A backend that already holds the start of a prompt in its KV cache skips that part of the prefill: the
time to first token falls with every cached token (vLLM's prefix caching; SGLang's radix cache). So the
policy sends a request where the longest prefix of its prompt is cached, as long as that does not pile
work onto one backend while others idle. Per request, over the healthy backends that can decode:

1. `Candidates.cached_tokens[i]` (from the prefix index: matched blocks x block size) says how many
   leading prompt tokens backend i holds.
2. A backend is *overloaded* when its load exceeds the least-loaded eligible backend's load by BOTH
   `balance_abs_threshold` requests AND a factor `balance_rel_threshold`. This is SGLang cache_aware's
   balance rule, applied per backend: an affinity target is dropped only when it is far behind in
   absolute terms and in relative terms, so a small queue on an idle cluster (1 vs 0) never breaks
   affinity, and neither does a modest spread on a busy one (300 vs 250).
3. Backends with a cached prefix that are not overloaded come first, longest prefix first (ties: lower
   load). If there is none, because nothing is cached or every holder is overloaded, the request goes
   least-load first: load / capacity, ties rotated between requests so a cold start spreads out.
4. The rest follow in least-load order: they are the proxy's fallbacks when the first choice fails.

"Load" is `Candidates.load`, in-flight plus waiting requests, in requests (not normalised by capacity),
because the thresholds are request counts as in SGLang; the least-load fallback order does normalise by
capacity, like the `least_load` policy, so a big backend takes its share.

The knobs
---------
- `balance_abs_threshold` (default 32 requests): how many more requests than the least-loaded backend
  an affinity target may carry. Higher keeps more cache hits under skewed traffic, at the price of
  queueing behind a hot backend. SGLang's default is 64, tuned for GPUs with hundreds of concurrent
  sequences; we default lower because hetgate mixes slower accelerators with smaller batches.
- `balance_rel_threshold` (default 1.5): the same bound as a ratio to the least-loaded backend's load.
  With both at their defaults an affinity target is abandoned at, e.g., 49 vs 16, but kept at 48 vs 16
  or 40 vs 30.

`prefix_hit_score` gives the cost router the same signal as a score in [0, 1]: the share of the prompt
each backend already holds.
"""

from __future__ import annotations

import itertools

import numpy as np

from scoring.types import Candidates, Mode, Outcome, RequestFeatures, RoutePlan


def prefix_hit_score(request: RequestFeatures, candidates: Candidates) -> np.ndarray:
    """Cached share of the prompt per backend, in [0, 1] (0 for an empty prompt)."""
    cached = np.asarray(candidates.cached_tokens, dtype=float)
    if request.prompt_tokens <= 0:
        return np.zeros(len(candidates))
    return np.clip(cached / float(request.prompt_tokens), 0.0, 1.0)


def overloaded(load: np.ndarray, abs_threshold: float, rel_threshold: float) -> np.ndarray:
    """Which entries of `load` exceed its minimum by both thresholds (SGLang's imbalance rule)."""
    if load.size == 0:
        return np.zeros(0, dtype=bool)
    least = load.min()
    return ((load - least) > abs_threshold) & (load > least * rel_threshold)


class PrefixRouter:
    """Cache affinity with a load guard; both a `Router` (plan) and a ranker (rank) for PlanningRouter."""

    name = "prefix"

    def __init__(self, balance_abs_threshold: float = 32, balance_rel_threshold: float = 1.5) -> None:
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._turn = itertools.count()

    def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
        mask = candidates.healthy & candidates.can_decode
        ranked, reason = self._rank(candidates, mask)
        return RoutePlan(mode=Mode.AGGREGATED, aggregated=tuple(int(i) for i in ranked), reason=reason)

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        return self._rank(candidates, mask)[0]

    def observe(self, outcome: Outcome) -> None:
        """The index learns what backends hold; the policy itself keeps no state to correct."""

    def _rank(self, candidates: Candidates, mask: np.ndarray) -> tuple[np.ndarray, str]:
        eligible = np.flatnonzero(mask)
        if eligible.size == 0:
            return eligible, "no_healthy_backend"
        # Rotate first: the stable sorts below then break ties differently on every request.
        eligible = np.roll(eligible, -(next(self._turn) % eligible.size))
        cached = np.asarray(candidates.cached_tokens, dtype=float)[eligible]
        load = np.asarray(candidates.load, dtype=float)[eligible]
        hot = overloaded(load, self.balance_abs_threshold, self.balance_rel_threshold)
        affine = (cached > 0) & ~hot
        first = eligible[affine][np.lexsort((load[affine], -cached[affine]))]
        rest = eligible[~affine]
        utilisation = load[~affine] / np.maximum(np.asarray(candidates.capacity, dtype=float)[rest], 1.0)
        rest = rest[np.lexsort((-cached[~affine], utilisation))]
        return np.concatenate([first, rest]), _reason(affine.any(), (cached > 0).any())


def _reason(followed: bool | np.bool_, anything_cached: bool | np.bool_) -> str:
    if followed:
        return "prefix_hit"
    return "prefix_overloaded" if anything_cached else "no_prefix"
