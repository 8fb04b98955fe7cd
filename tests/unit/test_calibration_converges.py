"""The cost policy's online calibration, run against the simulator: the simulated backends run at their
cluster's own efficiency, which the router does not know, so what the router learns can be compared
with the truth. Bursts included: prompts that arrive together share an engine step, which no plan can
see; calibration must count that as queue, not as slowness.

The truth is the ratio of the simulator's prefill time to the roofline's over the workload's own prompt
lengths (10th to 90th percentile): at other efficiencies than the roofline's the ratio depends on the
length (the AMD cluster's MI308X: 2.69 at 200 tokens, 2.91 at 1,536), and a backend learns it for the
prompts it prefills (the MI308X servers mostly short ones: the long ones are split to the MI300X)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from bench.policies import build_scenario, cluster_named, make_router, scenario_bound
from bench.sim.des import Simulation
from scoring.cost import DEFAULT_EFFICIENCY, prefill_time
from scoring.types import Leg, Outcome, Prediction


@pytest.mark.parametrize(
    ("scenario", "requests", "load", "policy", "tolerance"),
    [
        ("bursty@nvidia", 200, 0.1, "cost/auto", 0.1),
        ("azure-conv@amd", 200, 0.1, "cost/auto", 0.1),
        # Sustained load, queues ten times a prompt's own prefill, a queue model 30-50 % pessimistic:
        # one factor on the compute part swung between its clips (0.1 and 10) here; the fit's compute
        # stays within 20 % while its queue factor takes the queue model's error (0.5-0.65).
        ("sysprompt@nvidia", 2000, 0.8, "cost/never", 0.25),
        # Bursts at half the fluid bound: the B200's prompts wait 5-10x their own prefill. Weighted
        # alike, those outcomes read the queue model's error as slowness (B200 2.45 under `never`,
        # 1.45 under `auto`; 1.79 and 1.29 once a running step took no more prompts).
        ("bursty@nvidia", 1000, 0.5, "cost/never", 0.1),
        ("bursty@nvidia", 1000, 0.5, "cost/auto", 0.1),
    ],
)
def test_learnt_compute_corrections_approach_the_truth(
    scenario: str, requests: int, load: float, policy: str, tolerance: float
) -> None:
    sc = build_scenario(scenario, requests)
    cluster = cluster_named(sc.cluster)
    router = make_router(cluster, policy)
    Simulation(cluster.model, cluster.backends, router, cluster.efficiency).run(
        sc.at_rate(load * scenario_bound(sc).requests_per_s)
    )
    hw = cluster.hardware()
    lengths = np.quantile([r.prompt_len for r in sc.requests], [0.1, 0.9]).astype(int)
    model, efficiency = cluster.model, cluster.efficiency
    truth = np.array(
        [prefill_time(model, hw, n, 0, efficiency) / prefill_time(model, hw, n, 0, DEFAULT_EFFICIENCY)
         for n in lengths]
    )  # fmt: skip
    for backend_id, low, high in zip(cluster.ids, truth.min(axis=0), truth.max(axis=0), strict=True):
        learnt = router.correction(backend_id)
        assert low * (1 - tolerance) <= learnt <= high * (1 + tolerance), (backend_id, learnt, low, high)


def ttft_ratios(
    scenario: str, requests: int, load: float, policy: str, counts: Callable[[Prediction, Leg], bool]
) -> dict[str, list[float]]:
    """Per backend, measured over roofline-predicted TTFT (queue, own prefill, and the prompts that
    joined its step after it was planned: `Joined`) of the prefills `counts` keeps, at `load` times the
    fluid bound. The scenario's cluster runs at the roofline's own efficiency."""
    sc = build_scenario(scenario, requests)
    cluster = cluster_named(sc.cluster)
    assert cluster.efficiency == DEFAULT_EFFICIENCY  # the roofline is the truth here
    router = make_router(cluster, policy)
    ratios: dict[str, list[float]] = {}
    ranker_observe = router.observe

    def observe(outcome: Outcome) -> None:
        p = outcome.predicted
        if p is not None and counts(p, outcome.leg):
            joined = p.joined.seconds if p.joined is not None else 0.0
            predicted = p.roofline_compute_s + p.roofline_queue_s + joined
            ratios.setdefault(outcome.backend_id, []).append(outcome.ttft_s / predicted)
        ranker_observe(outcome)

    router.observe = observe
    Simulation(cluster.model, cluster.backends, router, cluster.efficiency).run(
        sc.at_rate(load * scenario_bound(sc).requests_per_s)
    )
    return ratios


def ttft_over_predicted(
    scenario: str, requests: int, load: float, policy: str, counts: Callable[[Prediction, Leg], bool]
) -> dict[str, float]:
    """Per backend, the median of `ttft_ratios`."""
    ratios = ttft_ratios(scenario, requests, load, policy, counts)
    assert set(ratios) == set(cluster_named(build_scenario(scenario, requests).cluster).ids)
    return {b: float(np.median(r)) for b, r in ratios.items()}


@pytest.mark.parametrize(
    ("scenario", "requests", "load"),
    [("sysprompt@nvidia", 2000, 0.8), ("bursty@nvidia", 1000, 0.5)],
)
def test_the_queue_a_prefill_is_priced_with_is_the_queue_it_meets(scenario: str, requests: int, load: float):
    """At the simulator's own efficiency, a whole request's time to first token is its roofline
    prediction: median measured over predicted, per backend, within 10 %. With a step taken as joinable
    until its prompts' first tokens, the B200 read 0.70 on shared system prompts (its queue looked 1.4x
    what it was), and calibration took the rest for slowness."""
    whole = ttft_over_predicted(scenario, requests, load, "cost/never", lambda p, leg: leg is Leg.AGGREGATED)
    assert all(0.9 <= m <= 1.1 for m in whole.values()), whole


def queue_bound(p: Prediction, leg: Leg) -> bool:
    """A prefill whose queue was over twice its own prefill."""
    return leg is not Leg.DECODE and p.roofline_queue_s > 2 * p.roofline_compute_s


def test_a_queue_of_long_prompts_is_priced_as_the_part_still_to_compute():
    """Mooncake's prompts take two 8k-token steps each. A prompt queued behind one in progress meets
    only its remaining part; counted whole until its first token, the CPX's queues of such prompts came
    to 0.66 of their prediction (median measured over predicted TTFT of the queue-bound prefills; the
    H100s' 0.85 and 0.76). With the prompt in progress dated by its predicted prefill
    (`Reserved.head_s`): 0.83, 1.00 and 1.09; priced as the step in progress and the steps behind it,
    0.98, 1.09 and 1.14 (the H100s' from 9 and 14 prefills). Every backend within 20 %, over 2,000
    requests: at 1,000 the H100s had 7-14 queue-bound prefills, too few for a median (h100-1 read 1.22
    once splits had to meet the TTFT target with their learnt headroom; 1.05 and 1.07 over 2,000, from
    52 and 38, the CPX 0.98)."""
    medians = ttft_over_predicted("mooncake@cpx", 2000, 0.5, "cost/auto", queue_bound)
    assert all(0.8 <= m <= 1.2 for m in medians.values()), medians


@pytest.mark.parametrize(
    ("scenario", "backends"),
    [("azure-conv@cpx", ("cpx-0",)), ("azure-conv@nvidia", ("b200-0", "h100-0", "h100-1"))],
)
def test_a_queue_of_short_prompts_is_the_step_in_progress_and_the_steps_behind_it(
    scenario: str, backends: tuple[str, ...]
):
    """Azure conversation prompts fit in a step. A prompt planned while one runs waits for what is left
    of it, then takes a step of its own with the prompts that waited beside it, reading the weights
    again. Priced as one pass with the step in progress, queue-bound prefills came to 1.26 of their
    prediction on the CPX (a weight-bound step: the second read was missing) and to 0.79, 0.64 and
    0.76 on the B200 and H100s (the step in progress was counted whole); now 1.00, 0.98, 1.00, 1.00.
    Within 10 % (the CPX cluster's H100s see too few queue-bound prefills to tell)."""
    medians = ttft_over_predicted(scenario, 1000, 0.5, "cost/auto", queue_bound)
    assert all(0.9 <= medians[b] <= 1.1 for b in backends), medians


def test_a_prefix_evicted_before_its_prompt_is_admitted_is_not_priced_as_cached():
    """Eight-turn conversations on the CPX cluster, a quarter of the fluid bound: the CPX's KV cache
    cycles in seconds, so a conversation's prefix that the index shows when its next turn is planned is
    often evicted by the queue ahead before vLLM admits that turn. Counted as cached (a ninth of the
    turn's real work reserved), the CPX's queue-bound prefills took 6.95x their prediction (median)
    and its prefills' 90th percentile 3.49x; with the prefix discounted by what its prompts lately
    found (`CacheSurvival`): 1.10 and 1.07."""
    queue_bound_cpx = ttft_ratios("multiturn@cpx", 1000, 0.25, "cost/auto", queue_bound)["cpx-0"]
    assert 0.8 <= np.median(queue_bound_cpx) <= 1.2
    cpx = ttft_ratios("multiturn@cpx", 1000, 0.25, "cost/auto", lambda p, leg: leg is not Leg.DECODE)["cpx-0"]
    assert np.quantile(cpx, 0.9) <= 1.25


def test_a_splits_learnt_headroom_is_the_90th_percentile_of_its_pairs_ttft_error():
    """B200 + 2x H100 bursts at half the fluid bound, `auto`: the H100s prefill splits that the B200
    decodes, and those splits' TTFTs spread wide (a burst's prompts share steps no plan sees). Each
    pair's headroom, learnt as a running quantile, is the 90th percentile of what its splits measured
    over predicted (their last 150, within 15 %: the quantile moves as the load does)."""
    sc = build_scenario("bursty@nvidia", 1000)
    cluster = cluster_named(sc.cluster)
    router = make_router(cluster, "cost/auto")
    ratios: dict[str, list[float]] = {}
    ranker_observe = router.observe

    def observe(outcome: Outcome) -> None:
        p = outcome.predicted
        if p is not None and outcome.leg is Leg.DECODE:
            ratios.setdefault(f"headroom/{outcome.peer_id}/{outcome.backend_id}", []).append(
                outcome.request_ttft_s / p.ttft_s
            )
        ranker_observe(outcome)

    router.observe = observe
    Simulation(cluster.model, cluster.backends, router, cluster.efficiency).run(
        sc.at_rate(0.5 * scenario_bound(sc).requests_per_s)
    )
    learnt = router.calibration()
    busy = {pair: r for pair, r in ratios.items() if len(r) >= 150}
    assert busy, {pair: len(r) for pair, r in ratios.items()}
    for pair, r in busy.items():
        assert learnt[pair] == pytest.approx(np.quantile(r[-150:], 0.9), rel=0.15), (pair, learnt[pair])
