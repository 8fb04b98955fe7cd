"""Chained block hashes and the per-request prompt features (text mode and token mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from kvindex.hashing import HashMode, chain_hashes, hash_text_array, hash_token_ids, root_hash
from kvindex.prompt import PromptHasher, render_chat_text
from kvindex.tokenizer import ChatTokenizer, TokenizerError

ROOT = root_hash(HashMode.TOKENS, "m")


def test_shared_prefix_shares_exactly_its_full_blocks() -> None:
    a = hash_token_ids(list(range(64)), 16, ROOT)
    b = hash_token_ids([*range(40), 999, *range(41, 64)], 16, ROOT)
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]


@pytest.mark.parametrize(
    ("n_tokens", "block_size", "blocks"), [(0, 16, 0), (15, 16, 0), (16, 16, 1), (47, 16, 2), (300, 128, 2)]
)
def test_only_full_blocks_are_hashed(n_tokens: int, block_size: int, blocks: int) -> None:
    assert len(hash_token_ids(list(range(n_tokens)), block_size, ROOT)) == blocks


def test_a_hash_names_its_whole_prefix() -> None:
    """The same block content after different prefixes hashes differently."""
    a = hash_token_ids([1] * 16 + [7] * 16, 16, ROOT)
    b = hash_token_ids([2] * 16 + [7] * 16, 16, ROOT)
    assert a[1] != b[1]


def test_continuing_from_a_parent_equals_hashing_the_whole() -> None:
    ids = list(range(96))
    whole = hash_token_ids(ids, 32, ROOT)
    assert hash_token_ids(ids[32:], 32, whole[0]) == whole[1:]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((HashMode.TOKENS, "m", None), (HashMode.TEXT, "m", None)),
        ((HashMode.TOKENS, "m", None), (HashMode.TOKENS, "n", None)),
        ((HashMode.TOKENS, "m", None), (HashMode.TOKENS, "m", "tenant")),
        ((HashMode.TOKENS, "m", "t1"), (HashMode.TOKENS, "m", "t2")),
        ((HashMode.TOKENS, "ab", "c"), (HashMode.TOKENS, "a", "bc")),
    ],
)
def test_roots_separate_modes_models_and_tenants(a: tuple, b: tuple) -> None:
    assert root_hash(*a) != root_hash(*b)
    assert root_hash(*a) == root_hash(*a)


def test_hashes_are_64_bit_and_deterministic() -> None:
    hashes = chain_hashes(b"x" * 640, 64, 12345)
    assert hashes == chain_hashes(b"x" * 640, 64, 12345)
    assert len(set(hashes)) == 10 and all(0 <= h < 2**64 for h in hashes)


def test_text_chunks_are_block_size_times_four_bytes() -> None:
    assert len(hash_text_array("a" * (16 * 4 * 3 + 5), 16, ROOT)) == 3


CHAT = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "messages": [
        {"role": "system", "content": "S" * 300},
        {"role": "user", "content": "U" * 300},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "T" * 300},
        {"role": "user", "content": [{"type": "text", "text": "V" * 300}]},
    ],
}


def _with(path: list, value: object) -> dict:
    body = json.loads(json.dumps(CHAT))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


@pytest.mark.parametrize(
    "changed",
    [
        _with(["messages", 4, "content"], [{"type": "text", "text": "W" * 300}]),  # the LAST message
        _with(["messages", 3, "tool_call_id"], "2"),
        _with(["messages", 2, "tool_calls"], [{"id": "1", "function": {"name": "g"}}]),
        _with(["messages", 1, "role"], "assistant"),
        _with(["tools"], []),
        _with(["messages", 0, "content"], "s" * 300),
    ],
    ids=["last-message", "tool-call-id", "tool-calls", "role", "tools", "system"],
)
def test_text_mode_hashes_the_whole_conversation(changed: dict) -> None:
    hasher = PromptHasher("m", [16])
    base_tokens, base = hasher.features(CHAT, "chat")
    _, other = hasher.features(changed, "chat")
    assert len(base[16]) and len(other[16])
    assert base[16].tolist() != other[16].tolist()
    assert base_tokens == -(-len(render_chat_text(CHAT)) // 4)


def test_text_mode_appending_a_turn_keeps_the_earlier_blocks() -> None:
    hasher = PromptHasher("m", [16])
    _, before = hasher.features(CHAT, "chat")
    longer = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "A" * 500}]}
    _, after = hasher.features(longer, "chat")
    assert after[16][: len(before[16])].tolist() == before[16].tolist()
    assert len(after[16]) > len(before[16])


@pytest.mark.parametrize(
    "body",
    [{}, {"messages": "nope"}, {"messages": [1, None, "x"]}, {"messages": [{"content": 5}]}],
)
def test_odd_chat_bodies_do_not_raise(body: dict) -> None:
    tokens, hashes = PromptHasher("m", [16, 128]).features(body, "chat")
    assert tokens >= 0 and set(hashes) == {16, 128}


def test_features_cover_every_block_size_and_tenants_differ() -> None:
    hasher = PromptHasher("m", [128, 16, 16])
    body = {"prompt": "p" * 4 * 256}
    tokens, hashes = hasher.features(body, "completions")
    assert tokens == 256 and len(hashes[16]) == 16 and len(hashes[128]) == 2
    _, salted = hasher.features(body, "completions", tenant="t")
    assert not set(salted[16].tolist()) & set(hashes[16].tolist())


@pytest.mark.parametrize("prompt", [[list(range(40))], list(range(40))])
def test_token_id_prompts_hash_like_kv_events(prompt: list) -> None:
    hasher = PromptHasher("m", [16])
    tokens, hashes = hasher.features({"prompt": prompt}, "completions")
    assert tokens == 40
    assert hashes[16].tolist() == hasher.hash_token_ids(list(range(40)), 16)


# --- token mode with a real tokenizer folder ------------------------------------------------

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|unk|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "hello world, user assistant system"]
    tokenizer.train_from_iterator(corpus, trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": {"content": "<|bos|>"}, "eos_token": "<|eos|>", "chat_template": "ignored"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def test_chat_tokens_follow_the_template_like_vllm(model_dir: Path) -> None:
    tok = ChatTokenizer.load(model_dir)
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tok.render_chat(messages, None)
    assert rendered == "<|bos|><|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # The template writes the specials itself: no second BOS from the post-processor.
    assert tok.chat_ids(messages, None) == raw.encode(rendered, add_special_tokens=False).ids
    assert tok.prompt_ids("hello")[0] == raw.token_to_id("<|bos|>")


def test_token_mode_request_hashes_equal_event_hashes(model_dir: Path) -> None:
    tok = ChatTokenizer.load(model_dir)
    hasher = PromptHasher("m", [16], tokenizer=tok)
    body = {"messages": [{"role": "user", "content": "the quick brown fox " * 30}]}
    tokens, hashes = hasher.features(body, "chat", tenant="t")
    ids = tok.chat_ids(body["messages"], None)
    assert tokens == len(ids) and len(hashes[16]) == len(ids) // 16 > 0
    assert hashes[16].tolist() == hasher.hash_token_ids(ids, 16, tenant="t")


def test_token_mode_includes_tools(model_dir: Path) -> None:
    hasher = PromptHasher("m", [16], tokenizer=ChatTokenizer.load(model_dir))
    body = {"messages": [{"role": "user", "content": "the lazy dog " * 30}]}
    with_tools = {**body, "tools": [{"type": "function", "function": {"name": "jump"}}]}
    assert hasher.features(body, "chat")[0] < hasher.features(with_tools, "chat")[0]


def test_tokenizer_json_file_alone_and_template_from_config(tmp_path: Path, model_dir: Path) -> None:
    alone = ChatTokenizer.load(model_dir / "tokenizer.json")
    assert alone.has_chat_template  # the folder's chat_template.jinja is still found
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    config = {"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTokenizer.load(tmp_path).render_chat([{"role": "user", "content": "x"}], None) == "x"


def test_missing_tokenizer_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        ChatTokenizer.load(tmp_path)


def test_template_error_falls_back_to_text_hashes(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    hasher = PromptHasher("m", [16], tokenizer=ChatTokenizer.load(tmp_path))
    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    tokens, hashes = hasher.features(body, "chat")
    text_tokens, text_hashes = PromptHasher("m", [16]).features(body, "chat")
    assert tokens == text_tokens and hashes[16].tolist() == text_hashes[16].tolist()
