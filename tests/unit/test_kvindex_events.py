"""KV events: a real ZMQ publisher framing batches like vLLM, and the index state after them."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from bench.ports import free_port
from kvindex.events import KVEventSubscriber, connect_address, sub_binds
from kvindex.memory import MemoryIndex
from kvindex.prompt import PromptHasher

MODEL = "tiny"
BS = 16
TOPIC = "kv-events"
IDS = list(range(100, 164))  # 4 blocks of 16 token ids
ENGINE = [9_000_000_000_000_000_001 + i for i in range(8)]  # vLLM's (opaque) u64 block hashes


def _tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def stored_map(hashes, parent, token_ids, **extra) -> dict:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": token_ids, "block_size": BS, "lora_id": None, "medium": "GPU",
        "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
        "kv_cache_spec_kind": "full_attention", "some_future_key": {"x": 1}, **extra,
    }  # fmt: skip


def stored_array(hashes, parent, token_ids) -> list:
    # Older releases: positional, and later releases appended fields we must tolerate.
    return ["BlockStored", hashes, parent, token_ids, BS, None, "GPU", None, None, "appended-field"]


class Publisher:
    """Stands in for vLLM's ZmqEventPublisher (XPUB so the test can wait for the subscription)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, bind: bool) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.buffer: list[tuple[int, bytes]] = []

    async def subscribed(self) -> None:
        message = await asyncio.wait_for(self.sock.recv(), 10)
        assert message == b"\x01" + TOPIC.encode()

    def batch(self, seq: int, events: list, live: bool = True) -> Awaitable[None] | None:
        payload = msgpack.packb([time.time(), events, 0])
        self.buffer.append((seq, payload))
        if live:
            return self.sock.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


async def serve_replay(router: zmq.asyncio.Socket, publisher: Publisher, requests: list[int]) -> None:
    """vLLM's replay protocol: [id, b"", start] -> [id, b"", topic, seq, payload]... then END_SEQ."""
    while True:
        identity, empty, start_bytes = await router.recv_multipart()
        start = int.from_bytes(start_bytes, "big")
        requests.append(start)
        for seq, payload in publisher.buffer:
            if seq >= start:
                await router.send_multipart(
                    [identity, empty, TOPIC.encode(), seq.to_bytes(8, "big"), payload]
                )
        await router.send_multipart([identity, empty, b"", (-1).to_bytes(8, "big", signed=True), b""])


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "the index never reached the expected state"
        await asyncio.sleep(0.01)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.ctx = zmq.asyncio.Context()
        self.index = MemoryIndex()
        self.hasher = PromptHasher(MODEL, [BS])
        self.events: Counter[str] = Counter()
        self.tmp_path = tmp_path
        self.closers: list[Callable[[], object]] = []
        self.subscribers: list[KVEventSubscriber] = []

    def subscriber(self, endpoint: str, replay: str | None = None) -> KVEventSubscriber:
        sub = KVEventSubscriber(
            "be-1", MODEL, endpoint, self.index, self.hasher, topic=TOPIC, replay_endpoints=replay,
            on_event=lambda what: self.events.update([what]), context=self.ctx,
        )  # fmt: skip
        self.subscribers.append(sub)
        return sub

    def publisher(self, endpoint: str, bind: bool) -> Publisher:
        pub = Publisher(self.ctx, endpoint, bind)
        self.closers.append(pub.close)
        return pub

    async def held(self, token_ids: list[int], tenant: str | None = None) -> int:
        hashes = self.hasher.hash_token_ids(token_ids, BS, tenant)
        return (await self.index.match(MODEL, BS, hashes, ["be-1"]))[0]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    rig = Rig(tmp_path)
    yield rig
    for sub in rig.subscribers:  # idempotent; a test that failed before its own stop() left it open
        await sub.stop()
    for close in rig.closers:
        close()
    rig.ctx.term()  # blocks for ever while any socket of the context is open


async def _started(rig: Rig, endpoint: str, replay: str | None = None) -> KVEventSubscriber:
    sub = rig.subscriber(endpoint, replay)
    await sub.start()
    return sub


