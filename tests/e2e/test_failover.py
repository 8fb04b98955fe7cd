"""A backend dies mid-test: hetgate routes around it and no client request fails.

The health probe is slowed so that it cannot notice the death during the test: every request round
robin sends to the dead backend must be retried on the survivor, as hetgate's retry counter shows.
(The probe's own marking-down is tested against simulated backends, tests/faults/test_health.py.)

This module kills a vLLM server, so it runs after the other aggregated-pair modules (file order); the
fleet restarts the killed server if a later test asks for it.
"""

from __future__ import annotations

import openai
import pytest
from e2e_helpers import ROUTE_HEADER, backend_entry, gateway_config, metric_total, route_fields
from vllm_server import VllmServer

pytestmark = pytest.mark.e2e


def test_requests_succeed_after_a_backend_is_killed(
    aggregated_servers: list[VllmServer], start_gateway
) -> None:
    victim, survivor = aggregated_servers
    backends = [backend_entry(server) for server in aggregated_servers]
    config = gateway_config(backends, policy="round_robin")
    config["health"]["interval_s"] = 600.0  # one probe at start-up, none after the kill
    gateway = start_gateway(config, "failover")
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        before = set()
        for _ in range(2):
            raw = client.completions.with_raw_response.create(model="tiny", prompt="x = 1", max_tokens=2)
            before.add(route_fields(raw.headers[ROUTE_HEADER])["backend"])
        assert before == {victim.spec.name, survivor.spec.name}

        retries_before = metric_total(gateway.url, "hetgate:retries_total")
        victim.kill()

        # Still healthy to the gateway, the dead backend gets its round-robin share: each try there is
        # refused and retried on the survivor before the client sees a byte.
        for index in range(6):
            stream = index % 2 == 1
            raw = client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=[{"role": "user", "content": f"request {index}"}],
                max_tokens=3,
                stream=stream,
            )
            assert route_fields(raw.headers[ROUTE_HEADER])["backend"] == survivor.spec.name
            if stream:
                chunks = list(raw.parse())
                assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in chunks)
            else:
                assert raw.parse().usage.completion_tokens == 3

    assert metric_total(gateway.url, "hetgate:retries_total") - retries_before >= 1
    assert (
        metric_total(gateway.url, "hetgate:upstream_errors_total", backend=victim.spec.name, kind="connect")
        >= 1
    )
