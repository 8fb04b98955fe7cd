"""The `cost` policy: rank backends by predicted time to first token on their own hardware.

For every candidate at once (numpy over backends):

    predicted_ttft = correction * prefill_time(uncached prompt tokens, after the cached ones) * (1 + load)

- `prefill_time` is the roofline of `scoring/cost.py` on the backend's accelerator and GPU count: a
  compute-rich backend (MI300X, Rubin CPX) prefills a long prompt several times faster than a
  bandwidth-rich, compute-poor one (MI308X), and a cached prefix makes the prompt shorter.
- `(1 + load)`: each request in flight or waiting ahead costs about one more prefill of this size; it is
  a deliberately simple queue estimate that keeps a fast backend from being buried.
- `correction` is learnt online per backend: an exponentially weighted mean of measured TTFT over the
  predicted, queue-free TTFT of finished requests (`observe`), clipped to [0.1, 10]. It absorbs what
  the roofline cannot know (kernels, quantisation, a noisy neighbour).

Ties (equal predictions) keep the rotation order, so identical backends share the load.

With `disaggregation: auto`, `split_pays` decides each split by the same prediction: prefill on the
prefill backend plus the KV transfer (`kv_transfer_time` over the slower side's link) against prefill on
the decode backend itself, its queue and cached prefix included.
"""

from __future__ import annotations

import itertools

import numpy as np

from scoring.catalog import Catalog, ModelSpec, load_catalog
from scoring.cost import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Hardware,
    decode_step_time,
    kv_transfer_time,
    prefill_time,
)
from scoring.types import BackendSpec, Candidates, Outcome, RequestFeatures


class CostRanker:
    name = "cost"

    def __init__(
        self,
        model: ModelSpec,
        catalog: Catalog | None = None,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
        learning_rate: float = 0.1,
    ) -> None:
        self.model = model
        self.catalog = catalog or load_catalog()
        self.efficiency = efficiency
        self.learning_rate = learning_rate
        self._turn = itertools.count()
        self._hardware: dict[tuple[str, ...], Hardware] = {}
        self._correction: dict[str, float] = {}
        self._specs: dict[str, BackendSpec] = {}

    def predicted_ttft(self, request: RequestFeatures, candidates: Candidates) -> np.ndarray:
        hw = self._hardware_of(candidates.specs)
        cached = np.minimum(candidates.cached_tokens, request.prompt_tokens)
        new = np.maximum(request.prompt_tokens - cached, 1)
        prefill = prefill_time(self.model, hw, new, cached, self.efficiency)
        correction = np.array([self._correction.get(s.id, 1.0) for s in candidates.specs])
        return correction * prefill * (1.0 + candidates.load)

    def rank(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        eligible = np.flatnonzero(mask)
        if eligible.size < 2:
            return eligible
        k = next(self._turn) % eligible.size
        rotated = np.concatenate((eligible[k:], eligible[:k]))
        return rotated[np.argsort(self.predicted_ttft(request, candidates)[rotated], kind="stable")]

    def rank_decode(self, request: RequestFeatures, candidates: Candidates, mask: np.ndarray) -> np.ndarray:
        """Backends by predicted time per output token once this request joins their batch (each sequence
        taken to be about this request's length); bandwidth-rich backends win, load spreads the rest."""
        eligible = np.flatnonzero(mask)
        if eligible.size < 2:
            return eligible
        k = next(self._turn) % eligible.size
        rotated = np.concatenate((eligible[k:], eligible[:k]))
        batch = candidates.load + 1.0
        context = batch * (request.prompt_tokens + request.max_tokens)
        tpot = decode_step_time(
            self.model, self._hardware_of(candidates.specs), batch, context, self.efficiency
        )
        return rotated[np.argsort(tpot[rotated], kind="stable")]

    def split_pays(self, request: RequestFeatures, candidates: Candidates, prefill: int, decode: int) -> bool:
        """True when prefill on `prefill` plus shipping the prompt's KV to `decode` is predicted to reach
        the first token sooner than prefilling on `decode` itself (its queue and cache included)."""
        ttft = self.predicted_ttft(request, candidates)
        hw = self._hardware_of(candidates.specs)
        transfer = kv_transfer_time(
            self.model, hw.row(prefill), hw.row(decode), request.prompt_tokens, self.efficiency
        )
        return float(ttft[prefill] + transfer[0]) < float(ttft[decode])

    def observe(self, outcome: Outcome) -> None:
        spec = self._specs.get(outcome.backend_id)
        if spec is None or outcome.ttft_s <= 0:
            return
        hw = self._hardware_of((spec,))
        new = max(outcome.prompt_tokens - outcome.cached_tokens, 1)
        predicted = float(prefill_time(self.model, hw, new, outcome.cached_tokens, self.efficiency)[0])
        ratio = float(np.clip(outcome.ttft_s / predicted, 0.1, 10.0))
        old = self._correction.get(spec.id, 1.0)
        self._correction[spec.id] = old + self.learning_rate * (ratio - old)

    def correction(self, backend_id: str) -> float:
        return self._correction.get(backend_id, 1.0)

    def _hardware_of(self, specs: tuple[BackendSpec, ...]) -> Hardware:
        key = tuple(s.id for s in specs)
        hw = self._hardware.get(key)
        if hw is None:
            accelerators = [self.catalog.accelerator(s.accelerator) for s in specs]
            hw = Hardware.of(accelerators, [s.gpus for s in specs], self.model.compute_dtype)
            self._hardware[key] = hw
            self._specs.update((s.id, s) for s in specs)
        return hw
