"""Backend health in the registry: active probes and passive ejection kept apart, panic mode, load."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gateway.config import parse_config
from gateway.outlier import Verdict
from gateway.registry import HealthEvent, Registry
from gateway.stats import VllmLoad
from scoring.prefix import CacheAware
from scoring.types import BackendStats, Candidates, LegLoad, RequestFeatures

LOAD = LegLoad(prefill_tokens=0, decode_tokens=1, context_tokens=0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, n: int = 2, **health: object) -> tuple[Registry, list[tuple[str, HealthEvent]]]:
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "backends": [
                {"id": f"b{i}", "url": f"http://127.0.0.1:{i + 1}", "model": "m", "accelerator": "cpu"}
                for i in range(n)
            ],
            "health": {
                "failure_threshold": 2,
                "outlier": {"consecutive_5xx": 3, "base_ejection_time_s": 10, "max_ejection_percent": 50},
                **health,
            },
        }
    )
    events: list[tuple[str, HealthEvent]] = []
    return Registry(config, lambda b, e: events.append((b.id, e)), clock=clock), events


def routable(reg: Registry) -> list[bool]:
    return reg.candidates(reg.pools["m"]).healthy.tolist()


def test_failed_probes_in_a_row_take_a_backend_out_and_one_good_probe_brings_it_back():
    reg, events = registry(Clock(), n=4)
    b0 = reg.backends["b0"]
    reg.probe_result(b0, False)
    reg.probe_result(b0, True)
    reg.probe_result(b0, False)
    assert routable(reg)[0]
    reg.probe_result(b0, False)
    assert routable(reg) == [False, True, True, True]
    assert reg.any_ready("m")  # three others still answer
    reg.probe_result(b0, True)
    assert routable(reg) == [True] * 4
    assert events == [("b0", HealthEvent.PROBE_DOWN), ("b0", HealthEvent.PROBE_UP)]


def test_good_probes_do_not_reset_passive_failures():
    clock = Clock()
    reg, events = registry(clock)
    b0 = reg.backends["b0"]
    for _ in range(3):
        reg.probe_result(b0, True)  # /health says 200 between every failed generation
        reg.record_failure(b0, Verdict.ERROR)
    assert routable(reg) == [False, True]
    assert events == [("b0", HealthEvent.EJECTED)]
    assert reg.any_ready("m")  # ejection is not unreadiness
    clock.now += 10
    assert routable(reg) == [True, True]  # routing sees it back at once ...
    reg.release_due()
    assert events[-1] == ("b0", HealthEvent.RETURNED)  # ... the event comes with the next tick


def test_passive_successes_do_not_bring_back_a_probe_down_backend():
    reg, _ = registry(Clock())
    b0 = reg.backends["b0"]
    reg.probe_result(b0, False)
    reg.probe_result(b0, False)
    reg.record_success(b0)
    assert routable(reg) == [False, True]


def test_panic_mode_routes_to_all_when_too_few_are_healthy():
    reg, _ = registry(Clock(), n=4)
    for i in range(2):
        for _ in range(2):
            reg.probe_result(reg.backends[f"b{i}"], False)
    assert routable(reg) == [False, False, True, True]  # 50 %: not below the threshold
    reg.probe_result(reg.backends["b2"], False)
    reg.probe_result(reg.backends["b2"], False)
    assert routable(reg) == [True] * 4  # 25 % < 50 %: panic


def test_panic_threshold_zero_never_panics():
    reg, _ = registry(Clock(), n=2, panic_threshold_percent=0)
    for backend in reg.backends.values():
        reg.probe_result(backend, False)
        reg.probe_result(backend, False)
    assert routable(reg) == [False, False]
    assert not reg.any_ready("m")


def test_load_combines_own_in_flight_with_reported_queue():
    reg, _ = registry(Clock())
    b0 = reg.backends["b0"]
    reg.reserve(b0, LOAD)
    reg.reserve(b0, LOAD)
    b0.report(VllmLoad(running=1))  # lags behind our two
    reg.backends["b1"].report(VllmLoad(running=1, waiting=2))  # other clients' requests
    assert reg.candidates(reg.pools["m"]).load.tolist() == [2.0, 3.0]
    assert reg.in_flight_total() == 2


def test_work_columns_take_the_larger_of_our_reservations_and_vllms_counts():
    reg, _ = registry(Clock())
    a, b = reg.backends["b0"], reg.backends["b1"]
    reg.reserve(a, LegLoad(prefill_tokens=100, decode_tokens=8, context_tokens=120))
    reg.reserve(a, LegLoad(prefill_tokens=300, decode_tokens=8, context_tokens=280))
    a.report(VllmLoad(running=4, waiting=6))  # vLLM also serves other clients: its view is larger
    reg.reserve(b, LegLoad(prefill_tokens=50, decode_tokens=8, context_tokens=60))
    # b's metrics lag (nothing reported yet): our reservation is the larger view
    c = reg.candidates(reg.pools["m"])
    assert c.load.tolist() == [10.0, 1.0]
    # vLLM's extra sequences and waiting prompts are priced like ours (200 context, 200-token prompts)
    assert c.decode_seqs.tolist() == [4.0, 1.0]
    assert c.context_tokens.tolist() == [800.0, 60.0]
    assert c.prefill_tokens.tolist() == [1200.0, 50.0]
    assert c.prefill_len.tolist() == [200.0, 50.0]


def test_a_report_counts_only_what_our_own_legs_did_not_explain_when_it_was_taken():
    """vLLM's counts lag by a poll: our requests that ended since the report no longer count, while
    another client's request the report showed still does. Taken as the larger of the two views, a
    decoder whose one sequence had just ended looked busy until the next poll."""
    reg, _ = registry(Clock())
    a, b = reg.backends["b0"], reg.backends["b1"]
    legs = [reg.reserve(a, LegLoad(prefill_tokens=0, decode_tokens=8, context_tokens=100)) for _ in range(2)]
    a.report(VllmLoad(running=2, kv_usage=0.5))  # our two, nobody else's
    reg.reserve(b, LegLoad(prefill_tokens=0, decode_tokens=8, context_tokens=100)).release()
    b.report(VllmLoad(running=1, waiting=1))  # taken after ours ended: another client's two
    for leg in legs:
        leg.release()
    c = reg.candidates(reg.pools["m"])
    assert c.load.tolist() == [0.0, 2.0]
    assert c.decode_seqs.tolist() == [0.0, 1.0]
    assert c.context_tokens.tolist() == [0.0, 0.0]
    # The KV usage was reported with 200 tokens of ours in use: only what is beyond them is others'.
    assert c.context_when_reported.tolist() == [200.0, 0.0]


def test_each_new_report_is_read_by_the_next_snapshot():
    """The reported rows are kept between snapshots: a report that lands in between must show."""
    reg, _ = registry(Clock())
    a = reg.backends["b0"]
    pool = reg.pools["m"]
    assert reg.candidates(pool).load.tolist() == [0.0, 0.0]
    a.report(VllmLoad(running=2, kv_usage=0.25))
    c = reg.candidates(pool)
    assert (c.load.tolist(), c.kv_usage.tolist()) == ([2.0, 0.0], [0.25, 0.0])
    a.report(VllmLoad(waiting=3))
    assert reg.candidates(pool, work=False).load.tolist() == [3.0, 0.0]


def test_a_leg_that_ends_while_the_scrape_is_under_way_is_not_taken_for_another_clients():
    reg, _ = registry(Clock())
    a = reg.backends["b0"]
    leg = reg.reserve(a, LegLoad(prefill_tokens=0, decode_tokens=8, context_tokens=100))
    before = a.own_counts()
    leg.release()  # ends after vLLM answered /metrics, before the answer is read
    a.report(VllmLoad(running=1), before)
    c = reg.candidates(reg.pools["m"])
    assert (c.load[0], c.decode_seqs[0]) == (0.0, 0.0)
    a.report(VllmLoad(running=1))  # without the count before: taken for another client's sequence
    assert reg.candidates(reg.pools["m"]).decode_seqs[0] == 1.0


def test_candidates_equal_candidates_built_from_each_backends_stats():
    """The registry's one pass over its backends gives, column for column and bit for bit, what
    `Candidates.build` gives from per-backend `BackendStats` of the same state."""
    rng = random.Random(3)
    reg, _ = registry(Clock(), n=9)
    pool = reg.pools["m"]
    for b in pool.backends:
        for _ in range(rng.randrange(4)):
            reg.reserve(b, LegLoad(rng.randrange(0, 9000), rng.randrange(1, 300), rng.randrange(0, 9000)))
        b.remote_in_flight = rng.randrange(3)
        # reported now: `Candidates.build` takes its stats as one fresh view
        b.report(VllmLoad(running=rng.randrange(6), waiting=rng.randrange(3), kv_usage=rng.random()))
    got = reg.candidates(pool)
    stats = tuple(
        BackendStats(
            in_flight=b.in_flight + b.remote_in_flight,
            running=int(b.load.running),
            waiting=int(b.load.waiting),
            kv_usage=b.load.kv_usage,
            prefill_tokens=b.reserved.prefill_tokens,
            prefill_seqs=b.reserved.prefill_seqs,
            decode_seqs=b.reserved.decode_seqs,
            context_tokens=b.reserved.context_tokens,
        )
        for b in pool.backends
    )
    want = Candidates.build(pool.specs, stats)
    names = ("load", "kv_usage", "prefill_tokens", "prefill_len", "decode_seqs", "context_tokens",
             "context_when_reported")  # fmt: skip
    for name in names:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


def test_reservation_adds_its_load_and_takes_it_off_once():
    reg, _ = registry(Clock())
    a = reg.backends["b0"]
    first = reg.reserve(a, LegLoad(prefill_tokens=100, decode_tokens=8, context_tokens=120))
    second = reg.reserve(a, LegLoad(prefill_tokens=10, decode_tokens=4, context_tokens=30))
    totals = (a.in_flight, a.reserved.prefill_tokens, a.reserved.decode_seqs, a.reserved.context_tokens)
    assert totals == (2, 110, 2, 150)
    first.prefill_done()
    first.prefill_done()
    assert (a.in_flight, a.reserved.prefill_tokens) == (2, 10)
    first.release()
    first.release()
    second.release()
    totals = (a.in_flight, a.reserved.prefill_tokens, a.reserved.decode_seqs, a.reserved.context_tokens)
    assert totals == (0, 0, 0, 0)


def test_a_split_decode_leg_is_due_until_its_prefill_ends():
    """A planned decode leg's KV is due at the time its plan gave; `Candidates` carries it in seconds
    from now, until the leg's prefill (done on the prefiller) is over or the leg ends first."""
    clock = Clock()
    reg, _ = registry(clock)
    b = reg.backends["b1"]
    first = reg.reserve(b, LegLoad(0, 64, 2000, kv_due_s=clock.now + 0.5))
    second = reg.reserve(b, LegLoad(0, 64, 1000, kv_due_s=clock.now + 0.2))
    reg.reserve(b, LegLoad(0, 64, 1000))  # aggregated, or a decode leg retried elsewhere: nothing due
    clock.now += 0.1
    c = reg.candidates(reg.pools["m"])
    assert c.kv_due_rows.tolist() == [1, 1]
    assert c.kv_due_s.tolist() == pytest.approx([0.4, 0.1])
    assert b.reserved.decode_seqs == 3  # still decoding sequences there
    first.prefill_done()
    first.prefill_done()
    assert reg.candidates(reg.pools["m"]).kv_due_s.tolist() == pytest.approx([0.1])
    second.release()  # it failed before its prefill was done
    assert reg.candidates(reg.pools["m"]).kv_due_rows.size == 0
    first.release()
    assert b.reserved.kv_due == []


