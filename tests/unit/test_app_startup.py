"""A gateway whose start-up fails closes what it had opened (the upstream HTTP session) before the error
reaches uvicorn: no leaked sockets, no "Unclosed client session" at exit."""

from __future__ import annotations

import socket
from typing import ClassVar

import pytest
import zmq

from gateway import app as app_module
from gateway.config import parse_config
from gateway.upstream import Upstream


class RecordedUpstream(Upstream):
    """The real Upstream, remembered so the test can look at its session afterwards."""

    made: ClassVar[list[Upstream]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        RecordedUpstream.made.append(self)


async def test_a_failed_start_closes_the_upstream_session(monkeypatch):
    monkeypatch.setattr(app_module, "Upstream", RecordedUpstream)
    RecordedUpstream.made.clear()
    with socket.socket() as busy:  # a concrete KV-events address is bound by the gateway: make it taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        config = parse_config(
            {
                "models": [{"name": "m"}],
                "backends": [
                    {"id": "a", "url": "http://127.0.0.1:9", "model": "m", "accelerator": "cpu",
                     "kv_events": {"endpoint": endpoint}},
                ],
            }
        )  # fmt: skip
        app = app_module.create_app(config)
        with pytest.raises(zmq.ZMQError):
            async with app.router.lifespan_context(app):
                pass
    [upstream] = RecordedUpstream.made
    assert upstream.session.closed
