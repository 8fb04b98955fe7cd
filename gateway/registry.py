"""Backends, their health, and their live load.

Health has two independent sources, each owning its own state:
- active: the poller's GET /health every `health.interval_s`; `failure_threshold` failed probes in a row
  take a backend out (`probe_up` False), one good probe brings it back. A probe decides only this.
- passive: outlier detection on real traffic (gateway/outlier.py, attributed by gateway/retry.py). A good
  probe never resets it: a backend answering 500 to every generation while /health says 200 is ejected.
A backend takes traffic when its probe is up and it is not ejected. Panic mode (as Envoy's): when fewer
than `panic_threshold_percent` of a model's backends take traffic, all of them do, so that health
checking can never turn a degraded pool into an empty one.
Load is the gateway's own in-flight count plus what vLLM's /metrics said last (polled off the request path).
Nothing here does I/O on the request path: `candidates()` only reads memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from enum import Enum

import numpy as np

from gateway.config import BackendConfig, GatewayConfig, Health, ModelConfig
from gateway.outlier import OutlierPool, OutlierState, Verdict
from gateway.stats import VllmLoad
from scoring.load import CacheSurvival, Reserved, kv_due_columns, load_columns, request_load
from scoring.types import BackendSpec, Candidates, LegLoad, Role

OwnCounts = tuple[int, int, int, int]  # `BackendState.own_counts`


class HealthEvent(Enum):
    EJECTED = "ejected"
    RETURNED = "returned"
    PROBE_DOWN = "probe_down"
    PROBE_UP = "probe_up"


class BackendState:
    __slots__ = (
        "_load",
        "busy_until",
        "config",
        "in_flight",
        "outlier",
        "probe_failures",
        "probe_up",
        "remote_in_flight",
        "reported",
        "reserved",
        "spec",
        "survival",
        "upstream_key",
        "version",
    )

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.spec = BackendSpec(
            id=config.id,
            model=config.model,
            accelerator=config.accelerator,
            gpus=config.gpus,
            roles=config.roles,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
        )
        self.upstream_key = config.upstream_key()
        self.probe_up = True
        self.probe_failures = 0
        self.outlier = OutlierState(config.id)
        self.in_flight = 0
        self.reserved = Reserved()  # the work of the legs in flight, taken at plan time (`reserve`)
        self.survival = CacheSurvival()  # how much of an indexed prefix its prompts found, lately
        self.remote_in_flight = 0  # other gateway processes' requests on it (gateway/replicas.py)
        # Bumped whenever what `ModelPool.candidates` reads of it changes (in-flight counts, reserved
        # work, the survival factor), so the pool rereads only the backends that changed.
        self.version = 0
        self.busy_until = 0.0  # answered 429/503 (backpressure): tried last until then (decision.demote)
        self._load = VllmLoad()
        # What `ModelPool.candidates` reads of the last report: running, waiting, KV usage, then the
        # own counts when it was reported (`report`).
        self.reported: tuple[float, ...] = (0.0,) * 7

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def load(self) -> VllmLoad:
        """What vLLM's /metrics said last (`report`)."""
        return self._load

    def own_counts(self) -> OwnCounts:
        """The gateway's own view of this backend, as `load_columns`' `seen` takes it: legs in flight
        (this process's and other replicas'), legs vLLM counts as waiting (`Reserved.waiting_seqs`),
        sequences decoding, their context."""
        r = self.reserved
        return (self.in_flight + self.remote_in_flight, r.waiting_seqs, r.decode_seqs, r.context_tokens)

    def report(self, load: VllmLoad, own_before: OwnCounts | None = None) -> None:
        """vLLM's counts as scraped, with the gateway's own counts at the time (`load_columns`' `seen`):
        each the larger of those before the scrape was sent (`own_before`) and now, so a leg of the
        gateway's that starts or ends while the scrape is under way is not taken for another client's."""
        now = self.own_counts()
        seen = now if own_before is None else map(max, own_before, now)
        self._load = load
        self.reported = (load.running, load.waiting, load.kv_usage, *map(float, seen))
        r = self.reserved
        self.survival.observe(load.prefix_hits, load.prefix_queries, r.indexed_tokens, r.queried_tokens)
        self.version += 1

    def set_remote_in_flight(self, count: int) -> None:
        """Other gateway replicas' requests on it, as the shared load says (gateway/replicas.py)."""
        if count != self.remote_in_flight:
            self.remote_in_flight = count
            self.version += 1

    def available(self, now: float) -> bool:
        """Takes traffic outside panic mode: its probe is up and it is not ejected."""
        until = self.outlier.ejected_until  # OutlierState.ejected inlined: this runs per backend per request
        return self.probe_up and (until is None or now >= until)


