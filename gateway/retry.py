"""Retries across backends (Envoy's `retry_on` with a retry budget), and who is to blame for a failed attempt.

Retries. A failed attempt goes to the next backend of the plan only before any byte reached the client
(the proxy opens a leg, status line and headers, before relaying anything), at most `num_retries` times,
and only when it matches one of `retry_on`:
  connect-failure         the connection could not be opened
  reset                   the connection broke or timed out before the response headers
  5xx                     any 5xx, and everything `reset` and `connect-failure` cover
  gateway-error           502, 503, 504, and everything `reset` and `connect-failure` cover
  retriable-4xx           409
  retriable-status-codes  a status of `retriable_status_codes`
Defaults: `[connect-failure, reset, 5xx, retriable-status-codes]` with `retriable_status_codes: [429]` and
`num_retries: 2`. Envoy retries nothing by default; an LLM gateway's users expect a generation that failed
before its first byte (a dead backend, a 500, a stall, a 429/503 busy backend) to be served elsewhere. A
retried generation costs the pool a second prefill, so retries are capped by a budget, as Envoy's
`retry_budget`: at most `budget_percent` of active requests (legs in flight, plus this request) may be
retrying at once, and `min_retry_concurrency` always may. A retry holds its budget token from the decision
until its attempt's outcome (response headers or failure), not for the whole generation. A retry after a
connect failure takes no token: the refused attempt cost no backend any work, and without the exemption a
killed backend's share of the traffic (every request routed there before health checks notice, ~20 in a
second at 80 req/s) overran the budget at once and reached clients as 502 (`hetgate bench soak`).

Blame (what feeds outlier detection, gateway/outlier.py), so that a client cannot get backends ejected
with requests that fail because of what they contain:
  connect failure, reset      the backend's fault whatever the request: counted at once (GATEWAY)
  429, 503                    backpressure from a busy vLLM, not ill health: never counted; the backend
                              cools down instead (tried last for `health.backpressure_cooldown_s`,
                              gateway/decision.py `demote`)
  other 4xx                   the request's fault: never counted
  other 5xx, timeouts before  could be either (a prompt that trips an engine bug, a prefill longer than
  the first byte              `ttfb_s`): held until the request is over. Counted (ERROR for a 5xx, GATEWAY
                              for 502/504/timeouts) only if another backend then answered the same request
                              with a 2xx: this backend failed what a peer served. Dropped if every backend
                              tried failed it (the request's own doing) or none other was tried.
  a stream that breaks after  counted at once when the connection broke (GATEWAY); an idle timeout mid-stream
  the first byte              is not (a slow generation is not proof of a broken backend)
Why this is sound: a request that fails everywhere costs no backend anything, however often it is sent; a
broken backend fails requests its peers serve, so with 5xx retries on (the default) its count rises on every
request it gets until it is ejected. The price: with 5xx retries off (or the budget spent) a 5xx cannot be
compared and is not counted; probes and connection failures still take such a backend out.
"""

from __future__ import annotations

import logging
from types import TracebackType

from gateway.config import Retry
from gateway.metrics import GatewayMetrics
from gateway.outlier import Verdict
from gateway.registry import BackendState, Registry
from gateway.upstream import LegFailed

log = logging.getLogger("hetgate.upstream")

_BACKPRESSURE = frozenset({429, 503})
_GATEWAY_STATUSES = frozenset({502, 503, 504})
_CONFLICT = 409


def failing_statuses(settings: Retry) -> frozenset[int]:
    """Statuses at which an attempt counts as failed (Upstream raises LegFailed): every 5xx, for blame,
    and the 4xx that `retry_on` retries. Any other status is relayed as the backend's answer."""
    statuses = set(range(500, 600))
    if "retriable-status-codes" in settings.retry_on:
        statuses |= set(settings.retriable_status_codes)
    if "retriable-4xx" in settings.retry_on:
        statuses.add(_CONFLICT)
    return frozenset(statuses)


def retry_conditions(failure: LegFailed) -> frozenset[str]:
    """The `retry_on` values that cover this failure."""
    if failure.kind == "connect":
        return frozenset({"connect-failure", "5xx", "gateway-error"})
    # payload: the body broke before the client saw it; redirect: a 3xx, never followed (another host)
    if failure.kind in ("reset", "timeout", "payload", "redirect"):
        return frozenset({"reset", "5xx", "gateway-error"})
    if failure.kind != "status":
        return frozenset()
    status = failure.status
    if status in _GATEWAY_STATUSES:
        return frozenset({"5xx", "gateway-error"})
    if status >= 500:
        return frozenset({"5xx"})
    if status == _CONFLICT:
        return frozenset({"retriable-4xx"})
    return frozenset()


def _log(request_id: str, leg: str, backend: BackendState, failure: LegFailed) -> None:
    """One failed attempt in the gateway's log, as nginx's error log names the upstream that failed and
    how. `leg`: the attempt's leg (aggregated | prefill | decode), or "" for a response that broke after
    its headers. No prompt and no key: the request is named by its id (the client's X-Request-Id)."""
    when = f"{leg} leg" if leg else "response"
    # A busy vLLM's 429/503 is backpressure, not a fault (see `blame`): not a warning.
    level = logging.INFO if failure.kind == "status" and failure.status in _BACKPRESSURE else logging.WARNING
    log.log(level, "request %s: %s on backend %s failed: %s", request_id, when, backend.id,
            failure.describe())  # fmt: skip


