"""`hetgate bench soak` configures its gateway with the gateway's own config schema (it broke silently once,
when `limits.max_attempts` and `health.recovery_s` were replaced by `retry` and `health.outlier`)."""

from __future__ import annotations

from bench.soak import cluster, gateway_config
from gateway.config import parse_config


def test_the_soak_gateway_config_is_valid() -> None:
    config = parse_config(gateway_config(cluster()))
    assert config.retry.num_retries == 2  # three attempts: at most two backends are faulty at once
    assert {b.id for b in config.backends} == {b.id for b in cluster()}
