"""`MemoryIndex.match_now` against its definition: per backend, the prompt's leading blocks it holds."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvindex.memory import MemoryIndex

MODEL, BLOCK = "m", 16


def leading(held: set[int], hashes: list[int]) -> int:
    """The definition: blocks from the start of `hashes` until the first one not held."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


@pytest.mark.parametrize("seed", range(40))
def test_match_equals_leading_blocks_held(seed: int) -> None:
    """Random chains over a shared prefix tree, partial records (as KV events store suffixes), removes
    that leave holes, backends asked for twice, unknown or never recorded, and prompt lengths across
    the walk's chunk boundaries (16, then 64, 256, ...)."""
    rng = random.Random(seed)
    index = MemoryIndex()
    backends = [f"b{i}" for i in range(rng.choice([1, 3, 8, 64, 70]))]  # 70: masks wider than 64 bits
    held: dict[str, set[int]] = {b: set() for b in backends}
    # Chains that share prefixes: a prompt is a root's chain up to a random length, then its own tail.
    roots = [list(range(r * 10_000, r * 10_000 + 400)) for r in range(3)]

    def prompt() -> list[int]:
        root = rng.choice(roots)
        shared = rng.randrange(len(root) + 1)
        return root[:shared] + [rng.getrandbits(60) for _ in range(rng.choice([0, 1, 5, 100]))]

    prompts = [prompt() for _ in range(12)]
    for _ in range(rng.randrange(1, 120)):
        backend, hashes = rng.choice(backends), rng.choice(prompts)
        lo = rng.randrange(len(hashes) + 1) if rng.random() < 0.3 else 0
        hi = rng.randrange(lo, len(hashes) + 1)
        if rng.random() < 0.2:
            gone = [h for h in hashes[lo:hi] if rng.random() < 0.1]
            asyncio.run(index.remove(MODEL, BLOCK, gone, backend))
            held[backend] -= set(gone)
        else:
            index.record_now(MODEL, BLOCK, hashes[lo:hi], backend)
            held[backend] |= set(hashes[lo:hi])
    for _ in range(20):
        asked = rng.sample(backends, rng.randrange(1, len(backends) + 1))
        asked += [*rng.sample(asked, min(2, len(asked))), "never-seen"]
        rng.shuffle(asked)
        hashes = rng.choice(prompts)[: rng.choice([1, 15, 16, 17, 80, 81, 336, 337, 500])]
        got = index.match_now(MODEL, BLOCK, hashes, asked)
        assert got == [leading(held.get(b, set()), hashes) for b in asked]


def test_match_empty_and_unknown_space() -> None:
    index = MemoryIndex()
    assert index.match_now(MODEL, BLOCK, [1, 2], ["a"]) == [0]
    index.record_now(MODEL, BLOCK, [1, 2, 3], "a")
    assert index.match_now(MODEL, BLOCK, [], ["a"]) == [0]
    assert index.match_now(MODEL, 32, [1, 2], ["a"]) == [0]
    assert index.match_now(MODEL, BLOCK, [1], ["a"]) == [1]  # a one-block chunk
    assert index.match_now(MODEL, BLOCK, [1, 2, 3, 4], ["a"]) == [3]
    assert index.match_now(MODEL, BLOCK, [2, 3], ["a"]) == [2]  # any sequence, not only chains
