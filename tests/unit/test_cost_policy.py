"""The cost policy: plans priced in seconds of work (roofline, prefix hits, work queued), the SLO, and
calibration that converges."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.catalog import load_catalog
from scoring.cost import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Hardware,
    StepCoefficients,
    causal_pairs,
    prefill_time,
)
from scoring.cost_policy import SHORTLIST, CostRanker, _cobatched, _order, _pairs, _shortlist
from scoring.outcome import Measured, outcomes_of
from scoring.router import build_router
from scoring.types import (
    BackendSpec,
    BackendStats,
    Candidates,
    Leg,
    Mode,
    Outcome,
    Prediction,
    RequestFeatures,
    Role,
)

BOTH = frozenset({Role.PREFILL, Role.DECODE})
P = frozenset({Role.PREFILL})
D = frozenset({Role.DECODE})


@pytest.fixture(scope="module")
def deepseek():
    return load_catalog().model("deepseek-r1")


def queued(prompts: int, tokens: int = 8000) -> BackendStats:
    """A backend with `prompts` requests of `tokens` reserved and not yet prefilled."""
    return BackendStats(
        in_flight=prompts,
        prefill_tokens=prompts * tokens,
        prefill_seqs=prompts,
        decode_seqs=prompts,
        context_tokens=prompts * tokens,
    )


IDLE = (BackendStats(), BackendStats())


def cluster(stats=IDLE, cached=(0, 0), roles=(BOTH, BOTH)) -> Candidates:
    specs = (
        BackendSpec("mi300x-0", "m", "mi300x", 8, roles[0]),
        BackendSpec("mi308x-0", "m", "mi308x", 8, roles[1]),
    )
    return Candidates.build(specs, tuple(stats), np.array(cached, dtype=np.int64))


def hardware(model) -> Hardware:
    """`cluster()`'s backends as the roofline sees them."""
    catalog = load_catalog()
    return Hardware.of(
        [catalog.accelerator("mi300x"), catalog.accelerator("mi308x")], [8, 8], model.compute_dtype
    )


def fixed_step(model) -> np.ndarray:
    """The fixed seconds of one engine step on each of `cluster()`'s backends, which no correction scales."""
    return StepCoefficients.of(model, hardware(model)).overhead_s


def long_prompt(**slo: float) -> RequestFeatures:
    return RequestFeatures("m", prompt_tokens=8000, max_tokens=64, **slo)


def test_compute_rich_backend_prefills_long_prompts_faster(deepseek):
    ranker = CostRanker(deepseek)
    predicted = ranker.predicted_ttft(long_prompt(), cluster())
    assert predicted[1] / predicted[0] > 3  # MI308X has ~18 % of MI300X's FP8 compute
    assert build_router("cost", model=deepseek).plan(long_prompt(), cluster()).aggregated[0] == 0


def test_a_cached_prefix_can_outweigh_compute(deepseek):
    plan = build_router("cost", model=deepseek).plan(long_prompt(), cluster(cached=(0, 7900)))
    assert plan.aggregated[0] == 1


def test_a_prefix_the_backend_keeps_evicting_before_admission_does_not(deepseek):
    """The index says the MI308X holds 7,900 tokens, but its prompts lately found a tenth of what the
    index promised (`Candidates.cache_survival`): priced at that share, the prefix is not worth it."""
    c = cluster(cached=(0, 7900))
    c.cache_survival = np.array([1.0, 0.1])
    plan = build_router("cost", model=deepseek).plan(long_prompt(), c)
    assert plan.aggregated[0] == 0


def test_queued_work_moves_traffic_off_a_busy_fast_backend(deepseek):
    router = build_router("cost", model=deepseek)
    assert router.plan(long_prompt(), cluster((queued(20), BackendStats()))).aggregated[0] == 1


def test_load_is_work_not_a_count(deepseek):
    """The same number of requests ahead, short or long prompts: only the long ones are a queue."""
    ranker = CostRanker(deepseek)
    idle = ranker.predicted_ttft(long_prompt(), cluster())[0]
    short = ranker.predicted_ttft(long_prompt(), cluster((queued(6, 100), BackendStats())))[0] - idle
    long = ranker.predicted_ttft(long_prompt(), cluster((queued(6, 8000), BackendStats())))[0] - idle
    assert short > 0 and long > 10 * short  # per-step costs (weights, overhead) are not per token


def test_plan_carries_its_prediction(deepseek):
    plan = build_router("cost", model=deepseek).plan(long_prompt(), cluster((queued(2), BackendStats())))
    pred = plan.predicted
    assert pred is not None and pred.wait_s > 0 and pred.compute_s > 0 and pred.tpot_s > 0
    assert pred.ttft_s == pytest.approx(pred.wait_s + pred.compute_s)


def test_tpot_slo_excludes_a_crowded_decoder(deepseek):
    """The MI300X holds a 32k-token prompt (cheapest prefill by far) but decodes long contexts: over a
    tight TPOT SLO. (A crowd of many sequences would already lose on the delay it suffers from one more.)"""
    crowded = BackendStats(in_flight=8, running=8, decode_seqs=8, context_tokens=8 * 120_000)
    router = build_router("cost", model=deepseek)
    busy = cluster((crowded, BackendStats()), cached=(31_900, 0))

    def request(tpot_s: float) -> RequestFeatures:
        return RequestFeatures("m", prompt_tokens=32_000, max_tokens=64, slo_ttft_s=100.0, slo_tpot_s=tpot_s)

    lax = router.plan(request(10.0), busy)
    assert lax.aggregated[0] == 0
    tight = router.plan(request(0.02), busy)
    assert tight.predicted is not None and lax.predicted is not None
    assert lax.predicted.tpot_s > 0.02 >= tight.predicted.tpot_s
    assert tight.aggregated[0] == 1


def test_a_decode_only_backend_serves_short_requests_whole(deepseek):
    """As under the other policies (and in the fluid bound): a decode-only vLLM serves a request without
    KV parameters whole. A short prompt costs the compute-poor MI308X little to prefill."""
    short = RequestFeatures("m", prompt_tokens=300, max_tokens=200)
    plan = build_router("cost", model=deepseek).plan(short, cluster(roles=(BOTH, D)))
    assert plan.mode is Mode.AGGREGATED and plan.aggregated[0] == 1


