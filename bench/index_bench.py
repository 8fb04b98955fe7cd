"""`hetgate bench index`: what the prefix index costs on the request path.

For prompts of 1k, 8k and 32k tokens across 8, 64 and 512 backends, in the memory store and in a
redis-server this benchmark starts itself on a free loopback port:
- hashing: `PromptHasher.features` of a chat body (text mode, the default without a tokenizer) and of a
  token-id prompt (token mode), at block size 16 (GPU) - the worst case, most blocks;
- lookup: one `match` over all backends. Backend i holds the first (i mod 8 + 1)/8 of the prompt, so an
  eighth hold all of it and the walk runs to the end with many backends alive;
- round trips per Redis match, counted at the client's connection (the exit status is 1 unless it is 1);
- memory per million indexed blocks (memory store: tracemalloc; Redis: used_memory), extrapolated from
  a smaller fill.
Each figure is the median of `--repeats` rounds; ratios compare against baselines measured in the same
run: blake2b-8 chained hashing (the alternative hash) and a Redis PING round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import shutil
import statistics
import subprocess
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench.ports import free_port
from kvindex.hashing import BlockHashes, pack_token_ids
from kvindex.memory import MemoryIndex
from kvindex.prompt import PromptHasher
from kvindex.redis import RedisIndex

MODEL = "bench-model"
BLOCK_SIZE = 16
PROMPT_TOKENS = (1024, 8192, 32768)
BACKENDS = (8, 64, 512)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hetgate bench index", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="rounds per figure (median reported)")
    parser.add_argument("--calls", type=int, default=20, help="calls timed per round")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=list(PROMPT_TOKENS), help="prompt lengths measured"
    )
    parser.add_argument(
        "--backends", type=int, nargs="+", default=list(BACKENDS), help="backend counts measured"
    )
    parser.add_argument("--memory-blocks", type=int, default=200_000, help="fill for the memory figure")
    parser.add_argument("--no-redis", action="store_true", help="memory store only")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


# --- timing -------------------------------------------------------------------------------------


def _median_ms(rounds: list[float]) -> float:
    return round(statistics.median(rounds) * 1000, 4)


def time_sync(fn: Callable[[], object], repeats: int, calls: int) -> float:
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls)
    return _median_ms(rounds)


async def time_async(fn: Callable[[], Awaitable[object]], repeats: int, calls: int) -> float:
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            await fn()
        rounds.append((time.perf_counter() - start) / calls)
    return _median_ms(rounds)


# --- workloads ----------------------------------------------------------------------------------


def chat_body(tokens: int) -> dict[str, Any]:
    """A conversation of about `tokens` tokens (4 characters each), in several turns."""
    turn = "The quick brown fox jumps over the lazy dog. " * 23  # ~1k characters
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    while sum(len(m["content"]) for m in messages) < tokens * 4:
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": turn})
    return {"messages": messages}


def token_body(tokens: int) -> dict[str, Any]:
    return {"prompt": [(i * 7919) % 50_000 for i in range(tokens)]}


def blake2b_chain(data: bytes, chunk: int) -> list[int]:
    """The baseline hash: the same chaining with blake2b-8 instead of xxh3-64."""
    out, parent = [], b"\0" * 8
    for start in range(0, len(data) - chunk + 1, chunk):
        parent = hashlib.blake2b(parent + data[start : start + chunk], digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def hashing_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    hasher = PromptHasher(MODEL, [BLOCK_SIZE])
    rows = []
    for tokens in args.prompt_tokens:
        chat, ids = chat_body(tokens), token_body(tokens)
        packed = pack_token_ids(ids["prompt"])
        rows.append(
            {
                "prompt_tokens": tokens,
                "blocks": tokens // BLOCK_SIZE,
                "text_ms": time_sync(partial(hasher.features, chat, "chat"), args.repeats, args.calls),
                "tokens_ms": time_sync(
                    partial(hasher.features, ids, "completions"), args.repeats, args.calls
                ),
                "blake2b_ms": time_sync(
                    partial(blake2b_chain, packed, BLOCK_SIZE * 4), args.repeats, args.calls
                ),
            }
        )
    for row in rows:
        row["xxh3_vs_blake2b"] = round(row["tokens_ms"] / row["blake2b_ms"], 3)
    return rows


async def populate(store: Any, hashes: BlockHashes, backends: int) -> list[str]:
    ids = [f"backend-{i}" for i in range(backends)]
    for i, backend_id in enumerate(ids):
        held = len(hashes) * (i % 8 + 1) // 8
        await store.record(MODEL, BLOCK_SIZE, hashes[:held], backend_id)
    return ids


async def lookup_rows(
    args: argparse.Namespace, store_name: str, make_store: Callable[[], Any]
) -> list[dict[str, Any]]:
    hasher = PromptHasher(MODEL, [BLOCK_SIZE])
    rows = []
    for tokens in args.prompt_tokens:
        body = chat_body(tokens)
        _, features = hasher.features(body, "chat")
        hashes = features[BLOCK_SIZE]
        for backends in args.backends:
            store = make_store()
            ids = await populate(store, hashes, backends)
            counts = await store.match(MODEL, BLOCK_SIZE, hashes, ids)
            assert counts[7 % backends] == len(hashes), "the benchmark's fill is wrong"
            match_ms = await time_async(
                partial(store.match, MODEL, BLOCK_SIZE, hashes, ids), args.repeats, args.calls
            )

            async def hash_and_match(s=store, i=ids, b=body) -> None:
                await s.match(MODEL, BLOCK_SIZE, hasher.features(b, "chat")[1][BLOCK_SIZE], i)

            total_ms = await time_async(hash_and_match, args.repeats, args.calls)
            rows.append(
                {"store": store_name, "prompt_tokens": tokens, "backends": backends,
                 "match_ms": match_ms, "hash_and_match_ms": total_ms}
            )  # fmt: skip
            await store.close()
    return rows


def memory_store_bytes_per_million(blocks: int) -> float:
    """Bytes tracemalloc sees for `blocks` entries (8 backends, distinct prompts), per million."""

    async def fill() -> MemoryIndex:
        store = MemoryIndex()
        per_call = 1000
        for start in range(0, blocks, per_call):
            chunk = [(start + i) * 0x9E3779B97F4A7C15 % 2**64 for i in range(per_call)]
            await store.record(MODEL, BLOCK_SIZE, chunk, f"backend-{start // per_call % 8}")
        return store

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = asyncio.run(fill())
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert store.stats()["entries"] == blocks
    return used / blocks * 1_000_000


# --- redis ----------------------------------------------------------------------------------------


@contextmanager
def redis_server() -> Iterator[int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server), or use --no-redis")
    port = free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


class CountingConnection(redis.asyncio.Connection):
    """Counts what the client sends: each send is one round trip (nothing here is pipelined)."""

    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


async def redis_round_trips(port: int, hashes: BlockHashes, backends: int, calls: int) -> float:
    """Client round trips per match, counted at the client's connection."""
    pool = redis.asyncio.ConnectionPool(port=port, connection_class=CountingConnection, socket_timeout=30)
    store = RedisIndex(redis.asyncio.Redis(connection_pool=pool), key_prefix=f"rt-{uuid.uuid4().hex}")
    ids = await populate(store, hashes, backends)
    await store.match(MODEL, BLOCK_SIZE, hashes, ids)  # connection handshake and script load
    before = CountingConnection.sends
    for _ in range(calls):
        await store.match(MODEL, BLOCK_SIZE, hashes, ids)
    trips = (CountingConnection.sends - before) / calls
    await store.close()
    await pool.aclose()
    return trips


