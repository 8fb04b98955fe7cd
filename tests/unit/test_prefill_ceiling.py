"""`bench.prefill_ceiling`: a cluster's prefill alone, as vLLM schedules it, with decoding free and the
prefix cache ideal."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench import policies as pb
from bench import workloads as w
from bench.prefill_ceiling import main as ceiling_main
from bench.prefill_ceiling import prefill_goodput
from scoring.cost import prefill_time

_PROMPT = 4096


def _prefill_s(cluster_name: str, new: int = _PROMPT) -> np.ndarray:
    """Per backend, one prompt of `new` tokens alone (within one step's token budget)."""
    cluster = pb.cluster_named(cluster_name)
    return prefill_time(cluster.model, cluster.hardware(), new, 0, cluster.efficiency)


def _two_at(second_s: float, shared: bool) -> pb.Scenario:
    """Two prompts of `_PROMPT` tokens on the AMD cluster, the same prompt twice or two different ones, at
    0 s and `second_s` (the trace's own times: `at_rate` at the pair's own rate keeps them), or both at
    one instant where `second_s` is 0 (a group: `bursty` arrivals)."""
    first, other = w.fixed_lengths(2, _PROMPT, 65, name="pair")
    second = replace(first if shared else other, request_id="second", arrival_s=second_s)
    return pb.Scenario("pair", "amd", (first, second), arrivals="trace" if second_s else "bursty")


def test_a_prompt_alone_takes_one_step_on_the_fastest_backend() -> None:
    amd = pb.cluster_named("amd")
    scenario = pb.Scenario("alone", "amd", tuple(w.fixed_lengths(1, _PROMPT, 65, name="alone")))
    fastest = float(np.min(_prefill_s("amd")))
    assert prefill_goodput(amd, scenario, 1.0, np.array([fastest * 1.001])) == 1.0
    assert prefill_goodput(amd, scenario, 1.0, np.array([fastest * 0.999])) == 0.0


def test_a_prompt_finds_what_an_earlier_prefill_cached_once_it_has_ended() -> None:
    amd = pb.cluster_named("amd")
    full = float(np.min(_prefill_s("amd")))
    limits = np.array([full * 1.001, full * 0.5])  # the second meets its limit only from the cache
    later = 2.0 * full
    assert prefill_goodput(amd, _two_at(later, shared=True), 2.0 / later, limits) == 1.0
    assert prefill_goodput(amd, _two_at(later, shared=False), 2.0 / later, limits) == 0.5
    # At the same instant the first prefill has not ended: nothing is cached yet.
    assert prefill_goodput(amd, _two_at(0.0, shared=True), 1e9, limits) == 0.5


def test_prompts_that_share_a_step_all_end_with_it() -> None:
    amd = pb.cluster_named("amd")
    alone, together = float(np.min(_prefill_s("amd"))), float(np.min(_prefill_s("amd", 2 * _PROMPT)))
    assert together < float(np.sort(_prefill_s("amd"))[1])  # the second joins the first's step
    limits = np.array([alone * 1.001, together * 1.001])
    assert prefill_goodput(amd, _two_at(0.0, shared=False), 1e9, limits) == 0.5  # the first waits for both
    assert prefill_goodput(amd, _two_at(0.0, shared=False), 1e9, np.full(2, together * 1.001)) == 1.0


def test_a_request_no_backend_can_serve_in_time_holds_up_no_other() -> None:
    amd = pb.cluster_named("amd")
    fastest = float(np.min(_prefill_s("amd")))
    assert float(np.sort(_prefill_s("amd"))[1]) > 1.5 * fastest  # the others are too slow for the limit
    limits = np.array([0.0, fastest * 1.001])  # the first can never be met
    assert prefill_goodput(amd, _two_at(0.0, shared=False), 1e9, limits) == 0.5


def test_more_traffic_meets_the_limit_less_often() -> None:
    scenario = pb.get_scenario("seed", 200)
    cluster = pb.cluster_named(scenario.cluster)
    ttft_limits, _ = pb.Slo().limits(cluster, scenario.requests)
    shares = [prefill_goodput(cluster, scenario, rate, ttft_limits) for rate in (0.1, 1.5, 8.0)]
    assert shares[0] == 1.0
    assert shares[0] >= shares[1] >= shares[2]
    assert shares[2] < pb.GOAL


def test_groups_arriving_together_lower_the_ceiling() -> None:
    bursty = pb.get_scenario("bursty@amd", 400)
    one_by_one = replace(bursty, name="bursty-as-poisson", arrivals="poisson")
    assert pb.scenario_prefill_ceiling(bursty, pb.Slo()) < pb.scenario_prefill_ceiling(one_by_one, pb.Slo())


def test_the_ceiling_meets_the_goal_and_half_again_does_not() -> None:
    scenario = pb.get_scenario("azure-code@amd", 300)
    ceiling = pb.scenario_prefill_ceiling(scenario, pb.Slo())
    cluster = pb.cluster_named(scenario.cluster)
    ttft_limits, _ = pb.Slo().limits(cluster, scenario.requests)
    assert prefill_goodput(cluster, scenario, ceiling, ttft_limits) >= pb.GOAL
    assert prefill_goodput(cluster, scenario, ceiling * 1.5, ttft_limits) < pb.GOAL


def test_too_few_requests_to_fill_the_prefill_have_no_ceiling() -> None:
    scenario = pb.get_scenario("sysprompt@nvidia", 8)
    assert pb.scenario_prefill_ceiling(scenario, pb.Slo()) == math.inf


def test_the_command_prints_and_writes_each_scenarios_ceiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ceilings.json"
    assert ceiling_main(["--scenarios", "seed", "--requests", "100", "--json", str(out)]) == 0
    assert "seed" in out.read_text() and "prefill ceiling" in capsys.readouterr().out
