"""SimpleEngine on a manual clock: prefix caching, cached-token accounting, KV events, P/D leases."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.sim.engine_api import SimRequest, TokenOutput
from bench.sim.simple_engine import SimpleEngine, SimpleEngineConfig, block_hashes

BLOCK = 16
BASE_S, PER_TOKEN_S, TPOT_S = 0.01, 0.001, 0.005


class ManualClock:
    """The engine's wall clock: sleeping advances it instantly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class EventLog:
    def __init__(self) -> None:
        self.batches: list[list[dict[str, Any]]] = []

    def publish(self, events: list[dict[str, Any]]) -> None:
        self.batches.append(events)

    def types(self) -> list[list[str]]:
        return [[event["type"] for event in batch] for batch in self.batches]


def make_engine(**overrides: Any) -> tuple[SimpleEngine, ManualClock, EventLog]:
    clock, events = ManualClock(), EventLog()
    settings = {"ttft_base_s": BASE_S, "prefill_token_s": PER_TOKEN_S, "tpot_s": TPOT_S, "block_size": BLOCK}
    config = SimpleEngineConfig(**{**settings, **overrides})
    return SimpleEngine(config, events, clock=clock, sleep=clock.sleep), clock, events


async def run(
    engine: SimpleEngine, clock: ManualClock, request: SimRequest
) -> tuple[list[TokenOutput], float]:
    """All outputs, and the TTFT seen on the engine's clock."""
    started, first_at, outputs = clock.now, None, []
    async for output in engine.generate(request):
        first_at = clock.now if first_at is None else first_at
        outputs.append(output)
    assert first_at is not None
    return outputs, first_at - started


def prompt(n: int, offset: int = 0) -> list[int]:
    return [1000 + offset + i for i in range(n)]


@pytest.fixture
async def setup() -> Any:
    engine, clock, events = make_engine()
    await engine.start()
    yield engine, clock, events
    await engine.stop()


async def test_prefix_hit_cuts_ttft_and_reports_cached_tokens(setup: Any) -> None:
    engine, clock, _ = setup
    cold, cold_ttft = await run(engine, clock, SimRequest("a", prompt(100), max_tokens=3))
    warm, warm_ttft = await run(engine, clock, SimRequest("b", prompt(100), max_tokens=3))
    assert cold[-1].num_cached_tokens == 0
    assert warm[-1].num_cached_tokens == 96  # 6 full blocks; the partial tail is recomputed
    assert cold_ttft == pytest.approx(BASE_S + 100 * PER_TOKEN_S)
    assert warm_ttft == pytest.approx(BASE_S + 4 * PER_TOKEN_S)
    assert warm_ttft < cold_ttft


async def test_a_fully_cached_prompt_still_computes_its_last_token(setup: Any) -> None:
    engine, clock, _ = setup
    await run(engine, clock, SimRequest("a", prompt(64), max_tokens=1))
    outputs, _ = await run(engine, clock, SimRequest("b", prompt(64), max_tokens=1))
    assert outputs[-1].num_cached_tokens == 48


async def test_a_different_prefix_misses(setup: Any) -> None:
    engine, clock, _ = setup
    await run(engine, clock, SimRequest("a", prompt(100), max_tokens=1))
    outputs, _ = await run(engine, clock, SimRequest("b", [7, *prompt(99)], max_tokens=1))
    assert outputs[-1].num_cached_tokens == 0


async def test_outputs_are_deterministic_per_seed_and_finish_by_length(setup: Any) -> None:
    engine, clock, _ = setup
    first, _ = await run(engine, clock, SimRequest("a", prompt(20), max_tokens=5, seed=7))
    again, _ = await run(engine, clock, SimRequest("b", prompt(20), max_tokens=5, seed=7))
    other, _ = await run(engine, clock, SimRequest("c", prompt(20), max_tokens=5, seed=8))
    ids = [o.token_id for o in first]
    assert ids == [o.token_id for o in again] != [o.token_id for o in other]
    assert [o.finish_reason for o in first] == [None] * 4 + ["length"]


async def test_stats_count_tokens_by_source(setup: Any) -> None:
    engine, clock, _ = setup
    await run(engine, clock, SimRequest("a", prompt(100), max_tokens=2))
    await run(engine, clock, SimRequest("b", prompt(100), max_tokens=2))
    stats = engine.stats()
    assert (stats.prompt_tokens, stats.prefix_cache_queries, stats.prefix_cache_hits) == (200, 200, 96)
    assert stats.prompt_tokens_by_source == {
        "local_compute": 104,
        "local_cache_hit": 96,
        "external_kv_transfer": 0,
    }
    assert stats.generation_tokens == 4
    assert stats.num_requests_running == 0 and stats.kv_cache_usage_perc == 0.0


