"""hetgate in front of two real vLLM servers, driven by the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from e2e_helpers import ROUTE_HEADER, backend_entry, code_prompt, gateway_config, route_fields
from vllm_server import VllmServer

from bench.harness import GatewayProcess

pytestmark = pytest.mark.e2e


@pytest.fixture
def gateway(aggregated_servers: list[VllmServer], start_gateway) -> GatewayProcess:
    backends = [backend_entry(server) for server in aggregated_servers]
    return start_gateway(gateway_config(backends, policy="round_robin"), "agg-api")


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == ["tiny"]


def test_chat_completion(client: openai.OpenAI, aggregated_servers: list[VllmServer]) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "def main():"}], max_tokens=8, temperature=0
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens > 0
    route = route_fields(raw.headers[ROUTE_HEADER])
    assert route["mode"] == "aggregated"
    assert route["backend"] in {server.spec.name for server in aggregated_servers}


def test_streamed_chat_reports_usage_last(
    client: openai.OpenAI, aggregated_servers: list[VllmServer]
) -> None:
    messages = [{"role": "user", "content": "import os"}]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text
    finished = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finished[-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert all(chunk.usage is None for chunk in chunks[:-1])
    # No event was lost on the way: the text is a backend's own greedy answer (both hold the same weights).
    direct = httpx.post(
        f"{aggregated_servers[0].base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0},
        timeout=60,
    ).json()
    assert text == direct["choices"][0]["message"]["content"]


def test_completion_equals_the_backends_own_greedy_answer(
    client: openai.OpenAI, aggregated_servers: list[VllmServer]
) -> None:
    prompt = code_prompt(4)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0
    )
    through_gateway = raw.parse()
    backend = route_fields(raw.headers[ROUTE_HEADER])["backend"]
    server = next(server for server in aggregated_servers if server.spec.name == backend)
    direct = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0},
        timeout=60,
    ).json()
    assert through_gateway.object == "text_completion"
    assert through_gateway.choices[0].text == direct["choices"][0]["text"]
    assert through_gateway.usage.prompt_tokens == direct["usage"]["prompt_tokens"]


def test_round_robin_uses_both_backends(client: openai.OpenAI, aggregated_servers: list[VllmServer]) -> None:
    used = set()
    for _ in range(4):
        raw = client.completions.with_raw_response.create(model="tiny", prompt="x = 1", max_tokens=1)
        used.add(route_fields(raw.headers[ROUTE_HEADER])["backend"])
    assert used == {server.spec.name for server in aggregated_servers}


def test_unknown_model_is_an_openai_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert raised.value.status_code == 404
