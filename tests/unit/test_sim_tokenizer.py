"""The simulator's tokenizer: stable ids, about one token per word, exact round trips, ChatML."""

from __future__ import annotations

import pytest

from bench.sim.tokenizer import VOCAB_SIZE, SimTokenizer


@pytest.fixture(scope="module")
def tokenizer() -> SimTokenizer:
    return SimTokenizer()


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("one two three four", 4),
        ("hello, world.", 4),
        ("line one\nline two", 5),
        ("   spaced    out   ", 2),
        ("", 0),
        ("<|im_start|>user\nhi<|im_end|>", 5),
    ],
)
def test_token_counts(tokenizer: SimTokenizer, text: str, count: int) -> None:
    assert len(tokenizer.encode(text)) == count


def test_n_words_make_n_tokens(tokenizer: SimTokenizer) -> None:
    words = " ".join(f"word{i}" for i in range(500))
    assert len(tokenizer.encode(words)) == 500


def test_ids_are_stable_across_instances_and_in_range(tokenizer: SimTokenizer) -> None:
    text = "The quick brown fox, again: 42 times!"
    ids = tokenizer.encode(text)
    assert ids == SimTokenizer().encode(text)
    assert all(0 <= token_id < VOCAB_SIZE for token_id in ids)
    assert len(set(tokenizer.encode("alpha beta gamma delta"))) == 4


def test_case_and_spelling_change_the_id(tokenizer: SimTokenizer) -> None:
    assert tokenizer.token_id("Hello") != tokenizer.token_id("hello")


def test_vocabulary_tokens_round_trip(tokenizer: SimTokenizer) -> None:
    words = range(tokenizer.first_word_id, tokenizer.first_word_id + 300, 7)
    ids = [*words, tokenizer.token_id(","), tokenizer.token_id("\n")]
    assert tokenizer.encode(tokenizer.decode(ids)) == ids


def test_streamed_pieces_concatenate_to_decode(tokenizer: SimTokenizer) -> None:
    ids = [tokenizer.first_word_id + k for k in (5, 90, 1234, 7)]
    pieces = [tokenizer.token_text(token_id, first=i == 0) for i, token_id in enumerate(ids)]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert pieces[1].startswith(" ")


def test_decode_rejects_ids_outside_the_vocabulary(tokenizer: SimTokenizer) -> None:
    with pytest.raises(ValueError, match="out of vocabulary"):
        tokenizer.decode([VOCAB_SIZE])


def test_chat_template_is_chatml(tokenizer: SimTokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered.startswith(without) and not without.endswith("assistant\n")


def test_chat_template_reads_text_parts(tokenizer: SimTokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]}]
    assert "a b\nc" in tokenizer.apply_chat_template(messages, add_generation_prompt=False)


def test_chat_prefix_is_a_token_prefix(tokenizer: SimTokenizer) -> None:
    """Multi-turn prefix caching depends on the earlier turns tokenizing identically."""
    turn1 = [{"role": "user", "content": "first question here"}]
    turn2 = [*turn1, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
    ids1 = tokenizer.encode(tokenizer.apply_chat_template(turn1, add_generation_prompt=False))
    ids2 = tokenizer.encode(tokenizer.apply_chat_template(turn2, add_generation_prompt=True))
    assert ids2[: len(ids1)] == ids1
