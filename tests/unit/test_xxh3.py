"""`kvindex/xxh3.py` against the `xxhash` library: the compiled chain must give the library's hashes
bit for bit, for every chunk size it takes, any data and any seed (the request path's hashes must meet
the hashes built from vLLM's KV events, and earlier gateways' entries in a shared Redis index)."""

from __future__ import annotations

import random

import pytest
import xxhash

from kvindex import xxh3
from kvindex.hashing import TOKEN_BYTES, chain_hash_array, chain_hashes

SIZES = [size for size in range(1, 300) if xxh3.compiled_size(size)]


def library_chain(data: bytes, size: int, root: int) -> list[int]:
    hashes, parent = [], root
    for start in range(0, len(data) - size + 1, size):
        parent = xxhash.xxh3_64_intdigest(data[start : start + size], parent)
        hashes.append(parent)
    return hashes


def test_the_compiled_sizes_are_the_mid_sizes_in_whole_words() -> None:
    assert list(range(24, 241, 8)) == SIZES
    assert 16 * TOKEN_BYTES in SIZES and 32 * TOKEN_BYTES in SIZES  # vLLM's usual block sizes


@pytest.mark.parametrize("size", SIZES)
def test_compiled_chain_equals_the_library(size: int) -> None:
    rng = random.Random(size)
    for _ in range(25):
        data = rng.randbytes(rng.randrange(0, 6) * size + rng.randrange(0, size))  # a partial tail too
        root = rng.choice([0, 1, 2**63, 2**64 - 1, rng.getrandbits(64)])
        assert xxh3.chained(data, size, root).tolist() == library_chain(data, size, root)


@pytest.mark.parametrize("size", [8, 16, 64 * TOKEN_BYTES, 20])
def test_other_sizes_are_hashed_by_the_library(size: int) -> None:
    data = random.Random(size).randbytes(10 * size + 3)
    assert not xxh3.compiled_size(size)
    assert chain_hashes(data, size, 7) == library_chain(data, size, 7)
    assert chain_hash_array(data, size, 7).tolist() == library_chain(data, size, 7)