class Reservation:
    """One request leg's hold on one backend: counted in `in_flight` and `reserved` until released.

    Both methods are idempotent, so the one owner (the handler's `finally`, see gateway/handler.py) can
    release everything a request took without knowing which legs already gave their part back.
    """

    __slots__ = ("_arriving", "_clock", "_open", "_prefilling", "backend", "load")

    def __init__(self, backend: BackendState, load: LegLoad, clock: Callable[[], float]) -> None:
        self.backend = backend
        self.load = load
        self._clock = clock  # the registry's, which `Candidates.now` is read from
        self._open = True
        self._prefilling = True
        self._arriving = False  # a split decode leg sent to vLLM, before its first token
        backend.in_flight += 1
        backend.reserved.add(load, clock())
        backend.version += 1

    @property
    def open(self) -> bool:
        return self._open

    def prefill_done(self) -> None:
        """Its prompt is computed: the backend's first byte came, or, for a split's decode leg, the
        prefill leg's result (the leg goes out now, and waits in vLLM until `first_token`)."""
        if self._prefilling and self._open:
            self._prefilling = False
            self._arriving = self.load.awaits_kv
            self.backend.reserved.prefill_done(self.load, self._clock())
            self.backend.version += 1

    def first_token(self) -> None:
        """The backend's first byte: its prompt is computed, and vLLM no longer counts it as waiting."""
        self.prefill_done()
        self._arrived()

    def release(self) -> None:
        if not self._open:
            return
        self._arrived()  # a decode leg that ends before its first token no longer waits either
        self._open = False
        self.backend.in_flight -= 1
        self.backend.reserved.release(self.load, self._prefilling, self._clock())
        self.backend.version += 1

    def _arrived(self) -> None:
        if self._arriving:
            self._arriving = False
            self.backend.reserved.arrived()
            self.backend.version += 1


_OWN_ROWS = 11  # `ModelPool._own_rows`


