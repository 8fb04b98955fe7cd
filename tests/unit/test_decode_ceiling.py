"""`bench.decode_ceiling`: a cluster's decoders alone, with prefill and KV transfer free."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench import policies as pb
from bench import workloads as w
from bench.clusters import Cluster
from bench.decode_ceiling import decode_goodput
from bench.decode_ceiling import main as ceiling_main
from scoring.cost import decode_step_time
from scoring.types import Role


def _one_request_on(cluster_name: str) -> tuple[pb.Scenario, float]:
    """One request alone on the cluster, and its TPOT there: the fastest decoder's step at batch 1."""
    request = w.fixed_lengths(1, 1024, 65, name="alone")
    scenario = pb.Scenario("alone", cluster_name, tuple(request))
    cluster = pb.cluster_named(cluster_name)
    steps = decode_step_time(cluster.model, cluster.hardware(), 1, 1024 + 65 / 2, cluster.efficiency)
    return scenario, float(np.min(steps))


def test_a_request_alone_decodes_at_the_fastest_decoders_step() -> None:
    scenario, step = _one_request_on("amd")
    cluster = pb.cluster_named("amd")
    ttft = np.array([1.0])
    assert decode_goodput(cluster, scenario, 1.0, (ttft, np.array([step * 1.001]))) == 1.0
    assert decode_goodput(cluster, scenario, 1.0, (ttft, np.array([step * 0.999]))) == 0.0


def test_more_traffic_meets_the_limit_less_often() -> None:
    scenario = pb.get_scenario("sysprompt@amd", 200)
    cluster = pb.cluster_named(scenario.cluster)
    limits = pb.Slo().limits(cluster, scenario.requests)
    shares = [decode_goodput(cluster, scenario, rate, limits) for rate in (0.5, 8.0, 64.0)]
    assert shares[0] == 1.0
    assert shares[0] >= shares[1] >= shares[2]
    assert shares[2] < pb.GOAL


def test_groups_arriving_together_lower_the_ceiling_the_fluid_bounds_cannot_see() -> None:
    bursty = pb.get_scenario("bursty@amd", 400)
    one_by_one = replace(bursty, name="bursty-as-poisson", arrivals="poisson")
    cluster = pb.cluster_named(bursty.cluster)
    limits = pb.Slo().limits(cluster, bursty.requests)
    rate = 6.5  # past the groups' ceiling, well within the one-by-one ceiling
    assert (
        decode_goodput(cluster, bursty, rate, limits)
        < pb.GOAL
        <= decode_goodput(cluster, one_by_one, rate, limits)
    )


def test_the_ceiling_meets_the_goal_and_half_again_does_not() -> None:
    scenario = pb.get_scenario("bursty@amd", 200)
    ceiling = pb.scenario_decode_ceiling(scenario, pb.Slo())
    cluster = pb.cluster_named(scenario.cluster)
    limits = pb.Slo().limits(cluster, scenario.requests)
    assert decode_goodput(cluster, scenario, ceiling, limits) >= pb.GOAL
    assert decode_goodput(cluster, scenario, ceiling * 1.5, limits) < pb.GOAL


def test_the_command_prints_and_writes_each_scenarios_ceiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ceilings.json"
    assert ceiling_main(["--scenarios", "sysprompt@amd", "--requests", "100", "--json", str(out)]) == 0
    written = out.read_text()
    assert "sysprompt@amd" in written and "sysprompt@amd" in capsys.readouterr().out


def test_a_request_waits_for_a_decoder_with_room_and_its_wait_counts_against_its_ttft() -> None:
    amd = pb.cluster_named("amd")
    one_seq = _one_seq_each(amd)
    decoders = sum(1 for b in amd.backends if Role.DECODE in b.spec.roles)
    requests = w.fixed_lengths(2 * decoders, 1024, 65, name="crowd")
    scenario = pb.Scenario("crowd", "amd", tuple(requests))
    limits = (np.full(len(requests), 0.01), np.full(len(requests), 1.0))  # TPOT never binds here
    at_once = 1e9  # the whole crowd within nanoseconds
    assert decode_goodput(amd, scenario, at_once, limits) == 1.0
    assert decode_goodput(one_seq, scenario, at_once, limits) == 0.5  # half wait a whole decode


def _one_seq_each(cluster: Cluster) -> Cluster:
    return replace(
        cluster, backends=tuple(replace(b, spec=replace(b.spec, max_num_seqs=1)) for b in cluster.backends)
    )


def test_too_few_requests_to_fill_the_decoders_have_no_ceiling() -> None:
    scenario = pb.get_scenario("sysprompt@nvidia", 30)
    assert pb.scenario_decode_ceiling(scenario, pb.Slo()) == math.inf
