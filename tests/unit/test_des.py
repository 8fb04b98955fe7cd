"""The discrete-event mode: the real router plans from live engine state; aggregated and P/D paths."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest

from bench import workloads as w
from bench.sim.des import PromptHasher, Simulation, make_backends
from kvindex.hashing import HashMode, hash_token_ids, root_hash
from scoring.catalog import load_catalog
from scoring.load import DEFAULT_CHUNK_TOKENS
from scoring.router import build_router
from scoring.types import Candidates, Mode, Outcome, RequestFeatures, Role, RoutePlan

CATALOG = load_catalog()
MODEL = CATALOG.model("llama-3.1-8b")
BOTH = frozenset({Role.PREFILL, Role.DECODE})


def backends(*roles: frozenset[Role], accelerator: str = "h100-sxm") -> list[Any]:
    acc = CATALOG.accelerator(accelerator)
    return make_backends([(f"b{i}", acc, 1, r) for i, r in enumerate(roles)], MODEL.name)


class Spy:
    """Wraps a real router and keeps what it was shown and what it learnt."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_prefix_index = inner.uses_prefix_index
        self.learns = True  # it wants every outcome, whatever the inner router does with them
        self.replans = inner.replans
        self.uses_work = True
        self.seen: list[tuple[RequestFeatures, Candidates]] = []
        self.outcomes: list[Outcome] = []

    def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
        self.seen.append((request, candidates))
        return self.inner.plan(request, candidates)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.inner.observe(outcome)

    def replan(self) -> None:
        self.inner.replan()


def test_round_robin_spreads_requests_and_all_complete() -> None:
    sim = Simulation(MODEL, backends(BOTH, BOTH, BOTH), build_router("round_robin"))
    result = sim.run(w.with_poisson_arrivals(w.fixed_lengths(30, 512, 16), rate=20.0))
    assert result.summary()["completed"] == 30
    counts = {b: sum(r.backend == b for r in result.records) for b in ("b0", "b1", "b2")}
    assert counts == {"b0": 10, "b1": 10, "b2": 10}
    assert all(r.output_tokens == 16 and r.ttft_s > 0 for r in result.records)
    assert result.output_throughput() > 0


def test_candidates_come_from_live_engine_state() -> None:
    spy = Spy(build_router("least_load"))
    sim = Simulation(MODEL, backends(BOTH, BOTH), spy, prefix_lookup=True)
    requests = w.shared_system_prompts(
        40, system_prompts=1, system_tokens=2048, user_tokens=64, max_tokens=32
    )
    sim.run(requests, concurrency=8)
    loads = np.array([c.load.sum() for _, c in spy.seen])
    cached = np.array([c.cached_tokens.max() for _, c in spy.seen])
    assert loads.max() >= 7  # the other clients' requests are in flight when one is routed
    assert cached[0] == 0 and cached[-1] >= 2048  # the shared system prompt is found in an engine's cache
    features = spy.seen[0][0]
    assert features.prompt_tokens == requests[0].prompt_len and 16 in features.block_hashes
    assert len(spy.outcomes) == 40 and all(o.output_tokens == 32 for o in spy.outcomes)


def test_prefix_policy_finds_more_cache_hits_than_round_robin() -> None:
    requests = w.with_poisson_arrivals(
        w.shared_system_prompts(60, system_prompts=4, system_tokens=4096, user_tokens=128, max_tokens=8),
        rate=10.0,
    )
    hits = {}
    for policy in ("round_robin", "prefix"):
        result = Simulation(MODEL, backends(BOTH, BOTH, BOTH, BOTH), build_router(policy)).run(requests)
        hits[policy] = sum(r.cached_tokens for r in result.records)
    assert hits["prefix"] > hits["round_robin"]


def test_prefix_spreads_a_burst_that_queues_before_it_holds_any_kv() -> None:
    """Prompts no backend holds go to the least loaded. A burst's prompts queue before they hold any KV,
    so by vLLM's usage they herded onto one backend: here seven of the eight onto b0, whose step in
    progress kept them waiting. Counted as requests in flight, each one counts where it went."""
    early = w.fixed_lengths(1, 512, 4000, name="early")  # b0 holds a long decode's KV
    burst = [dataclasses.replace(r, arrival_s=0.5) for r in w.fixed_lengths(8, 2000, 8, name="burst")]
    result = Simulation(MODEL, backends(BOTH, BOTH), build_router("prefix")).run(early + burst)
    assert [r.backend for r in result.records[:1]] == ["b0"]
    counts = Counter(r.backend for r in result.records[1:])
    assert min(counts["b0"], counts["b1"]) >= 3, counts


