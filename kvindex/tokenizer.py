"""An optional per-model tokenizer that turns a request into the token ids vLLM will see.

Loads a `tokenizer.json` file, or a model folder holding `tokenizer.json` plus `tokenizer_config.json`
and/or `chat_template.jinja`. Chat requests are rendered with the folder's chat template the way vLLM
does it (a sandboxed jinja2 environment with `trim_blocks`/`lstrip_blocks`, `add_generation_prompt=True`,
the template's special tokens as variables) and tokenized without adding special tokens (the template
writes them); completions prompts are tokenized with special tokens, as vLLM's defaults are.

Content given as a list of parts is flattened to its text parts joined by newlines (vLLM's "string"
content format); templates that iterate over parts themselves are rendered from that string too.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class TokenizerError(ValueError):
    """The tokenizer or its chat template could not be loaded or rendered."""


class ChatTokenizer:
    """`tokenizers.Tokenizer` plus the model's chat template."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special_tokens: Mapping[str, str]):
        self._tokenizer = tokenizer
        self._special_tokens = dict(special_tokens)
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def load(cls, path: str | Path) -> ChatTokenizer:
        """From a `tokenizer.json` file or a model folder; raises TokenizerError naming the path."""
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerError(f"cannot load tokenizer from {tokenizer_file}: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        template = _find_chat_template(folder, config)
        return cls(tokenizer, template, _special_tokens(config))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> list[int]:
        """Token ids of a chat request as vLLM builds them (template rendered, no extra specials)."""
        if self._template is None:
            raise TokenizerError("this tokenizer has no chat template")
        text = self.render_chat(messages, tools)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> str:
        assert self._template is not None
        flat = [_flatten_message(m) for m in messages]
        try:
            return self._template.render(
                messages=flat, tools=tools or None, add_generation_prompt=True, **self._special_tokens
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a completions prompt (special tokens added, like vLLM's default)."""
        return self._tokenizer.encode(prompt, add_special_tokens=True).ids


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _find_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` wins over tokenizer_config.json (as in current transformers)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _flatten_message(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return {**message, "content": "\n".join(t for t in texts if isinstance(t, str))}
    return dict(message)
