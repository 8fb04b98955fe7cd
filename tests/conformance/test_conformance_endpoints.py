"""Small endpoints: health, models, version, load, tokenize/detokenize, unknown paths."""

from __future__ import annotations

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


def test_load_counts_in_flight_requests(client: httpx.Client) -> None:
    load = client.get("/load").json()
    assert set(load) == {"server_load"} and load["server_load"] >= 0


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
