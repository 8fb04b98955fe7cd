"""`load_columns` and `WorkModel`: what a new request meets on a backend, as vLLM's steps run it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scoring.catalog import load_catalog
from scoring.cost import Hardware, causal_pairs, step_time
from scoring.load import DEFAULT_CHUNK_TOKENS, WorkModel, leg_loads, load_columns, planned_prefill_s
from scoring.types import Mode, Prediction

CATALOG = load_catalog()
R1 = CATALOG.model("deepseek-r1")
HW = Hardware.of([CATALOG.accelerator("mi300x")], [8], R1.compute_dtype)
ONE = np.ones(1)


def steps(new: float, queued: float = 0.0, queued_len: float = 1.0, seqs: float = 0.0, context: float = 0.0):
    work = WorkModel(R1, HW)
    return work.steps(new * ONE, 0 * ONE, new, seqs * ONE, context * ONE, queued * ONE, queued_len * ONE)


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


def test_decodes_ride_the_prefill_step_and_each_further_chunk_adds_a_step():
    seqs, context = 16, 16 * 2000
    base = float(step_time(R1, HW, 0, 0, seqs, context)[0])
    one_chunk = steps(1000, seqs=seqs, context=context)
    assert one_chunk.prefill[0] == pytest.approx(alone(1000, seqs, context))
    assert one_chunk.prefill[0] < alone(1000) + base
    tokens = 3 * DEFAULT_CHUNK_TOKENS - 100  # three chunks: one pass, then two more decode steps
    three = steps(tokens, seqs=seqs, context=context)
    assert three.prefill[0] == pytest.approx(alone(tokens, seqs, context) + 2 * base)


def test_steps_equal_the_five_step_times_bit_for_bit():
    """The fused `steps` (one concatenate per input) against the five `step_time` rows it stands for,
    written out one by one: equal to the last bit, so routing decisions do not move."""
    rng = np.random.default_rng(7)
    accelerators = [CATALOG.accelerator(a) for a in ("mi300x", "mi308x", "mi300x")]
    hw = Hardware.of(accelerators, [8, 8, 1], R1.compute_dtype)
    work = WorkModel(R1, hw)
    for _ in range(50):
        n = 3
        new = rng.integers(1, 40_000, n)
        cached = rng.integers(0, 40_000, n) * rng.integers(0, 2, n)
        seqs = rng.integers(0, 200, n) * 1.0
        context = seqs * rng.integers(0, 5000, n) + rng.random(n) * 1000
        queued = rng.integers(0, 4, n) * rng.integers(1, 20_000, n) * 1.0
        queued_len = np.maximum(rng.integers(0, 20_000, n) * 1.0, 1.0)
        own = float(rng.integers(1, 40_000)) + 0.5
        s = work.steps(new, cached, own, seqs, context, queued, queued_len)

        def one(tokens, pairs, batch, ctx):
            return step_time(R1, hw, tokens, pairs, batch, ctx)

        own_pairs = causal_pairs(new, cached)
        queued_pairs = queued / queued_len * causal_pairs(queued_len, 0)
        base = one(0.0, 0.0, seqs, context)
        step = one(0.0, 0.0, seqs + 1.0, context + own)
        chunks = np.ceil(queued / DEFAULT_CHUNK_TOKENS) * base
        chunks_with = np.ceil((queued + new) / DEFAULT_CHUNK_TOKENS) * base
        wait = one(queued, queued_pairs, seqs, context) + chunks - base
        first = one(queued + new, queued_pairs + own_pairs, seqs, context) + chunks_with - base
        mixed = one(new * 1.0, own_pairs, seqs, context)
        assert np.array_equal(s.base, base)
        assert np.array_equal(s.step, step)
        assert np.array_equal(s.wait, wait)
        assert np.array_equal(s.prefill, first - wait)
        assert np.array_equal(s.stall, np.maximum(mixed - base, 0.0))


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
    first, second = leg_loads(Mode.PD, 1000, 8, 200, kv_due_s=3.0, prefill_s=0.4)
    assert (first.prefill_tokens, first.prefill_s) == (800, 0.4)
    assert second is not None and math.isnan(second.prefill_s)  # the decode leg computes no prompt
