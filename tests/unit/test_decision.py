"""What the Decider does to a policy's plan before it is executed (gateway/decision.py)."""

from __future__ import annotations

from gateway.config import BackendConfig
from gateway.decision import demote, route_text
from gateway.registry import BackendState
from scoring.types import Mode, Prediction, RoutePlan


def state(backend_id: str) -> BackendState:
    config = BackendConfig(id=backend_id, url="http://127.0.0.1:1", model="m", accelerator="mi300x")
    return BackendState(config)


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


def test_the_route_names_the_backends_and_what_the_plan_predicted_for_them():
    p, d = state("p"), state("d")
    assert route_text([p], None) == "mode=aggregated; backend=p"
    assert (
        route_text([p], None, "; fallback=decode_failed")
        == "mode=aggregated; backend=p; fallback=decode_failed"
    )
    assert route_text([p, d], None) == "mode=pd; prefill=p; decode=d"
    priced = Prediction(ttft_s=0.12345, tpot_s=0.01, expected_tpot_s=0.0314159, rows=(0, 1))
    assert route_text([p, d], priced) == (
        "mode=pd; prefill=p; decode=d; predicted_ttft_ms=123.5; predicted_tpot_ms=31.42"
    )