def test_a_split_decode_leg_waiting_for_its_kv_is_not_read_as_another_clients_queued_prompt():
    """vLLM counts a decode leg that waits for its KV pull in `num_requests_waiting`: the gateway
    counts it among its own waiting legs from the prefill's end to its first token (or its end), so a
    report taken meanwhile shows no one else's prompt queued there."""
    clock = Clock()
    reg, _ = registry(clock)
    b = reg.backends["b1"]
    reg.reserve(b, LegLoad(0, 64, 1000))  # an aggregated sequence decoding there: the mean context
    decode = reg.reserve(b, LegLoad(0, 64, 2000, kv_due_s=clock.now + 0.5))
    decode.prefill_done()  # the prefill leg's result came: the decode leg goes out and waits there
    assert b.reserved.waiting_seqs == 1
    b.report(VllmLoad(running=1, waiting=1), b.own_counts())
    assert reg.candidates(reg.pools["m"]).prefill_tokens.tolist() == [0.0, 0.0]
    decode.first_token()
    decode.first_token()
    assert b.reserved.waiting_seqs == 0
    # A report that still shows it waiting, taken before its first token, counts it as the gateway's.
    b.report(VllmLoad(running=1, waiting=1), (2, 1, 2, 3000))
    assert reg.candidates(reg.pools["m"]).prefill_tokens.tolist() == [0.0, 0.0]
    # A third request waiting there is another client's, priced at the mean context (1,500 tokens).
    b.report(VllmLoad(running=2, waiting=1), b.own_counts())
    assert reg.candidates(reg.pools["m"]).prefill_tokens.tolist() == [0.0, 1500.0]


