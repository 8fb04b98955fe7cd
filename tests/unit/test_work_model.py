"""`load_columns` and `WorkModel`: what a new request meets on a backend, as vLLM's steps run it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scoring.catalog import ModelSpec, load_catalog
from scoring.cost import Hardware, causal_pairs, step_time
from scoring.load import DEFAULT_CHUNK_TOKENS, WorkModel, leg_load, load_columns, planned_prefill_s
from scoring.types import Prediction

CATALOG = load_catalog()
R1 = CATALOG.model("deepseek-r1")
HW = Hardware.of([CATALOG.accelerator("mi300x")], [8], R1.compute_dtype)
ONE = np.ones(1)


def steps(
    new: float,
    queued: float = 0.0,
    queued_len: float = 1.0,
    seqs: float = 0.0,
    context: float = 0.0,
    in_step: float = 0.0,
    elapsed: float = 0.0,
    behind: float = 0.0,
    hw: Hardware = HW,
    model: ModelSpec = R1,
):
    """`WorkModel.steps` on one backend: `queued` tokens ahead, `in_step` of them in the step in
    progress (begun `elapsed` seconds ago, after `behind` decode steps), the rest waiting."""
    work = WorkModel(model, hw)
    columns = (queued * ONE, queued_len * ONE, in_step * ONE, elapsed * ONE, behind * ONE)
    return work.steps(new * ONE, 0 * ONE, new, seqs * ONE, context * ONE, *columns)


def alone(tokens: float, seqs: float = 0.0, context: float = 0.0) -> float:
    """One step of `tokens` prompt tokens (one prompt) beside `seqs` decodes."""
    return float(step_time(R1, HW, tokens, causal_pairs(tokens, 0), seqs, context)[0])


def test_an_idle_backend_prefills_at_once():
    s = steps(1000)
    assert s.wait[0] == 0.0
    assert s.prefill[0] == pytest.approx(alone(1000))


def test_a_prompt_joining_a_short_queue_reads_the_weights_once():
    """vLLM runs the queued prompt and the new one in one step: the new one's TTFT is that step, not
    the queue's step plus a step of its own (the weights read twice)."""
    s = steps(200, queued=300, queued_len=300)
    assert s.wait[0] == pytest.approx(alone(300))
    one_pass = float(step_time(R1, HW, 500, causal_pairs(300, 0) + causal_pairs(200, 0), 0, 0)[0])
    assert s.wait[0] + s.prefill[0] == pytest.approx(one_pass)
    assert s.prefill[0] < 0.5 * alone(200)  # a small prompt's step is mostly the weights read


def test_a_prompt_planned_during_a_step_waits_for_what_is_left_of_it_then_takes_its_own():
    """vLLM schedules a step from the prompts waiting when it begins: one planned while it runs waits
    for the rest of it, then reads the weights again in a step of its own (with the prompts that
    waited beside it)."""
    s = steps(200, queued=300, queued_len=300, in_step=300, elapsed=0.004)
    assert s.wait[0] == pytest.approx(alone(300) - 0.004)
    assert s.prefill[0] == pytest.approx(alone(200))
    assert s.ahead[0] == pytest.approx(alone(300) - 0.004)  # its step begins when that one ends
    late = steps(200, queued=300, queued_len=300, in_step=300, elapsed=1.0)  # overdue: nothing is left
    assert late.wait[0] == 0.0
    # Planned to an idle queue beside decodes, it begins when their step ends: half a step later on
    # average. Until then it is open: a new prompt waits for the decode step and joins it.
    seqs, context = 16, 16 * 2000
    base = float(step_time(R1, HW, 0, 0, seqs, context)[0])
    assert base > 0.01
    opening = steps(200, 300, 300, seqs, context, in_step=300, elapsed=0.004, behind=0.5)
    assert opening.mid_step[0] == pytest.approx(0.5 * base - 0.004)
    assert opening.wait[0] == pytest.approx(alone(300, seqs, context))
    assert opening.prefill[0] < 0.5 * alone(200, seqs, context)
    begun = steps(200, 300, 300, seqs, context, in_step=300, elapsed=0.008, behind=0.5)
    assert begun.mid_step[0] == 0.0
    assert begun.wait[0] == pytest.approx(alone(300, seqs, context) + 0.5 * base - 0.008)
    assert begun.prefill[0] == pytest.approx(alone(200, seqs, context))
    behind = steps(200, queued=700, queued_len=350, in_step=350, elapsed=0.0)  # one prompt waits
    joined = float(step_time(R1, HW, 550, causal_pairs(350, 0) + causal_pairs(200, 0), 0, 0)[0])
    assert behind.wait[0] == pytest.approx(2 * alone(350))
    assert behind.wait[0] + behind.prefill[0] == pytest.approx(alone(350) + joined)


