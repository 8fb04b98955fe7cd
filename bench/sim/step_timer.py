"""Step times of one backend from the roofline (`scoring/cost.py`): `StepTimer`, plus its KV capacity and
KV transfer time."""

from __future__ import annotations

from scoring.catalog import Accelerator, ModelSpec
from scoring.cost import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Hardware,
    ScalarStepTime,
    kv_capacity_tokens,
    kv_transfer_time,
    request_overhead,
)


class StepTimer:
    """Times one backend's steps with `scoring.cost.step_time` (scalars in, float out)."""

    def __init__(
        self, model: ModelSpec, hardware: Hardware, efficiency: Efficiency = DEFAULT_EFFICIENCY
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.efficiency = efficiency
        self._step_s = ScalarStepTime(model, hardware, efficiency)
        # Each request waits this long before it can join a step (scoring.cost.request_overhead).
        self.request_overhead_s = float(request_overhead(hardware, efficiency)[0])

    @classmethod
    def for_accelerator(
        cls,
        model: ModelSpec,
        accelerator: Accelerator,
        gpus: int,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
    ) -> StepTimer:
        return cls(model, Hardware.of([accelerator], [gpus], model.compute_dtype), efficiency)

    def __call__(
        self, prefill_tokens: int, prefill_pairs: float, decode_batch: int, decode_context: int
    ) -> float:
        return self._step_s(prefill_tokens, prefill_pairs, decode_batch, decode_context)

    def kv_capacity_blocks(self, block_size: int) -> int:
        return int(kv_capacity_tokens(self.model, self.hardware, self.efficiency)[0]) // block_size

    def transfer_s(self, tokens: int, source: Hardware | None = None) -> float:
        src = self.hardware if source is None else source
        return float(kv_transfer_time(self.model, src, self.hardware, tokens, self.efficiency)[0])