@pytest.mark.parametrize("roles", [(BOTH, D), (BOTH, BOTH)])
def test_a_decode_only_backends_prefill_costs_its_bandwidth_share_where_a_split_is_allowed(deepseek, roles):
    """The MI308X has 18 % of the MI300X's compute and all of its bandwidth. Its prefill seconds cost
    its compute share under `never`, and with a split allowed too where it may prefill; kept for
    decoding (decode-only) and serving a request whole, they cost its bandwidth share, the decoding
    they displace. The MI300X's cost the same either way."""
    ranker = CostRanker(deepseek)
    c = cluster(roles=roles)
    cl = ranker._cluster(c.specs)
    mi300x, mi308x = load_catalog().accelerator("mi300x"), load_catalog().accelerator("mi308x")
    compute_share = mi308x.fp8_tflops / mi300x.fp8_tflops
    assert mi308x.memory_tbps == mi300x.memory_tbps and compute_share < 0.2
    split_allowed = ranker._price(long_prompt(), c, cl)
    whole_only = ranker._price(long_prompt(), c, cl, whole_only=True)
    for priced in (split_allowed, whole_only):
        assert priced.compute_cost[0] == pytest.approx(priced.compute[0])
    assert whole_only.compute_cost[1] == pytest.approx(compute_share * whole_only.compute[1], rel=0.01)
    kept_for_decoding = roles[1] == D
    expected = 1.0 if kept_for_decoding else compute_share
    assert split_allowed.compute_cost[1] == pytest.approx(expected * split_allowed.compute[1], rel=0.01)


@pytest.mark.parametrize("running", [0, 16])
def test_a_long_prefill_keeps_off_a_decoder_with_running_sequences(deepseek, running):
    """The MI300X has 16k-token prompts queued; the decode-only MI308X would finish this one sooner. Idle,
    it takes it; with sequences decoding, the delay a 16k prefill would impose on each of them (chunked
    prefill stalls their steps) outweighs the queue, and the MI300X takes it."""
    decoding = BackendStats(
        in_flight=running, running=running, decode_seqs=running, context_tokens=running * 16_000
    )
    request = RequestFeatures("m", prompt_tokens=16_000, max_tokens=128, slo_ttft_s=100.0, slo_tpot_s=10.0)
    plan = build_router("cost", model=deepseek).plan(
        request, cluster((queued(2, 16_000), decoding), roles=(BOTH, D))
    )
    assert plan.aggregated[0] == (1 if running == 0 else 0)


def converge(
    ranker: CostRanker, truth: float, queue: float, compute: float, rounds: int, backend: str = "mi300x-0"
) -> float:
    """Feed outcomes of a backend whose compute is `truth` times the roofline, with `queue` seconds of
    roofline work ahead; each prediction carries the correction learnt so far (as plans do)."""
    for _ in range(rounds):
        k, q = ranker.correction(backend), ranker.queue_correction(backend)
        pred = Prediction(
            wait_s=q * queue, compute_s=k * compute, ttft_s=q * queue + k * compute,
            roofline_queue_s=queue, roofline_compute_s=compute,
        )  # fmt: skip
        measured = truth * (queue + compute)
        ranker.observe(Outcome(backend, Mode.AGGREGATED, 8000, 0, 64, measured, measured, predicted=pred))
    return ranker.correction(backend)


@pytest.mark.parametrize(("truth", "queue"), [(3.0, 0.0), (3.0, 10.0), (0.5, 10.0), (1.0, 50.0)])
def test_calibration_converges_and_a_queue_is_not_slowness(deepseek, truth, queue):
    ranker = CostRanker(deepseek)
    assert converge(ranker, truth, queue, 1.0, 200) == pytest.approx(truth, rel=0.02)


def test_measured_slowness_moves_traffic(deepseek):
    router = build_router("cost", "never", model=deepseek)
    assert router.plan(long_prompt(), cluster()).aggregated[0] == 0
    converge(router.ranker, 1.0, 0.0, 1.0, 50, "mi308x-0")  # the MI308X is as fast as its roofline
    converge(router.ranker, 10.0, 0.0, 1.0, 200)  # the MI300X turns out 10x slower than its roofline
    assert router.plan(long_prompt(), cluster()).aggregated[0] == 1


def test_an_unmeasured_backend_takes_the_measured_ones_correction(deepseek):
    """The roofline's error is mostly shared (its efficiency): until a backend has prefilled, it is
    priced with the others' (geometric) mean correction, not as the roofline has it."""
    ranker = CostRanker(deepseek)
    assert ranker.correction("mi308x-0") == 1.0
    converge(ranker, 4.0, 0.0, 1.0, 200)
    converge(ranker, 1.0, 0.0, 1.0, 200, "mi308x-1")
    assert ranker.correction("mi300x-0") == pytest.approx(4.0, rel=0.02)
    assert ranker.correction("mi308x-0") == pytest.approx(2.0, rel=0.02)
    predicted = ranker.predicted_ttft(long_prompt(), cluster())  # rows: mi300x-0, mi308x-0
    roofline = CostRanker(deepseek).predicted_ttft(long_prompt(), cluster())
    fixed = fixed_step(deepseek)  # one step, which the correction does not scale
    assert (predicted - fixed) / (roofline - fixed) == pytest.approx([4.0, 2.0], rel=0.02)


def test_outcomes_without_prediction_are_ignored(deepseek):
    ranker = CostRanker(deepseek)
    ranker.observe(Outcome("ghost", Mode.AGGREGATED, 10, 0, 1, 1.0, 1.0))
    assert ranker.correction("ghost") == 1.0


def test_each_split_leg_is_credited_to_its_backend(deepseek):
    pred = Prediction(
        wait_s=0.0, compute_s=1.0, transfer_s=0.1, ttft_s=1.2, tpot_s=0.1, roofline_compute_s=1.0
    )
    measured = Measured(Mode.PD, "dec", 8000, 512, 11, 0.0, first_token_s=2.5, finish_s=3.5,
                        prefill_backend_id="pre", prefill_done_s=2.0)  # fmt: skip
    prefill, decode = outcomes_of(measured, pred)
    assert (prefill.backend_id, prefill.leg, prefill.cached_tokens, prefill.ttft_s) == (
        "pre",
        Leg.PREFILL,
        512,
        2.0,
    )
    assert (decode.backend_id, decode.leg, decode.cached_tokens, decode.peer_id) == (
        "dec",
        Leg.DECODE,
        0,
        "pre",
    )
    assert decode.ttft_s == pytest.approx(0.5) and decode.tpot_s == pytest.approx(0.1)
    assert decode.request_ttft_s == pytest.approx(2.5)  # the whole request's, for the pair's headroom
    ranker = CostRanker(deepseek)
    ranker.observe(prefill)
    ranker.observe(decode)
    assert ranker.correction("pre") > 1.0  # 2 s measured for 1 s predicted
    assert "dec" not in ranker.corrections()  # the decoder did no prefill (it takes the others' mean)


