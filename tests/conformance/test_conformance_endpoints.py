"""Small endpoints: health, models, version, load, tokenize/detokenize, unknown paths."""

from __future__ import annotations

import time

import httpx
from conformance_helpers import ConformanceTarget, words


def test_health_is_200_with_an_empty_body(client: httpx.Client) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    assert response.content == b""


def test_models_lists_the_served_model(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    card = next(card for card in body["data"] if card["id"] == conformance_target.model)
    assert card["object"] == "model" and card["owned_by"] == "vllm"
    assert isinstance(card["created"], int) and isinstance(card["max_model_len"], int)
    assert {"root", "parent", "permission"} <= set(card)


def test_version(client: httpx.Client) -> None:
    version = client.get("/version").json()["version"]
    assert isinstance(version, str) and version[0].isdigit()


def server_load(client: httpx.Client) -> int:
    load = client.get("/load").json()
    assert set(load) == {"server_load"}
    return load["server_load"]


def load_becomes(client: httpx.Client, expected: int, timeout_s: float = 10.0) -> bool:
    """Poll /load: a finished or aborted request leaves the count a moment after its last byte."""
    deadline = time.monotonic() + timeout_s
    while server_load(client) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def load_while_streaming(client: httpx.Client, request: dict[str, object]) -> int:
    """/load as read after the first event of a held stream; the stream is closed on return, so the
    server aborts the request if it is still running."""
    with client.stream("POST", "/v1/completions", json=request) as held:
        assert held.status_code == 200
        events = held.iter_raw()  # kept: a dropped iterator would close the stream
        next(events)  # the first event: the request is running
        return server_load(client)


def test_load_counts_in_flight_requests(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    # Real vLLM counts only with --enable-server-load-tracking (bench/vllm_server.py starts it so).
    assert load_becomes(client, 0)
    max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    request = {
        "model": conformance_target.model,
        "prompt": words(4),
        "max_tokens": min(1000, max_model_len - 32),
        "ignore_eos": True,
        "stream": True,
    }
    # The tiny CPU model streams 1,000 tokens in about 2 s, into socket buffers that hold them all, so
    # a host busy enough to delay the /load read past the stream's end reads 0 (one CI run of stop 40).
    # A server that does not count reads 0 every time; one that does must be seen counting once in three.
    loads = []
    for _ in range(3):
        loads.append(load_while_streaming(client, request))
        # Leaving the stream closed it: the server aborts the request and stops counting it.
        assert load_becomes(client, 0)
        if loads[-1] == 1:
            break
    assert loads[-1] == 1, loads
    assert set(loads) <= {0, 1}, loads


def test_unknown_path_is_fastapis_404(client: httpx.Client) -> None:
    response = client.get("/v1/no-such-endpoint")
    assert response.status_code == 404
    assert response.json() == {"detail": "Not Found"}


def test_tokenize_a_prompt(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    body = client.post("/tokenize", json={"model": conformance_target.model, "prompt": words(20)}).json()
    assert {"count", "max_model_len", "tokens", "token_strs"} <= set(body)
    assert body["count"] == len(body["tokens"]) >= 20
    assert all(isinstance(token, int) for token in body["tokens"])
    assert isinstance(body["max_model_len"], int)


def test_tokenize_messages_applies_the_chat_template(
    client: httpx.Client, conformance_target: ConformanceTarget
) -> None:
    messages = [{"role": "user", "content": words(10)}]
    plain = client.post("/tokenize", json={"model": conformance_target.model, "prompt": words(10)}).json()
    chat = client.post(
        "/tokenize",
        json={"model": conformance_target.model, "messages": messages, "add_generation_prompt": True},
    ).json()
    assert chat["count"] > plain["count"]


def test_detokenize_inverts_tokenize(client: httpx.Client, conformance_target: ConformanceTarget) -> None:
    # Without special tokens: a BOS would be detokenized into the text and then added again.
    request = {"model": conformance_target.model, "prompt": words(12), "add_special_tokens": False}
    tokens = client.post("/tokenize", json=request).json()["tokens"]
    prompt = client.post("/detokenize", json={"model": conformance_target.model, "tokens": tokens}).json()
    assert set(prompt) == {"prompt"}
    again = client.post("/tokenize", json={**request, "prompt": prompt["prompt"]})
    assert again.json()["tokens"] == tokens
