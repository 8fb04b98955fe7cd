"""The gateway's Prometheus metrics, vLLM-like names under `hetgate:`.

Built once per app in the lifespan, on a registry of its own (no module-level globals, so tests can run
several apps in one process). Labels are bounded: model and backend ids come from the configuration,
mode/status/reason from small fixed sets; no prompt text or key ever becomes a label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        # `*_created` series double the page for nothing a dashboard uses (a process-wide switch, set here
        # rather than at import).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hetgate:requests", "Requests finished", ["model", "mode", "status"], registry=r
        )
        self.ttft = Histogram(
            "hetgate:time_to_first_token_seconds",
            "Time to the first streamed byte sent to the client",
            ["model", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "hetgate:time_per_output_token_seconds",
            "Mean time between streamed chunks after the first",
            ["model", "mode"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hetgate:e2e_request_latency_seconds",
            "Request latency seen by the gateway, first byte in to last byte out",
            ["model", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "hetgate:upstream_errors", "Failed upstream attempts", ["backend", "kind"], registry=r
        )
        self.retries = Counter(
            "hetgate:retries", "Attempts retried on another backend", ["model"], registry=r
        )
        self.fallbacks = Counter(
            "hetgate:pd_fallbacks", "P/D requests that fell back", ["model", "to"], registry=r
        )
        self.in_flight = Gauge("hetgate:backend_in_flight", "Requests in flight", ["backend"], registry=r)
        self.healthy = Gauge(
            "hetgate:backend_healthy", "1 when the backend takes traffic", ["backend"], registry=r
        )
        self.route_decisions = Counter(
            "hetgate:route_decisions", "Router decisions", ["model", "mode", "reason"], registry=r
        )
        self.index_errors = Counter(
            "hetgate:index_errors",
            "Prefix index calls that failed or timed out",
            ["op", "reason"],
            registry=r,
        )
        self.kv_events = Counter(
            "hetgate:kv_events",
            "KV-cache event batches and anomalies from backends",
            ["backend", "what"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "hetgate:client_disconnects", "Requests cancelled by the client", ["model"], registry=r
        )
        self.admission_rejections = Counter(
            "hetgate:admission_rejections",
            "Requests refused with 429 by admission control",
            ["reason"],
            registry=r,
        )
        self.admission_active = Gauge(
            "hetgate:admission_active", "Requests holding a global admission slot", registry=r
        )
        self.admission_queued = Gauge(
            "hetgate:admission_queued", "Requests waiting for a global admission slot", registry=r
        )