@pytest.mark.parametrize(
    ("stats", "cached", "mode", "reason"),
    [
        ((BackendStats(), BackendStats()), (0, 0), Mode.PD, "split"),  # MI300X prefills far faster
        ((BackendStats(), BackendStats()), (0, 7900), Mode.AGGREGATED, "split_costlier"),  # decoder has it
        ((queued(60), BackendStats()), (0, 0), Mode.AGGREGATED, "split_costlier"),  # prefiller buried
    ],
)
def test_auto_splits_when_it_pays(deepseek, stats, cached, mode, reason):
    router = build_router("cost", "auto", pd_min_prompt_tokens=0, model=deepseek)
    plan = router.plan(long_prompt(), cluster(stats, cached, roles=(P, BOTH)))
    assert (plan.mode, plan.reason) == (mode, reason)


def test_single_roles_are_respected(deepseek):
    router = build_router("cost", "auto", pd_min_prompt_tokens=0, model=deepseek)
    plan = router.plan(long_prompt(), cluster((queued(60), BackendStats()), roles=(P, D)))
    assert (plan.mode, plan.prefill[0], plan.decode[0]) == (Mode.PD, 0, 1)  # never aggregated on a decoder


def test_roles_follow_the_traffic(deepseek):
    """Two backends that may do both: the compute-rich one prefills, the other decodes; once the
    compute-rich one is buried in prefill work, the other takes the whole request."""
    router = build_router("cost", "auto", pd_min_prompt_tokens=0, model=deepseek)
    plan = router.plan(long_prompt(), cluster())
    assert (plan.mode, plan.prefill[0], plan.decode[0]) == (Mode.PD, 0, 1)
    plan = router.plan(long_prompt(), cluster((queued(60), BackendStats())))
    assert (plan.mode, plan.aggregated[0]) == (Mode.AGGREGATED, 1)


def test_declares_what_it_uses(deepseek):
    ranker = CostRanker(deepseek)
    assert (ranker.uses_prefix_index, ranker.judges_split, ranker.learns) == (
        True, True, True,
    )  # fmt: skip


def test_transfer_is_learnt_per_pair(deepseek):
    router = build_router("cost", "always", model=deepseek)
    before = router.plan(long_prompt(), cluster(roles=(P, D))).predicted
    assert before is not None and before.transfer_s > 0
    for _ in range(100):  # the pair's link turns out 3x slower: the decode leg's first token is late
        pred = router.plan(long_prompt(), cluster(roles=(P, D))).predicted
        assert pred is not None
        first_step = pred.ttft_s - pred.wait_s - pred.compute_s - pred.transfer_s
        measured = first_step + 3 * before.transfer_s
        router.observe(Outcome("mi308x-0", Mode.PD, 8000, 0, 64, measured, 1.0, Leg.DECODE, "mi300x-0", pred))
    after = router.plan(long_prompt(), cluster(roles=(P, D))).predicted
    assert after is not None
    assert after.transfer_s == pytest.approx(3 * before.transfer_s, rel=0.05)
    assert router.ranker.correction("mi308x-0") == 1.0  # the decoder's compute is not blamed


def test_a_fixed_overhead_per_request_is_learnt_and_priced(deepseek):
    """Outcomes of prompts of varied sizes, each 8 ms slower than the roofline's prefill: the ranker
    learns 8 ms of overhead, not slowness, and every prediction carries it once: a whole request's (an
    unmeasured backend takes the measured ones' mean), and a split's prefill leg's, in its wait (so the
    pair's transfer correction does not learn it as the decoder's first step; the decode leg's own is
    left to that correction)."""
    router = build_router("cost", "always", model=deepseek)
    ranker = router.ranker
    assert isinstance(ranker, CostRanker)
    short = RequestFeatures("m", prompt_tokens=300, max_tokens=64)
    whole_before = ranker.predicted_ttft(short, cluster())
    split_before = router.plan(short, cluster(roles=(P, D))).predicted
    for compute in np.linspace(0.002, 0.2, 200):
        pred = Prediction(wait_s=0.0, compute_s=compute, ttft_s=compute, roofline_queue_s=0.0,
                          roofline_compute_s=compute)  # fmt: skip
        measured = compute + 0.008
        ranker.observe(Outcome("mi300x-0", Mode.AGGREGATED, 8000, 0, 64, measured, measured, predicted=pred))
    assert ranker.overhead("mi300x-0") == pytest.approx(0.008, rel=0.05)
    assert ranker.correction("mi300x-0") == pytest.approx(1.0, rel=0.02)
    assert ranker.predicted_ttft(short, cluster()) - whole_before == pytest.approx([0.008, 0.008], rel=0.1)
    split_after = router.plan(short, cluster(roles=(P, D))).predicted
    assert split_before is not None and split_after is not None
    assert split_after.ttft_s - split_before.ttft_s == pytest.approx(0.008, rel=0.1)
    assert split_after.wait_s - split_before.wait_s == pytest.approx(0.008, rel=0.1)


def test_the_correction_scales_the_roofline_less_the_steps_fixed_seconds(deepseek):
    """Backends 3x slower than the roofline at their arithmetic and memory reads, with its per-step
    overhead (the simulator's truth on the AMD seed cluster): fitted on prompts of 50-8,000 tokens
    as the router placed them, each measured correction is 3 and no overhead is found, and a short
    prompt is priced as it takes. Scaled with the rest, the step's fixed seconds made the fit settle
    between the sizes: one-step prompts 6 ms dearer than they are, long ones 10 % cheaper."""
    router = build_router("cost", model=deepseek)
    slow = Efficiency(mfu=DEFAULT_EFFICIENCY.mfu / 3, bw_util=DEFAULT_EFFICIENCY.bw_util / 3)
    hw = hardware(deepseek)
    ids = ("mi300x-0", "mi308x-0")
    for prompt in np.geomspace(50, 8000, 300).astype(int):
        plan = router.plan(RequestFeatures("m", prompt_tokens=int(prompt), max_tokens=16), cluster())
        row = plan.aggregated[0]
        measured = float(prefill_time(deepseek, hw, prompt, 0, slow)[row])
        outcome = Outcome(
            ids[row], Mode.AGGREGATED, int(prompt), 0, 16, measured, measured, predicted=plan.predicted
        )
        router.observe(outcome)
    ranker = router.ranker
    assert isinstance(ranker, CostRanker)
    for backend in ids:
        assert ranker.correction(backend) == pytest.approx(3.0, rel=0.02)
        assert ranker.overhead(backend) == pytest.approx(0.0, abs=2e-4)
    short = RequestFeatures("m", prompt_tokens=100, max_tokens=16)
    truth = prefill_time(deepseek, hw, 100, 0, slow)
    assert ranker.predicted_ttft(short, cluster()) == pytest.approx(truth, rel=0.02)


