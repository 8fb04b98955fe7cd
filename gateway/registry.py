"""Backends, their health, and their live load.

Health is a small circuit breaker per backend, fed by two sources:
- active: the poller's GET /health (every `health.interval_s`);
- passive: the outcome of real requests (connection errors, 5xx).
`failure_threshold` consecutive failures mark a backend down. After `recovery_s` down it is half-open:
one trial request may go through; its success (or a good probe) brings the backend back. Load is the
gateway's own in-flight count plus what vLLM's /metrics said last (polled off the request path).
Nothing here does I/O on the request path: `candidates()` only reads memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from gateway.config import BackendConfig, GatewayConfig, Health, ModelConfig
from gateway.stats import VllmLoad
from scoring.types import BackendSpec, Candidates, Role


class BackendState:
    __slots__ = (
        "config",
        "down_since",
        "failures",
        "healthy",
        "in_flight",
        "load",
        "remote_in_flight",
        "spec",
        "trial_in_flight",
        "upstream_key",
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
        self.healthy = True
        self.failures = 0
        self.down_since = 0.0
        self.trial_in_flight = False
        self.in_flight = 0
        self.remote_in_flight = 0  # other gateway processes' requests on it (gateway/replicas.py)
        self.load = VllmLoad()

    @property
    def id(self) -> str:
        return self.config.id

    def available(self, now: float, recovery_s: float) -> bool:
        """Healthy, or down long enough that one half-open trial may go through."""
        if self.healthy:
            return True
        return not self.trial_in_flight and now - self.down_since >= recovery_s


class ModelPool:
    """The backends of one model, with the arrays that never change precomputed."""

    def __init__(self, model: ModelConfig, backends: list[BackendState]) -> None:
        self.model = model
        self.backends = backends
        self.specs = tuple(b.spec for b in backends)
        self.block_sizes = tuple(sorted({b.spec.block_size for b in backends}))
        self._can_prefill = np.array([Role.PREFILL in s.roles for s in self.specs], dtype=bool)
        self._can_decode = np.array([Role.DECODE in s.roles for s in self.specs], dtype=bool)
        self._capacity = np.array([s.max_num_seqs for s in self.specs], dtype=float)

    def candidates(
        self, now: float, recovery_s: float, cached_tokens: np.ndarray | None = None
    ) -> Candidates:
        n = len(self.backends)
        return Candidates(
            specs=self.specs,
            healthy=np.fromiter((b.available(now, recovery_s) for b in self.backends), dtype=bool, count=n),
            can_prefill=self._can_prefill,
            can_decode=self._can_decode,
            load=np.fromiter(
                (
                    max(b.in_flight + b.remote_in_flight, b.load.running) + b.load.waiting
                    for b in self.backends
                ),
                dtype=float,
                count=n,
            ),
            capacity=self._capacity,
            kv_usage=np.fromiter((b.load.kv_usage for b in self.backends), dtype=float, count=n),
            cached_tokens=np.zeros(n, dtype=np.int64) if cached_tokens is None else cached_tokens,
        )


class Registry:
    def __init__(
        self,
        config: GatewayConfig,
        on_health_change: Callable[[BackendState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.health_settings: Health = config.health
        self.backends = {b.id: BackendState(b) for b in config.backends}
        self.pools = {
            m.name: ModelPool(m, [self.backends[b.id] for b in config.backends_of(m.name)])
            for m in config.models
        }
        self._on_health_change = on_health_change or (lambda _state: None)
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
            name: ModelPool(pool.model, [b for b in fresh.values() if b.config.model == name])
            for name, pool in self.pools.items()
        }
        return added, removed

    def pool(self, model: str) -> ModelPool | None:
        return self.pools.get(model)

    def candidates(self, pool: ModelPool, cached_tokens: np.ndarray | None = None) -> Candidates:
        return pool.candidates(self._clock(), self.health_settings.recovery_s, cached_tokens)

    def begin(self, backend: BackendState) -> None:
        backend.in_flight += 1
        if not backend.healthy:
            backend.trial_in_flight = True

    def end(self, backend: BackendState) -> None:
        backend.in_flight -= 1

    def record_success(self, backend: BackendState) -> None:
        backend.failures = 0
        backend.trial_in_flight = False
        if not backend.healthy:
            backend.healthy = True
            self._on_health_change(backend)

    def record_failure(self, backend: BackendState) -> None:
        backend.failures += 1
        if not backend.healthy:
            # A failed half-open trial restarts the recovery wait.
            backend.trial_in_flight = False
            backend.down_since = self._clock()
        elif backend.failures >= self.health_settings.failure_threshold:
            backend.healthy = False
            backend.down_since = self._clock()
            self._on_health_change(backend)

    def any_ready(self, model: str) -> bool:
        pool = self.pools[model]
        return any(b.healthy for b in pool.backends)
