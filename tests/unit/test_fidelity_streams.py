"""`hetgate bench fidelity`'s client: what one stream measures, and when it measures the host instead."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import web

from bench.fidelity import BURST_GAP_S, Measured, Stream, measure_all
from bench.fidelity_workload import Point


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


class _Server:
    """A streaming /v1/completions whose first `bursty` requests after the warm-up arrive in one burst
    (as a starved API server delivers them), the rest token by token."""

    def __init__(self, bursty: int) -> None:
        self.bursty = bursty
        self.served = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.served += 1
        burst = 1 < self.served <= 1 + self.bursty  # request 1 is measure_all's warm-up
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            if not burst:
                await asyncio.sleep(0.003)
            await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response


async def _measure(server: _Server, rounds: int) -> Measured:
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        point = Point("p", prompt_tokens=16, max_tokens=8, concurrency=2)
        (measured,) = await measure_all(f"http://127.0.0.1:{port}", "m", [point], rounds, seed=1)
        return measured
    finally:
        await runner.cleanup()


async def test_a_point_whose_every_stream_burst_is_measured_again() -> None:
    measured = await _measure(_Server(bursty=2), rounds=1)  # the one round's two streams burst
    assert measured.burst_streams == 2 and measured.extra_rounds == 1
    assert math.isfinite(measured.ttft_ms) and measured.itl_ms >= 2.0  # from the re-run, 3 ms gaps


async def test_a_host_that_never_stops_bursting_is_reported_not_hidden() -> None:
    measured = await _measure(_Server(bursty=10**6), rounds=2)
    assert measured.extra_rounds == 2  # at most `rounds` more
    assert measured.burst_streams == 8  # 2 streams x (2 + 2) rounds
    assert math.isnan(measured.ttft_ms)
