"""What only the Redis store promises: one round trip, TTLs, validated values, no text stored."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from redis_server import RedisServer

from kvindex.redis import InvalidReply, RedisIndex, _validated_counts

pytestmark = pytest.mark.redis

MODEL = "tiny"
BS = 16
PROMPT = [(0x9E3779B97F4A7C15 * (i + 1)) % 2**64 for i in range(8)]


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex}"


@pytest.fixture
async def index(redis_server: RedisServer, prefix: str):
    store = RedisIndex.from_url(redis_server.url, key_prefix=prefix)
    yield store
    await store.close()


def _keys(server: RedisServer, prefix: str) -> list[bytes]:
    with server.sync_client() as client:
        return sorted(client.scan_iter(match=f"{{{prefix}}}:*"))


def _client_commands_between_markers(
    server: RedisServer, marker: str, monitoring: threading.Event
) -> list[str]:
    """Commands sent by clients (not by scripts) between two ECHO markers, read from MONITOR."""
    commands: list[str] = []
    with server.sync_client() as client, client.monitor() as monitor:
        monitoring.set()  # MONITOR has been acknowledged: every later command is seen
        seen_start = False
        while True:
            entry = monitor.next_command()
            command = entry["command"]
            if command == f"ECHO {marker}-start":
                seen_start = True
            elif command == f"ECHO {marker}-end":
                return commands
            elif seen_start and entry["client_type"] != "lua":
                commands.append(command.split(" ", 1)[0].upper())


async def test_one_round_trip_per_match(index: RedisIndex, redis_server: RedisServer) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    await index.match(MODEL, BS, PROMPT, ["a"])  # loads the script if this server lacks it
    marker = uuid.uuid4().hex
    monitoring = threading.Event()
    watcher = asyncio.create_task(
        asyncio.to_thread(_client_commands_between_markers, redis_server, marker, monitoring)
    )
    assert await asyncio.to_thread(monitoring.wait, 10)
    with redis_server.sync_client() as client:
        client.echo(f"{marker}-start")
        ids = [f"be-{i}" for i in range(64)]
        assert await index.match(MODEL, BS, PROMPT, ["a", *ids]) == [8] + [0] * 64
        client.echo(f"{marker}-end")
    assert await asyncio.wait_for(watcher, 10) == ["EVALSHA"]


async def test_layout_every_key_has_a_ttl_and_holds_only_hashes(
    index: RedisIndex, redis_server: RedisServer, prefix: str
) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    await index.record(MODEL, BS, PROMPT[:2], "b")
    block_keys = {_block_key(prefix, i) for i in range(len(PROMPT))}
    backend_keys = {f"{{{prefix}}}:backend:{b}".encode() for b in "ab"}
    slot_keys = {f"{{{prefix}}}:{name}".encode() for name in ("slots", "slots:next", "oldest")}
    assert set(_keys(redis_server, prefix)) == block_keys | backend_keys | slot_keys
    with redis_server.sync_client() as client:
        for key in block_keys | backend_keys | slot_keys:
            assert 0 < client.pttl(key) <= 2 * 600_000
        assert client.hgetall(f"{{{prefix}}}:slots") == {b"a": b"0", b"b": b"1"}
        first, last = _block_key(prefix, 0), _block_key(prefix, len(PROMPT) - 1)
        assert client.get(first) == bytes([0b1100_0000]) and client.get(last) == bytes([0b1000_0000])
        assert set(client.zrange(f"{{{prefix}}}:backend:a", 0, -1)) == block_keys


def _block_key(prefix: str, block: int) -> bytes:
    return f"{{{prefix}}}:{MODEL}:{BS}:".encode() + PROMPT[block].to_bytes(8, "big")


async def test_oversized_block_value_counts_as_absent(
    index: RedisIndex, redis_server: RedisServer, prefix: str
) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    with redis_server.sync_client() as client:
        client.set(_block_key(prefix, 3), b"\xff" * 9000)  # longer than any valid bitmap
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [3]


@pytest.mark.parametrize("garbage", [b"x", b"-1", b"1.5", b"70000", b""])
async def test_garbage_slot_counts_as_absent_and_is_remapped(
    index: RedisIndex, redis_server: RedisServer, prefix: str, garbage: bytes
) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    with redis_server.sync_client() as client:
        client.hset(f"{{{prefix}}}:slots", "a", garbage)
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [0]
    await index.record(MODEL, BS, PROMPT[:3], "a")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [3]


async def test_wrong_type_key_stops_the_match_and_is_overwritten(
    index: RedisIndex, redis_server: RedisServer, prefix: str
) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    with redis_server.sync_client() as client:
        client.delete(_block_key(prefix, 2))
        client.hset(_block_key(prefix, 2), "a", "foreign hash")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [2]
    await index.record(MODEL, BS, PROMPT, "a")
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [8]


async def test_lost_backend_set_retires_the_slot(redis_server: RedisServer, prefix: str) -> None:
    """If a backend's set vanished uncleaned (maxmemory), its bits are believed at most one TTL."""
    index = RedisIndex.from_url(redis_server.url, key_prefix=prefix, ttl_s=0.3)
    await index.record(MODEL, BS, PROMPT, "a")
    with redis_server.sync_client() as client:
        client.delete(f"{{{prefix}}}:backend:a")
    await asyncio.sleep(0.35)
    assert await index.match(MODEL, BS, PROMPT, ["a"]) == [0]
    await index.record(MODEL, BS, PROMPT[:1], "b")  # must not inherit a's old slot or bits
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 1]
    with redis_server.sync_client() as client:
        assert client.hgetall(f"{{{prefix}}}:slots") == {b"b": b"1"}
    await index.close()


async def test_removing_every_block_releases_the_slot(
    index: RedisIndex, redis_server: RedisServer, prefix: str
) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    await index.remove(MODEL, BS, PROMPT, "a")
    await index.record(MODEL, BS, PROMPT[:2], "b")
    with redis_server.sync_client() as client:
        assert client.hgetall(f"{{{prefix}}}:slots") == {b"b": b"0"}
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 2]


async def test_cleared_slot_is_reused_clean(
    index: RedisIndex, redis_server: RedisServer, prefix: str
) -> None:
    await index.record(MODEL, BS, PROMPT, "a")
    await index.clear_backend("a")
    await index.record(MODEL, BS, PROMPT[:2], "b")
    with redis_server.sync_client() as client:
        assert client.hgetall(f"{{{prefix}}}:slots") == {b"b": b"0"}
    assert await index.match(MODEL, BS, PROMPT, ["a", "b"]) == [0, 2]


@pytest.mark.parametrize(
    "reply",
    [None, "3", [1], [1, 2, 3], [1, -1], [1, 9], [1, b"2"], [1, 2.0]],
)
def test_invalid_replies_are_rejected(reply: object) -> None:
    with pytest.raises(InvalidReply):
        _validated_counts(reply, n_backends=2, n_blocks=8)


def test_valid_reply_passes() -> None:
    assert _validated_counts([0, 8], n_backends=2, n_blocks=8) == [0, 8]
