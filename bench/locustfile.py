"""Load-test any running OpenAI-compatible gateway (hetgate, nginx in front of vLLM, vLLM itself).

    locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 32 -r 8 -t 60s

Environment: HETGATE_MODEL (default: the first model the server lists), HETGATE_API_KEY, HETGATE_MAX_TOKENS
(default 32), HETGATE_PREFIXES (how many shared system prompts, default 8). Traffic: chat, streamed chat
(time to first chunk is reported as its own entry) and completions; prompts share long prefixes the way
real tenants' system prompts do, so prefix-aware routing has something to find.
"""

from __future__ import annotations

import os
import random
import time

import orjson
from locust import HttpUser, between, events, task

MAX_TOKENS = int(os.environ.get("HETGATE_MAX_TOKENS", "32"))
N_PREFIXES = int(os.environ.get("HETGATE_PREFIXES", "8"))
# A small vocabulary: the simulator and real tokenizers both see ~1 token per word.
_VOCABULARY = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega router cache prefill decode accelerator bandwidth compute memory"
)
WORDS = tuple(_VOCABULARY.split())


def shared_prefix(index: int, words: int = 400) -> str:
    """A deterministic ~`words`-token system prompt; the same index gives the same text in every process."""
    rng = random.Random(index)
    return f"System prompt {index}: " + " ".join(rng.choice(WORDS) for _ in range(words))


PREFIXES = [shared_prefix(i) for i in range(N_PREFIXES)]


class GatewayUser(HttpUser):
    wait_time = between(0.0, 0.2)
    model = os.environ.get("HETGATE_MODEL", "")

    def on_start(self) -> None:
        key = os.environ.get("HETGATE_API_KEY")
        self.client.headers["Content-Type"] = "application/json"
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"
        if not self.model:
            response = self.client.get("/v1/models", name="/v1/models")
            GatewayUser.model = response.json()["data"][0]["id"]

    def _messages(self) -> list[dict[str, str]]:
        question = " ".join(random.choice(WORDS) for _ in range(random.randint(5, 40)))
        return [
            {"role": "system", "content": random.choice(PREFIXES)},
            {"role": "user", "content": question},
        ]

    @task(4)
    def chat(self) -> None:
        body = {"model": self.model, "messages": self._messages(), "max_tokens": MAX_TOKENS}
        self.client.post("/v1/chat/completions", data=orjson.dumps(body), name="chat")

    @task(4)
    def streamed_chat(self) -> None:
        body = {
            "model": self.model,
            "messages": self._messages(),
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        first_chunk_ms = None
        with self.client.post(
            "/v1/chat/completions",
            data=orjson.dumps(body),
            name="chat (stream)",
            stream=True,
            catch_response=True,
        ) as response:
            for chunk in response.iter_content(chunk_size=None):
                if first_chunk_ms is None and chunk:
                    first_chunk_ms = (time.perf_counter() - started) * 1000
                if b'"error"' in chunk:
                    response.failure("in-band stream error")
        if first_chunk_ms is not None:
            events.request.fire(
                request_type="TTFT", name="chat (stream)", response_time=first_chunk_ms, response_length=0,
                exception=None, context={},
            )  # fmt: skip

    @task(2)
    def completion(self) -> None:
        prompt = random.choice(PREFIXES) + "\nContinue:"
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS}
        self.client.post("/v1/completions", data=orjson.dumps(body), name="completions")
