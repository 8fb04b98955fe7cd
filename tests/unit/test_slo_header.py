"""The per-request SLO headers: milliseconds in, seconds out, bad values refused with a 400; and the
session header, which marks a request as a turn of a conversation."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, GatewayConfig, parse_config
from gateway.decision import NO_SLO_OVERRIDE, SESSION_HEADER, Decider, session_header, with_hints
from gateway.errors import BadRequest
from gateway.handler import _slo_override
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from scoring.types import RequestFeatures


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, (None, None)),
        ({b"x-hetgate-slo-ttft-ms": b"2500"}, (2.5, None)),
        ({b"x-hetgate-slo-tpot-ms": b"40"}, (None, 0.04)),
        ({b"x-hetgate-slo-ttft-ms": b"100", b"x-hetgate-slo-tpot-ms": b"12.5"}, (0.1, 0.0125)),
    ],
)
def test_slo_headers_are_read_in_seconds(headers, expected) -> None:
    got = _slo_override(headers)
    assert [g is None for g in got] == [e is None for e in expected]
    assert [g for g in got if g is not None] == pytest.approx([e for e in expected if e is not None])


@pytest.mark.parametrize("value", [b"0", b"-5", b"fast", b"nan", b"inf", b""])
def test_bad_slo_headers_are_a_400(value) -> None:
    with pytest.raises(BadRequest) as raised:
        _slo_override({b"x-hetgate-slo-ttft-ms": value})
    assert raised.value.status == 400 and raised.value.param == "x-hetgate-slo-ttft-ms"


def test_the_session_header_marks_a_turn_of_a_conversation() -> None:
    plain = RequestFeatures("m", 100, 10)
    assert with_hints(plain, {}, NO_SLO_OVERRIDE) is plain
    assert not plain.in_conversation
    named = with_hints(plain, {SESSION_HEADER: b"chat-7"}, NO_SLO_OVERRIDE)
    assert named.in_conversation and named.slo_ttft_s is None
    both = with_hints(plain, {SESSION_HEADER: b"chat-7"}, (2.5, None))
    assert both.in_conversation and both.slo_ttft_s == 2.5
    assert not with_hints(plain, {}, (2.5, None)).in_conversation


_MODEL = {"name": "m", "spec": "deepseek-r1"}
_BACKEND = {"id": "a", "url": "http://127.0.0.1:8101", "model": "m", "accelerator": "h100"}


def _registry() -> Registry:
    return Registry(parse_config({"models": [_MODEL], "backends": [_BACKEND]}))


def test_the_session_header_is_configurable_and_can_be_switched_off() -> None:
    plain = RequestFeatures("m", 100, 10)

    def config(routing: dict) -> GatewayConfig:
        return parse_config({"models": [_MODEL], "backends": [_BACKEND], "routing": routing})

    def named(routing: dict, headers: dict[bytes, bytes]) -> bool:
        return with_hints(plain, headers, NO_SLO_OVERRIDE, session_header(config(routing))).in_conversation

    assert named({}, {b"x-session-id": b"c"})
    assert named({"session_header": "X-Conversation"}, {b"x-conversation": b"c"})
    assert not named({"session_header": "X-Conversation"}, {b"x-session-id": b"c"})
    assert not named({"session_header": None}, {b"x-session-id": b"c"})
    with pytest.raises(ConfigError, match="not a header name"):
        config({"session_header": "x session"})

    # The gateway reads the configured name, and a reloaded configuration's (gateway/live.py).
    decider = Decider(config({"session_header": "X-Conversation"}), _registry(), GatewayMetrics(), None)
    assert decider.session_header == b"x-conversation"
    decider.reconfigure(config({"session_header": None, "policy": "cost"}))
    assert decider.session_header is None and decider.routers["m"].replans
