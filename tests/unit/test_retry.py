"""Retry decisions (retry_on, num_retries, budget) and blame held until a request's outcome is known."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import ConfigError, Retry, parse_config
from gateway.metrics import GatewayMetrics
from gateway.outlier import Verdict
from gateway.registry import Registry
from gateway.retry import RetryBudget, RetryPolicy, blame, failing_statuses
from gateway.upstream import LegFailed


def status(code: int) -> LegFailed:
    return LegFailed("status", retryable=True, status=code, body=b"{}")


CONNECT = LegFailed("connect", retryable=True)
RESET = LegFailed("reset", retryable=True)
TIMEOUT = LegFailed("timeout", retryable=True, status=504)


def policy(n: int = 3, **retry: Any) -> tuple[RetryPolicy, Registry, GatewayMetrics]:
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "backends": [
                {"id": f"b{i}", "url": f"http://127.0.0.1:{i + 1}", "model": "m", "accelerator": "cpu"}
                for i in range(n)
            ],
            "health": {"outlier": {"consecutive_5xx": 1, "consecutive_gateway_failure": 1}},
            "retry": retry,
        }
    )
    registry = Registry(config)
    metrics = GatewayMetrics()
    return RetryPolicy(config.retry, registry, metrics), registry, metrics


@pytest.mark.parametrize(
    ("retry_on", "failure", "retried"),
    [
        (["connect-failure"], CONNECT, True),
        (["connect-failure"], RESET, False),
        (["reset"], RESET, True),
        (["reset"], TIMEOUT, True),
        (["reset"], status(500), False),
        (["5xx"], CONNECT, True),
        (["5xx"], TIMEOUT, True),
        (["5xx"], status(500), True),
        (["5xx"], status(503), True),
        (["5xx"], status(429), False),
        (["gateway-error"], status(500), False),
        (["gateway-error"], status(502), True),
        (["gateway-error"], status(504), True),
        (["gateway-error"], CONNECT, True),
        (["retriable-4xx"], status(409), True),
        (["retriable-4xx"], status(400), False),
        (["retriable-status-codes"], status(429), True),
        (["retriable-status-codes"], status(503), False),
        (["5xx"], LegFailed("payload", retryable=False), False),  # after the headers: never
    ],
)
def test_retry_on(retry_on, failure, retried):
    retry, _, _ = policy(retry_on=retry_on)
    with retry.attempts("r1", "aggregated") as tries:
        assert (failure.retryable and tries.should_retry(failure, 1, 3)) is retried


def test_retriable_status_codes_need_their_condition():
    retry, _, _ = policy(retry_on=["5xx"], retriable_status_codes=[429])
    with retry.attempts("r1", "aggregated") as tries:
        assert not tries.should_retry(status(429), 1, 3)


def test_num_retries_and_the_plan_bound_the_tries():
    retry, _, _ = policy(num_retries=1)
    with retry.attempts("r1", "aggregated") as tries:
        assert tries.should_retry(CONNECT, 1, 3)
        assert not tries.should_retry(CONNECT, 2, 3)
    retry, _, _ = policy(num_retries=5)
    with retry.attempts("r1", "aggregated") as tries:
        assert not tries.should_retry(CONNECT, 2, 2)  # no backend left


def test_failing_statuses():
    assert failing_statuses(Retry()) == frozenset(range(500, 600)) | {429}
    assert 409 in failing_statuses(Retry(retry_on=("retriable-4xx",)))
    assert 429 not in failing_statuses(Retry(retry_on=("5xx",)))


@pytest.mark.parametrize(
    ("failure", "verdict", "certain"),
    [
        (CONNECT, Verdict.GATEWAY, True),
        (RESET, Verdict.GATEWAY, True),
        (TIMEOUT, Verdict.GATEWAY, False),
        (status(500), Verdict.ERROR, False),
        (status(502), Verdict.GATEWAY, False),
        (status(503), None, False),  # backpressure
        (status(429), None, False),
        (status(400), None, False),
        (status(409), None, False),
    ],
)
def test_blame(failure, verdict, certain):
    assert blame(failure) == (verdict, certain)


def test_budget_is_a_share_of_active_requests_with_a_floor():
    budget = RetryBudget(20, 3)
    assert [budget.acquire(10) for _ in range(4)] == [True, True, True, False]  # floor 3 > 20 % of 10
    budget.release()
    assert budget.acquire(10)
    assert [budget.acquire(50) for _ in range(8)] == [True] * 7 + [False]  # 3 held, 20 % of 50 = 10


def test_exhausted_budget_stops_retries_and_is_counted():
    retry, _, metrics = policy(budget_percent=0, min_retry_concurrency=1)
    with retry.attempts("r1", "aggregated") as first, retry.attempts("r1", "aggregated") as second:
        assert first.should_retry(RESET, 1, 3)
        assert not second.should_retry(RESET, 1, 3)
    assert metrics.retry_budget_exhausted._value.get() == 1
    with retry.attempts("r1", "aggregated") as third:  # the tokens went back when the attempts ended
        assert third.should_retry(RESET, 1, 3)
    assert retry.budget.active == 0


def test_a_refused_connection_is_retried_outside_the_budget():
    """It cost no backend any work: a dead backend's traffic must not spend the budget meant for redone
    prefills (a killed backend's ~20 requests in its first second overran it in the soak)."""
    retry, _, metrics = policy(budget_percent=0, min_retry_concurrency=0)
    with retry.attempts("r1", "aggregated") as first, retry.attempts("r1", "aggregated") as second:
        assert first.should_retry(CONNECT, 1, 3) and second.should_retry(CONNECT, 1, 3)
        assert not first.should_retry(CONNECT, 3, 3)  # num_retries and the plan still bound it
        assert not second.should_retry(RESET, 1, 3)  # work may have been done: the budget applies
    assert retry.budget.active == 0
    assert metrics.retry_budget_exhausted._value.get() == 1


def test_a_retry_token_is_given_back_by_the_next_outcome_and_on_exit():
    retry, registry, _ = policy()
    b0, b1 = registry.backends["b0"], registry.backends["b1"]
    with retry.attempts("r1", "aggregated") as tries:
        tries.failed(b0, RESET)
        assert tries.should_retry(RESET, 1, 3)
        assert retry.budget.active == 1
        tries.succeeded(b1, 200)
        assert retry.budget.active == 0
    with pytest.raises(RuntimeError), retry.attempts("r1", "aggregated") as tries:
        assert tries.should_retry(RESET, 1, 3)
        raise RuntimeError("the client left")
    assert retry.budget.active == 0


@pytest.mark.parametrize(
    ("failure", "busy"), [(status(503), True), (status(429), True), (status(500), False)]
)
def test_backpressure_makes_the_backend_cool_down(failure, busy):
    retry, registry, _ = policy()
    backend = registry.backends["b0"]
    with retry.attempts("r1", "aggregated") as tries:
        tries.failed(backend, failure)
    assert (backend.busy_until > 0) is busy
    assert not backend.outlier.consecutive_5xx  # never counted as ill health


def ejected(registry: Registry) -> list[str]:
    return [b.id for b in registry.backends.values() if not registry.available(b)]


def test_a_5xx_counts_once_a_peer_served_the_same_request():
    retry, registry, _ = policy()
    b0, b1 = registry.backends["b0"], registry.backends["b1"]
    with retry.attempts("r1", "aggregated") as tries:
        tries.failed(b0, status(500))
        assert ejected(registry) == []  # held: not yet known whose fault it is
        tries.succeeded(b1, 200)
    assert ejected(registry) == ["b0"]


def test_a_5xx_that_follows_the_request_everywhere_counts_nowhere():
    retry, registry, _ = policy()
    with retry.attempts("r1", "aggregated") as tries:
        for backend in registry.backends.values():
            tries.failed(backend, status(500))
    assert ejected(registry) == []


def test_a_5xx_answered_with_a_4xx_elsewhere_is_not_confirmed():
    retry, registry, _ = policy()
    b0, b1 = registry.backends["b0"], registry.backends["b1"]
    with retry.attempts("r1", "aggregated") as tries:
        tries.failed(b0, TIMEOUT)
        tries.succeeded(b1, 400)
    assert ejected(registry) == []


def test_connection_failures_count_at_once_backpressure_never():
    retry, registry, _ = policy(n=4)
    b0, b1 = registry.backends["b0"], registry.backends["b1"]
    with retry.attempts("r1", "aggregated") as tries:
        tries.failed(b1, status(503))
        tries.failed(b1, status(429))
        tries.failed(b0, CONNECT)
    assert ejected(registry) == ["b0"]


def test_mid_stream_breaks_count_idle_timeouts_do_not():
    retry, registry, _ = policy(n=4)
    retry.note(registry.backends["b0"], LegFailed("timeout", retryable=False), "r1")
    retry.note(registry.backends["b1"], LegFailed("payload", retryable=False), "r1")
    assert ejected(registry) == ["b1"]


def test_a_bad_retry_condition_is_named_by_its_path():
    with pytest.raises(ConfigError, match=r"retry\.retry_on\[1\]"):
        policy(retry_on=["5xx", "4xx"])
