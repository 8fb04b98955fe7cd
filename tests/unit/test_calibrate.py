"""`hetgate sim calibrate`'s fit: synthetic measurements made with known figures give those figures back.

The measurements are the simulator scheduler's own predictions (`predict`) with chosen figures, optionally
with multiplicative noise; the fit starts from the catalogue's entry, far from them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.fidelity_workload import WORKLOADS, Point
from bench.sim.calibrate import (
    FIGURES,
    Observation,
    catalogue_block,
    fit,
    predict,
    predict_point,
    replace_block,
    timer_for,
    with_figures,
)
from bench.sim.sched_core import SchedulerConfig
from scoring.catalog import load_catalog

CONFIG = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048, block_size=128)
# Figures of the order a CPU server shows, none equal to the catalogue's, so the fit has to move.
TRUE = {
    "bf16_tflops": 0.08,
    "memory_tbps": 0.02,
    "step_overhead_s": 0.004,
    "request_overhead_s": 0.012,
    "seq_overhead_s": 0.0009,
}
# bf16_tflops sets the prefill slope, request_overhead_s the TTFT intercept, seq_overhead_s how ITL grows
# with concurrency: these are identifiable from the points. A step's fixed cost and its weight-read floor
# (memory_tbps) both add a constant to every small step, so only their effect is checked.
IDENTIFIABLE = ("bf16_tflops", "request_overhead_s", "seq_overhead_s")


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _truth(catalog):
    start = catalog.accelerator("cpu")
    return start, with_figures(start, [TRUE[name] for name in FIGURES])


def _measure(catalog, points, accelerator, noise: float = 0.0, seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    observed = predict(points, catalog.model("tiny-cpu"), accelerator, CONFIG)
    return [Observation(*(o.vector() * (1.0 + noise * rng.standard_normal(3)))) for o in observed]


def _start_far(start):
    # Every figure 3x off the truth, alternately high and low.
    return with_figures(start, [TRUE[name] * (3.0 if i % 2 else 1 / 3) for i, name in enumerate(FIGURES)])


def test_exact_measurements_give_the_figures_back(catalog) -> None:
    start, truth = _truth(catalog)
    points = WORKLOADS["fit"]
    result = fit(
        points, _measure(catalog, points, truth), catalog.model("tiny-cpu"), _start_far(start), CONFIG
    )
    for name in IDENTIFIABLE:
        assert getattr(result.accelerator, name) == pytest.approx(TRUE[name], rel=0.02), name
    assert max(result.max_abs_error().values()) < 0.01


def test_noisy_measurements_give_the_figures_back_within_the_noise(catalog) -> None:
    start, truth = _truth(catalog)
    points = WORKLOADS["fit"]
    measured = _measure(catalog, points, truth, noise=0.03, seed=7)
    result = fit(points, measured, catalog.model("tiny-cpu"), _start_far(start), CONFIG)
    for name in IDENTIFIABLE:
        assert getattr(result.accelerator, name) == pytest.approx(TRUE[name], rel=0.15), name
    # Fitted on noisy points, it still predicts the held-out ones (noise-free) closely.
    held_out = WORKLOADS["holdout"]
    expected = _measure(catalog, held_out, truth)
    got = predict(held_out, catalog.model("tiny-cpu"), result.accelerator, CONFIG)
    errors = np.abs(np.array([g.vector() / e.vector() - 1 for g, e in zip(got, expected, strict=True)]))
    assert np.nanmedian(errors) < 0.05


def test_the_replay_sees_prefix_hits_and_batching(catalog) -> None:
    _, truth = _truth(catalog)
    timer = timer_for(catalog.model("tiny-cpu"), truth)
    cold = predict_point(Point("c", 1024, 8), timer, CONFIG)
    cached = predict_point(Point("h", 1024, 8, cached=True), timer, CONFIG)
    assert cached.ttft_ms < 0.5 * cold.ttft_ms  # 896 of 1,024 tokens come from the cache
    alone = predict_point(Point("a", 128, 32), timer, CONFIG)
    eight = predict_point(Point("b", 128, 32, concurrency=8), timer, CONFIG)
    assert eight.itl_ms > alone.itl_ms  # each decoding sequence costs its share of a step
    assert eight.throughput_tps > 2 * alone.throughput_tps  # ... but a batch of 8 outruns one (real: 2.3x)
    mixed = predict_point(Point("m", 1536, 1, background=4), timer, CONFIG)
    assert mixed.itl_ms > 5 * alone.itl_ms  # decodes wait for the long prefill that shares their step


def test_the_catalogue_entry_is_replaced_in_place(catalog) -> None:
    accelerator = dataclasses.replace(catalog.accelerator("cpu"), bf16_tflops=0.123, step_overhead_s=0.004)
    text = (
        "accelerators:\n  a:\n    vendor: x\n\n"
        "  cpu:\n    vendor: old\n    # old note\n    bf16_tflops: 1\n\n"
        "  z:\n    vendor: y\n"
    )
    out = replace_block(text, "cpu", catalogue_block(accelerator, ["fitted"]))
    assert "old" not in out
    assert out.startswith("accelerators:\n  a:\n    vendor: x\n\n  cpu:\n")
    assert out.endswith("\n\n  z:\n    vendor: y\n")
    assert "    # fitted\n    bf16_tflops: 0.123\n" in out and "    step_overhead_s: 0.004\n" in out
    appended = replace_block("accelerators:\n  a:\n    vendor: x\n", "cpu", catalogue_block(accelerator, []))
    assert appended.startswith("accelerators:\n  a:\n    vendor: x\n\n  cpu:\n    vendor: generic\n")


def test_a_written_entry_loads_back_with_its_figures(catalog, tmp_path) -> None:
    from scoring.catalog import CONFIG_DIR

    fitted = with_figures(catalog.accelerator("cpu"), [TRUE[name] for name in FIGURES])
    path = tmp_path / "accelerators.yaml"
    source = (CONFIG_DIR / "accelerators.yaml").read_text()
    path.write_text(replace_block(source, "cpu", catalogue_block(fitted, ["test"])))
    loaded = load_catalog(accelerators_path=path).accelerator("cpu")
    for name in FIGURES:
        assert getattr(loaded, name) == pytest.approx(TRUE[name], rel=1e-3), name
    assert load_catalog(accelerators_path=path).accelerator("mi300x") == catalog.accelerator("mi300x")
