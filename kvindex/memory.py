"""The embedded prefix index: one process, no I/O (the default store).

Layout, chosen so `match` costs one dict lookup per block however many backends there are:
- per key space (model, block_size): block hash -> bitmask of the backend slots holding it;
- per backend: an LRU (OrderedDict, oldest first) of its blocks -> time last recorded, sized by the
  backend's capacity in blocks. All entries share one TTL, so the LRU's front is also the next to
  expire; a sweep drops expired entries at most every TTL/16 (and a backend's own on each record).

`match` walks the prompt's blocks AND-ing bitmasks, and stops as soon as no asked-for backend holds the
block. Recording a prompt touches its blocks tail first, so the prompt's head is the most recently used
and is evicted last (a backend keeps the start of a prefix longer than its end, as vLLM's free queue does).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from itertools import groupby, repeat
from operator import itemgetter

DEFAULT_CAPACITY_BLOCKS = 1_000_000
_BITS_CACHE_SIZE = 64
_HASH_MASK = (1 << 64) - 1
_FIRST_CHUNK = 16  # blocks in the walk's first chunk (then 64, 256, ...)
_BYTE_BITS = tuple(tuple(i for i in range(8) if byte >> i & 1) for byte in range(256))  # set bits per byte


class _Backend:
    __slots__ = ("bit", "capacity", "lru")

    def __init__(self, bit: int, capacity: int) -> None:
        self.bit = bit
        self.capacity = capacity
        # (space id << 64 | block hash) -> monotonic time it was last recorded. One int per key, not a
        # tuple: ~25% less memory per indexed block (bench/index_bench.py measures it).
        self.lru: OrderedDict[int, float] = OrderedDict()


class MemoryIndex:
    """In-process `PrefixIndex` with per-backend LRU capacity and a TTL."""

    def __init__(
        self,
        ttl_s: float = 600.0,
        capacity_blocks: Mapping[str, int] | None = None,
        default_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl_s
        self._capacities = dict(capacity_blocks or {})
        self._default_capacity = default_capacity_blocks
        self._clock = clock
        self._spaces: dict[tuple[str, int], int] = {}
        self._holders: list[dict[int, int]] = []  # per space id: block hash -> backend bitmask
        self._backends: dict[str, _Backend] = {}
        self._free_bits: list[int] = []
        self._generation = 0  # bumped when a backend's bit is assigned or freed
        self._bits_cache: dict[tuple[str, ...], tuple[int, int, dict[int, list[int]]]] = {}
        self._next_sweep = 0.0

    def set_capacity(self, backend_id: str, blocks: int) -> None:
        """Resize one backend (e.g. once vLLM's num_gpu_blocks is known); evicts at once if smaller."""
        self._capacities[backend_id] = blocks
        backend = self._backends.get(backend_id)
        if backend is not None:
            backend.capacity = blocks
            self._evict_over_capacity(backend)

    async def match(
        self, model: str, block_size: int, hashes: Sequence[int], backend_ids: Sequence[str]
    ) -> list[int]:
        return self.match_now(model, block_size, hashes, backend_ids)

    async def record(self, model: str, block_size: int, hashes: Sequence[int], backend_id: str) -> None:
        self.record_now(model, block_size, hashes, backend_id)

    def match_now(
        self, model: str, block_size: int, hashes: Sequence[int], backend_ids: Sequence[str]
    ) -> list[int]:
        """`match` without the coroutine, for synchronous callers (the discrete-event simulator)."""
        counts = [0] * len(backend_ids)
        space = self._spaces.get((model, block_size))
        if space is None or not hashes:
            return counts
        self._sweep_if_due()
        wanted, slot_of_bit = self._bits_of(backend_ids)
        self._walk(self._holders[space], hashes, wanted, slot_of_bit, counts)
        return counts

    def _bits_of(self, backend_ids: Sequence[str]) -> tuple[int, dict[int, list[int]]]:
        """The asked-for backends as one bitmask, and bit position -> their slots; cached per backend list
        (a model's list is the same on every request) until a backend appears or is cleared."""
        key = tuple(backend_ids)
        cached = self._bits_cache.get(key)
        if cached is not None and cached[0] == self._generation:
            return cached[1], cached[2]
        wanted = 0
        slot_of_bit: dict[int, list[int]] = {}
        for i, backend_id in enumerate(backend_ids):
            backend = self._backends.get(backend_id)
            if backend is not None:
                wanted |= backend.bit
                slot_of_bit.setdefault(backend.bit.bit_length() - 1, []).append(i)
        if len(self._bits_cache) >= _BITS_CACHE_SIZE:
            self._bits_cache.clear()
        self._bits_cache[key] = (self._generation, wanted, slot_of_bit)
        return wanted, slot_of_bit

    def _sweep_if_due(self) -> None:
        """Expire every backend's old entries, at most every TTL/16 (so entries live < 1.07 TTL)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._ttl / 16
        for backend in self._backends.values():
            self._expire(backend, now)

    @staticmethod
    def _walk(
        holders: dict[int, int],
        hashes: Sequence[int],
        alive: int,
        slot_of_bit: dict[int, list[int]],
        counts: list[int],
    ) -> None:
        """Leading blocks held per backend: AND the holders' bitmasks until nobody is left.

        Over chunks that grow 4x (a prompt nobody holds costs one short chunk), the masks are fetched
        by one C call (`itemgetter`) and walked in runs of equal masks (`groupby`, in C; a run's length
        by `list`, in C too): a run's mask is AND-ed once, so the Python work is per run, not per
        block. A prefix held by some backends is a few long runs; AND-ing every block as a Python int
        cost ~50 ns a block (2,048 blocks: most of the lookup)."""
        depth, size, total = 0, _FIRST_CHUNK, len(hashes)
        while alive and depth < total:
            chunk = hashes[depth : depth + size]
            at = depth
            for mask, run in groupby(_masks(holders, chunk)):
                if mask & alive != alive:
                    _set_counts(alive & ~mask, at, slot_of_bit, counts)
                    alive &= mask
                    if not alive:
                        break
                at += len(list(run))
            depth += len(chunk)
            size *= 4
        _set_counts(alive, total, slot_of_bit, counts)  # held the whole prompt

    def record_now(self, model: str, block_size: int, hashes: Sequence[int], backend_id: str) -> None:
        """`record` without the coroutine."""
        if not hashes:
            return
        backend = self._backend(backend_id)
        space = self._space(model, block_size)
        holders = self._holders[space]
        now = self._clock()
        lru, bit = backend.lru, backend.bit
        # A run of blocks with one holders' mask (one int object) gets one new object: equal masks that
        # are the same object compare by identity, which `_walk`'s `groupby` does first.
        last_old, last_new = -1, 0
        for block_hash in reversed(hashes):  # head last: most recently used, evicted last
            key = space << 64 | block_hash
            if key in lru:
                lru.move_to_end(key)
            old = holders.get(block_hash, 0)
            if old is not last_old:
                last_old, last_new = old, old | bit
            holders[block_hash] = last_new
            lru[key] = now
        self._expire(backend, now)
        self._evict_over_capacity(backend)

    async def remove(self, model: str, block_size: int, hashes: Sequence[int], backend_id: str) -> None:
        backend = self._backends.get(backend_id)
        space = self._spaces.get((model, block_size))
        if backend is None or space is None:
            return
        for block_hash in hashes:
            key = space << 64 | block_hash
            if backend.lru.pop(key, None) is not None:
                self._drop_holder(key, backend.bit)

    async def clear_backend(self, backend_id: str) -> None:
        backend = self._backends.pop(backend_id, None)
        if backend is None:
            return
        for key in backend.lru:
            self._drop_holder(key, backend.bit)
        backend.lru.clear()
        self._free_bits.append(backend.bit)
        self._generation += 1

    async def close(self) -> None:
        self._holders.clear()
        self._spaces.clear()
        self._backends.clear()

    def stats(self) -> dict[str, int]:
        """Sizes for benchmarks and debugging (no hashes, no ids)."""
        return {
            "backends": len(self._backends),
            "blocks": sum(len(h) for h in self._holders),
            "entries": sum(len(b.lru) for b in self._backends.values()),
        }

    def _backend(self, backend_id: str) -> _Backend:
        backend = self._backends.get(backend_id)
        if backend is None:
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._backends)
            capacity = self._capacities.get(backend_id, self._default_capacity)
            backend = self._backends[backend_id] = _Backend(bit, capacity)
            self._generation += 1
        return backend

    def _space(self, model: str, block_size: int) -> int:
        space = self._spaces.get((model, block_size))
        if space is None:
            space = self._spaces[(model, block_size)] = len(self._holders)
            self._holders.append({})
        return space

    def _expire(self, backend: _Backend, now: float) -> None:
        lru = backend.lru
        deadline = now - self._ttl
        while lru:
            key, touched = next(iter(lru.items()))
            if touched > deadline:
                return
            del lru[key]
            self._drop_holder(key, backend.bit)

    def _evict_over_capacity(self, backend: _Backend) -> None:
        lru = backend.lru
        while len(lru) > backend.capacity:
            key, _ = lru.popitem(last=False)
            self._drop_holder(key, backend.bit)

    def _drop_holder(self, key: int, bit: int) -> None:
        holders = self._holders[key >> 64]
        block_hash = key & _HASH_MASK
        mask = holders.get(block_hash, 0) & ~bit
        if mask:
            holders[block_hash] = mask
        else:
            holders.pop(block_hash, None)


def _masks(holders: dict[int, int], chunk: Sequence[int]) -> Sequence[int]:
    """The holders' bitmask of every block of `chunk` (0: nobody holds it), by one C call when every
    block is held (`itemgetter` of one key returns the value alone, not a 1-tuple)."""
    if len(chunk) > 1:
        try:
            masks: Sequence[int] = itemgetter(*chunk)(holders)
            return masks
        except KeyError:
            pass
    return tuple(map(holders.get, chunk, repeat(0)))


def _set_counts(bits: int, count: int, slot_of_bit: dict[int, list[int]], counts: list[int]) -> None:
    """Set `count` for every backend whose bit is in `bits` (`slot_of_bit`: bit position -> slots):
    byte by byte, a byte's set bits from a table. Peeling the lowest bit off a 64-bit int took four
    int operations a backend, as long as the rest of the lookup's Python work together."""
    at = 0
    for byte in bits.to_bytes((bits.bit_length() + 7) // 8, "little"):
        if byte:
            for i in _BYTE_BITS[byte]:
                for slot in slot_of_bit[at + i]:
                    counts[slot] = count
        at += 8
