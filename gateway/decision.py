"""The routing decision, written once for both deployment shapes (`hetgate serve` and `hetgate epp`).

A decision is: the model's pool, the request's features (prompt estimate or hashes plus the one awaited
index lookup), the candidates the registry sees now, and the router's plan. `serve` then carries the bytes
itself (proxy.py); `epp` hands the plan to Envoy as `x-gateway-destination-endpoint`. Because both call
`Decider.decide`, the same request in the same state gets the same plan in either shape.

After the request, `served` records what the chosen backends now hold (approximate prefix mode) and
`learn` feeds a measured TTFT back to a router that learns (the cost policy calibrates its model with it,
against the prediction it planned with).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.config import GatewayConfig
from gateway.errors import BadRequest, ModelNotFound, NoBackend
from gateway.metrics import GatewayMetrics
from gateway.registry import BackendState, ModelPool, Registry
from gateway.schemas import ParsedRequest, estimate_prompt_tokens
from scoring.catalog import load_catalog
from scoring.cost import DEFAULT_EFFICIENCY
from scoring.cost_policy import Slo, compile_kernels
from scoring.load import leg_load, planned_prefill_s
from scoring.outcome import Measured, outcomes_of
from scoring.router import build_router
from scoring.types import Candidates, LegLoad, Mode, Prediction, RequestFeatures, RoutePlan, Router

if TYPE_CHECKING:
    from gateway.affinity import Affinity


SloOverride = tuple[float | None, float | None]  # per-request TTFT and TPOT objectives, s (None: the model's)
NO_SLO_OVERRIDE: SloOverride = (None, None)
_SLO_HEADERS = (b"x-hetgate-slo-ttft-ms", b"x-hetgate-slo-tpot-ms")
# Names the conversation a request belongs to (vLLM's production-stack router and llm-d's session scorer
# route on such a header), by default: `routing.session_header`. Only its presence is read:
# `RequestFeatures.in_conversation`.
SESSION_HEADER = b"x-session-id"


def slo_override(headers: dict[bytes, bytes]) -> SloOverride:
    """The request's own SLO from its headers (milliseconds), for policies that plan for one (`cost`).
    Raises BadRequest for a value that is not a positive number."""
    values: list[float | None] = []
    for name in _SLO_HEADERS:
        raw = headers.get(name)
        if raw is None:
            values.append(None)
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = -1.0
        if not 0 < ms < 1e9:  # also rejects nan and inf
            raise BadRequest(f"{name.decode()} must be a positive number of milliseconds.", name.decode())
        values.append(ms / 1000.0)
    return values[0], values[1]


def with_hints(
    features: RequestFeatures,
    headers: dict[bytes, bytes],
    slo: SloOverride,
    session_header: bytes | None = SESSION_HEADER,
) -> RequestFeatures:
    """`features` with what the client said of the request: its own SLO (`slo_override`) and whether
    it names a conversation (`session_header`, lower case; None: never). The same object when it said
    nothing."""
    chat = session_header is not None and session_header in headers
    if slo == NO_SLO_OVERRIDE and not chat:
        return features
    return dataclasses.replace(features, slo_ttft_s=slo[0], slo_tpot_s=slo[1], in_conversation=chat)


def route_text(backends: Sequence[BackendState], predicted: Prediction | None, note: str = "") -> str:
    """The `x-hetgate-route` value of a served request, one rule for `serve` and `epp`: how it was served
    (`backends`: one, or the prefiller then the decoder) and, when its plan priced those backends, the
    TTFT and TPOT the plan predicted, so a client can set them beside what it measures."""
    if len(backends) > 1:
        text = f"mode=pd; prefill={backends[0].id}; decode={backends[-1].id}{note}"
    else:
        text = f"mode=aggregated; backend={backends[0].id}{note}"
    if predicted is None:
        return text
    ttft_ms, tpot_ms = predicted.ttft_s * 1e3, predicted.expected_tpot_s * 1e3
    return f"{text}; predicted_ttft_ms={ttft_ms:.1f}; predicted_tpot_ms={tpot_ms:.2f}"


def session_header(config: GatewayConfig) -> bytes | None:
    """The header that names a request's conversation, as the server hands headers over."""
    name = config.routing.session_header
    return None if name is None else name.encode("latin-1")


def needs_prompt_tokens(config: GatewayConfig, routers: dict[str, Router]) -> bool:
    """The `auto` split and the policies that price prompts (prefix share, cost) read its length."""
    return config.routing.disaggregation == "auto" or any(r.uses_prefix_index for r in routers.values())


