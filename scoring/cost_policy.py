"""The `cost` policy: price every plan in seconds, keep the SLO, spend the least of the cluster.

For one request (prompt P, cached c_i on backend i, up to M output tokens), all vectorised with numpy:

* **Aggregated on b**: TTFT = k_b * (queue_b + prefill_b(P - c_b after c_b)); TPOT = decode step of b at
  its batch + 1 and its context + this request's, plus its queued prefill spread over the M tokens
  (chunked prefill shares the decode steps).
* **Prefill on p, decode on d** (p != d, p may prefill, d may decode): TTFT = k_p * (queue_p + prefill_p)
  + t_pd * KV transfer of P tokens over the pair's slower link + d's step in progress and first decode
  step; TPOT = d's as above.

`queue`, `prefill` and the decode step are `scoring/load.py`'s one load formula over the backend's
reserved and reported work; prefill and transfer are `scoring/cost.py`'s roofline. Each plan also has a
**cluster cost**: the seconds of work it adds (own prefill on its prefill backend; M times the marginal
decode step on its decode backend, where under `never` an idle backend's first sequence does not pay the
step's weights read: see `choose`), each backend's seconds weighted by its compute (its dense FLOP/s
over the cluster's largest), so the plan that uses the least of the cluster's compute wins, and a
compute-rich backend is not spent on work a compute-poor one does as well (decode on a bandwidth-rich,
compute-poor backend is cheap; prefill costs about the same FLOPs anywhere, except that with a split
allowed a decode-only backend's prefill second is priced at the larger of its compute and bandwidth
shares, `_prefill_price`), plus the **delay it imposes
on the requests already running**: a prefill on b stalls each of b's running decodes for its compute
(chunked prefill puts its chunks into their steps), and one more sequence on d lengthens each of d's
other sequences' steps for about this request's output length, a prefill delays the prompts queued
in the step it joins (vLLM batches waiting prompts in one step; they finish together), and it holds up
the split decode legs headed to b whose KV is due before it ends (`_held_up`). Without that
term the policy packed decodes onto the backends with the cheapest seconds until their TPOT broke (AMD
seed cluster, shared system prompts: 0.25x round robin's SLO capacity), and past saturation sent
16k-token prompts to the compute-poor decoders, whose running decodes then missed their TPOT.

**The choice.** Plans that meet the SLO (TTFT <= `ttft_s`, TPOT <= `tpot_s`, and the decode backend's
KV holds the request) are feasible. Among them, those whose cost is within `cost_tolerance` of the
cheapest, and of these the one that finishes first (TTFT + M * TPOT, plus the delay it imposes). Without
a feasible plan, the one that finishes first by the same measure. The SLO comes from the model's config
(`slo: {ttft_s, tpot_s}`), the request (`RequestFeatures.slo_*`), or by default 5x the unloaded TTFT and
3x the unloaded TPOT of the fastest backend for this request (DistServe-style goodput SLO).

**Roles.** Aggregated plans run on any backend that may decode (a decode-only vLLM serves a request
without KV parameters whole, as the other policies and the fluid bound assume). A backend with both
roles may be p in one plan and d in the next, so the prefill:decode ratio follows the traffic; a
backend with one role only ever takes that role in a split. `never`
prices aggregated plans only; `always` split plans only (aggregated when no pair is healthy); `auto`
both, with no token floor unless `pd_min_prompt_tokens` is configured (then a split needs a decoder
that lacks at least that many of the prompt's tokens; `split_gate_tokens`).

**Calibration** (`observe`, outcomes built by `scoring/outcome.py`): per backend, k_b corrects its
compute. It is fitted by least squares to the measured TTFTs of the prefills it did (the prefill leg of
a split is measured on its own) together with a second factor on the roofline's queue ahead of them,
in `scoring/calibration.py`, which says why: the queue model's own error is then not taken for slow
compute. That queue factor (`queue_correction`) is a diagnostic, not a price: the queue is priced as
k_b times the roofline's, as the other work on that backend. Priced with it, the NVIDIA mix lost under
`auto`: the queue model is pessimistic on average under steady load (factor 0.6-0.9 there) but not
in a burst, where all of a group's prompts queue at once (SLO capacity, bursty@nvidia 37.9 -> 3.71
requests/s, multi-turn 18.8 -> 14.6, Azure conversations 17.7 -> 13.6). t_pd corrects the transfer
per (prefill, decode) pair from the decode leg's time to first token, moving by `learning_rate` of
its relative error (more for the first outcomes: `_rate`), clipped to [0.1, 10]. A TPOT correction
per backend (measured over predicted TPOT of the legs that decoded there, clipped to [0.5, 4], learnt
at the same rate) carries what no prediction at plan time sees: the prefill chunks of requests that
arrive while a request decodes. It scales TPOT only in the SLO check,
not in the price or the finish time (there it made fast decoders look slow, and an earlier version
that scaled the decode step itself drove the factors to the clip limits).

Ties keep a rotating order, so identical backends share the load.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from scoring.calibration import CLIP, ComputeFit
from scoring.catalog import Catalog, ModelSpec, load_catalog
from scoring.conversations import ConversationStarts, TrafficWindow
from scoring.cost import (
    DEFAULT_EFFICIENCY,
    HARDWARE_FIELDS,
    Efficiency,
    Hardware,
    ScalarStepTime,
    kv_transfer_time,
)
from scoring.jit import kernel
from scoring.load import DEFAULT_CHUNK_TOKENS, WorkModel, corrected, steps_kernel
from scoring.router import Rotation, SimpleRanker, SplitSettings, rotated
from scoring.slo_plan import Servers
from scoring.types import (
    BackendSpec,
    BackendStats,
    Candidates,
    Disaggregation,
    Joined,
    Leg,
    Mode,
    Outcome,
    Prediction,
    RequestFeatures,
    Role,
    RoutePlan,
)

_CLIP = CLIP  # the transfer corrections, as the compute ones
_TPOT_CLIP = (0.5, 4.0)
# A split meets the TTFT target only if it would at this quantile of its pair's measured over predicted
# TTFT (`_learn_headroom`): the goodput target's share of requests. The running quantile moves by this
# much (log) per split served, and never below the prediction itself.
_SPLIT_QUANTILE = 0.9
_HEADROOM_STEP = 0.05
_HEADROOM_CLIP = (1.0, 10.0)
_PLANNED_KEPT = 64  # per backend: more than a step's worth of queued prompts
_Key = TypeVar("_Key", str, tuple[str, str])  # what a correction is kept per: backend, or transfer pair
# A `Prediction`'s fields in order, less `joined` (what `CostRanker._route` builds it from).
_Predicted = tuple[float, float, float, float, float, float, float, float, float, float, tuple[int, ...]]
# `_price_rows`' arguments (`CostRanker._price_args`)
_PriceArgs = tuple[
    tuple[np.ndarray, np.ndarray, float],
    tuple[float, float, bool, float, float],
    tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    tuple[np.ndarray, ...],
    tuple[np.ndarray, np.ndarray],
]


@dataclass(frozen=True, slots=True)
class Slo:
    """Absolute targets in seconds (None: relative to the fastest backend, `*_factor` times unloaded)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    ttft_factor: float = 5.0
    tpot_factor: float = 3.0