def test_pd_prefills_on_one_backend_decodes_on_another_and_frees_the_kv() -> None:
    prefill, decode = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
    sim = Simulation(MODEL, backends(prefill, decode, decode), build_router("least_load", "always"))
    result = sim.run(w.with_poisson_arrivals(w.fixed_lengths(20, 3000, 8), rate=5.0))
    assert result.summary()["completed"] == 20
    assert all(
        r.mode == Mode.PD and r.prefill_backend == "b0" and r.backend in ("b1", "b2") for r in result.records
    )
    assert all(r.output_tokens == 8 for r in result.records)
    stats = result.engine_stats
    assert stats["b0"]["kv_held_for_transfer_blocks"] == 0  # every prefill's KV was pulled and freed
    assert stats["b0"]["generation_tokens"] == 20  # one token per prefill leg, not shown to the client
    assert stats["b1"]["prompt_tokens"] + stats["b2"]["prompt_tokens"] == 20 * 3000
    # The decoder's pulled KV is not a cache hit: unique prompts, nothing cached where they prefilled.
    assert all(r.cached_tokens == 0 for r in result.records)


def test_pd_outcomes_are_credited_to_the_leg_that_did_the_work() -> None:
    """One outcome rule (scoring/outcome.py), as the gateway: the prefill leg on the prefiller with its
    own cached tokens, the decode leg on the decoder with none, naming its prefiller."""
    prefill, decode = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
    spy = Spy(build_router("least_load", "always"))
    Simulation(MODEL, backends(prefill, decode), spy).run(
        w.with_poisson_arrivals(w.fixed_lengths(5, 3000, 8), 2.0)
    )
    legs = sorted((o.leg.value, o.backend_id, o.peer_id, o.cached_tokens) for o in spy.outcomes)
    assert legs == [("decode", "b1", "b0", 0)] * 5 + [("prefill", "b0", "b1", 0)] * 5
    assert all(o.ttft_s > 0 for o in spy.outcomes)


def test_pd_ttft_includes_the_kv_transfer() -> None:
    prefill, decode = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
    request = w.fixed_lengths(1, 8000, 4)
    pd = Simulation(MODEL, backends(prefill, decode), build_router("least_load", "always")).run(request)
    local = Simulation(MODEL, backends(BOTH), build_router("least_load")).run(request)
    assert pd.records[0].ttft_s > local.records[0].ttft_s


def test_replay_is_deterministic() -> None:
    requests = w.with_poisson_arrivals(w.fixed_lengths(50, 256, 8), rate=40.0, seed=5)

    def once() -> dict[str, float]:
        summary = Simulation(MODEL, backends(BOTH, BOTH), build_router("least_load")).run(requests).summary()
        return {k: v for k, v in summary.items() if k != "wall_s"}

    assert once() == once()


def test_memoised_prompt_hashes_equal_hashing_the_whole_prompt() -> None:
    hasher = PromptHasher(root_hash(HashMode.TOKENS, "m"))
    prompts = [
        r.prompt for r in w.shared_system_prompts(5, system_prompts=2, system_tokens=1024, user_tokens=300)
    ]
    prompts += [r.prompt for r in w.mooncake_trace(limit=20)] + [w.fixed_lengths(1, 15, 1)[0].prompt]
    for block_size in (16, 128, 100):
        for prompt in prompts * 2:  # the second pass is served from the memo
            expected = hash_token_ids(prompt.token_array(), block_size, root_hash(HashMode.TOKENS, "m"))
            assert hasher(prompt, block_size) == expected


def test_seed_case_report_shape_and_bound(tmp_path: Any) -> None:
    from bench import seed_case

    small = seed_case.SeedWorkload(
        prompt_tokens=8192, output_tokens=64, concurrency_per_server=2, requests_per_client=3
    )
    report = seed_case.run(load_catalog(), seed_case.FITTED, small)
    simulated = report["simulated"]
    assert set(report["published"]) == {"mi300x_alone", "mi308x_alone", "load_balanced", "disaggregated"}
    assert {"mi300x_alone", "mi308x_alone", "load_balanced", "disaggregated", "upper_bound"} <= set(simulated)
    cluster = ("load_balanced", "disaggregated", "load_balanced_least_load", "cost_auto", "cost_auto_slo")
    assert all(0 < simulated[k] <= simulated["upper_bound"] for k in cluster)
    assert simulated["mi300x_alone"] > simulated["mi308x_alone"]
    path = tmp_path / "seed.png"
    seed_case.plot(report, str(path))
    assert path.stat().st_size > 1000