class ModelPool:
    """The backends of one model, with the arrays that never change precomputed."""

    def __init__(self, model: ModelConfig, backends: list[BackendState], health: Health) -> None:
        self.model = model
        self.backends = backends
        self.outliers = OutlierPool(health.outlier, [b.outlier for b in backends])
        self._panic_below = len(backends) * health.panic_threshold_percent / 100
        self._everyone = np.ones(len(backends), dtype=bool)
        self._rows = {b.id: i for i, b in enumerate(backends)}
        self.specs = tuple(b.spec for b in backends)
        self.block_sizes = tuple(sorted({b.spec.block_size for b in backends}))
        self._can_prefill = np.array([Role.PREFILL in s.roles for s in self.specs], dtype=bool)
        self._can_decode = np.array([Role.DECODE in s.roles for s in self.specs], dtype=bool)
        self._capacity = np.array([s.max_num_seqs for s in self.specs], dtype=float)
        self._reports: list[tuple[float, ...]] = []
        self._reported = np.zeros((7, len(backends)))
        self._versions = [-1] * len(backends)  # each backend's `version` when `_own` last read it
        self._own = np.zeros((_OWN_ROWS, len(backends)))
        # Split decode legs due on each backend (`kv_due_columns`, on the clock's absolute times), reread
        # with `_own`.
        self._kv_due = kv_due_columns([], 0.0)

    def routable(self, now: float) -> np.ndarray:
        """Who may get traffic: the available backends, or all of them in panic mode."""
        # `BackendState.available` of each, in two passes: the probes, then the few ejected backends
        # (the outlier pool keeps them), not a method call per backend per request (~10 us of 64).
        available = [b.probe_up for b in self.backends]  # a list: cheaper than np.fromiter here
        for member in self.outliers.ejected_now(now):
            available[self._rows[member.key]] = False
        if available.count(True) < self._panic_below:
            return self._everyone
        return np.array(available, dtype=bool)

    def _reported_rows(self) -> np.ndarray:
        """vLLM's last reports as rows (`BackendState.reported`: running, waiting, KV usage, then the own
        counts when each was reported), rebuilt only when a report has come in since the last call: a
        report comes once per scrape, a routing decision on every request."""
        reports = [b.reported for b in self.backends]
        if reports != self._reports:  # the same tuples compare by identity, without their values
            self._reports = reports
            self._reported = np.array(reports, dtype=float).reshape(len(reports), 7).T.copy()
        return self._reported

    def _own_rows(self) -> np.ndarray:
        """The gateway's own inputs of the load formula per backend (`_OWN_ROWS`: legs in flight, the
        reserved work, the prompt in progress, the survival factor), rereading only the backends whose
        `version` moved since the last call: building all 64 rows took ~100 us a decision, and a
        decision follows at most a few changes."""
        versions = [b.version for b in self.backends]
        if versions != self._versions:
            own, seen = self._own, self._versions
            for i, (backend, version) in enumerate(zip(self.backends, versions, strict=True)):
                if version != seen[i]:
                    r = backend.reserved
                    own[:, i] = (
                        backend.in_flight + backend.remote_in_flight, r.prefill_tokens, r.prefill_seqs,
                        r.decode_seqs, r.context_tokens, r.head_tokens, r.head_since, r.head_s,
                        r.step_tokens, r.step_behind, backend.survival.factor,
                    )  # fmt: skip
            self._versions = versions
            self._kv_due = kv_due_columns([b.reserved.kv_due for b in self.backends], 0.0)
        return self._own

    def cooling(self, now: float) -> frozenset[int]:
        """Rows of the backends cooling down after backpressure (`Registry.record_backpressure`)."""
        return frozenset(i for i, b in enumerate(self.backends) if b.busy_until > now)

    def candidates(
        self, now: float, cached_tokens: np.ndarray | None = None, work: bool = True
    ) -> Candidates:
        """The routing snapshot. Without `work` (a router that does not read the work columns, see
        `Ranker.uses_work`) only the request counts are computed and the work columns are zero."""
        n = len(self.backends)
        own = self._own_rows()
        reported = self._reported_rows()
        # The one load formula, as the simulator uses it; without `work`, its request counts alone.
        if work:
            head = own[5:10]
            columns = load_columns(own[0], *reported[:2], *own[1:5], seen=reported[3:], head=head, now=now)
            rows_due, due_at = self._kv_due
            columns.update(kv_due_rows=rows_due, kv_due_s=due_at - now)
        else:
            columns = _counts_only(own[0], reported)
        return Candidates(
            specs=self.specs,
            healthy=self.routable(now),
            can_prefill=self._can_prefill,
            can_decode=self._can_decode,
            capacity=self._capacity,
            kv_usage=reported[2].copy(),
            cached_tokens=np.zeros(n, dtype=np.int64) if cached_tokens is None else cached_tokens,
            cache_survival=own[10].copy(),
            now=now,
            **columns,
        )


def _counts_only(in_flight: np.ndarray, reported: np.ndarray) -> dict[str, np.ndarray]:
    """`load_columns` for routers that read only `load` (see ModelPool.candidates)."""
    zero = np.zeros(len(in_flight))
    zeros = ("prefill_len", "decode_seqs", "context_tokens", "context_when_reported", "step_tokens",
             "step_elapsed", "step_behind")  # fmt: skip
    return {"load": request_load(in_flight, *reported[:2], in_flight_seen=reported[3]),
            "prefill_tokens": zero, **{name: zero.copy() for name in zeros}}  # fmt: skip


