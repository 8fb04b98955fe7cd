"""Precise index updates from vLLM's KV-cache events (`--kv-events-config`, ZMQ + msgpack).

One `KVEventSubscriber` per backend. For every publisher endpoint (one per data-parallel rank) it runs
a SUB socket and applies each batch to the prefix index:

- Socket direction follows vLLM's rule: vLLM's PUB binds when its endpoint has a `*` (or `::`, or is
  ipc/inproc), and then we connect (with `*` replaced by the backend's host); with a concrete host vLLM
  connects, so we bind that address.
- Messages are 3 frames `[topic, seq (8 bytes big-endian), payload]`; the payload is a msgpack array
  `[ts, events, dp_rank]`. Events come as maps with a `"type"` tag (vLLM >= ~0.26) or, from older
  releases, as arrays `["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]`.
  Unknown keys, unknown event types and extra array fields are ignored.
- `seq` is tracked per publisher. A gap triggers a replay from the publisher's ROUTER socket (send
  `[b"", start_seq]`, receive `[b"", topic, seq, payload]`... until seq -1). A seq back at 0 means the
  engine restarted: everything the backend held is dropped first. A subscriber that joins a running
  engine also replays what the publisher still buffers.
- Our index keys are our own chained hashes of `token_ids` at the event's block size
  (`kvindex.hashing`), so they equal the request path's hashes in token mode; vLLM's own hashes depend
  on its hash algorithm and seed, so we only use them as names: engine hash -> our hash, per backend,
  to resolve parents and `BlockRemoved`.
- We index only what a plain request can hit: the first KV cache group, full attention, GPU medium,
  no LoRA and no per-block extra keys (multimodal, prompt embeds). A block 0 extra key tagged
  `("cache_salt", s)` seeds the chain with tenant salt `s`, matching requests hashed with tenant `s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import msgpack
import zmq
import zmq.asyncio

from kvindex.base import PrefixIndex
from kvindex.hashing import HashMode, hash_token_ids
from kvindex.prompt import PromptHasher

log = logging.getLogger(__name__)

END_SEQ = -1
# Positional field names of the array-shaped (pre-map) events, in vLLM's order; later fields were
# appended over releases, so shorter arrays are fine.
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
_INDEXED_MEDIA = (None, "GPU")
EventCallback = Callable[[str], None]


def sub_binds(endpoint: str) -> bool:
    """Whether our SUB must bind `endpoint` (vLLM's PUB connects to concrete addresses)."""
    vllm_binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    return not vllm_binds


def connect_address(endpoint: str, host: str) -> str:
    """The address to connect to when vLLM bound a wildcard endpoint."""
    return endpoint.replace("[::]", host).replace("*", host)


@dataclass(slots=True)
class _Source:
    endpoint: str
    replay_endpoint: str | None
    last_seq: int = -1


@dataclass(frozen=True, slots=True)
class _Stored:
    block_size: int
    our_hash: int


class KVEventSubscriber:
    """Feeds one backend's vLLM KV events into a `PrefixIndex`."""

    def __init__(
        self,
        backend_id: str,
        model: str,
        endpoints: str | Sequence[str],
        index: PrefixIndex,
        hasher: PromptHasher,
        topic: str = "",
        replay_endpoints: str | Sequence[str | None] | None = None,
        host: str = "127.0.0.1",
        replay_timeout_s: float = 2.0,
        max_tracked_blocks: int = 2_000_000,
        on_event: EventCallback | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        replays = _aligned_replays(replay_endpoints, len(endpoints))
        self.backend_id = backend_id
        self.model = model
        self._sources = [_Source(e, r) for e, r in zip(endpoints, replays, strict=True)]
        self._index = index
        self._hasher = hasher
        self._topic = topic.encode()
        self._host = host
        self._replay_timeout = replay_timeout_s
        self._max_tracked = max_tracked_blocks
        self._on_event = on_event
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._engine_to_ours: dict[Any, _Stored] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[zmq.asyncio.Socket] = []

    async def start(self) -> None:
        """Open the sockets (bind errors surface here) and start one reader per publisher."""
        if self._own_context and self._context.closed:  # started again after stop()
            self._context = zmq.asyncio.Context()
        for source in self._sources:
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            # Owned before binding: when the bind fails, stop() must still close it, or the context's
            # term() waits for it forever (a start-up that hangs instead of failing).
            self._sockets.append(sock)
            if sub_binds(source.endpoint):
                sock.bind(source.endpoint)
            else:
                sock.connect(connect_address(source.endpoint, self._host))
            self._tasks.append(asyncio.create_task(self._read(source, sock)))

    async def stop(self, forget: bool = False) -> None:
        """Stop reading; with `forget`, also drop everything the backend held (backend removed)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self._sockets:
            sock.close(linger=0)
        self._tasks.clear()
        self._sockets.clear()
        if self._own_context:
            self._context.term()
        if forget:
            await self._clear()

    async def _read(self, source: _Source, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                await self._on_message(source, frames)
            except Exception:
                # One bad batch must not stop the stream; the TTL repairs whatever it left wrong.
                log.warning("KV event batch from %s failed", self.backend_id, exc_info=True)
                self._count("malformed")

    async def _on_message(self, source: _Source, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count("malformed")
            return
        seq = int.from_bytes(frames[1], "big")
        if seq == 0 and source.last_seq >= 0:
            log.info("KV events of %s restarted at seq 0: dropping its entries", self.backend_id)
            self._count("restart")
            await self._clear()
            source.last_seq = -1
        if seq <= source.last_seq:
            self._count("duplicate")
            return
        if seq > source.last_seq + 1:
            await self._replay(source, source.last_seq + 1)
            if seq <= source.last_seq:
                return
            if seq > source.last_seq + 1:
                self._count("gap_lost")
        await self._apply_batch(frames[2])
        source.last_seq = seq

    async def _replay(self, source: _Source, start: int) -> None:
        """Fetch and apply the batches from `start` the publisher still buffers."""
        if source.replay_endpoint is None:
            return
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(connect_address(source.replay_endpoint, self._host))
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self._replay_timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    if len(frames) < 3 or int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                        return
                    seq = int.from_bytes(frames[1], "big")
                    if seq > source.last_seq:
                        await self._apply_batch(frames[2])
                        source.last_seq = seq
                        self._count("replayed")
        except TimeoutError:
            log.warning("KV event replay from %s timed out", self.backend_id)
        finally:
            dealer.close(linger=0)

    async def _apply_batch(self, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
            self._count("malformed")
            return
        for raw in batch[1]:
            kind, fields = _event_fields(raw)
            if kind == "BlockStored":
                await self._stored(fields)
            elif kind == "BlockRemoved":
                await self._removed(fields)
            elif kind == "AllBlocksCleared":
                self._count("cleared")
                await self._clear()
            else:
                self._count("unknown")

    async def _stored(self, ev: Mapping[str, Any]) -> None:
        hashes, token_ids, block_size = ev.get("block_hashes"), ev.get("token_ids"), ev.get("block_size")
        if not (isinstance(hashes, list) and isinstance(token_ids, list) and _positive_int(block_size)):
            self._count("malformed")
            return
        tenant = _indexable_salt(ev)
        if tenant is False or len(token_ids) < len(hashes) * block_size:
            self._count("skipped")
            return
        seed = self._seed(ev.get("parent_block_hash"), tenant)
        if seed is None:
            self._count("unknown_parent")
            return
        ours = hash_token_ids(token_ids[: len(hashes) * block_size], block_size, seed)
        for engine_hash, our_hash in zip(hashes, ours, strict=True):
            self._track(engine_hash, _Stored(block_size, our_hash))
        await self._index.record(self.model, block_size, ours, self.backend_id)
        self._count("stored")

    def _seed(self, parent: Any, tenant: str | None) -> int | None:
        if parent is None:
            return self._hasher.root(HashMode.TOKENS, tenant)
        stored = self._engine_to_ours.get(_key(parent))
        return None if stored is None else stored.our_hash

    async def _removed(self, ev: Mapping[str, Any]) -> None:
        hashes = ev.get("block_hashes")
        if not isinstance(hashes, list) or ev.get("medium") not in _INDEXED_MEDIA:
            self._count("skipped")
            return
        by_size: dict[int, list[int]] = {}
        for engine_hash in hashes:
            stored = self._engine_to_ours.pop(_key(engine_hash), None)
            if stored is not None:
                by_size.setdefault(stored.block_size, []).append(stored.our_hash)
        for block_size, ours in by_size.items():
            await self._index.remove(self.model, block_size, ours, self.backend_id)
        self._count("removed")

    async def _clear(self) -> None:
        self._engine_to_ours.clear()
        await self._index.clear_backend(self.backend_id)

    def _track(self, engine_hash: Any, stored: _Stored) -> None:
        self._engine_to_ours[_key(engine_hash)] = stored
        while len(self._engine_to_ours) > self._max_tracked:  # forget the oldest mapping
            del self._engine_to_ours[next(iter(self._engine_to_ours))]

    def _count(self, what: str) -> None:
        if self._on_event is not None:
            self._on_event(what)


def _event_fields(raw: Any) -> tuple[str | None, Mapping[str, Any]]:
    """(type, fields) of one event in either shape; (None, {}) when it is neither."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        return (kind if isinstance(kind, str) else None), raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        names = _ARRAY_FIELDS.get(raw[0], ())
        return raw[0], dict(zip(names, raw[1:], strict=False))
    return None, {}


def _indexable_salt(ev: Mapping[str, Any]) -> str | Literal[False] | None:
    """The tenant salt to seed with (None: none), or False when requests could never hit this block."""
    if ev.get("lora_id") is not None or ev.get("lora_name") is not None:
        return False
    if ev.get("medium") not in _INDEXED_MEDIA or ev.get("group_idx", 0) not in (0, None):
        return False
    if ev.get("kv_cache_spec_kind", "full_attention") not in ("full_attention", None):
        return False
    extra = ev.get("extra_keys")
    if not extra or all(k is None for k in extra):
        return None
    first, rest = extra[0], extra[1:]
    if any(k is not None for k in rest):
        return False
    salt = _cache_salt(first)
    return False if salt is None else salt


def _cache_salt(keys: Any) -> str | None:
    """`s` from block 0's extra keys when they are exactly a tagged ("cache_salt", s)."""
    if isinstance(keys, list | tuple) and len(keys) == 2 and keys[0] == "cache_salt":
        return keys[1] if isinstance(keys[1], str) else None
    if isinstance(keys, list | tuple) and len(keys) == 1:
        return _cache_salt(keys[0])
    return None


def _key(engine_hash: Any) -> Any:
    """Engine hashes arrive as int or bytes; lists (never expected) are made hashable."""
    return tuple(engine_hash) if isinstance(engine_hash, list) else engine_hash


def _positive_int(value: Any) -> TypeGuard[int]:
    return type(value) is int and value > 0


def _aligned_replays(replays: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if replays is None:
        return [None] * n
    if isinstance(replays, str):
        return [replays] + [None] * (n - 1)
    replays = list(replays)
    if len(replays) != n:
        raise ValueError("give one replay endpoint (or None) per event endpoint")
    return replays
