"""The router's plans: filters, ranking order, and the split decision, table-driven."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gateway.config import GatewayConfig
from gateway.decision import build_routers
from scoring.catalog import load_catalog
from scoring.cost import DEFAULT_EFFICIENCY
from scoring.cost_policy import CostRanker
from scoring.router import LeastLoad, Rotation, RoundRobin, build_router
from scoring.types import BackendSpec, BackendStats, Candidates, Mode, RequestFeatures, Role

BOTH = frozenset({Role.PREFILL, Role.DECODE})
P = frozenset({Role.PREFILL})
D = frozenset({Role.DECODE})


def candidates(roles, loads=None, healthy=None, cached=None, capacity=None) -> Candidates:
    n = len(roles)
    loads = loads or [0] * n
    healthy = healthy or [True] * n
    capacity = capacity or [256] * n
    specs = tuple(
        BackendSpec(f"b{i}", "m", "h100", 8, r, max_num_seqs=c)
        for i, (r, c) in enumerate(zip(roles, capacity))
    )
    stats = tuple(BackendStats(healthy=h, in_flight=ld) for h, ld in zip(healthy, loads))
    cached_arr = None if cached is None else np.array(cached, dtype=np.int64)
    return Candidates.build(specs, stats, cached_arr)


def request(prompt_tokens: int = 100) -> RequestFeatures:
    return RequestFeatures(model="m", prompt_tokens=prompt_tokens, max_tokens=16)


def test_round_robin_rotates_over_healthy_backends_only():
    cands = candidates([BOTH, BOTH, BOTH], healthy=[True, False, True])
    ranker = RoundRobin()
    mask = cands.healthy
    firsts = [int(ranker.rank(request(), cands, mask)[0]) for _ in range(4)]
    assert firsts == [0, 2, 0, 2]


@pytest.mark.parametrize(
    ("loads", "capacity", "expected_first"),
    [
        ([5, 1, 3], [256, 256, 256], 1),
        ([10, 6, 9], [100, 20, 100], 2),  # normalised by capacity: 0.1, 0.3, 0.09
        ([0, 0, 0], [8, 8, 8], None),  # ties: any, but rotating
    ],
)
def test_least_load_picks_lowest_utilisation(loads, capacity, expected_first):
    cands = candidates([BOTH] * 3, loads=loads, capacity=capacity)
    ranker = LeastLoad()
    order = ranker.rank(request(), cands, cands.healthy)
    assert sorted(order.tolist()) == [0, 1, 2]
    if expected_first is None:
        assert len({int(ranker.rank(request(), cands, cands.healthy)[0]) for _ in range(3)}) == 3
    else:
        assert order[0] == expected_first


def test_never_is_aggregated_and_keeps_fallbacks():
    plan = build_router("least_load", "never").plan(request(), candidates([BOTH, BOTH], loads=[3, 1]))
    assert plan.mode is Mode.AGGREGATED
    assert plan.aggregated == (1, 0)


def test_no_healthy_backend_gives_an_empty_plan():
    plan = build_router("round_robin").plan(request(), candidates([BOTH], healthy=[False]))
    assert plan.aggregated == ()
    assert plan.reason == "no_healthy_backend"


def test_always_splits_prefill_and_decode_on_distinct_backends():
    plan = build_router("round_robin", "always").plan(request(), candidates([P, D, D]))
    assert plan.mode is Mode.PD
    assert plan.prefill == (0,)
    assert plan.decode[0] in (1, 2)
    assert plan.prefill[0] not in plan.decode[:1]


def test_always_falls_back_to_aggregated_without_a_healthy_prefill_backend():
    plan = build_router("round_robin", "always").plan(request(), candidates([P, D], healthy=[False, True]))
    assert plan.mode is Mode.AGGREGATED
    assert plan.reason == "no_prefill_backend"


@pytest.mark.parametrize(
    ("prompt_tokens", "cached_on_decode", "mode"),
    [(4000, 0, Mode.PD), (500, 0, Mode.AGGREGATED), (4000, 3500, Mode.AGGREGATED)],
)
def test_auto_splits_only_long_uncached_prompts(prompt_tokens, cached_on_decode, mode):
    router = build_router("round_robin", "auto", pd_min_prompt_tokens=1024)
    plan = router.plan(request(prompt_tokens), candidates([P, D], cached=[0, cached_on_decode]))
    assert plan.mode is mode


@pytest.mark.parametrize(("policy", "configured", "gate"), [
    ("round_robin", None, 1024),
    ("prefix", None, 1024),
    ("cost", None, 0),  # it prices each split in seconds
    ("cost", 2048, 2048),  # an operator's floor holds for it too
    ("least_load", 0, 0),
])  # fmt: skip
def test_the_split_gate_is_the_policys_own_unless_configured(policy, configured, gate):
    knobs = {"model": load_catalog().model("llama-3.1-70b")} if policy == "cost" else {}
    config = GatewayConfig.model_validate(
        {
            "models": [{"name": "m", "spec": "llama-3.1-70b"}],
            "backends": [{"id": "b", "url": "http://127.0.0.1:9", "model": "m", "accelerator": "h100-sxm"}],
            "routing": {"policy": policy, "disaggregation": "auto"}
            | ({} if configured is None else {"pd_min_prompt_tokens": configured}),
        }
    )
    assert build_routers(config)["m"].split.pd_min_prompt_tokens == gate
    assert build_router(policy, "auto", configured, **knobs).split.pd_min_prompt_tokens == gate


@pytest.mark.parametrize("prior", [{}, {"mfu": 0.2}, {"mfu": 0.2, "bw_util": 0.3}])
def test_the_cost_models_starting_efficiency_is_routing_cost(prior):
    config = GatewayConfig.model_validate(
        {
            "models": [{"name": "m", "spec": "llama-3.1-70b"}],
            "backends": [{"id": "b", "url": "http://127.0.0.1:9", "model": "m", "accelerator": "h100-sxm"}],
            "routing": {"policy": "cost", "cost": prior},
        }
    )
    ranker = build_routers(config)["m"].ranker
    assert isinstance(ranker, CostRanker)
    assert ranker.efficiency == dataclasses.replace(DEFAULT_EFFICIENCY, **prior)
    # What it prices with: an unmeasured backend's prefill takes longer at a lower share of peak FLOPS.
    spec = BackendSpec("b", "m", "h100-sxm", 8, BOTH)
    prompt, idle = RequestFeatures("m", 8192, 16), Candidates.build((spec,), (BackendStats(),))
    ttft = ranker.predicted_ttft(prompt, idle)
    default = build_router("cost", model=load_catalog().model("llama-3.1-70b")).ranker
    assert isinstance(default, CostRanker)
    default_ttft = default.predicted_ttft(prompt, idle)
    assert (ttft[0] > 1.5 * default_ttft[0]) == ("mfu" in prior)


def test_aggregated_prefers_decode_role_over_prefill_only():
    plan = build_router("least_load").plan(request(), candidates([P, D], loads=[0, 50]))
    assert plan.aggregated == (1,)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        build_router("random")


def test_always_round_robin_spreads_decodes_over_every_decode_backend():
    router = build_router("round_robin", "always")
    cands = candidates([P, D, D])
    decodes = {router.plan(request(), cands).decode[0] for _ in range(4)}
    assert decodes == {1, 2}


def test_rotation_turns_through_equal_choices():
    rotate = Rotation()
    indices = np.array([3, 5, 9])
    assert [rotate(indices).tolist() for _ in range(4)] == [[3, 5, 9], [5, 9, 3], [9, 3, 5], [3, 5, 9]]
    assert rotate(np.array([7])).tolist() == [7]


def test_load_counts_a_queued_request_once():
    """The gateway's own count and vLLM's running + waiting see the same requests: the larger wins."""
    specs = tuple(BackendSpec(f"b{i}", "m", "h100", 8, BOTH) for i in range(2))
    stats = (BackendStats(in_flight=3, running=2, waiting=1), BackendStats(in_flight=0, running=1, waiting=4))
    assert Candidates.build(specs, stats).load.tolist() == [3.0, 5.0]


@pytest.mark.parametrize(
    ("policy", "prefix", "split", "learns"),
    [
        ("round_robin", False, False, False),
        ("least_load", False, False, False),
        ("prefix", True, False, False),
    ],
)
def test_policies_declare_what_they_use(policy, prefix, split, learns):
    ranker = build_router(policy).ranker
    assert (ranker.uses_prefix_index, ranker.judges_split, ranker.learns) == (
        prefix, split, learns,
    )  # fmt: skip
