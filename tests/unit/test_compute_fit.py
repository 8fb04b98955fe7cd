"""The least-squares calibration of one backend (scoring/calibration.py): compute and queue apart."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.calibration import ComputeFit


def feed(
    fit: ComputeFit, compute: float, queue: float, samples: int, seed: int = 0, noise: float = 0.0
) -> None:
    """Outcomes of a backend whose prefill takes `compute` and whose queue takes `queue` times the
    roofline's, for prompts with varied shares of queue ahead (0 to 10x their own prefill)."""
    rng = np.random.default_rng(seed)
    for _ in range(samples):
        own = rng.uniform(0.002, 0.05)
        ahead = own * rng.choice([0.0, 0.5, 2.0, 10.0])
        measured = (compute * own + queue * ahead) * (1.0 + noise * rng.standard_normal())
        assert fit.add(measured, own, ahead)


def test_both_coefficients_are_recovered():
    """The compute exactly; the queue within 5 %: an outcome counts by its compute's share, so those
    that say most about the queue (10x their prefill ahead) weigh least, and the weak prior that the
    queue is the compute's hardware (queue = compute) holds it a little toward 2.7 (1.56 here)."""
    fit = ComputeFit(1.0)
    feed(fit, 2.7, 1.5, 300)
    assert (fit.compute, fit.queue) == (pytest.approx(2.7, rel=0.01), pytest.approx(1.5, rel=0.05))


def test_a_queue_model_that_errs_is_not_taken_for_slow_compute():
    """Prompts with 10x their prefill queued ahead, the queue 30 % shorter than predicted (as on B200 +
    2x H100 under shared system prompts): the compute stays at its truth. A single factor on the compute
    part, the queue subtracted as predicted, would put it at 1 - 0.3 * 10 < 0 (its clip)."""
    fit = ComputeFit(1.0)
    feed(fit, 1.0, 0.7, 400, noise=0.1)
    assert fit.compute == pytest.approx(1.0, rel=0.1)
    assert fit.queue == pytest.approx(0.7, rel=0.05)


def test_a_backend_never_queued_prices_its_queue_as_its_compute():
    """The roofline's assumption (the queue is the same hardware's compute) holds until outcomes with a
    queue say otherwise."""
    fit = ComputeFit(2.0)
    for own in np.linspace(0.01, 0.1, 50):
        fit.add(3.0 * own, own, 0.0)
    assert fit.compute == pytest.approx(3.0, rel=1e-3)
    assert fit.queue == pytest.approx(3.0, rel=0.01)


def test_a_queue_in_a_fixed_ratio_is_taken_as_slow_as_the_compute():
    """Every prompt behind 10x its own prefill, all 3x slower than the roofline: the outcomes cannot tell
    queue from compute, and the fit takes both as 3 (not 1.2 and 3.2, the nearest point to its anchor)."""
    fit = ComputeFit(1.0)
    for _ in range(200):
        fit.add(3.0 * 11.0, 1.0, 10.0)
    assert (fit.compute, fit.queue) == (pytest.approx(3.0, rel=0.01), pytest.approx(3.0, rel=0.01))


def test_old_outcomes_are_forgotten():
    fit = ComputeFit(1.0)
    feed(fit, 4.0, 4.0, 300)
    feed(fit, 1.0, 1.0, 1500, seed=1)  # the backend was upgraded
    assert fit.compute == pytest.approx(1.0, rel=0.01)


def test_moving_keeps_the_evidence():
    """A blended value is where the fit stands afterwards, and the outcomes before it still weigh as
    much against the next ones."""
    moved, fresh = ComputeFit(1.0), ComputeFit(1.0)
    feed(moved, 2.0, 2.0, 300)
    moved.move_to(compute=3.0)
    assert (moved.compute, moved.queue) == (pytest.approx(3.0), pytest.approx(2.0, rel=1e-3))
    feed(moved, 1.0, 2.0, 20, seed=2)
    feed(fresh, 1.0, 2.0, 20, seed=2)
    assert moved.compute > 2.0 > 1.1 > fresh.compute


@pytest.mark.parametrize(("measured", "compute"), [(float("nan"), 0.1), (-1.0, 0.1), (0.1, 0.0)])
def test_outcomes_that_say_nothing_are_refused(measured, compute):
    fit = ComputeFit(1.0)
    assert not fit.add(measured, compute, 0.0)
    assert (fit.compute, fit.queue) == (1.0, 1.0)


def test_coefficients_stay_within_the_clip():
    fit = ComputeFit(1.0)
    feed(fit, 50.0, 50.0, 100)
    assert (fit.compute, fit.queue) == (10.0, 10.0)


def feed_with_overhead(fit: ComputeFit, compute: float, overhead_s: float, samples: int) -> None:
    """Prompts of 100 to 2,500 tokens' worth of roofline prefill (2-50 ms), some queued, each paying
    `overhead_s` besides (an HTTP round trip, tokenization)."""
    rng = np.random.default_rng(3)
    for _ in range(samples):
        own = rng.uniform(0.002, 0.05)
        ahead = own * rng.choice([0.0, 0.5, 2.0])
        assert fit.add(compute * (own + ahead) + overhead_s, own, ahead)


def test_a_fixed_overhead_per_request_is_told_from_slow_compute():
    """5 ms per request on prompts of 2-50 ms: the fit finds the 5 ms and the compute's truth. Without
    the overhead term (d5c5a00) the same outcomes fitted compute 1.33x, which predicted a 2 ms prompt
    4 ms short and a 50 ms one 12 ms long (the thirty-seventh pass of docs/policies.md measured that shape
    over HTTP)."""
    fit = ComputeFit(1.0)
    feed_with_overhead(fit, 1.0, 0.005, 300)
    assert fit.overhead == pytest.approx(0.005, rel=0.02)
    assert (fit.compute, fit.queue) == (pytest.approx(1.0, rel=0.01), pytest.approx(1.0, rel=0.01))


def test_no_overhead_is_found_where_there_is_none_and_never_a_negative_one():
    fit = ComputeFit(1.0)
    feed(fit, 2.7, 1.5, 300)
    # 0.04 ms: what the tie prior's pull on the queue (1.56 for 1.5) leaves over, on prompts of 2-50 ms
    assert fit.overhead == pytest.approx(0.0, abs=1e-4)
    faster = ComputeFit(1.0)  # a backend that answers short prompts early would fit a negative one
    feed_with_overhead(faster, 1.0, -0.001, 300)
    assert faster.overhead == 0.0
    assert faster.compute == pytest.approx(0.95, rel=0.05)


def test_prompts_of_one_size_cannot_tell_overhead_from_compute_and_leave_it_to_the_compute():
    fit = ComputeFit(1.0)
    for _ in range(200):
        fit.add(1.2 * 0.02 + 0.005, 0.02, 0.0)
    assert fit.overhead < 0.001
    assert fit.compute * 0.02 + fit.overhead == pytest.approx(0.029, rel=0.01)
