"""The scheduler core: a vLLM-V1-like continuous-batching scheduler whose step times come from the
roofline (`scoring/cost.py`).

`SchedulerCore` is pure and clock-driven: `step(now)` picks one batch, advances every request in it, and
returns what the batch produced together with the simulated time the step ends. Nothing here sleeps or
awaits, so the discrete-event simulator (`bench/sim/des.py`) drives it directly; `CostModelEngine`
(`bench/sim/cost_engine.py`) wraps it in asyncio (with `time_scale` simulated seconds per wall second) to
implement `bench.sim.engine_api.Engine` for the HTTP server. Its parts: the block KV cache
(`bench/sim/kv_blocks.py`), per-request state (`bench/sim/sched_request.py`), held KV for P/D
(`bench/sim/kv_leases.py`) and step times (`bench/sim/step_timer.py`).

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

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.sim.engine_api import EngineStats, KVEventSink
from bench.sim.kv_blocks import BlockPool
from bench.sim.kv_leases import KVLeases
from bench.sim.sched_request import (
    DONE,
    RUNNING,
    TRANSFERRING,
    WAITING,
    EngineRequest,
    ReqState,
    RequestEvent,
)
from bench.sim.step_timer import StepTimer


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


class SchedulerCore(KVLeases):
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
        self.waiting: deque[ReqState] = deque()
        self.transferring: list[ReqState] = []
        self.running: list[ReqState] = []
        self.held: dict[str, ReqState] = {}
        self.requests: dict[str, ReqState] = {}
        self.counters = _Counters()

    # --- requests in and out -------------------------------------------------------------------------
    def add_request(self, spec: EngineRequest) -> None:
        if self._blocks_for(spec.prompt_len + spec.max_tokens) > self.config.num_gpu_blocks:
            raise ValueError(f"request of {spec.prompt_len}+{spec.max_tokens} tokens exceeds the KV cache")
        if spec.prompt_len < 1 or spec.max_tokens < 1:
            raise ValueError("prompt_len and max_tokens must be at least 1")
        # The decoder always computes at least the last prompt token itself.
        spec.remote_kv_tokens = min(spec.remote_kv_tokens, spec.prompt_len - 1)
        req = ReqState(spec)
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

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.clear_hashes()
        self._flush_events()
        return ok

    # --- scheduling ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self, now: float) -> StepOutput:
        if self.held:
            self._expire_leases(now)
        pulled = self._finish_transfers(now)
        batch = self._schedule(now)
        if not batch:
            self._flush_events()
            return StepOutput(now, now, [], kv_pulled=pulled)
        return self._run_batch(now, batch, pulled)

    def _run_batch(self, now: float, batch: list[tuple[ReqState, int]], pulled: list[str]) -> StepOutput:
        """Time the batch and advance every request in it, in one pass (this loop is the simulator's
        per-token cost)."""
        prefill_tokens = decode_batch = decode_context = tokens = 0
        prefill_pairs = 0.0
        events: list[RequestEvent] = []
        emit = events.append
        held: list[ReqState] = []
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
            self.running = [r for r in self.running if r.state == RUNNING]
        self._flush_events()
        return StepOutput(now, end, events, prefill_tokens, decode_batch, pulled, tokens)

    def _finish(self, req: ReqState) -> None:
        self.requests.pop(req.spec.request_id, None)
        self._free(req)
        req.state = DONE

    def _schedule(self, now: float) -> list[tuple[ReqState, int]]:
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[ReqState, int]] = []
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

    def _grow(self, req: ReqState, n: int) -> bool:
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

    def _admit(self, now: float, budget: int, batch: list[tuple[ReqState, int]]) -> int:
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
                req.state = TRANSFERRING
                req.ready_at = now + req.spec.kv_transfer_s
                self.transferring.append(req)
                continue
            req.state = RUNNING
            self.running.append(req)
            n = target - start
            batch.append((req, n))
            budget -= n
        return budget

    def _prefix_hit(self, req: ReqState) -> list[int]:
        # Never the whole prompt: vLLM always computes at least the last prompt token.
        limit = (req.known - 1) // self.config.block_size
        return self.pool.lookup(req.spec.block_hashes, limit)

    def _count_admission(self, req: ReqState, hit: int, remote: bool) -> None:
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

    def _register_blocks(self, req: ReqState) -> None:
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

    def _stored_event(self, req: ReqState, indices: list[int]) -> None:
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

    def _preempt(self, req: ReqState) -> None:
        self.counters.preemptions += 1
        self._free(req)
        req.computed = 0
        req.hashed_blocks = 0
        req.state = WAITING
        self.waiting.appendleft(req)

    def _free(self, req: ReqState) -> None:
        if req.blocks:
            self.pool.release(req.blocks)
            req.blocks = []

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