def test_a_decode_leg_that_ends_before_its_first_token_no_longer_counts_as_waiting():
    clock = Clock()
    reg, _ = registry(clock)
    b = reg.backends["b1"]
    decode = reg.reserve(b, LegLoad(0, 64, 2000, kv_due_s=clock.now + 0.5))
    aggregated = reg.reserve(b, LegLoad(500, 64, 500))
    assert b.reserved.waiting_seqs == 1  # the aggregated leg, still to prefill
    decode.prefill_done()
    assert b.reserved.waiting_seqs == 2
    decode.release()  # e.g. the KV pull failed
    decode.first_token()
    aggregated.first_token()  # its first byte: its prefill is done, and it was never arriving
    assert b.reserved.waiting_seqs == 0
    aggregated.release()
    assert (b.in_flight, b.reserved.waiting_seqs, b.reserved.decode_seqs) == (0, 0, 0)


def cooling(reg: Registry) -> list[int]:
    return sorted(reg.cooling(reg.pools["m"]))


def test_a_backend_answering_backpressure_cools_down_for_a_while():
    clock = Clock()
    reg, events = registry(clock, n=3, backpressure_cooldown_s=1.0)
    reg.record_backpressure(reg.backends["b1"])
    assert cooling(reg) == [1]
    clock.now += 0.9
    assert cooling(reg) == [1]
    clock.now += 0.2
    assert cooling(reg) == []
    assert events == []  # busy is not ill health: no health change


