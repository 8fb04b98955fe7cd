"""/v1/completions and /v1/chat/completions: bodies, ids, usage, SSE framing [observed on vLLM 0.32]."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conformance_helpers import ConformanceTarget, sse_chunks, token_prompt, words

COMPLETION_KEYS = {
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
    "kv_transfer_params",
}  # fmt: skip
USAGE_KEYS = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}


def body(target: ConformanceTarget, **fields: Any) -> dict[str, Any]:
    # Greedy and EOS ignored: a real model then produces exactly max_tokens, deterministically.
    return {"model": target.model, "temperature": 0, "ignore_eos": True, **fields}


def prompt_tokens(client: httpx.Client, target: ConformanceTarget, **prompt: Any) -> int:
    return client.post("/tokenize", json={"model": target.model, **prompt}).json()["count"]


def test_completion_body(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    response = client.post("/v1/completions", json=body(conformance_target, prompt=words(8), max_tokens=5))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    completion = response.json()
    assert set(completion) >= COMPLETION_KEYS
    assert completion["id"].startswith("cmpl-") and completion["object"] == "text_completion"
    assert completion["model"] == conformance_target.model and isinstance(completion["created"], int)
    assert completion["system_fingerprint"].startswith("vllm-")
    assert completion["kv_transfer_params"] is None
    (choice,) = completion["choices"]
    assert {"index", "text", "logprobs", "finish_reason", "stop_reason"} <= set(choice)
    assert choice["index"] == 0 and isinstance(choice["text"], str) and choice["finish_reason"] == "length"
    usage = completion["usage"]
    assert set(usage) >= USAGE_KEYS
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] == prompt_tokens(client, conformance_target, prompt=words(8))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_x_request_id_becomes_the_response_id(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    request = body(conformance_target, prompt=words(4), max_tokens=1)
    completion = client.post("/v1/completions", json=request, headers={"X-Request-Id": "conf-req-123"}).json()
    assert completion["id"] == "cmpl-conf-req-123"
    chat = client.post(
        "/v1/chat/completions",
        json=body(conformance_target, messages=[{"role": "user", "content": "hi"}], max_tokens=1),
        headers={"X-Request-Id": "conf-req-456"},
    ).json()
    assert chat["id"] == "chatcmpl-conf-req-456"


def test_unknown_fields_are_tolerated(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    request = body(conformance_target, prompt=words(4), max_tokens=2, top_k=5, user="u1", hetgate_unknown=1)
    assert client.post("/v1/completions", json=request).status_code == 200


def test_prompt_as_token_ids(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    tokens = client.post("/tokenize", json={"model": conformance_target.model, "prompt": words(6)}).json()[
        "tokens"
    ]
    response = client.post("/v1/completions", json=body(conformance_target, prompt=tokens, max_tokens=2))
    assert response.json()["usage"]["prompt_tokens"] == len(tokens)


def test_chat_body(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    messages = [{"role": "user", "content": words(8)}]
    response = client.post(
        "/v1/chat/completions", json=body(conformance_target, messages=messages, max_tokens=4)
    )
    assert response.status_code == 200
    chat = response.json()
    assert chat["id"].startswith("chatcmpl-") and chat["object"] == "chat.completion"
    assert "kv_transfer_params" in chat and chat["kv_transfer_params"] is None
    (choice,) = chat["choices"]
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert {"refusal", "annotations", "audio", "function_call", "reasoning"} <= set(message)
    usage = chat["usage"]
    assert usage["completion_tokens"] == 4
    templated = prompt_tokens(client, conformance_target, messages=messages, add_generation_prompt=True)
    assert usage["prompt_tokens"] == templated


def stream(client: httpx.Client, path: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_chunks(response)


def test_completion_stream(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    request = body(conformance_target, prompt=words(8), max_tokens=5)
    whole = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    chunks = stream(client, "/v1/completions", {**request, "stream": True})
    assert len({chunk["id"] for chunk in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert all(chunk.get("usage") is None for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])


def test_chat_stream_starts_with_the_role(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    request = body(conformance_target, messages=[{"role": "user", "content": words(8)}], max_tokens=4)
    whole = client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"]
    chunks = stream(client, "/v1/chat/completions", {**request, "stream": True})
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks[1:]) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_adds_a_final_usage_chunk(
    client: httpx.Client, conformance_target: ConformanceTarget, path: str
) -> None:
    prompt = (
        {"prompt": words(8)}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    request = body(
        conformance_target, **prompt, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = stream(client, path, request)
    *content, last = chunks
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 3
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 3
    assert all(chunk.get("usage") is None for chunk in content)


def test_continuous_usage_stats_put_usage_in_every_chunk(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = body(conformance_target, prompt=words(8), max_tokens=4, stream=True, stream_options=options)
    chunks = stream(client, "/v1/completions", request)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert len({chunk["usage"]["prompt_tokens"] for chunk in chunks}) == 1


def test_cached_tokens_are_reported_block_granular(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    size = conformance_target.block_size
    prompt = token_prompt(client, conformance_target, 3 * size + 5, seed="cache")
    request = body(conformance_target, prompt=prompt, max_tokens=1)
    client.post("/v1/completions", json=request)
    usage = client.post("/v1/completions", json=request).json()["usage"]
    details = usage["prompt_tokens_details"]
    if not conformance_target.prompt_tokens_details:
        assert details is None
        return
    # The three whole blocks; the partial fourth is never cached (nor a whole last block: its last
    # token is always computed).
    assert details["cached_tokens"] == 3 * size
