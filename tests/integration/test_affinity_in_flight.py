"""The approximate prefix index learns a prompt's backend when that backend answers, not when its reply
ends: a conversation's next turn, or a request sharing the prompt, that arrives while the first one still
streams follows it (SGLang's cache_aware inserts at the routing decision; the EPP records at the response
headers)."""

from __future__ import annotations

import httpx

from bench.sim.simple_engine import SimpleEngineConfig
from tests.integration.conftest import backend, chat_body, config

# Slow enough that a 60-token reply streams for over a second on a busy machine.
SLOW_DECODE = SimpleEngineConfig(ttft_base_s=0.002, prefill_token_s=0.00001, tpot_s=0.03)


def backend_of(route_header: str) -> str:
    return route_header.rsplit("backend=", 1)[1]


def test_a_request_sharing_a_prompt_still_streaming_follows_it(sim, gateway) -> None:
    sims = [sim(simple_engine=SLOW_DECODE) for _ in range(2)]
    gw = gateway(config([backend(s, f"b{i}") for i, s in enumerate(sims)], routing={"policy": "prefix"}))
    for k in range(3):
        history = f"conversation {k}: " + " ".join(f"w{k}x{j}" for j in range(400))
        first = chat_body(history, max_tokens=60, stream=True, ignore_eos=True)
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=first, timeout=30) as streaming:
            assert streaming.status_code == 200
            held_by = backend_of(streaming.headers["x-hetgate-route"])
            chunks = streaming.iter_lines()
            next(line for line in chunks if line.startswith("data: {"))  # the first token is out
            # The next turn: the same history and one more message, sent while the first still streams.
            # Without the record the least-loaded backend (the other one) would take it.
            turn = chat_body(history, max_tokens=2)
            turn["messages"] += [{"role": "assistant", "content": "yes"}, {"role": "user", "content": "and?"}]
            reply = httpx.post(f"{gw.url}/v1/chat/completions", json=turn, timeout=30)
            assert reply.status_code == 200
            assert backend_of(reply.headers["x-hetgate-route"]) == held_by, f"turn {k}"
            rest = [line for line in chunks if line.startswith("data: ")]
            # The first was still streaming when the turn was routed: most of its tokens came after.
            assert len(rest) > 20 and rest[-1] == "data: [DONE]"