def test_candidates_match_a_registry_build_of_the_live_stats() -> None:
    checked = []

    class Checker(Spy):
        def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
            built = Candidates.build(candidates.specs, replay.live_stats(), candidates.cached_tokens)
            columns = ("healthy", "can_prefill", "can_decode", "load", "capacity", "kv_usage")
            work = ("prefill_tokens", "prefill_len", "decode_seqs", "context_tokens")
            for column in columns + work:
                np.testing.assert_array_equal(getattr(candidates, column), getattr(built, column))
            checked.append(built.load.sum())
            return super().plan(request, candidates)

    sim = Simulation(
        MODEL, backends(BOTH, BOTH, frozenset({Role.DECODE})), Checker(build_router("least_load"))
    )
    replay = sim.replay(w.with_poisson_arrivals(w.fixed_lengths(60, 2000, 16), rate=40.0))
    replay.execute()
    assert len(checked) == 60 and max(checked) > 3


def test_a_split_decode_leg_is_due_on_its_decoder_until_its_prefill_leg_ends() -> None:
    """Each plan sees every split planned before it whose prefill leg has not ended, on its decoder, due
    when it was planned (an unpriced plan predicts no prefill time), in seconds from now."""
    checked = []

    class Checker(Spy):
        def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
            records = replay.records
            now = records[len(self.seen)].arrival_s
            pending = [
                (sim.specs.index(next(s for s in sim.specs if s.id == r.backend)), r.arrival_s - now)
                for r in records[: len(self.seen)]
                if r.mode is Mode.PD and not r.prefill_done_s <= now
            ]
            got = sorted(zip(candidates.kv_due_rows.tolist(), candidates.kv_due_s.tolist(), strict=True))
            assert got == [pytest.approx(p) for p in sorted(pending)]
            checked.append(len(pending))
            return super().plan(request, candidates)

    prefill, decode = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
    sim = Simulation(MODEL, backends(prefill, decode, decode), Checker(build_router("least_load", "always")))
    replay = sim.replay(w.with_poisson_arrivals(w.fixed_lengths(60, 4000, 16), rate=30.0))
    replay.execute()
    assert len(checked) == 60 and max(checked) >= 3


def test_pd_removes_prefill_interference_from_decode_steps() -> None:
    requests = w.with_poisson_arrivals(w.fixed_lengths(40, 6000, 64), rate=4.0, seed=2)

    def mean_tpot(result: Any) -> float:
        done = [r for r in result.records if r.output_tokens > 1]
        return float(np.mean([(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in done]))

    colocated = Simulation(MODEL, backends(BOTH, BOTH), build_router("least_load")).run(requests)
    prefill, decode = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
    split = Simulation(MODEL, backends(prefill, decode), build_router("least_load", "always")).run(requests)
    assert split.summary()["completed"] == colocated.summary()["completed"] == 40
    assert mean_tpot(split) < 0.75 * mean_tpot(colocated)  # measured: ~0.6


def test_the_prompt_in_progress_is_counted_by_what_its_plan_predicted_is_left() -> None:
    """The DES keeps the gateway's prefill queue per engine (`Reserved`): legs in plan order, the first
    one dated by its plan's predicted prefill. Every plan sees each engine's reserved prompt tokens less
    the share of the first that its prediction says is done (past its predicted end, all but its last
    chunk); every leg leaves the queue by the end."""
    credited = []

    class Checker(Spy):
        def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan:
            now = candidates.now
            for k, reserved in enumerate(replay.reserved):
                if not reserved.prefilling:
                    assert candidates.prefill_tokens[k] == 0
                    continue
                head = reserved.prefilling[0]
                assert head.prefill_s > 0 and reserved.head_tokens == head.prefill_tokens
                share = max(now - reserved.head_since, 0.0) / head.prefill_s
                long = head.prefill_tokens > DEFAULT_CHUNK_TOKENS  # a shorter one is done with its step
                # Past its predicted end, all but its last chunk: that one counts until its first token.
                chunks_before_last = np.ceil(head.prefill_tokens / DEFAULT_CHUNK_TOKENS) - 1
                done = share * head.prefill_tokens if share < 1 else chunks_before_last * DEFAULT_CHUNK_TOKENS
                want = reserved.prefill_tokens - done * long
                assert candidates.prefill_tokens[k] == pytest.approx(want)
                credited.append(share)
            return super().plan(request, candidates)

    sim = Simulation(MODEL, backends(BOTH, BOTH), Checker(build_router("cost", "never", model=MODEL)))
    prompts = w.fixed_lengths(20, 12000, 16, "long") + w.fixed_lengths(20, 3000, 16, "short")
    replay = sim.replay(w.with_poisson_arrivals(random.Random(1).sample(prompts, 40), rate=30.0))
    assert replay.execute().summary()["completed"] == 40
    assert len(credited) > 20 and 0 < np.median(credited) < 1  # prompts in progress, partly done
    assert all(not r.prefilling and r.prefill_tokens == 0 and r.head_tokens == 0 for r in replay.reserved)
