"""The prefix policy: affinity to the longest cached prefix, guarded by load (table-driven)."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.prefix import PrefixRouter, overloaded, prefix_hit_score
from scoring.types import BackendSpec, BackendStats, Candidates, Mode, RequestFeatures, Role

BOTH = frozenset({Role.PREFILL, Role.DECODE})
REQUEST = RequestFeatures(model="m", prompt_tokens=1000, max_tokens=16)


def candidates(
    cached: list[int],
    load: list[int],
    healthy: list[bool] | None = None,
    roles: list[frozenset[Role]] | None = None,
    capacity: list[int] | None = None,
) -> Candidates:
    n = len(cached)
    specs = tuple(
        BackendSpec(
            id=f"b{i}",
            model="m",
            accelerator="cpu",
            gpus=1,
            roles=(roles or [BOTH] * n)[i],
            max_num_seqs=(capacity or [256] * n)[i],
        )
        for i in range(n)
    )
    stats = tuple(BackendStats(healthy=(healthy or [True] * n)[i], in_flight=load[i]) for i in range(n))
    return Candidates.build(specs, stats, np.asarray(cached, dtype=np.int64))


D = frozenset({Role.DECODE})
P = frozenset({Role.PREFILL})

CASES = [
    # (name, cached, load, healthy, roles, expected first, reason)
    ("follows longest prefix", [0, 512, 256], [0, 5, 0], None, None, 1, "prefix_hit"),
    ("small absolute skew keeps affinity", [512, 0], [30, 0], None, None, 0, "prefix_hit"),
    ("small ratio keeps affinity", [512, 0, 0], [300, 250, 260], None, None, 0, "prefix_hit"),
    ("both thresholds broken: least load", [512, 0, 0], [49, 16, 20], None, None, 1, "prefix_overloaded"),
    ("exactly at the abs threshold: keep", [512, 0, 0], [48, 16, 20], None, None, 0, "prefix_hit"),
    ("overloaded holder: next holder wins", [512, 256, 0], [100, 10, 0], None, None, 1, "prefix_hit"),
    ("equal prefixes: lower load", [512, 512, 0], [9, 3, 0], None, None, 1, "prefix_hit"),
    ("nothing cached: least load", [0, 0, 0], [4, 1, 2], None, None, 1, "no_prefix"),
    ("unhealthy holder skipped", [512, 0, 0], [0, 3, 1], [False, True, True], None, 2, "no_prefix"),
    ("prefill-only holder skipped", [512, 128, 0], [0, 0, 0], None, [P, D, BOTH], 1, "prefix_hit"),
]


@pytest.mark.parametrize(
    ("cached", "load", "healthy", "roles", "first", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_plan_picks(cached, load, healthy, roles, first, reason) -> None:
    plan = PrefixRouter().plan(REQUEST, candidates(cached, load, healthy, roles))
    assert plan.mode is Mode.AGGREGATED
    assert plan.aggregated[0] == first
    assert plan.reason == reason


def test_plan_ranks_every_eligible_backend_once_with_fallbacks_least_loaded() -> None:
    plan = PrefixRouter().plan(REQUEST, candidates([512, 0, 0, 0], [5, 7, 1, 3], [True, True, True, False]))
    assert plan.aggregated == (0, 2, 1)


def test_no_eligible_backend() -> None:
    plan = PrefixRouter().plan(REQUEST, candidates([512], [0], [False]))
    assert plan.aggregated == () and plan.reason == "no_healthy_backend"


def test_cold_start_ties_rotate() -> None:
    router = PrefixRouter()
    firsts = {router.plan(REQUEST, candidates([0, 0, 0], [0, 0, 0])).aggregated[0] for _ in range(3)}
    assert firsts == {0, 1, 2}


def test_least_load_fallback_normalises_by_capacity() -> None:
    plan = PrefixRouter().plan(REQUEST, candidates([0, 0], [10, 30], capacity=[16, 256]))
    assert plan.aggregated == (1, 0)


def test_rank_respects_the_callers_mask() -> None:
    cands = candidates([512, 256, 0], [0, 0, 0])
    ranked = PrefixRouter().rank(REQUEST, cands, np.array([False, True, True]))
    assert list(ranked) == [1, 2]


@pytest.mark.parametrize(
    ("load", "abs_t", "rel_t", "expected"),
    [
        ([0, 33], 32, 1.5, [False, True]),
        ([0, 32], 32, 1.5, [False, False]),
        ([100, 140], 32, 1.5, [False, False]),  # +40 but only 1.4x
        ([100, 151], 32, 1.5, [False, True]),
        ([5, 5], 0, 1.0, [False, False]),
        ([], 32, 1.5, []),
    ],
)
def test_overloaded_needs_both_thresholds(load, abs_t, rel_t, expected) -> None:
    assert overloaded(np.asarray(load, dtype=float), abs_t, rel_t).tolist() == expected


@pytest.mark.parametrize(
    ("prompt_tokens", "cached", "expected"),
    [(1000, [0, 500, 1000], [0.0, 0.5, 1.0]), (100, [128], [1.0]), (0, [0, 16], [0.0, 0.0])],
)
def test_prefix_hit_score(prompt_tokens, cached, expected) -> None:
    request = RequestFeatures(model="m", prompt_tokens=prompt_tokens, max_tokens=1)
    score = prefix_hit_score(request, candidates(cached, [0] * len(cached)))
    assert score.tolist() == expected


@pytest.mark.parametrize(("abs_t", "rel_t"), [(-1, 1.5), (32, 0.9)])
def test_invalid_knobs(abs_t, rel_t) -> None:
    with pytest.raises(ValueError):
        PrefixRouter(abs_t, rel_t)


def test_is_a_router_named_prefix() -> None:
    router = PrefixRouter(balance_abs_threshold=64, balance_rel_threshold=2.0)
    assert router.name == "prefix"
    assert router.observe is not None