@dataclass(slots=True)
class _Cluster:
    """What never changes for one set of backends: hardware rows, prices, per-pair transfer times (and
    the corrections as arrays, rebuilt when they change)."""

    specs: tuple[BackendSpec, ...]
    work: WorkModel
    price: np.ndarray  # compute weight of one second on each backend
    # What a second of prefill on each backend costs where a split is allowed: `price`, but on a
    # decode-only backend the larger of its compute and memory-bandwidth shares (see `_prefill_price`).
    prefill_price: np.ndarray
    kv_limit: np.ndarray  # the KV tokens a plan may fill (95 % of the capacity)
    # [4, p, d]: the pair correction, seconds per KV token (without the fixed latency), the fixed latency,
    # the split's TTFT headroom (`_learn_headroom`); one array so a plan's pairs take all four at once
    # (`_split`).
    links: np.ndarray
    fastest_prefill: ScalarStepTime  # the backend with the most compute, alone
    fastest_prefill_row: int
    fastest_decode: ScalarStepTime  # the backend with the most memory bandwidth, alone
    rows: dict[str, int]  # backend id -> row
    compute_factor: np.ndarray
    overhead_s: np.ndarray  # seconds each request pays besides its roofline work (`ComputeFit.overhead`)
    tpot_factor: np.ndarray  # measured over predicted TPOT (the SLO check's correction)
    pair_factor: np.ndarray  # [p, d], a view of `links[0]`
    headroom: np.ndarray  # [p, d], a view of `links[3]`
    starts: ConversationStarts  # where new conversations decode

    def set_pair(self, kind: str, pair: tuple[str, str], value: float) -> None:
        """Write a pair's learnt `pair` correction or `headroom` where the pricing reads it."""
        if pair[0] in self.rows and pair[1] in self.rows:
            array = self.pair_factor if kind == "pair" else self.headroom
            array[self.rows[pair[0]], self.rows[pair[1]]] = value


@dataclass(slots=True)
class _Priced:
    """The SLO a request was priced under, and `_price`'s figures per backend (`_price_rows`' rows, in
    this order)."""

    slo: tuple[float, float]  # (TTFT, TPOT) targets
    wait: np.ndarray
    compute: np.ndarray
    ttft: np.ndarray  # wait + compute: an aggregated plan's TTFT, a split's until its transfer
    compute_cost: np.ndarray  # compute weighted by the backend's price
    decode_price: np.ndarray  # decode_cost weighted by the backend's price
    tpot_seen: np.ndarray  # tpot as the SLO check sees it (times the learnt TPOT correction)
    roofline_wait: np.ndarray  # `wait` and `compute` before the learnt corrections
    roofline_compute: np.ndarray
    tpot: np.ndarray
    first_step: np.ndarray  # after a split: the decoder's step in progress, then its first decode step
    decode_cost: np.ndarray
    kv_ok: np.ndarray
    step: np.ndarray  # the decode step with this request in the batch
    stall: np.ndarray  # how much longer the running batch's steps take in all while this prefill runs
    seqs: np.ndarray  # sequences decoding
    delay: np.ndarray  # how much later the queued prompts that share this prefill's step finish, in all
    opens: np.ndarray  # seconds until the step a new prefill joins starts (later prompts may join it)
    waiting: np.ndarray  # prompt tokens queued behind the step in progress (`Steps.waiting`)
    prefill_harm: np.ndarray  # the delay a plan imposes as its prefill side, weighted (`_harm`)
    decode_harm: np.ndarray  # and as its decode side
    agg_ok: np.ndarray  # serving whole meets the SLO
    agg_finish: np.ndarray  # serving whole: TTFT + M * TPOT + the delay it imposes
    agg_cost: np.ndarray  # serving whole: the cluster's compute it takes + the delay it imposes
    roofline_fixed_wait: np.ndarray  # the steps' fixed seconds in `roofline_wait`, `roofline_compute`
    roofline_fixed_compute: np.ndarray


# `_Priced`'s rows as `_price_rows` writes them (constants to the compiled kernel)
_PRICED_ROWS = 25
wait_, compute_, ttft_, ccost_, dprice_, tseen_, rwait_, rcomp_, tpot_, first_, dcost_ = range(11)
kv_ok_, step_, stall_, seqs_, delay_, opens_, waiting_, pharm_, dharm_, aok_, afin_, acost_ = range(11, 23)
rfixq_, rfixc_ = 23, 24