def test_a_backend_faster_than_the_steps_fixed_seconds_still_teaches(deepseek):
    """A prompt measured in less than the fixed seconds of its step (a backend far faster than its
    roofline) is an outcome of no scalable seconds: the correction falls to its lower clip, as it did
    when the fixed seconds were scaled with the rest, instead of the outcome being dropped."""
    router = build_router("cost", model=deepseek)
    request = RequestFeatures("m", prompt_tokens=160, max_tokens=6)
    for _ in range(3):
        plan = router.plan(request, cluster())
        assert plan.predicted is not None and plan.predicted.roofline_fixed_compute_s > 0.002
        backend = ("mi300x-0", "mi308x-0")[plan.aggregated[0]]
        router.observe(Outcome(backend, Mode.AGGREGATED, 160, 0, 6, 0.002, 0.003, predicted=plan.predicted))
    assert min(router.ranker.correction(b) for b in ("mi300x-0", "mi308x-0")) == pytest.approx(0.1)


def test_plans_are_ordered_cheap_tier_then_feasible_then_infeasible_each_by_finish():
    rows = np.array([10, 11, 12, 13])
    cost, finish = np.array([1.0, 1.2, 3.0, 0.5]), np.array([5.0, 4.0, 1.0, 0.1])
    ok = np.array([True, True, True, False])  # 13 is cheapest and quickest but misses the SLO
    assert _order(rows, cost, finish, ok, 0.5).tolist() == [11, 10, 12, 13]  # 1.2 is within 50 % of 1.0
    assert _order(rows, cost, finish, ok, 0.1).tolist() == [10, 12, 11, 13]  # 11 falls to the feasible tier
    none_ok = np.zeros(4, dtype=bool)
    assert _order(rows, cost, finish, none_ok, 0.5).tolist() == [13, 12, 11, 10]  # by finish alone


@pytest.mark.parametrize("seed", range(12))
def test_the_best_pair_is_the_first_of_the_full_order_of_pairs(seed):
    """`_pairs` prices the [prefill, decode] matrix as the formulas of `_best_pair`'s docstring say (here
    in numpy) and picks from it without sorting it: `_order`'s first pair, one backend with itself
    excluded."""
    rng = np.random.default_rng(seed)
    n = 7
    rows_p, rows_d = rng.permutation(n)[:6], rng.permutation(n)[:5]
    links = rng.uniform(0.5, 2.0, (4, n, n)) * np.array([1.0, 1e-6, 0.01, 1.0])[:, None, None]
    ttft, compute_cost, harm_p, first, factor, time, harm_d, price, tpot = rng.uniform(0.1, 1.0, (9, n))
    decodes, kv_ok = rng.random((2, n)) < 0.7
    slo_ttft = 1.5 if seed else 0.0  # seed 0: no feasible pair
    transfer, ttft_m, finish, cost, ok, a, b = _pairs(
        rows_p, rows_d, links, 3000.0, (ttft, compute_cost, harm_p, decodes),
        (first, factor, time, harm_d, price, tpot, kv_ok), slo_ttft, 0.8, 0.3,
    )  # fmt: skip
    pr, dr = rows_p[:, None], rows_d
    link = links[:, pr, dr]
    assert np.array_equal(transfer, link[0] * (link[1] * 3000.0 + link[2]))
    assert np.array_equal(ttft_m, ttft[pr] + transfer + (first * factor)[dr])
    same = pr == dr
    assert np.array_equal(
        finish, np.where(same, np.inf, ttft[pr] + transfer + (time + harm_d)[dr] + harm_p[pr])
    )
    assert np.array_equal(cost, (compute_cost + harm_p)[pr] + (price + harm_d)[dr])
    room = np.where(decodes[pr], link[3], 1.0)
    assert np.array_equal(ok, (ttft_m * room <= slo_ttft) & (tpot[dr] <= 0.8) & kv_ok[dr] & ~same)
    first_pair = _order(np.arange(30), cost.ravel(), finish.ravel(), ok.ravel(), 0.3)[0]
    assert (a, b) == divmod(int(first_pair), 5)
    assert rows_p[a] != rows_d[b]


def tiered_order(rows, cost, finish, ok, tolerance):
    """`_order` as first written: an explicit tier per plan (0 cheap, 1 feasible, 2 not), then finish."""
    if ok.any():
        cheap = ok & (cost <= cost[ok].min() * (1.0 + tolerance))
        tier = np.where(cheap, 0, np.where(ok, 1, 2))
    else:
        tier = np.zeros(rows.size, dtype=int)
    return rows[np.lexsort((finish, tier))]


