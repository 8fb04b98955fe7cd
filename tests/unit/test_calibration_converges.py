"""The cost policy's online calibration, run against the simulator: the simulated backends run at their
cluster's own efficiency, which the router does not know, so what the router learns can be compared
with the truth. Bursts included: prompts that arrive together share an engine step, which no plan can
see; calibration must count that as queue, not as slowness."""

from __future__ import annotations

import pytest

from bench.policies import build_scenario, cluster_named, make_router, scenario_bound
from bench.sim.des import Simulation
from scoring.cost import DEFAULT_EFFICIENCY, prefill_time


@pytest.mark.parametrize(("scenario", "tolerance"), [("bursty@nvidia", 0.1), ("azure-conv@amd", 0.1)])
def test_learnt_compute_corrections_approach_the_truth(scenario: str, tolerance: float) -> None:
    sc = build_scenario(scenario, 200)
    cluster = cluster_named(sc.cluster)
    router = make_router(cluster, "cost/auto")
    Simulation(cluster.model, cluster.backends, router, cluster.efficiency).run(
        sc.at_rate(0.1 * scenario_bound(sc).requests_per_s)
    )
    hw = cluster.hardware()
    truth = prefill_time(cluster.model, hw, 1536, 0, cluster.efficiency) / prefill_time(
        cluster.model, hw, 1536, 0, DEFAULT_EFFICIENCY
    )
    for backend_id, true in zip(cluster.ids, truth, strict=True):
        assert router.correction(backend_id) == pytest.approx(true, rel=tolerance), backend_id
