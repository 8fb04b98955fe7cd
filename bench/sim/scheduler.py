"""A vLLM-V1-like continuous-batching scheduler whose step times come from the roofline (`scoring/cost.py`).

`SchedulerCore` is pure and clock-driven: `step(now)` picks one batch, advances every request in it, and
returns what the batch produced together with the simulated time the step ends. Nothing here sleeps or
awaits, so the discrete-event simulator (`bench/sim/des.py`) drives it directly; `CostModelEngine` wraps it
in asyncio (with `time_scale` simulated seconds per wall second) to implement `bench.sim.engine_api.Engine`
for the HTTP server.

What it reproduces of vLLM V1 (`vllm/v1/core/sched/scheduler.py`), because routing results depend on it:

* **One token budget per step** (`max_num_batched_tokens`), at most `max_num_seqs` running. Running requests
  are served first (a decode takes 1 token, an unfinished prefill takes a chunk of what is left), then
  waiting requests are admitted in FIFO order while budget, sequence slots and KV blocks last. Chunked
  prefill thus shares steps with decodes, and a step's time is `cost.step_time(prefill tokens, decode
  batch)`: a big chunk slows every decode in its step (the interference P/D disaggregation removes).
* **KV cache in blocks** of `block_size` tokens. A request that needs a block when none is free preempts
  the most recently admitted running request (recompute: its blocks are freed and it goes back to the
  front of the queue). A waiting request is admitted only if its blocks fit, else it queues.
* **Prefix caching**: full prompt blocks are registered under chained hashes when computed; a new request
  reuses the longest run of leading cached blocks (never the last prompt token, which vLLM recomputes).
  Freed blocks keep their hash and sit in an LRU free queue (a request's tail blocks first), evicted only
  when allocation needs them; evictions and registrations go to a `KVEventSink` as vLLM's event maps.
* **P/D**: a `prefill_only` request computes its prompt, emits one token and keeps its blocks
  (`kv_held_for_transfer_blocks`) until `release_kv` (the decoder pulled) or the lease expires. A request
  with `remote_kv_tokens` allocates its blocks, waits `kv_transfer_s` (WAITING_FOR_REMOTE_KVS) and then
  computes only the rest of its prompt; those tokens count as `external_kv_transfer`.

Simplifications: generated tokens' blocks are not hashed into the prefix cache, there is no
`max_model_len`, and a step's outputs become visible when the step ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.sim.engine_api import EngineStats, KVEventSink, SimRequest, TokenOutput
from scoring.catalog import Accelerator, ModelSpec
from scoring.cost import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Hardware,
    ScalarStepTime,
    kv_capacity_tokens,
    kv_transfer_time,
)

_WAITING, _TRANSFERRING, _RUNNING, _HELD, _DONE = range(5)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_gpu_blocks: int = 16384
    enable_prefix_caching: bool = True
    kv_lease_s: float = 30.0  # vLLM's kv_lease_duration: a prefiller frees unpulled KV after this
    # False: only first and last tokens produce a RequestEvent (the DES needs no more); `StepOutput.tokens`
    # still counts every token.
    emit_every_token: bool = True


@dataclass(slots=True)
class EngineRequest:
    """What the scheduler needs to know about one request (token ids only if KV events are wanted)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    block_hashes: Sequence[int] = ()  # chained hashes of the full prompt blocks, at this engine's block size
    prompt_token_ids: Sequence[int] | None = None
    prefill_only: bool = False
    remote_kv_tokens: int = 0  # P/D decode: prompt tokens whose KV a prefiller computed
    kv_transfer_s: float = 0.0  # P/D decode: how long pulling that KV takes once blocks are allocated


@dataclass(slots=True)
class RequestEvent:
    """One request's result of one step: a token (or none, mid-prefill) and whether it finished."""

    request_id: str
    first_token: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_output_tokens: int = 0  # tokens of this request generated so far, this one included


@dataclass(slots=True)
class StepOutput:
    start_s: float
    end_s: float
    events: list[RequestEvent]
    prefill_tokens: int = 0
    decode_batch: int = 0
    # P/D decode: requests whose remote KV arrived by `start_s` (their prefiller may free it now).
    kv_pulled: list[str] = field(default_factory=list)
    tokens: int = 0  # tokens generated in this step (all requests, prefill-only legs included)

    @property
    def idle(self) -> bool:
        return self.end_s <= self.start_s


