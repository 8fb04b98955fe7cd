"""The PrefixIndex contract, run against the memory store and a real Redis."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvindex.prompt import PromptHasher

MODEL = "tiny"
BS = 16


def blocks(*ids: int) -> list[int]:
    """Stand-in chained hashes: distinct 64-bit values, one per id."""
    return [(0x9E3779B97F4A7C15 * (i + 1)) % 2**64 for i in ids]


PROMPT = blocks(*range(8))


async def test_empty_index_matches_nothing(index) -> None:
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 0]


async def test_empty_inputs(index) -> None:
    await index.record(MODEL, BS, [], "a")
    assert await index.match(MODEL, BS, [], ["a"]) == [0]
    assert await index.match(MODEL, BS, PROMPT, []) == []


async def test_longest_leading_prefix_per_backend_in_order(index) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    await index.record(MODEL, BS, PROMPT[:3], "b")
    counts = await index.match(MODEL, BS, PROMPT, ["unknown", "b", "a"])
    assert counts == [0, 3, 8]


async def test_only_leading_blocks_count(index) -> None:
    await index.record(MODEL, BS, PROMPT[:2] + blocks(100, 101), "a")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [2]
    # A prompt that diverges at block 0 shares nothing, even if later hashes exist.
    assert await index.match(MODEL, BS, blocks(50) + PROMPT[1:], ["a"]) == [0]


async def test_prompt_shorter_than_cached(index) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    assert await index.match(MODEL, BS, PROMPT[:5], ["a"]) == [5]


async def test_key_spaces_are_separate(index) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    assert await index.match("other-model", BS, PROMPT, ["a"]) == [0]
    assert await index.match(MODEL, 128, PROMPT, ["a"]) == [0]


async def test_remove_cuts_the_prefix_at_the_removed_block(index) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    await index.record(MODEL, BS, PROMPT, "b")
    await index.remove(MODEL, BS, [PROMPT[4]], "a")
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [4, 8]


async def test_clear_backend_forgets_only_that_backend(index) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    await index.record("other-model", 128, PROMPT, "a")
    await index.record(MODEL, BS, PROMPT, "b")
    await index.clear_backend("a")
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 8]
    assert await index.match("other-model", 128, PROMPT, ["a"]) == [0]
    await index.clear_backend("never-seen")
    await index.record(MODEL, BS, PROMPT[:2], "a")
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [2, 8]


async def test_many_backends_in_one_match(index) -> None:
    ids = [f"be-{i}" for i in range(70)]  # more than 64: bitmasks must grow past one word
    for i, backend_id in enumerate(ids):
        await index.record(MODEL, BS, PROMPT[: i % 9], backend_id)
    assert await index.match(MODEL, BS, PROMPT, ids) == [i % 9 for i in range(70)]


async def test_entries_expire_after_ttl(store_factory) -> None:
    index = store_factory(ttl_s=0.3)
    await index.record(MODEL, BS, PROMPT, "a")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [8]
    await asyncio.sleep(0.45)
    await index.record(MODEL, BS, PROMPT[:2], "b")
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 2]


async def test_recording_again_refreshes_the_ttl(store_factory) -> None:
    index = store_factory(ttl_s=0.4)
    await index.record(MODEL, BS, PROMPT, "a")
    await asyncio.sleep(0.25)
    await index.record(MODEL, BS, PROMPT[:3], "a")
    await asyncio.sleep(0.25)
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [3]


async def test_capacity_evicts_least_recent_tail_first(store_factory) -> None:
    index = store_factory(capacity_blocks={"a": 4}, default_capacity_blocks=100)
    await index.record(MODEL, BS, PROMPT[:6], "a")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [4]  # the head stays, the tail went
    other = blocks(200, 201, 202)
    await index.record(MODEL, BS, other, "a")
    assert await index.match(MODEL, BS, other, ["a"]) == [3]
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [1]
    # Other backends keep their default capacity.
    await index.record(MODEL, BS, PROMPT, "b")
    assert await index.match(MODEL, BS, PROMPT, ["b"]) == [8]


async def test_recording_again_makes_blocks_most_recent(store_factory) -> None:
    index = store_factory(capacity_blocks={"a": 4})
    other = blocks(200, 201)
    await index.record(MODEL, BS, PROMPT[:2], "a")
    await _tick()
    await index.record(MODEL, BS, other, "a")
    await _tick()
    await index.record(MODEL, BS, PROMPT[:2], "a")  # used again: now newer than `other`
    await _tick()
    await index.record(MODEL, BS, blocks(300), "a")  # one over capacity: `other`'s tail goes
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [2]
    assert await index.match(MODEL, BS, other, ["a"]) == [1]


async def _tick() -> None:
    """Wait for the wall clock's millisecond to change: Redis orders recency by millisecond stamps."""
    start = time.time_ns() // 1_000_000
    while time.time_ns() // 1_000_000 == start:
        await asyncio.sleep(0.0005)


