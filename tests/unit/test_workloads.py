"""Workload records: traces replay with real shared prefixes, synthetic generators, arrivals."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from bench import workloads as w
from bench.sim.tokenizer import SimTokenizer


def test_mooncake_shared_hash_ids_give_shared_token_prefixes() -> None:
    trace = w.mooncake_trace(limit=300)
    by_first: dict[int, list[w.WorkloadRequest]] = {}
    for r in trace:
        by_first.setdefault(r.prompt.blocks[0], []).append(r)
    a, b = next(group[:2] for group in by_first.values() if len(group) >= 2)
    shared = 0
    while a.prompt.blocks[shared] == b.prompt.blocks[shared]:
        shared += 1
    ta, tb = a.token_array(), b.token_array()
    n = shared * w.MOONCAKE_BLOCK_TOKENS
    np.testing.assert_array_equal(ta[:n], tb[:n])
    assert not np.array_equal(ta[n : n + 512], tb[n : n + 512])


def test_mooncake_lengths_and_arrivals_follow_the_trace() -> None:
    trace = w.mooncake_trace(limit=50)
    assert trace[0].prompt_len == 40160 and trace[0].max_tokens == 6
    assert all(len(r.token_ids()) == r.prompt_len for r in trace[:5])
    arrivals = [r.arrival_s for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def test_azure_trace_gives_unique_prompts_and_relative_arrivals() -> None:
    trace = w.azure_trace("code", limit=100)
    assert trace[0].arrival_s == 0.0 and trace[1].arrival_s == pytest.approx(0.052)
    assert trace[0].prompt_len == 4808 and trace[0].max_tokens == 10
    firsts = {r.prompt.blocks[0] for r in trace}
    assert len(firsts) == len(trace)
    with pytest.raises(ValueError, match="code' or 'conv"):
        w.azure_trace("chat")


def test_traces_dir_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mooncake_synthetic_trace.jsonl").write_text(
        '{"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}\n'
    )
    monkeypatch.setenv("HETGATE_TRACES", str(tmp_path))
    [only] = w.mooncake_trace()
    assert (only.arrival_s, only.prompt_len, only.prompt.blocks) == (1.5, 600, (7, 8))


def test_block_content_is_deterministic_and_distinct() -> None:
    np.testing.assert_array_equal(w.block_token_ids(42, 512), w.block_token_ids(42, 512))
    assert not np.array_equal(w.block_token_ids(42, 512), w.block_token_ids(43, 512))
    ids = w.block_token_ids(1 << 45, 512)
    assert ids.min() >= w.FIRST_WORD_ID and ids.max() < w.FIRST_WORD_ID + w.NUM_WORD_IDS


def test_text_round_trips_through_the_simulator_tokenizer() -> None:
    request = w.fixed_lengths(1, 700, 5)[0]
    assert SimTokenizer().encode(request.text()) == request.token_ids()


def test_shared_system_prompts_share_their_prefix() -> None:
    requests = w.shared_system_prompts(20, system_prompts=2, system_tokens=1024, user_tokens=100, seed=1)
    prefixes = {tuple(r.token_array()[:1024]) for r in requests}
    assert len(prefixes) == 2
    assert len({tuple(r.token_array()[1024:]) for r in requests}) == 20
    assert all(r.prompt_len == 1124 for r in requests)


def test_multi_turn_prompts_extend_the_previous_turn() -> None:
    chats = w.multi_turn_chats(3, 4, seed=2)
    session = sorted((r for r in chats if r.session == chats[0].session), key=lambda r: r.request_id)
    assert len(session) == 4
    for earlier, later in itertools.pairwise(session):
        assert later.prompt_len > earlier.prompt_len
        assert later.prompt.blocks[: len(earlier.prompt.blocks)] == earlier.prompt.blocks
        assert later.arrival_s > earlier.arrival_s


def test_long_context_coding_shares_repositories() -> None:
    requests = w.long_context_coding(10, repositories=2, repo_tokens=4096, question_tokens=128)
    assert len({r.prompt.blocks[0] for r in requests}) <= 2
    assert all(r.prompt_len == 4096 + 128 for r in requests)


def test_poisson_arrivals_at_the_chosen_rate() -> None:
    requests = w.with_poisson_arrivals(w.fixed_lengths(4000, 10, 1), rate=50.0, seed=3)
    gaps = np.diff([0.0] + [r.arrival_s for r in requests])
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
    assert np.all(gaps > 0)
    assert [r.arrival_s for r in w.with_speedup(requests[:3], 2.0)] == [r.arrival_s / 2 for r in requests[:3]]