class StepTimer:
    """Times one backend's steps with `scoring.cost.step_time` (scalars in, float out)."""

    def __init__(
        self, model: ModelSpec, hardware: Hardware, efficiency: Efficiency = DEFAULT_EFFICIENCY
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.efficiency = efficiency
        self._step_s = ScalarStepTime(model, hardware, efficiency)

    @classmethod
    def for_accelerator(
        cls,
        model: ModelSpec,
        accelerator: Accelerator,
        gpus: int,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
    ) -> StepTimer:
        return cls(model, Hardware.of([accelerator], [gpus], model.compute_dtype), efficiency)

    def __call__(
        self, prefill_tokens: int, prefill_pairs: float, decode_batch: int, decode_context: int
    ) -> float:
        return self._step_s(prefill_tokens, prefill_pairs, decode_batch, decode_context)

    def kv_capacity_blocks(self, block_size: int) -> int:
        return int(kv_capacity_tokens(self.model, self.hardware, self.efficiency)[0]) // block_size

    def transfer_s(self, tokens: int, source: Hardware | None = None) -> float:
        src = self.hardware if source is None else source
        return float(kv_transfer_time(self.model, src, self.hardware, tokens, self.efficiency)[0])


class _Req:
    __slots__ = (
        "admitted_once",
        "blocks",
        "cached_tokens",
        "computed",
        "hashed_blocks",
        "held_until",
        "num_hashes",
        "outputs",
        "prompt_len",
        "ready_at",
        "spec",
        "state",
    )

    def __init__(self, spec: EngineRequest) -> None:
        self.spec = spec
        self.prompt_len = spec.prompt_len
        self.num_hashes = len(spec.block_hashes)
        self.state = _WAITING
        self.computed = 0  # tokens whose KV is in cache
        self.outputs = 0  # tokens generated so far
        self.blocks: list[int] = []
        self.hashed_blocks = 0  # leading prompt blocks registered in (or taken from) the prefix cache
        self.cached_tokens = 0  # prompt tokens served without local compute (prefix hit + remote KV)
        self.ready_at = 0.0
        self.held_until = 0.0
        self.admitted_once = False

    @property
    def known(self) -> int:
        return self.spec.prompt_len + self.outputs


class BlockPool:
    """KV blocks with reference counts, a hash -> block map and an LRU queue of free blocks."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool, emit_events: bool = True) -> None:
        self.block_size = block_size
        self.caching = caching
        self.emit_events = emit_events  # without a sink nobody reads the events: skip building them
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        # Blocks never used yet are handed out first, in order (as from vLLM's initial free queue), without
        # building a queue of them up front; freed blocks join `free` in LRU order.
        self.num_blocks = num_blocks
        self.next_fresh = 0
        self.free: OrderedDict[int, None] = OrderedDict()
        self.events: list[dict[str, Any]] = []

    @property
    def num_free(self) -> int:
        return len(self.free) + self.num_blocks - self.next_fresh

    def lookup(self, hashes: Sequence[int], limit: int) -> list[int]:
        """Blocks holding the longest cached run of `hashes[:limit]`."""
        found: list[int] = []
        if not self.caching:
            return found
        for h in hashes[:limit]:
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1

    def allocate(self, n: int) -> list[int]:
        fresh = min(n, self.num_blocks - self.next_fresh)
        blocks = list(range(self.next_fresh, self.next_fresh + fresh))
        self.next_fresh += fresh
        for block in blocks:
            self.ref[block] = 1
        evicted = []
        free, hash_of, by_hash, ref = self.free, self.hash_of, self.by_hash, self.ref
        for _ in range(n - fresh):
            block, _unused = free.popitem(last=False)
            old = hash_of[block]
            if old is not None:
                del by_hash[old]
                hash_of[block] = None
                evicted.append(old)
            ref[block] = 1
            blocks.append(block)
        if evicted and self.emit_events:
            self.events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        return blocks

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first: the end of a prompt is the least likely to be shared, so it is evicted first.
        ref, free = self.ref, self.free
        for block in reversed(blocks):
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None

    def register(self, block: int, block_hash: int) -> bool:
        if not self.caching or block_hash in self.by_hash or self.hash_of[block] is not None:
            return False
        self.by_hash[block_hash] = block
        self.hash_of[block] = block_hash
        return True

    def clear_hashes(self) -> bool:
        if any(self.ref):
            return False
        self.by_hash.clear()
        self.hash_of = [None] * len(self.hash_of)
        self.events.append({"type": "AllBlocksCleared"})
        return True


@dataclass(slots=True)
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    by_source: dict[str, int] = field(
        default_factory=lambda: {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
    )


class SchedulerCore:
    """The clock-driven engine core: `add_request`, then `step(now)` repeatedly while `has_work()`."""

    def __init__(self, config: SchedulerConfig, timer: StepTimer, sink: KVEventSink | None = None) -> None:
        self.config = config
        self.timer = timer
        self.sink = sink
        self.pool = BlockPool(
            config.num_gpu_blocks,
            config.block_size,
            config.enable_prefix_caching,
            emit_events=sink is not None,
        )
        self.waiting: deque[_Req] = deque()
        self.transferring: list[_Req] = []
        self.running: list[_Req] = []
        self.held: dict[str, _Req] = {}
        self.requests: dict[str, _Req] = {}
        self.counters = _Counters()

    # --- requests in and out -------------------------------------------------------------------------
    def add_request(self, spec: EngineRequest) -> None:
        if self._blocks_for(spec.prompt_len + spec.max_tokens) > self.config.num_gpu_blocks:
            raise ValueError(f"request of {spec.prompt_len}+{spec.max_tokens} tokens exceeds the KV cache")
        if spec.prompt_len < 1 or spec.max_tokens < 1:
            raise ValueError("prompt_len and max_tokens must be at least 1")
        # The decoder always computes at least the last prompt token itself.
        spec.remote_kv_tokens = min(spec.remote_kv_tokens, spec.prompt_len - 1)
        req = _Req(spec)
        self.requests[spec.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for queue in (self.running, self.transferring):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.held.pop(request_id, None)
        self._free(req)

    def release_kv(self, request_id: str) -> bool:
        """The decoder pulled a prefill-only request's KV: unpin its blocks (False if not held)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.requests.pop(request_id, None)
        self._free(req)
        return True

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.clear_hashes()
        self._flush_events()
        return ok

    # --- scheduling ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_wakeup(self) -> float | None:
        """When something not yet runnable becomes so (a KV transfer ends, a lease expires)."""
        times = [r.ready_at for r in self.transferring] + [r.held_until for r in self.held.values()]
        return min(times) if times else None

    def step(self, now: float) -> StepOutput:
        if self.held:
            self._expire_leases(now)
        pulled = self._finish_transfers(now)
        batch = self._schedule(now)
        if not batch:
            self._flush_events()
            return StepOutput(now, now, [], kv_pulled=pulled)
        return self._run_batch(now, batch, pulled)

    def _run_batch(self, now: float, batch: list[tuple[_Req, int]], pulled: list[str]) -> StepOutput:
        """Time the batch and advance every request in it, in one pass (this loop is the simulator's
        per-token cost)."""
        prefill_tokens = decode_batch = decode_context = tokens = 0
        prefill_pairs = 0.0
        events: list[RequestEvent] = []
        emit = events.append
        held: list[_Req] = []
        left = False
        every = self.config.emit_every_token
        bs = self.config.block_size
        for req, n in batch:
            before = req.computed
            if n == 1 and before >= req.prompt_len:
                decode_batch += 1
                decode_context += before + 1
            else:
                prefill_tokens += n
                prefill_pairs += n * before + n * (n + 1) / 2  # causal pairs, as cost.causal_pairs
            computed = req.computed = before + n
            if req.hashed_blocks < req.num_hashes and computed // bs > req.hashed_blocks:
                self._register_blocks(req)
            if computed < req.prompt_len + req.outputs:
                continue
            outputs = req.outputs = req.outputs + 1
            tokens += 1
            spec = req.spec
            if spec.prefill_only:
                emit(self._hold(req))
                held.append(req)
                left = True
            elif outputs >= spec.max_tokens:
                self._finish(req)
                left = True
                emit(RequestEvent(spec.request_id, outputs == 1, "length", req.cached_tokens, outputs))
            elif every or outputs == 1:
                emit(RequestEvent(spec.request_id, outputs == 1, None, req.cached_tokens, outputs))
        end = now + self.timer(prefill_tokens, prefill_pairs, decode_batch, decode_context)
        for req in held:
            req.held_until = end + self.config.kv_lease_s
        self.counters.generation_tokens += tokens
        if left:
            self.running = [r for r in self.running if r.state == _RUNNING]
        self._flush_events()
        return StepOutput(now, end, events, prefill_tokens, decode_batch, pulled, tokens)

    def _finish(self, req: _Req) -> None:
        self.requests.pop(req.spec.request_id, None)
        self._free(req)
        req.state = _DONE

    def _schedule(self, now: float) -> list[tuple[_Req, int]]:
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[_Req, int]] = []
        preempted = False
        i = 0
        running, bs = self.running, self.config.block_size  # `_grow` pops from this same list
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.prompt_len + req.outputs - req.computed
            if n > budget:
                n = budget
            if req.computed + n > len(req.blocks) * bs and not self._grow(req, n):
                preempted = True
                if req not in running:  # it preempted itself
                    continue
            batch.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(now, budget, batch)
        return batch

    def _grow(self, req: _Req, n: int) -> bool:
        """Give `req` blocks for `n` more tokens, preempting from the back of `running` if needed."""
        need = self._blocks_for(req.computed + n) - len(req.blocks)
        clean = True
        while need > self.pool.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            clean = False
            if victim is req:
                return False
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        return clean

    def _admit(self, now: float, budget: int, batch: list[tuple[_Req, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self._prefix_hit(req)
            hit = len(cached)
            start = max(
                hit * self.config.block_size, req.spec.remote_kv_tokens if not req.admitted_once else 0
            )
            remote = req.spec.remote_kv_tokens > 0 and not req.admitted_once
            target = req.spec.prompt_len if remote else min(req.known, start + budget)
            need = self._blocks_for(target) - hit
            # Cached blocks nobody uses sit in the free queue: taking them shrinks it too.
            if need + sum(1 for block in cached if self.pool.ref[block] == 0) > self.pool.num_free:
                break
            self.waiting.popleft()
            self.pool.touch(cached)
            req.blocks = cached + self.pool.allocate(need)
            req.hashed_blocks = hit
            req.computed = start
            self._count_admission(req, hit, remote)
            if remote:
                req.state = _TRANSFERRING
                req.ready_at = now + req.spec.kv_transfer_s
                self.transferring.append(req)
                continue
            req.state = _RUNNING
            self.running.append(req)
            n = target - start
            batch.append((req, n))
            budget -= n
        return budget

    def _prefix_hit(self, req: _Req) -> list[int]:
        # Never the whole prompt: vLLM always computes at least the last prompt token.
        limit = (req.known - 1) // self.config.block_size
        return self.pool.lookup(req.spec.block_hashes, limit)

    def _count_admission(self, req: _Req, hit: int, remote: bool) -> None:
        if req.admitted_once:
            return
        req.admitted_once = True
        c = self.counters
        hit_tokens = hit * self.config.block_size
        remote_tokens = max(0, req.spec.remote_kv_tokens - hit_tokens) if remote else 0
        req.cached_tokens = hit_tokens + remote_tokens
        c.prompt_tokens += req.spec.prompt_len
        c.prefix_queries += req.spec.prompt_len
        c.prefix_hits += hit_tokens
        c.by_source["local_cache_hit"] += hit_tokens
        c.by_source["external_kv_transfer"] += remote_tokens
        c.by_source["local_compute"] += req.spec.prompt_len - hit_tokens - remote_tokens

    def _hold(self, req: _Req) -> RequestEvent:
        req.state = _HELD
        self.held[req.spec.request_id] = req
        return RequestEvent(req.spec.request_id, True, "length", req.cached_tokens, 1)

    def _register_blocks(self, req: _Req) -> None:
        full = min(req.computed // self.config.block_size, len(req.spec.block_hashes))
        if full <= req.hashed_blocks:
            return
        hashes = req.spec.block_hashes
        pool, blocks = self.pool, req.blocks
        if not pool.caching:
            req.hashed_blocks = full
            return
        by_hash, hash_of = pool.by_hash, pool.hash_of
        stored = []
        for j in range(req.hashed_blocks, full):
            # Inline BlockPool.register: this loop runs for every prompt block of every request.
            h, block = hashes[j], blocks[j]
            if h not in by_hash and hash_of[block] is None:
                by_hash[h] = block
                hash_of[block] = h
                stored.append(j)
        if stored and self.sink is not None:
            # One event per run of consecutive blocks, so each carries its own parent and token ids.
            run = [stored[0]]
            for j in stored[1:]:
                if j != run[-1] + 1:
                    self._stored_event(req, run)
                    run = []
                run.append(j)
            self._stored_event(req, run)
        req.hashed_blocks = full

    def _stored_event(self, req: _Req, indices: list[int]) -> None:
        bs = self.config.block_size
        hashes = req.spec.block_hashes
        first, last = indices[0], indices[-1] + 1
        tokens = req.spec.prompt_token_ids
        self.pool.events.append(
            {
                "type": "BlockStored",
                "block_hashes": [hashes[j] for j in indices],
                "parent_block_hash": hashes[first - 1] if first else None,
                "token_ids": list(tokens[first * bs : last * bs]) if tokens is not None else [],
                "block_size": bs,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": None,
            }
        )

    def _preempt(self, req: _Req) -> None:
        self.counters.preemptions += 1
        self._free(req)
        req.computed = 0
        req.hashed_blocks = 0
        req.state = _WAITING
        self.waiting.appendleft(req)

    def _free(self, req: _Req) -> None:
        if req.blocks:
            self.pool.release(req.blocks)
            req.blocks = []

    def _expire_leases(self, now: float) -> None:
        for request_id in [rid for rid, r in self.held.items() if r.held_until <= now]:
            self.release_kv(request_id)

    def _finish_transfers(self, now: float) -> list[str]:
        if not self.transferring:
            return []
        still, pulled = [], []
        for req in self.transferring:
            if req.ready_at <= now:
                req.state = _RUNNING
                self.running.append(req)
                pulled.append(req.spec.request_id)
            else:
                still.append(req)
        self.transferring = still
        return pulled

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _flush_events(self) -> None:
        if self.pool.events:
            if self.sink is not None:
                self.sink.publish(self.pool.events)
            self.pool.events = []

    # --- what /metrics and the router see ------------------------------------------------------------
    def stats(self) -> EngineStats:
        c = self.counters
        total = self.config.num_gpu_blocks
        return EngineStats(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting) + len(self.transferring),
            kv_cache_usage_perc=(total - self.pool.num_free) / total,
            prefix_cache_queries=c.prefix_queries,
            prefix_cache_hits=c.prefix_hits,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            num_preemptions=c.preemptions,
            prompt_tokens_by_source=dict(c.by_source),
            kv_held_for_transfer_blocks=sum(len(r.blocks) for r in self.held.values()),
            block_size=self.config.block_size,
            num_gpu_blocks=total,
        )

    def cached_prefix_tokens(self, block_hashes: Sequence[int]) -> int:
        """Leading tokens of a prompt with these hashes that this engine's prefix cache holds now."""
        return len(self.pool.lookup(block_hashes, len(block_hashes))) * self.config.block_size


@dataclass(frozen=True, slots=True)
class CostEngineConfig:
    time_scale: float = 1.0  # simulated seconds per wall second
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    first_token_id: int = 128  # generated ids are drawn from [first_token_id, first_token_id + num_token_ids)
    num_token_ids: int = 30000
    kv_host: str = "localhost"
    kv_port: int = 5600


class CostModelEngine:
    """`Engine` for the HTTP server: runs `SchedulerCore` against the wall clock (scaled by `time_scale`).

    One background task loops: take a step at the current simulated time, sleep until the step's end, then
    hand each request its token. Requests added during a step join the next one, as in vLLM.
    """

    def __init__(
        self,
        core: SchedulerCore,
        config: CostEngineConfig | None = None,
        block_hasher: Callable[[list[int], int], list[int]] | None = None,
    ) -> None:
        self.core = core
        self.config = config or CostEngineConfig()
        self._hasher = block_hasher or chained_block_hashes
        self._queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._rngs: dict[str, random.Random] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self._task = loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def stats(self) -> EngineStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def release_kv(self, request_id: str) -> bool:
        return self.core.release_kv(request_id)

    async def generate(self, request: SimRequest) -> AsyncGenerator[TokenOutput, None]:
        if self._task is None or self._task.done():
            raise RuntimeError("the cost engine is not running")
        rid = request.request_id
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._queues[rid] = queue
        self._rngs[rid] = random.Random(request.seed)
        self.core.add_request(self._engine_request(request))
        self._wake.set()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            self._queues.pop(rid, None)
            self._rngs.pop(rid, None)
            if not finished:
                self.core.abort(rid)

    def _engine_request(self, request: SimRequest) -> EngineRequest:
        tokens = list(request.prompt_token_ids)
        bs = self.core.config.block_size
        remote = 0
        transfer = 0.0
        if request.remote_prefill is not None:
            # The prefiller sends whole blocks; the decoder computes the rest of the prompt itself.
            remote = (len(tokens) - 1) // bs * bs
            transfer = self.core.timer.transfer_s(remote)
        return EngineRequest(
            request_id=request.request_id,
            prompt_len=len(tokens),
            max_tokens=1 if request.prefill_only else request.max_tokens,
            block_hashes=self._hasher(tokens, bs),
            prompt_token_ids=tokens,
            prefill_only=request.prefill_only,
            remote_kv_tokens=remote,
            kv_transfer_s=transfer,
        )

    def _sim_now(self) -> float:
        return (asyncio.get_running_loop().time() - self._t0) * self.config.time_scale

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception:
            # A broken core must not leave streams waiting forever: end each one, then fail loudly.
            for queue in self._queues.values():
                queue.put_nowait(TokenOutput(0, "abort"))
            raise

    async def _loop(self) -> None:
        while True:
            now = self._sim_now()
            out = self.core.step(now)
            if out.idle:
                await self._idle_wait(now)
                continue
            await asyncio.sleep(max(0.0, out.end_s - self._sim_now()) / self.config.time_scale)
            for event in out.events:
                self._deliver(event)

    async def _idle_wait(self, now: float) -> None:
        self._wake.clear()
        wakeup = self.core.next_wakeup()
        timeout = None if wakeup is None else max(0.0, wakeup - now) / self.config.time_scale
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _deliver(self, event: RequestEvent) -> None:
        queue = self._queues.get(event.request_id)
        rng = self._rngs.get(event.request_id)
        if queue is None or rng is None:
            return
        token = self.config.first_token_id + rng.randrange(self.config.num_token_ids)
        params = self._transfer_params(event.request_id) if event.request_id in self.core.held else None
        queue.put_nowait(TokenOutput(token, event.finish_reason, event.num_cached_tokens, params))

    def _transfer_params(self, request_id: str) -> dict[str, Any]:
        req = self.core.held[request_id]
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(req.blocks)],
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.config.kv_host,
            "remote_port": self.config.kv_port,
            "tp_size": 1,
        }


def chained_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained u64 hashes of the full blocks of `token_ids`; deterministic across processes
    (tuples of ints hash without PYTHONHASHSEED)."""
    hashes = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size]))) & 0xFFFFFFFFFFFFFFFF
        hashes.append(parent)
    return hashes


def build_cost_engine(
    model: ModelSpec,
    accelerator: Accelerator,
    gpus: int,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    num_gpu_blocks: int | None = None,
    kv_lease_s: float = 30.0,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
    engine: CostEngineConfig | None = None,
    sink: KVEventSink | None = None,
) -> CostModelEngine:
    """The `--engine cost` backend; KV blocks sized by the cost model (weights subtracted) unless given."""
    timer = StepTimer.for_accelerator(model, accelerator, gpus, efficiency)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks or max(1, timer.kv_capacity_blocks(block_size)),
        kv_lease_s=kv_lease_s,
    )
    return CostModelEngine(SchedulerCore(config, timer, sink), engine)
