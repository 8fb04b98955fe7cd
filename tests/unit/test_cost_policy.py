"""The cost policy: predicted TTFT from the roofline, prefix hits, load, and online correction."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.catalog import load_catalog
from scoring.cost_policy import CostRanker
from scoring.router import build_router
from scoring.types import BackendSpec, BackendStats, Candidates, Mode, Outcome, RequestFeatures, Role

BOTH = frozenset({Role.PREFILL, Role.DECODE})


@pytest.fixture(scope="module")
def deepseek():
    return load_catalog().model("deepseek-r1")


def cluster(loads=(0, 0), cached=(0, 0)) -> Candidates:
    specs = (
        BackendSpec("mi300x-0", "m", "mi300x", 8, BOTH),
        BackendSpec("mi308x-0", "m", "mi308x", 8, BOTH),
    )
    stats = tuple(BackendStats(in_flight=ld) for ld in loads)
    return Candidates.build(specs, stats, np.array(cached, dtype=np.int64))


def long_prompt() -> RequestFeatures:
    return RequestFeatures("m", prompt_tokens=8000, max_tokens=64)


def test_compute_rich_backend_prefills_long_prompts_faster(deepseek):
    ranker = CostRanker(deepseek)
    predicted = ranker.predicted_ttft(long_prompt(), cluster())
    assert predicted[1] / predicted[0] > 3  # MI308X has ~18 % of MI300X's FP8 compute
    assert ranker.rank(long_prompt(), cluster(), np.array([True, True]))[0] == 0


def test_a_cached_prefix_can_outweigh_compute(deepseek):
    ranker = CostRanker(deepseek)
    order = ranker.rank(long_prompt(), cluster(cached=(0, 7900)), np.array([True, True]))
    assert order[0] == 1


def test_load_moves_traffic_off_a_busy_fast_backend(deepseek):
    ranker = CostRanker(deepseek)
    assert ranker.rank(long_prompt(), cluster(loads=(20, 0)), np.array([True, True]))[0] == 1


def test_measured_ttft_corrects_the_model(deepseek):
    router = build_router("cost", "never", model=deepseek)
    candidates = cluster()
    predicted = router.ranker.predicted_ttft(long_prompt(), candidates)
    assert router.plan(long_prompt(), candidates).aggregated[0] == 0
    for _ in range(60):  # the MI300X turns out 10x slower than its roofline says
        router.observe(Outcome("mi300x-0", Mode.AGGREGATED, 8000, 0, 64, float(predicted[0]) * 10, 1.0))
    assert router.ranker.correction("mi300x-0") == pytest.approx(10, rel=0.05)
    assert router.plan(long_prompt(), candidates).aggregated[0] == 1


def test_unknown_backend_outcomes_are_ignored(deepseek):
    ranker = CostRanker(deepseek)
    ranker.observe(Outcome("ghost", Mode.AGGREGATED, 10, 0, 1, 1.0, 1.0))
    assert ranker.correction("ghost") == 1.0


def split_cluster(loads=(0, 0), cached=(0, 0)) -> Candidates:
    specs = (
        BackendSpec("mi300x-0", "m", "mi300x", 8, frozenset({Role.PREFILL})),
        BackendSpec("mi308x-0", "m", "mi308x", 8, frozenset({Role.DECODE})),
    )
    stats = tuple(BackendStats(in_flight=ld) for ld in loads)
    return Candidates.build(specs, stats, np.array(cached, dtype=np.int64))


@pytest.mark.parametrize(
    ("loads", "cached", "mode", "reason"),
    [
        ((0, 0), (0, 0), Mode.PD, "split"),  # MI300X prefills 8k tokens far faster than the MI308X
        ((0, 0), (0, 7900), Mode.AGGREGATED, "split_costlier"),  # the decode backend holds the prompt
        ((60, 0), (0, 0), Mode.AGGREGATED, "split_costlier"),  # the prefill backend is buried
    ],
)
def test_auto_splits_when_the_cost_model_says_it_pays(deepseek, loads, cached, mode, reason):
    router = build_router("cost", "auto", pd_min_prompt_tokens=0, model=deepseek)
    plan = router.plan(long_prompt(), split_cluster(loads, cached))
    assert (plan.mode, plan.reason) == (mode, reason)


def test_auto_decodes_on_the_bandwidth_side_and_prefills_on_the_compute_side(deepseek):
    specs = (
        BackendSpec("mi300x-0", "m", "mi300x", 8, BOTH),
        BackendSpec("mi308x-0", "m", "mi308x", 8, frozenset({Role.DECODE})),
    )
    candidates = Candidates.build(specs, (BackendStats(in_flight=3), BackendStats()), np.zeros(2, np.int64))
    router = build_router("cost", "auto", pd_min_prompt_tokens=0, model=deepseek)
    plan = router.plan(long_prompt(), candidates)
    # Aggregated, the MI300X would still be the fastest first token even with 3 requests ahead of it ...
    assert plan.aggregated[0] == 0
    # ... but the split (prefill there, decode on the idle MI308X) reaches the first token sooner still.
    assert (plan.mode, plan.prefill, plan.decode[0]) == (Mode.PD, (0,), 1)
