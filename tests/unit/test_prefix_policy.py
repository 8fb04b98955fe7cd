"""The prefix policy: SGLang's cache_aware rules on the prefix index (table-driven)."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.prefix import CacheAware, imbalanced
from scoring.router import build_router
from scoring.types import BackendSpec, BackendStats, Candidates, Mode, RequestFeatures, Role

BOTH = frozenset({Role.PREFILL, Role.DECODE})
D = frozenset({Role.DECODE})
P = frozenset({Role.PREFILL})
REQUEST = RequestFeatures(model="m", prompt_tokens=1000, max_tokens=16)


def candidates(
    cached: list[int],
    load: list[int],
    healthy: list[bool] | None = None,
    roles: list[frozenset[Role]] | None = None,
    kv: list[float] | None = None,
) -> Candidates:
    n = len(cached)
    specs = tuple(
        BackendSpec(id=f"b{i}", model="m", accelerator="cpu", gpus=1, roles=(roles or [BOTH] * n)[i])
        for i in range(n)
    )
    stats = tuple(
        BackendStats(healthy=(healthy or [True] * n)[i], in_flight=load[i], kv_usage=(kv or [0.0] * n)[i])
        for i in range(n)
    )
    return Candidates.build(specs, stats, np.asarray(cached, dtype=np.int64))


CASES = [
    # (name, cached, load, kv usage, expected first)
    ("holder of a long prefix wins", [0, 512, 0], [0, 5, 0], None, 1),
    ("share at the threshold is not enough", [300, 0, 0], [5, 0, 0], None, 1),  # 0.3 is not > 0.3
    ("a prefix every backend holds does not attract", [512, 512, 512], [5, 1, 3], None, 1),
    ("equal holders: the least loaded", [512, 512, 0], [9, 3, 0], None, 1),
    ("imbalanced cluster: least load, cache ignored", [900, 0, 0], [100, 10, 20], None, 1),
    ("abs skew alone keeps affinity", [900, 0, 0], [70, 10, 10], None, 0),  # 60 <= 64
    ("rel skew alone keeps affinity", [900, 0, 0], [300, 250, 260], None, 0),  # 300 < 1.5 * 250
    ("no affinity: the least loaded, whatever its KV usage", [0, 0, 0], [3, 1, 2], [0.1, 0.9, 0.2], 1),
    ("no affinity, equal loads: the first configured", [0, 0, 0], [2, 0, 0], [0.1, 0.9, 0.2], 1),
]


@pytest.mark.parametrize(("cached", "load", "kv", "first"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cache_aware_first_choice(cached, load, kv, first) -> None:
    cands = candidates(cached, load, kv=kv)
    order = CacheAware().rank(REQUEST, cands, cands.healthy)
    assert sorted(order.tolist()) == list(range(len(cached)))
    assert order[0] == first


def test_beyond_common_share_threshold() -> None:
    # 900 vs 500 everywhere else: 400 / 1000 = 0.4 beyond the common part, > 0.3.
    cands = candidates([900, 500, 500], [5, 0, 0])
    assert CacheAware().rank(REQUEST, cands, cands.healthy)[0] == 0
    # 700 vs 500: 0.2 beyond, not enough: the least loaded.
    cands = candidates([700, 500, 500], [5, 0, 1])
    assert CacheAware().rank(REQUEST, cands, cands.healthy)[0] == 1


def test_fallbacks_follow_least_load() -> None:
    cands = candidates([900, 0, 0, 0], [1, 7, 2, 5])
    assert CacheAware().rank(REQUEST, cands, cands.healthy).tolist() == [0, 2, 3, 1]


def test_unhealthy_and_prefill_only_backends_are_skipped() -> None:
    router = build_router("prefix")
    plan = router.plan(REQUEST, candidates([900, 0, 0], [0, 3, 1], healthy=[False, True, True]))
    assert plan.aggregated[0] == 2
    plan = router.plan(REQUEST, candidates([900, 600, 0], [0, 0, 0], roles=[P, D, BOTH]))
    assert plan.aggregated[0] == 1 and 0 not in plan.aggregated


def test_split_picks_prefill_and_decode_cache_aware_each_in_its_pool() -> None:
    router = build_router("prefix", "always")
    plan = router.plan(REQUEST, candidates([0, 900, 0, 0], [0, 0, 5, 1], roles=[P, P, D, D]))
    assert plan.mode is Mode.PD
    assert plan.prefill[0] == 1
    assert plan.decode[0] == 3  # neither decoder holds any of it: the emptiest cache, ties by load
    # SGLang's P/D router ranks the decode pool with the main policy too: the holder decodes, busy or not.
    plan = router.plan(REQUEST, candidates([0, 900, 900, 0], [0, 0, 5, 1], roles=[P, P, D, D]))
    assert (plan.prefill[0], plan.decode[0]) == (1, 2)


def test_no_affinity_goes_to_the_least_loaded_not_the_emptiest_cache() -> None:
    """sglang-router 0.3.2 sends a prompt no worker holds enough of to the fewest requests in flight,
    ties to the first worker. Ranked by vLLM's KV usage, a backend that frees its KV at once (usage 0)
    took every request until the next report; by load, each request counts where it went."""
    policy = CacheAware()
    load = [0, 0, 0]
    chosen = []
    for _ in range(6):
        cands = candidates([0, 0, 0], load, kv=[0.0, 0.5, 0.5])
        first = int(policy.rank(REQUEST, cands, cands.healthy)[0])
        load[first] += 1
        chosen.append(first)
    assert chosen == [0, 1, 2, 0, 1, 2]


def test_auto_serves_a_conversations_next_turn_whole_where_it_is_cached() -> None:
    """Under `auto` the split is judged on the decoder the policy picks (llm-d's prefix-based decider):
    the holder lacks only the new turn, so it serves the turn whole. A decoder picked by least load
    lacked the whole context, and the turn was split off and its context shipped."""
    router = build_router("prefix", "auto")
    turn = RequestFeatures(model="m", prompt_tokens=4000, max_tokens=16)
    plan = router.plan(turn, candidates([3500, 0, 0], [5, 0, 1]))
    assert (plan.mode, plan.aggregated[0], plan.reason) == (Mode.AGGREGATED, 0, "short_prompt")
    fresh = router.plan(turn, candidates([0, 0, 0], [5, 0, 1]))  # held nowhere: split, decode on the emptiest
    assert (fresh.mode, fresh.decode[0]) == (Mode.PD, 1)


def test_auto_does_not_split_a_turn_off_a_holder_that_may_prefill_it() -> None:
    """A turn that lacks more than the gate is split only onto a prefill backend holding as much of it
    as the decoder; else the split prefills from scratch what the decoder holds, and the turn is served
    whole there. A decode-only holder keeps its role, and a prefix every backend holds splits as before."""
    router = build_router("prefix", "auto")
    turn = RequestFeatures(model="m", prompt_tokens=12000, max_tokens=16)
    plan = router.plan(turn, candidates([8000, 0, 0], [5, 0, 1]))  # lacks 4,000 >= the 1,024 gate
    assert (plan.mode, plan.aggregated[0], plan.reason) == (Mode.AGGREGATED, 0, "split_adds_prefill")
    decode_only = router.plan(turn, candidates([8000, 0, 0], [5, 0, 1], roles=[D, BOTH, BOTH]))
    assert (decode_only.mode, decode_only.decode[0], decode_only.prefill[0]) == (Mode.PD, 0, 1)
    shared = router.plan(turn, candidates([8000, 8000, 0], [0, 0, 1]))
    assert (shared.mode, shared.decode[0], shared.prefill[0]) == (Mode.PD, 0, 1)


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        ([0, 0], False),
        ([65, 0], True),
        ([64, 0], False),
        ([200, 150], False),
        ([226, 150], True),
        ([], False),
    ],
)
def test_imbalance_rule(load, expected) -> None:
    assert imbalanced(np.asarray(load, dtype=float), 64, 1.5) is expected


@pytest.mark.parametrize(("t", "a", "r"), [(-0.1, 64, 1.5), (1.1, 64, 1.5), (0.3, -1, 1.5), (0.3, 64, 0.9)])
def test_bad_knobs_rejected(t, a, r) -> None:
    with pytest.raises(ValueError):
        CacheAware(t, a, r)


def test_declares_prefix_index_use() -> None:
    assert build_router("prefix").uses_prefix_index
    assert not build_router("round_robin").uses_prefix_index