def test_cooling_down_is_not_ill_health():
    reg, _ = registry(Clock(), n=4)
    for i in range(4):
        reg.record_backpressure(reg.backends[f"b{i}"])
    assert routable(reg) == [True] * 4  # still routable (tried last, gateway/decision.py), no panic
    assert cooling(reg) == [0, 1, 2, 3]


def test_backpressure_cooldown_zero_is_off():
    reg, _ = registry(Clock(), n=2, backpressure_cooldown_s=0)
    reg.record_backpressure(reg.backends["b0"])
    assert cooling(reg) == []


def test_the_prompt_in_progress_counts_only_what_its_predicted_prefill_has_left():
    """vLLM takes prompts first come, first served, so the first leg still to prefill is the prompt in
    progress. When it is longer than one step's budget (8,192 tokens), the share of it that its predicted
    prefill seconds say is done since it reached the front is no longer queued (past its predicted end it
    is late, not done: its last chunk counts until its first token); the legs behind it count
    in full until they reach the front. One that fits in a step is done when the step ends: no share."""
    clock = Clock()
    reg, _ = registry(clock)
    a = reg.backends["b0"]

    def queued() -> float:
        return float(reg.candidates(reg.pools["m"]).prefill_tokens[0])

    first = reg.reserve(a, LegLoad(16000, 8, 16000, prefill_s=2.0))
    clock.now += 0.5
    second = reg.reserve(a, LegLoad(12000, 8, 12000, prefill_s=1.0))
    clock.now += 0.5  # the first is half done
    assert queued() == pytest.approx(8000 + 12000)
    clock.now += 5.0  # past its predicted end: its last chunk (16,000 - 8,192) is left until its first token
    assert queued() == pytest.approx(16000 - 8192 + 12000)
    first.prefill_done()
    clock.now += 0.25  # the second has been at the front since the first was done
    assert queued() == pytest.approx(9000)
    first.release()
    second.release()  # it failed before its prefill was done
    assert queued() == 0
    short = reg.reserve(a, LegLoad(4000, 8, 4000, prefill_s=1.0))  # one step's worth: done with the step
    unpriced = reg.reserve(b := reg.backends["b1"], LegLoad(16000, 8, 16000))  # its progress is unknown
    clock.now += 0.5
    assert queued() == 4000 and reg.candidates(reg.pools["m"]).prefill_tokens[1] == 16000
    assert b.reserved.head_tokens == 16000
    short.release()
    unpriced.release()