@pytest.mark.parametrize("shape", ["map", "array"])
async def test_store_continue_remove_clear(rig: Rig, shape: str) -> None:
    stored = stored_map if shape == "map" else stored_array
    endpoint = _tcp_endpoint()  # concrete host: vLLM connects, we bind
    sub = await _started(rig, endpoint)
    pub = rig.publisher(endpoint, bind=False)
    await pub.subscribed()

    await pub.batch(0, [stored(ENGINE[:2], None, IDS[:32]), {"type": "SomethingNew", "x": 1}])
    await pub.batch(1, [stored(ENGINE[2:4], ENGINE[1], IDS[32:64])])
    # The request path (token mode) finds all 4 blocks: same hashes from the same token ids.
    await eventually(lambda: _eq(rig.held(IDS), 4))

    removed = {"type": "BlockRemoved", "block_hashes": [ENGINE[2]], "medium": "GPU"}
    await pub.batch(2, [removed if shape == "map" else ["BlockRemoved", [ENGINE[2]], "GPU"]])
    await eventually(lambda: _eq(rig.held(IDS), 2))

    await pub.batch(3, [{"type": "AllBlocksCleared"} if shape == "map" else ["AllBlocksCleared"]])
    await eventually(lambda: _eq(rig.held(IDS), 0))
    await sub.stop()
    assert rig.events["unknown"] == 1 and rig.events["stored"] == 2


async def test_wildcard_endpoint_means_we_connect(rig: Rig) -> None:
    endpoint = f"ipc://{rig.tmp_path}/kv.sock"  # vLLM binds ipc endpoints, so we connect
    pub = rig.publisher(endpoint, bind=True)
    sub = await _started(rig, endpoint)
    await pub.subscribed()
    await pub.batch(0, [stored_map(ENGINE[:4], None, IDS)])
    await eventually(lambda: _eq(rig.held(IDS), 4))
    await sub.stop()


async def test_gap_is_filled_by_replay(rig: Rig) -> None:
    endpoint, replay = _tcp_endpoint(), f"ipc://{rig.tmp_path}/replay.sock"
    router = rig.ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(replay)
    rig.closers.append(lambda: router.close(linger=0))
    sub = await _started(rig, endpoint, replay)
    pub = rig.publisher(endpoint, bind=False)
    requests: list[int] = []
    server = asyncio.create_task(serve_replay(router, pub, requests))
    await pub.subscribed()

    await pub.batch(0, [stored_map(ENGINE[:1], None, IDS[:16])])
    pub.batch(1, [stored_map(ENGINE[1:2], ENGINE[0], IDS[16:32])], live=False)  # lost on the wire
    pub.batch(2, [stored_map(ENGINE[2:3], ENGINE[1], IDS[32:48])], live=False)
    await pub.batch(3, [stored_map(ENGINE[3:4], ENGINE[2], IDS[48:64])])
    await eventually(lambda: _eq(rig.held(IDS), 4))
    assert requests == [1]
    assert rig.events["replayed"] == 3 and rig.events["gap_lost"] == 0
    server.cancel()
    await sub.stop()


async def test_gap_without_replay_keeps_going(rig: Rig) -> None:
    endpoint = _tcp_endpoint()
    sub = await _started(rig, endpoint)
    pub = rig.publisher(endpoint, bind=False)
    await pub.subscribed()
    await pub.batch(4, [stored_map(ENGINE[:4], None, IDS)])  # joined late, nothing to replay from
    await eventually(lambda: _eq(rig.held(IDS), 4))
    assert rig.events["gap_lost"] == 1
    await sub.stop()


async def test_engine_restart_drops_what_it_held(rig: Rig) -> None:
    endpoint = _tcp_endpoint()
    sub = await _started(rig, endpoint)
    pub = rig.publisher(endpoint, bind=False)
    await pub.subscribed()
    await pub.batch(0, [stored_map(ENGINE[:4], None, IDS)])
    await pub.batch(1, [])
    await eventually(lambda: _eq(rig.held(IDS), 4))
    pub.close()

    other = list(range(500, 532))
    restarted = rig.publisher(endpoint, bind=False)  # a new engine: seq starts again at 0
    await restarted.subscribed()
    await restarted.batch(0, [stored_map(ENGINE[4:6], None, other)])
    await eventually(lambda: _eq(rig.held(other), 2))
    assert await rig.held(IDS) == 0
    assert rig.events["restart"] == 1
    await sub.stop()


