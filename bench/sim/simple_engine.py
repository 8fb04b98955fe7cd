"""SimpleEngine: fixed-cost timing for functional tests of the simulated vLLM backend.

Timing (simulated seconds, divided by `time_scale` to get wall seconds):
  TTFT  = ttft_base_s + prefill_token_s * (prompt tokens not served from cache)
          (+ kv_transfer_token_s per token pulled from a prefiller, on a decode server)
  each further token = tpot_s
No batching model: requests run independently, at most `max_num_seqs` at once (the rest wait).

What is real, because the gateway's routing depends on it:
  * a block-level prefix cache (chained 64-bit block hashes over full blocks, LRU over
    `num_gpu_blocks`), so `num_cached_tokens`, prefix hit metrics and KV events are true;
  * cached tokens are block-granular and never cover the last prompt token (vLLM recomputes it);
  * prefill-only requests (P/D) keep their KV blocks pinned until the decoder pulls them
    (`release_kv`) or the lease (`kv_lease_s`) expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.sim.engine_api import EngineStats, KVEventSink, SimRequest, TokenOutput


@dataclass(slots=True)
class SimpleEngineConfig:
    ttft_base_s: float = 0.005
    prefill_token_s: float = 0.00002
    tpot_s: float = 0.002
    kv_transfer_token_s: float = 0.000002
    time_scale: float = 1.0  # simulated seconds per wall second
    block_size: int = 16
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    kv_lease_s: float = 30.0  # simulated seconds a prefiller keeps KV for an unpulled transfer
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    first_token_id: int = 128  # generated ids are drawn from [first_token_id, first_token_id + num_token_ids)
    num_token_ids: int = 30000


def block_hashes(token_ids: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained u64 hashes of the full blocks of `token_ids` (the partial tail is not hashed)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        payload = (parent or 0).to_bytes(8, "big") + array(
            "I", token_ids[start : start + block_size]
        ).tobytes()
        parent = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")
        hashes.append(parent)
    return hashes


class PrefixCache:
    """LRU map of block hash -> present, producing vLLM's map-shaped KV events."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[int]) -> int:
        """Number of leading blocks present; touches them so they are evicted last."""
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            matched += 1
        return matched

    def insert(self, hashes: list[int], token_ids: list[int], reserved_blocks: int) -> list[dict[str, Any]]:
        """Cache the blocks of `hashes` not yet present; evict LRU blocks beyond capacity.
        `reserved_blocks` are blocks pinned by running or transferring requests, unavailable to the cache."""
        first_new = self.match(hashes)
        new_hashes = hashes[first_new:]
        if not new_hashes:
            return []
        for block_hash in new_hashes:
            self._blocks[block_hash] = None
        events = self._evict(max(0, self.capacity_blocks - reserved_blocks), keep=set(hashes))
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": new_hashes,
                "parent_block_hash": hashes[first_new - 1] if first_new else None,
                "token_ids": token_ids[first_new * self.block_size : len(hashes) * self.block_size],
                "block_size": self.block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None] * len(new_hashes),
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        )
        return events

    def _evict(self, limit: int, keep: set[int]) -> list[dict[str, Any]]:
        """Drop least recently used blocks (never those in `keep`) until at most `limit` remain."""
        excess = len(self._blocks) - limit
        if excess <= 0:
            return []
        victims: list[int] = []
        for block_hash in self._blocks:  # oldest first; stops as soon as enough are found
            if len(victims) == excess:
                break
            if block_hash not in keep:
                victims.append(block_hash)
        for block_hash in victims:
            del self._blocks[block_hash]
        return [
            {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU", "group_idx": 0}
            for block_hash in victims
        ]

    def clear(self) -> None:
        self._blocks.clear()


@dataclass(slots=True)
class _HeldTransfer:
    blocks: int
    expires_at: float  # engine clock


class SimpleEngine:
    """Fixed-delay implementation of `bench.sim.engine_api.Engine`; see the module docstring."""

    def __init__(
        self,
        config: SimpleEngineConfig | None = None,
        kv_events: KVEventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        # `clock` and `sleep` are the engine's notion of wall time; tests pass a manual clock.
        self._clock, self._sleep = clock, sleep
        self.config = config or SimpleEngineConfig()
        self._kv_events = kv_events
        self._cache = PrefixCache(self.config.block_size, self.config.num_gpu_blocks)
        self._stats = EngineStats(
            block_size=self.config.block_size, num_gpu_blocks=self.config.num_gpu_blocks
        )
        self._running_blocks: dict[str, int] = {}
        self._held: dict[str, _HeldTransfer] = {}
        self._pending_events: list[dict[str, Any]] = []
        self._slots: asyncio.Semaphore | None = None
        self._next_block_id = 1
        self._lease_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.config.max_num_seqs)
        self._lease_task = asyncio.create_task(self._expire_leases_forever())

    async def stop(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_task

    def stats(self) -> EngineStats:
        self._expire_leases()
        stats = self._stats
        stats.num_requests_running = len(self._running_blocks)
        held_blocks = sum(held.blocks for held in self._held.values())
        stats.kv_held_for_transfer_blocks = held_blocks
        used = sum(self._running_blocks.values()) + held_blocks
        stats.kv_cache_usage_perc = min(1.0, used / self.config.num_gpu_blocks)
        return stats

    def reset_prefix_cache(self) -> bool:
        self._cache.clear()
        # vLLM publishes AllBlocksCleared with the next engine step, not at the reset itself.
        self._pending_events.append({"type": "AllBlocksCleared"})
        return True

    def release_kv(self, request_id: str) -> bool:
        """The decoder pulled the KV of prefill request `request_id`: unpin its blocks.
        (An extension of the Engine protocol, called by the server's /sim/kv_pull endpoint.)"""
        return self._held.pop(request_id, None) is not None

    async def generate(self, request: SimRequest) -> AsyncGenerator[TokenOutput, None]:
        assert self._slots is not None, "SimpleEngine.start() was not awaited"
        self._stats.num_requests_waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._stats.num_requests_waiting -= 1
        try:
            started = self._clock()
            hashes, cached, ttft = await self._prefill(request, started)
            reported_cached = _reported_cached_tokens(request, cached)
            # One flat loop: this is the per-token hot path of every simulated request.
            config, stats, running, rid = self.config, self._stats, self._running_blocks, request.request_id
            tokens = output_token_ids(request.seed, config.first_token_id, config.num_token_ids)
            first_wall, tpot_wall = started + ttft / config.time_scale, config.tpot_s / config.time_scale
            context_len, output_ids = len(request.prompt_token_ids), []
            max_tokens = 1 if request.prefill_only else max(1, request.max_tokens)
            for index in range(max_tokens - 1):
                token_id = next(tokens)
                output_ids.append(token_id)
                stats.generation_tokens += 1
                context_len += 1
                running[rid] = -(-context_len // config.block_size)
                yield TokenOutput(token_id, num_cached_tokens=reported_cached)
                if tpot_wall > 0:
                    await self._sleep_until(first_wall + tpot_wall * (index + 1))
            output_ids.append(next(tokens))
            stats.generation_tokens += 1
            self._cache_generated_blocks(request.prompt_token_ids + output_ids, hashes)
            held = self._hold_for_transfer(request, cached) if request.prefill_only else None
            yield TokenOutput(output_ids[-1], "length", reported_cached, held)
        finally:
            self._running_blocks.pop(request.request_id, None)
            self._slots.release()

    async def _prefill(self, request: SimRequest, started: float) -> tuple[list[int], int, float]:
        """Look up and account the prompt, wait its TTFT, cache its blocks: (hashes, cached, ttft_s)."""
        config = self.config
        prompt = request.prompt_token_ids
        hashes = block_hashes(prompt, config.block_size)
        cached, transferred = self._account_prompt(request, hashes)
        self._running_blocks[request.request_id] = _blocks_for(len(prompt) + 1, config.block_size)
        ttft = (
            config.ttft_base_s
            + config.prefill_token_s * (len(prompt) - cached - transferred)
            + config.kv_transfer_token_s * transferred
        )
        await self._sleep_until(started + ttft / config.time_scale)
        self._publish(self._cache.insert(hashes, prompt, self._reserved_blocks()))
        return hashes, cached, ttft

    def _account_prompt(self, request: SimRequest, hashes: list[int]) -> tuple[int, int]:
        """Count prompt tokens by source; returns (locally cached, pulled from a prefiller)."""
        prompt_len = len(request.prompt_token_ids)
        # The last prompt token is always computed, so a full hit stops one block short.
        max_cached_blocks = (prompt_len - 1) // self.config.block_size
        cached = self._cache.match(hashes[:max_cached_blocks]) * self.config.block_size
        transferred = prompt_len - cached if _has_remote_kv(request) else 0
        stats = self._stats
        stats.prompt_tokens += prompt_len
        stats.prefix_cache_queries += prompt_len
        stats.prefix_cache_hits += cached
        stats.prompt_tokens_by_source["local_cache_hit"] += cached
        stats.prompt_tokens_by_source["external_kv_transfer"] += transferred
        stats.prompt_tokens_by_source["local_compute"] += prompt_len - cached - transferred
        return cached, transferred

    def _hold_for_transfer(self, request: SimRequest, cached: int) -> dict[str, Any]:
        config = self.config
        num_blocks = _blocks_for(len(request.prompt_token_ids), config.block_size)
        block_ids = list(range(self._next_block_id, self._next_block_id + num_blocks))
        self._next_block_id += num_blocks
        lease_wall_s = config.kv_lease_s / config.time_scale
        self._held[request.request_id] = _HeldTransfer(num_blocks, self._clock() + lease_wall_s)
        # NIXL pull-mode shape (vLLM 0.32); the server fills remote_host/remote_port with its own address.
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": config.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": None,
            "remote_port": None,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(request.prompt_token_ids),
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached,
        }

    def _cache_generated_blocks(self, all_token_ids: list[int], prompt_hashes: list[int]) -> None:
        """vLLM caches full blocks of prompt + output; multi-turn chats then hit the previous answer."""
        size = self.config.block_size
        parent = prompt_hashes[-1] if prompt_hashes else None
        rest = block_hashes(all_token_ids[len(prompt_hashes) * size :], size, parent)
        if not rest:
            return
        hashes = prompt_hashes + rest
        self._publish(self._cache.insert(hashes, all_token_ids, self._reserved_blocks()))

    def _reserved_blocks(self) -> int:
        return sum(self._running_blocks.values()) + sum(held.blocks for held in self._held.values())

    def _publish(self, events: list[dict[str, Any]]) -> None:
        if self._pending_events:
            events = self._pending_events + events
            self._pending_events = []
        if events and self._kv_events is not None:
            self._kv_events.publish(events)

    def _expire_leases(self) -> None:
        now = self._clock()
        for request_id in [rid for rid, held in self._held.items() if held.expires_at <= now]:
            del self._held[request_id]

    async def _expire_leases_forever(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            self._expire_leases()

    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - self._clock()
        if delay > 0:
            await self._sleep(delay)


_U64 = (1 << 64) - 1


def output_token_ids(seed: int, first_id: int, count: int) -> Iterator[int]:
    """Endless deterministic token ids in [first_id, first_id + count) (SplitMix64: cheaper to start
    than random.Random, which matters at one generator per request)."""
    state = seed & _U64
    while True:
        state = (state + 0x9E3779B97F4A7C15) & _U64
        mixed = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _U64
        yield first_id + (mixed ^ (mixed >> 31)) % count


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _has_remote_kv(request: SimRequest) -> bool:
    params = request.remote_prefill
    return bool(params and params.get("do_remote_prefill") and params.get("remote_engine_id"))


def _reported_cached_tokens(request: SimRequest, cached: int) -> int:
    """vLLM overwrites a decoder's cached_tokens with the prefiller's `remote_prefill_cached_tokens`."""
    if _has_remote_kv(request):
        return int(request.remote_prefill.get("remote_prefill_cached_tokens") or 0)  # type: ignore[union-attr]
    return cached
