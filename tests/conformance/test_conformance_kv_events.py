"""KV events over ZMQ, as vLLM 0.32 frames them (A2 [observed]): the suite binds the SUB socket."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from conformance_helpers import ConformanceTarget, token_prompt

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_prompt_counter = itertools.count()


@pytest.fixture(scope="module")
def subscriber(conformance_target: ConformanceTarget) -> Iterator[zmq.Socket]:
    if conformance_target.kv_events_endpoint is None:
        pytest.skip("this target publishes no KV events to the suite")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.bind(conformance_target.kv_events_endpoint)
    yield sub
    sub.close(linger=0)
    context.term()


def next_batch(sub: zmq.Socket, client: httpx.Client, target: ConformanceTarget) -> list[bytes]:
    """Send fresh full-block prompts until a batch arrives (PUB drops what is sent before it connects)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        prompt = token_prompt(client, target, 3 * target.block_size, seed=f"kvev{next(_prompt_counter)}x")
        client.post("/v1/completions", json={"model": target.model, "prompt": prompt, "max_tokens": 1})
        try:
            return sub.recv_multipart()
        except zmq.Again:
            continue
    raise AssertionError("no KV event batch within 30 s")


def decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int]:
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, list) and len(batch) == 3, "a batch is the array [ts, events, dp_rank]"
    ts, events, rank = batch
    assert isinstance(ts, float) and isinstance(events, list) and isinstance(rank, int)
    return ts, events, rank


def test_batches_are_three_frames_with_a_sequence(
    subscriber: zmq.Socket, client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    topic, seq, payload = next_batch(subscriber, client, conformance_target)
    assert topic == conformance_target.kv_events_topic.encode()
    assert len(seq) == 8
    decode(payload)
    following = next_batch(subscriber, client, conformance_target)
    assert int.from_bytes(following[1], "big") > int.from_bytes(seq, "big")


def test_block_stored_events_are_tagged_maps(
    subscriber: zmq.Socket, client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    stored = []
    for _ in range(5):
        _, events, _ = decode(next_batch(subscriber, client, conformance_target)[2])
        stored = [event for event in events if event["type"] == "BlockStored"]
        if stored:
            break
    assert stored, "no BlockStored in five batches"
    event = stored[0]
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"} <= set(event)
    assert event["block_size"] == conformance_target.block_size
    assert event["medium"] == "GPU"
    assert all(isinstance(h, int | bytes) for h in event["block_hashes"])
    assert len(event["token_ids"]) == len(event["block_hashes"]) * event["block_size"]


def stored_blocks(
    sub: zmq.Socket, size: int, wanted: list[tuple[int, ...]]
) -> dict[tuple[int, ...], dict[str, Any]]:
    """Read batches until every wanted block (its token ids) was announced; each maps to its event."""
    found: dict[tuple[int, ...], dict[str, Any]] = {}
    deadline = time.monotonic() + 30
    while not set(wanted) <= found.keys():
        assert time.monotonic() < deadline, "the wanted BlockStored events did not come within 30 s"
        try:
            _, events, _ = decode(sub.recv_multipart()[2])
        except zmq.Again:
            continue
        for event in events:
            if event["type"] == "BlockStored":
                tokens = event["token_ids"]
                for i in range(len(event["block_hashes"])):
                    found[tuple(tokens[i * size : (i + 1) * size])] = {**event, "index": i}
    return found


def test_a_longer_prompt_chains_its_new_blocks_to_the_cached_prefix(
    subscriber: zmq.Socket, client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    """A consumer rebuilds hashes from the chain (hetgate's kvindex/events.py does): the first new block's
    parent is the cached prefix's last block."""
    size, model = conformance_target.block_size, conformance_target.model
    tokens = token_prompt(client, conformance_target, 4 * size + 1, seed=f"chain{next(_prompt_counter)}x")
    blocks = [tuple(tokens[i * size : (i + 1) * size]) for i in range(4)]
    client.post("/v1/completions", json={"model": model, "prompt": tokens[: 2 * size + 1], "max_tokens": 1})
    prefix = stored_blocks(subscriber, size, blocks[:2])
    client.post("/v1/completions", json={"model": model, "prompt": tokens, "max_tokens": 1})
    extension = stored_blocks(subscriber, size, blocks[2:])[blocks[2]]
    last_cached = prefix[blocks[1]]
    assert extension["index"] == 0, "the cached blocks are not announced again"
    assert extension["parent_block_hash"] == last_cached["block_hashes"][last_cached["index"]]


def test_replay_resends_buffered_batches_then_end_seq(
    subscriber: zmq.Socket, client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    if conformance_target.kv_replay_endpoint is None:
        pytest.skip("no replay endpoint")
    _, seq, payload = next_batch(subscriber, client, conformance_target)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(conformance_target.kv_replay_endpoint)
    try:
        dealer.send_multipart([b"", seq])
        first = dealer.recv_multipart()
        frames = [first]
        while frames[-1][2] != END_SEQ:
            frames.append(dealer.recv_multipart())
    finally:
        dealer.close(linger=0)
        context.term()
    assert first[0] == b"" and first[2] == seq and first[3] == payload
    assert frames[-1] == [b"", b"", END_SEQ, b""]
