"""Fixtures for the PrefixIndex contract: the same suite runs against every store."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helper

from redis_server import RedisServer, redis_server, redis_server_factory

from kvindex.memory import MemoryIndex
from kvindex.redis import RedisIndex

__all__ = ["redis_server", "redis_server_factory"]


def make_store(kind: str, server: RedisServer | None, **kwargs: object) -> MemoryIndex | RedisIndex:
    if kind == "memory":
        return MemoryIndex(**kwargs)  # type: ignore[arg-type]
    assert server is not None
    # A fresh key prefix per test: tests share one server but never each other's keys.
    return RedisIndex.from_url(server.url, key_prefix=f"test-{uuid.uuid4().hex}", **kwargs)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server_for(store_kind: str, request: pytest.FixtureRequest) -> RedisServer | None:
    return request.getfixturevalue("redis_server") if store_kind == "redis" else None


@pytest.fixture
async def store_factory(store_kind: str, server_for: RedisServer | None) -> AsyncIterator[object]:
    made: list[MemoryIndex | RedisIndex] = []

    def factory(**kwargs: object) -> MemoryIndex | RedisIndex:
        made.append(make_store(store_kind, server_for, **kwargs))
        return made[-1]

    yield factory
    for store in made:
        await store.close()


@pytest.fixture
def index(store_factory):  # type: ignore[no-untyped-def]
    return store_factory()
