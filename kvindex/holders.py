"""Which backends hold each block of one key space: block hash -> bitmask of backend positions.

An open-addressing hash table (linear probing, multiplicative hashing) in numpy arrays, so that the
prompt walk of `MemoryIndex.match` is one compiled loop (`scoring/jit.py`): a 32k-token prompt is 2,048
lookups, ~150 us as Python dict lookups and ~10 us here. A mask is `words` uint64 columns, one bit per
backend position (position p is bit p % 64 of word p // 64), so any number of backends fit.

Deleted entries leave a tombstone until the next rebuild. A rebuild (to the smallest power of two
that keeps the table at most a quarter full) runs before an insertion could take it past half full,
counting tombstones, so a probe meets an empty slot within a few steps.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from scoring.jit import kernel

_EMPTY, _FULL, _GONE = 0, 1, 2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / phi: multiplicative hashing spreads even structured keys
_MIN_SLOTS = 1024
WORD_BITS = 64

U64Array = npt.NDArray[np.uint64]
# The table's arrays, as its kernels take them: keys, slot states, masks [slot, word], and the shift that
# turns a hash into its first slot.
Arrays = tuple[U64Array, npt.NDArray[np.uint8], U64Array, int]


class HolderTable:
    """Block hash -> holders' bitmask, for one key space (model, block size)."""

    def __init__(self, words: int = 1, slots: int = _MIN_SLOTS) -> None:
        self._allocate(slots, words)
        self.size = 0  # entries held
        self._taken = 0  # entries held and tombstones: what probes walk over

    def __len__(self) -> int:
        return self.size

    def add(self, hashes: U64Array, position: int) -> None:
        """Mark every block of `hashes` as held by backend `position`."""
        word, bit = divmod(position, WORD_BITS)
        if word >= self.masks.shape[1]:
            self._rebuild(self.keys.shape[0], word + 1)
        if 2 * (self._taken + len(hashes)) > self.keys.shape[0]:
            self._rebuild(_slots_for(self.size + len(hashes)), self.masks.shape[1])
        added, reused = _add(self._arrays(), hashes, word, _bit(bit))
        self.size += added
        self._taken += added - reused

    def drop(self, hashes: U64Array, position: int) -> None:
        """Backend `position` no longer holds these blocks; a block nobody holds leaves the table."""
        word, bit = divmod(position, WORD_BITS)
        if word < self.masks.shape[1]:
            self.size -= _drop(self._arrays(), hashes, word, _bit(bit))

    def walk(self, hashes: U64Array, wanted: U64Array, depth: npt.NDArray[np.int64]) -> None:
        """Per backend position in `wanted` (a mask of any number of words), the number of leading
        blocks of `hashes` it holds, into `depth[position]` (other positions are left as they are)."""
        _walk(self._arrays(), hashes, wanted, depth)

    def _arrays(self) -> Arrays:
        return self.keys, self.state, self.masks, self._shift

    def _allocate(self, slots: int, words: int) -> None:
        self.keys = np.zeros(slots, dtype=np.uint64)
        self.state = np.zeros(slots, dtype=np.uint8)
        self.masks = np.zeros((slots, words), dtype=np.uint64)
        self._shift = 64 - (slots.bit_length() - 1)

    def _rebuild(self, slots: int, words: int) -> None:
        old = self._arrays()
        self._allocate(slots, words)
        _rehash(old, self._arrays())
        self._taken = self.size


def _slots_for(entries: int) -> int:
    """The smallest power of two at least four times `entries` (and at least `_MIN_SLOTS`)."""
    return max(_MIN_SLOTS, 1 << (4 * entries - 1).bit_length())


def _bit(bit: int) -> np.uint64:
    return np.uint64(1 << bit)


@kernel
def _home(block_hash: np.uint64, shift: int) -> int:
    """A hash's first slot: the top bits of hash x golden ratio (the product wraps at 64 bits)."""
    return int(np.int64((block_hash * _GOLDEN) >> np.uint64(shift)))  # < 2^63: shift >= 1


@kernel
def _find(table: Arrays, block_hash: np.uint64) -> int:
    """The slot holding `block_hash`, or -1."""
    keys, state, _, shift = table
    last = keys.shape[0] - 1
    slot = _home(block_hash, shift)
    while state[slot] != _EMPTY:
        if state[slot] == _FULL and keys[slot] == block_hash:
            return slot
        slot = (slot + 1) & last
    return -1