async def test_kv_events_store_full_blocks_chained_to_their_parent(setup: Any) -> None:
    engine, clock, events = setup
    tokens = prompt(40)
    await run(engine, clock, SimRequest("a", tokens, max_tokens=1))
    stored = events.batches[0][0]
    hashes = block_hashes(tokens, BLOCK)
    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == hashes
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == tokens[:32]
    assert stored["block_size"] == BLOCK and stored["medium"] == "GPU"
    await run(engine, clock, SimRequest("b", [*tokens[:32], *prompt(20, offset=500)], max_tokens=1))
    extension = events.batches[-1][-1]
    assert extension["parent_block_hash"] == hashes[-1]
    assert len(extension["block_hashes"]) == 1


async def test_eviction_emits_block_removed_before_the_store() -> None:
    engine, clock, events = make_engine(num_gpu_blocks=4)
    await engine.start()
    await run(engine, clock, SimRequest("a", prompt(48), max_tokens=1))
    await run(engine, clock, SimRequest("b", prompt(48, offset=5000), max_tokens=1))
    await engine.stop()
    last = events.types()[-1]
    assert last[-1] == "BlockStored"
    assert set(last[:-1]) == {"BlockRemoved"} and len(last) > 1
    assert all(len(e["block_hashes"]) == 1 for e in events.batches[-1][:-1])


async def test_reset_clears_the_cache_and_announces_it_with_the_next_step(setup: Any) -> None:
    engine, clock, events = setup
    await run(engine, clock, SimRequest("a", prompt(40), max_tokens=1))
    assert engine.reset_prefix_cache() is True
    batches_before = len(events.batches)
    outputs, _ = await run(engine, clock, SimRequest("b", prompt(40), max_tokens=1))
    assert outputs[-1].num_cached_tokens == 0
    assert len(events.batches) > batches_before
    assert events.batches[batches_before][0] == {"type": "AllBlocksCleared"}


async def test_prefill_only_holds_kv_until_the_lease_expires(setup: Any) -> None:
    engine, clock, _ = setup
    outputs, _ = await run(engine, clock, SimRequest("p1", prompt(100), max_tokens=50, prefill_only=True))
    assert len(outputs) == 1 and outputs[0].finish_reason == "length"
    params = outputs[0].kv_transfer_params
    assert params is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"] == "p1" and params["remote_num_tokens"] == 100
    assert len(params["remote_block_ids"][0]) == 7
    assert engine.stats().kv_held_for_transfer_blocks == 7
    clock.now += 29.0
    assert engine.stats().kv_held_for_transfer_blocks == 7
    clock.now += 2.0
    assert engine.stats().kv_held_for_transfer_blocks == 0


async def test_a_pull_frees_held_kv_at_once(setup: Any) -> None:
    engine, clock, _ = setup
    await run(engine, clock, SimRequest("p1", prompt(100), max_tokens=1, prefill_only=True))
    assert engine.release_kv("p1") is True
    assert engine.stats().kv_held_for_transfer_blocks == 0
    assert engine.release_kv("p1") is False


async def test_remote_prefill_skips_compute_and_reports_the_prefillers_cached_tokens(setup: Any) -> None:
    engine, clock, _ = setup
    remote = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_prefill_cached_tokens": 32}
    request = SimRequest("d1", prompt(100), max_tokens=2, remote_prefill=remote)
    outputs, ttft = await run(engine, clock, request)
    assert outputs[-1].num_cached_tokens == 32
    assert ttft == pytest.approx(BASE_S + 100 * engine.config.kv_transfer_token_s)
    assert engine.stats().prompt_tokens_by_source["external_kv_transfer"] == 100
    assert engine.stats().prompt_tokens_by_source["local_compute"] == 0


async def test_time_scale_divides_wall_time() -> None:
    engine, clock, _ = make_engine(time_scale=10.0)
    await engine.start()
    _, ttft = await run(engine, clock, SimRequest("a", prompt(100), max_tokens=1))
    await engine.stop()
    assert ttft == pytest.approx((BASE_S + 100 * PER_TOKEN_S) / 10)


async def test_requests_beyond_max_num_seqs_wait_and_abort_frees_the_slot() -> None:
    gate = asyncio.Event()

    async def gated_sleep(seconds: float) -> None:
        await gate.wait()

    engine = SimpleEngine(SimpleEngineConfig(max_num_seqs=1, block_size=BLOCK), sleep=gated_sleep)
    await engine.start()
    first = engine.generate(SimRequest("a", prompt(40), max_tokens=4))
    second = engine.generate(SimRequest("b", prompt(40), max_tokens=4))
    first_token = asyncio.ensure_future(anext(first))
    second_token = asyncio.ensure_future(anext(second))
    await asyncio.sleep(0.01)
    stats = engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (1, 1)
    assert stats.kv_cache_usage_perc > 0
    first_token.cancel()
    await asyncio.gather(first_token, return_exceptions=True)
    await first.aclose()
    gate.set()
    assert (await second_token).token_id > 0
    await second.aclose()
    await engine.stop()
    assert engine.stats().num_requests_running == 0