@pytest.mark.parametrize("seed", range(30))
def test_order_equals_the_tiered_order(seed):
    """Ties in finish (kept in row order), inf costs, nothing feasible or everything feasible."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    rows = rng.permutation(n) + 5
    cost = rng.choice([1.0, 1.2, 2.0, np.inf], n) * rng.choice([1.0, 1.0 + rng.random()], n)
    finish = rng.choice([0.5, 0.7, 1.0], n)
    ok = rng.random(n) < rng.choice([0.0, 0.5, 1.0])
    for tolerance in (0.0, 0.3):
        assert (
            _order(rows, cost, finish, ok, tolerance).tolist()
            == tiered_order(rows, cost, finish, ok, tolerance).tolist()
        )


@pytest.mark.parametrize("seed", range(20))
def test_shortlist_keeps_the_quickest_and_the_cheapest(seed):
    """The rows among the `SHORTLIST` smallest of either measure, ties to the rows given first, in the
    order given."""
    rng = np.random.default_rng(seed)
    n = 64
    time, cost = rng.choice([1.0, 2.0, 3.0], n), rng.random(n).round(1)
    rows = rng.choice(n, int(rng.integers(1, n)), replace=False)
    if rows.size > 2 * SHORTLIST:
        ranked = [
            sorted(range(rows.size), key=lambda i, m=m: (m[rows[i]], i))[:SHORTLIST] for m in (time, cost)
        ]
        expected = [int(r) for i, r in enumerate(rows) if i in ranked[0] or i in ranked[1]]
    else:
        expected = rows.tolist()
    assert _shortlist(rows, time, cost).tolist() == expected


# --- bursts and idle hardware (B200 + H100, Llama-3.1-70B) ------------------------------------------------
def nvidia(stats: tuple[BackendStats, BackendStats]) -> Candidates:
    specs = (
        BackendSpec("b200-0", "m", "b200", 4, BOTH),
        BackendSpec("h100-0", "m", "h100-sxm", 4, BOTH),
    )
    return Candidates.build(specs, stats, np.zeros(2, dtype=np.int64))


@pytest.fixture(scope="module")
def llama():
    return load_catalog().model("llama-3.1-70b")


@pytest.mark.parametrize(
    ("queued_tokens", "prompt_len", "new", "expected"),
    [
        (0, 1, 1536, 0.0),  # nothing queued
        (1536, 1536, 1536, 1.0),  # one prompt waiting: it finishes with the new one
        (8192, 1536, 1536, 0.0),  # the queue fills whole steps: the new prompt starts its own
        (7680, 1536, 1536, 5 / 3),  # five prompts in the last step, a third of the new one joins it
        (9728, 1536, 1536, 1.0),  # one step full, one prompt in the next
    ],
)
def test_cobatched_counts_the_queued_prompts_sharing_the_new_prefills_step(
    queued_tokens, prompt_len, new, expected
):
    assert _cobatched(float(queued_tokens), float(prompt_len), float(new), 8192.0) == pytest.approx(expected)


def test_a_burst_is_not_stacked_on_the_fastest_backend(llama):
    """Three prompts queued on the B200 finish with a fourth one put there (vLLM batches them in one
    step), so the fourth goes to the H100 (decoding one sequence) although the B200 would finish it
    first, in either split mode."""
    request = RequestFeatures("m", prompt_tokens=1536, max_tokens=128)
    burst = BackendStats(in_flight=3, prefill_tokens=4608, prefill_seqs=3, decode_seqs=3, context_tokens=4608)
    one = BackendStats(in_flight=1, decode_seqs=1, context_tokens=1600, running=1)
    ranker = CostRanker(llama)
    candidates = nvidia((burst, one))
    priced = ranker._price(request, candidates, ranker._cluster(candidates.specs))
    finish = priced.wait + priced.compute + request.max_tokens * priced.tpot
    assert finish[0] < finish[1]  # on its own account the request is done sooner on the B200
    assert priced.delay[0] > 0 and priced.delay[1] == 0
    for split in ("never", "auto"):
        plan = build_router("cost", model=llama, disaggregation=split).plan(request, candidates)
        assert plan.aggregated[0] == 1


def test_a_queued_prompts_ttft_outweighs_a_stall_spread_over_a_decodes_output(llama):
    """Eight prompts of a burst wait in the B200's step, and each H100 decodes 16 sequences; every
    backend holds 1,024 of the prompt's 1,536 tokens. Prefilled on the B200 (whole or split), this
    prompt delays the eight by its 16 ms; on an H100 it stalls each of 16 decodes by 23 ms, spread
    over their 128 tokens. By share of the SLO budget the queued prompts' TTFT weighs more, and an
    H100 serves it whole; counted as seconds alike, the stall weighed more and the B200 took it."""
    specs = (
        BackendSpec("b200-0", "m", "b200", 4, BOTH),
        BackendSpec("h100-0", "m", "h100-sxm", 4, BOTH),
        BackendSpec("h100-1", "m", "h100-sxm", 4, BOTH),
    )
    burst = BackendStats(in_flight=8, prefill_tokens=8 * 512, prefill_seqs=8)
    decoding = BackendStats(in_flight=16, running=16, decode_seqs=16, context_tokens=16 * 1600)
    c = Candidates.build(specs, (burst, decoding, decoding), np.full(3, 1024, dtype=np.int64))
    request = RequestFeatures("m", prompt_tokens=1536, max_tokens=128)
    ranker = CostRanker(llama)
    priced = ranker._price(request, c, ranker._cluster(c.specs))
    assert priced.stall[1] * priced.seqs[1] > priced.delay[0] > 0  # more seconds of stall than of delay
    for split in ("never", "auto"):
        plan = build_router("cost", split, model=llama).plan(request, c)
        assert plan.mode is Mode.AGGREGATED and plan.aggregated[0] in (1, 2), split


def test_an_idle_backend_is_not_dearer_than_a_busy_one_without_a_split(llama):
    """Without a split an idle backend's weights read are spare capacity: two alike backends, one decoding
    one sequence, the other idle: the idle one serves the next request. With a split allowed the first
    sequence pays them (it makes the backend a decoder), and the busy one keeps the request."""
    specs = (
        BackendSpec("h100-0", "m", "h100-sxm", 4, BOTH),
        BackendSpec("h100-1", "m", "h100-sxm", 4, BOTH),
    )
    one = BackendStats(in_flight=1, decode_seqs=1, context_tokens=2000, running=1)
    candidates = Candidates.build(specs, (one, BackendStats()), np.zeros(2, dtype=np.int64))
    request = RequestFeatures("m", prompt_tokens=1000, max_tokens=128)
    for _ in range(4):  # whatever the rotation
        plan = build_router("cost", model=llama).plan(request, candidates)
        assert plan.aggregated[0] == 1
    auto = build_router("cost", model=llama, disaggregation="auto").plan(request, candidates)
    assert auto.aggregated[0] == 0


# --- the TPOT correction --------------------------------------------------------------------------------
def decode_outcomes(ranker: CostRanker, backend: str, truth: float, rounds: int, leg: Leg = Leg.AGGREGATED):
    """Outcomes whose measured TPOT is `truth` times the (uncorrected) prediction, as plans carry it."""
    for _ in range(rounds):
        pred = Prediction(wait_s=0.0, compute_s=0.5, ttft_s=0.5, tpot_s=0.02)
        ranker.observe(
            Outcome(
                backend, Mode.AGGREGATED, 8000, 0, 64, 0.5, 2.0, leg=leg, predicted=pred, tpot_s=0.02 * truth
            )
        )


@pytest.mark.parametrize("truth", [0.6, 1.0, 2.5])
def test_tpot_correction_converges_to_measured_over_predicted(deepseek, truth):
    ranker = CostRanker(deepseek)
    decode_outcomes(ranker, "mi300x-0", truth, 200)
    assert ranker.tpot_correction("mi300x-0") == pytest.approx(truth, rel=0.02)
    assert ranker.tpot_correction("mi308x-0") == pytest.approx(truth, rel=0.02)  # unmeasured: the mean
    assert ranker.correction("mi300x-0") == pytest.approx(1.0)  # TPOT does not move the compute part


def test_the_first_outcomes_teach_their_mean_then_a_moving_average_follows(deepseek):
    """Outcome n moves the TPOT correction by 1/(n+1) of its error (the start counting as one outcome),
    down to `learning_rate`: two outcomes 2x the prediction leave 1 + 2/3, not the 1.19 of two steps at
    0.1; a backend that then slows further is followed at the moving average's pace."""
    ranker = CostRanker(deepseek, learning_rate=0.1)
    decode_outcomes(ranker, "mi300x-0", 2.0, 1)
    assert ranker.tpot_correction("mi300x-0") == pytest.approx(1.5)  # half way: 1/(1+1)
    decode_outcomes(ranker, "mi300x-0", 2.0, 1)
    assert ranker.tpot_correction("mi300x-0") == pytest.approx(1.5 * (1 + (2.0 / 1.5 - 1) / 3))
    decode_outcomes(ranker, "mi300x-0", 2.0, 30)
    assert ranker.tpot_correction("mi300x-0") == pytest.approx(2.0, rel=0.02)
    decode_outcomes(ranker, "mi300x-0", 4.0, 1)  # outcome 33: the rate is down to 0.1
    assert ranker.tpot_correction("mi300x-0") == pytest.approx(2.0 * 1.1, rel=0.02)


