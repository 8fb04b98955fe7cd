"""Workloads: plain request records from real traces or synthetic generators, for the DES and HTTP load.

A prompt is a run of content blocks: block id -> a deterministic run of `block_tokens` token ids (word ids
of `bench/sim/tokenizer.py`'s vocabulary, so `text()` round-trips through the simulated server's tokenizer).
Two prompts that share leading block ids share a real token prefix, which is how traces with prefix reuse
are replayed faithfully:

* Mooncake (`mooncake_synthetic_trace.jsonl`): `hash_ids` are 512-token blocks shared across requests;
  `timestamp` is in milliseconds.
* Azure LLM 2023 (`azure_llm_2023_code.csv`, `..._conv.csv`): lengths and arrival times only; every prompt
  is unique (no shared blocks).
* Synthetic: shared system prompts, multi-turn chats (each turn's prompt extends the previous one), long
  context coding (a few large repositories, short questions), and fixed lengths (the seed case).
* Any trace file in either format: `load_trace(path)` picks the reader by the file's content.

The traces ship with the package (`bench/data/traces/`, licences and citation in its README);
`$HETGATE_TRACES` names another folder holding files of the same names.
Arrival times can be replaced by a Poisson process at a chosen rate (`with_poisson_arrivals`), by bursts
(groups of requests at one instant, `with_bursty_arrivals`) or scaled (`with_speedup`); closed-loop
concurrency is a property of the runner (`bench/sim/des.py`).
"""

from __future__ import annotations

import csv
import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import numpy as np

