"""Plain data the router works on.

Everything here is immutable or numpy, and nothing imports FastAPI, httpx, aiohttp or redis: the live
gateway and the discrete-event simulator build the same `Candidates` and call the same `Router.plan`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Mode(enum.StrEnum):
    AGGREGATED = "aggregated"
    PD = "pd"


class Disaggregation(enum.StrEnum):
    NEVER = "never"
    ALWAYS = "always"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What the configuration says about one backend; never changes while it runs."""

    id: str
    model: str
    accelerator: str
    gpus: int
    roles: frozenset[Role]
    max_num_seqs: int = 256
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class BackendStats:
    """Live load of one backend: the gateway's own count plus what vLLM's /metrics said last."""

    healthy: bool = True
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """The few facts about a request that routing needs."""

    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool = False
    # Chained block hashes of the prompt, per block size used by this model's backends.
    block_hashes: Mapping[int, Sequence[int]] = field(default_factory=dict)


@dataclass(slots=True)
class Candidates:
    """The backends serving one model, as parallel arrays (one row per backend).

    `cached_tokens[i]` is how many leading prompt tokens backend i holds in KV cache (prefix index);
    `load` is in-flight plus waiting requests; `capacity` is how many requests it serves at once.
    """

    specs: tuple[BackendSpec, ...]
    healthy: np.ndarray
    can_prefill: np.ndarray
    can_decode: np.ndarray
    load: np.ndarray
    capacity: np.ndarray
    kv_usage: np.ndarray
    cached_tokens: np.ndarray

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    @classmethod
    def build(
        cls,
        specs: tuple[BackendSpec, ...],
        stats: tuple[BackendStats, ...],
        cached_tokens: np.ndarray | None = None,
    ) -> Candidates:
        n = len(specs)
        return cls(
            specs=specs,
            healthy=np.fromiter((s.healthy for s in stats), dtype=bool, count=n),
            can_prefill=np.fromiter((Role.PREFILL in s.roles for s in specs), dtype=bool, count=n),
            can_decode=np.fromiter((Role.DECODE in s.roles for s in specs), dtype=bool, count=n),
            load=np.fromiter((max(s.in_flight, s.running) + s.waiting for s in stats), dtype=float, count=n),
            capacity=np.fromiter((s.max_num_seqs for s in specs), dtype=float, count=n),
            kv_usage=np.fromiter((s.kv_usage for s in stats), dtype=float, count=n),
            cached_tokens=np.zeros(n, dtype=np.int64) if cached_tokens is None else cached_tokens,
        )


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The router's answer: indices into `Candidates`, best first; later entries are fallbacks.

    Aggregated plans use `aggregated`; P/D plans use `prefill` and `decode` (and `aggregated` holds the
    backends to fall back to when a leg fails). `reason` is a short, bounded label for metrics.
    """

    mode: Mode
    aggregated: tuple[int, ...] = ()
    prefill: tuple[int, ...] = ()
    decode: tuple[int, ...] = ()
    reason: str = ""


class Router(Protocol):
    """A routing policy: pure and synchronous; the same object runs live and in simulation."""

    name: str

    def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan: ...

    def observe(self, outcome: Outcome) -> None:
        """Feedback after a request finishes (online cost correction); may do nothing."""
        ...


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one finished request measured, fed back to routers that learn."""

    backend_id: str
    mode: Mode
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True, slots=True)
class LegLoad:
    """The work one request leg puts on one backend, reserved when the request is planned."""

    prefill_tokens: int  # prompt tokens this backend must compute (uncached; 0 for the decode leg of a split)
    decode_tokens: int  # output tokens it will generate (1 for a prefill leg)
    context_tokens: int  # prompt tokens whose KV it will hold while decoding