def test_a_prefill_leg_teaches_no_tpot(deepseek):
    ranker = CostRanker(deepseek)
    decode_outcomes(ranker, "mi300x-0", 3.0, 50, leg=Leg.PREFILL)
    assert ranker.tpot_correction("mi300x-0") == 1.0


def test_a_slow_decoder_fails_the_tpot_check_but_keeps_its_price(deepseek):
    """Two alike backends under a TPOT target both meet: once one is measured 3x slower than predicted
    at decode, its plans miss the target and the other serves; its price and finish are unchanged."""
    specs = (
        BackendSpec("mi300x-0", "m", "mi300x", 8, BOTH),
        BackendSpec("mi300x-1", "m", "mi300x", 8, BOTH),
    )
    candidates = Candidates.build(specs, IDLE, np.zeros(2, dtype=np.int64))
    router = build_router("cost", model=deepseek)
    ranker = router.ranker
    assert isinstance(ranker, CostRanker)
    request = RequestFeatures("m", prompt_tokens=1000, max_tokens=64)
    tpot = ranker._price(request, candidates, ranker._cluster(specs)).tpot
    slow = RequestFeatures(
        "m", prompt_tokens=1000, max_tokens=64, slo_ttft_s=10.0, slo_tpot_s=2 * float(tpot[0])
    )
    first = {router.plan(slow, candidates).aggregated[0] for _ in range(4)}
    assert first == {0, 1}  # alike: the rotation shares them
    decode_outcomes(ranker, "mi300x-0", 3.0, 200)
    decode_outcomes(ranker, "mi300x-1", 1.0, 200)
    assert {router.plan(slow, candidates).aggregated[0] for _ in range(4)} == {1}
    after = ranker._price(request, candidates, ranker._cluster(specs)).tpot
    assert after == pytest.approx(tpot)


def test_blending_moves_half_way_to_the_other_replicas_and_ignores_what_it_cannot_read(deepseek):
    ranker = CostRanker(deepseek)
    converge(ranker, 4.0, 0.0, 1.0, 200, "mi308x-0")
    ranker.blend_calibration(
        {
            "compute/mi300x-0": [4.0],  # unmeasured here (prior 4.0, the mean of mi308x-0's): stays 4
            "compute/mi308x-0": [1.0, 1.0],  # half way in log space: sqrt(4 x 1)
            "tpot/mi300x-0": [2.0, 8.0],  # the others' geometric mean is 4: sqrt(1 x 4)
            "pair/mi300x-0/mi308x-0": [9.0],
            "headroom/mi300x-0/mi308x-0": [4.0],  # half way from none: sqrt(1 x 4)
            "compute/mi308x-1": [-1.0, 0.0],  # not a correction
            "queue/mi308x-0": [16.0],  # half way: sqrt(4 x 16)
            "overhead/mi308x-0": [0.01, 0.03],  # seconds: half way to their mean, from none
            "overhead/mi300x-0": [-0.01],  # not an overhead
            "size/mi300x-0": [5.0],  # not a kind it learns
            "pair/mi300x-0": [5.0],  # not a pair
        }
    )
    assert ranker.correction("mi308x-0") == pytest.approx(2.0, rel=0.02)
    assert ranker.correction("mi300x-0") == pytest.approx(4.0, rel=0.02)
    assert ranker.tpot_correction("mi300x-0") == pytest.approx(2.0)
    learnt = ranker.calibration()
    assert learnt["pair/mi300x-0/mi308x-0"] == pytest.approx(3.0)
    assert learnt["headroom/mi300x-0/mi308x-0"] == pytest.approx(2.0)
    assert ranker.queue_correction("mi308x-0") == pytest.approx(8.0, rel=0.02)
    assert ranker.overhead("mi308x-0") == pytest.approx(0.01, abs=1e-4)
    assert ranker.overhead("mi300x-0") == pytest.approx(0.0, abs=1e-4)
    assert set(learnt) == {
        "compute/mi300x-0", "compute/mi308x-0", "queue/mi300x-0", "queue/mi308x-0", "tpot/mi300x-0",
        "overhead/mi300x-0", "overhead/mi308x-0",
        "pair/mi300x-0/mi308x-0", "headroom/mi300x-0/mi308x-0",
    }  # fmt: skip
    # The pricing reads the blended factors (rows: mi300x-0, mi308x-0).
    roofline = CostRanker(deepseek).predicted_ttft(long_prompt(), cluster())
    fixed = fixed_step(deepseek)
    blended = ranker.predicted_ttft(long_prompt(), cluster())
    assert (blended - fixed) / (roofline - fixed) == pytest.approx([4.0, 2.0], rel=0.02)


def test_a_learnt_pair_correction_reaches_the_transfer_the_split_is_priced_with(deepseek):
    """The pair corrections are a view of the cluster's [correction, per token, latency, headroom] array
    that splits read: a correction learnt after the cluster was built is in the next plan's transfer."""
    router = build_router("cost", "always", model=deepseek)
    c = cluster(roles=(P, D))  # prefill on mi300x-0, decode on mi308x-0
    cl = router.ranker._cluster(c.specs)
    before = cl.links.copy()
    router.blend_calibration({"pair/mi300x-0/mi308x-0": [9.0]})
    assert cl.links[0, 0, 1] == pytest.approx(3.0)  # half way in log space: sqrt(1 x 9)
    others = np.ones_like(before, dtype=bool)
    others[0, 0, 1] = False
    assert np.array_equal(cl.links[others], before[others])
    plan = router.plan(long_prompt(), c)
    assert (plan.mode, plan.prefill[0], plan.decode[0]) == (Mode.PD, 0, 1)
    assert plan.predicted is not None
    expected = cl.links[0, 0, 1] * (before[1, 0, 1] * long_prompt().prompt_tokens + before[2, 0, 1])
    assert plan.predicted.transfer_s == expected


