"""Roofline cost model: how long prefill, a decode step and a KV transfer take on each backend.

Everything is numpy and vectorised over backends: `Hardware` holds one row per backend (a device times its
count of GPUs), and every function broadcasts over those rows (scalars work too). The same formulas time the
simulator's engine steps (`bench/sim/scheduler.py`) and score backends in the router.

One engine step (vLLM runs GEMMs and attention as separate kernels, so each gets its own roofline and they
add up):

* **GEMMs**: `2 * active_params` FLOPs per token in the step, against reading the weights once. A MoE step
  reads the always-on weights plus only the experts some token picked: with T tokens each choosing k of E
  experts, the expected distinct experts per layer is `E * (1 - (1 - k/E) ** T)`. Time is
  `max(FLOPs / (peak * mfu), bytes / (bandwidth * bw_util))`.
* **Attention**: prefill does `attn_flops_per_pair` FLOPs for every (query, key) pair (causal: n new tokens
  after c cached ones make `n * c + n * (n + 1) / 2` pairs) at the BF16 peak; decode reads every sequence's
  KV once. Same max(compute, memory) rule.
* A fixed per-step overhead (scheduling, kernel launches, sampling, the Python of the engine).

Because a chunk of prefill makes the GEMM phase compute-bound, decodes that share the step wait for it: that
is the prefill/decode interference that disaggregation removes.

MLA (DeepSeek) keeps one latent KV per token that every tensor-parallel rank holds and reads in full, so its
KV capacity and KV read time do not shrink with the GPU count (`kv_replication`).

Efficiency defaults follow epsteinj/disagg's calibrated roofline (comp_eff 0.50, bw_eff 0.70); InferSim
reports ~15 % error for this style of model on DeepSeek-V3. Fit them per deployment when you have one
measurement (see `bench/seed_case.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scoring.catalog import Accelerator, ModelSpec
from scoring.jit import kernel, ufunc

ArrayLike = np.ndarray | float | int
TB = 1e12
GB = 1e9


@dataclass(frozen=True, slots=True)
class Efficiency:
    """The knobs between peak figures and what a serving engine gets."""

    mfu: float = 0.50  # fraction of peak dense FLOPS (epsteinj/disagg comp_eff)
    bw_util: float = 0.70  # fraction of peak memory bandwidth (epsteinj/disagg bw_eff)
    step_overhead_s: float = 0.003  # per engine step: scheduler, launches, sampling
    request_overhead_s: float = 0.0  # per request, before its first step: API server, IPC to the engine
    seq_overhead_s: float = 0.0  # per decoding sequence in a step: sampling, output processing
    kv_mem_util: float = 0.90  # vLLM's gpu_memory_utilization
    link_util: float = 0.80  # fraction of a link's bandwidth a KV transfer gets
    transfer_latency_s: float = 0.005  # per KV transfer: handshake, metadata, first RDMA read


@dataclass(frozen=True, slots=True)
class Hardware:
    """Per-backend totals (one row per backend, device figure times GPU count), in SI units."""

    gemm_flops: np.ndarray  # FLOP/s at the model's compute dtype
    attn_flops: np.ndarray  # FLOP/s at BF16 (attention kernels run in BF16)
    mem_bw: np.ndarray  # B/s
    mem_bytes: np.ndarray  # B
    scale_up_bw: np.ndarray  # B/s
    scale_out_bw: np.ndarray  # B/s
    gpus: np.ndarray
    step_overhead: np.ndarray  # s per engine step from the catalogue; NaN: Efficiency.step_overhead_s
    request_overhead: np.ndarray  # s per request before its first step; NaN: Efficiency.request_overhead_s
    seq_overhead: np.ndarray  # s per decoding sequence in a step; NaN: Efficiency.seq_overhead_s

    @classmethod
    def of(cls, accelerators: Sequence[Accelerator], gpus: Sequence[int], compute_dtype: str) -> Hardware:
        n = np.asarray(gpus, dtype=float)

        def column(values: Sequence[float], unit: float) -> np.ndarray:
            return np.asarray(values, dtype=float) * unit * n

        return cls(
            gemm_flops=column([a.tflops(compute_dtype) for a in accelerators], TB),
            attn_flops=column([a.tflops("bf16") for a in accelerators], TB),
            mem_bw=column([a.memory_tbps for a in accelerators], TB),
            mem_bytes=column([a.memory_gb for a in accelerators], GB),
            scale_up_bw=column([a.scale_up_gbps for a in accelerators], GB),
            scale_out_bw=column([a.scale_out_gbps for a in accelerators], GB),
            gpus=n,
            step_overhead=_catalogue_column([a.step_overhead_s for a in accelerators]),
            request_overhead=_catalogue_column([a.request_overhead_s for a in accelerators]),
            seq_overhead=_catalogue_column([a.seq_overhead_s for a in accelerators]),
        )

    def row(self, i: int) -> Hardware:
        """One backend, as a 1-row `Hardware` (the scheduler times its steps with it)."""
        return Hardware(*(getattr(self, f)[i : i + 1] for f in HARDWARE_FIELDS))


DEFAULT_EFFICIENCY = Efficiency()
HARDWARE_FIELDS = (
    "gemm_flops",
    "attn_flops",
    "mem_bw",
    "mem_bytes",
    "scale_up_bw",
    "scale_out_bw",
    "gpus",
    "step_overhead",
    "request_overhead",
    "seq_overhead",
)


def _catalogue_column(values: Sequence[float | None]) -> np.ndarray:
    """A per-backend figure the catalogue may leave out: NaN there (the Efficiency default applies)."""
    return np.asarray([np.nan if v is None else v for v in values], dtype=float)


def step_overhead(hw: Hardware, eff: Efficiency = DEFAULT_EFFICIENCY) -> np.ndarray:
    """Per-step fixed cost of each backend: the catalogue's figure where it has one (fitted), else `eff`'s."""
    return np.where(np.isnan(hw.step_overhead), eff.step_overhead_s, hw.step_overhead)


def request_overhead(hw: Hardware, eff: Efficiency = DEFAULT_EFFICIENCY) -> np.ndarray:
    """Latency each request pays before its first engine step (API server, IPC): added to its TTFT once,
    not to any step. The catalogue's figure where it has one (fitted), else `eff`'s."""
    return np.where(np.isnan(hw.request_overhead), eff.request_overhead_s, hw.request_overhead)


def seq_overhead(hw: Hardware, eff: Efficiency = DEFAULT_EFFICIENCY) -> np.ndarray:
    """Per decoding sequence in a step, beyond its share of the GEMMs (sampling, output processing)."""
    return np.where(np.isnan(hw.seq_overhead), eff.seq_overhead_s, hw.seq_overhead)


def kv_replication(model: ModelSpec, hw: Hardware) -> np.ndarray:
    """How many copies of each token's KV the backend holds: MLA's latent is on every TP rank."""
    return hw.gpus if model.attention == "mla" else np.ones_like(hw.gpus)


def expected_experts(routed: int, top_k: int, tokens: ArrayLike) -> ArrayLike:
    """Expected distinct experts (of `routed`) that `tokens` tokens touch, each picking `top_k` at random."""
    return routed * (1.0 - (1.0 - top_k / routed) ** np.asarray(tokens, dtype=float))


def weight_terms(model: ModelSpec) -> np.ndarray:
    """What the weight bytes a step reads depend on, as `weight_bytes` takes them: the always-on weight
    bytes, the bytes of one expert across the MoE layers, the routed experts (0: dense) and the chance a
    token leaves a given expert out."""
    always = (model.total_params - model.routed_params) * model.weight_bytes_per_param
    if model.moe is None:
        return np.array([always, 0.0, 0.0, 1.0])
    routed = model.moe.routed_experts
    expert = model.moe_layers * model.expert_params * model.weight_bytes_per_param
    return np.array([always, expert, routed, 1.0 - model.moe.experts_per_token / routed])


def _weight_bytes(
    tokens: float, always_bytes: float, expert_bytes: float, routed: float, keep: float
) -> float:
    """Weight bytes one forward pass over `tokens` tokens reads (`weight_terms`): always-on weights plus
    the experts some token picked (`expected_experts`)."""
    if routed > 0:
        return always_bytes + expert_bytes * (routed * (1.0 - keep**tokens))
    return always_bytes + 0.0 * tokens


weight_bytes = kernel(_weight_bytes)  # for `_one_step`
_weight_bytes_ufunc = ufunc(_weight_bytes)


def weight_bytes_read(model: ModelSpec, tokens: ArrayLike) -> ArrayLike:
    """`weight_bytes` of `model` for each of `tokens`."""
    return np.asarray(_weight_bytes_ufunc(np.asarray(tokens, dtype=float), *weight_terms(model)))


def causal_pairs(new_tokens: ArrayLike, cached_tokens: ArrayLike) -> ArrayLike:
    """(query, key) pairs of causal attention for `new_tokens` after `cached_tokens`."""
    n = np.asarray(new_tokens, dtype=float)
    return n * np.asarray(cached_tokens, dtype=float) + n * (n + 1.0) / 2.0


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """`step_time`'s constants per backend, folded once (arrays over `Hardware`'s rows): the formula is
    written here, once, and the router's `WorkModel` and `step_time` evaluate it (the simulator's
    `ScalarStepTime` is its float copy for one backend). Folding matters on the request path: the router
    prices five step shapes per decision, and each numpy call costs microseconds."""

    model: ModelSpec  # for the weight bytes a step reads (`weight_terms`)
    linear_s: np.ndarray  # GEMM seconds per token (2 * active params at the compute peak and mfu)
    byte_s: np.ndarray  # seconds to read one byte of weights or KV (bandwidth at bw_util)
    pair_s: np.ndarray  # attention seconds per causal (query, key) pair, BF16
    kv_s: np.ndarray  # decode KV read per token of context
    overhead_s: np.ndarray  # fixed per step
    seq_s: np.ndarray  # per decoding sequence in a step

    @classmethod
    def of(cls, model: ModelSpec, hw: Hardware, eff: Efficiency = DEFAULT_EFFICIENCY) -> StepCoefficients:
        byte_s = 1.0 / (hw.mem_bw * eff.bw_util)
        return cls(
            model=model,
            linear_s=2.0 * model.active_params / (hw.gemm_flops * eff.mfu),
            byte_s=byte_s,
            pair_s=model.attn_flops_per_pair / (hw.attn_flops * eff.mfu),
            kv_s=model.kv_bytes_per_token * kv_replication(model, hw) * byte_s,
            overhead_s=step_overhead(hw, eff),
            seq_s=seq_overhead(hw, eff),
        )

    def table(self) -> np.ndarray:
        """The per-backend coefficients as one C-ordered [6, backends] array, in `one_step`'s order."""
        columns = (self.linear_s, self.byte_s, self.pair_s, self.kv_s, self.overhead_s, self.seq_s)
        return np.ascontiguousarray(np.stack(columns), dtype=float)

    def __call__(
        self,
        prefill_tokens: ArrayLike,
        prefill_pairs: ArrayLike,
        decode_batch: ArrayLike,
        decode_context: ArrayLike,
    ) -> np.ndarray:
        """Seconds for one engine step per backend (see `step_time`); inputs broadcast against the rows."""
        w = weight_terms(self.model)
        columns = (self.linear_s, self.byte_s, self.pair_s, self.kv_s, self.overhead_s, self.seq_s)
        inputs = (prefill_tokens, prefill_pairs, decode_batch, decode_context)
        floats = [np.asarray(x, dtype=float) for x in (*inputs, *columns)]
        return np.asarray(_step_ufunc(*floats, *w))


