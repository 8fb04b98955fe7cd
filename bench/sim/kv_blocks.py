"""The KV cache in blocks with prefix caching: `BlockPool` (reference counts, hash -> block map, LRU free
queue, vLLM-shaped KV events) and `chained_block_hashes` (the prompt block hashes it is keyed by).

Freed blocks keep their hash and sit in the LRU free queue (a request's tail blocks first), evicted only when
allocation needs them; evictions go to `events` as vLLM's event maps (`SchedulerCore` publishes them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


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


def chained_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained u64 hashes of the full blocks of `token_ids`; deterministic across processes
    (tuples of ints hash without PYTHONHASHSEED)."""
    hashes = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size]))) & 0xFFFFFFFFFFFFFFFF
        hashes.append(parent)
    return hashes
