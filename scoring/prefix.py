"""Prefix policy: SGLang's `cache_aware` router, on hetgate's prefix index.

The algorithm (sgl-router `policies/cache_aware.rs`)
----------------------------------------------------
A backend that already holds the start of a prompt in its KV cache skips that part of the prefill. SGLang's
router keeps an approximate radix tree of what it sent where; hetgate's prefix index answers the same
question per backend (`Candidates.cached_tokens`, matched blocks x block size). Per request, over the
eligible backends:

1. **Imbalanced?** The load of every backend (requests in flight or queued, a count, as SGLang's) is
   compared: the cluster is imbalanced when `max - min > balance_abs_threshold` AND
   `max > min * balance_rel_threshold`. Then the request goes to the least-loaded backend, whatever is
   cached.
2. **Otherwise, cache affinity.** The match rate is the share of the prompt the best holder has cached
   *beyond what every eligible backend holds*. If it exceeds `cache_threshold`, the request goes to that
   holder (several equal holders: the least loaded of them).
3. **Otherwise, the least loaded.** The version hetgate is measured against (sglang-router 0.3.2, the
   SGLang model gateway's `select_worker_with_text`) sends it to the worker with the fewest requests in
   flight; equal loads go to the first in the configured order, as Rust's `min_by_key` returns the
   first minimum. Earlier SGLang routers sent it to the smallest tree (`get_smallest_tenant`); the
   0.3.2 binary has no such rule. Ranked here before by vLLM's KV usage, the policy sent most new
   prompts to the backend that frees its KV first (a B200 beside two H100s took 103 of 150, where
   sglang-router sent it 58-60; docs/policies.md, thirty-fourth pass).

Where this differs from SGLang, and why: SGLang's match rate counts every matched character, so when every
worker holds a shared system prompt the match passes the threshold and the tree's first holder takes the
request; on real traffic, where every conversation starts with the same block, that sends everything to one
server. Counting only what the holder has *beyond the common part* keeps SGLang's rule for real affinity
and spreads requests whose only shared part is everywhere.

The rest of the ranking (the proxy's fallbacks) is least-load order, ties in the configured order. In a
split, SGLang's P/D router picks both workers with this policy, each over its own pool (sgl-router
`create_pd_router`: the prefill and decode policies default to the main one): the decode backend is the
cache-aware choice among those that may decode, so a conversation's next turn decodes where its last one
left its KV, and under `auto` is served whole there when it lacks fewer than `pd_min_prompt_tokens`
(llm-d's prefix-based P/D decider). Where every backend may prefill, a turn that lacks more than that
is served whole on its holder too, since another backend would prefill from scratch what the holder
has (`PlanningRouter._split_adds_prefill`; neither SGLang nor llm-d runs a backend in both pools, so
neither has a rule to copy). `auto` still loses to `never` where new prompts are split between
backends that may all do both (docs/policies.md, thirty-fifth pass).

The knobs (SGLang's defaults)
-----------------------------
- `cache_threshold` (0.3): the share of the prompt a holder must have beyond the common part.
- `balance_abs_threshold` (64 requests) and `balance_rel_threshold` (1.5): both must be exceeded for the
  cluster to count as imbalanced.

Its load is `Candidates.load`: the gateway's requests in flight there, plus what vLLM reports beyond
them (other clients'), as SGLang's router counts what it has in flight.
"""

from __future__ import annotations

import numpy as np

from scoring.router import SimpleRanker
from scoring.types import Candidates, RequestFeatures


def imbalanced(load: np.ndarray, abs_threshold: float, rel_threshold: float) -> bool:
    """SGLang's rule over the whole set: max - min > abs AND max > min * rel."""
    if load.size == 0:
        return False
    most, least = float(load.max()), float(load.min())
    return most - least > abs_threshold and most > least * rel_threshold


class CacheAware(SimpleRanker):
    """SGLang's cache-aware policy as a ranker for `PlanningRouter` (see the module docstring)."""

    name = "prefix"
    uses_prefix_index = True

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if not 0 <= cache_threshold <= 1 or balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError(
                "cache_threshold must be in [0, 1], balance_abs_threshold >= 0, balance_rel_threshold >= 1"
            )
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        eligible = mask.nonzero()[0]
        order = eligible[np.argsort(candidates.load[eligible], kind="stable")]  # least loaded, then first
        if order.size < 2:
            return order
        first = self._first(request, candidates, order)
        return np.concatenate(([first], order[order != first]))

    def _first(self, request: RequestFeatures, candidates: Candidates, order: np.ndarray) -> int:
        """`order` is least-load first (ties in the configured order), so the argmax below breaks ties
        by load."""
        if imbalanced(candidates.load[order], self.balance_abs_threshold, self.balance_rel_threshold):
            return int(order[0])
        cached = candidates.cached_tokens[order]
        beyond = cached - cached.min()
        if request.prompt_tokens > 0 and beyond.max() / request.prompt_tokens > self.cache_threshold:
            return int(order[int(cached.argmax())])
        return int(order[0])
