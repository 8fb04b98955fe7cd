"""The prefix index contract every store implements (memory, Redis).

A key space is one (model, block_size): chained block hashes only compare within it. All methods are
async so Redis and memory share one call shape; the memory store never awaits I/O. Callers on the
request path wrap the store in `GuardedIndex` (kvindex/guard.py), which adds the deadline and treats any
failure as "nothing cached": the index is a hint, never a dependency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvindex.hashing import BlockHashes


class PrefixIndex(Protocol):
    async def match(
        self, model: str, block_size: int, hashes: BlockHashes, backend_ids: Sequence[str]
    ) -> list[int]:
        """For each backend id (same order), how many leading blocks of `hashes` it holds."""
        ...

    async def record(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        """Note that `backend_id` now holds these blocks (approximate mode, or a BlockStored event)."""
        ...

    async def remove(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        """Forget these blocks on one backend (a BlockRemoved event)."""
        ...

    async def clear_backend(self, backend_id: str) -> None:
        """Forget everything one backend holds (AllBlocksCleared, restart, removal)."""
        ...

    async def close(self) -> None: ...
