"""Discrete-event mode: replay a workload through the real router against many simulated engines, no HTTP.

Each backend is a `SchedulerCore` (`bench/sim/scheduler.py`) timed by the roofline of its accelerator. A heap
of events drives them: a request arrives, the router plans it from `Candidates` built from every engine's
live state (the same fields the gateway's registry fills from its in-flight counts and vLLM's /metrics, plus
the cached-prefix tokens a precise prefix index would report), and the plan is executed:

* aggregated: the request goes to `plan.aggregated[0]`;
* P/D: a prefill-only leg on `plan.prefill[0]`; when its token comes out, the decode leg goes to
  `plan.decode[0]` carrying the prompt as remote KV; the decoder allocates blocks, waits the KV transfer
  time of `scoring/cost.py` (prefiller's and decoder's links) and decodes; the prefiller frees the KV when
  the decoder has pulled it.

An engine is stepped whenever it is idle and has work; a step's outputs are delivered when the step ends.
Prompt block hashes come from `kvindex/hashing.py`, as on the gateway's request path.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.sim.scheduler import (
    EngineRequest,
    RequestEvent,
    SchedulerConfig,
    SchedulerCore,
    StepOutput,
    StepTimer,
)
from bench.workloads import Prompt, WorkloadRequest, block_token_ids
from kvindex.hashing import HashMode, hash_token_ids, root_hash
from scoring.catalog import Accelerator, ModelSpec
from scoring.conversations import MIN_SEEN, REPLAN_EVERY
from scoring.cost import DEFAULT_EFFICIENCY, Efficiency, Hardware, kv_transfer_time
from scoring.load import (
    CacheSurvival,
    Reserved,
    kv_due,
    kv_due_columns,
    leg_load,
    load_columns,
    planned_prefill_s,
)
from scoring.outcome import Measured, outcomes_of
from scoring.types import (
    BackendSpec,
    BackendStats,
    Candidates,
    LegLoad,
    Mode,
    Prediction,
    RequestFeatures,
    Router,
)

_ARRIVE, _STEP_END, _WAKE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class SimBackend:
    spec: BackendSpec
    accelerator: Accelerator
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int | None = None  # None: what the cost model says fits after the weights


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    mode: str = ""
    backend: str = ""  # the aggregated backend, or the decode backend of a P/D pair
    prefill_backend: str = ""
    cached_tokens: int = 0  # on the backend that prefilled (a decoder's pulled KV is not a hit)
    output_tokens: int = 0
    prefill_done_s: float = float("nan")  # P/D: when the prefill leg's token came out
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    error: str = ""
    predicted_ttft_s: float = float("nan")  # what the plan predicted, if its router priced it
    predicted_tpot_s: float = float("nan")

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(slots=True)
class DesResult:
    records: list[RequestRecord]
    token_times: np.ndarray  # end time of each step that produced client-visible tokens
    token_counts: np.ndarray  # how many client-visible tokens that step produced
    steps: int
    wall_s: float
    engine_stats: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def makespan_s(self) -> float:
        return float(self.token_times.max()) if self.token_times.size else 0.0

    def output_throughput(self, window: tuple[float, float] = (0.0, 1.0)) -> float:
        """Client-visible output tokens per simulated second within a fraction of the makespan."""
        if not self.token_times.size:
            return 0.0
        start, end = window[0] * self.makespan_s, window[1] * self.makespan_s
        inside = (self.token_times > start) & (self.token_times <= end)
        return float(self.token_counts[inside].sum()) / max(end - start, 1e-12)

    def summary(self) -> dict[str, float]:
        done = [r for r in self.records if not r.error and r.finish_s == r.finish_s]
        ttft = np.array([r.ttft_s for r in done]) if done else np.zeros(1)
        return {
            "requests": len(self.records),
            "completed": len(done),
            "failed": sum(1 for r in self.records if r.error),
            "makespan_s": self.makespan_s,
            "output_tok_s": self.output_throughput(),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "pd_share": sum(1 for r in done if r.mode == Mode.PD) / max(len(done), 1),
            "steps": self.steps,
            "wall_s": self.wall_s,
        }


class PromptHasher:
    """The gateway's chained block hashes (`kvindex.hashing.hash_token_ids`) of a workload prompt, memoised
    per content block: the hashes of a full content block depend only on its parent hash and its id, so a
    shared system prompt or trace block is hashed once, not once per request. Equal to hashing the whole
    prompt's token ids (tested)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.memo: dict[tuple[int, int, int], list[int]] = {}

    def __call__(self, prompt: Prompt, block_size: int) -> list[int]:
        if prompt.block_tokens % block_size:
            return hash_token_ids(prompt.token_array(), block_size, self.root)
        hashes: list[int] = []
        parent, remaining = self.root, prompt.length
        for block in prompt.blocks:
            n = min(remaining, prompt.block_tokens)
            if n < block_size:
                break
            key = (block_size, parent, block)
            chunk = self.memo.get(key) if n == prompt.block_tokens else None
            if chunk is None:
                chunk = hash_token_ids(block_token_ids(block, prompt.block_tokens)[:n], block_size, parent)
                if n == prompt.block_tokens:
                    self.memo[key] = chunk
            hashes.extend(chunk)
            parent, remaining = chunk[-1], remaining - n
            if remaining <= 0:
                break
        return hashes