def test_every_step_reads_the_weights_again():
    """Two short prompts, one in the step in progress and one waiting, on a weight-bound backend (a
    Rubin CPX's short steps are its GDDR7 weights read): two reads, not one pass over both."""
    llama = CATALOG.model("llama-3.1-70b")
    cpx = Hardware.of([CATALOG.accelerator("rubin-cpx")], [4], llama.compute_dtype)
    s = steps(1.0, queued=2000, queued_len=1000, in_step=1000, hw=cpx, model=llama)
    one = step_time(llama, cpx, 1000, causal_pairs(1000.0, 0), 0, 0)[0]
    assert s.wait[0] == pytest.approx(2 * one)
    one_pass = step_time(llama, cpx, 2000, 2 * causal_pairs(1000.0, 0), 0, 0)[0]
    assert s.wait[0] > 1.5 * one_pass


def test_decodes_ride_every_step():
    seqs, context = 16, 16 * 2000
    base = float(step_time(R1, HW, 0, 0, seqs, context)[0])
    one_chunk = steps(1000, seqs=seqs, context=context)
    assert one_chunk.prefill[0] == pytest.approx(alone(1000, seqs, context))
    assert one_chunk.prefill[0] < alone(1000) + base
    tokens = 3 * DEFAULT_CHUNK_TOKENS - 300  # three steps, the running batch in each
    three = steps(tokens, seqs=seqs, context=context)
    chunk = step_time(R1, HW, tokens / 3, causal_pairs(tokens, 0) / 3, seqs, context)[0]
    assert three.prefill[0] == pytest.approx(3 * chunk)
    assert three.prefill[0] > alone(tokens)  # the decodes' own work in each; their weights read is hidden


def test_steps_equal_the_step_times_they_stand_for_bit_for_bit():
    """The fused `steps` (one concatenate per input) against the `step_time` rows it stands for,
    written out one by one: equal to the last bit, so routing decisions do not move."""
    rng = np.random.default_rng(7)
    accelerators = [CATALOG.accelerator(a) for a in ("mi300x", "mi308x", "mi300x")]
    hw = Hardware.of(accelerators, [8, 8, 1], R1.compute_dtype)
    work = WorkModel(R1, hw)
    chunk = DEFAULT_CHUNK_TOKENS
    for _ in range(50):
        n = 3
        new = rng.integers(1, 40_000, n)
        cached = rng.integers(0, 40_000, n) * rng.integers(0, 2, n)
        seqs = rng.integers(0, 200, n) * 1.0
        context = seqs * rng.integers(0, 5000, n) + rng.random(n) * 1000
        queued = rng.integers(0, 4, n) * rng.integers(1, 20_000, n) * 1.0
        queued_len = np.maximum(rng.integers(0, 20_000, n) * 1.0, 1.0)
        in_step = np.minimum(queued, rng.integers(0, 2, n) * rng.integers(1, chunk, n))
        elapsed = rng.random(n) * 0.05
        behind = np.where(in_step > 0, rng.integers(0, 2, n) * 0.5, 0.0)
        own = float(rng.integers(1, 40_000)) + 0.5
        s = work.steps(new, cached, own, seqs, context, queued, queued_len, in_step, elapsed, behind)

        def one(tokens, pairs, batch, ctx):
            return step_time(R1, hw, tokens, pairs, batch, ctx)

        own_pairs = causal_pairs(new, cached)
        per_token = causal_pairs(queued_len, 0) / queued_len
        base = one(0.0, 0.0, seqs, context)
        closed = (in_step > 0) & (elapsed >= behind * base)
        in_step = np.where(closed, in_step, 0.0)
        mid_step = np.where(
            closed, 0.0, np.where(behind > 0, np.maximum(behind * base - elapsed, 0.0), 0.5 * base)
        )
        waiting = np.maximum(queued - in_step, 0.0)
        alone_steps = np.ceil(waiting / chunk)
        with_steps = np.maximum(np.ceil((waiting + new) / chunk), 1.0)
        step = one(0.0, 0.0, seqs + 1.0, context + own)
        current = one(in_step, in_step * per_token, seqs, context)
        left = np.where(closed, np.maximum(current + behind * base - elapsed, 0.0), 0.0)
        per_alone, per_with = 1.0 / np.maximum(alone_steps, 1.0), 1.0 / with_steps
        alone_step = one(waiting * per_alone, waiting * per_token * per_alone, seqs, context)
        joined = one((waiting + new) * per_with, (waiting * per_token + own_pairs) * per_with, seqs, context)
        mixed = one(new * 1.0, own_pairs, seqs, context)
        wait = left + alone_steps * alone_step
        assert np.array_equal(s.base, base)
        assert np.array_equal(s.step, step)
        assert np.array_equal(s.wait, wait)
        assert np.array_equal(s.prefill, left + with_steps * joined - wait)
        assert np.array_equal(s.stall, np.maximum(mixed - base, 0.0))
        assert np.array_equal(s.mid_step, mid_step)
        assert np.array_equal(s.waiting, waiting)
        assert np.array_equal(s.ahead, left + np.maximum(alone_steps - 1.0, 0.0) * alone_step)


