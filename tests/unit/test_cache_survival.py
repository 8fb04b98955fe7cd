"""How much of an indexed prefix a backend's prompts still find when vLLM admits them (`CacheSurvival`),
the counts it is learnt from (`Reserved`, `leg_load`), and where the gateway and the simulator use it."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.config import parse_config
from gateway.registry import Registry
from gateway.stats import VllmLoad
from scoring.load import SURVIVAL_NOISE, CacheSurvival, Reserved, leg_load

N = 100_000  # prompt tokens per report in these tests: a tenth of the window
HALF = 0.5 / (1 - SURVIVAL_NOISE)  # the factor when half the promised prefix was found
Report = tuple[float, float, float, float]  # cumulative hits, queries (vLLM); indexed, queried (own)


def fed(reports: list[Report]) -> CacheSurvival:
    """A fresh estimate fed cumulative (hits, queries, indexed, queried) reports, after a zero baseline."""
    survival = CacheSurvival()
    survival.observe(0, 0, 0, 0)
    for report in reports:
        survival.observe(*report)
    return survival


def cumulative(per_report: Report, n: int) -> list[Report]:
    return [tuple(k * v for v in per_report) for k in range(1, n + 1)]  # type: ignore[misc]


def test_a_prefix_found_as_promised_counts_whole():
    assert fed(cumulative((0.6 * N, N, 0.6 * N, N), 5)).factor == 1.0


def test_prompts_that_found_half_the_promised_prefix_count_half_of_it():
    factor = fed(cumulative((0.3 * N, N, 0.6 * N, N), 5)).factor
    assert factor == pytest.approx(HALF)


def test_a_shortfall_within_the_counters_timing_is_none():
    """vLLM counts a prompt when it admits it, the gateway when its prefill is done: a few percent apart."""
    assert fed(cumulative((0.58 * N, N, 0.6 * N, N), 5)).factor == 1.0


def test_other_clients_traffic_does_not_skew_it():
    """vLLM's counters include prompts the gateway did not plan (another replica's, another client's):
    compared as rates, twice the queries at the same hit rate say the same."""
    assert fed(cumulative((1.2 * N, 2 * N, 0.6 * N, N), 5)).factor == 1.0
    assert fed(cumulative((0.6 * N, 2 * N, 0.6 * N, N), 5)).factor == pytest.approx(
        0.5 / (1 - SURVIVAL_NOISE)
    )


def test_it_never_counts_more_than_the_index_promised():
    assert fed(cumulative((0.9 * N, N, 0.3 * N, N), 5)).factor == 1.0


def test_the_first_report_is_the_baseline():
    """A gateway that starts beside a vLLM that has served for hours reads its counters as they stand."""
    survival = CacheSurvival()
    survival.observe(1e3, 1e9, 0, 0)  # hours of misses before this gateway
    survival.observe(1e3 + 0.6 * N, 1e9 + N, 0.6 * N, N)
    assert survival.factor == 1.0


def test_too_little_promised_leaves_it_as_it_was():
    assert fed([(0, N, 4000, N)]).factor == 1.0


def test_a_restarted_vllm_starts_over():
    survival = fed(cumulative((0.3 * N, N, 0.6 * N, N), 5))
    assert survival.factor < 0.6
    survival.observe(0.5 * N, N, 3.6 * N, 6 * N)  # vLLM's counters went back: it restarted
    assert survival.factor == 1.0


def test_it_forgets_what_it_saw_long_ago():
    evicting = cumulative((0.3 * N, N, 0.6 * N, N), 5)
    last = evicting[-1]
    steps = cumulative((0.6 * N, N, 0.6 * N, N), 60)
    healthy = [tuple(a + b for a, b in zip(last, step, strict=True)) for step in steps]
    survival = fed(evicting + healthy[:3])
    assert survival.factor < 0.9  # three healthy reports do not outweigh five bad ones
    survival = fed(evicting + healthy)
    assert survival.factor == 1.0  # six windows later they are forgotten


def test_a_leg_reserves_as_uncached_what_is_not_expected_to_survive():
    leg = leg_load("aggregated", 1000, 8, 800, survival=0.5)
    assert (leg.prefill_tokens, leg.queried_tokens, leg.indexed_tokens) == (600, 1000, 800)
    assert leg_load("prefill", 1000, 8, 800).prefill_tokens == 200
    decode = leg_load("decode", 1000, 8, 300, kv_due_s=1.0, survival=0.5)
    # vLLM looks a decode leg's prompt up too (its local hits come before the connector's)
    assert (decode.prefill_tokens, decode.queried_tokens, decode.indexed_tokens) == (0, 1000, 300)


def test_legs_count_as_looked_up_once_admitted():
    """The gateway's totals move as vLLM's counters do: when a leg's prefill is done (it was admitted),
    when a split's decode leg gets its KV, at once for a leg with nothing to prefill; a leg that fails
    before its prefill counts when it is released, and none counts twice."""
    r = Reserved()
    queued = leg_load("aggregated", 1000, 8, 600)
    due = leg_load("decode", 2000, 8, 0, kv_due_s=5.0)
    whole = leg_load("aggregated", 500, 8, 500)  # the index holds the whole prompt
    failing = leg_load("prefill", 300, 8, 0)
    for leg in (queued, due, whole, failing):
        r.add(leg, 0.0)
    assert (r.queried_tokens, r.indexed_tokens) == (500, 500)
    r.prefill_done(queued, 1.0)
    r.prefill_done(due, 1.0)
    assert (r.queried_tokens, r.indexed_tokens) == (3500, 1100)
    r.release(failing, prefill_pending=True, now=2.0)
    for leg in (queued, due, whole):
        r.release(leg, prefill_pending=False, now=2.0)
    assert (r.queried_tokens, r.indexed_tokens) == (3800, 1100)


def test_the_registry_learns_it_from_each_scrape_and_routes_with_it():
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "backends": [
                {"id": f"b{i}", "url": f"http://127.0.0.1:{i + 1}", "model": "m", "accelerator": "cpu"}
                for i in range(2)
            ],
        }
    )
    reg = Registry(config)
    evicting, keeping = reg.backends["b0"], reg.backends["b1"]
    for backend in (evicting, keeping):
        backend.report(VllmLoad())
    for k in range(1, 6):
        for backend, hit_rate in ((evicting, 0.3), (keeping, 0.6)):
            for _ in range(10):  # ten 10k-token prompts, 6k of each indexed, admitted
                reg.reserve(backend, leg_load("aggregated", 10_000, 8, 6000)).prefill_done()
            backend.report(VllmLoad(prefix_queries=k * N, prefix_hits=k * hit_rate * N))
    c = reg.candidates(reg.pools["m"], np.array([6000, 6000]))
    assert c.cache_survival == pytest.approx([HALF, 1.0])
    assert c.surviving_cached() == pytest.approx([6000 * HALF, 6000])
