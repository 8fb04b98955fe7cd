"""Plain data the router works on.

Everything here is immutable or numpy, and nothing imports FastAPI, httpx, aiohttp or redis: the live
gateway and the discrete-event simulator build the same `Candidates` and call the same `Router.plan`.
"""

from __future__ import annotations

import enum
import math
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
    """Live load of one backend: the gateway's own accounting (in-flight legs and the work they reserved
    when planned) plus what vLLM's /metrics said last. `scoring/load.py` reconciles the two."""

    healthy: bool = True
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefill_tokens: int = 0  # reserved: uncached prompt tokens not yet prefilled
    prefill_seqs: int = 0  # reserved: legs whose prefill is not done
    decode_seqs: int = 0  # reserved: sequences that will decode here
    context_tokens: int = 0  # reserved: prompt tokens those sequences hold in KV


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """The few facts about a request that routing needs."""

    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool = False
    # Chained block hashes of the prompt, per block size used by this model's backends (the gateway's
    # are uint64 arrays: `kvindex.hashing.BlockHashes`).
    block_hashes: Mapping[int, Sequence[int] | np.ndarray] = field(default_factory=dict)
    # Per-request SLO in seconds (headers x-hetgate-slo-ttft-ms / -tpot-ms); None: the model's.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # The client named the conversation the request belongs to (header x-session-id; in the simulator,
    # `WorkloadRequest.session`): later turns will follow, so where its first turn decodes matters.
    in_conversation: bool = False


@dataclass(slots=True)
class Candidates:
    """The backends serving one model, as parallel arrays (one row per backend).

    `cached_tokens[i]` is how many leading prompt tokens backend i holds in KV cache (prefix index);
    `load` is requests in flight or queued (a count, for the count-based policies); `capacity` is how
    many requests it serves at once. The work columns (`prefill_tokens`, `prefill_len`, `decode_seqs`,
    `context_tokens`) say what the backend has ahead of a new request, as `scoring/load.py` reconciles
    them; `scoring/load.py`'s `WorkModel` prices them in seconds.
    """

    specs: tuple[BackendSpec, ...]
    healthy: np.ndarray
    can_prefill: np.ndarray
    can_decode: np.ndarray
    load: np.ndarray
    capacity: np.ndarray
    kv_usage: np.ndarray
    cached_tokens: np.ndarray
    # The share of an indexed prefix each backend's prompts still found when admitted, lately
    # (`scoring.load.CacheSurvival`; 1 where nothing was learnt): a small KV cache can evict a prefix
    # between the plan and the admission.
    cache_survival: np.ndarray
    prefill_tokens: np.ndarray
    prefill_len: np.ndarray
    decode_seqs: np.ndarray
    context_tokens: np.ndarray
    # `context_tokens` as it was when vLLM's `kv_usage` was reported: what the KV usage says beyond it is
    # other clients' context (`WorkModel.context`).
    context_when_reported: np.ndarray
    # The engine step in progress, as far as the gateway knows (`scoring.load.Reserved`): the prompt
    # tokens in it (part of `prefill_tokens`; 0: none known), the seconds since it was known to begin,
    # and the decode steps it waited for then (0.5: planned to an idle queue beside running decodes).
    step_tokens: np.ndarray
    step_elapsed: np.ndarray
    step_behind: np.ndarray
    # Split decode legs headed here whose KV has not come: their rows and when each is due, in seconds
    # from now (negative: overdue). A prefill planned on such a row before one is due holds it up.
    kv_due_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intp))
    kv_due_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # The clock this snapshot was read on (seconds: the registry's monotonic clock, the simulator's
    # time), the one `kv_due_s` is relative to: a policy dates what it books with it (`Joined`).
    now: float = 0.0

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def surviving_cached(self) -> np.ndarray:
        """The prompt tokens each backend is expected to still hold when the request is admitted:
        `cached_tokens` times `cache_survival` (what pricing and the reservation count as cached)."""
        surviving: np.ndarray = self.cached_tokens * self.cache_survival
        return surviving

    @classmethod
    def build(
        cls,
        specs: tuple[BackendSpec, ...],
        stats: tuple[BackendStats, ...],
        cached_tokens: np.ndarray | None = None,
        now: float = 0.0,
    ) -> Candidates:
        """From per-backend stats (tests, small tools); the registry and the simulator fill the same
        columns from their own state through the same formula (`scoring.load.load_columns`)."""
        from scoring.load import load_columns  # load.py imports this module

        n = len(specs)

        def col(name: str) -> np.ndarray:
            return np.fromiter((getattr(s, name) for s in stats), dtype=float, count=n)

        columns = load_columns(
            col("in_flight"),
            col("running"),
            col("waiting"),
            col("prefill_tokens"),
            col("prefill_seqs"),
            col("decode_seqs"),
            col("context_tokens"),
        )
        return cls(
            specs=specs,
            healthy=np.fromiter((s.healthy for s in stats), dtype=bool, count=n),
            can_prefill=np.fromiter((Role.PREFILL in s.roles for s in specs), dtype=bool, count=n),
            can_decode=np.fromiter((Role.DECODE in s.roles for s in specs), dtype=bool, count=n),
            capacity=np.fromiter((s.max_num_seqs for s in specs), dtype=float, count=n),
            kv_usage=col("kv_usage"),
            cached_tokens=np.zeros(n, dtype=np.int64) if cached_tokens is None else cached_tokens,
            cache_survival=np.ones(n),
            now=now,
            **columns,
        )