class Simulation:
    """Engines of one model behind one router; `run` replays a workload, returns per-request records."""

    def __init__(
        self,
        model: ModelSpec,
        backends: Sequence[SimBackend],
        router: Router,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
        prefix_lookup: bool | None = None,
    ) -> None:
        self.model = model
        # Asking every engine's cache for every request is the costliest part of a decision; policies
        # that ignore `cached_tokens` skip it (None: as the router declares).
        self.prefix_lookup = router.uses_prefix_index if prefix_lookup is None else prefix_lookup
        self.backends = tuple(backends)
        self.router = router
        self.efficiency = efficiency
        self.specs = tuple(b.spec for b in self.backends)
        self.hardware = [
            Hardware.of([b.accelerator], [b.spec.gpus], model.compute_dtype) for b in self.backends
        ]
        self.engines = [self._engine(b, hw) for b, hw in zip(self.backends, self.hardware, strict=True)]
        self.block_sizes = sorted({b.spec.block_size for b in self.backends})
        self.hasher = PromptHasher(root_hash(HashMode.TOKENS, model.name))

    def _engine(self, backend: SimBackend, hardware: Hardware) -> SchedulerCore:
        timer = StepTimer(self.model, hardware, self.efficiency)
        blocks = backend.num_gpu_blocks or timer.kv_capacity_blocks(backend.spec.block_size)
        config = SchedulerConfig(
            max_num_seqs=backend.spec.max_num_seqs,
            max_num_batched_tokens=backend.max_num_batched_tokens,
            block_size=backend.spec.block_size,
            num_gpu_blocks=max(1, blocks),
            emit_every_token=False,
        )
        return SchedulerCore(config, timer)

    def run(self, workload: Sequence[WorkloadRequest], concurrency: int | None = None) -> DesResult:
        """Replay `workload` (open loop at its arrival times, or closed loop with `concurrency` clients)."""
        return self.replay(workload, concurrency).execute()

    def replay(self, workload: Sequence[WorkloadRequest], concurrency: int | None = None) -> Replay:
        """The replay before it runs (tests inspect its live state from inside a router)."""
        return Replay(self, workload, concurrency)


