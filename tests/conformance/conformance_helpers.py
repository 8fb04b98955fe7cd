"""Shared pieces of the vLLM conformance suite (see conftest.py for how a target is chosen)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class ConformanceTarget:
    base_url: str
    model: str
    block_size: int = 16
    # Started with --enable-prompt-tokens-details (usage.prompt_tokens_details is filled).
    prompt_tokens_details: bool = True
    # A prefiller (NIXL-style kv_transfer_config) and a decoder for the P/D checks; None skips them.
    prefill_url: str | None = None
    decode_url: str | None = None
    # Where the suite's SUB socket binds: the server's --kv-events-config endpoint (a concrete address,
    # so the server connects to it). None skips the KV event checks.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_replay_endpoint: str | None = None
    # Checks of simulator-only extensions (the P/D pull notification, /sim/faults) run only here.
    simulator: bool = False


def words(n: int, seed: str = "w") -> str:
    """A prompt of about n tokens (one per word on the simulator; more on a BPE tokenizer)."""
    return " ".join(f"{seed}{i}" for i in range(n))


def token_prompt(client: httpx.Client, target: ConformanceTarget, n: int, seed: str = "t") -> list[int]:
    """Exactly n prompt token ids, whatever the tokenizer (a word is one token or more)."""
    response = client.post("/tokenize", json={"model": target.model, "prompt": words(n, seed)})
    tokens = response.json()["tokens"]
    assert len(tokens) >= n
    return tokens[:n]


def sse_events(response: httpx.Response) -> list[bytes]:
    """The payloads of an SSE body, checking vLLM's framing: `data: <payload>\\n\\n`, nothing else."""
    body = response.read()
    assert body.endswith(b"\n\n"), "every SSE event ends with a blank line"
    frames = body[:-2].split(b"\n\n")
    for frame in frames:
        assert frame.startswith(b"data: "), f"unexpected SSE frame {frame[:40]!r}"
    return [frame[len(b"data: ") :] for frame in frames]


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of a stream, checking it ends with exactly one `data: [DONE]`."""
    payloads = sse_events(response)
    assert payloads[-1] == b"[DONE]"
    assert b"[DONE]" not in payloads[:-1]
    return [orjson.loads(payload) for payload in payloads[:-1]]


def metric_samples(client: httpx.Client) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of /metrics by sample name (counters keep their `_total`)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def metric_value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    matching = [value for found, value in samples.get(name, []) if labels.items() <= found.items()]
    assert len(matching) == 1, f"{name}{labels}: {len(matching)} samples"
    return matching[0]


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a response, after checking its status and shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert error["code"] == status and isinstance(error["message"], str)
    return error
