"""The gateway's Prometheus metrics, vLLM-like names under `hetgate:`.

Built once per app in the lifespan, on a registry of its own (no module-level globals, so tests can run
several apps in one process). Labels are bounded: model and backend ids come from the configuration,
mode/status/reason from small fixed sets; no prompt text or key ever becomes a label.

With `--workers N` every worker counts its own requests. `hetgate serve` then runs prometheus-client's
multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, a fresh folder per run unless set): each worker writes its
values to files there and any worker's `/metrics` answers for all of them, counters and histograms
summed, in-flight gauges summed over live workers, health and cluster-wide in-flight their maximum.
Gauges read from backend state are refreshed at each scrape and, with several workers, every second
and when a request ends (its backends' in-flight gauges).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from gateway.registry import BackendState
    from scoring.types import Prediction

# Why a split request fell back (gateway/proxy.py names them in the route header too).
PD_FALLBACK_REASONS = ("prefill_failed", "no_kv_params", "decode_failed")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_INDEX_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        # `*_created` series double the page for nothing a dashboard uses (a process-wide switch, set here
        # rather than at import).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._info_labels: dict[str, tuple[str, ...]] = {}
        self._backends: dict[str, tuple[BackendState, Callable[[], bool]]] = {}
        r = self.registry
        self.requests = Counter(
            "hetgate:requests", "Requests finished", ["model", "mode", "status"], registry=r
        )

        def by_mode(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"hetgate:{name}", text, ["model", "mode"], buckets=buckets, registry=r)

        self.ttft = by_mode(
            "time_to_first_token_seconds",
            "Time to the first streamed byte sent to the client",
            _LATENCY_BUCKETS,
        )
        self.tpot = by_mode(
            "time_per_output_token_seconds",
            "Mean time between streamed chunks after the first",
            _TPOT_BUCKETS,
        )
        # The same requests' TTFT and TPOT as the plan predicted them (`cost`: streamed requests served
        # where their plan priced them), so a dashboard puts predicted and observed quantiles side by side.
        self.predicted_ttft = by_mode(
            "predicted_time_to_first_token_seconds",
            "Time to first token the routing plan predicted, for the streamed requests it priced",
            _LATENCY_BUCKETS,
        )
        self.predicted_tpot = by_mode(
            "predicted_time_per_output_token_seconds",
            "Time per output token the routing plan predicted, for the streamed requests it priced",
            _TPOT_BUCKETS,
        )
        self.e2e = by_mode(
            "e2e_request_latency_seconds",
            "Request latency seen by the gateway, first byte in to last byte out",
            _LATENCY_BUCKETS,
        )
        self.upstream_errors = Counter(
            "hetgate:upstream_errors", "Failed upstream attempts", ["backend", "kind"], registry=r
        )
        self.retries = Counter(
            "hetgate:retries", "Attempts retried on another backend", ["model"], registry=r
        )
        self.fallbacks = Counter(
            "hetgate:pd_fallbacks", "P/D requests that fell back", ["model", "to", "reason"], registry=r
        )
        self.decode_recomputes = Counter(
            "hetgate:pd_decode_recomputes",
            "Decode legs retried with transfer parameters an earlier decode backend had already taken "
            "(the KV may be gone, so the decode recomputes the prompt)",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "hetgate:backend_in_flight",
            "Requests in flight",
            ["backend"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.pending_decodes = Gauge(
            "hetgate:backend_pending_decode_legs",
            "Split decode legs planned on this backend whose prefill leg has not ended yet (a prefill "
            "planned here before their KV is due holds them up: the cost policy prices that)",
            ["backend"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.cluster_in_flight = Gauge(
            "hetgate:backend_in_flight_cluster",
            "Requests in flight from every gateway replica sharing the Redis store (this one's without it)",
            ["backend"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.prefix_survival = Gauge(
            "hetgate:prefix_cache_survival",
            "Share of the cached prefix the index promised that this backend's prompts found when vLLM "
            "admitted them, lately (vLLM's prefix cache counters against the gateway's own; 1: all of it). "
            "The cost policy counts cached prompt tokens at this share",
            ["backend"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.healthy = Gauge(
            "hetgate:backend_healthy",
            "1 when the backend takes traffic",
            ["backend"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.ejections = Counter(
            "hetgate:backend_ejections", "Outlier ejections of a backend", ["backend"], registry=r
        )
        self.health_changes = Counter(
            "hetgate:backend_health_changes",
            "Changes of a backend's health (ejected, returned, probe_down, probe_up)",
            ["backend", "event"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "hetgate:retry_budget_exhausted",
            "Retries not made because the retry budget was spent",
            registry=r,
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
        self.cost_model_error = Gauge(
            "hetgate:cost_model_error",
            "Measured over roofline-predicted compute time per backend, as the cost policy learnt it",
            ["backend"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.cost_model_queue_error = Gauge(
            "hetgate:cost_model_queue_error",
            "Measured over roofline-predicted queue before a prefill per backend, as the cost policy learnt",
            ["backend"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.cost_model_overhead = Gauge(
            "hetgate:cost_model_overhead_seconds",
            "Seconds each request pays per backend besides its roofline work, as the cost policy learnt",
            ["backend"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.cost_model_tpot_error = Gauge(
            "hetgate:cost_model_tpot_error",
            "Measured over predicted TPOT per backend, as the cost policy learnt it (its SLO check uses it)",
            ["backend"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.client_disconnects = Counter(
            "hetgate:client_disconnects", "Requests cancelled by the client", ["model"], registry=r
        )
        self.backend_info = Gauge(
            "hetgate:backend_info",
            "Always 1: what each backend is (join on `backend` to group other series by accelerator)",
            ["backend", "model", "accelerator", "gpus", "roles"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.index_lookup = Histogram(
            "hetgate:index_lookup_seconds",
            "Prompt hashing plus the prefix-index lookup, per request",
            ["model"],
            buckets=_INDEX_BUCKETS,
            registry=r,
        )
        self.index_prompt_tokens = Counter(
            "hetgate:index_prompt_tokens",
            "Prompt tokens looked up in the prefix index",
            ["model"],
            registry=r,
        )
        self.index_matched_tokens = Counter(
            "hetgate:index_matched_tokens",
            "Of those, the longest cached prefix any backend held (index hit rate = matched / prompt)",
            ["model"],
            registry=r,
        )
        self.connection_rejections = Counter(
            "hetgate:connection_rejections",
            "Requests the server's limits answered before the app saw them, connection closed (malformed,"
            " header_too_large, too_many_headers, header_timeout, body_timeout, connection_limit)",
            ["reason"],
            registry=r,
        )
        self.admission_rejections = Counter(
            "hetgate:admission_rejections",
            "Requests refused with 429 by admission control",
            ["reason"],
            registry=r,
        )
        self.admission_active = Gauge(
            "hetgate:admission_active",
            "Requests holding a global admission slot",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.admission_queued = Gauge(
            "hetgate:admission_queued",
            "Requests waiting for a global admission slot",
            registry=r,
            multiprocess_mode="livesum",
        )

    def first_token(self, model: str, mode: str, ttft_s: float, predicted: Prediction | None) -> None:
        """A streamed request's TTFT, and its plan's where the plan priced the backends that served it."""
        self.ttft.labels(model, mode).observe(ttft_s)
        if predicted is not None:
            self.predicted_ttft.labels(model, mode).observe(predicted.ttft_s)

    def token_gap(self, model: str, mode: str, tpot_s: float, predicted: Prediction | None) -> None:
        """A completed stream's TPOT, and the one its plan expected (`first_token`'s rule)."""
        self.tpot.labels(model, mode).observe(tpot_s)
        if predicted is not None:
            self.predicted_tpot.labels(model, mode).observe(predicted.expected_tpot_s)

    def initialise(self, models: Iterable[str]) -> None:
        """Create every series whose labels are known at start, at 0, so dashboards and alerts see a
        value (not an absent series) before the first event."""
        for model in models:
            self.retries.labels(model)
            self.client_disconnects.labels(model)
            self.decode_recomputes.labels(model)
            for to in ("aggregated", "fail"):
                for reason in PD_FALLBACK_REASONS:
                    self.fallbacks.labels(model, to, reason)

    def watch_backend(self, backend: BackendState, available: Callable[[], bool]) -> None:
        """A backend joins (at start, or discovered): its series start. `available`: does it take traffic
        now (probes and outlier detection, gateway/registry.py)."""
        config = backend.config
        roles = ",".join(sorted(config.roles))
        labels = (config.id, config.model, config.accelerator, str(config.gpus), roles)
        self.forget_backend(config.id)  # a changed backend (same id) replaces its old description
        self._info_labels[config.id] = labels
        self._backends[config.id] = (backend, available)
        self.backend_info.labels(*labels).set(1)
        self.refresh()

    def forget_backend(self, backend_id: str) -> None:
        """A backend left: its series go (labels stay bounded by the live backend set). In multiprocess
        mode the files keep a removed series, so it is zeroed first."""
        if self._backends.pop(backend_id, None) is None:
            return
        gauges = (
            self.healthy,
            self.in_flight,
            self.pending_decodes,
            self.cluster_in_flight,
            self.prefix_survival,
        )
        for gauge in gauges:
            gauge.labels(backend_id).set(0)
            gauge.remove(backend_id)
        labels = self._info_labels.pop(backend_id)
        self.backend_info.labels(*labels).set(0)
        self.backend_info.remove(*labels)

    def refresh(self) -> None:
        """Copy what the backends' state says into the gauges that mirror it."""
        for backend_id, (backend, available) in self._backends.items():
            self.healthy.labels(backend_id).set(1 if available() else 0)
            self._mirror_load(backend)

    def _mirror_load(self, backend: BackendState) -> None:
        backend_id = backend.id
        self.in_flight.labels(backend_id).set(backend.in_flight)
        self.pending_decodes.labels(backend_id).set(len(backend.reserved.kv_due))
        self.cluster_in_flight.labels(backend_id).set(backend.in_flight + backend.remote_in_flight)
        self.prefix_survival.labels(backend_id).set(backend.survival.factor)

    def legs_ended(self, backends: Iterable[BackendState]) -> None:
        """A request gave its backends back: with several workers, write their in-flight gauges now,
        so another worker's scrape does not read this one's count from before (up to a refresh old)."""
        if not self.multiprocess:
            return  # one process: the scrape refreshes them
        for backend in backends:
            if backend.id in self._backends:  # one removed meanwhile: its series are gone and stay gone
                self._mirror_load(backend)

    async def refresh_every(self, interval_s: float) -> None:
        """With several workers a scrape reads every worker's files: keep this worker's fresh."""
        while True:
            self.refresh()
            await asyncio.sleep(interval_s)

    def exposition(self) -> bytes:
        """The `/metrics` page: this process's registry, or every worker's in multiprocess mode."""
        self.refresh()
        if not self.multiprocess:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        return generate_latest(merged)
