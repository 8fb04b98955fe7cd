"""The per-backend circuit breaker: consecutive failures mark down, half-open trial, recovery."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.registry import Registry
from scoring.types import LegLoad

LOAD = LegLoad(prefill_tokens=0, decode_tokens=1, context_tokens=0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock) -> Registry:
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "backends": [
                {"id": "a", "url": "http://127.0.0.1:1", "model": "m", "accelerator": "cpu"},
                {"id": "b", "url": "http://127.0.0.1:2", "model": "m", "accelerator": "cpu"},
            ],
            "health": {"failure_threshold": 2, "recovery_s": 5},
        }
    )
    return Registry(config, clock=clock)


def test_consecutive_failures_mark_down_and_success_resets():
    clock = Clock()
    reg = registry(clock)
    a = reg.backends["a"]
    reg.record_failure(a)
    reg.record_success(a)
    reg.record_failure(a)
    assert a.healthy
    reg.record_failure(a)
    assert not a.healthy
    assert reg.candidates(reg.pools["m"]).healthy.tolist() == [False, True]


def test_half_open_lets_one_trial_through_after_recovery_time():
    clock = Clock()
    reg = registry(clock)
    a = reg.backends["a"]
    reg.record_failure(a)
    reg.record_failure(a)
    clock.now += 4.9
    assert not a.available(clock(), 5)
    clock.now += 0.2
    assert a.available(clock(), 5)
    trial = reg.reserve(a, LOAD)  # the trial
    assert not a.available(clock(), 5)
    reg.record_failure(a)  # trial failed: wait again
    trial.release()
    assert not a.available(clock(), 5)
    clock.now += 5
    trial = reg.reserve(a, LOAD)
    reg.record_success(a)
    trial.release()
    assert a.healthy and a.available(clock(), 5)


def test_load_combines_own_in_flight_with_reported_queue():
    reg = registry(Clock())
    a = reg.backends["a"]
    reg.reserve(a, LOAD)
    reg.reserve(a, LOAD)
    assert reg.candidates(reg.pools["m"]).load.tolist() == [2.0, 0.0]


def test_reservation_adds_its_load_and_takes_it_off_once():
    reg = registry(Clock())
    a = reg.backends["a"]
    first = reg.reserve(a, LegLoad(prefill_tokens=100, decode_tokens=8, context_tokens=120))
    second = reg.reserve(a, LegLoad(prefill_tokens=10, decode_tokens=4, context_tokens=30))
    totals = (a.in_flight, a.reserved.prefill_tokens, a.reserved.decode_seqs, a.reserved.context_tokens)
    assert totals == (2, 110, 2, 150)
    first.prefill_done()
    first.prefill_done()
    assert (a.in_flight, a.reserved.prefill_tokens) == (2, 10)
    first.release()
    first.release()
    second.release()
    totals = (a.in_flight, a.reserved.prefill_tokens, a.reserved.decode_seqs, a.reserved.context_tokens)
    assert totals == (0, 0, 0, 0)
