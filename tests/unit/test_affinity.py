"""Prefix affinity on the request path (gateway/affinity.py) with a real memory index: what a lookup
reports, and what a served request records."""

from __future__ import annotations

import orjson

from gateway.affinity import Affinity
from gateway.config import parse_config
from gateway.registry import Registry
from gateway.schemas import Kind, ParsedRequest, parse_body
from kvindex.memory import MemoryIndex
from kvindex.prompt import PromptHasher

BS = 16


def rig() -> tuple[Registry, MemoryIndex, Affinity]:
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "backends": [
                {"id": f"b{i}", "url": f"http://127.0.0.1:{i + 1}", "model": "m", "accelerator": "cpu"}
                for i in range(2)
            ],
        }
    )
    index = MemoryIndex()
    # b1's KV events feed the index: the gateway adds no guesses for it.
    affinity = Affinity(index, {"m": PromptHasher("m", [BS])}, None, precise_backends={"b1"})
    return Registry(config), index, affinity


def completion(prompt: str) -> ParsedRequest:
    return parse_body(orjson.dumps({"model": "m", "prompt": prompt}), Kind.COMPLETIONS)


async def test_served_backends_are_recorded_except_those_fed_by_kv_events() -> None:
    registry, _, affinity = rig()
    pool = registry.pools["m"]
    request = completion("x" * 4 * BS * 5)  # 5 blocks of text
    features, cached = await affinity.lookup(request, pool, {})
    assert cached.tolist() == [0, 0]
    affinity.record(request, pool, features, list(pool.backends))
    await affinity.drain()
    _, cached = await affinity.lookup(request, pool, {})
    assert cached.tolist() == [5 * BS, 0]


async def test_a_hit_never_exceeds_the_estimated_prompt() -> None:
    registry, index, affinity = rig()
    pool = registry.pools["m"]
    request = completion("漢" * 4 * BS * 4)  # 3 UTF-8 bytes a character: 12 blocks hashed, ~64 tokens
    features, _ = await affinity.lookup(request, pool, {})
    hashes = features.block_hashes[BS]
    assert len(hashes) * BS > features.prompt_tokens
    await index.record("m", BS, hashes, "b0")
    _, cached = await affinity.lookup(request, pool, {})
    assert cached.tolist() == [features.prompt_tokens, 0]