def test_the_step_in_progress_holds_the_legs_queued_when_it_began():
    """A leg planned to an idle backend begins a step; legs planned while it runs wait for the next one,
    which begins when the head's prefill is done and takes every leg queued then, up to one step's
    token budget. A head longer than a step has steps of its own chunks: no step is known. A step
    planned to an idle queue begins when the decode step running then ends (half a step on average)."""
    clock = Clock()
    reg, _ = registry(clock)
    a = reg.backends["b0"]

    def step() -> tuple[float, float]:
        c = reg.candidates(reg.pools["m"])
        return float(c.step_tokens[0]), float(c.step_elapsed[0])

    def steps_behind() -> float:
        return float(reg.candidates(reg.pools["m"]).step_behind[0])

    head = reg.reserve(a, LegLoad(3000, 8, 3000, prefill_s=0.1))
    clock.now += 0.02
    behind = [reg.reserve(a, LegLoad(3000, 8, 3000, prefill_s=0.1)) for _ in range(3)]
    assert step() == pytest.approx((3000, 0.02))  # the three came too late for it
    assert steps_behind() == 0.5  # planned to an idle queue: after the decode step running then
    clock.now += 0.03
    head.prefill_done()
    assert step() == pytest.approx((8192, 0.0))  # two and a part of the third fit in the budget
    assert steps_behind() == 0.0  # it began as the step before it ended
    clock.now += 0.01
    assert step() == pytest.approx((8192, 0.01))
    for leg in behind:
        leg.prefill_done()
    assert step() == (0.0, 0.0)
    for leg in (head, *behind):
        leg.release()
    long = reg.reserve(a, LegLoad(20000, 8, 20000, prefill_s=1.0))
    assert step() == (0.0, 0.0)
    long.release()


