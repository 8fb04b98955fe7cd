"""`hetgate bench fidelity`'s client: what one stream measures, and when it measures the host instead."""

from __future__ import annotations

import pytest

from bench.fidelity import BURST_GAP_S, Stream


def stream(sent: float, gaps: list[float], first: float) -> Stream:
    times = [first]
    for gap in gaps:
        times.append(times[-1] + gap)
    return Stream(sent=sent, token_times=times)


def test_a_stream_as_generated_gives_its_ttft_and_mean_gap() -> None:
    s = stream(10.0, [0.005, 0.007, 0.006], first=10.1)
    assert s.ttft == pytest.approx(0.1)
    assert s.itl == pytest.approx(0.006)
    assert not s.burst


def test_a_stream_delivered_in_one_burst_is_recognised() -> None:
    # Real vLLM on a busy host: 16 tokens within 0.5 ms, after the engine had made them.
    assert stream(0.0, [0.00003] * 15, first=0.26).burst
    # One long gap among burst ones (a stall, then the rest at once) is still a burst by the median.
    assert stream(0.0, [0.4] + [0.00002] * 14, first=0.1).burst
    # Gaps just above the limit are a real stream, however uniform.
    assert not stream(0.0, [BURST_GAP_S * 1.01] * 15, first=0.1).burst


def test_too_short_to_judge_is_not_a_burst() -> None:
    assert not stream(0.0, [0.00001], first=0.1).burst  # two tokens: one gap
    assert not stream(0.0, [], first=0.1).burst
    assert stream(0.0, [], first=0.1).itl is None
