"""The seam between the simulated vLLM HTTP server and the engine that decides timing.

The HTTP layer (`bench/sim/http_server.py`) turns an OpenAI request into a `SimRequest`, iterates
`Engine.generate` and renders vLLM's JSON/SSE from the `TokenOutput`s. The engine owns all timing,
batching, prefix caching and KV bookkeeping. Two engines implement it: `SimpleEngine` (fixed
per-token delays, for functional tests) and the cost-model scheduler (`bench/sim/scheduler.py`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # P/D: True when kv_transfer_params.do_remote_decode is set (this server is the prefiller):
    # compute the prompt, emit one token, then hold the KV until pulled or the lease expires.
    prefill_only: bool = False
    # P/D: kv_transfer_params given to a decode server (from the prefiller's response), else None.
    remote_prefill: dict[str, Any] | None = None
    # Output tokens are drawn deterministically from this seed (same prompt -> same output).
    seed: int = 0


@dataclass(slots=True)
class TokenOutput:
    """One generated token; the last one of a request has `finish_reason` set."""

    token_id: int
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served from cache (local prefix hit or remote KV)
    # Only on the final output of a prefill-only request: the kv_transfer_params to return.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class EngineStats:
    """What /metrics reports, with vLLM's meaning for each field."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0  # 0..1
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens_by_source: dict[str, int] = field(
        default_factory=lambda: {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
    )
    kv_held_for_transfer_blocks: int = 0  # P/D: blocks pinned on a prefiller awaiting pull
    block_size: int = 16
    num_gpu_blocks: int = 0


class Engine(Protocol):
    def generate(self, request: SimRequest) -> AsyncGenerator[TokenOutput, None]:
        """Yield each token when the simulated clock produces it; raises nothing on client abort:
        the caller closes the iterator (aclose) and the engine frees the request."""
        ...

    def stats(self) -> EngineStats: ...

    def reset_prefix_cache(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class KVEventSink(Protocol):
    """Receives the KV-cache events of one engine step, as vLLM's map-shaped event dicts
    (`{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
    "block_size": n, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None}`,
    `{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}`, `{"type": "AllBlocksCleared"}`).
    The ZMQ publisher in `bench/sim/kv_events.py` frames them as vLLM does (topic, seq, msgpack batch)."""

    def publish(self, events: list[dict[str, Any]]) -> None: ...
