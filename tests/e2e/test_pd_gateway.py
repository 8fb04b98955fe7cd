"""Prefill/decode disaggregation through hetgate between two real vLLM servers (ExampleConnector).

The prefiller writes each prompt's KV cache into a shared folder; the decoder finds it by the
prompt's tokens and loads it instead of computing it. vLLM's own `external_kv_transfer` counter on
the decoder proves the transfer happened; greedy output must not change.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from e2e_helpers import ROUTE_HEADER, backend_entry, code_prompt, gateway_config, metric_total, route_fields
from vllm_server import VllmServer

from bench.harness import GatewayProcess

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
EXTERNAL = {"source": "external_kv_transfer"}


@pytest.fixture
def pd_gateway(pd_servers: list[VllmServer], start_gateway) -> GatewayProcess:
    prefill, decode = pd_servers
    backends = [
        backend_entry(prefill, roles=["prefill"], kv_connector="shared-storage"),
        backend_entry(decode, roles=["decode"], kv_connector="shared-storage"),
    ]
    return start_gateway(gateway_config(backends, disaggregation="always"), "pd")


@pytest.fixture
def client(pd_gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{pd_gateway.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def transferred_tokens(decode: VllmServer) -> float:
    return metric_total(decode.base_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)


def aggregated_greedy_text(server: VllmServer, prompt: str) -> str:
    """The whole request on one server: the reference the P/D answer must equal."""
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_pd_completion_loads_kv_from_the_prefiller(
    client: openai.OpenAI, pd_servers: list[VllmServer]
) -> None:
    prefill, decode = pd_servers
    prompt = code_prompt(12)
    before = transferred_tokens(decode)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    route = route_fields(raw.headers[ROUTE_HEADER])
    assert route == {"mode": "pd", "prefill": prefill.spec.name, "decode": decode.spec.name}
    assert transferred_tokens(decode) - before >= 128
    completion = raw.parse()
    assert completion.usage.completion_tokens == MAX_TOKENS
    assert completion.choices[0].text == aggregated_greedy_text(prefill, prompt)


def test_pd_streamed_chat_matches_aggregated_greedy_output(
    client: openai.OpenAI, pd_servers: list[VllmServer]
) -> None:
    prefill, decode = pd_servers
    messages = [{"role": "user", "content": code_prompt(12)}]
    before = transferred_tokens(decode)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert transferred_tokens(decode) - before >= 128

    reference = httpx.post(
        f"{prefill.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    )
    assert reference.status_code == 200, reference.text
    assert text == reference.json()["choices"][0]["message"]["content"]