async def ping_ms(port: int, repeats: int, calls: int) -> float:
    client = redis.asyncio.Redis(port=port)
    await client.ping()
    result = await time_async(client.ping, repeats, calls)
    await client.aclose()
    return result


def redis_bytes_per_million(port: int, blocks: int) -> float:
    async def fill() -> None:
        store = RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout_s=30, key_prefix="mem")
        per_call = 1000
        for start in range(0, blocks, per_call):
            chunk = [(start + i) * 0x9E3779B97F4A7C15 % 2**64 for i in range(per_call)]
            await store.record(MODEL, BLOCK_SIZE, chunk, f"backend-{start // per_call % 8}")
        await store.close()

    with redis.Redis(port=port) as client:
        client.flushall()
        before = int(client.info("memory")["used_memory"])
        asyncio.run(fill())
        used = int(client.info("memory")["used_memory"]) - before
    return used / blocks * 1_000_000


# --- output ---------------------------------------------------------------------------------------


def print_tables(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Prompt hashing (block size {BLOCK_SIZE}), median ms per request")
    for column in ("prompt tokens", "blocks", "chat text", "token ids", "blake2b baseline", "xxh3/blake2b"):
        table.add_column(column, justify="right")
    for r in result["hashing"]:
        table.add_row(*(str(r[k]) for k in ("prompt_tokens", "blocks", "text_ms", "tokens_ms",
                                            "blake2b_ms", "xxh3_vs_blake2b")))  # fmt: skip
    console.print(table)
    table = Table(title="Lookup over all backends (one match), median ms")
    for column in ("store", "prompt tokens", "backends", "match", "hash + match", "vs PING"):
        table.add_column(column, justify="right")
    ping = result.get("redis", {}).get("ping_ms")
    for r in result["lookup"]:
        ratio = f"{r['match_ms'] / ping:.1f}x" if r["store"] == "redis" and ping else "-"
        table.add_row(r["store"], str(r["prompt_tokens"]), str(r["backends"]), str(r["match_ms"]),
                      str(r["hash_and_match_ms"]), ratio)  # fmt: skip
    console.print(table)
    console.print(
        f"memory store: {result['memory_bytes_per_million_blocks'] / 2**20:.0f} MiB per million blocks"
    )
    if "redis" in result:
        redis_result = result["redis"]
        console.print(
            f"redis: {redis_result['bytes_per_million_blocks'] / 2**20:.0f} MiB per million blocks; "
            f"PING {redis_result['ping_ms']} ms; round trips per match: {redis_result['round_trips']}"
        )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    console = Console(width=120)
    result: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    result["hashing"] = hashing_rows(args)
    result["lookup"] = asyncio.run(lookup_rows(args, "memory", MemoryIndex))
    result["memory_bytes_per_million_blocks"] = memory_store_bytes_per_million(args.memory_blocks)
    if not args.no_redis:
        with redis_server() as port:
            url = f"redis://127.0.0.1:{port}/0"

            def make_redis() -> RedisIndex:
                return RedisIndex.from_url(url, socket_timeout_s=30, key_prefix=f"bench-{uuid.uuid4().hex}")

            result["lookup"] += asyncio.run(lookup_rows(args, "redis", make_redis))
            hasher = PromptHasher(MODEL, [BLOCK_SIZE])
            hashes = hasher.features(chat_body(max(args.prompt_tokens)), "chat")[1][BLOCK_SIZE]
            result["redis"] = {
                "ping_ms": asyncio.run(ping_ms(port, args.repeats, args.calls)),
                "round_trips": asyncio.run(redis_round_trips(port, hashes, max(args.backends), args.calls)),
                "bytes_per_million_blocks": redis_bytes_per_million(port, args.memory_blocks),
            }
    print_tables(result, console)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    trips = result.get("redis", {}).get("round_trips")
    return 0 if trips in (None, 1.0) else 1
