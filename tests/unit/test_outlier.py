"""Outlier detection's state machine (gateway/outlier.py), table-driven with time passed in."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import Outlier
from gateway.outlier import OutlierPool, OutlierState, Verdict

S, E, G = Verdict.SUCCESS, Verdict.ERROR, Verdict.GATEWAY

# (time, backend index, verdict)
Event = tuple[float, int, Verdict]


Ejection = tuple[float, int, float]  # (time, backend index, duration)
DEFAULTS = {"consecutive_5xx": 5, "consecutive_gateway_failure": 3, "max_ejection_percent": 50}


def run(events: list[Event], n: int = 2, **settings: Any) -> tuple[list[Ejection], OutlierPool]:
    """Feed the events; returns every ejection."""
    members = [OutlierState(f"b{i}") for i in range(n)]
    pool = OutlierPool(Outlier(**{**DEFAULTS, **settings}), members)
    ejections = []
    for t, i, verdict in events:
        if pool.record(members[i], verdict, t):
            ejections.append((t, i, members[i].ejected_until - t))  # type: ignore[operator]
    return ejections, pool


def repeat(verdict: Verdict, times: int, start: float = 0.0, backend: int = 0) -> list[Event]:
    return [(start + k * 0.1, backend, verdict) for k in range(times)]


@pytest.mark.parametrize(
    ("events", "settings", "expected"),
    [
        # consecutive_5xx: the fifth 5xx in a row ejects, for base_ejection_time_s
        (repeat(E, 4), {}, []),
        (repeat(E, 5), {}, [(0.4, 0, 30.0)]),
        # a success in between starts the count again
        ([*repeat(E, 4), (0.5, 0, S), *repeat(E, 4, start=1)], {}, []),
        # gateway failures have their own, lower threshold, and count as 5xx too (as in Envoy)
        (repeat(G, 3), {}, [(0.2, 0, 30.0)]),
        ([*repeat(E, 3), *repeat(G, 2, start=1)], {}, [(1.1, 0, 30.0)]),
        # 0 switches a detector off
        (repeat(E, 50), {"consecutive_5xx": 0}, []),
        (repeat(G, 50), {"consecutive_5xx": 0, "consecutive_gateway_failure": 0}, []),
        # other backends' verdicts do not interleave with this one's count
        ([(k, k % 2, E if k % 2 == 0 else S) for k in range(10)], {}, [(8, 0, 30.0)]),
        # verdicts while ejected change nothing; after the ejection the backend starts clean
        ([*repeat(E, 5), *repeat(E, 20, start=5), *repeat(E, 4, start=31)], {}, [(0.4, 0, 30.0)]),
        # failing again soon after returning: ejected for longer (base x times ejected) ...
        ([*repeat(E, 5), *repeat(E, 5, start=31)], {}, [(0.4, 0, 30.0), (31.4, 0, 60.0)]),
        # ... capped at max_ejection_time_s
        (
            [*repeat(E, 5), *repeat(E, 5, start=31), *repeat(E, 5, start=92)],
            {"max_ejection_time_s": 70},
            [(0.4, 0, 30.0), (31.4, 0, 60.0), (92.4, 0, 70.0)],
        ),
        # the multiplier decays by one per decay_interval_s back in rotation
        ([*repeat(E, 5), *repeat(E, 5, start=45)], {}, [(0.4, 0, 30.0), (45.4, 0, 30.0)]),
        (
            [*repeat(E, 5), *repeat(E, 5, start=31), *repeat(E, 5, start=91.4 + 25)],
            {},
            [(0.4, 0, 30.0), (31.4, 0, 60.0), (116.8, 0, 30.0)],
        ),
    ],
)
def test_one_backend(events, settings, expected):
    ejections, _ = run(events, **settings)
    assert ejections == [(pytest.approx(t), i, pytest.approx(d)) for t, i, d in expected]


@pytest.mark.parametrize(
    ("n", "percent", "max_ejected"),
    [
        (1, 10, 0),  # never the whole pool
        (2, 10, 1),  # 10 % of 2 rounds to 0, but at least one may go
        (2, 100, 1),
        (4, 50, 2),
        (10, 10, 1),
        (10, 25, 2),
        (20, 10, 2),
        (5, 0, 1),
    ],
)
def test_cap_on_how_many_are_ejected_at_once(n, percent, max_ejected):
    events = [e for i in range(n) for e in repeat(G, 3, start=i, backend=i)]
    ejections, pool = run(events, n=n, max_ejection_percent=percent)
    assert pool.max_ejected == max_ejected
    assert len(ejections) == max_ejected
    assert sum(m.ejected(n + 1) for m in pool.members) == max_ejected


def test_an_ejection_over_the_cap_waits_for_room_then_happens_on_the_next_failure():
    events = [*repeat(G, 3, backend=0), *repeat(G, 3, start=1, backend=1)]
    events += [(20, 1, G), (31, 1, G)]  # b0 is still out at 20 s, back at 30.2 s
    ejections, pool = run(events, max_ejection_percent=10)
    assert ejections == [(0.2, 0, 30.0), (31, 1, 30.0)]
    assert not pool.members[0].ejected(31) and pool.members[1].ejected(31)


def test_release_due_returns_those_whose_time_is_over_once():
    _, pool = run([*repeat(G, 3, backend=0), *repeat(G, 3, start=10, backend=1)], n=4)
    assert pool.release_due(29) == []
    assert [m.key for m in pool.release_due(30.5)] == ["b0"]
    assert pool.release_due(31) == []
    assert [m.key for m in pool.release_due(41)] == ["b1"]
    assert all(m.consecutive_5xx == m.consecutive_gateway == 0 for m in pool.members)


def test_a_success_resets_both_counters():
    _, pool = run([*repeat(G, 2), *repeat(E, 3, start=1)], consecutive_5xx=10)
    member = pool.members[0]
    assert (member.consecutive_5xx, member.consecutive_gateway) == (5, 2)
    pool.record(member, S, 3)
    assert (member.consecutive_5xx, member.consecutive_gateway) == (0, 0)
