"""GuardedIndex over a real Redis that dies, hangs (SIGSTOP) and comes back."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry, Counter
from redis_server import RedisServer

from kvindex import build_index, failure_counter
from kvindex.guard import GuardedIndex
from kvindex.memory import MemoryIndex

pytestmark = pytest.mark.redis

MODEL = "tiny"
BS = 16
PROMPT = [(0x9E3779B97F4A7C15 * (i + 1)) % 2**64 for i in range(8)]
DEADLINE_MS = 50
RETRY_AFTER_S = 0.2
# Generous bound on a guarded call's wall time: the deadline plus scheduling slack on a busy 2-core box.
RETURN_BOUND_S = 0.5


@pytest.fixture
def failures() -> Counter:
    return Counter("index_failures", "test", ["op", "reason"], registry=CollectorRegistry())


def _count(counter: Counter, op: str, reason: str) -> float:
    return counter.labels(op=op, reason=reason)._value.get()


def _guarded(server: RedisServer, failures: Counter) -> GuardedIndex:
    return build_index(
        "redis",
        redis_url=server.url,
        key_prefix=f"test-{uuid.uuid4().hex}",
        deadline_ms=DEADLINE_MS,
        on_failure=failure_counter(failures),
        retry_after_s=RETRY_AFTER_S,
    )


async def _timed_match(index: GuardedIndex) -> tuple[list[int], float]:
    start = time.perf_counter()
    counts = await index.match(MODEL, BS, PROMPT, ["a", "b"])
    return counts, time.perf_counter() - start


async def _wait_until_matches(
    index: GuardedIndex, expected: list[int], write_first: str | None = None, timeout_s: float = 10
) -> None:
    """Retry (optionally recording on `write_first`) until the store answers `expected` again."""
    deadline = time.monotonic() + timeout_s
    while True:
        if write_first:
            await index.record(MODEL, BS, PROMPT, write_first)
        if await index.match(MODEL, BS, PROMPT, ["a", "b"]) == expected:
            return
        assert time.monotonic() < deadline, "the guard did not recover"
        await asyncio.sleep(RETRY_AFTER_S / 2)


async def test_killed_redis_gives_zeros_then_recovers_after_restart(
    redis_server_factory, failures: Counter
) -> None:
    server = redis_server_factory()
    index = _guarded(server, failures)
    await index.record(MODEL, BS, PROMPT, "a")
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [8, 0]

    server.kill()
    counts, elapsed = await _timed_match(index)
    assert counts == [0, 0] and elapsed < RETURN_BOUND_S
    assert _count(failures, "match", "error") + _count(failures, "match", "timeout") == 1
    await index.record(MODEL, BS, PROMPT, "b")  # writes trip on their own: this one tries, and fails
    assert _count(failures, "record", "error") + _count(failures, "record", "timeout") == 1
    await index.record(MODEL, BS, PROMPT, "b")  # ... and the next is dropped at once
    assert _count(failures, "record", "open") == 1

    server.start()  # same port, empty (no persistence): only what is written after the restart
    await _wait_until_matches(index, [0, 8], write_first="b")
    assert index.healthy
    await index.close()


async def test_stopped_redis_answers_within_deadline_then_recovers(
    redis_server_factory, failures: Counter
) -> None:
    server = redis_server_factory()
    index = _guarded(server, failures)
    await index.record(MODEL, BS, PROMPT, "a")

    server.pause()
    try:
        counts, elapsed = await _timed_match(index)
        assert counts == [0, 0] and elapsed < RETURN_BOUND_S
        assert _count(failures, "match", "timeout") == 1
        counts, elapsed = await _timed_match(index)  # open: answered at once, still counted
        assert counts == [0, 0] and elapsed < RETURN_BOUND_S
        assert _count(failures, "match", "open") == 1
        await asyncio.sleep(RETRY_AFTER_S)
        counts, elapsed = await _timed_match(index)  # half-open trial, still hung
        assert counts == [0, 0] and elapsed < RETURN_BOUND_S
        assert _count(failures, "match", "timeout") == 2
    finally:
        server.resume()

    await _wait_until_matches(index, [8, 0])
    assert index.healthy
    await index.close()


async def test_guard_passes_results_through_and_counts_nothing(failures: Counter) -> None:
    index = GuardedIndex(MemoryIndex(), on_failure=failure_counter(failures))
    await index.record(MODEL, BS, PROMPT, "a")
    assert await index.match(MODEL, BS, PROMPT[:5], ["a", "b"]) == [5, 0]
    await index.remove(MODEL, BS, PROMPT[2:3], "a")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [2]
    await index.clear_backend("a")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [0]
    assert sum(s.value for m in failures.collect() for s in m.samples if s.name.endswith("_total")) == 0


class _BrokenStore(MemoryIndex):
    async def match(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionError("store unreachable")


async def test_guard_turns_errors_into_zeros(failures: Counter) -> None:
    index = GuardedIndex(_BrokenStore(), on_failure=failure_counter(failures), retry_after_s=0)
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 0]
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 0]
    assert _count(failures, "match", "error") == 2


class _SlowWrites(MemoryIndex):
    async def record(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.2)
        await super().record(*args, **kwargs)


async def test_a_slow_write_does_not_blank_lookups(failures: Counter) -> None:
    store = _SlowWrites()
    await MemoryIndex.record(store, MODEL, BS, PROMPT, "a")
    index = GuardedIndex(store, on_failure=failure_counter(failures), write_deadline_s=0.05)
    await index.record(MODEL, BS, PROMPT, "b")
    assert _count(failures, "record", "timeout") == 1
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [8, 0]
    assert index.healthy
