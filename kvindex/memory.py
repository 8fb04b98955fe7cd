"""The embedded prefix index: one process, no I/O (the default store).

Layout, chosen so `match` costs one table lookup per block however many backends there are:
- per key space (model, block_size): a `HolderTable` (kvindex/holders.py), block hash -> bitmask of the
  positions of the backends holding it, in numpy arrays walked by compiled loops;
- per backend: an LRU (OrderedDict, oldest first) of its blocks -> time last recorded, sized by the
  backend's capacity in blocks. All entries share one TTL, so the LRU's front is also the next to
  expire; a sweep drops expired entries at most every TTL/16 (and a backend's own on each record).

`match` walks the prompt's blocks AND-ing bitmasks, and stops as soon as no asked-for backend holds the
block. Recording a prompt touches its blocks tail first, so the prompt's head is the most recently used
and is evicted last (a backend keeps the start of a prefix longer than its end, as vLLM's free queue does).
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from kvindex.hashing import BlockHashes, as_hash_array
from kvindex.holders import WORD_BITS, HolderTable

DEFAULT_CAPACITY_BLOCKS = 1_000_000
_POSITIONS_CACHE_SIZE = 64
_HASH_MASK = (1 << 64) - 1


class _Backend:
    __slots__ = ("capacity", "lru", "position")

    def __init__(self, position: int, capacity: int) -> None:
        self.position = position  # its bit in the holders' masks
        self.capacity = capacity
        # (space id << 64 | block hash) -> monotonic time it was last recorded. One int per key, not a
        # tuple: ~25% less memory per indexed block (bench/index_bench.py measures it).
        self.lru: OrderedDict[int, float] = OrderedDict()


class _Asked:
    """A list of asked-for backends, resolved: their positions as one mask, and each one's position
    (`unknown`, a position never set, for a backend the index has not seen)."""

    __slots__ = ("generation", "positions", "unknown", "wanted")

    def __init__(self, generation: int, positions: list[int | None], words: int) -> None:
        self.generation = generation
        self.unknown = words * WORD_BITS
        wanted = [0] * words
        for position in positions:
            if position is not None:
                wanted[position // WORD_BITS] |= 1 << position % WORD_BITS
        self.wanted = np.array(wanted, dtype=np.uint64)
        self.positions = np.array([self.unknown if p is None else p for p in positions], dtype=np.int64)


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
        self._tables: list[HolderTable] = []  # per space id
        self._backends: dict[str, _Backend] = {}
        self._free_positions: list[int] = []
        self._generation = 0  # bumped when a backend's position is assigned or freed
        self._asked: dict[tuple[str, ...], _Asked] = {}
        self._next_sweep = 0.0

    def set_capacity(self, backend_id: str, blocks: int) -> None:
        """Resize one backend (e.g. once vLLM's num_gpu_blocks is known); evicts at once if smaller."""
        self._capacities[backend_id] = blocks
        backend = self._backends.get(backend_id)
        if backend is not None:
            backend.capacity = blocks
            self._evict_over_capacity(backend)

    async def match(
        self, model: str, block_size: int, hashes: BlockHashes, backend_ids: Sequence[str]
    ) -> list[int]:
        return self.match_now(model, block_size, hashes, backend_ids)

    async def record(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        self.record_now(model, block_size, hashes, backend_id)

    def match_now(
        self, model: str, block_size: int, hashes: BlockHashes, backend_ids: Sequence[str]
    ) -> list[int]:
        """`match` without the coroutine, for synchronous callers (the discrete-event simulator)."""
        space = self._spaces.get((model, block_size))
        if space is None or len(hashes) == 0:
            return [0] * len(backend_ids)
        self._sweep_if_due()
        asked = self._resolve(backend_ids)
        depth = np.zeros(asked.unknown + 1, dtype=np.int64)
        self._tables[space].walk(as_hash_array(hashes), asked.wanted, depth)
        counts: list[int] = depth[asked.positions].tolist()
        return counts

    def _resolve(self, backend_ids: Sequence[str]) -> _Asked:
        """The asked-for backends' positions; cached per backend list (a model's list is the same on
        every request) until a backend appears or is cleared."""
        key = tuple(backend_ids)
        cached = self._asked.get(key)
        if cached is not None and cached.generation == self._generation:
            return cached
        positions = [b.position if (b := self._backends.get(i)) is not None else None for i in backend_ids]
        words = 1 + max((b.position for b in self._backends.values()), default=0) // WORD_BITS
        if len(self._asked) >= _POSITIONS_CACHE_SIZE:
            self._asked.clear()
        asked = self._asked[key] = _Asked(self._generation, positions, words)
        return asked

    def _sweep_if_due(self) -> None:
        """Expire every backend's old entries, at most every TTL/16 (so entries live < 1.07 TTL)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._ttl / 16
        for backend in self._backends.values():
            self._expire(backend, now)

    def record_now(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        """`record` without the coroutine."""
        if len(hashes) == 0:
            return
        backend = self._backend(backend_id)
        space = self._space(model, block_size)
        blocks = as_hash_array(hashes)
        self._tables[space].add(blocks, backend.position)
        now = self._clock()
        lru, base = backend.lru, space << 64
        for block_hash in reversed(blocks.tolist()):  # head last: most recently used, evicted last
            key = base | block_hash
            if key in lru:
                lru.move_to_end(key)
            lru[key] = now
        self._expire(backend, now)
        self._evict_over_capacity(backend)

    async def remove(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        backend = self._backends.get(backend_id)
        space = self._spaces.get((model, block_size))
        if backend is None or space is None:
            return
        base, lru = space << 64, backend.lru
        held = [key for h in as_hash_array(hashes).tolist() if lru.pop(key := base | h, None) is not None]
        self._drop(held, backend)

    async def clear_backend(self, backend_id: str) -> None:
        backend = self._backends.pop(backend_id, None)
        if backend is None:
            return
        self._drop(backend.lru, backend)
        backend.lru.clear()
        self._free_positions.append(backend.position)
        self._generation += 1

    async def close(self) -> None:
        self._tables.clear()
        self._spaces.clear()
        self._backends.clear()

    def stats(self) -> dict[str, int]:
        """Sizes for benchmarks and debugging (no hashes, no ids)."""
        return {
            "backends": len(self._backends),
            "blocks": sum(len(t) for t in self._tables),
            "entries": sum(len(b.lru) for b in self._backends.values()),
        }

    def _backend(self, backend_id: str) -> _Backend:
        backend = self._backends.get(backend_id)
        if backend is None:
            position = self._free_positions.pop() if self._free_positions else len(self._backends)
            capacity = self._capacities.get(backend_id, self._default_capacity)
            backend = self._backends[backend_id] = _Backend(position, capacity)
            self._generation += 1
        return backend

    def _space(self, model: str, block_size: int) -> int:
        space = self._spaces.get((model, block_size))
        if space is None:
            space = self._spaces[(model, block_size)] = len(self._tables)
            self._tables.append(HolderTable())
        return space

    def _expire(self, backend: _Backend, now: float) -> None:
        lru = backend.lru
        deadline = now - self._ttl
        expired: list[int] = []
        while lru:
            key, touched = next(iter(lru.items()))
            if touched > deadline:
                break
            del lru[key]
            expired.append(key)
        self._drop(expired, backend)

    def _evict_over_capacity(self, backend: _Backend) -> None:
        lru = backend.lru
        over = len(lru) - backend.capacity
        if over > 0:
            self._drop([lru.popitem(last=False)[0] for _ in range(over)], backend)

    def _drop(self, keys: Iterable[int], backend: _Backend) -> None:
        """Clear the backend's bit on these (space << 64 | hash) keys, one table call per space."""
        per_space: defaultdict[int, list[int]] = defaultdict(list)
        for key in keys:
            per_space[key >> 64].append(key & _HASH_MASK)
        for space, hashes in per_space.items():
            self._tables[space].drop(as_hash_array(hashes), backend.position)