@dataclass(slots=True)
class Joined:
    """A planned prefill's share of the later ones: the roofline seconds that prompts planned after it
    added to the engine step it finishes in (vLLM fills a step with waiting prompts, and they finish
    together). Its policy adds them as it plans; at plan time they are unknown, so they are not in
    `Prediction`'s times, and calibration counts them with the queue (not as slowness).

    Only until that step starts (`closes_at`, on the clock of `Candidates.now`): vLLM schedules a step
    from the prompts waiting when it begins, and a prompt that arrives while it runs waits for the next
    one. A prompt planned on an idle backend starts at once (`closes_at` is its plan time)."""

    tokens: float  # the request's own prefill tokens on its backend
    closes_at: float = math.inf
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a pricing policy (`cost`) expects of the plan it chose, in seconds.

    `wait_s` is the queue ahead of the request's prefill, `compute_s` its own prefill, both on the prefill
    backend (the aggregated one when not split); `transfer_s` the KV transfer (0 when not split); `ttft_s`
    their sum plus the first decode step after a split; `tpot_s` the decode step at the batch and context
    the request joins, and `expected_tpot_s` that TPOT as the SLO check expects it (times the decoder's
    learnt TPOT correction; what the route header and the predicted-TPOT metric report).
    `roofline_queue_s` and `roofline_compute_s` are the first two as the roofline has them, before any
    learnt correction, and `roofline_fixed_queue_s` and `roofline_fixed_compute_s` the engine steps'
    fixed seconds in them, which no correction scales. `rows` names the backends it was made for: a
    request served by others (a retry, a fallback) teaches nothing with it. Outcomes carry them back so
    calibration can tell queue from compute (`scoring/outcome.py`, `scoring/calibration.py`); `joined`
    grows after the plan (see `Joined`).
    """

    wait_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    expected_tpot_s: float = 0.0
    roofline_queue_s: float = 0.0
    roofline_compute_s: float = 0.0
    roofline_fixed_queue_s: float = 0.0
    roofline_fixed_compute_s: float = 0.0
    rows: tuple[int, ...] = ()  # the `Candidates` rows it is for: (backend,) or (prefill, decode)
    joined: Joined | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The router's answer: indices into `Candidates`, best first; later entries are fallbacks.

    Aggregated plans use `aggregated`; P/D plans use `prefill` and `decode` (and `aggregated` holds the
    backends to fall back to when a leg fails). `reason` is a short, bounded label for metrics.
    `predicted` is set by policies that price plans (`cost`); None otherwise.
    """

    mode: Mode
    aggregated: tuple[int, ...] = ()
    prefill: tuple[int, ...] = ()
    decode: tuple[int, ...] = ()
    reason: str = ""
    predicted: Prediction | None = None


