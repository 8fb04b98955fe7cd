"""The request-path helpers: cached tokens per backend across block sizes, and recording a route."""

from __future__ import annotations

from kvindex.lookup import cached_tokens, record_routed
from kvindex.memory import MemoryIndex


async def test_cached_tokens_per_block_size_capped_at_the_prompt() -> None:
    index = MemoryIndex()
    hashes = {16: tuple(range(1, 9)), 128: (77,)}
    await record_routed(index, "m", hashes, "gpu-a", 16)
    await record_routed(index, "m", hashes, "cpu-b", 128)
    await index.record("m", 16, hashes[16][:3], "gpu-c")
    got = await cached_tokens(
        index, "m", 130, hashes, ["gpu-a", "cpu-b", "gpu-c", "gpu-d"], [16, 128, 16, 16]
    )
    assert got.tolist() == [128, 128, 48, 0]
    capped = await cached_tokens(index, "m", 100, hashes, ["gpu-a"], [16])
    assert capped.tolist() == [100]


async def test_no_hashes_for_a_block_size_means_nothing_cached() -> None:
    index = MemoryIndex()
    await index.record("m", 32, (1, 2), "a")
    got = await cached_tokens(index, "m", 64, {16: (1, 2)}, ["a"], [32])
    assert got.tolist() == [0]
    await record_routed(index, "m", {16: ()}, "a", 16)  # nothing to record: no call, no error
