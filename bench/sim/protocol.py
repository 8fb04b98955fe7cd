"""vLLM 0.32's OpenAI-compatible request checks and response bodies, for the simulated backend.

Shapes follow vllm-reference.md A5 ([observed] on a live vLLM 0.32). Only the fields the simulator
acts on are read; every other field is tolerated and ignored, as vLLM ignores fields it does not use.
Errors: request-shape problems (what vLLM's pydantic layer rejects) are 400 `"Bad Request"` with
`param: "body.<field>"`; semantic ones are 400 `BadRequestError`; an unknown model is 404 `NotFoundError`.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from enum import Enum
from typing import Any

from bench.sim.tokenizer import SimTokenizer

VLLM_VERSION = "0.32.0"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's default for /v1/completions

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class Kind(Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class RequestError(Exception):
    """An OpenAI-shaped error to return instead of running the request."""

    def __init__(
        self, status: int, message: str, err_type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or ERROR_TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(
    status: int, message: str, err_type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    err_type = err_type or ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _shape_error(field: str, message: str) -> RequestError:
    return RequestError(400, message, err_type="Bad Request", param=f"body.{field}")


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    seed: int


@dataclass(slots=True)
class ServedModel:
    names: list[str]
    max_model_len: int
    force_include_usage: bool = False


def parse_request(body: Any, kind: Kind, served: ServedModel, tokenizer: SimTokenizer) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _shape_error("", "Input should be a valid dictionary or object to extract fields from")
    model = _check_model(body.get("model"), served)
    prompt_ids = _prompt_tokens(body, kind, tokenizer)
    stream = _optional(body, "stream", bool) or False
    stream_options = _optional(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise RequestError(400, "Stream options can only be defined when `stream=True`.")
    n = _optional(body, "n", int)
    if n is not None and n != 1:
        raise RequestError(400, "the simulated backend supports only n=1", param="n")
    max_tokens = _max_tokens(body, kind, len(prompt_ids), served.max_model_len)
    seed = _optional(body, "seed", int)
    options = stream_options or {}
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")) or (stream and served.force_include_usage),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        kv_transfer_params=_optional(body, "kv_transfer_params", dict),
        seed=seed if seed is not None else prompt_seed(prompt_ids),
    )


def _optional(body: dict[str, Any], field: str, expected: type) -> Any:
    value = body.get(field)
    if value is None:
        return None
    # bool is an int in Python; vLLM's pydantic models reject true for integer fields.
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise _shape_error(field, f"Input should be a valid {expected.__name__}")
    return value


def _check_model(model: Any, served: ServedModel) -> str:
    if model is None:
        return served.names[0]
    if not isinstance(model, str):
        raise _shape_error("model", "Input should be a valid string")
    if model not in served.names:
        raise RequestError(404, f"The model `{model}` does not exist.", param="model")
    return model


def _prompt_tokens(body: dict[str, Any], kind: Kind, tokenizer: SimTokenizer) -> list[int]:
    if kind is Kind.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise _shape_error(
                "messages", "Field required" if messages is None else "Input should be a valid list"
            )
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        try:
            return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt))
        except TypeError as exc:
            raise _shape_error("messages", str(exc)) from exc
    prompt = body.get("prompt")
    if prompt is None:
        # vLLM 0.32 checks this in its own code, not pydantic: BadRequestError with param "prompt" [observed].
        raise RequestError(
            400,
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            param="prompt",
        )
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt)
    else:
        raise RequestError(
            400, "prompt must be a string, a list of token ids, or a batch of one", param="prompt"
        )
    if not token_ids:
        raise RequestError(400, "The prompt cannot be empty.", param="prompt")
    return token_ids


def _max_tokens(body: dict[str, Any], kind: Kind, prompt_len: int, max_model_len: int) -> int:
    field = (
        "max_completion_tokens"
        if kind is Kind.CHAT and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    requested = _optional(body, field, int)
    if prompt_len >= max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
        )
    if requested is None:
        return DEFAULT_COMPLETION_MAX_TOKENS if kind is Kind.COMPLETION else max_model_len - prompt_len
    if requested < 1:
        raise RequestError(400, f"{field} must be at least 1, got {requested}.", param=field)
    if prompt_len + requested > max_model_len:
        raise RequestError(
            400,
            f"'{field}' is too large: {requested}. This model's maximum context length is {max_model_len} "
            f"tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            param=field,
        )
    return requested


def prompt_seed(token_ids: list[int]) -> int:
    """Same prompt, same output: the default seed is a digest of the prompt tokens."""
    return int.from_bytes(hashlib.blake2b(array("I", token_ids).tobytes(), digest_size=8).digest(), "big")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """`cached_tokens` is None unless the server runs with --enable-prompt-tokens-details."""
    details = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
        "completion_tokens_details": None,
    }


def completion_body(
    response_id: str, created: int, model: str, text: str, finish_reason: str | None,
    usage_: dict[str, Any], kv_transfer_params: dict[str, Any] | None, fingerprint: str,
) -> dict[str, Any]:  # fmt: skip
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_body(
    response_id: str, created: int, model: str, text: str, finish_reason: str | None,
    usage_: dict[str, Any], kv_transfer_params: dict[str, Any] | None, fingerprint: str,
) -> dict[str, Any]:  # fmt: skip
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
    }


def stream_chunk(
    kind: Kind, response_id: str, created: int, model: str, text: str, finish_reason: str | None,
    first: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One SSE chunk, with the fields vLLM sets explicitly (it serialises with exclude_unset);
    a chat stream's first chunk carries the role and empty content."""
    if kind is Kind.COMPLETION:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        choice.update(stop_reason=None, prompt_token_ids=None, token_ids=None)
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": ""} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        obj = "chat.completion.chunk"
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    kind: Kind, response_id: str, created: int, model: str, usage_: dict[str, Any], fingerprint: str
) -> dict[str, Any]:
    """The final `choices: []` chunk; vLLM serialises it with exclude_none, so null fields vanish."""
    obj = "text_completion" if kind is Kind.COMPLETION else "chat.completion.chunk"
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": _without_nulls(usage_),
        "system_fingerprint": fingerprint,
    }


def _without_nulls(value: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _without_nulls(item) if isinstance(item, dict) else item
        for key, item in value.items()
        if item is not None
    }


def models_body(served: ServedModel, root: str, created: int) -> dict[str, Any]:
    cards = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": None,
            "max_model_len": served.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{hashlib.blake2b(name.encode(), digest_size=16).hexdigest()}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for name in served.names
    ]
    return {"object": "list", "data": cards}
