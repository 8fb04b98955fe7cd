"""Legs reach a backend in the order the gateway opened them (gateway/upstream.py `SendOrder`).

A real aiohttp server on loopback records the order in which whole request bodies arrive. The first
leg needs a new connection (to `localhost`, resolved in a thread first); the second, opened after it,
finds a pooled connection to `127.0.0.1` of the same backend and could write at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from gateway.config import BackendConfig, Timeouts
from gateway.registry import BackendState
from gateway.upstream import LegFailed, SendOrder, Upstream

PATH = "/v1/completions"


class OrderServer:
    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.content_types: set[str] = set()

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrived.append(request.headers["X-Request-Id"])
        self.content_types.add(request.content_type)
        return web.json_response({"ok": True})


@pytest.fixture
async def server() -> AsyncIterator[tuple[OrderServer, int]]:
    recorder = OrderServer()
    app = web.Application()
    app.router.add_post(PATH, recorder.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield recorder, port
    await runner.cleanup()


def backend(host: str, port: int) -> BackendState:
    # Two URLs of one backend (one id): one pool of connections each, one order of legs.
    return BackendState(BackendConfig(id="b", url=f"http://{host}:{port}", model="m", accelerator="mi300x"))


async def send(upstream: Upstream, target: BackendState, request_id: str, body: bytes) -> None:
    leg = await upstream.open(target, PATH, body, request_id)
    await upstream.read(leg)


async def test_a_leg_on_a_new_connection_is_not_overtaken_by_one_opened_after_it(server):
    recorder, port = server
    pooled, fresh = backend("127.0.0.1", port), backend("localhost", port)
    upstream = Upstream(Timeouts(), frozenset())
    try:
        await send(upstream, pooled, "warm", b"{}")  # leaves one connection in the pool
        body = orjson.dumps({"prompt": list(range(20_000))})  # more than one write of a socket
        first = asyncio.create_task(send(upstream, fresh, "first", body))
        second = asyncio.create_task(send(upstream, pooled, "second", body))
        await asyncio.gather(first, second)
    finally:
        await upstream.close()
    assert recorder.arrived == ["warm", "first", "second"]
    assert recorder.content_types == {"application/json"}


async def test_a_leg_that_cannot_connect_does_not_hold_up_the_next(server):
    recorder, port = server
    upstream = Upstream(Timeouts(connect_s=1.0), frozenset())
    dead = BackendState(BackendConfig(id="b", url="http://127.0.0.1:9", model="m", accelerator="mi300x"))
    try:
        failing = asyncio.create_task(upstream.open(dead, PATH, b"{}", "lost"))
        second = asyncio.create_task(send(upstream, backend("127.0.0.1", port), "next", b"{}"))
        with pytest.raises(LegFailed):
            await failing
        await asyncio.wait_for(second, 5.0)
    finally:
        await upstream.close()
    assert recorder.arrived == ["next"]
    assert len(upstream.order) == 0  # no turn is left behind


async def test_a_leg_that_gives_up_waiting_keeps_the_next_behind_the_one_it_waited_for():
    order = SendOrder()
    none_ahead, first = order.take("b")
    ahead, second = order.take("b")
    assert none_ahead is None and ahead is first
    behind_second, third = order.take("b")
    order.end("b", second, ahead)  # the second is cancelled while the first still connects
    await asyncio.sleep(0)
    assert not second.done()  # so the third still waits
    order.end("b", first)
    order.end("b", first)  # idempotent
    await asyncio.sleep(0)
    assert first.done() and second.done() and behind_second is second
    assert len(order) == 1  # the third's own turn, until it has written
    order.end("b", third)
    assert len(order) == 0