class Replay:
    """One replay: the event heap and the bookkeeping between router decisions and engine steps."""

    def __init__(self, sim: Simulation, workload: Sequence[WorkloadRequest], concurrency: int | None) -> None:
        self.sim = sim
        self.workload = workload
        self.concurrency = concurrency
        n = len(sim.engines)
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.busy = [False] * n
        self.pending: list[StepOutput | None] = [None] * n
        self.wake_at = [float("inf")] * n
        # The gateway's accounting, kept as the registry keeps it: legs in flight and the work each
        # reserved when planned (`scoring/load.py`), released as legs finish.
        self.in_flight = [0] * n
        self.reserved = [Reserved() for _ in range(n)]
        self.survival = [CacheSurvival() for _ in range(n)]  # fed each engine's counters, as a scrape
        self.leg_load: dict[tuple[int, str], LegLoad] = {}  # (engine, request id) -> its reservation
        # Split decode legs sent to their engine, before their first token (`Reserved.arriving`).
        self.arriving: set[tuple[int, str]] = set()
        self.predicted: dict[str, Prediction | None] = {}
        # The fixed columns of Candidates once; the live ones per engine as it changes, then the load
        # formula over all of them (`scoring.load.load_columns`, as the registry does).
        self.base = Candidates.build(sim.specs, tuple(BackendStats() for _ in range(n)))
        # in_flight, running, waiting, prefill tokens and seqs, decode seqs, context, kv_usage, and the
        # prompt in progress (`Reserved`: head tokens, since, predicted seconds; the step's tokens and
        # the decode steps it waited for), and the gateway's own legs among vLLM's waiting ones
        # (`Reserved.waiting_seqs`: the `seen` of a fresh report)
        self.stats = np.zeros((14, n))
        self.dirty = set(range(n))
        self.records = [
            RequestRecord(w.request_id, w.arrival_s, w.prompt_len, w.max_tokens) for w in workload
        ]
        self.index = {w.request_id: i for i, w in enumerate(workload)}
        self.hashes: dict[int, dict[int, list[int]]] = {}
        self.legs: dict[tuple[int, str], int] = {}  # (engine, request id) -> record index
        self.pd_pending: dict[
            str, tuple[int, int]
        ] = {}  # P/D: request id -> (prefiller, decoder) until decode
        self.prefill_of: dict[str, int] = {}  # P/D: request id -> prefill engine, until the KV is pulled
        self.times: list[float] = []
        self.counts: list[int] = []
        self.steps = 0
        self.next_issue = 0
        self.arrival_order: list[int] = []
        self.planned = 0  # requests routed so far: a router that replans does so every REPLAN_EVERY

    # --- the loop ---------------------------------------------------------------------------------------
    def execute(self) -> DesResult:
        started = time.perf_counter()
        # The loop allocates millions of short-lived, acyclic objects while 100k records stay alive: the
        # cyclic collector would rescan those records again and again (a superlinear cost), so it waits.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._loop()
        finally:
            if collecting:
                gc.enable()
        return DesResult(
            self.records,
            np.asarray(self.times),
            np.asarray(self.counts),
            self.steps,
            time.perf_counter() - started,
            {spec.id: _stats_row(e) for spec, e in zip(self.sim.specs, self.sim.engines, strict=True)},
        )

    def _loop(self) -> None:
        self._issue_initial()
        while self.heap:
            t, _seq, kind, arg = heapq.heappop(self.heap)
            if kind == _ARRIVE:
                self._issue_open_loop()
                self._arrive(arg, t)
            elif kind == _STEP_END:
                self._step_end(arg, t)
            elif t >= self.wake_at[arg]:
                self.wake_at[arg] = float("inf")
                self._kick(arg, t)

    def _push(self, t: float, kind: int, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, arg))

    def _issue_initial(self) -> None:
        if self.concurrency is None:
            # Open loop: arrivals enter the heap one at a time, in time order, so the heap stays small.
            self.arrival_order = sorted(range(len(self.workload)), key=lambda i: self.workload[i].arrival_s)
            self._issue_open_loop()
            return
        for _ in range(min(self.concurrency, len(self.workload))):
            self._issue_next(0.0)

    def _issue_open_loop(self) -> None:
        if self.concurrency is None and self.next_issue < len(self.arrival_order):
            i = self.arrival_order[self.next_issue]
            self.next_issue += 1
            self._push(self.workload[i].arrival_s, _ARRIVE, i)

    def _issue_next(self, t: float) -> None:
        if self.next_issue < len(self.workload):
            self.records[self.next_issue].arrival_s = t
            self._push(t, _ARRIVE, self.next_issue)
            self.next_issue += 1

    # --- routing ----------------------------------------------------------------------------------------
    def _arrive(self, i: int, t: float) -> None:
        w = self.workload[i]
        hashes = self._hashes(i, w)
        candidates = self._candidates(hashes, t)
        model, chat = self.sim.specs[0].model, w.session is not None
        features = RequestFeatures(model, w.prompt_len, w.max_tokens, False, hashes, in_conversation=chat)
        router = self.sim.router
        if router.replans and self.planned % REPLAN_EVERY == MIN_SEEN:
            router.replan()  # the gateway: in a thread every few seconds (simulated time is not wall time)
        self.planned += 1
        plan = router.plan(features, candidates)
        record = self.records[i]
        record.mode = plan.mode
        if plan.predicted is not None:  # the DES serves every request where its plan priced it
            predicted = plan.predicted
            record.predicted_ttft_s, record.predicted_tpot_s = predicted.ttft_s, predicted.expected_tpot_s
        if self.sim.router.learns:
            self.predicted[w.request_id] = plan.predicted
        if plan.mode == Mode.PD and plan.prefill and plan.decode:
            prefiller, decoder = plan.prefill[0], plan.decode[0]
            record.prefill_backend = self.sim.specs[prefiller].id
            record.backend = self.sim.specs[decoder].id
            due = kv_due(plan.predicted, t)
            prefill_s = planned_prefill_s(plan.predicted, "prefill", prefiller)
            decode_leg = self._leg("decode", i, decoder, candidates, kv_due_s=due)
            self._reserve(decoder, w.request_id, decode_leg, t)  # taken at plan time, like the gateway
            prefill_leg = self._leg("prefill", i, prefiller, candidates, prefill_s)
            self._reserve(prefiller, w.request_id, prefill_leg, t)
            request = EngineRequest(
                w.request_id, w.prompt_len, 1, hashes[self._bs(prefiller)], prefill_only=True
            )
            self._submit(prefiller, i, request, t)
            self.pd_pending[w.request_id] = (prefiller, decoder)
            return
        if not plan.aggregated:
            self._fail(i, t, plan.reason or "no_backend")
            return
        target = plan.aggregated[0]
        record.backend = self.sim.specs[target].id
        prefill_s = planned_prefill_s(plan.predicted, "aggregated", target)
        leg = self._leg("aggregated", i, target, candidates, prefill_s)
        self._reserve(target, w.request_id, leg, t)
        self._submit(
            target, i, EngineRequest(w.request_id, w.prompt_len, w.max_tokens, hashes[self._bs(target)]), t
        )

    def _leg(
        self,
        leg: str,
        i: int,
        engine: int,
        c: Candidates,
        prefill_s: float = math.nan,
        kv_due_s: float = math.nan,
    ) -> LegLoad:
        """What one leg of request `i` puts on `engine`, as the gateway reserves it (`Decision.leg_load`)."""
        w = self.workload[i]
        cached, survival = int(c.cached_tokens[engine]), float(c.cache_survival[engine])
        return leg_load(leg, w.prompt_len, w.max_tokens, cached, kv_due_s, prefill_s, survival)

    def _reserve(self, engine: int, request_id: str, leg: LegLoad, t: float) -> None:
        self.in_flight[engine] += 1
        self.reserved[engine].add(leg, t)
        self.leg_load[(engine, request_id)] = leg
        self.dirty.add(engine)

    def _prefill_done(self, engine: int, request_id: str, t: float) -> None:
        leg = self.leg_load.get((engine, request_id))
        if leg is not None and (leg.prefill_tokens or leg.awaits_kv):
            self.reserved[engine].prefill_done(leg, t)
            if leg.awaits_kv:
                self.arriving.add((engine, request_id))
            self.leg_load[(engine, request_id)] = LegLoad(0, leg.decode_tokens, leg.context_tokens)
            self.dirty.add(engine)

    def _arrived(self, engine: int, request_id: str) -> None:
        if (engine, request_id) in self.arriving:
            self.arriving.remove((engine, request_id))
            self.reserved[engine].arrived()
            self.dirty.add(engine)

    def _release(self, engine: int, request_id: str, t: float) -> None:
        self._arrived(engine, request_id)
        leg = self.leg_load.pop((engine, request_id), None)
        if leg is not None:
            self.in_flight[engine] -= 1
            self.reserved[engine].release(leg, prefill_pending=True, now=t)
            self.dirty.add(engine)

    def _hashes(self, i: int, w: WorkloadRequest) -> dict[int, list[int]]:
        return {bs: self.sim.hasher(w.prompt, bs) for bs in self.sim.block_sizes}

    def _bs(self, engine: int) -> int:
        return self.sim.specs[engine].block_size

    def _candidates(self, hashes: dict[int, list[int]], now: float) -> Candidates:
        """The registry snapshot the gateway would route on: the same load formula over each engine's
        accounting and its /metrics view, with the per-engine reads kept to engines that changed."""
        engines, stats = self.sim.engines, self.stats
        for k in self.dirty:
            stats[:, k] = self._stats_row(k)
            c, r = engines[k].counters, self.reserved[k]
            self.survival[k].observe(c.prefix_hits, c.prefix_queries, r.indexed_tokens, r.queried_tokens)
        self.dirty.clear()
        cached = np.zeros(len(engines), dtype=np.int64)
        if self.sim.prefix_lookup:
            cached = np.fromiter(
                (e.cached_prefix_tokens(hashes[e.config.block_size]) for e in engines),
                dtype=np.int64,
                count=len(engines),
            )
        base = self.base
        due_rows, due_s = kv_due_columns([r.kv_due for r in self.reserved], now)
        return Candidates(
            specs=base.specs,
            healthy=base.healthy.copy(),
            can_prefill=base.can_prefill.copy(),
            can_decode=base.can_decode.copy(),
            capacity=base.capacity.copy(),
            kv_usage=stats[7].copy(),
            cached_tokens=cached,
            cache_survival=np.fromiter((s.factor for s in self.survival), dtype=float, count=len(engines)),
            **load_columns(*stats[:7], seen=stats[[0, 13, 5, 6]], head=stats[8:13], now=now),
            kv_due_rows=due_rows,
            kv_due_s=due_s,
            now=now,
        )

    def _stats_row(self, k: int) -> tuple[float, ...]:
        e, r = self.sim.engines[k], self.reserved[k]
        kv_usage = 1.0 - e.pool.num_free / e.config.num_gpu_blocks
        return (
            # vLLM's waiting count holds the decode legs waiting for their KV pull.
            self.in_flight[k], len(e.running), len(e.waiting) + len(e.transferring), r.prefill_tokens,
            r.prefill_seqs, r.decode_seqs, r.context_tokens, kv_usage, r.head_tokens, r.head_since, r.head_s,
            r.step_tokens, r.step_behind, r.waiting_seqs,
        )  # fmt: skip

    def live_stats(self) -> tuple[BackendStats, ...]:
        """Each engine's state as the registry would report it (what `_candidates` summarises)."""
        return tuple(
            BackendStats(
                in_flight=self.in_flight[k],
                running=len(e.running),
                waiting=len(e.waiting) + len(e.transferring),
                kv_usage=1.0 - e.pool.num_free / e.config.num_gpu_blocks,
                prefill_tokens=self.reserved[k].prefill_tokens,
                prefill_seqs=self.reserved[k].prefill_seqs,
                decode_seqs=self.reserved[k].decode_seqs,
                context_tokens=self.reserved[k].context_tokens,
            )
            for k, e in enumerate(self.sim.engines)
        )

    def _submit(self, engine: int, i: int, request: EngineRequest, t: float) -> None:
        try:
            self.sim.engines[engine].add_request(request)
        except ValueError as exc:
            self._release(engine, request.request_id, t)
            self._fail(i, t, str(exc))
            return
        self.legs[(engine, request.request_id)] = i
        self._kick(engine, t)

    def _fail(self, i: int, t: float, reason: str) -> None:
        self.records[i].error = reason
        if self.concurrency is not None:
            self._issue_next(t)

    # --- engines ----------------------------------------------------------------------------------------
    def _kick(self, engine: int, t: float) -> None:
        self.dirty.add(engine)  # every change to an engine or its in-flight count is followed by a kick
        if self.busy[engine]:
            return
        core = self.sim.engines[engine]
        out = core.step(t)
        if not out.idle:
            # Busy before releasing pulled KV: that kicks the prefillers, and when roles follow the
            # traffic a prefiller may be decoding KV from this engine and kick it back.
            self.steps += 1
            self.busy[engine] = True
            self.pending[engine] = out
            self._push(out.end_s, _STEP_END, engine)
        self._release_pulled(out)
        if out.idle and not self.busy[engine]:
            wakeup = core.next_wakeup()
            if wakeup is not None and wakeup < self.wake_at[engine]:
                self.wake_at[engine] = max(wakeup, t)
                self._push(max(wakeup, t), _WAKE, engine)

    def _release_pulled(self, out: StepOutput) -> None:
        for request_id in out.kv_pulled:
            prefiller = self.prefill_of.pop(request_id, None)
            if prefiller is not None and self.sim.engines[prefiller].release_kv(request_id):
                self._kick(prefiller, out.start_s)

    def _step_end(self, engine: int, t: float) -> None:
        out = self.pending[engine]
        self.busy[engine] = False
        self.pending[engine] = None
        assert out is not None
        visible = out.tokens
        legs, pd_pending = self.legs, self.pd_pending
        for event in out.events:  # only first and last tokens: the engines run with emit_every_token off
            rid = event.request_id
            i = legs.get((engine, rid))
            if i is None:
                continue
            pair = pd_pending.get(rid)
            if pair is not None and pair[0] == engine:
                record = self.records[i]
                record.prefill_done_s = t
                record.cached_tokens = event.num_cached_tokens
                self._start_decode_leg(engine, pair[1], i, t)  # a prefill leg's token is not shown
                visible -= 1
                continue
            self._on_token(engine, i, rid, event, t)
        if visible:
            self.times.append(t)
            self.counts.append(visible)
        self._kick(engine, t)

    def _on_token(self, engine: int, i: int, rid: str, event: RequestEvent, t: float) -> None:
        record = self.records[i]
        if event.first_token:
            record.first_token_s = t
            if record.mode != Mode.PD:  # a decoder's pulled KV is not a cache hit
                record.cached_tokens = event.num_cached_tokens
            self._prefill_done(engine, rid, t)
            self._arrived(engine, rid)
        record.output_tokens = event.num_output_tokens
        if event.finish_reason is not None:
            self._finish(engine, i, rid, t)

    def _start_decode_leg(self, prefiller: int, decoder: int, i: int, t: float) -> None:
        w = self.workload[i]
        self._release(prefiller, w.request_id, t)
        del self.legs[(prefiller, w.request_id)]
        del self.pd_pending[w.request_id]
        bs = self._bs(decoder)
        remote = (w.prompt_len - 1) // bs * bs
        transfer = float(
            kv_transfer_time(
                self.sim.model,
                self.sim.hardware[prefiller],
                self.sim.hardware[decoder],
                remote,
                self.sim.efficiency,
            )[0]
        )
        hashes = self.sim.hasher(w.prompt, bs)
        self.prefill_of[w.request_id] = prefiller
        request = EngineRequest(
            w.request_id, w.prompt_len, w.max_tokens, hashes, remote_kv_tokens=remote, kv_transfer_s=transfer
        )
        self._prefill_done(decoder, w.request_id, t)  # its KV is computed: no longer due, it queues there now
        self._submit(decoder, i, request, t)  # reserved on the decoder when planned

    def _finish(self, engine: int, i: int, rid: str, t: float) -> None:
        record = self.records[i]
        record.finish_s = t
        self._release(engine, rid, t)
        del self.legs[(engine, rid)]
        router = self.sim.router
        if router.learns:
            measured = Measured(
                Mode(record.mode), record.backend, record.prompt_len, record.cached_tokens,
                record.output_tokens, record.arrival_s, record.first_token_s, t, record.prefill_backend,
                record.prefill_done_s,
            )  # fmt: skip
            for outcome in outcomes_of(measured, self.predicted.pop(rid, None)):
                router.observe(outcome)
        if self.concurrency is not None:
            self._issue_next(t)


def _stats_row(engine: SchedulerCore) -> dict[str, float]:
    s = engine.stats()
    return {
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
        "prefix_cache_hits": s.prefix_cache_hits,
        "preemptions": s.num_preemptions,
        "kv_held_for_transfer_blocks": s.kv_held_for_transfer_blocks,
    }


def make_backends(
    entries: Sequence[tuple[str, Accelerator, int, frozenset]],
    model: str,
    *,
    max_num_seqs: int = 256,
    block_size: int = 16,
) -> list[SimBackend]:
    """`(id, accelerator, gpus, roles)` tuples -> `SimBackend`s with gateway-like `BackendSpec`s."""
    return [
        SimBackend(BackendSpec(bid, model, acc.name, gpus, roles, max_num_seqs, block_size), acc)
        for bid, acc, gpus, roles in entries
    ]
