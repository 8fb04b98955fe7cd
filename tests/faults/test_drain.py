"""SIGTERM drains the gateway as a load balancer's backend should stop: /ready turns 503 at once, new
requests are still served during the grace period, then the listener closes, and a stream in flight
finishes before the process exits."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from bench.sim.simple_engine import SimpleEngineConfig
from tests.integration.conftest import backend, chat_body, config

# ~3 s streams (20 ms a token): one is still running when the listener closes.
SLOW = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.02)


def test_sigterm_drains_then_exits(sim, gateway) -> None:
    a = sim(simple_engine=SLOW)
    gw = gateway(config([backend(a, "a")], server={"drain_grace_s": 1.5, "drain_timeout_s": 30}))
    assert httpx.get(f"{gw.url}/ready", timeout=5).status_code == 200
    streamed: list[bytes] = []

    def stream() -> None:
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{gw.url}/v1/chat/completions", json=chat_body(stream=True, max_tokens=150)
        ) as reply:  # fmt: skip
            for chunk in reply.iter_bytes():  # appended as they come: the test polls for the first
                streamed.append(chunk)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 10
    while not streamed:  # the stream is open and its first bytes arrived
        assert time.monotonic() < deadline and reader.is_alive(), "the stream never started"
        time.sleep(0.01)
    assert gw.process is not None
    gw.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    deadline = signalled + 1.0
    while httpx.get(f"{gw.url}/ready", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/ready still 200 a second after SIGTERM"
        time.sleep(0.02)
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10).status_code == 200

    refused = False
    while time.monotonic() < signalled + 10:  # after the grace period the listener is gone
        try:
            httpx.get(f"{gw.url}/health", timeout=2)
        except httpx.TransportError:
            refused = True
            break
        time.sleep(0.05)
    assert refused and time.monotonic() - signalled >= 1.4

    reader.join(timeout=30)
    body = b"".join(streamed)
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    assert b'"error"' not in body
    # uvicorn re-raises the signal once shut down, so the exit status says SIGTERM ended it (on purpose).
    assert gw.process.wait(timeout=15) in (0, -signal.SIGTERM)
