"""Where a conversation starts (`scoring.conversations`): the SLO plan's decode shares, solved off the
request path from the traffic seen, pick the decoder of a named conversation's first turn."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from bench.policies import build_scenario, cluster_named, make_router, scenario_bound
from bench.sim.des import Simulation
from gateway.replanning import replan_once
from scoring.catalog import load_catalog
from scoring.conversations import MIN_SEEN, REPLAN_EVERY, ConversationStarts, TrafficWindow, even_within_kinds
from scoring.cost import Hardware
from scoring.cost_policy import CostRanker
from scoring.router import PlanningRouter, SplitSettings
from scoring.slo_plan import Servers, Traffic, solve_slo_plan
from scoring.types import BackendSpec, BackendStats, Candidates, Disaggregation, Mode, RequestFeatures, Role

BOTH = frozenset({Role.PREFILL, Role.DECODE})
SPECS = (
    BackendSpec("b200-0", "llama-3.1-70b", "b200", 4, BOTH),
    BackendSpec("h100-0", "llama-3.1-70b", "h100-sxm", 4, BOTH),
    BackendSpec("h100-1", "llama-3.1-70b", "h100-sxm", 4, BOTH),
)
PROMPT = 4096


@pytest.fixture(scope="module")
def llama():
    return load_catalog().model("llama-3.1-70b")


def servers(llama) -> Servers:
    catalog = load_catalog()
    hw = Hardware.of([catalog.accelerator(s.accelerator) for s in SPECS], [s.gpus for s in SPECS], "bf16")
    n, efficiency = len(SPECS), CostRanker(llama).efficiency
    return Servers(llama, hw, efficiency, np.ones(n, bool), np.ones(n, bool), np.full(n, 256.0))


def chat_turn(in_conversation: bool = True) -> RequestFeatures:
    return RequestFeatures("llama-3.1-70b", PROMPT, 128, in_conversation=in_conversation)


def nvidia(stats=None, cached=(0, 0, 0)) -> Candidates:
    stats = stats or tuple(BackendStats() for _ in SPECS)
    return Candidates.build(SPECS, stats, np.array(cached, dtype=np.int64))


def busy_b200() -> tuple[BackendStats, ...]:
    """The B200 decoding a full batch: a plan priced for one turn alone sends the next one elsewhere."""
    full = BackendStats(in_flight=200, running=200, decode_seqs=200, context_tokens=200 * 6000)
    return (full, BackendStats(), BackendStats())


def router_with_plan(llama, requests: int = MIN_SEEN) -> PlanningRouter:
    router = PlanningRouter(CostRanker(llama), SplitSettings(Disaggregation.AUTO))
    for _ in range(requests):
        router.plan(chat_turn(), nvidia())
    router.replan()
    return router


def decoder(plan) -> int:
    return plan.decode[0] if plan.mode is Mode.PD else plan.aggregated[0]


def test_identical_backends_share_their_kinds_share_evenly() -> None:
    shares = even_within_kinds(np.array([0.2, 0.0, 0.8]), SPECS)
    assert shares.tolist() == pytest.approx([0.2, 0.4, 0.4])


def test_picks_follow_the_shares_and_skip_what_is_not_eligible(llama) -> None:
    starts = ConversationStarts(SPECS, servers(llama))
    everyone = np.ones(3, bool)
    assert starts.pick(everyone) is None  # no plan yet: the router's own choice
    starts.adopt(np.array([0.5, 0.5, 0.0]))  # the H100s' 0.5 spread over both
    picks = [starts.pick(everyone) for _ in range(8)]
    assert [picks.count(row) for row in range(3)] == [4, 2, 2]
    assert {starts.pick(np.array([False, True, True])) for _ in range(4)} == {1, 2}
    starts.adopt(np.array([1.0, 0.0, 0.0]))
    assert starts.pick(np.array([False, True, True])) is None  # no eligible backend has a share


def test_the_window_keeps_the_latest_requests_and_needs_a_few() -> None:
    window = TrafficWindow(size=MIN_SEEN + 2)
    for k in range(MIN_SEEN - 1):
        window.record(100.0 + k, np.zeros(3), 10.0, (1.0, 0.1), in_conversation=True)
    assert window.snapshot() is None
    for k in range(MIN_SEEN - 1, 2 * MIN_SEEN):
        window.record(100.0 + k, np.zeros(3), 10.0, (1.0, 0.1), in_conversation=False)
    traffic = window.snapshot()
    assert traffic is not None and len(traffic.prompt) == MIN_SEEN + 2
    assert sorted(traffic.prompt.tolist()) == [100.0 + k for k in range(MIN_SEEN - 2, 2 * MIN_SEEN)]


def test_no_plan_is_solved_for_traffic_without_conversations() -> None:
    window = TrafficWindow()
    for k in range(2 * MIN_SEEN):
        window.record(100.0 + k, np.zeros(3), 10.0, (1.0, 0.1), in_conversation=False)
    assert window.snapshot() is None
    window.record(100.0, np.zeros(3), 10.0, (1.0, 0.1), in_conversation=True)
    assert window.snapshot() is not None
    assert window.snapshot() is None  # nothing new since: the last plan stands


def test_the_plan_of_chat_traffic_decodes_on_the_b200(llama) -> None:
    """The SLO plan of this cluster (docs/policies.md, thirtieth pass): the H100s prefill, the B200
    decodes; with no TPOT objective at all it still solves."""
    n = 32
    traffic = Traffic(np.full(n, 4096.0), np.zeros(n), np.full(n, 128.0), np.full(n, 2.0), np.full(n, 0.03))
    plan = solve_slo_plan(servers(llama), traffic)
    assert plan.requests_per_s > 0 and plan.decodes[0] > 0.9
    unlimited = dataclasses.replace(traffic, tpot_limits=np.full(n, np.inf))
    assert solve_slo_plan(servers(llama), unlimited).requests_per_s >= plan.requests_per_s


def test_a_conversations_first_turn_decodes_where_the_plan_says(llama) -> None:
    router = router_with_plan(llama)
    loaded = nvidia(busy_b200())
    assert decoder(router.plan(chat_turn(in_conversation=False), loaded)) != 0  # the router's own choice
    plan = router.plan(chat_turn(), loaded)
    assert decoder(plan) == 0
    assert sorted(plan.aggregated) == [0, 1, 2]  # the other decoders stay as fallbacks


def test_a_later_turn_follows_its_cache_not_the_plan(llama) -> None:
    router = router_with_plan(llama)
    held_on_an_h100 = nvidia(busy_b200(), cached=(0, PROMPT - 512, 0))
    assert decoder(router.plan(chat_turn(), held_on_an_h100)) == 1


def test_the_plan_is_solved_only_by_replan(llama, monkeypatch) -> None:
    """`plan` never solves (it is on the request path): before the first `replan`, first turns are
    routed as any other request."""
    router = PlanningRouter(CostRanker(llama), SplitSettings(Disaggregation.AUTO))
    import scoring.conversations as conversations

    def no_solving(*args, **kwargs):
        raise AssertionError("solved on the request path")

    monkeypatch.setattr(conversations, "solve_slo_plan", no_solving)
    loaded = nvidia(busy_b200())
    for _ in range(3 * MIN_SEEN):
        assert decoder(router.plan(chat_turn(), loaded)) != 0


def test_the_gateway_replans_in_a_worker_thread_and_survives_a_failure(llama) -> None:
    threads: list[str] = []

    class Failing:
        replans = True

        def replan(self) -> None:
            raise ValueError("infeasible")

    class Recording:
        replans = True

        def replan(self) -> None:
            threads.append(threading.current_thread().name)

    class Idle:
        replans = False

        def replan(self) -> None:
            raise AssertionError("a router that does not replan was asked to")

    asyncio.run(replan_once({"a": Failing(), "b": Recording(), "c": Idle()}))  # type: ignore[dict-item]
    assert len(threads) == 1 and threads[0] != threading.main_thread().name


def test_in_the_simulator_conversations_start_where_the_plan_decodes() -> None:
    """multiturn@nvidia, replayed at a load where the router's own choice starts some conversations on
    an H100 (docs/policies.md, thirtieth pass): once the plan is solved (after `MIN_SEEN` arrivals,
    then every `REPLAN_EVERY`), every first turn decodes on the B200; the replans happen on schedule."""
    sc = build_scenario("multiturn@nvidia", 320)
    cluster = cluster_named(sc.cluster)
    router = make_router(cluster, "cost/auto")
    replans: list[int] = []
    replan = router.replan

    def counted() -> None:
        replans.append(len(replans))
        replan()

    router.replan = counted  # type: ignore[method-assign]
    requests = sc.at_rate(0.7 * scenario_bound(sc).requests_per_s)  # the router alone: 3 of 40 on an H100
    result = Simulation(cluster.model, cluster.backends, router, cluster.efficiency).run(requests)
    assert len(replans) == len(range(MIN_SEEN, len(requests), REPLAN_EVERY))
    arrived = sorted(result.records, key=lambda r: r.arrival_s)
    first_turns = [r for r in arrived[MIN_SEEN:] if r.request_id.endswith("-0")]
    assert len(first_turns) >= 5
    assert {r.backend for r in first_turns} == {"b200-0"}
