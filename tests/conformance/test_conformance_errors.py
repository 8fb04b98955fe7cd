"""OpenAI-shaped errors with vLLM 0.32's types and codes [observed]."""

from __future__ import annotations

import httpx
import pytest
from conformance_helpers import ConformanceTarget, error_of, words


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(client: httpx.Client, path: str) -> None:
    request = {"model": "no-such-model", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    error = error_of(client.post(path, json=request), 404)
    assert error["type"] == "NotFoundError"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_beyond_the_context_is_400(
    client: httpx.Client, conformance_target: ConformanceTarget, stream: bool
) -> None:
    max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    request = {"model": conformance_target.model, "prompt": words(4), "max_tokens": max_model_len + 1}
    response = client.post("/v1/completions", json={**request, "stream": stream})
    error = error_of(response, 400)  # before any SSE byte, also when streaming
    assert error["type"] == "BadRequestError"
    assert response.headers["content-type"].startswith("application/json")


def test_missing_prompt_is_a_bad_request(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    # Seen on vLLM 0.32: the check is vLLM's own (not pydantic's), so it is a BadRequestError on `prompt`.
    error = error_of(client.post("/v1/completions", json={"model": conformance_target.model}), 400)
    assert error["type"] == "BadRequestError"
    assert error["param"] == "prompt"


def test_wrong_field_type_is_a_request_shape_error(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    request = {"model": conformance_target.model, "prompt": "hi", "max_tokens": "many"}
    error = error_of(client.post("/v1/completions", json=request), 400)
    assert error["type"] == "Bad Request"
    assert error["param"] == "body.max_tokens"


def test_stream_options_without_stream_is_400(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    request = {"model": conformance_target.model, "prompt": "hi", "stream_options": {"include_usage": True}}
    assert error_of(client.post("/v1/completions", json=request), 400)["type"] == "BadRequestError"


def test_invalid_json_is_400(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    error_of(response, 400)