class Router(Protocol):
    """A routing policy: pure and synchronous; the same object runs live and in simulation."""

    name: str
    # Reads `Candidates.cached_tokens`: the gateway and the simulator look prefixes up only when True.
    uses_prefix_index: bool
    # Reads the work columns of `Candidates`; for the others they may be left zero.
    uses_work: bool
    # Learns from `observe`; for the others it does nothing and callers may skip building outcomes.
    learns: bool
    # Has a plan of the traffic to solve off the request path: its owner calls `replan` now and then
    # (the gateway in a worker thread every few seconds, the simulator every so many arrivals).
    replans: bool

    def plan(self, request: RequestFeatures, candidates: Candidates) -> RoutePlan: ...

    def observe(self, outcome: Outcome) -> None:
        """Feedback after a request leg finishes (online cost correction); may do nothing."""
        ...

    def correction(self, backend_id: str) -> float:
        """What it learnt of one backend: measured over predicted compute time (1.0: nothing)."""
        ...

    def queue_correction(self, backend_id: str) -> float:
        """What it learnt of one backend: measured over predicted queue ahead of a prefill (1.0: nothing)."""
        ...

    def tpot_correction(self, backend_id: str) -> float:
        """What it learnt of one backend: measured over predicted TPOT (1.0: nothing)."""
        ...

    def overhead(self, backend_id: str) -> float:
        """What it learnt of one backend: seconds a request pays besides its predicted work (0.0: none)."""
        ...

    def calibration(self) -> dict[str, float]:
        """Everything it learnt, by name, to share with other gateway replicas (empty: nothing)."""
        ...

    def blend_calibration(self, others: Mapping[str, Sequence[float]]) -> None:
        """Take in what other replicas learnt (their `calibration` values, per name); may do nothing."""
        ...

    def replan(self) -> None:
        """Solve its plan of the traffic seen (seconds of CPU at most; thread-safe against `plan`)."""
        ...


class Leg(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"  # the prefill leg of a split: measured up to its result
    DECODE = "decode"  # the decode leg of a split: KV transfer, then decoding


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one finished request leg measured, fed back to routers that learn (`scoring/outcome.py`
    builds them, for the gateway and the simulator alike).

    Times are seconds. `ttft_s` is measured from the leg's own start for a prefill leg (its result) and
    for an aggregated leg (first token); for a decode leg, `ttft_s` is from its start to its first token
    (KV transfer plus first step). `predicted` is what the plan expected (None: a policy that does not
    price plans); `peer_id` is the other backend of a split (the prefiller for a decode leg), naming the
    transfer pair.
    """

    backend_id: str
    mode: Mode
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    leg: Leg = Leg.AGGREGATED
    peer_id: str = ""
    predicted: Prediction | None = None
    tpot_s: float = 0.0
    # A split's decode leg: the whole request's TTFT, from its start (NaN for the other legs).
    request_ttft_s: float = math.nan


@dataclass(frozen=True, slots=True)
class LegLoad:
    """The work one request leg puts on one backend, reserved when the request is planned."""

    prefill_tokens: int  # prompt tokens this backend must compute (uncached; 0 for the decode leg of a split)
    decode_tokens: int  # output tokens it will generate (1 for a prefill leg)
    context_tokens: int  # prompt tokens whose KV it will hold while decoding
    # A split's decode leg: when its KV is due here (the prefill leg's predicted end, on the clock the
    # registry or simulator builds `Candidates` with); NaN for every other leg. See `Candidates.kv_due_s`.
    kv_due_s: float = math.nan
    # The seconds its own prefill takes here as the plan priced it (`Prediction.compute_s`); NaN when no
    # plan priced this backend for it. It dates the prefill in progress (`scoring.load.Reserved.head_tokens`).
    prefill_s: float = math.nan
    # What its engine's prefix cache will be asked for (`scoring.load.CacheSurvival`): the prompt tokens it
    # looks up (every leg: vLLM looks up the whole prompt, a split's decode leg too) and how many of them
    # the prefix index said this backend held when the leg was planned (0 for a split's decode leg).
    queried_tokens: int = 0
    indexed_tokens: int = 0

    @property
    def awaits_kv(self) -> bool:
        """A split's decode leg whose KV is still to come (see `kv_due_s`)."""
        return not math.isnan(self.kv_due_s)