def decode_base(ranker: CostRanker, c: Candidates) -> np.ndarray:
    """Each backend's decode step of its running batch (without the new request), as `_price` sees it."""
    work = ranker._cluster(c.specs).work
    n = len(c.specs)
    context = work.context(c.context_tokens, c.kv_usage, c.context_when_reported)
    own = long_prompt()
    return work.steps(
        np.full(n, float(own.prompt_tokens)), np.zeros(n), own.prompt_tokens + own.max_tokens / 2,
        c.decode_seqs, context, c.prefill_tokens, c.prefill_len, c.step_tokens, c.step_elapsed,
        c.step_behind,
    ).base  # fmt: skip


def test_a_split_decode_leg_waits_for_the_decoders_queue_and_two_step_boundaries(deepseek):
    """The decode leg of a split is admitted behind the prefill queued on its decoder (vLLM admits the
    waiting queue in order) in the step of the queue's last chunk, then pulls its KV and waits for a
    step boundary before its first step."""
    ranker = CostRanker(deepseek)
    decoding = BackendStats(in_flight=8, decode_seqs=8, context_tokens=8 * 2000)
    busy = BackendStats(
        in_flight=11, prefill_tokens=3 * 8192, prefill_seqs=3, decode_seqs=8, context_tokens=16000
    )
    c = cluster((decoding, busy))
    p = ranker._price(long_prompt(), c, ranker._cluster(c.specs))
    queue = p.wait - 0.5 * decode_base(ranker, c)
    assert queue[0] == pytest.approx(0.0, abs=1e-12)
    assert p.first_step[0] == pytest.approx(2 * p.step[0])
    assert p.first_step[1] == pytest.approx(2 * p.step[1] + queue[1] * 2 / 3)  # all but the last of 3 chunks


def test_a_request_waits_for_the_step_in_progress(deepseek):
    """Half a step on average on a backend that is decoding; nothing on an idle one."""
    ranker = CostRanker(deepseek)
    decoding = BackendStats(in_flight=8, decode_seqs=8, context_tokens=8 * 2000)
    c = cluster((BackendStats(), decoding))
    p = ranker._price(long_prompt(), c, ranker._cluster(c.specs))
    base = decode_base(ranker, c)
    assert base[1] > 0
    assert p.wait[0] == 0.0
    assert p.wait[1] == pytest.approx(0.5 * base[1])


def test_a_request_planned_during_a_prefill_step_waits_for_what_is_left_of_it(deepseek):
    """A step in progress takes no more prompts: a request waits for what is left of it (no half step
    besides), then takes a step of its own, weights read and all; the longer the step has run, the less
    is left. The compute correction scales the step's seconds, so the clock's elapsed seconds count
    1/k of its roofline."""
    ranker = CostRanker(deepseek)
    queued = BackendStats(in_flight=1, prefill_tokens=2000, prefill_seqs=1)
    c = cluster((queued, queued))
    c.step_tokens = np.array([0.0, 2000.0])  # backend 1 began a step of that prompt...
    c.step_elapsed = np.array([0.0, 0.01])  # ...10 ms ago
    cl = ranker._cluster(c.specs)
    work, request = cl.work, RequestFeatures("m", prompt_tokens=1000, max_tokens=64)
    one_step = work._step_time(2000.0, causal_pairs(2000.0, 0), 0.0, 0.0)
    own_step = work._step_time(1000.0, causal_pairs(1000.0, 0), 0.0, 0.0)
    p = ranker._price(request, c, cl)
    assert p.wait[1] == pytest.approx(one_step[1] - 0.01)
    assert p.compute[1] == pytest.approx(own_step[1])  # the weights read again
    assert p.compute[0] < 0.5 * own_step[0]  # backend 0's prompt waits: they share one step
    cl.compute_factor[:] = 2.0
    slow = ranker._price(request, c, cl)
    assert slow.wait[1] == pytest.approx(2.0 * (one_step[1] - 0.005))


def test_a_split_prices_the_decoders_steps_as_its_measured_tpot_corrects_them(deepseek):
    """Otherwise the pair correction learns the decoder's slow steps as transfer time."""
    router = build_router("cost", "always", model=deepseek)
    ranker = router.ranker
    c = cluster(roles=(P, D))
    for _ in range(100):  # the decoder's steps take twice what the roofline says
        pred = Prediction(compute_s=0.1, ttft_s=0.1, tpot_s=0.01)
        ranker.observe(
            Outcome("mi308x-0", Mode.AGGREGATED, 8000, 0, 64, 0.1, 1.0, predicted=pred, tpot_s=0.02)
        )
    assert ranker.tpot_correction("mi308x-0") == pytest.approx(2.0, rel=0.02)
    plan = router.plan(long_prompt(), c)
    assert plan.mode is Mode.PD
    pred = plan.predicted
    first_steps = pred.ttft_s - pred.wait_s - pred.compute_s - pred.transfer_s
    uncorrected = ranker._price(long_prompt(), c, ranker._cluster(c.specs)).first_step[1]
    assert first_steps == pytest.approx(2.0 * uncorrected, rel=0.03)


def test_a_prefill_that_would_hold_up_a_split_decode_leg_pays_for_it(llama):
    """A split's decode leg planned on h100-0 comes when its prefill leg ends; a prefill put there
    before that runs first (vLLM serves running prompts before admitting waiting ones), so the leg waits
    for what is left of it: charged as delay imposed, whole when the leg is due before the prefill
    starts, in part when it is due while it runs, not at all when it is due after it ends."""
    specs = (
        BackendSpec("h100-0", "m", "h100-sxm", 4, BOTH),
        BackendSpec("h100-1", "m", "h100-sxm", 4, BOTH),
    )
    request = RequestFeatures("m", prompt_tokens=8000, max_tokens=64)
    ranker = CostRanker(llama)

    def priced_with_leg_due(due_s: float):
        c = Candidates.build(specs, (BackendStats(), BackendStats()), np.zeros(2, dtype=np.int64))
        c.kv_due_rows, c.kv_due_s = np.array([0]), np.array([due_s])
        return c, ranker._price(request, c, ranker._cluster(c.specs))

    c, p = priced_with_leg_due(0.0)  # due as the prefill starts (both backends are idle)
    assert p.compute[0] > 0.05
    assert p.delay.tolist() == pytest.approx([p.compute[0], 0.0])
    for split in ("never", "auto"):
        for _ in range(4):  # whatever the rotation
            assert build_router("cost", model=llama, disaggregation=split).plan(request, c).aggregated[0] == 1
    _, p = priced_with_leg_due(float(p.ttft[0] - 0.25 * p.compute[0]))  # due with a quarter left
    assert p.delay[0] == pytest.approx(0.25 * p.compute[0])
    _, p = priced_with_leg_due(float(p.ttft[0]) + 0.01)
    assert p.delay.tolist() == [0.0, 0.0]


