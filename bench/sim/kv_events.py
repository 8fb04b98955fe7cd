"""KV-cache events over ZMQ, framed as vLLM 0.32 publishes them (see vllm-reference.md A2).

Each engine step's events go out as one PUB message of three frames:
  [topic (utf-8), seq (8-byte big-endian, from 0), msgpack([ts, events, data_parallel_rank])]
with events as `{"type": ...}` maps. Like vLLM, the PUB socket binds only when the endpoint contains
`*` or `::` or is ipc/inproc, and connects otherwise (then the consumer binds). With a
`replay_endpoint`, a ROUTER socket answers `[b"", start_seq]` with every buffered batch from
`start_seq` on, then `[b"", b"", END_SEQ (-1), b""]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` fields and defaults (`vllm/config/kv_events.py`)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(
                f"kv-events-config: unknown publisher {self.publisher!r} (expected 'zmq' or 'null')"
            )

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv-events-config: unknown keys {unknown}")
        return cls(**data)

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: wildcard host or local transports bind, a concrete address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str:
    """Data-parallel rank r publishes on port + r."""
    if data_parallel_rank == 0:
        return endpoint
    match = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if match is None:
        return endpoint
    return f"{match.group(1)}{int(match.group(2)) + data_parallel_rank}"


class ZmqKVEventPublisher:
    """A `KVEventSink` publishing vLLM-framed batches; call `start()` inside the event loop."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        # PUB sends synchronously (never blocks); only the replay ROUTER needs asyncio.
        self._context = zmq.Context()
        self._async_context = zmq.asyncio.Context.shadow(self._context.underlying)
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = config.replay_endpoint

    async def start(self) -> None:
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if should_bind(self.endpoint):
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(self.endpoint)
        if self.config.replay_endpoint:
            self._replay = self._async_context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(offset_endpoint_port(self.config.replay_endpoint, self.data_parallel_rank))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.create_task(self._serve_replay())

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events or self._pub is None:
            return
        seq = self._seq.to_bytes(8, "big")
        self._seq += 1
        payload = msgpack.packb([time.time(), events, self.data_parallel_rank])
        self._buffer.append((self._seq - 1, payload))
        try:
            # The PUB socket never blocks: beyond the high-water mark ZMQ drops, as vLLM's does.
            self._pub.send_multipart([self._topic, seq, payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("kv events: PUB high-water mark reached, batch %d dropped", self._seq - 1)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            identity, _empty, start = await self._replay.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([identity, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
