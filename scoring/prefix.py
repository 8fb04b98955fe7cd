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
3. **Otherwise, the emptiest cache.** SGLang sends it to the worker with the smallest tree (the one
   holding least, so it has room and gains most from a new prefix); here the backend with the lowest KV
   cache usage, ties by load, then rotating. SGLang's tree grows at each decision; vLLM's usage is
   scraped (every second by default), so the usage counted is the last report plus the context sent
   there since, over the cache's size (`Candidates.kv_usage_now`): by the report alone, every request
   between two scrapes went to the same backend (docs/policies.md, thirty-third pass).

Where this differs from SGLang, and why: SGLang's match rate counts every matched character, so when every
worker holds a shared system prompt the match passes the threshold and the tree's first holder takes the
request; on real traffic, where every conversation starts with the same block, that sends everything to one
server. Counting only what the holder has *beyond the common part* keeps SGLang's rule for real affinity
and spreads requests whose only shared part is everywhere.

The rest of the ranking (the proxy's fallbacks) is least-load order. In a split, SGLang's P/D router picks
the prefill worker cache-aware and the decode worker by least load; so does this policy (`rank_decode`).

The knobs (SGLang's defaults)
-----------------------------
- `cache_threshold` (0.3): the share of the prompt a holder must have beyond the common part.
- `balance_abs_threshold` (64 requests) and `balance_rel_threshold` (1.5): both must be exceeded for the
  cluster to count as imbalanced.
"""

from __future__ import annotations

import numpy as np

from scoring.router import Rotation, SimpleRanker, least_load_order
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
    ranks_decode = True

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
        self._rotate = Rotation()

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        order = least_load_order(self._rotate(mask.nonzero()[0]), candidates)
        if order.size < 2:
            return order
        first = self._first(request, candidates, order)
        return np.concatenate(([first], order[order != first]))

    def rank_decode(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        return least_load_order(self._rotate(mask.nonzero()[0]), candidates)

    def _first(self, request: RequestFeatures, candidates: Candidates, order: np.ndarray) -> int:
        """`order` is least-load first (ties rotated), so each argmax/argmin below breaks ties by load."""
        load = candidates.load[order]
        if imbalanced(load, self.balance_abs_threshold, self.balance_rel_threshold):
            return int(order[0])
        cached = candidates.cached_tokens[order]
        beyond = cached - cached.min()
        if request.prompt_tokens > 0 and beyond.max() / request.prompt_tokens > self.cache_threshold:
            return int(order[int(cached.argmax())])
        return int(order[int(candidates.kv_usage_now()[order].argmin())])