async def test_tenant_salts_never_share_hits(index) -> None:
    hasher = PromptHasher(MODEL, [BS])
    body = {"messages": [{"role": "user", "content": "x" * 4 * BS * 6}]}
    _, mine = hasher.features(body, "chat", tenant="tenant-a")
    _, theirs = hasher.features(body, "chat", tenant="tenant-b")
    await index.record(MODEL, BS, mine[BS], "a")
    assert await index.match(MODEL, BS, mine[BS], ["a"]) == [6]
    assert await index.match(MODEL, BS, theirs[BS], ["a"]) == [0]


@pytest.mark.parametrize("store_kind", ["memory"])
async def test_memory_set_capacity_shrinks_at_once(store_factory) -> None:
    index = store_factory()
    await index.record(MODEL, BS, PROMPT, "a")
    index.set_capacity("a", 2)
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [2]


async def test_long_prompts_across_many_blocks(index) -> None:
    """Hundreds of blocks: prefixes that end in the middle, at a batch edge, or not at all."""
    long_prompt = blocks(*range(1000, 1300))
    await index.record(MODEL, BS, long_prompt, "all")
    await index.record(MODEL, BS, long_prompt[:64], "edge")
    await index.record(MODEL, BS, long_prompt[:130], "mid")
    await index.record(MODEL, BS, long_prompt, "hole")
    await index.remove(MODEL, BS, [long_prompt[200]], "hole")
    counts = await index.match(MODEL, BS, long_prompt, ["mid", "all", "edge", "hole"])
    assert counts == [130, 300, 64, 200]


async def test_random_holdings_match_a_per_block_reference(index) -> None:
    """Many backends holding random prefixes of one long prompt, some with holes: every count is the
    leading run of blocks that backend holds (checked block by block here), whatever the walk's chunking."""
    rng = random.Random(7)
    prompt = blocks(*range(5000, 5000 + 700))
    held: dict[str, set[int]] = {}
    for b in range(24):
        backend = f"b{b}"
        length = rng.choice([0, 1, 15, 16, 17, 80, 81, 336, 337, rng.randrange(700), 700])
        await index.record(MODEL, BS, prompt[:length], backend)
        held[backend] = set(range(length))
        for _ in range(rng.choice([0, 0, 1, 3])):
            if length:
                hole = rng.randrange(length)
                await index.remove(MODEL, BS, [prompt[hole]], backend)
                held[backend].discard(hole)
    backends = [*held, "never-recorded"]
    held["never-recorded"] = set()
    expected = [next((i for i in range(len(prompt)) if i not in held[b]), len(prompt)) for b in backends]
    assert await index.match(MODEL, BS, prompt, backends) == expected
    # A shorter prompt (the same head) and one that diverges at block 40.
    assert await index.match(MODEL, BS, prompt[:50], backends) == [min(e, 50) for e in expected]
    diverged = prompt[:40] + blocks(*range(9000, 9100))
    assert await index.match(MODEL, BS, diverged, backends) == [min(e, 40) for e in expected]