class Registry:
    def __init__(
        self,
        config: GatewayConfig,
        on_health_change: Callable[[BackendState, HealthEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.health_settings: Health = config.health
        self.backends = {b.id: BackendState(b) for b in config.backends}
        self.pools = {
            m.name: ModelPool(m, [self.backends[b.id] for b in config.backends_of(m.name)], config.health)
            for m in config.models
        }
        self._on_health_change = on_health_change or (lambda _state, _event: None)
        self._clock = clock

    def update_backends(
        self, configs: Sequence[BackendConfig]
    ) -> tuple[list[BackendState], list[BackendState]]:
        """Replace the set of backends (discovery, config reload); returns (added, removed).

        A backend whose configuration is unchanged keeps its state (health, load, in-flight count); a new
        or changed one starts fresh. Removed backends leave the pools at once, so they get no new request,
        while the requests holding them (open streams) finish on them.
        """
        fresh: dict[str, BackendState] = {}
        added: list[BackendState] = []
        for config in configs:
            kept = self.backends.get(config.id)
            if kept is None or kept.config != config:
                kept = BackendState(config)
                added.append(kept)
            fresh[config.id] = kept
        removed = [b for id_, b in self.backends.items() if fresh.get(id_) is not b]
        self.backends = fresh
        self.pools = {
            name: ModelPool(
                pool.model, [b for b in fresh.values() if b.config.model == name], self.health_settings
            )
            for name, pool in self.pools.items()
        }
        return added, removed

    def pool(self, model: str) -> ModelPool | None:
        return self.pools.get(model)

    def candidates(
        self, pool: ModelPool, cached_tokens: np.ndarray | None = None, work: bool = True
    ) -> Candidates:
        return pool.candidates(self._clock(), cached_tokens, work)

    def now(self) -> float:
        """The registry's clock (what `LegLoad.kv_due_s` is read against)."""
        return self._clock()

    def reserve(self, backend: BackendState, load: LegLoad) -> Reservation:
        """Hold `load` on `backend` until the reservation is released (see Reservation)."""
        return Reservation(backend, load, self._clock)

    def available(self, backend: BackendState) -> bool:
        return backend.available(self._clock())

    def in_flight_total(self) -> int:
        return sum(b.in_flight for b in self.backends.values())

    # -- passive: verdicts on real requests (attributed by gateway/retry.py) --------------------------------

    def record_success(self, backend: BackendState) -> None:
        outlier = backend.outlier
        if outlier.consecutive_5xx == 0 and outlier.ejected_until is None:
            return  # the common case, nothing to reset (a gateway failure counts toward consecutive_5xx too)
        self._record(backend, Verdict.SUCCESS)

    def record_failure(self, backend: BackendState, verdict: Verdict) -> None:
        self._record(backend, verdict)

    def cooling(self, pool: ModelPool) -> frozenset[int]:
        return pool.cooling(self._clock())

    def record_backpressure(self, backend: BackendState) -> None:
        """It answered 429/503: tried last for `health.backpressure_cooldown_s` (gateway/decision.py)."""
        backend.busy_until = self._clock() + self.health_settings.backpressure_cooldown_s

    def _record(self, backend: BackendState, verdict: Verdict) -> None:
        now = self._clock()
        outliers = self.pools[backend.config.model].outliers
        self._release(outliers, now)
        if outliers.record(backend.outlier, verdict, now):
            self._on_health_change(backend, HealthEvent.EJECTED)

    def release_due(self) -> None:
        """Bring back ejected backends whose time is over (routing already sees them back; this tells)."""
        now = self._clock()
        for pool in self.pools.values():
            self._release(pool.outliers, now)

    def _release(self, outliers: OutlierPool, now: float) -> None:
        for member in outliers.release_due(now):
            self._on_health_change(self.backends[member.key], HealthEvent.RETURNED)

    # -- active: the poller's /health probes -----------------------------------------------------------------

    def probe_result(self, backend: BackendState, ok: bool) -> None:
        if ok:
            backend.probe_failures = 0
            if not backend.probe_up:
                backend.probe_up = True
                self._on_health_change(backend, HealthEvent.PROBE_UP)
            return
        backend.probe_failures += 1
        if backend.probe_up and backend.probe_failures >= self.health_settings.failure_threshold:
            backend.probe_up = False
            self._on_health_change(backend, HealthEvent.PROBE_DOWN)

    def any_ready(self, model: str) -> bool:
        """Some backend answers its probes (ejected ones count: panic mode would route to them)."""
        return any(b.probe_up for b in self.pools[model].backends)
