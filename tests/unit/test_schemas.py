"""The fields the gateway reads: valid bodies pass untouched, invalid ones get vLLM-like 400s."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.schemas import Kind, parse_body


def chat(**fields) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_valid_chat_keeps_unknown_fields():
    request = parse_body(chat(stream=True, stream_options={"include_usage": True}, vendor_x=[1]), Kind.CHAT)
    assert request.stream is True
    assert request.body["vendor_x"] == [1]


@pytest.mark.parametrize(
    ("raw", "kind", "param"),
    [
        (b"{not json", Kind.CHAT, None),
        (b"[1, 2]", Kind.CHAT, None),
        (orjson.dumps({"messages": [{"role": "user"}]}), Kind.CHAT, "model"),
        (orjson.dumps({"model": "m", "messages": []}), Kind.CHAT, "messages"),
        (orjson.dumps({"model": "m", "messages": ["hi"]}), Kind.CHAT, "messages"),
        (chat(max_tokens=0), Kind.CHAT, "max_tokens"),
        (chat(max_tokens="8"), Kind.CHAT, "max_tokens"),
        (chat(max_tokens=True), Kind.CHAT, "max_tokens"),
        (chat(n=1000), Kind.CHAT, "n"),
        (chat(stream="yes"), Kind.CHAT, "stream"),
        (chat(stream_options={"include_usage": True}), Kind.CHAT, "stream_options"),
        (chat(temperature="hot"), Kind.CHAT, "temperature"),
        (orjson.dumps({"model": "m", "prompt": 3}), Kind.COMPLETIONS, "prompt"),
        (orjson.dumps({"model": "m", "prompt": []}), Kind.COMPLETIONS, "prompt"),
        (orjson.dumps({"model": "m", "prompt": ["a", 1]}), Kind.COMPLETIONS, "prompt"),
    ],
)
def test_invalid_bodies_are_refused_with_the_param(raw, kind, param):
    with pytest.raises(BadRequest) as error:
        parse_body(raw, kind)
    assert error.value.param == param
    assert orjson.loads(error.value.body())["error"]["code"] == 400


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_shapes(prompt):
    assert parse_body(orjson.dumps({"model": "m", "prompt": prompt}), Kind.COMPLETIONS).model == "m"