def build_routers(config: GatewayConfig) -> dict[str, Router]:
    """One router per model, its compiled kernels ready (scoring/jit.py): compiled on the first
    request, that request and the event loop would wait ~15 s (a second when numba's cache has them)."""
    compile_kernels()
    routing = config.routing
    routers: dict[str, Router] = {}
    for model in config.models:
        knobs: dict[str, Any] = {}
        if routing.policy == "prefix":
            knobs = routing.prefix.model_dump()
        elif routing.policy == "cost":
            knobs = {"model": load_catalog().model(model.spec or "")}
            prior = routing.cost.model_dump(exclude_none=True)
            if prior:
                knobs["efficiency"] = dataclasses.replace(DEFAULT_EFFICIENCY, **prior)
            if model.slo is not None:
                knobs["slo"] = Slo(model.slo.ttft_s, model.slo.tpot_s)
        routers[model.name] = build_router(
            routing.policy, routing.disaggregation, routing.pd_min_prompt_tokens, **knobs
        )
    return routers


@dataclass(frozen=True, slots=True)
class Served:
    """What the proxy measured of a streamed request (perf_counter seconds): the backends that served it
    (one, or the prefiller then the decoder of a split), its first token, and, when the stream completed,
    its end and output tokens (0: not known; then only its TTFT is learnt)."""

    backends: tuple[BackendState, ...]
    first_token_s: float
    finish_s: float = math.nan
    output_tokens: int = 0
    prefill_done_s: float = math.nan


@dataclass(slots=True)
class Decision:
    """One planned request: everything needed to execute the plan and to learn from it afterwards."""

    request: ParsedRequest
    pool: ModelPool
    features: RequestFeatures
    cached: np.ndarray | None  # prompt tokens each backend holds (row = pool.backends index); None: unknown
    candidates: Candidates
    plan: RoutePlan
    started: float

    @property
    def aggregated(self) -> list[BackendState]:
        return [self.pool.backends[i] for i in self.plan.aggregated]

    @property
    def prefill(self) -> list[BackendState]:
        return [self.pool.backends[i] for i in self.plan.prefill]

    @property
    def decode(self) -> list[BackendState]:
        return [self.pool.backends[i] for i in self.plan.decode]

    def leg_load(self, backend: BackendState, leg: str, kv_due_s: float = math.nan) -> LegLoad:
        """What a leg of this request (aggregated | prefill | decode; a planned decode leg's KV due at
        `kv_due_s`) puts on `backend` (scoring/load.py)."""
        row = self.pool.backends.index(backend)
        cached = 0 if self.cached is None or not self.features.prompt_tokens else int(self.cached[row])
        max_tokens = self.request.max_tokens or 1
        prefill_s = planned_prefill_s(self.plan.predicted, leg, row)
        survival = float(self.candidates.cache_survival[row])
        return leg_load(leg, self.features.prompt_tokens, max_tokens, cached, kv_due_s, prefill_s, survival)

    def prediction_for(self, backends: Sequence[BackendState]) -> Prediction | None:
        """The plan's prediction if `backends` (prefiller first) are the ones it was made for, else None:
        a request a retry or a fallback moved to another backend (or from a split to one backend) would
        credit that backend with another one's queue and compute."""
        predicted = self.plan.predicted
        if predicted is None or predicted.rows != tuple(self.pool.backends.index(b) for b in backends):
            return None
        return predicted

    def utilisation(self, rows: tuple[int, ...]) -> float:
        """The lowest load/capacity among `rows`: 1.0 means even the least busy one is full."""
        c = self.candidates
        return float(np.min(c.load[list(rows)] / c.capacity[list(rows)])) if rows else float("inf")


def demote(plan: RoutePlan, cooling: frozenset[int]) -> RoutePlan:
    """The plan with the backends cooling down after backpressure moved to the end of each order.

    A backend that just answered 429/503 would refuse the next request too (in `hetgate bench soak`, ten
    503s in 140 ms from one backend, each retried, overran the retry budget), so it is tried last; it stays
    in the plan as a fallback (removing it left single-backend plans with nothing to retry on). Busy is
    not ill health: it never ejects a backend or counts toward panic mode."""
    if not cooling:
        return plan

    def last(order: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(order, key=cooling.__contains__))  # stable: the policy's order otherwise

    return dataclasses.replace(
        plan, aggregated=last(plan.aggregated), prefill=last(plan.prefill), decode=last(plan.decode)
    )


