"""Prefix/KV-cache index: block hashing, stores (memory, Redis), the guard, and vLLM KV events.

`build_index(...)` is the one constructor the gateway calls in its lifespan; it returns a
`GuardedIndex`, so callers never handle store failures themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from kvindex import holders, xxh3
from kvindex.base import PrefixIndex
from kvindex.guard import FailureCallback, GuardedIndex, failure_counter
from kvindex.memory import DEFAULT_CAPACITY_BLOCKS, MemoryIndex
from kvindex.prompt import PromptHasher

__all__ = [
    "GuardedIndex",
    "MemoryIndex",
    "PromptHasher",
    "build_index",
    "compile_kernels",
    "failure_counter",
]


def compile_kernels() -> None:
    """Compile (or load from numba's cache) the index's kernels: block hashing (`kvindex/xxh3.py`) and
    the memory store's table (`kvindex/holders.py`). `build_index` runs this, so no request (nor the
    event loop) waits for a compile."""
    xxh3.compile_kernels()
    holders.compile_kernels()


def build_index(
    store: Literal["memory", "redis"] = "memory",
    *,
    redis_url: str = "redis://127.0.0.1:6379/0",
    key_prefix: str = "hetgate",
    ttl_s: float = 600.0,
    deadline_ms: float = 20.0,
    write_deadline_ms: float = 250.0,
    capacity_blocks: Mapping[str, int] | None = None,
    default_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    on_failure: FailureCallback | None = None,
    retry_after_s: float = 1.0,
) -> GuardedIndex:
    """A guarded store built from `index:` settings (gateway.config.IndexConfig's fields).

    Creating the Redis client does not connect; the first call does, under the guard's deadline.
    """
    compile_kernels()
    inner: PrefixIndex
    if store == "redis":
        from kvindex.redis import RedisIndex

        socket_timeout_s = max(0.05, 2 * max(deadline_ms, write_deadline_ms) / 1000)
        inner = RedisIndex.from_url(
            redis_url,
            socket_timeout_s=socket_timeout_s,
            key_prefix=key_prefix,
            ttl_s=ttl_s,
            capacity_blocks=capacity_blocks,
            default_capacity_blocks=default_capacity_blocks,
        )
    elif store == "memory":
        inner = MemoryIndex(
            ttl_s=ttl_s, capacity_blocks=capacity_blocks, default_capacity_blocks=default_capacity_blocks
        )
    else:
        raise ValueError(f"index.store must be 'memory' or 'redis', not {store!r}")
    return GuardedIndex(
        inner,
        deadline_s=deadline_ms / 1000,
        on_failure=on_failure,
        retry_after_s=retry_after_s,
        write_deadline_s=write_deadline_ms / 1000,
    )
