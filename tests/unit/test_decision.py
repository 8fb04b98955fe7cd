"""What the Decider does to a policy's plan before it is executed (gateway/decision.py)."""

from __future__ import annotations

from gateway.decision import demote
from scoring.types import Mode, RoutePlan


def test_backends_cooling_down_are_tried_last_and_stay_as_fallbacks():
    plan = RoutePlan(mode=Mode.PD, aggregated=(2, 0, 1, 3), prefill=(1, 3), decode=(0, 2), reason="split")
    demoted = demote(plan, frozenset({0, 1}))
    assert demoted.aggregated == (2, 3, 0, 1)  # the policy's order kept within each group
    assert demoted.prefill == (3, 1)
    assert demoted.decode == (2, 0)
    assert (demoted.mode, demoted.reason) == (Mode.PD, "split")


def test_nothing_cooling_leaves_the_plan_as_it_is():
    plan = RoutePlan(mode=Mode.AGGREGATED, aggregated=(1, 0), reason="never")
    assert demote(plan, frozenset()) is plan
    assert demote(plan, frozenset({0, 1})) == plan  # everyone busy: nothing to reorder