@kernel
def _add(table: Arrays, hashes: U64Array, word: int, bit: np.uint64) -> tuple[int, int]:
    """OR `bit` into word `word` of each block's mask, inserting the blocks not yet held. Returns the
    entries added and how many of them reused a tombstone."""
    keys, state, masks, shift = table
    last = keys.shape[0] - 1
    added = 0
    reused = 0
    for block_hash in hashes:
        slot = _home(block_hash, shift)
        free = -1
        while state[slot] != _EMPTY:
            if state[slot] == _FULL and keys[slot] == block_hash:
                break
            if state[slot] == _GONE and free < 0:
                free = slot
            slot = (slot + 1) & last
        if state[slot] != _FULL:
            if free >= 0:
                slot = free
                reused += 1
            keys[slot] = block_hash
            state[slot] = _FULL
            masks[slot, :] = 0
            added += 1
        masks[slot, word] |= bit
    return added, reused


@kernel
def _drop(table: Arrays, hashes: U64Array, word: int, bit: np.uint64) -> int:
    """Clear `bit` in each block's mask; entries left with no holder become tombstones. Returns how
    many did."""
    _, state, masks, _ = table
    removed = 0
    for block_hash in hashes:
        slot = _find(table, block_hash)
        if slot < 0 or masks[slot, word] & bit == 0:
            continue
        masks[slot, word] &= ~bit
        if not masks[slot].any():
            state[slot] = _GONE
            removed += 1
    return removed


@kernel
def _walk(table: Arrays, hashes: U64Array, wanted: U64Array, depth: npt.NDArray[np.int64]) -> None:
    """AND the blocks' masks from the first block on; a position leaving the AND at block i held i
    leading blocks. Stops as soon as no wanted position is left."""
    masks = table[2]
    alive = wanted.copy()
    words = min(wanted.shape[0], masks.shape[1])
    for w in range(words, wanted.shape[0]):  # positions beyond the table's words hold nothing here
        _settle(alive[w], w, 0, depth)
        alive[w] = 0
    left = bool(alive.any())
    for i in range(hashes.shape[0]):
        if not left:
            return
        slot = _find(table, hashes[i])
        left = False
        for w in range(words):
            held = masks[slot, w] if slot >= 0 else np.uint64(0)
            _settle(alive[w] & ~held, w, i, depth)
            alive[w] &= held
            left = left or alive[w] != 0
    for w in range(words):
        _settle(alive[w], w, hashes.shape[0], depth)


@kernel
def _settle(bits: np.uint64, word: int, count: int, depth: npt.NDArray[np.int64]) -> None:
    """`depth[position] = count` for every position set in `bits` (of word `word`)."""
    while bits:
        low = bits & (~bits + np.uint64(1))  # the lowest set bit
        depth[word * 64 + _bit_index(low)] = count
        bits ^= low


@kernel
def _bit_index(single_bit: np.uint64) -> int:
    index = 0
    while single_bit > np.uint64(1):
        single_bit >>= np.uint64(1)
        index += 1
    return index


@kernel
def _rehash(old: Arrays, new: Arrays) -> None:
    """Insert every held entry of the old arrays into the new (empty) ones; tombstones are dropped and
    masks keep their words (the new arrays may have more)."""
    keys, state, masks, _ = old
    new_keys, new_state, new_masks, shift = new
    last = new_keys.shape[0] - 1
    words = masks.shape[1]
    for entry in range(keys.shape[0]):
        if state[entry] != _FULL:
            continue
        slot = _home(keys[entry], shift)
        while new_state[slot] != _EMPTY:
            slot = (slot + 1) & last
        new_keys[slot] = keys[entry]
        new_state[slot] = _FULL
        new_masks[slot, :words] = masks[entry]


def compile_kernels() -> None:
    """Compile (or load from numba's cache) the table's kernels for the types the index calls them
    with, so no request waits for a compile."""
    table = HolderTable(words=1, slots=_MIN_SLOTS)
    hashes = np.arange(3, dtype=np.uint64)
    table.add(hashes, 65)
    table.walk(hashes, np.ones(2, dtype=np.uint64), np.zeros(2 * WORD_BITS, dtype=np.int64))
    table.drop(hashes, 65)
    table._rebuild(_MIN_SLOTS, 2)