# Beside this module in a source tree and in an installed package alike (package data of `bench`).
TRACES_DIR = Path(__file__).resolve().parent / "data" / "traces"
MOONCAKE_BLOCK_TOKENS = 512
# Word ids drawn for prompts: past the specials and punctuation, inside the generated word vocabulary.
FIRST_WORD_ID = 64
NUM_WORD_IDS = 32000
# Block ids of generated (non-trace) content live far above any trace hash id.
_SYNTHETIC_BASE = 1 << 40
_MASK64 = (1 << 64) - 1
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Prompt:
    """The concatenation of content blocks, cut to `length` tokens."""

    blocks: tuple[int, ...]
    length: int
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def token_array(self) -> np.ndarray:
        needed = -(-self.length // self.block_tokens)
        parts = [block_token_ids(block, self.block_tokens) for block in self.blocks[:needed]]
        return np.concatenate(parts)[: self.length]

    def token_ids(self) -> list[int]:
        return self.token_array().tolist()


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float
    prompt: Prompt
    max_tokens: int
    session: str | None = None  # multi-turn conversation this request belongs to

    @property
    def prompt_len(self) -> int:
        return self.prompt.length

    def token_ids(self) -> list[int]:
        return self.prompt.token_ids()

    def token_array(self) -> np.ndarray:
        return self.prompt.token_array()

    def text(self) -> str:
        """The prompt as words, for an HTTP load generator (about one token per word)."""
        from bench.sim.tokenizer import SimTokenizer

        return _tokenizer(SimTokenizer).decode(self.token_ids())


@functools.cache
def _tokenizer(cls: type[_T]) -> _T:
    return cls()


@functools.lru_cache(maxsize=4096)
def block_token_ids(block_id: int, block_tokens: int) -> np.ndarray:
    """The deterministic content of one block (same id, same tokens, in every process): a splitmix64
    hash of (block id, position), folded into the word ids."""
    x = _position_mix(block_tokens) + np.uint64((block_id * 0x9E3779B97F4A7C15) & _MASK64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    ids = (x % np.uint64(NUM_WORD_IDS)).astype(np.int64) + FIRST_WORD_ID
    ids.flags.writeable = False
    return ids


@functools.cache
def _position_mix(block_tokens: int) -> np.ndarray:
    # uint64 array arithmetic wraps silently (scalar arithmetic would warn), which splitmix relies on.
    positions = np.arange(1, block_tokens + 1, dtype=np.uint64)
    mix = positions * np.uint64(0xBF58476D1CE4E5B9)
    mix.flags.writeable = False
    return mix


def traces_dir() -> Path:
    env = os.environ.get("HETGATE_TRACES")
    return Path(env) if env else TRACES_DIR


def _blocks_for(tokens: int, block_tokens: int) -> int:
    return max(1, -(-tokens // block_tokens))


# --- traces ---------------------------------------------------------------------------------------------
def mooncake_trace(path: str | Path | None = None, limit: int | None = None) -> list[WorkloadRequest]:
    """Mooncake's synthetic trace: shared 512-token blocks by `hash_ids`, arrivals in milliseconds."""
    source = Path(path) if path else traces_dir() / "mooncake_synthetic_trace.jsonl"
    requests = []
    with source.open() as lines:
        for i, line in enumerate(lines):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            length = int(row["input_length"])
            blocks = tuple(int(h) for h in row["hash_ids"])
            # Some rows have fewer hash ids than their length needs: pad with blocks unique to the row.
            missing = _blocks_for(length, MOONCAKE_BLOCK_TOKENS) - len(blocks)
            blocks += tuple(_SYNTHETIC_BASE + i * 1024 + k for k in range(max(0, missing)))
            requests.append(
                WorkloadRequest(
                    f"mooncake-{i}",
                    row["timestamp"] / 1000.0,
                    Prompt(blocks, length),
                    max(1, int(row["output_length"])),
                )
            )
    return requests


def azure_trace(
    kind: str = "code", path: str | Path | None = None, limit: int | None = None
) -> list[WorkloadRequest]:
    """Azure LLM inference trace 2023 (`kind` code or conv): lengths and arrivals; no shared prefixes."""
    if kind not in ("code", "conv"):
        raise ValueError(f"azure trace kind must be 'code' or 'conv', not {kind!r}")
    source = Path(path) if path else traces_dir() / f"azure_llm_2023_{kind}.csv"
    requests: list[WorkloadRequest] = []
    start: datetime | None = None
    with source.open(newline="") as handle:
        for i, row in enumerate(csv.DictReader(handle)):
            if limit is not None and i >= limit:
                break
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            start = start or stamp
            length = max(1, int(row["ContextTokens"]))
            requests.append(
                WorkloadRequest(
                    f"azure-{kind}-{i}",
                    (stamp - start).total_seconds(),
                    _unique_prompt(f"azure-{kind}", i, length),
                    max(1, int(row["GeneratedTokens"])),
                )
            )
    return requests


def load_trace(path: str | Path, limit: int | None = None) -> list[WorkloadRequest]:
    """A trace file in Mooncake (JSON lines with `hash_ids`) or Azure LLM 2023 (CSV with `ContextTokens`)
    format, told apart by the first line, not the file name."""
    source = Path(path)
    with source.open() as handle:
        first = handle.readline().strip()
    if first.startswith("{"):
        return mooncake_trace(source, limit)
    if "ContextTokens" in first and "GeneratedTokens" in first:
        return azure_trace("conv" if "conv" in source.name else "code", source, limit)
    raise ValueError(f"{source}: neither a Mooncake (JSON lines) nor an Azure (CSV) trace")


def _unique_prompt(
    namespace: str, index: int, length: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Prompt:
    base = _SYNTHETIC_BASE + (_stable_id(namespace) << 24) + index * 4096
    return Prompt(tuple(base + k for k in range(_blocks_for(length, block_tokens))), length, block_tokens)


def _stable_id(name: str) -> int:
    return int.from_bytes(name.encode()[:6].ljust(6, b"\0"), "big") & 0xFFFF


# --- synthetic ------------------------------------------------------------------------------------------
def fixed_lengths(n: int, prompt_tokens: int, max_tokens: int, name: str = "fixed") -> list[WorkloadRequest]:
    """`n` unique prompts of one length (no prefix sharing), all arriving at t=0 (use a concurrency)."""
    return [
        WorkloadRequest(f"{name}-{i}", 0.0, _unique_prompt(name, i, prompt_tokens), max_tokens)
        for i in range(n)
    ]


def shared_system_prompts(
    n: int,
    *,
    system_prompts: int = 4,
    system_tokens: int = 2048,
    user_tokens: int = 256,
    max_tokens: int = 128,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Each request = one of a few long system prompts + a unique user message."""
    rng = np.random.default_rng(seed)
    bt = MOONCAKE_BLOCK_TOKENS
    system_blocks = _blocks_for(system_tokens, bt)
    requests = []
    for i in range(n):
        system = int(rng.integers(system_prompts))
        shared = tuple(_SYNTHETIC_BASE + (1 << 32) + system * 4096 + k for k in range(system_blocks))
        own = _unique_prompt(f"sys{seed}", i, user_tokens).blocks
        prompt = Prompt(shared + own, system_blocks * bt + user_tokens)
        requests.append(WorkloadRequest(f"sys-{seed}-{i}", 0.0, prompt, max_tokens))
    return requests


def multi_turn_chats(
    sessions: int,
    turns: int,
    *,
    system_tokens: int = 1024,
    turn_tokens: int = 512,
    max_tokens: int = 128,
    think_time_s: float = 5.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Chats whose turn k prompt is turn k-1's prompt plus its answer and a new message (block-aligned)."""
    bt = MOONCAKE_BLOCK_TOKENS
    rng = np.random.default_rng(seed)
    per_turn = _blocks_for(turn_tokens + max_tokens, bt)
    requests = []
    for s in range(sessions):
        blocks = _unique_prompt(f"chat{seed}", s, system_tokens).blocks
        start = float(rng.exponential(think_time_s))
        for t in range(turns):
            blocks += tuple(_SYNTHETIC_BASE + (2 << 32) + (s * turns + t) * 64 + k for k in range(per_turn))
            prompt = Prompt(blocks, len(blocks) * bt)
            arrival = start + t * think_time_s
            requests.append(
                WorkloadRequest(f"chat-{seed}-{s}-{t}", arrival, prompt, max_tokens, f"chat-{seed}-{s}")
            )
    return sorted(requests, key=lambda r: r.arrival_s)


def long_context_coding(
    n: int,
    *,
    repositories: int = 2,
    repo_tokens: int = 32768,
    question_tokens: int = 512,
    max_tokens: int = 256,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Questions about a few large code bases: a long shared context, a short unique question."""
    bt = MOONCAKE_BLOCK_TOKENS
    rng = np.random.default_rng(seed)
    repo_blocks = _blocks_for(repo_tokens, bt)
    requests = []
    for i in range(n):
        repo = int(rng.integers(repositories))
        shared = tuple(_SYNTHETIC_BASE + (3 << 32) + repo * 65536 + k for k in range(repo_blocks))
        own = _unique_prompt(f"code{seed}", i, question_tokens).blocks
        requests.append(
            WorkloadRequest(
                f"code-{seed}-{i}", 0.0, Prompt(shared + own, repo_blocks * bt + question_tokens), max_tokens
            )
        )
    return requests


# --- arrivals -------------------------------------------------------------------------------------------
def with_poisson_arrivals(
    requests: Sequence[WorkloadRequest], rate: float, seed: int = 0
) -> list[WorkloadRequest]:
    """Same requests, in order, arriving as a Poisson process of `rate` requests per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(requests))
    return [replace(r, arrival_s=float(t)) for r, t in zip(requests, np.cumsum(gaps), strict=True)]


def with_bursty_arrivals(
    requests: Sequence[WorkloadRequest], rate: float, burst_size: int = 8, seed: int = 0
) -> list[WorkloadRequest]:
    """Same requests, in order, arriving in groups of `burst_size` at one instant; the groups arrive as a
    Poisson process, so the mean request rate is still `rate` (real traffic: a batch job, a retry storm)."""
    if rate <= 0 or burst_size < 1:
        raise ValueError("rate must be positive and burst_size at least 1")
    groups = -(-len(requests) // burst_size)
    starts = np.cumsum(np.random.default_rng(seed).exponential(burst_size / rate, groups))
    return [replace(r, arrival_s=float(starts[i // burst_size])) for i, r in enumerate(requests)]


def with_speedup(requests: Iterable[WorkloadRequest], factor: float) -> list[WorkloadRequest]:
    """Trace arrivals compressed `factor` times (2.0 = twice the request rate)."""
    if factor <= 0:
        raise ValueError("factor must be positive")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in requests]


def summarize(requests: Sequence[WorkloadRequest]) -> dict[str, float]:
    """Counts and mean lengths, for reports."""
    prompts = np.array([r.prompt_len for r in requests], dtype=float)
    outputs = np.array([r.max_tokens for r in requests], dtype=float)
    return {
        "requests": len(requests),
        "mean_prompt_tokens": float(prompts.mean()) if len(requests) else 0.0,
        "mean_output_tokens": float(outputs.mean()) if len(requests) else 0.0,
        "duration_s": float(max((r.arrival_s for r in requests), default=0.0)),
    }
