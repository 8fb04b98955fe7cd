"""Load as work: what each backend has ahead of a new request, and what that costs in seconds.

One formula in two halves, both vectorised over backends and used alike by the live registry
(`gateway/registry.py`) and the simulator (`bench/sim/des.py`):

1. `load_columns` reconciles two views of a backend into the columns of `Candidates`:
   - the gateway's own accounting: legs in flight and the work each reserved when it was planned
     (`Reserved`, fed with `LegLoad`s: uncached prompt tokens still to prefill, sequences that will
     decode, the prompt tokens of context they hold). It is exact for the gateway's traffic and has no lag;
   - vLLM's /metrics (`num_requests_running`, `num_requests_waiting`): it sees traffic from other clients
     but lags by a poll. Each column is the gateway's own figure now plus what vLLM reported beyond the
     gateway's own figure at the time of the report (`seen`): other clients' load. A request of the
     gateway's that has finished since the report then no longer counts; as the larger of the two views,
     a decoder whose only sequence had just ended looked busy until the next poll, and a burst's decodes
     were stacked on its peer (traced in the HTTP check, docs/policies.md, eleventh pass). With a fresh
     report (`seen` is now, as in the simulator) this is the larger of the two views.
2. `WorkModel` prices those columns with `scoring/cost.py`:
   - the wait: the prefill work ahead of a new request (vLLM schedules FCFS), as what is left of the
     engine step in progress and then the steps of the prompts waiting behind it (of the backend's mean
     prompt length, one step's token budget each), the decode batch riding along in every step;
   - `prefill_s`: a request's own (uncached) prefill on each backend, with the same riding decodes;
   - `tpot_s`: one decode step at the batch and context the request joins. The context is the reserved
     one plus what `kv_cache_usage_perc` said was in use beyond the context the columns gave when it was
     reported (KV blocks held by traffic the gateway did not plan).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np

from scoring.catalog import ModelSpec
from scoring.cost import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Hardware,
    StepCoefficients,
    kv_capacity_tokens,
    one_step,
    weight_terms,
)
from scoring.jit import kernel
from scoring.types import LegLoad, Prediction

# vLLM's default `max_num_batched_tokens` with chunked prefill (V1): the prefill tokens one step takes.
DEFAULT_CHUNK_TOKENS = 8192
# Decode steps a step planned to an idle queue waits for: the one running then, half done on average.
_IDLE_QUEUE_BEHIND = 0.5
# `CacheSurvival`: its sums forget one e-fold per this many prompt tokens looked up (~200 8k-token prompts),
# and it moves only once the index promised this many cached tokens within that window.
SURVIVAL_WINDOW_TOKENS = 2.0**20
SURVIVAL_MIN_INDEXED = 8192.0
# The two sides count a leg at slightly different moments (vLLM when it admits it, the gateway when its
# prefill is done or its KV came): a shortfall this small is timing, not eviction, and counts as none.
SURVIVAL_NOISE = 0.05


class Reserved:
    """The work a backend's legs in flight reserved when they were planned (`LegLoad` totals).

    One leg adds its prefill tokens until its prefill is done (`prefill_done`), and, when it decodes here
    (it holds context), one sequence and its context until it is released; a split's decode leg is due
    (`kv_due`) until its prefill, on the prefiller, is done.

    The legs still to prefill are also kept in the order they were planned, which is the order vLLM
    takes them in (first come, first served), so the first of them is the prompt in progress (the
    head). Counted in full until its first token, a 13k-token prompt weighed whole for the two 8k-token
    steps it takes, and every prompt planned behind it was priced with a queue half a prompt too long on
    average (the CPX on the Mooncake trace: multi-chunk queues came to 0.66 of their prediction).
    `load_columns` takes off the part of a head longer than one step that its own predicted prefill time
    says is done since it reached the front (`head_since`: when it was planned to an idle queue, or when
    the leg ahead of it was done; see `head_progress`). The head is kept as three attributes,
    `head_tokens`, `head_since` and `head_s`, which the registry reads for every backend on every
    request (a method call per backend cost ~10 us on 64).

    A head that fits in one step is the first prompt of the engine step in progress: that step began when
    the head reached the front (the one before it ended then, or the queue was idle), and took the legs
    queued then, up to one step's token budget (`step_tokens`). A prompt planned later cannot join it;
    it waits for what is left of it, then for the waiting legs' steps (`WorkModel.steps`). A head planned
    to an idle queue begins its step when the decode step running then ends: half a step later on
    average (`step_behind`, in decode steps; 0 when the step began as the one before it ended)."""

    __slots__ = (
        "arriving",
        "context_tokens",
        "decode_seqs",
        "head_s",
        "head_since",
        "head_tokens",
        "indexed_tokens",
        "kv_due",
        "prefill_tokens",
        "prefilling",
        "queried_tokens",
        "step_behind",
        "step_tokens",
    )

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.decode_seqs = 0
        self.context_tokens = 0
        self.kv_due: list[float] = []  # split decode legs still to start here: when their KV is due
        # Split decode legs sent here (their KV computed), before their first token: vLLM counts them in
        # `num_requests_waiting` while they wait for the KV pull and then for a step (`waiting_seqs`).
        self.arriving = 0
        self.prefilling: deque[LegLoad] = deque()  # legs still to prefill, first planned first
        # The first of them: its tokens (0: none), when it reached the front, its predicted prefill
        # seconds (`LegLoad.prefill_s`; infinite where no plan priced it, so none of it counts as done).
        self.head_tokens = 0.0
        self.head_since = 0.0
        self.head_s = math.inf
        self.step_tokens = 0.0  # the tokens of the step in progress (0: none known, see above)
        self.step_behind = 0.0
        # Running totals of the legs admitted here (`LegLoad.queried_tokens`, `.indexed_tokens`): what
        # `CacheSurvival` sets against vLLM's prefix cache counters.
        self.queried_tokens = 0
        self.indexed_tokens = 0

    def add(self, leg: LegLoad, now: float) -> None:
        if not leg.prefill_tokens and not leg.awaits_kv:
            self._looked_up(leg)  # nothing to wait for: admitted now
        self.prefill_tokens += leg.prefill_tokens
        if leg.prefill_tokens > 0:
            self.prefilling.append(leg)
            if len(self.prefilling) == 1:
                self._front(now, behind=_IDLE_QUEUE_BEHIND)
        if leg.context_tokens > 0:
            self.decode_seqs += 1
            self.context_tokens += leg.context_tokens
        if leg.awaits_kv:
            self.kv_due.append(leg.kv_due_s)

    def prefill_done(self, leg: LegLoad, now: float) -> None:
        """The leg's prompt is computed (for a split's decode leg: on its prefiller, so the leg is no
        longer due; it goes out to this backend and waits there, `arriving`, until `arrived`)."""
        self._prefill_over(leg, now)
        if leg.awaits_kv:
            self.arriving += 1

    def arrived(self) -> None:
        """A split's decode leg that `prefill_done` sent here made its first token (or ended before):
        vLLM no longer counts it as waiting. Once per such leg (its owner knows which legs are)."""
        self.arriving -= 1

    def release(self, leg: LegLoad, prefill_pending: bool, now: float) -> None:
        """Take the leg off; `prefill_pending` when it ends before its prefill was done (a failure). A
        decode leg that was sent here and ends before its first token needs `arrived` as well."""
        if prefill_pending:
            self._prefill_over(leg, now)
        if leg.context_tokens > 0:
            self.decode_seqs -= 1
            self.context_tokens -= leg.context_tokens

    def _prefill_over(self, leg: LegLoad, now: float) -> None:
        if leg.prefill_tokens or leg.awaits_kv:
            self._looked_up(leg)
        self.prefill_tokens -= leg.prefill_tokens
        if leg.prefill_tokens > 0:
            self._leave_queue(leg, now)
        if leg.awaits_kv:
            self.kv_due.remove(leg.kv_due_s)

    def _looked_up(self, leg: LegLoad) -> None:
        # Counted when vLLM has admitted the leg (its prefill is done, or its KV came), as vLLM counts
        # its prefix cache queries: counted at plan time, a burst's legs lowered `CacheSurvival` until
        # they were admitted (B200 + 2x H100 bursts: to 0.38).
        self.queried_tokens += leg.queried_tokens
        self.indexed_tokens += leg.indexed_tokens

    @property
    def prefill_seqs(self) -> int:
        """Legs whose prefill is not done (prices queued prompts at their length)."""
        return len(self.prefilling)

    @property
    def waiting_seqs(self) -> int:
        """The legs vLLM counts in `num_requests_waiting`: those still to prefill, and the split decode
        legs `arriving`. Without the latter, a decoder's legs waiting for their KV were read as other
        clients' prompts queued there, at the mean context's length each (B200 + 2x H100, Azure
        conversations over HTTP: short prompts split off the B200 for a phantom 800-token queue)."""
        return len(self.prefilling) + self.arriving

    def _leave_queue(self, leg: LegLoad, now: float) -> None:
        # By identity: two legs of one size are equal, and the one done is the one that leaves.
        for j, queued in enumerate(self.prefilling):
            if queued is leg:
                del self.prefilling[j]
                if j == 0:
                    self._front(now)  # the next one is at the front from now
                return

    def _front(self, now: float, behind: float = 0.0) -> None:
        if not self.prefilling:
            self.head_tokens, self.head_s, self.step_tokens = 0.0, math.inf, 0.0
            return
        leg = self.prefilling[0]
        self.head_tokens = float(leg.prefill_tokens)
        self.head_since = now
        self.head_s = leg.prefill_s if leg.prefill_s > 0.0 else math.inf  # NaN: not priced
        # Every leg queued now is in the step that starts now, up to its budget; a longer head's steps
        # are its own chunks, counted by `head_progress` instead.
        short = self.head_tokens <= DEFAULT_CHUNK_TOKENS
        self.step_tokens = float(min(self.prefill_tokens, DEFAULT_CHUNK_TOKENS)) if short else 0.0
        self.step_behind = behind


class CacheSurvival:
    """The share of the prefix the index promised a backend that its prompts still found when admitted.

    The prefix index says what a backend holds when a request is planned; vLLM looks the prompt up
    when it admits it, after the queue ahead, whose prompts may have evicted the prefix by then (LRU
    over free blocks; a small KV cache cycles in seconds). Each report of vLLM's prefix cache counters
    (`prefix_cache_hits`, `prefix_cache_queries`) is set against the gateway's own totals of the legs it
    planned there (`Reserved.indexed_tokens`, `.queried_tokens`), as rates, so other clients' traffic
    and other gateway replicas' do not skew it:

        found  = (hits / queries) / (indexed / queried)
        factor = min(1, found / (1 - SURVIVAL_NOISE))

    over sums that forget at one e-fold per `window_tokens` prompt tokens looked up (a window in work,
    not in time: the poller's cadence and the simulator's differ). It only ever discounts: an index
    that under-counts (approximate mode misses other clients' prompts) is not corrected upward."""

    __slots__ = ("_last", "_sums", "factor", "window_tokens")

    def __init__(self, window_tokens: float = SURVIVAL_WINDOW_TOKENS) -> None:
        self.window_tokens = window_tokens
        self.factor = 1.0
        self._last: tuple[float, float, float, float] | None = None
        self._sums = [0.0, 0.0, 0.0, 0.0]  # hits, queries, indexed, queried

    def observe(self, hits: float, queries: float, indexed: float, queried: float) -> None:
        """One report: vLLM's two counters and the gateway's two totals, as they stand now."""
        now = (hits, queries, indexed, queried)
        last, self._last = self._last, now
        if last is None:  # the first report is the baseline: vLLM may have run long before
            return
        delta = [a - b for a, b in zip(now, last, strict=True)]
        if min(delta[:2]) < 0:  # vLLM's counters went back: it restarted; start over
            self._sums = [0.0, 0.0, 0.0, 0.0]
            self.factor = 1.0
            return
        keep = math.exp(-max(delta[1], delta[3]) / self.window_tokens)
        self._sums = [s * keep + d for s, d in zip(self._sums, delta, strict=True)]
        hit, queried_vllm, promised, queried_own = self._sums
        if promised < SURVIVAL_MIN_INDEXED or queried_vllm <= 0.0:
            return  # too little promised lately to tell: keep the last factor
        found = (hit / queried_vllm) / (promised / queried_own)
        self.factor = min(1.0, found / (1.0 - SURVIVAL_NOISE))


def leg_load(
    leg: str,
    prompt_tokens: int,
    max_tokens: int,
    cached: int,
    kv_due_s: float = math.nan,
    prefill_s: float = math.nan,
    survival: float = 1.0,
) -> LegLoad:
    """The `LegLoad` of one leg of a request (leg: aggregated | prefill | decode) on one backend.

    `cached` is the prompt tokens the prefix index says that backend holds, and `survival` the share of
    such a prefix its prompts still found when admitted (`CacheSurvival`): a leg that prefills reserves
    the rest as uncached. `prefill_s` is the seconds the plan predicts for that prefill
    (`planned_prefill_s`). A prefill leg generates one token and keeps no sequence; the decode leg of a
    split computes no prompt tokens (its KV is transferred) but holds the whole prompt as context, and
    its KV is due at `kv_due_s`. Every leg looks the whole prompt up in its backend's prefix cache (a
    decode leg too: vLLM takes its local hits before the connector's)."""
    if leg == "decode":
        return LegLoad(
            0, max_tokens, prompt_tokens, kv_due_s, queried_tokens=prompt_tokens, indexed_tokens=cached
        )
    uncached = max(prompt_tokens - int(cached * survival), 0)
    split = leg == "prefill"
    return LegLoad(
        uncached,
        1 if split else max_tokens,
        0 if split else prompt_tokens,
        prefill_s=prefill_s,
        queried_tokens=prompt_tokens,
        indexed_tokens=cached,
    )


def planned_prefill_s(predicted: Prediction | None, leg: str, row: int) -> float:
    """The prefill seconds `predicted` priced for `leg` (aggregated | prefill | decode) on backend `row`,
    or NaN: a decode leg computes no prompt, and a leg served where the plan did not price it (a retry,
    a fallback) was not priced there."""
    if predicted is None or leg == "decode" or not predicted.rows or predicted.rows[0] != row:
        return math.nan
    return predicted.compute_s if (len(predicted.rows) == 1) == (leg == "aggregated") else math.nan


def kv_due(predicted: Prediction | None, now: float) -> float:
    """When a split's decode leg is due on its decoder (`LegLoad.kv_due_s`): when the plan predicts its
    prefill leg to end (`now` if the plan was not priced); the gateway sends the decode leg then."""
    return now + (predicted.wait_s + predicted.compute_s if predicted is not None else 0.0)


def request_load(
    in_flight: np.ndarray,
    running: np.ndarray,
    waiting: np.ndarray,
    *,
    in_flight_seen: np.ndarray | None = None,
) -> np.ndarray:
    """Requests in flight or queued, counted once: the count-based policies' load. `in_flight_seen`: the
    gateway's own count when vLLM's were reported (None: now)."""
    f = np.float64
    seen = in_flight if in_flight_seen is None else in_flight_seen
    arrays = [np.asarray(x, dtype=f) for x in (in_flight, running, waiting, seen)]
    return _request_load_row(*arrays)


@kernel
def _requests_counted(in_flight: float, running: float, waiting: float, seen: float) -> float:
    """One backend's `request_load`: its legs in flight, and vLLM's running and waiting requests beyond
    the gateway's own count when they were reported (other clients')."""
    return in_flight + max(running + waiting - seen, 0.0)


@kernel
def _request_load_row(
    in_flight: np.ndarray, running: np.ndarray, waiting: np.ndarray, seen: np.ndarray
) -> np.ndarray:
    load = np.empty(in_flight.size)
    for i in range(in_flight.size):
        load[i] = _requests_counted(in_flight[i], running[i], waiting[i], seen[i])
    return load


def load_columns(
    in_flight: np.ndarray,
    running: np.ndarray,
    waiting: np.ndarray,
    prefill_tokens: np.ndarray,
    prefill_seqs: np.ndarray,
    decode_seqs: np.ndarray,
    context_tokens: np.ndarray,
    *,
    seen: np.ndarray | None = None,
    head: np.ndarray | None = None,
    now: float = 0.0,
) -> dict[str, np.ndarray]:
    """The load columns of `Candidates` from the gateway's accounting and vLLM's counts (see above).

    `seen` ([4, backends]): the gateway's own `in_flight`, `waiting_seqs` (`Reserved.waiting_seqs`: what
    vLLM counts as waiting of its legs), `decode_seqs` and `context_tokens` when vLLM's counts were
    reported (None: now, a fresh report with no split decode leg arriving). `head` ([5, backends]:
    `Reserved.head_tokens`, `head_since`, `head_s`, `step_tokens`, `step_behind` of each): the prompt in
    progress, of which the share its predicted prefill seconds say is done no longer counts as queued,
    and the step in progress (None: nothing is taken off, no step is known)."""
    if seen is None:
        seen = np.stack((in_flight, prefill_seqs, decode_seqs, context_tokens))
    f = np.float64
    own = tuple([np.asarray(x, dtype=f) for x in (in_flight, running, waiting, prefill_tokens,
                                                  prefill_seqs, decode_seqs, context_tokens)])  # fmt: skip
    step = head is not None
    rows = _load_rows(own, np.asarray(seen, dtype=f), np.asarray(head if step else seen, dtype=f), step,
                      float(now), float(DEFAULT_CHUNK_TOKENS))  # fmt: skip
    return dict(zip(LOAD_COLUMNS, rows, strict=True))


# `load_columns`' keys, in the order of `_load_rows`' rows.
LOAD_COLUMNS = ("load", "prefill_tokens", "prefill_len", "decode_seqs", "context_tokens",
                "context_when_reported", "step_tokens", "step_elapsed", "step_behind")  # fmt: skip


@kernel
def _load_rows(
    own: tuple[np.ndarray, ...],
    seen: np.ndarray,
    head: np.ndarray,
    step_known: bool,
    now: float,
    chunk: float,
) -> np.ndarray:
    """`load_columns`' rows (`LOAD_COLUMNS`; `load` as `request_load` counts it), backend by
    backend, from its seven own columns (in flight, running, waiting, prefill tokens, prefill
    sequences, decode sequences, context tokens); `head` is read only if `step_known`."""
    in_flight, running, waiting, prefill_tokens, prefill_seqs, decode_seqs, context_tokens = own
    n = running.size
    rows = np.zeros((len(LOAD_COLUMNS), n))
    done = head_progress(head[:3], now, chunk) if step_known else np.zeros(n)
    for i in range(n):
        # vLLM's counts beyond the gateway's own at the time of the report: other clients' requests.
        # Waiting prompts beyond the gateway's own still to prefill; running sequences beyond its
        # decoding ones.
        rows[0, i] = _requests_counted(in_flight[i], running[i], waiting[i], seen[0, i])
        other_waiting = max(waiting[i] - seen[1, i], 0.0)
        other_running = max(running[i] - seen[2, i], 0.0)
        # Context per sequence from the gateway's own sequences; vLLM's extra ones are taken to be alike.
        mean_context = context_tokens[i] / decode_seqs[i] if decode_seqs[i] > 0 else 0.0
        # Prompts queued ahead: the reserved tokens less the part of the prompt in progress already
        # computed, and others' waiting requests at the mean prompt length.
        prompt_len = prefill_tokens[i] / prefill_seqs[i] if prefill_seqs[i] > 0 else mean_context
        queued = prefill_tokens[i] - done[i] + other_waiting * prompt_len
        others_context = other_running * mean_context
        rows[1, i] = queued
        rows[2, i] = max(min(prompt_len, queued), 1.0)
        rows[3, i] = decode_seqs[i] + other_running
        rows[4, i] = context_tokens[i] + others_context
        # What `context_tokens` was when vLLM's KV usage was reported (`WorkModel.context`).
        rows[5, i] = seen[3, i] + others_context
        if step_known:  # a leg that failed in the step may have left it: never more than is queued
            rows[6, i] = min(head[3, i], queued)
            rows[7, i] = now - head[1, i] if rows[6, i] > 0 else 0.0
            rows[8, i] = head[4, i]
    return rows


@kernel
def head_progress(head: np.ndarray, now: float, chunk_tokens: float = DEFAULT_CHUNK_TOKENS) -> np.ndarray:
    """The tokens of each backend's prompt in progress already computed at `now` (see `Reserved`): for
    a prompt longer than one step's token budget, its tokens times the time since it reached the front
    over its predicted prefill, and all but its last chunk once that time has passed; none for a
    shorter one, or where the prefill was not priced (`head_s` is infinite).

    A prompt that fits in one step is done when that step ends, together with the prompts batched with
    it, so the step's time is theirs as much as its own: credited by its own predicted seconds, the
    CPX's queues of short conversation prompts (Azure) looked shorter than they were (measured over
    predicted TTFT 1.26 -> 1.39). A longer one takes steps of its own, one chunk each."""
    tokens, since, seconds = head[0], head[1], head[2]
    done = np.zeros(tokens.size)
    for i in range(tokens.size):
        if tokens[i] > chunk_tokens:
            # Past its predicted end (a compute correction still learning) it is late, not done: its
            # last chunk stays queued until its first token. (Counted done, a long prompt that an
            # MI308X took 3x its first prediction for hid 5 s of queue, and the outcomes behind it
            # taught that backend 76 ms of overhead per request and 2.8x its compute correction.)
            share = max(now - since[i], 0.0) / seconds[i]
            last = tokens[i] - chunk_tokens * (np.ceil(tokens[i] / chunk_tokens) - 1.0)
            done[i] = share * tokens[i] if share < 1.0 else tokens[i] - last
    return done


def kv_due_columns(dues: Sequence[Sequence[float]], now: float) -> tuple[np.ndarray, np.ndarray]:
    """`Candidates.kv_due_rows` and `kv_due_s` from each backend's `Reserved.kv_due` (absolute, on the
    clock `now` is read from)."""
    if not any(dues):  # the common case, in ~2 us on 64 backends
        return np.zeros(0, dtype=np.intp), np.zeros(0)
    rows = [row for row, due in enumerate(dues) for _ in due]
    return np.array(rows, dtype=np.intp), np.fromiter(chain.from_iterable(dues), float, len(rows)) - now


class Steps(NamedTuple):
    """`WorkModel.steps`: seconds per backend (see there); a tuple, cheaper to build than a dataclass."""

    base: np.ndarray
    step: np.ndarray
    wait: np.ndarray
    prefill: np.ndarray
    stall: np.ndarray
    ahead: np.ndarray
    mid_step: np.ndarray
    waiting: np.ndarray
    fixed_wait: np.ndarray
    fixed_prefill: np.ndarray
    fixed_ahead: np.ndarray


class WorkModel:
    """Prices `Candidates`' load columns in seconds on each backend's hardware (rows as in `hw`)."""

    def __init__(
        self,
        model: ModelSpec,
        hw: Hardware,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        self.model = model
        self.hw = hw
        self.efficiency = efficiency
        self.chunk_tokens = chunk_tokens
        self.kv_capacity = kv_capacity_tokens(model, hw, efficiency)
        self._step_time = StepCoefficients.of(model, hw, efficiency)
        # `steps_kernel`'s coefficients (`StepCoefficients.table`, `weight_terms`)
        self.table, self.weights = self._step_time.table(), weight_terms(model)
        # One decode step of a single sequence without context: the weights read and the step overhead,
        # which a backend pays once per step however many sequences share it.
        zero = np.zeros(len(hw.gemm_flops))
        self.fixed_step = np.asarray(self._step_time(zero, zero, zero + 1.0, zero))

    def context(
        self, context_tokens: np.ndarray, kv_usage: np.ndarray, when_reported: np.ndarray
    ) -> np.ndarray:
        """Decoding context: the reserved one, plus what vLLM's KV usage said was held beyond the
        context the gateway counted then (`when_reported`; with a fresh report, the larger of the two)."""
        return np.asarray(context_tokens + np.maximum(kv_usage * self.kv_capacity - when_reported, 0.0))

    def steps(
        self,
        new_tokens: np.ndarray,
        cached_tokens: np.ndarray,
        own_context: float,
        seqs: np.ndarray,
        context: np.ndarray,
        prefill_tokens: np.ndarray,
        prefill_len: np.ndarray,
        step_tokens: np.ndarray,
        step_elapsed: np.ndarray,
        step_behind: np.ndarray,
    ) -> Steps:
        """What a new request meets on every backend, in seconds, from six step times per backend
        (`steps_kernel`, compiled: the routing decision is on the request path):

        - `base`, `step`: one decode step of the running batch, without and with this request
          (`own_context` tokens of context);
        - `wait`: what is left of the prefill step in progress (`step_tokens` of the queued
          `prefill_tokens`, of prompts `prefill_len` long, known `step_elapsed` roofline seconds ago
          and begun `step_behind` decode steps after that), then the steps of the prompts waiting
          behind it, each of one step's token budget at most, the running batch riding each. vLLM
          schedules a step from what waits when it begins, so a new prompt cannot join the one in
          progress, and every step reads the weights again: on a weight-bound backend (the CPX's
          short prompts) a queue priced as one pass with the step in progress was a quarter short,
          and with the step's progress unknown a compute-bound one's (the B200's) a fifth long. A
          step that has not begun (it waits for the decode step in progress) is still open: it is
          priced as waiting, and a new prompt joins it;
        - `mid_step`: the decode step in progress a new prompt waits for first when no prefill step
          is known to run: what is left of it before an open step, half of one on average otherwise;
        - `prefill`: what this request's own prefill of `new_tokens` after `cached_tokens` adds to
          that: it joins the last waiting step if there is room, and those steps are priced with it,
          minus the same steps without it. A step reads the weights once for every prompt and decode
          in it; priced apart, a prompt joining a short queue paid the weights twice, and the compute
          correction learnt from those TTFTs drifted to half the truth (AMD seed cluster,
          conversation trace: MI300X 1.53 for a true 2.71);
        - `ahead`: seconds until the last of the waiting prompts' steps begins, the one a prompt or a
          split's decode leg queued now is admitted in (what is left of the step in progress, and the
          waiting prompts' full steps before it);
        - `waiting`: the prompt tokens queued behind the step in progress (the ones a new prompt may
          share a step with);
        - `stall`: how much longer the running batch's steps take, in all, while that prefill shares
          them (chunked prefill): the mixed step minus the decode-only one, weights counted once;
        - `fixed_wait`, `fixed_prefill`, `fixed_ahead`: the part of `wait`, `prefill` and `ahead` that
          is the steps' fixed seconds (`StepCoefficients.overhead_s` and `seq_s`: the scheduler, the
          launches, sampling), one per step they count. A backend slower than its roofline is slower at
          its arithmetic and its memory reads, not at those: the compute correction scales the rest
          (`scoring/cost_policy.py`). (Scaled with them, the AMD seed cluster's corrections of ~3 put 6 ms
          too many on every one-step prompt; the fit settled between the short prompts and the long
          ones, and priced the long ones 10 % short.)
        """
        f = np.float64
        columns = (new_tokens, cached_tokens, seqs, context, prefill_tokens, prefill_len, step_tokens,
                   step_elapsed, step_behind)  # fmt: skip
        out = steps_kernel(self.table, self.weights, float(self.chunk_tokens), float(own_context),
                     *[np.asarray(x, dtype=f) for x in columns])  # fmt: skip
        return Steps(*out)


@kernel
def steps_kernel(
    table: np.ndarray,
    weights: np.ndarray,
    chunk: float,
    own_context: float,
    new_tokens: np.ndarray,
    cached_tokens: np.ndarray,
    seqs: np.ndarray,
    context: np.ndarray,
    prefill_tokens: np.ndarray,
    prefill_len: np.ndarray,
    step_tokens: np.ndarray,
    step_elapsed: np.ndarray,
    step_behind: np.ndarray,
) -> np.ndarray:
    """`WorkModel.steps`' eleven rows, backend by backend (`table`, `weights`: `StepCoefficients`).
    Priced first as if the step in progress had begun (the common case); a step planned to an idle
    queue begins when the decode step running then ends, and until then it takes more prompts, as a
    waiting one does: while any backend has such a step, every step not known to have begun is priced
    as waiting (its tokens join the waiting ones)."""
    n = seqs.shape[0]
    out = np.empty((11, n))
    closed = np.empty(n, dtype=np.bool_)
    opening = np.empty(n, dtype=np.bool_)
    for i in range(n):
        out[0, i] = _step(table, weights, i, 0.0, 0.0, seqs[i], context[i])  # the running batch's step
        closed[i] = step_tokens[i] > 0 and step_elapsed[i] >= step_behind[i] * out[0, i]
        opening[i] = step_tokens[i] > 0 and not closed[i]
    any_opening = opening.any()
    for i in range(n):
        base, behind, elapsed = out[0, i], step_behind[i], step_elapsed[i]
        in_step = step_tokens[i] if closed[i] or not any_opening else 0.0
        new, batch, ctx = new_tokens[i], seqs[i], context[i]
        own_pairs = new * cached_tokens[i] + new * (new + 1.0) / 2.0  # `causal_pairs`
        length = prefill_len[i]
        pairs_per_token = (length * (length + 1.0) / 2.0) / length
        # The waiting prompts' steps, without and with this one (at least one: its own).
        waiting = max(prefill_tokens[i] - in_step, 0.0)
        alone_steps = np.ceil(waiting / chunk)
        with_steps = max(np.ceil((waiting + new) / chunk), 1.0)
        per_alone, per_with = 1.0 / max(alone_steps, 1.0), 1.0 / with_steps
        waiting_pairs = waiting * pairs_per_token
        # The decode batch with this request; the step in progress; one waiting step without and with
        # this prompt; this prompt alone beside the decodes.
        step = _step(table, weights, i, 0.0, 0.0, batch + 1.0, ctx + own_context)
        current = _step(table, weights, i, in_step, in_step * pairs_per_token, batch, ctx)
        alone = _step(table, weights, i, waiting * per_alone, waiting_pairs * per_alone, batch, ctx)
        joined_tokens, joined_pairs = (waiting + new) * per_with, (waiting_pairs + own_pairs) * per_with
        joined = _step(table, weights, i, joined_tokens, joined_pairs, batch, ctx)
        mixed = _step(table, weights, i, new, own_pairs, batch, ctx)
        if closed[i]:
            left, mid_step = max(current + behind * base - elapsed, 0.0), 0.0
        else:
            left = 0.0
            mid_step = max(behind * base - elapsed, 0.0) if opening[i] else 0.5 * base
        wait = left + alone_steps * alone
        out[1, i] = step
        out[2, i] = wait
        out[3, i] = (left + with_steps * joined) - wait
        out[4, i] = max(mixed - base, 0.0)
        out[5, i] = left + max(alone_steps - 1.0, 0.0) * alone
        out[6, i] = mid_step
        out[7, i] = waiting
        fixed = table[4, i] + table[5, i] * batch  # `one_step`'s fixed seconds at this batch
        out[8, i] = alone_steps * fixed
        out[9, i] = (with_steps - alone_steps) * fixed
        out[10, i] = max(alone_steps - 1.0, 0.0) * fixed
    return out


@kernel
def corrected(k: float, roofline_s: float, fixed_s: float) -> float:
    """Roofline seconds as a backend with compute correction `k` takes them: the correction scales all
    but the steps' fixed seconds (`Steps`), which are the engine's, not the hardware's."""
    return k * (roofline_s - fixed_s) + fixed_s


@kernel
def _step(
    table: np.ndarray, weights: np.ndarray, i: int, tokens: float, pairs: float, batch: float, context: float
) -> float:
    """`one_step` on backend `i`."""
    linear, byte, pair, kv, overhead, seq = table[:, i]
    always, expert, routed, keep = weights
    return one_step(
        tokens, pairs, batch, context, linear, byte, pair, kv, overhead, seq, always, expert, routed, keep
    )
