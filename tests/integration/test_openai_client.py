"""The official `openai` client against hetgate in front of simulated vLLM backends."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.conftest import MODEL, backend, chat_body, config, metric


@pytest.fixture
def pair(sim, gateway):
    a, b = sim(), sim()
    gw = gateway(config([backend(a, "a"), backend(b, "b")]))
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    yield gw, client, (a, b)
    client.close()


def test_chat_completion(pair):
    _gw, client, _ = pair
    response = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something short."}], max_tokens=5
    )
    completion = response.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage.completion_tokens == 5
    assert response.headers["x-hetgate-route"] in ("mode=aggregated; backend=a", "mode=aggregated; backend=b")


def test_streamed_chat_with_usage(pair):
    _, client, _ = pair
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_and_models(pair):
    _, client, _ = pair
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert completion.object == "text_completion"
    assert completion.usage.completion_tokens == 4
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_unknown_model_is_a_404_before_any_backend(pair):
    _gw, client, (a, b) = pair
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["type"] == "NotFoundError"
    assert metric(a.url, "vllm:prompt_tokens_total") + metric(b.url, "vllm:prompt_tokens_total") == 0


def test_round_robin_spreads_and_unknown_fields_are_accepted(pair):
    # That they reach the backend unchanged is checked on the wire in tests/faults/test_internal_fields.py.
    gw, _, (_a, _b) = pair
    routes = set()
    for _ in range(4):
        r = httpx.post(
            f"{gw.url}/v1/chat/completions", json=chat_body(vendor_field={"x": 1}, seed=3), timeout=10
        )
        assert r.status_code == 200
        routes.add(r.headers["x-hetgate-route"])
    assert routes == {"mode=aggregated; backend=a", "mode=aggregated; backend=b"}


def test_gateway_metrics_count_requests_without_prompt_text(pair):
    gw, client, _ = pair
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "secret-prompt-123"}], max_tokens=3
    )
    page = httpx.get(f"{gw.url}/metrics").text
    assert metric(gw.url, "hetgate:requests_total", model=MODEL, status="200") == 1
    assert "secret-prompt-123" not in page
    assert httpx.get(f"{gw.url}/ready").status_code == 200