def test_the_leg_that_leaves_the_queue_is_the_one_whose_prefill_is_done():
    """Two legs of one size are equal; the one done out of order leaves, and the front keeps its time."""
    clock = Clock()
    reg, _ = registry(clock)
    a = reg.backends["b0"]
    front = reg.reserve(a, LegLoad(10000, 8, 10000, prefill_s=1.0))
    behind = reg.reserve(a, LegLoad(10000, 8, 10000, prefill_s=1.0))
    clock.now += 0.5
    behind.prefill_done()  # e.g. served from cache: its first token came first
    assert a.reserved.prefilling[0] is front.load and a.reserved.head_since == clock.now - 0.5
    assert reg.candidates(reg.pools["m"]).prefill_tokens[0] == pytest.approx(5000)
    front.release()
    assert not a.reserved.prefilling


def test_the_pool_rereads_every_backend_whose_accounting_changed():
    """`ModelPool.candidates` rereads only backends whose `version` moved: after every kind of change
    (a leg reserved, its prefill done, released; other replicas' counts; a scrape moving the survival
    factor), its columns equal those of a pool built afresh over the same backends."""
    from gateway.registry import ModelPool

    rng = random.Random(7)
    clock = Clock()
    reg, _ = registry(clock, n=5)
    pool = reg.pools["m"]
    held = []
    for step in range(200):
        clock.now += rng.random()
        backend = rng.choice(pool.backends)
        action = rng.randrange(5)
        if action == 0 or not held:
            due = clock.now + rng.random() if rng.random() < 0.3 else math.nan  # a split's decode leg
            load = LegLoad(rng.randrange(0, 9000), rng.randrange(1, 300), rng.randrange(0, 9000), due,
                           queried_tokens=20_000, indexed_tokens=15_000)  # fmt: skip
            held.append(reg.reserve(backend, load))
        elif action == 1:
            rng.choice(held).prefill_done()
        elif action == 2:
            held.pop(rng.randrange(len(held))).release()
        elif action == 3:
            backend.set_remote_in_flight(rng.randrange(3))
        else:
            queries = step * 20_000.0  # vLLM found a fifth where the index promised three quarters
            backend.report(
                VllmLoad(running=rng.randrange(4), prefix_hits=queries / 5, prefix_queries=queries)
            )
        got = reg.candidates(pool)
        fresh = ModelPool(pool.model, pool.backends, reg.health_settings).candidates(clock.now)
        for name in ("load", "prefill_tokens", "prefill_len", "decode_seqs", "context_tokens", "step_tokens",
                     "step_elapsed", "step_behind", "cache_survival"):  # fmt: skip
            assert getattr(got, name).tolist() == getattr(fresh, name).tolist(), (step, name)
        assert got.kv_due_rows.tolist() == fresh.kv_due_rows.tolist()
        assert got.kv_due_s.tolist() == fresh.kv_due_s.tolist()
    assert min(b.survival.factor for b in pool.backends) < 1.0  # the scrapes did move it


def test_prefix_spreads_requests_with_no_affinity_between_two_scrapes():
    """`prefix` sends a request no backend holds enough of to the least loaded, counting the gateway's
    own requests in flight at once (as sglang-router counts its own): the KV usage vLLM last reported,
    the same for every request until the next scrape, sent them all to one backend (33rd pass)."""
    reg, _ = registry(Clock(), n=3)
    pool = reg.pools["m"]
    for backend, usage in zip(reg.backends.values(), (0.10, 0.12, 0.25), strict=True):
        backend.report(VllmLoad(kv_usage=usage))
    policy, request = CacheAware(), RequestFeatures(model="m", prompt_tokens=1000, max_tokens=16)
    chosen = []
    for _ in range(6):
        c = reg.candidates(pool, work=False)
        first = int(policy.rank(request, c, c.healthy)[0])
        reg.reserve(pool.backends[first], LegLoad(prefill_tokens=1000, decode_tokens=16, context_tokens=1000))
        chosen.append(first)
    assert chosen == [0, 1, 2, 0, 1, 2]  # equal loads go to the first configured