class Decider:
    def __init__(
        self,
        config: GatewayConfig,
        registry: Registry,
        metrics: GatewayMetrics,
        affinity: Affinity | None,
    ) -> None:
        """The decider `config` asks for, with its routers; `serve` and `epp` alike."""
        self.registry = registry
        self.metrics = metrics
        self.affinity = affinity
        self.reconfigure(config)

    def reconfigure(self, config: GatewayConfig) -> None:
        """Apply a configuration's routing (at start and on a reload, gateway/live.py); the routers start
        afresh."""
        self.routers: dict[str, Router] = build_routers(config)
        self.needs_prompt_tokens: bool = needs_prompt_tokens(config, self.routers)
        self.session_header: bytes | None = session_header(config)

    def pool_of(self, request: ParsedRequest) -> ModelPool:
        pool = self.registry.pool(request.model)
        if pool is None:
            raise ModelNotFound(f"The model `{request.model}` does not exist.", "model")
        return pool

    async def decide(
        self,
        request: ParsedRequest,
        pool: ModelPool,
        headers: dict[bytes, bytes],
        slo: SloOverride = NO_SLO_OVERRIDE,
        eligible: np.ndarray | None = None,
        started: float | None = None,
    ) -> Decision:
        """Plan one request on `pool` (`pool_of(request)`). `slo` overrides the model's objectives (see
        `slo_override`); `eligible` (one bool per pool backend) narrows the choice, e.g. to the subset an
        Envoy gateway allows. Raises NoBackend when nothing can serve."""
        features, cached = await self._features(request, pool, headers)
        features = with_hints(features, headers, slo, self.session_header)
        router = self.routers[request.model]
        candidates = self.registry.candidates(pool, cached, router.uses_work)
        if eligible is not None:
            candidates.healthy = candidates.healthy & eligible
        plan = demote(router.plan(features, candidates), self.registry.cooling(pool))
        self.metrics.route_decisions.labels(request.model, plan.mode.value, plan.reason).inc()
        if not plan.aggregated:
            raise NoBackend("No healthy backend serves this model.")
        when = time.perf_counter() if started is None else started
        return Decision(request, pool, features, cached, candidates, plan, when)

    def served(self, decision: Decision, backends: list[BackendState]) -> None:
        """The backends that served the request now hold its prefix (approximate index mode)."""
        if self.affinity is not None and backends:
            self.affinity.record(decision.request, decision.pool, decision.features, backends)

    def learn(self, decision: Decision, served: Served) -> None:
        """Feed what a streamed request measured back to its router, if it learns, by the one outcome
        rule the simulator uses (`scoring/outcome.py`): each leg credited to the backend that did it,
        against the prediction the plan was made with, if it was served where that plan priced it."""
        router = self.routers[decision.request.model]
        predicted = decision.prediction_for(served.backends)
        if not router.learns or predicted is None:
            return
        prefiller, decoder = served.backends[0], served.backends[-1]
        split = len(served.backends) > 1
        row = decision.pool.backends.index(prefiller)
        measured = Measured(
            mode=Mode.PD if split else Mode.AGGREGATED,
            backend_id=decoder.id,
            prompt_tokens=decision.features.prompt_tokens,
            # What the prefiller was expected to hold at admission: vLLM's own figure is in the usage
            # of the last event only, which the relay does not parse.
            cached_tokens=0 if decision.cached is None else int(decision.candidates.surviving_cached()[row]),
            output_tokens=served.output_tokens,
            start_s=decision.started,
            first_token_s=served.first_token_s,
            finish_s=served.finish_s if served.output_tokens else served.first_token_s,
            prefill_backend_id=prefiller.id if split else "",
            prefill_done_s=served.prefill_done_s if split else math.nan,
        )
        for outcome in outcomes_of(measured, predicted):
            router.observe(outcome)
            backend = outcome.backend_id
            self.metrics.cost_model_error.labels(backend).set(router.correction(backend))
            self.metrics.cost_model_queue_error.labels(backend).set(router.queue_correction(backend))
            self.metrics.cost_model_tpot_error.labels(backend).set(router.tpot_correction(backend))
            self.metrics.cost_model_overhead.labels(backend).set(router.overhead(backend))

    async def _features(
        self, request: ParsedRequest, pool: ModelPool, headers: dict[bytes, bytes]
    ) -> tuple[RequestFeatures, np.ndarray | None]:
        if self.affinity is None:
            # Only the `auto` split reads the prompt length: a plain balancer skips the estimate.
            tokens = estimate_prompt_tokens(request) if self.needs_prompt_tokens else 0
            return RequestFeatures(request.model, tokens, request.max_tokens, request.stream), None
        return await self.affinity.lookup(request, pool, headers)
