"""`WorkModel.steps`: what a new request meets on a backend, in seconds, as vLLM's steps run it."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.catalog import load_catalog
from scoring.cost import Hardware, causal_pairs, step_time
from scoring.load import DEFAULT_CHUNK_TOKENS, WorkModel

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