async def test_salted_lora_and_unknown_parent_blocks(rig: Rig) -> None:
    endpoint = _tcp_endpoint()
    sub = await _started(rig, endpoint)
    pub = rig.publisher(endpoint, bind=False)
    await pub.subscribed()
    salted = stored_map(ENGINE[:2], None, IDS[:32], extra_keys=[("cache_salt", "tenant-a"), None])
    lora = stored_map(ENGINE[2:4], None, list(range(700, 732)), lora_name="adapter")
    orphan = stored_map(ENGINE[4:5], 12345, list(range(800, 816)))
    await pub.batch(0, [salted, lora, orphan])
    await eventually(lambda: _eq(rig.held(IDS[:32], tenant="tenant-a"), 2))
    assert await rig.held(IDS[:32]) == 0  # other tenants never see it
    assert await rig.held(list(range(700, 732))) == 0
    assert rig.events["skipped"] == 1 and rig.events["unknown_parent"] == 1
    await sub.stop()


async def test_garbage_frames_do_not_stop_the_stream(rig: Rig) -> None:
    endpoint = _tcp_endpoint()
    sub = await _started(rig, endpoint)
    pub = rig.publisher(endpoint, bind=False)
    await pub.subscribed()
    await pub.sock.send_multipart([TOPIC.encode(), b"\x00" * 8, b"\xc1 not msgpack"])
    await pub.sock.send_multipart([TOPIC.encode(), b"short"])
    await pub.batch(1, [stored_map(ENGINE[:4], None, IDS[:40])])  # too few token ids: skipped
    await pub.batch(2, [stored_map(ENGINE[:4], None, IDS)])
    await eventually(lambda: _eq(rig.held(IDS), 4))
    assert rig.events["malformed"] == 2 and rig.events["skipped"] == 1
    await sub.stop()


async def test_stop_with_forget_drops_the_backend(rig: Rig) -> None:
    endpoint = _tcp_endpoint()
    sub = await _started(rig, endpoint)
    pub = rig.publisher(endpoint, bind=False)
    await pub.subscribed()
    await pub.batch(0, [stored_map(ENGINE[:4], None, IDS)])
    await eventually(lambda: _eq(rig.held(IDS), 4))
    await sub.stop(forget=True)
    assert await rig.held(IDS) == 0


@pytest.mark.parametrize(
    ("endpoint", "we_bind", "address"),
    [
        ("tcp://127.0.0.1:5557", True, "tcp://127.0.0.1:5557"),
        ("tcp://*:5557", False, "tcp://10.0.0.7:5557"),
        ("tcp://[::]:5557", False, "tcp://10.0.0.7:5557"),
        ("ipc:///tmp/kv", False, "ipc:///tmp/kv"),
        ("inproc://kv", False, "inproc://kv"),
    ],
)
def test_bind_or_connect_follows_vllm(endpoint: str, we_bind: bool, address: str) -> None:
    assert sub_binds(endpoint) is we_bind
    assert (endpoint if we_bind else connect_address(endpoint, "10.0.0.7")) == address


async def _eq(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_against_the_simulators_publisher(rig: Rig) -> None:
    """Interoperates with an independently written vLLM-framed publisher (bench/sim/kv_events.py).
    Its PUB drops what it sends before our SUB is connected, so the first batch reaches us through
    the gap detection and the replay socket."""
    from bench.sim.kv_events import KVEventsConfig, ZmqKVEventPublisher

    endpoint, replay = _tcp_endpoint(), f"ipc://{rig.tmp_path}/sim-replay.sock"
    sub = await _started(rig, endpoint, replay)
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, topic=TOPIC
    )
    pub = ZmqKVEventPublisher(config)
    await pub.start()
    pub.publish([stored_map(ENGINE[:4], None, IDS)])
    keepalive = [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]

    async def held_all() -> bool:
        pub.publish(keepalive)  # later batches reveal the gap if the first one was dropped
        return await rig.held(IDS) == 4

    await eventually(held_all)
    await pub.close()
    await sub.stop()