def blame(failure: LegFailed, before_first_byte: bool = True) -> tuple[Verdict | None, bool]:
    """(verdict, certain): what the failure says about the backend, and whether it holds whatever the
    request contained. A verdict that is not certain counts only once a peer served the same request."""
    kind = failure.kind
    if kind in ("connect", "reset", "payload", "redirect"):
        return Verdict.GATEWAY, True
    if kind == "timeout":
        return (Verdict.GATEWAY, False) if before_first_byte else (None, False)
    if kind == "status" and failure.status >= 500 and failure.status not in _BACKPRESSURE:
        return (Verdict.GATEWAY if failure.status in _GATEWAY_STATUSES else Verdict.ERROR), False
    return None, False


class RetryBudget:
    """How many retries may be in progress at once: `percent` of active requests, at least `minimum`."""

    __slots__ = ("active", "minimum", "share")

    def __init__(self, percent: float, minimum: int) -> None:
        self.share = percent / 100
        self.minimum = minimum
        self.active = 0

    def acquire(self, active_requests: int) -> bool:
        if self.active >= max(self.minimum, self.share * active_requests):
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1


class RetryPolicy:
    def __init__(self, settings: Retry, registry: Registry, metrics: GatewayMetrics) -> None:
        self.max_attempts = settings.num_retries + 1
        self.retry_on = frozenset(settings.retry_on)
        self.retriable_statuses = (
            frozenset(settings.retriable_status_codes)
            if "retriable-status-codes" in settings.retry_on
            else frozenset()
        )
        self.budget = RetryBudget(settings.budget_percent, settings.min_retry_concurrency)
        self.registry = registry
        self.metrics = metrics

    def attempts(self, request_id: str, leg: str) -> Attempts:
        """The attempts of one leg (aggregated | prefill | decode) of one request across backends:
        `with policy.attempts(request_id, leg) as tries: ...`."""
        return Attempts(self, request_id, leg)

    def matches(self, failure: LegFailed) -> bool:
        if failure.kind == "status" and failure.status in self.retriable_statuses:
            return True
        return not self.retry_on.isdisjoint(retry_conditions(failure))

    def note(self, backend: BackendState, failure: LegFailed, request_id: str) -> None:
        """A failure outside the attempts (reading a body, mid-stream): counted only when certain."""
        _log(request_id, "", backend, failure)
        self.metrics.upstream_errors.labels(backend.id, failure.kind).inc()
        verdict, certain = blame(failure, before_first_byte=False)
        if verdict is not None and certain:
            self.registry.record_failure(backend, verdict)


class Attempts:
    """One leg's tries: the retry decisions and budget token, and blame held until the outcome is known."""

    __slots__ = ("_leg", "_pending", "_policy", "_request_id", "_token")

    def __init__(self, policy: RetryPolicy, request_id: str, leg: str) -> None:
        self._policy = policy
        self._request_id = request_id  # for the log
        self._leg = leg
        self._pending: list[tuple[BackendState, Verdict]] = []
        self._token = False

    def __enter__(self) -> Attempts:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        # No backend answered (or the client left): uncertain blame is dropped, see the module doc.
        self._release()
        self._pending.clear()

    def failed(self, backend: BackendState, failure: LegFailed) -> None:
        """Report one failed attempt."""
        self._release()
        _log(self._request_id, self._leg, backend, failure)
        policy = self._policy
        policy.metrics.upstream_errors.labels(backend.id, failure.kind).inc()
        if failure.kind == "status" and failure.status in _BACKPRESSURE:
            policy.registry.record_backpressure(backend)
        verdict, certain = blame(failure)
        if verdict is None:
            return
        if certain:
            policy.registry.record_failure(backend, verdict)
        else:
            self._pending.append((backend, verdict))

    def succeeded(self, backend: BackendState, status: int) -> None:
        """Report the attempt that produced the response (its status line is in)."""
        self._release()
        if not 200 <= status < 300:
            return  # e.g. a 400 elsewhere: says nothing about this backend, nor confirms earlier failures
        registry = self._policy.registry
        for failed, verdict in self._pending:
            registry.record_failure(failed, verdict)
        self._pending.clear()
        registry.record_success(backend)

    def should_retry(self, failure: LegFailed, tried: int, candidates: int) -> bool:
        """After `tried` attempts over a plan of `candidates` backends: may the next one be tried?"""
        policy = self._policy
        if tried >= min(candidates, policy.max_attempts) or not policy.matches(failure):
            return False
        if failure.kind == "connect":
            return True
        if not policy.budget.acquire(policy.registry.in_flight_total() + 1):
            policy.metrics.retry_budget_exhausted.inc()
            return False
        self._token = True
        return True

    def _release(self) -> None:
        if self._token:
            self._token = False
            self._policy.budget.release()
