"""A deterministic word-level tokenizer and ChatML chat template for the simulated vLLM backend.

About one token per word, so a workload generator builds an N-token prompt from N words. Token ids
are stable across processes (no Python `hash`): the id of a word is found in a fixed generated
vocabulary when the word is one of its entries, else it is a BLAKE2 hash of the word folded into
the upper half of the id space. Decoding maps every id back to its vocabulary entry, so generated
tokens (always drawn from the vocabulary) round-trip exactly. Hashed words are remembered (per id,
the newest spelling wins) so detokenizing recently tokenized text gives it back; an id never seen
decodes to the stand-in vocabulary word of that id.

The chat template mirrors ChatML as vLLM applies it from a model's `chat_template`:
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n` when
`add_generation_prompt` is true. Special tokens in the rendered text are single tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PUNCTUATION = (*"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "\n")
_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"

VOCAB_SIZE = 65536
# Ids below this are the generated vocabulary; words outside it hash into [_HASHED_BASE, VOCAB_SIZE).
_HASHED_BASE = VOCAB_SIZE // 2

_MAX_MEMO = 1 << 20
_TOKEN_RE = re.compile(r"<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>|\w+|\n|[^\w\s]")


def _syllables() -> list[str]:
    return [c + v for c in _CONSONANTS for v in _VOWELS]


def _build_vocab() -> list[str]:
    """Specials, punctuation, then pronounceable words of 1..3 syllables until the table is full."""
    vocab = list(SPECIAL_TOKENS) + list(PUNCTUATION)
    syllables = _syllables()
    for length in (1, 2, 3):
        for parts in itertools.product(syllables, repeat=length):
            if len(vocab) >= VOCAB_SIZE:
                return vocab
            vocab.append("".join(parts))
    return vocab


class SimTokenizer:
    """Word/punctuation tokenizer with a stable id per word; see the module docstring."""

    def __init__(self) -> None:
        self._vocab = _build_vocab()
        self._ids = {word: i for i, word in enumerate(self._vocab[:_HASHED_BASE])}
        self.eos_token_id = self._ids["<|endoftext|>"]
        # Generated tokens come from the plain-word part of the vocabulary (no specials, no punctuation).
        self.first_word_id = len(SPECIAL_TOKENS) + len(PUNCTUATION)
        self.num_word_ids = _HASHED_BASE - self.first_word_id
        # Last word seen per hashed id; bounded by the hashed id range (32768 entries).
        self._seen: dict[int, str] = {}
        # Word -> id memo: workloads reuse their words, and hashing is most of the tokenizing cost.
        self._memo: dict[str, int] = dict(self._ids)

    def token_id(self, word: str) -> int:
        known = self._ids.get(word)
        if known is not None:
            return known
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        token_id = _HASHED_BASE + int.from_bytes(digest, "big") % (VOCAB_SIZE - _HASHED_BASE)
        self._seen[token_id] = word
        if len(self._memo) < _MAX_MEMO:
            self._memo[word] = token_id
        return token_id

    def encode(self, text: str) -> list[int]:
        memo = self._memo
        return [memo[word] if word in memo else self.token_id(word) for word in _TOKEN_RE.findall(text)]

    def token_strs(self, token_ids: Iterable[int]) -> list[str]:
        return [self.id_to_str(token_id) for token_id in token_ids]

    def id_to_str(self, token_id: int) -> str:
        if 0 <= token_id < len(self._vocab):
            return self._seen.get(token_id) or self._vocab[token_id]
        raise ValueError(f"token id {token_id} is out of vocabulary range [0, {VOCAB_SIZE})")

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.token_text(token_id, first=i == 0) for i, token_id in enumerate(token_ids))

    def token_text(self, token_id: int, first: bool = False) -> str:
        """Text of one token as it appears in a stream: words carry a leading space, punctuation
        and special tokens do not, so concatenated pieces re-tokenize to the same ids."""
        word = self.id_to_str(token_id)
        if first or not (word[0].isalnum() or word[0] == "_"):
            return word
        return " " + word

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        parts = [
            f"<|im_start|>{m.get('role', '')}\n{message_text(m.get('content'))}<|im_end|>\n" for m in messages
        ]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def write_tokenizer_json(path: Path) -> Path:
    """The vocabulary words as a `tokenizers` WordLevel `tokenizer.json`, as a vLLM model folder holds
    one, so a gateway given it counts and hashes text prompts as the simulator does (`hetgate bench
    policies --http` with text prompts: the workloads' text is vocabulary words). A word outside the
    vocabulary reads as `<|endoftext|>` there, where the simulator hashes it to an id of its own."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(_build_vocab()[:_HASHED_BASE])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    # _TOKEN_RE's pieces: words, newlines and punctuation; other white space separates them only.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\w+|\n|[^\w\s]"), behavior="isolated"),
        ]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path))
    return path


def message_text(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise TypeError("message content must be a string or a list of content parts")