def test_a_fresh_report_gives_the_larger_of_the_two_views():
    """With vLLM's counts reported now (the simulator's case), each column is the larger of the
    gateway's view and vLLM's, the rule before reports were reconciled with what the gateway had then."""
    rng = np.random.default_rng(11)
    n = 200
    in_flight, running, waiting = (rng.integers(0, 6, n).astype(float) for _ in range(3))
    prefill_seqs, decode_seqs = rng.integers(0, 4, n).astype(float), rng.integers(0, 4, n).astype(float)
    prefill_tokens = prefill_seqs * rng.integers(1, 3000, n)
    context_tokens = decode_seqs * rng.integers(1, 9000, n)
    got = load_columns(in_flight, running, waiting, prefill_tokens, prefill_seqs, decode_seqs, context_tokens)
    seqs = np.maximum(decode_seqs, running)
    mean_context = np.divide(context_tokens, decode_seqs, out=np.zeros(n), where=decode_seqs > 0)
    prompt_len = np.divide(prefill_tokens, prefill_seqs, out=mean_context.copy(), where=prefill_seqs > 0)
    assert np.array_equal(got["load"], np.maximum(in_flight, running + waiting))
    assert np.array_equal(got["decode_seqs"], seqs)
    assert np.allclose(got["context_tokens"], np.maximum(context_tokens, seqs * mean_context))
    assert np.allclose(got["prefill_tokens"], np.maximum(prefill_tokens, waiting * prompt_len))
    assert np.array_equal(got["context_when_reported"], got["context_tokens"])
    work = WorkModel(R1, Hardware.of([CATALOG.accelerator("mi300x")] * n, [8] * n, R1.compute_dtype))
    usage = rng.random(n) * 0.1
    context = work.context(got["context_tokens"], usage, got["context_when_reported"])
    assert np.allclose(context, np.maximum(got["context_tokens"], usage * work.kv_capacity))


def test_kv_usage_counts_only_beyond_the_context_held_when_it_was_reported():
    work = WorkModel(R1, HW)
    held = 0.01 * work.kv_capacity  # what our own sequences held when vLLM reported 1 % in use
    assert work.context(0 * ONE, 0.01 * ONE, held)[0] == 0.0  # they have ended since: nothing is left
    assert work.context(0 * ONE, 0.01 * ONE, held / 2)[0] == pytest.approx(held[0] / 2)  # others' half


def test_a_leg_carries_the_prefill_seconds_its_plan_priced_on_its_backend():
    """`planned_prefill_s`: the plan's own prefill seconds for the leg that prefills where it was priced;
    NaN for a decode leg, a leg on another backend (a retry, a fallback), or a leg of the other shape."""
    split = Prediction(compute_s=0.4, rows=(2, 5))
    whole = Prediction(compute_s=0.3, rows=(1,))
    assert planned_prefill_s(split, "prefill", 2) == 0.4
    assert planned_prefill_s(whole, "aggregated", 1) == 0.3
    for predicted, leg, row in [
        (split, "decode", 5),
        (split, "prefill", 5),
        (split, "aggregated", 2),  # a split's fallback to one backend
        (whole, "aggregated", 0),
        (whole, "prefill", 1),
        (None, "aggregated", 1),
    ]:
        assert math.isnan(planned_prefill_s(predicted, leg, row)), (predicted, leg, row)
    first = leg_load("prefill", 1000, 8, 200, prefill_s=0.4)
    second = leg_load("decode", 1000, 8, 0, kv_due_s=3.0, prefill_s=0.4)
    assert (first.prefill_tokens, first.prefill_s) == (800, 0.4)
    assert math.isnan(second.prefill_s)  # the decode leg computes no prompt
