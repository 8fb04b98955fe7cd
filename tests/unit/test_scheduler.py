"""The vLLM-like scheduler: prefix hits, queueing, KV pressure, chunked prefill, P/D, KV events, asyncio."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.sim.engine_api import SimRequest
from bench.sim.scheduler import (
    CostEngineConfig,
    CostModelEngine,
    EngineRequest,
    SchedulerConfig,
    SchedulerCore,
    StepTimer,
    build_cost_engine,
    chained_block_hashes,
)
from scoring.catalog import load_catalog

CATALOG = load_catalog()
BS = 16


def make_core(sink: Any = None, **config: Any) -> SchedulerCore:
    timer = StepTimer.for_accelerator(CATALOG.model("llama-3.1-8b"), CATALOG.accelerator("h100-sxm"), 1)
    return SchedulerCore(SchedulerConfig(block_size=BS, **config), timer, sink)


def request(rid: str, prompt: list[int], max_tokens: int = 4, **kw: Any) -> EngineRequest:
    return EngineRequest(rid, len(prompt), max_tokens, chained_block_hashes(prompt, BS), prompt, **kw)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(n)]


class Clock:
    """Drives a core the way the DES does: step while there is work, idle to the next wakeup."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.now = 0.0
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.steps: list[Any] = []

    def run(self, until: float = float("inf")) -> None:
        while self.now < until:
            out = self.core.step(self.now)
            if out.idle:
                wake = self.core.next_wakeup()
                if wake is None or wake > until:
                    return
                self.now = max(wake, self.now)
                continue
            self.steps.append(out)
            self.now = out.end_s
            for e in out.events:
                self.tokens[e.request_id] = self.tokens.get(e.request_id, 0) + 1
                if e.first_token:
                    self.first[e.request_id] = self.now
                    self.cached[e.request_id] = e.num_cached_tokens
                if e.finish_reason:
                    self.done[e.request_id] = self.now


def test_prefix_hit_cuts_ttft_and_is_block_granular() -> None:
    core = make_core()
    clock = Clock(core)
    shared = prompt(1, 4000)
    core.add_request(request("cold", shared))
    clock.run()
    start = clock.now
    core.add_request(request("warm", shared))
    clock.run()
    cold_ttft, warm_ttft = clock.first["cold"], clock.first["warm"] - start
    assert warm_ttft < cold_ttft / 3
    assert clock.cached["warm"] == (4000 - 1) // BS * BS
    assert clock.cached["cold"] == 0
    stats = core.stats()
    assert stats.prefix_cache_hits == clock.cached["warm"]
    assert stats.prompt_tokens_by_source["local_cache_hit"] == clock.cached["warm"]


def test_queueing_grows_ttft_under_load() -> None:
    alone = make_core()
    clock = Clock(alone)
    alone.add_request(request("only", prompt(0, 3000)))
    clock.run()
    busy = make_core()
    busy_clock = Clock(busy)
    for i in range(16):
        busy.add_request(request(f"r{i}", prompt(i, 3000)))
    busy_clock.run()
    assert busy_clock.first["r15"] > 5 * clock.first["only"]
    assert all(busy_clock.tokens[f"r{i}"] == 4 for i in range(16))


def test_full_kv_cache_queues_requests() -> None:
    core = make_core(num_gpu_blocks=64)  # 1024 tokens: two 400-token requests fit, not three
    clock = Clock(core)
    for i in range(3):
        core.add_request(request(f"r{i}", prompt(i, 400), max_tokens=8))
    core.step(0.0)
    assert core.stats().num_requests_waiting == 1
    clock.run()
    assert sorted(clock.done) == ["r0", "r1", "r2"]
    assert clock.first["r2"] >= min(clock.done["r0"], clock.done["r1"])


def test_full_kv_cache_preempts_and_recomputes() -> None:
    core = make_core(num_gpu_blocks=40)  # 640 tokens; two requests grow from 300 to 300+100 each
    clock = Clock(core)
    for i in range(2):
        core.add_request(request(f"r{i}", prompt(i, 300), max_tokens=100))
    clock.run()
    assert core.stats().num_preemptions > 0
    assert clock.tokens == {"r0": 100, "r1": 100}
    assert core.pool.num_free == 40


def test_chunked_prefill_shares_steps_with_decodes_and_slows_them() -> None:
    core = make_core(max_num_batched_tokens=1024)
    clock = Clock(core)
    core.add_request(request("decoder", prompt(1, 200), max_tokens=50))
    clock.run(until=0.05)
    core.add_request(request("long", prompt(2, 4000), max_tokens=2))
    clock.run()
    mixed = [s for s in clock.steps if s.prefill_tokens and s.decode_batch]
    pure = [s for s in clock.steps if s.decode_batch and not s.prefill_tokens]
    assert len(mixed) >= 3  # 4000 tokens in 1024-token chunks, each with the decode riding along
    assert all(s.prefill_tokens <= 1024 for s in clock.steps)
    assert min(s.end_s - s.start_s for s in mixed) > 2 * max(s.end_s - s.start_s for s in pure)