def one_b200(stats: BackendStats, now: float) -> Candidates:
    return Candidates.build((BackendSpec("b200-0", "m", "b200", 4, BOTH),), (stats,), now=now)


def test_a_prompt_joins_a_step_only_until_it_starts(llama):
    """A prompt planned on a decoding B200 waits for the step in progress to end: one planned before
    then shares its step (and adds to its `joined` seconds); one planned after it started waits for the
    next step and adds nothing. Counted as joining until the first prompt's first token, a burst that
    arrived while the step ran was credited to it too (docs/policies.md, thirteenth pass)."""
    router = build_router("cost", "never", model=llama)
    request = RequestFeatures("m", prompt_tokens=1536, max_tokens=128)
    decoding = BackendStats(in_flight=4, running=4, decode_seqs=4, context_tokens=4 * 1600)
    first = router.plan(request, one_b200(decoding, now=100.0)).predicted
    assert first is not None and first.joined is not None
    assert first.joined.closes_at > 100.0  # the step in progress ends first
    # The first prompt is reserved (queued) there now; a second planned before its step starts joins it.
    queued = BackendStats(
        in_flight=5, running=4, prefill_tokens=1536, prefill_seqs=1, decode_seqs=5, context_tokens=5 * 1600
    )
    router.plan(request, one_b200(queued, now=100.0))
    shared = first.joined.seconds
    assert shared > 0
    # Planned once that step has started (the first prompt still reserved: its first token is not out).
    third = router.plan(request, one_b200(queued, now=first.joined.closes_at + 1e-3)).predicted
    assert first.joined.seconds == shared
    assert third is not None and third.joined is not None and third.joined.closes_at > first.joined.closes_at


def test_an_idle_backends_step_starts_at_once_and_takes_no_later_prompt(llama):
    router = build_router("cost", "never", model=llama)
    request = RequestFeatures("m", prompt_tokens=1536, max_tokens=128)
    first = router.plan(request, one_b200(BackendStats(), now=5.0)).predicted
    assert first is not None and first.joined is not None and first.joined.closes_at == 5.0
    queued = BackendStats(
        in_flight=1, prefill_tokens=1536, prefill_seqs=1, decode_seqs=1, context_tokens=1536
    )
    router.plan(request, one_b200(queued, now=5.0))  # the same instant: the step already runs
    assert first.joined.seconds == 0.0


def test_a_splits_headroom_is_the_90th_percentile_of_its_pairs_ttft_error(deepseek):
    """Fed measured over predicted TTFTs of one pair's splits, the headroom settles at their 90th
    percentile (a stochastic quantile: within 10 % after 2,000 splits)."""
    ranker = CostRanker(deepseek)
    ratios = np.random.default_rng(4).lognormal(0.0, 0.4, 2000)
    pred = Prediction(compute_s=1.0, transfer_s=0.1, ttft_s=1.2, roofline_compute_s=1.0)
    for ratio in ratios:
        ranker.observe(
            Outcome(
                "dec", Mode.PD, 8000, 0, 64, 0.1, 1.0, Leg.DECODE, "pre", pred, request_ttft_s=1.2 * ratio
            )
        )
    assert ranker.calibration()["headroom/pre/dec"] == pytest.approx(np.quantile(ratios, 0.9), rel=0.1)


def test_a_split_meets_the_ttft_target_only_with_its_pairs_headroom(deepseek):
    """The MI300X prefills, the MI308X decodes: the split wins while it meets the TTFT target. Once the
    pair's splits have taken up to twice their predicted TTFT, a split predicted at 60 % of the target
    no longer counts as meeting it, and the request is served whole on the MI300X, which meets it.
    Only where the prefiller could serve it whole: the headroom weighs a split against that."""
    router = build_router("cost", "auto", pd_min_prompt_tokens=0, model=deepseek)
    split = router.plan(long_prompt(), cluster()).predicted
    assert split is not None
    request = long_prompt(slo_ttft_s=split.ttft_s / 0.6)
    plan = router.plan(request, cluster())
    assert (plan.mode, plan.reason) == (Mode.PD, "split")
    for _ in range(100):
        router.observe(
            Outcome(
                "mi308x-0",
                Mode.PD,
                8000,
                0,
                64,
                0.1,
                1.0,
                Leg.DECODE,
                "mi300x-0",
                split,
                request_ttft_s=2.0 * split.ttft_s,
            )
        )
    plan = router.plan(request, cluster())
    assert (plan.mode, plan.reason, plan.aggregated[0]) == (Mode.AGGREGATED, "split_costlier", 0)
    # A prefill-only MI300X cannot serve it whole: the split is the only way to use it, and keeps it.
    plan = router.plan(request, cluster(roles=(P, BOTH)))
    assert (plan.mode, plan.reason) == (Mode.PD, "split")


@pytest.mark.parametrize("mode", ["never", "auto", "always"])
def test_no_healthy_backend_gives_an_empty_plan_and_spends_no_turn(deepseek, mode):
    """`_plan_kernel` finds no backend to serve on: no plan, and the rotation is where it was (ties
    among equal backends are shared by turns actually used)."""
    router = build_router("cost", mode, model=deepseek)
    c = cluster()
    c.healthy = np.array([False, False])
    plan = router.plan(long_prompt(), c)
    assert (plan.aggregated, plan.prefill, plan.decode, plan.predicted) == ((), (), (), None)
    assert plan.reason == "no_healthy_backend"
    assert router.ranker._rotate.turn == 0


def test_a_decode_only_pool_serves_whole_on_its_decoders(deepseek):
    """Aggregated plans run on any backend that may decode; with no prefiller healthy, no split."""
    c = cluster(roles=(P, D))
    c.healthy = np.array([False, True])
    plan = build_router("cost", "auto", model=deepseek).plan(long_prompt(), c)
    assert plan.mode is Mode.AGGREGATED
    assert plan.aggregated == (1,)
    assert plan.reason == "no_split"
    assert plan.predicted is not None and plan.predicted.rows == (1,)


def test_a_split_spends_three_turns_and_serving_whole_one(deepseek):
    """The aggregated order takes turn t; a split's prefill and decode sides t + 1 and t + 2 (so equal
    backends share each role in turn), unless no split could be formed."""
    never = build_router("cost", "never", model=deepseek)
    never.plan(long_prompt(), cluster())
    assert never.ranker._rotate.turn == 1
    always = build_router("cost", "always", model=deepseek)
    plan = always.plan(long_prompt(), cluster())
    assert plan.mode is Mode.PD
    assert always.ranker._rotate.turn == 3
