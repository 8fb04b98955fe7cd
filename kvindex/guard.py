"""`GuardedIndex`: the deadline and failure policy around any prefix index store.

The index is a hint, never a dependency. Every call gets a deadline (default 20 ms for `match`, which
is on the request path; 250 ms for writes, which the gateway runs in the background and which carry a
whole prompt's blocks); a timeout or any error makes `match` answer "nothing cached" (zeros) and makes
writes a no-op, and `on_failure(op, reason)` is called so the gateway can count it (pass
`failure_counter(counter)` for a prometheus Counter with labels `op` and `reason`). After a failure the
guard stops calling the store for `retry_after_s` (answering at once, reason "open") so a hung Redis does
not cost every request its full deadline; the first call after that tries the store again, so the guard
recovers by itself once the store is back. Reads and writes trip separately: a slow background write
never blanks the lookups of the requests that follow it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvindex.base import PrefixIndex
from kvindex.hashing import BlockHashes

log = logging.getLogger(__name__)

FailureCallback = Callable[[str, str], None]
_READ, _WRITE = "read", "write"
T = TypeVar("T")


def failure_counter(counter: Any) -> FailureCallback:
    """Adapts a prometheus Counter with labels (op, reason) to `on_failure`."""
    return lambda op, reason: counter.labels(op=op, reason=reason).inc()


class GuardedIndex:
    """Wraps a `PrefixIndex`; same methods, never raises, never waits past the deadline."""

    def __init__(
        self,
        store: PrefixIndex,
        deadline_s: float = 0.020,
        on_failure: FailureCallback | None = None,
        retry_after_s: float = 1.0,
        write_deadline_s: float = 0.250,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._deadlines = {_READ: deadline_s, _WRITE: write_deadline_s}
        self._on_failure = on_failure
        self._retry_after = retry_after_s
        self._clock = clock
        self._open_until = {_READ: 0.0, _WRITE: 0.0}

    @property
    def healthy(self) -> bool:
        """False while the guard is skipping the store for lookups after a failure."""
        return self._clock() >= self._open_until[_READ]

    async def match(
        self, model: str, block_size: int, hashes: BlockHashes, backend_ids: Sequence[str]
    ) -> list[int]:
        zeros = [0] * len(backend_ids)
        if len(hashes) == 0 or not backend_ids:
            return zeros
        result = await self._call("match", self.store.match(model, block_size, hashes, backend_ids))
        return zeros if result is None else result

    async def record(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        if len(hashes):
            await self._call("record", self.store.record(model, block_size, hashes, backend_id))

    async def remove(self, model: str, block_size: int, hashes: BlockHashes, backend_id: str) -> None:
        if len(hashes):
            await self._call("remove", self.store.remove(model, block_size, hashes, backend_id))

    async def clear_backend(self, backend_id: str) -> None:
        await self._call("clear_backend", self.store.clear_backend(backend_id))

    async def close(self) -> None:
        try:
            await self.store.close()
        except Exception:
            log.warning("prefix index store failed to close", exc_info=True)

    async def _call(self, op: str, call: Awaitable[T]) -> T | None:
        kind = _READ if op == "match" else _WRITE
        if self._clock() < self._open_until[kind]:
            _discard(call)
            self._failed(op, "open")
            return None
        try:
            async with asyncio.timeout(self._deadlines[kind]):
                return await call
        except TimeoutError:
            self._trip(kind, op, "timeout")
        except Exception as exc:
            log.warning("prefix index %s failed: %s", op, type(exc).__name__)
            self._trip(kind, op, "error")
        return None

    def _trip(self, kind: str, op: str, reason: str) -> None:
        self._open_until[kind] = self._clock() + self._retry_after
        self._failed(op, reason)

    def _failed(self, op: str, reason: str) -> None:
        if self._on_failure is not None:
            self._on_failure(op, reason)


def _discard(call: Awaitable[Any]) -> None:
    """Close a coroutine we decided not to run (avoids 'never awaited' warnings)."""
    close = getattr(call, "close", None)
    if close is not None:
        close()
