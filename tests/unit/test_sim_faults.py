"""Fault plans: validation, and how counted faults are consumed by arriving requests."""

from __future__ import annotations

import pytest

from bench.sim.faults import NO_FAULTS, FaultInjector, FaultPlan, RequestFaults


def test_error_status_for_the_next_n_requests_only() -> None:
    injector = FaultInjector(FaultPlan.from_dict({"error_status": 503, "error_count": 2}))
    statuses = [injector.admit("/v1/completions").error_status for _ in range(4)]
    assert statuses == [503, 503, None, None]


def test_timed_error_lasts_its_seconds_whatever_the_number_of_requests() -> None:
    now = [10.0]
    injector = FaultInjector(FaultPlan.from_dict({"error_status": 503, "error_for_s": 1.0}), lambda: now[0])
    statuses = [injector.admit("/v1/completions").error_status for _ in range(5)]
    now[0] = 10.99
    statuses.append(injector.admit("/v1/completions").error_status)
    now[0] = 11.0
    statuses.append(injector.admit("/v1/completions").error_status)
    assert statuses == [503] * 6 + [None]


def test_uncounted_error_lasts_until_cleared() -> None:
    injector = FaultInjector(FaultPlan.from_dict({"error_status": 429}))
    assert [injector.admit("/v1/chat/completions").error_status for _ in range(3)] == [429, 429, 429]
    injector.clear()
    assert injector.admit("/v1/chat/completions") is NO_FAULTS


def test_faults_apply_only_to_their_paths() -> None:
    injector = FaultInjector(FaultPlan.from_dict({"error_status": 500, "error_count": 1}))
    assert injector.admit("/v1/models") is NO_FAULTS
    assert injector.admit("/v1/completions").error_status == 500


def test_stalls_and_cuts_are_counted_separately() -> None:
    plan = {"first_byte_delay_s": 1.5, "chunk_delay_s": 0.25, "delay_count": 1, "close_after_chunks": 3}
    injector = FaultInjector(FaultPlan.from_dict(plan))
    first, second = injector.admit("/v1/completions"), injector.admit("/v1/completions")
    assert first == RequestFaults(first_byte_delay_s=1.5, chunk_delay_s=0.25, close_after_chunks=3)
    assert second == RequestFaults(close_after_chunks=3)


def test_an_error_takes_precedence_and_does_not_consume_other_counts() -> None:
    plan = {"error_status": 503, "error_count": 1, "close_after_chunks": 0, "close_count": 1}
    injector = FaultInjector(FaultPlan.from_dict(plan))
    assert injector.admit("/v1/completions") == RequestFaults(error_status=503)
    assert injector.admit("/v1/completions") == RequestFaults(close_after_chunks=0)
    assert injector.admit("/v1/completions") is NO_FAULTS


def test_health_status() -> None:
    injector = FaultInjector()
    assert injector.health_status == 200
    injector.set_plan(FaultPlan.from_dict({"health_status": 503}))
    assert injector.health_status == 503


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"error_status": 42}, "HTTP status"),
        ({"error_status": "503"}, "HTTP status"),
        ({"first_byte_delay_s": -1}, ">= 0"),
        ({"error_count": -2}, "integer"),
        ({"close_after_chunks": 1.5}, "integer"),
        ({"bogus": 1}, "unknown fault keys"),
        ({"error_for_s": -1}, ">= 0"),
        ({"error_for_s": 1, "error_count": 2}, "exclude"),
        ([], "JSON object"),
    ],
)
def test_bad_plans_are_rejected(plan: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultPlan.from_dict(plan)


def test_stream_errors_are_counted() -> None:
    injector = FaultInjector(FaultPlan.from_dict({"stream_error_after_chunks": 1, "stream_error_count": 1}))
    assert injector.admit("/v1/completions") == RequestFaults(stream_error_after_chunks=1)
    assert injector.admit("/v1/completions") is NO_FAULTS


def test_servers_sharing_a_plan_count_separately() -> None:
    plan = FaultPlan.from_dict({"error_status": 503, "error_count": 1})
    first, second = FaultInjector(plan), FaultInjector(plan)
    assert first.admit("/v1/completions").error_status == 503
    assert second.admit("/v1/completions").error_status == 503
    assert plan.error_count == 1