class CostRanker(SimpleRanker):
    name = "cost"
    uses_prefix_index = True
    uses_work = True
    judges_split = True
    learns = True
    replans = True  # where new conversations decode: `scoring.conversations`
    # It prices a split in seconds, transfer included, so `auto` needs no token gate (an operator may
    # still set `pd_min_prompt_tokens`). The gate had hidden `_harm` pricing a second of a queued
    # prompt's TTFT like a second spread over a decode's output (docs/policies.md, tenth pass).
    split_gate_tokens = 0

    def __init__(
        self,
        model: ModelSpec,
        catalog: Catalog | None = None,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
        learning_rate: float = 0.1,
        slo: Slo | None = None,
        cost_tolerance: float = 0.5,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        self.model = model
        self.catalog = catalog or load_catalog()
        self.efficiency = efficiency
        self.learning_rate = learning_rate
        self.slo = slo or Slo()
        self.cost_tolerance = cost_tolerance
        self.chunk_tokens = chunk_tokens
        self._rotate = Rotation()
        self._clusters: dict[tuple[str, ...], _Cluster] = {}
        self._last: _Cluster | None = None
        self._fits: dict[str, ComputeFit] = {}  # compute and queue corrections per backend
        self._compute_prior = 1.0  # for a backend not measured yet: the others' geometric mean
        self._queue_prior = 1.0
        self._overhead_prior = 0.0
        self._pair_correction: dict[tuple[str, str], float] = {}
        self._traffic = TrafficWindow()  # what the SLO plan of `replan` is solved over
        self._tpot_correction: dict[str, float] = {}
        self._tpot_prior = 1.0
        self._tpot_outcomes: dict[str, int] = {}  # outcomes learnt per backend (`_rate`)
        self._pair_outcomes: dict[tuple[str, str], int] = {}  # and per transfer pair
        self._headroom: dict[tuple[str, str], float] = {}  # per transfer pair (`_learn_headroom`)
        self._planned: dict[str, deque[Joined]] = {}  # per backend, the last prefills planned

    # --- pricing ---------------------------------------------------------------------------------------
    def _price(
        self, request: RequestFeatures, c: Candidates, cl: _Cluster, whole_only: bool = False
    ) -> _Priced:
        """Every plan's figures per backend (`_Priced`), under the request's SLO targets: `_price_rows`
        in one compiled loop over the backends (as numpy, ~300 calls of ~1 us on 64 rows). `choose`
        prices inside `_plan_kernel` instead, from the same arguments."""
        args = self._price_args(request, c, cl, whole_only)
        rows = _price_rows(*args)
        figures: list[np.ndarray] = list(rows)
        figures[kv_ok_], figures[aok_] = rows[kv_ok_] > 0, rows[aok_] > 0
        return _Priced(args[1][3:5], *figures)

    def _price_args(
        self, request: RequestFeatures, c: Candidates, cl: _Cluster, whole_only: bool
    ) -> _PriceArgs:
        """`_price_rows`' arguments: the engine, the request under its SLO targets, the cluster's
        corrections, the load columns (the surviving cached tokens first) and the split legs due.
        `whole_only` (`never`): an idle backend's first sequence does not pay the step's weights read,
        and every backend's prefill is priced by its compute alone (see `choose`)."""
        work = cl.work
        slo_ttft, slo_tpot = self._targets(request, cl)
        f = np.float64
        prefill_price = cl.price if whole_only else cl.prefill_price
        context = work.context(c.context_tokens, c.kv_usage, c.context_when_reported)
        columns = (c.surviving_cached(), c.decode_seqs, context, c.prefill_tokens, c.prefill_len,
                   c.step_tokens, c.step_elapsed, c.step_behind)  # fmt: skip
        return (
            (work.table, work.weights, float(self.chunk_tokens)),
            (
                float(request.prompt_tokens),
                float(max(request.max_tokens, 1)),
                whole_only,
                slo_ttft,
                slo_tpot,
            ),
            (
                cl.compute_factor,
                cl.tpot_factor,
                prefill_price,
                cl.price,
                cl.kv_limit,
                work.fixed_step,
                cl.overhead_s,
            ),
            tuple([np.asarray(x, dtype=f) for x in columns]),
            (np.asarray(c.kv_due_rows, dtype=np.int64), np.asarray(c.kv_due_s, dtype=f)),
        )

    def predicted_ttft(self, request: RequestFeatures, candidates: Candidates) -> np.ndarray:
        """Aggregated TTFT on every backend (queue and own prefill, corrected)."""
        return self._price(request, candidates, self._cluster(candidates.specs)).ttft

    def _targets(self, request: RequestFeatures, cl: _Cluster) -> tuple[float, float]:
        """The request's SLO: its own, the model's, or relative to the cluster's fastest backends alone
        (prefill on the most compute, decode on the most bandwidth)."""
        ttft = request.slo_ttft_s or self.slo.ttft_s
        tpot = request.slo_tpot_s or self.slo.tpot_s
        prompt = request.prompt_tokens
        if ttft is None:
            # Corrected as that backend's measured prefills correct it: the target is relative to how
            # fast it really is (uncorrected, a roofline that is 2x optimistic halves the target and
            # every plan looks late).
            fastest = cl.fastest_prefill
            fixed = fastest.overhead_s  # one step's, which the correction does not scale (`Steps`)
            unloaded = fastest(prompt, 0.5 * prompt * (prompt + 1), 0, 0)
            k = float(cl.compute_factor[cl.fastest_prefill_row])
            ttft = self.slo.ttft_factor * corrected(k, unloaded, fixed)
        if tpot is None:
            tpot = self.slo.tpot_factor * cl.fastest_decode(0, 0, 1, prompt + 1)
        return ttft, tpot

    # --- the choice ------------------------------------------------------------------------------------
    def choose(self, request: RequestFeatures, candidates: Candidates, split: SplitSettings) -> RoutePlan:
        """The plan, priced, ranked and paired in one compiled call (`_plan_kernel`); what is left here
        is turning its arrays into the `RoutePlan` and booking the prefill (`_route`)."""
        c = candidates
        cl = self._cluster(c.specs)
        mode = split.disaggregation
        # Without a split, where a request decodes is where it prefills, and an idle backend's weights
        # read cost nothing that was not idle anyway: charged to the first sequence, they made an idle
        # backend look 10x dearer than a busy one and piled requests onto the busiest (B200 + 2xH100,
        # multi-turn chats: 19.3 -> 25.2 requests/s SLO capacity without the charge). With a split
        # allowed, those steps are the price of making a backend a decoder, which keeps a compute-rich
        # one prefilling (dropped there too, the AMD seed case lost a third of its SLO capacity), and a
        # decode-only backend's prefill is priced as the decoding it displaces (`_prefill_price`).
        args = self._price_args(request, c, cl, mode is Disaggregation.NEVER)
        turn = self._rotate.turn
        min_lacking = float(split.pd_min_prompt_tokens) if mode is Disaggregation.AUTO else -np.inf
        start = self._conversation_start(request, c, cl, args)
        can_decode = c.can_decode if start is None else np.arange(len(c)) == start
        rows, ranked, both, pair = _plan_kernel(
            args, (c.healthy, c.can_prefill, can_decode), cl.links,
            (_SPLIT_CODES[mode], min_lacking, turn, self.cost_tolerance),
        )  # fmt: skip
        if ranked.size == 0:
            return RoutePlan(mode=Mode.AGGREGATED, reason="no_healthy_backend")
        found, pi, di, feasible, cost, finish, transfer, ttft, prefills, decodes = pair
        # The aggregated plans took turn `turn`; a split's two sides `turn + 1` and `turn + 2`.
        self._rotate.turn = turn + (1 if found == _NO_ROWS else 3)
        aggregated = tuple(ranked.tolist())
        if start is not None:  # the other decoders stay as fallbacks, in the order they would have had
            others = _ranked(c.healthy & c.can_decode, turn, rows[acost_], rows[afin_], rows[aok_] > 0,
                             self.cost_tolerance)  # fmt: skip
            aggregated += tuple(i for i in others.tolist() if i != start)
        best = aggregated[0]
        agg = rows[:, best].tolist()
        agg_pred = _predicted(agg, agg, 0.0, agg[ttft_], (best,))
        surviving = args[3][0]
        if found != _FOUND:
            reason = "never" if mode is Disaggregation.NEVER else "no_split"
            plan = (Mode.AGGREGATED, aggregated, (), (), reason)
            return self._route(request, c, plan, agg_pred, rows, surviving)
        # `auto` weighs the split against serving whole where some backend has both roles.
        if mode is Disaggregation.AUTO and both:
            agg_rank = (not agg[aok_] > 0, agg[acost_], agg[afin_])
            if not _pair_wins((not feasible, cost, finish), agg_rank, self.cost_tolerance):
                plan = (Mode.AGGREGATED, aggregated, (), (), "split_costlier")
                return self._route(request, c, plan, agg_pred, rows, surviving)
        pair_pred = _predicted(rows[:, pi].tolist(), rows[:, di].tolist(), transfer, ttft, (pi, di))
        plan = (Mode.PD, aggregated, tuple(prefills.tolist()), tuple(decodes.tolist()), "split")
        return self._route(request, c, plan, pair_pred, rows, surviving)

    def _conversation_start(
        self, request: RequestFeatures, c: Candidates, cl: _Cluster, args: _PriceArgs
    ) -> int | None:
        """Notes the request for the SLO plan (`replan`). For the first turn of a named conversation,
        the one backend it may decode on (`ConversationStarts.pick`); None for any other request. A
        first turn is one no backend holds beyond what every backend holds, for half its prompt: no
        state, so gateway replicas agree, and a conversation whose KV was evicted starts afresh."""
        prompt, outputs, _, slo_ttft, slo_tpot = args[1]
        held = args[3][0]
        self._traffic.record(prompt, held, outputs, (slo_ttft, slo_tpot), request.in_conversation)
        if not request.in_conversation or float(held.max() - held.min()) >= 0.5 * prompt:
            return None
        return cl.starts.pick(c.healthy & c.can_decode)

    def replan(self) -> None:
        """The SLO plan of the traffic seen lately, solved for each set of backends (thread-safe
        against `choose`: it reads a copy of the traffic and swaps the shares in whole)."""
        traffic = self._traffic.snapshot()
        if traffic is None:
            return
        for cl in list(self._clusters.values()):
            cl.starts.replan(traffic)

    def _route(
        self,
        request: RequestFeatures,
        c: Candidates,
        plan: tuple[Mode, tuple[int, ...], tuple[int, ...], tuple[int, ...], str],
        predicted: _Predicted,
        rows: np.ndarray,
        surviving: np.ndarray,
    ) -> RoutePlan:
        """The plan (mode, aggregated, prefill, decode, reason) with its `Prediction` (the fields in
        order, less `joined`), its prefill booked on its backend (`_join`, by `_price_rows`' queue
        there, and the tokens it should still hold). Built once: rebuilt by `dataclasses.replace`, it
        cost more than the rest of the plan's bookkeeping."""
        mode, aggregated, prefill, decode, reason = plan
        row = prefill[0] if mode is Mode.PD else aggregated[0]
        queue = (float(rows[opens_, row]), float(rows[waiting_, row]), float(surviving[row]))
        joined = self._join(request, c, row, predicted[7], queue)
        return RoutePlan(mode, aggregated, prefill, decode, reason, Prediction(*predicted, joined=joined))

    def _join(
        self,
        request: RequestFeatures,
        c: Candidates,
        row: int,
        compute_s: float,
        queue: tuple[float, float, float],
    ) -> Joined:
        """Book a planned prefill on its backend (roofline `compute_s` as predicted; `queue`: seconds
        until its step opens, the prompt tokens waiting there (`_Priced.opens`, `.waiting`), the
        prompt tokens it should still hold): it joins the step of the waiting prompts in the queue's
        last, partly filled chunk (the most recently planned there, as vLLM admits them in order) if
        that step has not started, and lengthens it by its own share of it; then it waits for later
        ones to join its own until that starts (`opens_s` from now; at once on an idle backend).

        A step that has started takes no more prompts. Counted as joinable until its prompts' first
        tokens, a running step's prompts were credited with the next step's work as well: their
        queue looked 1.6-1.8x what they waited (B200 + 2x H100 bursts at half the fluid bound), and
        calibration took the excess for slowness (B200 compute 2.48 for a true 1.0;
        docs/policies.md, thirteenth pass)."""
        opens_s, waiting, cached = queue
        prompt = request.prompt_tokens
        new = max(prompt - min(int(cached), prompt - 1), 1)
        rest = waiting % self.chunk_tokens
        added = compute_s * min(new, self.chunk_tokens - rest) / new
        backend_id = c.specs[row].id
        booked = self._planned.get(backend_id)
        if booked is None:
            booked = self._planned[backend_id] = deque(maxlen=_PLANNED_KEPT)
        now = c.now
        for earlier in reversed(booked):  # newest first: once one has started, the older ones have
            if rest <= 0 or earlier.closes_at <= now:
                break
            earlier.seconds += added
            rest -= earlier.tokens
        joined = Joined(float(new), closes_at=now + opens_s)
        booked.append(joined)
        return joined

    # --- calibration -----------------------------------------------------------------------------------
    def observe(self, outcome: Outcome) -> None:
        pred = outcome.predicted
        if pred is None or outcome.ttft_s <= 0:
            return
        if outcome.leg in (Leg.AGGREGATED, Leg.PREFILL):
            backend = outcome.backend_id
            # The prompts that joined its step after it was planned are queue, not slowness: without
            # them, a burst's first prompts taught its backend 2.4x the compute correction it has.
            joined = pred.joined.seconds if pred.joined is not None else 0.0
            # The correction scales the roofline's seconds less the steps' fixed ones (`Steps`).
            fixed_q, fixed_c = pred.roofline_fixed_queue_s, pred.roofline_fixed_compute_s
            compute, queue = pred.roofline_compute_s - fixed_c, pred.roofline_queue_s - fixed_q + joined
            # Faster than even the fixed seconds (a backend far faster than its roofline says): it is
            # still an outcome, of no scalable seconds at all.
            measured = max(outcome.ttft_s - fixed_q - fixed_c, 0.0)
            if self._fit(backend).add(measured, compute, queue):
                self._refresh_compute_factors()
        if outcome.leg is not Leg.PREFILL and outcome.tpot_s > 0 and pred.tpot_s > 0:
            self._learn_tpot(outcome.backend_id, outcome.tpot_s, pred.tpot_s)
        if outcome.leg is Leg.DECODE:
            first_step = pred.ttft_s - pred.wait_s - pred.compute_s - pred.transfer_s
            pair = (outcome.peer_id, outcome.backend_id)
            if math.isfinite(outcome.request_ttft_s) and pred.ttft_s > 0:
                self._learn_headroom(pair, outcome.request_ttft_s / pred.ttft_s)
            old, rate = self._pair_correction.get(pair, 1.0), self._rate(self._pair_outcomes, pair)
            t = self._learn(old, outcome.ttft_s, pred.transfer_s, first_step, rate)
            if t is not None:
                self._set_pair("pair", pair, t)

    def _set_pair(self, kind: str, pair: tuple[str, str], value: float) -> None:
        """Keep a pair's `pair` correction or `headroom`, and put it in every cluster's arrays."""
        (self._pair_correction if kind == "pair" else self._headroom)[pair] = value
        for cl in self._clusters.values():
            cl.set_pair(kind, pair, value)

    def _learn_headroom(self, pair: tuple[str, str], ratio: float) -> None:
        """Move a pair's headroom, a running `_SPLIT_QUANTILE` quantile of its splits' measured over
        predicted TTFT (the whole request's), by one stochastic step in log space: up by
        `_HEADROOM_STEP * q` when a split took longer than the headroom allowed, down by
        `_HEADROOM_STEP * (1 - q)` otherwise, so it rests where a share 1 - q of splits exceed it.

        Splits priced right on average were planned to the edge of the TTFT target and half of them
        missed it (B200 + 2x H100: the decode part of a split's TTFT took 0.66x its prediction at the
        median and 3.2x at the 90th percentile in bursts); serving whole does not have those parts.
        `_pairs` holds a split to it only where its prefiller could serve the request whole: a
        prefill-only backend (the Rubin CPX) is used by splits alone, and held to it, its bursts went
        whole to the H100s instead (docs/policies.md, sixteenth pass). A pair never measured has none."""
        old = self._headroom.get(pair, 1.0)
        step = _HEADROOM_STEP * (_SPLIT_QUANTILE if ratio > old else _SPLIT_QUANTILE - 1.0)
        self._set_pair("headroom", pair, float(np.clip(old * math.exp(step), *_HEADROOM_CLIP)))

    def _learn_tpot(self, backend: str, measured: float, predicted: float) -> None:
        """Move a backend's TPOT correction by `_rate` of the relative error of its corrected
        prediction. The measured TPOT includes the prefill chunks of requests that arrived while this
        one decoded, which no prediction at plan time sees: the correction carries that on average,
        per backend (the one that prefills most stretches its decodes most). It scales TPOT only where
        the SLO is checked: in the price and the finish time it made the fast decoders look slow and
        moved decodes to worse ones (B200 + 2x H100 bursts: 20.6 -> 10.8 requests/s SLO capacity)."""
        old = self.tpot_correction(backend)
        step = 1.0 + self._rate(self._tpot_outcomes, backend) * (measured / (predicted * old) - 1.0)
        self._tpot_correction[backend] = float(np.clip(old * max(step, 0.5), *_TPOT_CLIP))
        self._refresh_tpot_factors()

    def _refresh_tpot_factors(self) -> None:
        values = np.fromiter(self._tpot_correction.values(), dtype=float)
        self._tpot_prior = float(np.exp(np.log(values).mean())) if values.size else 1.0
        for cl in self._clusters.values():
            cl.tpot_factor[:] = [self.tpot_correction(x.id) for x in cl.specs]

    def tpot_correction(self, backend_id: str) -> float:
        """Measured over predicted TPOT of one backend; an unmeasured one takes the others' geometric
        mean, as for compute."""
        return self._tpot_correction.get(backend_id, self._tpot_prior)

    def _rate(self, outcomes: dict[_Key, int], key: _Key) -> float:
        """The learning rate for one more outcome of `key`: 1/(n+1) after n before it (the running mean
        of the ratios, the value it started from counting as one), down to `learning_rate` (then a
        moving average, which follows a backend whose speed changes). At a fixed 0.1 from the start, a
        short run's predictions lagged the truth: 12 requests on the seed cluster ended with measured
        TPOT 1.4x the corrected prediction, 300 with 1.03x."""
        n = outcomes[key] = outcomes.get(key, 0) + 1
        return max(self.learning_rate, 1.0 / (n + 1))

    def _learn(self, old: float, measured: float, part: float, rest: float, rate: float) -> float | None:
        """Correct `part` (the predicted seconds this correction scales) from a measurement of
        `part + rest`: the part's own ratio, (measured - rest) / part, weighted by its share of the
        prediction (it equals moving by the relative error of the whole prediction). The prediction
        carried the `old` correction, so the ratio is relative to it. None: nothing to learn. Used for
        the transfer, whose `rest` (the decoder's first steps) is corrected by its own measured TPOT."""
        total = part + rest
        if part <= 0 or not math.isfinite(measured) or total <= 0:
            return None
        ratio = (measured - rest) / part
        step = 1.0 + rate * (part / total) * (ratio - 1.0)
        return float(np.clip(old * max(step, 0.5), *_CLIP))

    def correction(self, backend_id: str) -> float:
        """The compute correction of one backend (1.0: the roofline as it is). A backend that has not
        prefilled yet takes the geometric mean of the others': most of the roofline's error is shared
        (the efficiency it assumes), and without it an unmeasured backend looks as many times faster
        than a measured one as the roofline is optimistic (seed cluster: every 16k prompt sent to the
        never-measured MI308X servers, 5.6x slower in truth)."""
        fit = self._fits.get(backend_id)
        return fit.compute if fit is not None else self._compute_prior

    def overhead(self, backend_id: str) -> float:
        """The seconds a request pays on one backend besides its roofline work (`ComputeFit.overhead`);
        an unmeasured backend takes the others' mean (the same software stack serves them all)."""
        fit = self._fits.get(backend_id)
        return fit.overhead if fit is not None else self._overhead_prior

    def queue_correction(self, backend_id: str) -> float:
        """Measured over roofline-predicted queue ahead of a prefill on one backend, as calibration
        fitted it beside the compute (a diagnostic: pricing scales the queue by the compute factor); an
        unmeasured backend takes the others' geometric mean."""
        fit = self._fits.get(backend_id)
        return fit.queue if fit is not None else self._queue_prior

    def _fit(self, backend_id: str) -> ComputeFit:
        fit = self._fits.get(backend_id)
        if fit is None:  # anchored at what it was priced with until now
            fit = self._fits[backend_id] = ComputeFit(self._compute_prior)
        return fit

    def _refresh_compute_factors(self) -> None:
        """The priors of unmeasured backends, and every cluster's compute factors and overheads (what
        pricing reads)."""
        if self._fits:
            fits = self._fits.values()
            self._compute_prior = math.exp(sum(math.log(f.compute) for f in fits) / len(self._fits))
            self._queue_prior = math.exp(sum(math.log(f.queue) for f in fits) / len(self._fits))
            self._overhead_prior = sum(f.overhead for f in fits) / len(self._fits)
        for cl in self._clusters.values():
            cl.compute_factor[:] = [self.correction(s.id) for s in cl.specs]
            cl.overhead_s[:] = [self.overhead(s.id) for s in cl.specs]

    def corrections(self) -> dict[str, float]:
        return {b: f.compute for b, f in self._fits.items()}

    def calibration(self) -> dict[str, float]:
        """Every correction learnt, by name: `compute/<backend>`, `queue/<backend>`, `tpot/<backend>`,
        `pair/<from>/<to>` (backend ids have no `/`), for other gateway replicas (`blend_calibration`)."""
        named = {f"compute/{b}": f.compute for b, f in self._fits.items()}
        named.update({f"queue/{b}": f.queue for b, f in self._fits.items()})
        named.update({f"overhead/{b}": f.overhead for b, f in self._fits.items()})
        named.update({f"tpot/{b}": k for b, k in self._tpot_correction.items()})
        named.update({f"pair/{a}/{b}": k for (a, b), k in self._pair_correction.items()})
        named.update({f"headroom/{a}/{b}": k for (a, b), k in self._headroom.items()})
        return named

    def blend_calibration(self, others: Mapping[str, Sequence[float]]) -> None:
        """Move each correction half way (in log space) to the geometric mean of other replicas' values
        for it. Replicas that all blend so agree within a few exchanges while each keeps learning from
        its own requests; a backend this one has not measured takes what the others learnt."""
        for name, values in others.items():
            kind, _, ids = name.partition("/")
            theirs = [v for v in values if (v >= 0 if kind == "overhead" else v > 0)]
            if not theirs or not ids:
                continue
            if kind == "overhead":  # seconds, and often none: the arithmetic mean, half way
                self._fit(ids).move_to(overhead=(self.overhead(ids) + sum(theirs) / len(theirs)) / 2)
                continue
            target = math.exp(sum(map(math.log, theirs)) / len(theirs))
            if kind == "compute":
                self._fit(ids).move_to(compute=_halfway(self.correction(ids), target, _CLIP))
            elif kind == "queue":
                self._fit(ids).move_to(queue=_halfway(self.queue_correction(ids), target, _CLIP))
            elif kind == "tpot":
                self._tpot_correction[ids] = _halfway(self.tpot_correction(ids), target, _TPOT_CLIP)
            elif kind in ("pair", "headroom") and "/" in ids:
                source, _, target_id = ids.partition("/")
                pair = (source, target_id)
                mine, clip = (
                    (self._pair_correction, _CLIP) if kind == "pair" else (self._headroom, _HEADROOM_CLIP)
                )
                self._set_pair(kind, pair, _halfway(mine.get(pair, 1.0), target, clip))
        self._refresh_compute_factors()
        self._refresh_tpot_factors()

    def _cluster(self, specs: tuple[BackendSpec, ...]) -> _Cluster:
        last = self._last
        if last is not None and last.specs is specs:  # the pool passes the same tuple every time
            return last
        key = tuple(s.id for s in specs)
        cl = self._clusters.get(key)
        if cl is None:
            accelerators = [self.catalog.accelerator(s.accelerator) for s in specs]
            hw = Hardware.of(accelerators, [s.gpus for s in specs], self.model.compute_dtype)
            column = Hardware(*(getattr(hw, f)[:, None] for f in HARDWARE_FIELDS))
            row = Hardware(*(getattr(hw, f)[None, :] for f in HARDWARE_FIELDS))
            latency = kv_transfer_time(self.model, column, row, 0, self.efficiency)
            per_token = kv_transfer_time(self.model, column, row, 1, self.efficiency) - latency
            pair_factor = [[self._pair_correction.get((a.id, b.id), 1.0) for b in specs] for a in specs]
            headroom = [[self._headroom.get((a.id, b.id), 1.0) for b in specs] for a in specs]
            links = np.array([pair_factor, per_token, latency, headroom], dtype=float)
            work = WorkModel(self.model, hw, self.efficiency, self.chunk_tokens)
            compute_share = hw.gemm_flops / hw.gemm_flops.max()
            cl = _Cluster(
                specs,
                work,
                compute_share,
                _prefill_price(compute_share, hw, specs),
                0.95 * work.kv_capacity,
                links,
                ScalarStepTime(self.model, hw.row(int(np.argmax(hw.gemm_flops))), self.efficiency),
                int(np.argmax(hw.gemm_flops)),
                ScalarStepTime(self.model, hw.row(int(np.argmax(hw.mem_bw))), self.efficiency),
                {s.id: i for i, s in enumerate(specs)},
                np.array([self.correction(s.id) for s in specs]),
                np.array([self.overhead(s.id) for s in specs]),
                np.array([self.tpot_correction(s.id) for s in specs]),
                links[0],  # set_pair writes there, so into `links`
                links[3],
                ConversationStarts(specs, Servers.of(self.model, hw, self.efficiency, specs)),
            )
            self._clusters[key] = cl
        self._last = cl
        return cl


def _prefill_price(compute: np.ndarray, hw: Hardware, specs: tuple[BackendSpec, ...]) -> np.ndarray:
    """What a second of prefill costs on each backend where a split is allowed: its `compute` share
    (`_Cluster.price`), as any second there, but on a backend the config keeps for decoding (decode-only) the
    larger of its compute and memory-bandwidth shares. Serving a request whole there spends seconds of a
    backend kept for bandwidth-bound work on compute-bound work, and every decode it runs waits for that
    prefill (chunked prefill puts it into their steps). Priced by compute alone, an MI308X's prefill cost
    about what the MI300X's does (5.6x the seconds at 0.18x the price), so `auto` served prompts whole on the
    MI308X servers wherever that finished first, and their decodes missed their TPOT (AMD seed cluster, Azure
    code traces: 0.94 -> 1.02 requests/s of SLO capacity with this price; docs/policies.md, twenty-fourth
    pass). Under `never` every backend serves whole and this does not apply: pricing the MI308X's prefill so
    left only the MI300X serving (Azure code: 0.53 -> 0)."""
    bandwidth = hw.mem_bw / hw.mem_bw.max()
    decode_only = np.array([Role.PREFILL not in s.roles for s in specs], dtype=bool)
    return np.where(decode_only, np.maximum(compute, bandwidth), compute)


@kernel
def _order(
    rows: np.ndarray, cost: np.ndarray, finish: np.ndarray, ok: np.ndarray, tolerance: float
) -> np.ndarray:
    """`rows` best-first: feasible plans within `tolerance` of the cheapest feasible cost (earliest
    finish first), then the other feasible ones, then the infeasible ones (each by earliest finish; a
    tie keeps the order of `rows`). With nothing feasible, the cheapest is inf and nothing is cheap."""
    cheapest = np.inf
    for i in range(rows.size):
        if ok[i]:
            cheapest = min(cheapest, cost[i])
    by_finish = np.argsort(finish, kind="mergesort")  # stable: ties keep their order
    ordered = np.empty(rows.size, dtype=rows.dtype)
    at = 0
    for tier in range(3):  # 0: cheap (implies feasible), 1: feasible, 2: not
        for i in by_finish:
            cheap = ok[i] and cost[i] <= cheapest * (1.0 + tolerance)
            if (0 if cheap else 1 if ok[i] else 2) == tier:
                ordered[at] = rows[i]
                at += 1
    return ordered


SHORTLIST = 8


@kernel
def _shortlist(rows: np.ndarray, time: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """`rows` reduced to the `SHORTLIST` quickest and the `SHORTLIST` cheapest, in the order given;
    `time` and `cost` are per backend. Ties go to the rows given first, so a rotation of `rows`
    before it shares them among identical backends."""
    if rows.size <= 2 * SHORTLIST:
        return rows
    keep = np.zeros(rows.size, dtype=np.bool_)
    for measure in (time, cost):
        keep[np.argsort(measure[rows], kind="mergesort")[:SHORTLIST]] = True
    return rows[keep]


@kernel
def _price_rows(
    engine: tuple[np.ndarray, np.ndarray, float],
    request: tuple[float, float, bool, float, float],
    cluster: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    load: tuple[np.ndarray, ...],
    kv_due: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """`_Priced`'s rows for one request on every backend. `engine`: `WorkModel.table`, `.weights`, the
    step's token budget; `request`: prompt tokens, output tokens, `idle_is_free`, the TTFT and TPOT
    targets; `cluster`: compute and TPOT corrections, prices of a prefill second and of a decode
    second, KV limits, `WorkModel.fixed_step`, the learnt overhead per request;
    `load`: per backend, the cached tokens it should still hold (`Candidates.surviving_cached`), the
    sequences decoding, their context (`WorkModel.context`), then `Candidates`' prefill tokens,
    prompt length, step tokens, step elapsed and step behind; `kv_due`: `Candidates.kv_due_rows`,
    `.kv_due_s`."""
    table, weights, chunk = engine
    prompt, out, idle_is_free, slo_ttft, slo_tpot = request
    k, tpot_factor, prefill_price, price, kv_limit, fixed_step, overhead = cluster
    surviving, seqs, context = load[0], load[1], load[2]
    prefill_tokens, prefill_len, step_tokens, step_elapsed, step_behind = load[3:]
    n = seqs.size
    # What each backend should still hold at admission (vLLM recomputes the last token); the step in
    # progress began `step_elapsed` seconds ago on the clock: 1/k of that in the roofline's seconds,
    # which the compute correction k scales to the clock's.
    cached = np.minimum(surviving, max(prompt - 1.0, 0.0))
    new = prompt - cached
    elapsed = step_elapsed / k
    s = steps_kernel(table, weights, chunk, prompt + out / 2.0, new, cached, seqs, context,
                     prefill_tokens, prefill_len, step_tokens, elapsed, step_behind)  # fmt: skip
    rows = np.empty((_PRICED_ROWS, n))
    for i in range(n):
        fixed_wait, fixed_prefill = s[8, i], s[9, i]
        base, step, queue = s[0, i], s[1, i], corrected(k[i], s[2, i], fixed_wait)
        # A request that arrives mid-step waits for that step to end (`mid_step`: half a decode step
        # on average where no prefill step is known to be in progress; `wait` has what is left of one
        # that is). Counted for every plan alike, since a split's decode leg waits for step boundaries
        # too (below): counted for splits alone, it made them look slower than serving whole (bursts on
        # B200 + 2x H100, `auto`: 17 -> 3.6 requests/s of SLO capacity).
        mid_step = s[6, i]
        # And the seconds each request pays there besides its roofline work (`ComputeFit.overhead`).
        rows[wait_, i] = queue + mid_step + overhead[i]
        rows[rwait_, i] = s[2, i] + mid_step  # what calibration fits its queue factor on
        rows[rcomp_, i] = s[3, i]
        rows[rfixq_, i], rows[rfixc_, i] = fixed_wait, fixed_prefill  # which it takes off (see `observe`)
        compute = rows[compute_, i] = corrected(k[i], s[3, i], fixed_prefill)
        # The marginal decode step. A backend's first sequence pays the step's fixed part (weights read,
        # overhead) unless `idle_is_free`: see `choose`.
        decode_cost = rows[dcost_, i] = out * (step - (max(base, fixed_step[i]) if idle_is_free else base))
        # Chunked prefill shares the decode steps: the prefill queued here stretches them (taken as
        # the backend's ongoing prefill traffic).
        tpot = rows[tpot_, i] = step + queue / out
        # A split's decode leg joins the waiting queue behind that prefill (vLLM admits waiting requests
        # first come, first served, while a step's token budget lasts), so it is admitted in the step of
        # that prefill's last chunk; then its KV is pulled, it waits for the next step boundary and runs
        # one step: about two steps besides the steps ahead and the transfer. Priced as one step after
        # one chunk, the pair corrections learnt the rest as transfer time (10x, their clip, on the AMD
        # seed cluster's conversations).
        ahead = corrected(k[i], s[5, i], s[10, i])
        # Not the overhead: a split's decode leg pays its own, which its pair's transfer correction
        # learns as before (priced here as well, it is counted twice; in the simulator that cost the
        # Rubin CPX bursts 10 % of their SLO capacity; docs/policies.md, thirty-seventh pass).
        rows[first_, i] = 2.0 * step + ahead
        # The step a new prefill joins starts when the steps ahead of it have run; until then later
        # prompts may join it (`_join`).
        rows[opens_, i] = mid_step + ahead
        rows[kv_ok_, i] = context[i] + prompt + out <= kv_limit[i]
        rows[stall_, i] = k[i] * s[4, i]
        rows[ttft_, i] = rows[wait_, i] + compute
        rows[delay_, i] = compute * _cobatched(s[7, i], prefill_len[i], new[i], chunk)
        rows[ccost_, i] = prefill_price[i] * compute
        rows[dprice_, i] = price[i] * decode_cost
        rows[tseen_, i] = tpot * tpot_factor[i]
        rows[step_, i] = step
        rows[seqs_, i] = seqs[i]
        rows[waiting_, i] = s[7, i]
    # A prefill on b holds up the split decode legs headed to b whose KV is due while it is still
    # queued or running (vLLM serves running requests before admitting waiting ones), at most its
    # compute; one due after it ends is not held up.
    due_rows, due_s = kv_due
    held = np.zeros(n)
    for leg in range(due_rows.size):
        i = due_rows[leg]
        held[i] += min(max(rows[ttft_, i] - due_s[leg], 0.0), rows[compute_, i])
    for i in range(n):
        if due_rows.size:
            rows[delay_, i] = rows[delay_, i] + held[i]
        prefill_harm, decode_harm = _harm(
            rows[step_, i], rows[stall_, i], rows[ttft_, i], rows[delay_, i], rows[seqs_, i],
            rows[dcost_, i], out, slo_ttft, slo_tpot,
        )  # fmt: skip
        rows[pharm_, i], rows[dharm_, i] = prefill_harm, decode_harm
        harm = prefill_harm + decode_harm
        rows[aok_, i] = rows[ttft_, i] <= slo_ttft and rows[tseen_, i] <= slo_tpot and rows[kv_ok_, i] > 0
        rows[afin_, i] = rows[ttft_, i] + out * rows[tpot_, i] + harm
        rows[acost_, i] = rows[ccost_, i] + rows[dprice_, i] + harm
    return rows


@kernel
def _harm(
    step: float,
    stall: float,
    ttft: float,
    delay: float,
    seqs: float,
    decode_cost: float,
    out: float,
    slo_ttft: float,
    slo_tpot: float,
) -> tuple[float, float]:
    """The delay a plan imposes on the requests already there (per backend: as the prefill side,
    as the decode side), each weighted by how close it brings them to their target (1 at or past
    it, 0 without a target: a pure throughput objective counts only the plan's own time):

    - the sequences decoding: chunked prefill puts every prefill chunk into their steps, so each
      waits for the whole prefill (spread over about this request's output length); one more
      sequence lengthens each of their steps (TPOT target);
    - the prompts queued in the step this prefill joins: vLLM fills a step with waiting prompts
      up to its token budget and they all finish with it, so a prompt planned later delays those
      planned before it (TTFT target; the queue ahead stands for theirs). Without it, a burst of
      requests went to the backend that finished each one first, one at a time, and the earlier
      ones missed their TTFT (bursty@nvidia: 15 % missed at 2 % load).

    Each delay counts as the share it takes of its phase's budget: a queued prompt's TTFT target,
    a decoding sequence's output times its TPOT target (this request's targets and output length
    stand for theirs), in seconds of this request's whole budget, TTFT plus output times TPOT, the
    scale of its own finish. A second of a prompt's TTFT then counts as a second of the whole
    budget over the TTFT target (14x on the bursty trace), a second spread over a decode's output
    as a little more than one. Counted as seconds alike, a 24 ms stall of 16 decodes 128 tokens
    long outweighed 18 ms of 8 queued prompts' TTFT, so a burst's prompts were stacked on the
    B200's queue and the first of them missed their TTFT (B200 + 2x H100 bursts without the split
    gate: goodput 0.81 at 30 requests/s, 0.92 by budget share).

    Tried and dropped: counting it only past the target (a step function): the decoders were
    already full when it switched on (0.66x round robin on shared system prompts)."""
    budget = slo_ttft + out * slo_tpot
    per_ttft, per_decode = budget / slo_ttft, budget / (out * slo_tpot)
    stalled = min((step + stall / out) / slo_tpot, 1.0)
    queued = min(ttft / slo_ttft, 1.0)
    crowded = min(step / slo_tpot, 1.0)
    prefill_side = per_decode * stalled * seqs * stall + per_ttft * queued * delay
    return prefill_side, per_decode * crowded * seqs * decode_cost


@kernel
def _cobatched(queued: float, prompt_len: float, new: float, chunk: float) -> float:
    """On one backend: the queued prompts that finish in the step a new prefill of `new` tokens joins
    (those in the last, partly filled chunk of the queue), times the share of the new prefill that
    step takes. A full last chunk leaves none: the new prefill starts a step of its own."""
    rest = queued % chunk
    new = max(new, 1.0)
    share = min(new, chunk - rest) / new
    return rest / max(prompt_len, 1.0) * share


_FOUND, _NO_PAIR, _NO_ROWS = 0, 1, 2  # `_split`'s outcomes


@kernel
def _split(
    roles: tuple[np.ndarray, np.ndarray, np.ndarray],
    cached: np.ndarray,
    prompt_tokens: float,
    min_lacking: float,
    turn: int,
    out: float,
    prefill_side: tuple[np.ndarray, np.ndarray, np.ndarray],
    decode_side: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    cluster: tuple[np.ndarray, np.ndarray],
    targets: tuple[float, float, float],
) -> tuple[int, int, int, bool, float, float, float, float, np.ndarray, np.ndarray]:
    """The best (prefill, decode) pair with the fallbacks of each leg (`_plan_kernel`'s split): (outcome,
    prefill row, decode row, feasible, cost, finish, transfer, TTFT, the prefill fallbacks, the decode
    fallbacks). Over the pairs of the `SHORTLIST` best of each side by time and by cost (`_shortlist`):
    a pair's time and cost are its legs' sums plus the transfer, so the best pair is almost always
    among them, and 64 backends price 16 x 16 pairs instead of 4,032. `roles`: healthy, may prefill,
    may decode; `cached`: the tokens each backend should still hold (`Candidates.surviving_cached`); a
    decoder must lack at least `min_lacking` of the prompt; `turn`, `turn + 1`: the rotations of the
    prefill and decode sides (spent unless the outcome is `_NO_ROWS`); `prefill_side`: `_Priced`'s
    TTFT, compute cost, prefill harm; `decode_side`: first step, TPOT, decode harm, decode price, TPOT
    as the SLO check sees it, whether the KV fits; `cluster`: `_Cluster.links`, `.tpot_factor`;
    `targets`: the TTFT and TPOT targets, the cost tolerance."""
    healthy, can_prefill, can_decode = roles
    ttft_p, cost_p, harm_p = prefill_side
    first_d, tpot_d, harm_d, price_d, seen_d, kv_ok_d = decode_side
    links, tpot_factor = cluster
    slo_ttft, slo_tpot, tolerance = targets
    none = np.zeros(0, dtype=np.int64)
    prefill_rows = np.nonzero(healthy & can_prefill)[0]
    decode_rows = np.nonzero(healthy & can_decode)[0]
    decode_rows = decode_rows[prompt_tokens - cached[decode_rows] >= min_lacking]
    if prefill_rows.size == 0 or decode_rows.size == 0:
        return _NO_ROWS, -1, -1, False, 0.0, 0.0, 0.0, 0.0, none, none
    decode_time = first_d + out * tpot_d
    prefill_rows = _shortlist(rotated(prefill_rows, turn), ttft_p, cost_p)
    decode_rows = _shortlist(rotated(decode_rows, turn + 1), decode_time, price_d)
    if prefill_rows.size == 1 and decode_rows.size == 1 and prefill_rows[0] == decode_rows[0]:
        return _NO_PAIR, -1, -1, False, 0.0, 0.0, 0.0, 0.0, none, none
    transfer, ttft, finish, cost, ok, a, b = _pairs(
        prefill_rows, decode_rows, links, prompt_tokens, (ttft_p, cost_p, harm_p, can_decode),
        (first_d, tpot_factor, decode_time, harm_d, price_d, seen_d, kv_ok_d), slo_ttft, slo_tpot,
        tolerance,
    )  # fmt: skip
    if a < 0:
        return _NO_PAIR, -1, -1, False, 0.0, 0.0, 0.0, 0.0, none, none
    pi, di = prefill_rows[a], decode_rows[b]
    # Fallbacks of each leg with the other leg fixed, in the same order.
    prefills = _order(prefill_rows, cost[:, b], finish[:, b], ok[:, b], tolerance)
    decodes = _order(decode_rows, cost[a], finish[a], ok[a], tolerance)
    return (
        _FOUND, pi, di, ok[a, b], cost[a, b], finish[a, b], transfer[a, b], ttft[a, b],
        prefills[prefills != di], decodes[decodes != pi],
    )  # fmt: skip


@kernel
def _ranked(
    mask: np.ndarray, turn: int, cost: np.ndarray, finish: np.ndarray, ok: np.ndarray, tolerance: float
) -> np.ndarray:
    """The rows in `mask`, rotated by `turn`, best-first by `_order`."""
    rows = rotated(np.nonzero(mask)[0], turn)
    return _order(rows, cost[rows], finish[rows], ok[rows], tolerance)


# `Disaggregation` as `_plan_kernel` takes it
_SPLIT_CODES = {Disaggregation.NEVER: 0, Disaggregation.AUTO: 1, Disaggregation.ALWAYS: 2}
_Split = tuple[int, int, int, bool, float, float, float, float, np.ndarray, np.ndarray]  # `_split`'s


@kernel
def _plan_kernel(
    price: _PriceArgs,
    roles: tuple[np.ndarray, np.ndarray, np.ndarray],
    links: np.ndarray,
    split: tuple[int, float, int, float],
) -> tuple[np.ndarray, np.ndarray, bool, _Split]:
    """`CostRanker.choose`'s work in one call (each call from Python costs microseconds of argument
    checks, and the decision is on the request path): `_price_rows` (`price`: its arguments), the
    aggregated plans best-first (`_ranked`; none: no backend is healthy), whether a healthy backend
    has both roles, and the best split (`_split`; `_NO_ROWS` under `never`). `roles`: healthy, may
    prefill, may decode; `links`: `_Cluster.links`; `split`: the mode (`_SPLIT_CODES`), the tokens a
    decoder must lack, the rotation's turn, the cost tolerance."""
    rows = _price_rows(price[0], price[1], price[2], price[3], price[4])
    request, tpot_factor, cached = price[1], price[2][1], price[3][0]
    healthy, can_prefill, can_decode = roles
    mode, min_lacking, turn, tolerance = split
    # Aggregated serving runs on any backend that may decode (a decode-only vLLM serves a request
    # without KV parameters whole, as the other policies and the fluid bound assume); the delay its
    # prefill imposes on the decodes running there is in the price.
    serving = healthy & can_decode
    if not serving.any():
        serving = healthy
    ranked = _ranked(serving, turn, rows[acost_], rows[afin_], rows[aok_] > 0, tolerance)
    both = bool((healthy & can_prefill & can_decode).any())
    none = np.zeros(0, dtype=np.int64)
    if mode == 0 or ranked.size == 0:
        return rows, ranked, both, (_NO_ROWS, -1, -1, False, 0.0, 0.0, 0.0, 0.0, none, none)
    prompt, out, _, slo_ttft, slo_tpot = request
    pair = _split(
        roles, cached, prompt, min_lacking, turn + 1, out, (rows[ttft_], rows[ccost_], rows[pharm_]),
        (rows[first_], rows[tpot_], rows[dharm_], rows[dprice_], rows[tseen_], rows[kv_ok_] > 0),
        (links, tpot_factor), (slo_ttft, slo_tpot, tolerance),
    )  # fmt: skip
    return rows, ranked, both, pair


@kernel
def _pairs(
    prefill_rows: np.ndarray,
    decode_rows: np.ndarray,
    links: np.ndarray,
    prompt_tokens: float,
    prefill_side: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    decode_side: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    slo_ttft: float,
    slo_tpot: float,
    tolerance: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]:
    """`_split`'s [prefill, decode] matrices (transfer, TTFT, finish, cost, feasible) over the
    given rows, and the position of the first plan `_order` would give (-1, -1: every pair is one
    backend with itself). Per side, the `_Priced` figures it takes (prefill: TTFT, compute cost, harm,
    whether it may decode; decode: first step, TPOT correction, decode time, harm, price, TPOT as the
    SLO check sees it, whether its KV holds the request)."""
    ttft_p, cost_p, harm_p, decodes_p = prefill_side
    first_d, tpot_factor_d, time_d, harm_d, price_d, tpot_d, kv_ok_d = decode_side
    shape = (prefill_rows.size, decode_rows.size)
    transfer, ttft, finish, cost = np.empty(shape), np.empty(shape), np.empty(shape), np.empty(shape)
    ok = np.zeros(shape, dtype=np.bool_)
    cheapest = np.inf
    for a in range(shape[0]):
        i = prefill_rows[a]
        for b in range(shape[1]):
            j = decode_rows[b]
            transfer[a, b] = links[0, i, j] * (links[1, i, j] * prompt_tokens + links[2, i, j])
            ready = ttft_p[i] + transfer[a, b]
            # The decoder's steps as its measured TPOT corrects them: uncorrected, the pair correction
            # learnt the decoder's step error as transfer time.
            ttft[a, b] = ready + first_d[j] * tpot_factor_d[j]
            finish[a, b] = ready + (time_d[j] + harm_d[j]) + harm_p[i] if i != j else np.inf
            cost[a, b] = (cost_p[i] + harm_p[i]) + (price_d[j] + harm_d[j])
            # A split whose prefiller could serve the request whole must meet the TTFT target at its
            # pair's learnt headroom (`_learn_headroom`); one from a prefill-only backend is the only
            # way to use it.
            room = links[3, i, j] if decodes_p[i] else 1.0
            fits = ttft[a, b] * room <= slo_ttft and tpot_d[j] <= slo_tpot and kv_ok_d[j]
            ok[a, b] = fits and i != j
            if ok[a, b]:
                cheapest = min(cheapest, cost[a, b])
    # The first entry `_order` would give over the matrix, without sorting it: the earliest finish
    # among the feasible plans within `tolerance` of the cheapest, or among all when none is feasible.
    best, at = np.inf, -1
    for flat in range(shape[0] * shape[1]):
        a, b = flat // shape[1], flat % shape[1]
        if prefill_rows[a] == decode_rows[b]:
            continue
        eligible = ok[a, b] and cost[a, b] <= cheapest * (1.0 + tolerance) if cheapest < np.inf else True
        if eligible and (at < 0 or finish[a, b] < best):
            best, at = finish[a, b], flat
    if at < 0:
        return transfer, ttft, finish, cost, ok, -1, -1
    return transfer, ttft, finish, cost, ok, at // shape[1], at % shape[1]


def _predicted(
    prefill: list[float], decode: list[float], transfer_s: float, ttft_s: float, rows: tuple[int, ...]
) -> _Predicted:
    """A plan's `Prediction` fields (less `joined`) from `_price_rows`' columns of its prefill and decode
    backends (the same column for a plan served whole), its transfer and its TTFT."""
    return (prefill[wait_], prefill[compute_], transfer_s, ttft_s, decode[tpot_], decode[tseen_],
            prefill[rwait_], prefill[rcomp_], prefill[rfixq_], prefill[rfixc_], rows)  # fmt: skip


def _pair_wins(pair: tuple[bool, float, float], agg: tuple[bool, float, float], tolerance: float) -> bool:
    """Compare the best split with the best aggregated plan by the same rule as `_order`."""
    if pair[0] != agg[0]:
        return not pair[0]  # feasible beats infeasible
    if not pair[0]:
        cheapest = min(pair[1], agg[1])
        pair_cheap = pair[1] <= cheapest * (1.0 + tolerance)
        agg_cheap = agg[1] <= cheapest * (1.0 + tolerance)
        if pair_cheap != agg_cheap:
            return pair_cheap
    return pair[2] < agg[2]


def _halfway(mine: float, theirs: float, clip: tuple[float, float]) -> float:
    return float(np.clip(math.sqrt(mine * theirs), *clip))


def compile_kernels() -> None:
    """Compile every kernel of the request path (`scoring/jit.py`) for the argument types it is called
    with, or load them from numba's cache: one request planned on a two-backend cluster under each
    split mode, and the load formula as the registry calls it. The gateway runs this before it
    serves; `tests/unit/test_jit.py` checks that routing through the registry and the simulator then
    compiles nothing more."""
    from scoring.load import load_columns, request_load  # the registry's calls

    roles = frozenset((Role.PREFILL, Role.DECODE))
    specs = (BackendSpec("a", "m", "mi300x", 8, roles), BackendSpec("b", "m", "mi308x", 8, roles))
    busy = BackendStats(in_flight=2, prefill_tokens=9000, prefill_seqs=2, decode_seqs=1, context_tokens=900)
    candidates = Candidates.build(specs, (busy, BackendStats()), np.array([0, 512], dtype=np.int64))
    ranker = CostRanker(load_catalog().model("deepseek-r1"))
    request = RequestFeatures("m", 2048, 64)
    for mode in Disaggregation:
        ranker.choose(request, candidates, SplitSettings(mode))
    Rotation()(np.arange(2))  # the other policies' rotation
    columns = np.ones((12, 2))
    load_columns(*columns[:7], seen=columns[7:11], head=np.ones((5, 2)), now=1.0)
    request_load(*columns[:3], in_flight_seen=columns[3])  # for routers that read no work columns