def _one_step(
    prefill_tokens: float,
    prefill_pairs: float,
    batch: float,
    context: float,
    linear_s: float,
    byte_s: float,
    pair_s: float,
    kv_s: float,
    overhead_s: float,
    seq_s: float,
    always_bytes: float,
    expert_bytes: float,
    routed: float,
    keep: float,
) -> float:
    """Seconds for one engine step on one backend: the formula in the module's docstring, written once.
    Coefficients as `StepCoefficients` folds them, the model's weights as `weight_terms` gives them."""
    tokens = prefill_tokens + batch
    if not tokens > 0:
        return 0.0
    gemm = max(linear_s * tokens, weight_bytes(tokens, always_bytes, expert_bytes, routed, keep) * byte_s)
    attention = max(pair_s * (prefill_pairs + context), kv_s * context)
    return gemm + attention + seq_s * batch + overhead_s


one_step = kernel(_one_step)  # for other kernels (`scoring/load.py`)
_step_ufunc = ufunc(_one_step)  # for arrays that broadcast


def step_time(
    model: ModelSpec,
    hw: Hardware,
    prefill_tokens: ArrayLike,
    prefill_pairs: ArrayLike,
    decode_batch: ArrayLike,
    decode_context: ArrayLike,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> np.ndarray:
    """Seconds for one engine step mixing prefill chunks and decodes.

    `prefill_pairs` is the causal (query, key) pair count of the prefill chunks (`causal_pairs`);
    `decode_context` the total tokens of context the decoding sequences attend over. The formula is
    `StepCoefficients`'; callers that time many steps on one set of backends keep the coefficients.
    """
    return StepCoefficients.of(model, hw, eff)(prefill_tokens, prefill_pairs, decode_batch, decode_context)


def prefill_time(
    model: ModelSpec,
    hw: Hardware,
    new_tokens: ArrayLike,
    cached_tokens: ArrayLike = 0,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> np.ndarray:
    """Seconds to prefill `new_tokens` after `cached_tokens` already in cache, alone, in one pass."""
    return step_time(model, hw, new_tokens, causal_pairs(new_tokens, cached_tokens), 0, 0, eff)


def decode_step_time(
    model: ModelSpec,
    hw: Hardware,
    batch: ArrayLike,
    context_tokens: ArrayLike,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> np.ndarray:
    """Seconds for one decode step of `batch` sequences attending over `context_tokens` in total."""
    return step_time(model, hw, 0, 0, batch, context_tokens, eff)


def kv_transfer_time(
    model: ModelSpec,
    src: Hardware,
    dst: Hardware,
    tokens: ArrayLike,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    same_server: bool = False,
) -> np.ndarray:
    """Seconds to move `tokens` tokens of KV from `src` to `dst`, bounded by the slower side's links."""
    field = "scale_up_bw" if same_server else "scale_out_bw"
    per_copy = np.minimum(
        getattr(src, field) / kv_replication(model, src), getattr(dst, field) / kv_replication(model, dst)
    )
    volume = np.asarray(tokens, dtype=float) * model.kv_bytes_per_token
    return volume / (per_copy * eff.link_util) + eff.transfer_latency_s


def kv_capacity_tokens(model: ModelSpec, hw: Hardware, eff: Efficiency = DEFAULT_EFFICIENCY) -> np.ndarray:
    """Tokens of KV that fit after the weights, at vLLM's memory utilisation (0 when weights do not fit)."""
    free = hw.mem_bytes * eff.kv_mem_util - model.weight_bytes
    per_token = model.kv_bytes_per_token * kv_replication(model, hw)
    return np.floor(np.maximum(free, 0.0) / per_token)


class ScalarStepTime:
    """`StepCoefficients` for one backend in plain floats, `weight_bytes_read` folded in (the simulator
    calls it once per engine step, where numpy's per-call overhead would dominate). Same formula, tested
    equal."""

    def __init__(self, model: ModelSpec, hw: Hardware, eff: Efficiency = DEFAULT_EFFICIENCY) -> None:
        c = StepCoefficients.of(model, hw, eff)
        byte_s = float(c.byte_s[0])
        self.linear_s = float(c.linear_s[0])
        self.always_s = (model.total_params - model.routed_params) * model.weight_bytes_per_param * byte_s
        self.experts = model.moe.routed_experts if model.moe else 0
        self.miss = 1.0 - model.moe.experts_per_token / model.moe.routed_experts if model.moe else 1.0
        self.expert_s = model.moe_layers * model.expert_params * model.weight_bytes_per_param * byte_s
        self.pair_s = float(c.pair_s[0])
        self.kv_s = float(c.kv_s[0])
        self.overhead_s = float(c.overhead_s[0])
        self.seq_s = float(c.seq_s[0])

    def __call__(
        self, prefill_tokens: int, prefill_pairs: float, decode_batch: int, decode_context: int
    ) -> float:
        tokens = prefill_tokens + decode_batch
        if tokens <= 0:
            return 0.0
        weights = self.always_s + self.expert_s * self.experts * (1.0 - self.miss**tokens)
        gemm = max(self.linear_s * tokens, weights)
        attention = max(self.pair_s * (prefill_pairs + decode_context), self.kv_s * decode_context)
        return gemm + attention + self.seq_s * decode_batch + self.overhead_s
