"""Prefix affinity on the request path: hash the prompt, ask the index what each backend holds, and after
routing record what the chosen backends now hold (approximate mode).

One awaited index call per distinct block size among the model's backends (in practice one); the record
is fire-and-forget so it never adds to the request's latency. The index is a hint: `GuardedIndex` turns
timeouts and errors into "nothing cached".
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import numpy as np

from gateway.metrics import GatewayMetrics
from gateway.registry import BackendState, ModelPool
from gateway.schemas import ParsedRequest
from scoring.types import RequestFeatures

if TYPE_CHECKING:
    from kvindex.base import PrefixIndex
    from kvindex.prompt import PromptHasher


class Affinity:
    def __init__(
        self,
        index: PrefixIndex,
        hashers: dict[str, PromptHasher],
        tenant_header: str | None,
        precise_backends: set[str] | frozenset[str] = frozenset(),
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.index = index
        self.hashers = hashers
        # Backends whose KV events feed the index: their entries are exactly what vLLM reports, so the
        # gateway does not add guesses of its own.
        self.precise_backends = frozenset(precise_backends)
        self.tenant_header = tenant_header.lower().encode() if tenant_header else None
        self._pending: set[asyncio.Task[None]] = set()
        self.metrics = metrics

    async def lookup(
        self, request: ParsedRequest, pool: ModelPool, headers: dict[bytes, bytes]
    ) -> tuple[RequestFeatures, np.ndarray]:
        started = time.perf_counter()
        tenant_raw = headers.get(self.tenant_header) if self.tenant_header else None
        tenant = tenant_raw.decode("latin-1") if tenant_raw else None
        tokens, hashes = self.hashers[request.model].features(request.body, request.kind.value, tenant)
        cached = np.zeros(len(pool.backends), dtype=np.int64)
        for block_size, block_hashes in hashes.items():
            rows = [i for i, b in enumerate(pool.backends) if b.spec.block_size == block_size]
            ids = [pool.backends[i].id for i in rows]
            counts = await self.index.match(request.model, block_size, block_hashes, ids)
            cached[rows] = np.asarray(counts, dtype=np.int64) * block_size
        np.minimum(cached, tokens, out=cached)  # the last block may reach past the estimate
        if self.metrics is not None:
            self._observe(request.model, started, tokens, int(cached.max(initial=0)))
        features = RequestFeatures(request.model, tokens, request.max_tokens, request.stream, hashes)
        return features, cached

    def _observe(self, model: str, started: float, tokens: int, matched: int) -> None:
        metrics = self.metrics
        assert metrics is not None
        metrics.index_lookup.labels(model).observe(time.perf_counter() - started)
        metrics.index_prompt_tokens.labels(model).inc(tokens)
        metrics.index_matched_tokens.labels(model).inc(matched)

    def record(
        self, request: ParsedRequest, pool: ModelPool, features: RequestFeatures, served: list[BackendState]
    ) -> None:
        for backend in served:
            if backend.id in self.precise_backends:
                continue
            hashes = features.block_hashes.get(backend.spec.block_size)
            if hashes is not None and len(hashes):
                task = asyncio.create_task(
                    self.index.record(request.model, backend.spec.block_size, hashes, backend.id)
                )
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    async def drain(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
