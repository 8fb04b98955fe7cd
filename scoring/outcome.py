"""The one outcome rule: what a finished request teaches the router, for the gateway and the simulator.

Each leg is credited to the backend that did it:
- aggregated: one outcome on the backend, TTFT from the request's start to its first token, the prompt
  tokens that backend had cached;
- split: a prefill outcome on the prefill backend (TTFT = start to the prefill leg's result, the tokens
  the *prefiller* had cached) and a decode outcome on the decode backend (TTFT = prefill result to first
  token: the KV transfer and the first step; `peer_id` names the prefiller, so the transfer is learnt per
  pair). The KV the decoder pulled is not a cache hit: it is reported as 0 cached tokens.
TPOT is (finish - first token) / (output tokens - 1) on the leg that decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scoring.types import Leg, Mode, Outcome, Prediction


@dataclass(frozen=True, slots=True)
class Measured:
    """Times (seconds, any common clock) and counts of one finished request."""

    mode: Mode
    backend_id: str  # the aggregated backend, or the decode backend of a split
    prompt_tokens: int
    cached_tokens: int  # on the backend that prefilled
    output_tokens: int
    start_s: float
    first_token_s: float
    finish_s: float
    prefill_backend_id: str = ""
    prefill_done_s: float = math.nan  # split: when the prefill leg's result arrived


def outcomes_of(m: Measured, predicted: Prediction | None) -> tuple[Outcome, ...]:
    tpot = (m.finish_s - m.first_token_s) / (m.output_tokens - 1) if m.output_tokens > 1 else 0.0
    e2e = m.finish_s - m.start_s
    if m.mode is Mode.PD and m.prefill_backend_id and math.isfinite(m.prefill_done_s):
        prefilled = m.prefill_done_s - m.start_s
        prefill = Outcome(
            backend_id=m.prefill_backend_id,
            mode=Mode.PD,
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_tokens,
            output_tokens=1,
            ttft_s=prefilled,
            e2e_s=prefilled,
            leg=Leg.PREFILL,
            peer_id=m.backend_id,
            predicted=predicted,
        )
        decode = Outcome(
            backend_id=m.backend_id,
            mode=Mode.PD,
            prompt_tokens=m.prompt_tokens,
            cached_tokens=0,
            output_tokens=m.output_tokens,
            ttft_s=m.first_token_s - m.prefill_done_s,
            e2e_s=e2e,
            leg=Leg.DECODE,
            peer_id=m.prefill_backend_id,
            predicted=predicted,
            tpot_s=tpot,
            request_ttft_s=m.first_token_s - m.start_s,
        )
        return prefill, decode
    aggregated = Outcome(
        backend_id=m.backend_id,
        mode=Mode.AGGREGATED,
        prompt_tokens=m.prompt_tokens,
        cached_tokens=m.cached_tokens,
        output_tokens=m.output_tokens,
        ttft_s=m.first_token_s - m.start_s,
        e2e_s=e2e,
        predicted=predicted,
        tpot_s=tpot,
    )
    return (aggregated,)
