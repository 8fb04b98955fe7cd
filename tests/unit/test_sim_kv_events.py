"""The ZMQ KV-event publisher speaks vLLM's framing, bind/connect rule and replay protocol."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import zmq
import zmq.asyncio

from bench.sim.kv_events import (
    END_SEQ,
    KVEventsConfig,
    ZmqKVEventPublisher,
    offset_endpoint_port,
    should_bind,
)

STORED = {"type": "BlockStored", "block_hashes": [2**64 - 1, 5], "parent_block_hash": None, "token_ids": [1]}


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://127.0.0.1:*", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
    ],
)
def test_bind_or_connect_follows_vllm(endpoint: str, binds: bool) -> None:
    assert should_bind(endpoint) is binds


def test_data_parallel_ranks_offset_the_port() -> None:
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"


def test_config_defaults_and_json_match_vllm() -> None:
    assert KVEventsConfig().publisher == "null"
    config = KVEventsConfig.from_json(json.dumps({"enable_kv_cache_events": True, "topic": "kv"}))
    assert config.publisher == "zmq" and config.active
    assert config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "x"}')


async def _receive_while_publishing(sub: zmq.asyncio.Socket, publisher: ZmqKVEventPublisher) -> list[bytes]:
    """PUB/SUB drops messages until the subscription propagates: publish until one arrives."""
    for _ in range(200):
        publisher.publish([STORED])
        try:
            return await asyncio.wait_for(sub.recv_multipart(), 0.05)
        except TimeoutError:
            continue
    raise AssertionError("no KV event batch arrived")


async def test_connecting_publisher_reaches_a_bound_subscriber() -> None:
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}", topic="kv@sim")
    publisher = ZmqKVEventPublisher(config)
    await publisher.start()
    try:
        topic, seq, payload = await _receive_while_publishing(sub, publisher)
    finally:
        await publisher.close()
        sub.close(linger=0)
        context.term()
    assert topic == b"kv@sim"
    assert len(seq) == 8 and int.from_bytes(seq, "big") >= 0
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    assert events == [STORED]


async def test_replay_returns_buffered_batches_then_end_seq() -> None:
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"
    )
    publisher = ZmqKVEventPublisher(config)
    await publisher.start()
    for _ in range(3):
        publisher.publish([STORED])
    publisher.publish([])  # an empty step publishes nothing and takes no sequence number
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        frames = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
    finally:
        dealer.close(linger=0)
        context.term()
        await publisher.close()
    assert [int.from_bytes(f[2], "big") for f in frames[:2]] == [1, 2]
    assert all(f[0] == b"" and f[1] == b"" for f in frames[:2])
    assert msgpack.unpackb(frames[0][3])[1] == [STORED]
    assert frames[2] == [b"", b"", END_SEQ, b""]
