"""The OpenAI fields the gateway reads, checked by hand on the parsed body.

No pydantic model of the whole request: the body is parsed once with orjson, the few fields routing and
proxying need are checked here, and everything else passes through to the backend untouched. The checks
mirror vLLM's own 400s so a bad request fails here, before any backend is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from gateway.errors import BadRequest


class Kind(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Kind.CHAT else "/v1/completions"


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int


def parse_body(raw: bytes, kind: Kind) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string.", "model")
    if kind is Kind.CHAT:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    stream = _optional(body, "stream", bool, False)
    if "stream_options" in body and body["stream_options"] is not None:
        if not isinstance(body["stream_options"], dict):
            raise BadRequest("'stream_options' must be an object.", "stream_options")
        if not stream:
            raise BadRequest("'stream_options' can only be set when 'stream' is true.", "stream_options")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens") or 0
    n = _positive_int(body, "n")
    if n is not None and n > 128:
        raise BadRequest("'n' must be at most 128.", "n")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _optional(body, name, (int, float), None)
    return ParsedRequest(kind, raw, body, model, stream, max_tokens)


def _optional(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python; a JSON `true` is never a valid number here.
    if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
        raise BadRequest(f"'{name}' has the wrong type.", name)
    return value


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = _optional(body, name, int, None)
    if value is not None and value < 1:
        raise BadRequest(f"'{name}' must be at least 1.", name)
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'.", "messages")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return
    raise BadRequest("'prompt' must be a string, an array of strings, or token ids.", "prompt")


def estimate_prompt_tokens(request: ParsedRequest) -> int:
    """A cheap token estimate (~4 characters a token) when no tokenizer is configured."""
    body = request.body
    if request.kind is Kind.CHAT:
        chars = sum(len(str(m.get("content") or "")) for m in body["messages"])
        return chars // 4 + 4 * len(body["messages"])
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return len(prompt) // 4
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    return sum(len(p) if isinstance(p, list) else len(p) // 4 for p in prompt)
