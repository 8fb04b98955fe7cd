"""Per-request prompt features: a token estimate and chained block hashes per block size.

The gateway builds one `PromptHasher` per model at startup and calls `features()` once per request.
With a tokenizer (`ChatTokenizer`) the hashes cover the token ids vLLM will compute, so they match the
hashes built from vLLM's KV events. Without one, the whole conversation (every message with its role,
name, tool calls and tool call id, plus the tool definitions) is rendered to one canonical text and
hashed in chunks of ~block_size tokens; such hashes only meet hashes from the same gateway logic
(approximate mode: the gateway records what it routed).
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import orjson

from kvindex.hashing import (
    CHARS_PER_TOKEN,
    TOKEN_BYTES,
    BlockHashes,
    HashMode,
    chain_hash_array,
    hash_text_array,
    hash_token_ids,
    pack_token_ids,
    root_hash,
    uint32_array,
)
from kvindex.tokenizer import ChatTokenizer, TokenizerError

RequestKind = Literal["chat", "completions"]
Features = tuple[int, dict[int, BlockHashes]]


class PromptHasher:
    """Turns a parsed request body into (estimated prompt tokens, {block_size: hashes})."""

    def __init__(
        self,
        model: str,
        block_sizes: Iterable[int],
        tokenizer: ChatTokenizer | None = None,
        max_tenants: int = 4096,
    ) -> None:
        self.model = model
        self.block_sizes = tuple(sorted(set(block_sizes)))
        if not self.block_sizes or min(self.block_sizes) <= 0:
            raise ValueError("block sizes must be positive")
        self.tokenizer = tokenizer
        self._roots: OrderedDict[tuple[HashMode, str | None], int] = OrderedDict()
        self._max_tenants = max_tenants

    @property
    def mode(self) -> HashMode:
        return HashMode.TOKENS if self.tokenizer is not None else HashMode.TEXT

    def root(self, mode: HashMode, tenant: str | None) -> int:
        """Block 0's seed for this model and tenant (a small LRU: tenants are few, roots are reused)."""
        key = (mode, tenant)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = root_hash(mode, self.model, tenant)
            if len(self._roots) > self._max_tenants:
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end(key)
        return root

    def features(self, body: Mapping[str, Any], kind: RequestKind, tenant: str | None = None) -> Features:
        """Reads only `messages` (+ `tools`) or `prompt` from the body; never raises on odd shapes."""
        token_ids = self._token_ids(body, kind)
        if token_ids is not None:
            return len(token_ids), self._hash_tokens(token_ids, tenant)
        text = render_chat_text(body) if kind == "chat" else _prompt_text(body.get("prompt"))
        root = self.root(HashMode.TEXT, tenant)
        hashes: dict[int, BlockHashes] = {bs: hash_text_array(text, bs, root) for bs in self.block_sizes}
        return -(-len(text) // CHARS_PER_TOKEN), hashes

    def hash_token_ids(
        self, token_ids: Sequence[int], block_size: int, tenant: str | None = None
    ) -> list[int]:
        """Token-mode hashes of a whole prompt (what a request with these token ids would get)."""
        return hash_token_ids(token_ids, block_size, self.root(HashMode.TOKENS, tenant))

    def _hash_tokens(
        self, token_ids: Sequence[int] | np.ndarray, tenant: str | None
    ) -> dict[int, BlockHashes]:
        packed = pack_token_ids(token_ids)  # packed once, reused for every block size
        root = self.root(HashMode.TOKENS, tenant)
        return {bs: chain_hash_array(packed, bs * TOKEN_BYTES, root) for bs in self.block_sizes}

    def _token_ids(self, body: Mapping[str, Any], kind: RequestKind) -> Sequence[int] | np.ndarray | None:
        """Token ids when we can know them exactly; None means hash text instead."""
        if kind == "completions":
            prompt = _first_prompt(body.get("prompt"))
            ids = _token_array(prompt)
            if ids is not None:
                return ids
            if self.tokenizer is not None and isinstance(prompt, str):
                return self.tokenizer.prompt_ids(prompt)
            return None
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        try:
            return self.tokenizer.chat_ids(messages, tools)
        except TokenizerError:
            # A template that rejects this conversation: text hashes live under another root, so this
            # request simply finds no token-mode hits instead of failing.
            return None


def render_chat_text(body: Mapping[str, Any]) -> str:
    """The whole conversation as one canonical text: tools first, then every message in order."""
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append("<|tools|>" + _canonical_json(tools))
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict):
            parts.append(_render_message(message))
    return "".join(parts)


def _render_message(message: Mapping[str, Any]) -> str:
    out = [f"<|{message.get('role', '')}|>"]
    if message.get("name"):
        out.append(f"<|name|>{message['name']}")
    content = message.get("content")
    if isinstance(content, str):
        out.append(content)
    elif content is not None:
        out.append(_canonical_json(content))  # parts (text, image urls...) all shape the prompt
    for key in ("tool_calls", "tool_call_id", "function_call"):
        if message.get(key) is not None:
            out.append(f"<|{key}|>" + _canonical_json(message[key]))
    out.append("\n")
    return "".join(out)


def _canonical_json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(value)


def _first_prompt(prompt: Any) -> Any:
    """A batch prompt (list of strings or of token lists) is routed as a whole by its first entry."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def _token_array(value: Any) -> array.array[int] | None:
    """A prompt given as token ids, or None: converted and checked in one C loop (32k ids in ~0.35
    ms; numpy's conversion took ~1 ms, a Python loop several)."""
    if not isinstance(value, list) or not value or type(value[0]) is not int:
        return None
    try:
        return uint32_array(value)
    except (TypeError, OverflowError):
        return None  # floats, strings, nested lists or out-of-range ids


def _prompt_text(prompt: Any) -> str:
    prompt = _first_prompt(prompt)
    return prompt if isinstance(prompt, str) else ""
