"""`HolderTable` (kvindex/holders.py) against a dict of Python-int masks: adds and drops over many
backends (masks of three words), through growth, rebuilds, tombstones and their reuse."""

from __future__ import annotations

import numpy as np
import pytest

from kvindex.holders import WORD_BITS, HolderTable


def leading(reference: dict[int, int], hashes: list[int], position: int) -> int:
    count = 0
    for block_hash in hashes:
        if not reference.get(block_hash, 0) >> position & 1:
            break
        count += 1
    return count


@pytest.mark.parametrize("seed", range(6))
def test_table_equals_a_dict_of_masks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    table, reference = HolderTable(), {}
    universe = rng.integers(0, 2**64, size=6000, dtype=np.uint64)  # any 64-bit hash, high bit included
    for _ in range(1500):
        position = int(rng.integers(0, 3 * WORD_BITS))
        hashes = universe[rng.integers(0, len(universe), size=int(rng.integers(0, 80)))]
        if rng.random() < 0.6:
            table.add(hashes, position)
            for h in hashes.tolist():
                reference[h] = reference.get(h, 0) | 1 << position
        else:
            table.drop(hashes, position)
            for h in hashes.tolist():
                if h in reference and not reference[h] & ~(1 << position):
                    del reference[h]
                elif h in reference:
                    reference[h] &= ~(1 << position)
    assert len(table) == len(reference)
    prompt = list(reference)[:50] + universe[:20].tolist()
    wanted = np.array([2**64 - 1] * 3, dtype=np.uint64)
    depth = np.full(3 * WORD_BITS, -1, dtype=np.int64)
    table.walk(np.array(prompt, dtype=np.uint64), wanted, depth)
    assert depth.tolist() == [leading(reference, prompt, p) for p in range(3 * WORD_BITS)]


def test_walk_leaves_unwanted_positions_and_reads_missing_words_as_empty() -> None:
    table = HolderTable()
    hashes = np.arange(1, 6, dtype=np.uint64)
    table.add(hashes, 0)
    table.add(hashes[:2], 1)
    depth = np.full(2 * WORD_BITS, -1, dtype=np.int64)
    # positions 1 and 64 asked for; the table has one word, so position 64 holds nothing
    table.walk(hashes, np.array([0b10, 1], dtype=np.uint64), depth)
    assert depth[1] == 2 and depth[64] == 0
    assert (np.delete(depth, [1, 64]) == -1).all()


def test_tombstones_do_not_hide_entries_behind_them() -> None:
    table = HolderTable()
    hashes = np.arange(2000, dtype=np.uint64)  # forces a growth past the first 1,024 slots
    table.add(hashes, 3)
    table.drop(hashes[::2], 3)
    assert len(table) == 1000
    depth = np.zeros(WORD_BITS, dtype=np.int64)
    table.walk(hashes[1::2].copy(), np.array([1 << 3], dtype=np.uint64), depth)
    assert depth[3] == 1000
    table.add(hashes[::2], 5)  # reinserted over tombstones
    assert len(table) == 2000