def test_prefill_only_holds_kv_until_pulled() -> None:
    core = make_core()
    clock = Clock(core)
    core.add_request(request("p", prompt(3, 1000), max_tokens=1, prefill_only=True))
    clock.run(until=1.0)
    assert clock.done == {"p": clock.first["p"]}
    held = core.stats().kv_held_for_transfer_blocks
    assert held == -(-1000 // BS)
    assert core.release_kv("p") is True
    assert core.stats().kv_held_for_transfer_blocks == 0
    assert core.release_kv("p") is False


def test_unpulled_kv_is_freed_when_the_lease_expires() -> None:
    core = make_core(kv_lease_s=2.0)
    clock = Clock(core)
    core.add_request(request("p", prompt(3, 1000), max_tokens=1, prefill_only=True))
    clock.run(until=1.0)
    assert core.stats().kv_held_for_transfer_blocks > 0
    clock.run(until=5.0)
    assert core.stats().kv_held_for_transfer_blocks == 0
    assert clock.now >= 2.0


def test_remote_kv_waits_the_transfer_then_skips_the_prefill() -> None:
    tokens = prompt(4, 2000)
    local, remote = make_core(), make_core()
    local_clock, remote_clock = Clock(local), Clock(remote)
    local.add_request(request("x", tokens))
    local_clock.run()
    remote.add_request(request("x", tokens, remote_kv_tokens=1984, kv_transfer_s=0.5))
    remote.step(0.0)
    assert remote.stats().num_requests_waiting == 1  # WAITING_FOR_REMOTE_KVS, blocks allocated
    remote_clock.run()
    assert remote_clock.first["x"] > 0.5
    assert remote_clock.first["x"] - 0.5 < local_clock.first["x"] / 3
    assert remote.stats().prompt_tokens_by_source == {
        "local_compute": 16,
        "local_cache_hit": 0,
        "external_kv_transfer": 1984,
    }
    assert remote_clock.steps[0].kv_pulled == ["x"]


class Sink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def publish(self, events: list[dict[str, Any]]) -> None:
        self.events.extend(events)


def test_kv_events_have_vllm_map_shape() -> None:
    sink = Sink()
    core = make_core(sink=sink, num_gpu_blocks=80)
    clock = Clock(core)
    first = prompt(5, 640)
    core.add_request(request("a", first, max_tokens=2))
    clock.run()
    stored = [e for e in sink.events if e["type"] == "BlockStored"]
    assert stored and set(stored[0]) == {
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys",
    }  # fmt: skip
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert hashes == chained_block_hashes(first, BS)
    assert stored[0]["token_ids"] == first[: len(stored[0]["block_hashes"]) * BS]
    assert stored[0]["parent_block_hash"] is None and stored[0]["medium"] == "GPU"
    # A different prompt needing most of the cache evicts the free, cached blocks of the first one.
    core.add_request(request("b", prompt(6, 1000), max_tokens=2))
    clock.run()
    removed = [h for e in sink.events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and set(removed) <= set(hashes)
    assert core.reset_prefix_cache() is True
    assert sink.events[-1] == {"type": "AllBlocksCleared"}
    assert core.cached_prefix_tokens(chained_block_hashes(first, BS)) == 0


async def test_asyncio_engine_streams_tokens_and_returns_transfer_params() -> None:
    engine = CostModelEngine(make_core(), CostEngineConfig(time_scale=100.0))
    await engine.start()
    try:
        outputs = [o async for o in engine.generate(SimRequest("r1", prompt(7, 500), 5, seed=3))]
        again = [o async for o in engine.generate(SimRequest("r2", prompt(7, 500), 5, seed=3))]
        held = [o async for o in engine.generate(SimRequest("p1", prompt(8, 300), 1, prefill_only=True))]
    finally:
        await engine.stop()
    assert [o.finish_reason for o in outputs] == [None] * 4 + ["length"]
    assert [o.token_id for o in outputs] == [o.token_id for o in again]  # same seed, same tokens
    assert again[0].num_cached_tokens == 496
    params = held[-1].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    assert len(params["remote_block_ids"][0]) == -(-300 // BS)
    assert engine.stats().kv_held_for_transfer_blocks == len(params["remote_block_ids"][0])


async def test_closing_the_stream_aborts_the_request() -> None:
    engine = CostModelEngine(make_core(), CostEngineConfig(time_scale=10.0))
    await engine.start()
    try:
        stream = engine.generate(SimRequest("r", prompt(9, 200), 1000))
        await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0)
        assert engine.stats().num_requests_running == 0
        assert engine.core.pool.num_free == engine.core.config.num_gpu_blocks
    finally:
        await engine.stop()


async def test_built_cost_engine_sizes_its_cache_from_the_cost_model() -> None:
    engine = build_cost_engine(
        CATALOG.model("tiny-cpu"),
        CATALOG.accelerator("cpu"),
        1,
        block_size=128,
        engine=CostEngineConfig(1000.0),
    )
    stats = engine.stats()
    assert stats.block_size == 128
    assert stats.num_gpu_blocks == int((8e9 * 0.9 - 0.0037e9 * 2) // 1024) // 128
    await engine.start()
    try:
        outputs = [o async for o in engine.generate(SimRequest("r", prompt(1, 300), 3))]
    finally:
        await engine.stop()
    assert len(outputs) == 3 and engine.stats().generation_tokens == 3


async def test_a_failing_core_ends_streams_with_abort_and_fails_loudly() -> None:
    core = make_core()
    engine = CostModelEngine(core, CostEngineConfig(time_scale=100.0))
    real_step = core.step

    def broken(now: float) -> Any:
        if core.has_work():
            raise RuntimeError("boom")
        return real_step(now)

    core.step = broken  # type: ignore[method-assign]
    await engine.start()
    outputs = [o async for o in engine.generate(SimRequest("r", prompt(1, 100), 3))]
    assert [o.finish_reason for o in outputs] == ["abort"]
    with pytest.raises(RuntimeError, match="boom"):
        await engine.stop()
    with pytest.raises(RuntimeError, match="not running"):
        await anext(engine.generate(SimRequest("r2", prompt(1, 100), 3)))
