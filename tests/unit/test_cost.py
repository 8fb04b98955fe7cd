"""Physics of the roofline cost model: monotonic, right regimes, right ratios between accelerators."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scoring.catalog import load_catalog
from scoring.cost import (
    Efficiency,
    Hardware,
    ScalarStepTime,
    causal_pairs,
    decode_step_time,
    expected_experts,
    kv_capacity_tokens,
    kv_transfer_time,
    prefill_time,
    step_time,
    weight_bytes_read,
)

CATALOG = load_catalog()
R1 = CATALOG.model("deepseek-r1")
LLAMA8 = CATALOG.model("llama-3.1-8b")


def hardware(*names: str, gpus: int = 8, dtype: str = "fp8") -> Hardware:
    return Hardware.of([CATALOG.accelerator(n) for n in names], [gpus] * len(names), dtype)


def test_prefill_grows_with_new_and_with_cached_tokens() -> None:
    hw = hardware("mi300x")
    lengths = np.array([128, 1024, 4096, 16384])
    assert np.all(np.diff(prefill_time(R1, hw, lengths[:, None])[:, 0]) > 0)
    cached = np.array([0, 4096, 32768])
    assert np.all(np.diff(prefill_time(R1, hw, 1024, cached[:, None])[:, 0]) > 0)


def test_attention_makes_prefill_superlinear() -> None:
    hw = hardware("h100-sxm")
    short, long = prefill_time(R1, hw, 8192)[0], prefill_time(R1, hw, 65536)[0]
    assert long / short > 8.0


def test_compute_ratio_shows_in_long_prefill() -> None:
    mi300x, mi308x = CATALOG.accelerator("mi300x"), CATALOG.accelerator("mi308x")
    ratio = mi300x.fp8_tflops / mi308x.fp8_tflops
    times = prefill_time(R1, hardware("mi300x", "mi308x"), 16384)
    assert ratio == pytest.approx(5.56, abs=0.01)
    assert times[1] / times[0] == pytest.approx(ratio, rel=0.03)


def test_equal_bandwidth_shows_in_small_batch_decode() -> None:
    times = decode_step_time(R1, hardware("mi300x", "mi308x"), 4, 4 * 8192)
    assert times[0] == pytest.approx(times[1], rel=1e-12)


def test_decode_is_memory_bound_at_small_batch_and_compute_bound_at_large() -> None:
    hw = hardware("h100-sxm", gpus=1, dtype="bf16")
    batches = np.array([1, 2, 4, 8])
    small = decode_step_time(LLAMA8, hw, batches[:, None], 0)[:, 0]
    # Memory-bound: reading the weights dominates, so doubling the batch barely changes the step.
    assert small[-1] / small[0] < 1.05
    huge = decode_step_time(LLAMA8, hw, np.array([[4096], [8192]]), 0)[:, 0]
    # Compute-bound: the step scales with the batch.
    assert huge[1] / huge[0] == pytest.approx(2.0, rel=0.05)


def test_per_token_decode_cost_falls_with_batch() -> None:
    hw = hardware("mi300x")
    batches = np.array([1, 4, 16, 64])
    per_token = decode_step_time(R1, hw, batches[:, None], batches[:, None] * 4096)[:, 0] / batches
    assert np.all(np.diff(per_token) < 0)


def test_moe_expert_coverage_grows_with_batch() -> None:
    assert expected_experts(256, 8, 1) == pytest.approx(8.0)
    coverage = expected_experts(256, 8, np.array([1, 8, 64, 1024]))
    assert np.all(np.diff(coverage) > 0)
    assert coverage[-1] == pytest.approx(256, rel=1e-3)
    one, many = weight_bytes_read(R1, 1), weight_bytes_read(R1, 100_000)
    assert many == pytest.approx(R1.weight_bytes, rel=1e-3)
    assert one < 0.1 * many


def test_dense_model_reads_all_weights_whatever_the_batch() -> None:
    assert weight_bytes_read(LLAMA8, 1) == weight_bytes_read(LLAMA8, 512) == LLAMA8.weight_bytes


def test_prefill_chunk_slows_the_decodes_sharing_its_step() -> None:
    hw = hardware("mi300x")
    alone = step_time(R1, hw, 0, 0, 32, 32 * 4096)[0]
    mixed = step_time(R1, hw, 4096, causal_pairs(4096, 0), 32, 32 * 4096)[0]
    assert mixed > 1.5 * alone


def test_kv_transfer_linear_in_tokens_and_bounded_by_the_slower_link() -> None:
    eff = Efficiency(transfer_latency_s=0.0)
    fast, slow = hardware("b300"), hardware("h100-sxm")
    t = kv_transfer_time(LLAMA8, fast, slow, np.array([1000, 2000]), eff)
    assert t[1] == pytest.approx(2 * t[0])
    assert kv_transfer_time(LLAMA8, fast, slow, 1000, eff) == pytest.approx(
        kv_transfer_time(LLAMA8, slow, slow, 1000, eff)
    )
    assert kv_transfer_time(LLAMA8, fast, fast, 1000, eff) < kv_transfer_time(LLAMA8, slow, slow, 1000, eff)
    assert kv_transfer_time(LLAMA8, slow, slow, 0)[0] == Efficiency().transfer_latency_s


def test_kv_capacity_after_weights() -> None:
    caps = kv_capacity_tokens(R1, hardware("mi300x", "h100-sxm"))
    assert caps[0] > 1_000_000  # 8x192 GB holds 671 GB of FP8 weights with plenty left
    assert caps[1] == 0  # 8x80 GB does not hold them at all
    more_memory = kv_capacity_tokens(LLAMA8, hardware("h200", "h100-sxm", gpus=1, dtype="bf16"))
    assert more_memory[0] > more_memory[1] > 0


def test_vectorised_rows_equal_single_backend_calls() -> None:
    hw = hardware("mi300x", "mi308x", "h200", "gaudi3")
    together = step_time(R1, hw, 512, causal_pairs(512, 1024), 16, 16 * 2048)
    alone = [step_time(R1, hw.row(i), 512, causal_pairs(512, 1024), 16, 16 * 2048)[0] for i in range(4)]
    np.testing.assert_allclose(together, alone)


def test_scalar_fast_path_equals_the_vectorised_formula() -> None:
    rng = np.random.default_rng(7)
    # `cpu` carries catalogue overheads (step, per sequence); the others fall back to Efficiency's.
    for name, model in (("mi308x", R1), ("h100-sxm", LLAMA8), ("cpu", CATALOG.model("tiny-cpu"))):
        hw = hardware(name, dtype=model.compute_dtype)
        fast = ScalarStepTime(model, hw)
        for _ in range(50):
            n, c, b = (int(x) for x in rng.integers(0, 5000, 3))
            ctx = b * int(rng.integers(1, 8000))
            expected = step_time(model, hw, n, causal_pairs(n, c), b, ctx)[0]
            assert fast(n, float(causal_pairs(n, c)), b, ctx) == pytest.approx(expected, rel=1e-9)


def test_catalogue_overheads_replace_the_efficiency_defaults() -> None:
    tiny = CATALOG.model("tiny-cpu")
    cpu, h100 = CATALOG.accelerator("cpu"), CATALOG.accelerator("h100-sxm")
    assert cpu.step_overhead_s is not None and cpu.seq_overhead_s is not None and h100.step_overhead_s is None
    bare = dataclasses.replace(cpu, step_overhead_s=None, seq_overhead_s=None)
    hw = Hardware.of([cpu, bare, h100], [1, 1, 1], "bf16")
    eff = Efficiency(step_overhead_s=0.5, seq_overhead_s=0.25)
    four = step_time(tiny, hw, 0, 0, 4, 40, eff)
    # The catalogue's figures where it has them, Efficiency's where it does not: exactly the difference.
    expected = (0.5 + 4 * 0.25) - (cpu.step_overhead_s + 4 * cpu.seq_overhead_s)
    assert four[1] - four[0] == pytest.approx(expected, rel=1e-9)
    assert four[2] > 0.5 + 4 * 0.25
