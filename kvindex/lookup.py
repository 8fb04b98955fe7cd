"""The two index calls on the request path, in the shape the router wants.

`cached_tokens` before routing (one `match` per distinct block size among the model's backends, which
is one call in the usual single-size cluster) and `record_routed` after it (approximate mode: assume
the chosen backend now holds the prompt's blocks; KV events correct it where they are enabled).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np

from kvindex.base import PrefixIndex


async def cached_tokens(
    index: PrefixIndex,
    model: str,
    prompt_tokens: int,
    block_hashes: Mapping[int, Sequence[int]],
    backend_ids: Sequence[str],
    block_sizes: Sequence[int],
) -> np.ndarray:
    """Leading prompt tokens each backend (same order) holds, capped at `prompt_tokens`."""
    result = np.zeros(len(backend_ids), dtype=np.int64)
    groups: dict[int, list[int]] = {}
    for i, size in enumerate(block_sizes):
        groups.setdefault(size, []).append(i)
    sizes = [s for s in groups if block_hashes.get(s)]
    replies = await asyncio.gather(
        *(index.match(model, s, block_hashes[s], [backend_ids[i] for i in groups[s]]) for s in sizes)
    )
    for size, counts in zip(sizes, replies, strict=True):
        result[groups[size]] = np.asarray(counts, dtype=np.int64) * size
    return np.minimum(result, max(prompt_tokens, 0))


async def record_routed(
    index: PrefixIndex,
    model: str,
    block_hashes: Mapping[int, Sequence[int]],
    backend_id: str,
    block_size: int,
) -> None:
    """Note that `backend_id` now holds the prompt's full blocks (call once the backend accepted it)."""
    hashes = block_hashes.get(block_size)
    if hashes:
        await index.record(model, block_size, hashes, backend_id)
