"""Admission control against a real gateway (issue 9 item 8): overload sheds with 429 + Retry-After.

Each backend request is slow (a simulated engine at 50 ms per output token), so requests sent together
are in flight together and the limits decide deterministically who is served.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.harness import GatewayProcess
from bench.sim.server import SimServerConfig, SimThread, start_in_thread
from bench.sim.simple_engine import SimpleEngineConfig
from tests.integration.conftest import MODEL, backend, chat_body, config, metric

SLOW = SimpleEngineConfig(ttft_base_s=0.01, prefill_token_s=0.00001, tpot_s=0.05)
LONG = 40  # output tokens: 2 s of decoding, long enough for the whole burst to arrive meanwhile
KEYS = ("sk-admission-a-4f1c", "sk-admission-b-9e27")


@pytest.fixture(scope="module")
def sim_backend() -> Iterator[SimThread]:
    server = start_in_thread(SimServerConfig(model=MODEL), simple_engine=SLOW)
    yield server
    server.stop()


def start(sim: SimThread, admission: dict[str, Any], **sections: Any) -> GatewayProcess:
    return GatewayProcess(config([backend(sim, "a")], admission=admission, **sections))


async def burst(url: str, requests: list[dict[str, str]], max_tokens: int = LONG) -> list[httpx.Response]:
    """Send one request per header set, all at once; their responses in order."""
    async with httpx.AsyncClient(timeout=30) as client:
        return await asyncio.gather(
            *(
                client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=max_tokens), headers=h)
                for h in requests
            )
        )


def assert_rate_limited(reply: httpx.Response) -> int:
    assert reply.status_code == 429, reply.text
    error = orjson.loads(reply.content)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_exceeded" and error["code"] == 429
    retry_after = int(reply.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def statuses(replies: list[httpx.Response]) -> Counter[int]:
    return Counter(r.status_code for r in replies)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_per_key_concurrency(sim_backend: SimThread) -> None:
    admission = {"per_key": {"max_concurrent": 2}}
    with start(sim_backend, admission, auth={"api_keys": list(KEYS)}) as gateway:
        replies = asyncio.run(burst(gateway.url, [bearer(KEYS[0])] * 5 + [bearer(KEYS[1])]))
        assert statuses(replies[:5]) == {200: 2, 429: 3}
        assert replies[5].status_code == 200  # another key has its own limit
        for reply in replies[:5]:
            if reply.status_code == 429:
                assert_rate_limited(reply)
        after = asyncio.run(burst(gateway.url, [bearer(KEYS[0])], max_tokens=4))
        assert after[0].status_code == 200  # the places came back
        page = httpx.get(f"{gateway.url}/metrics", headers=bearer(KEYS[1])).text
        assert metric_value(page, "hetgate:admission_rejections_total", reason="key_concurrency") == 3
        for secret in KEYS:
            assert secret not in page and secret not in gateway.log()


def metric_value(page: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in page.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def test_per_tenant_token_rate(sim_backend: SimThread) -> None:
    admission = {"tenant_header": "x-tenant-id", "per_tenant": {"tokens_per_s": 20, "burst_tokens": 120}}
    with start(sim_backend, admission) as gateway:
        tenant = {"x-tenant-id": "team-a"}
        # chat_body's prompt is ~11 estimated tokens: 11 + 40 = 51 a request, two fit in 120
        replies = asyncio.run(burst(gateway.url, [tenant] * 3))
        assert statuses(replies) == {200: 2, 429: 1}
        limited = next(r for r in replies if r.status_code == 429)
        assert assert_rate_limited(limited) >= 1
        other = asyncio.run(burst(gateway.url, [{"x-tenant-id": "team-b"}]))
        assert other[0].status_code == 200
        assert metric(gateway.url, "hetgate:admission_rejections_total", reason="tenant_tokens") == 1
        deadline = time.monotonic() + 30
        while asyncio.run(burst(gateway.url, [tenant], max_tokens=4))[0].status_code == 429:
            assert time.monotonic() < deadline, "the bucket never refilled"
            time.sleep(0.2)


def test_global_queue_bound(sim_backend: SimThread) -> None:
    admission = {"max_concurrent": 2, "max_queued": 2, "queue_timeout_s": 30}
    with start(sim_backend, admission) as gateway:
        replies = asyncio.run(burst(gateway.url, [{}] * 6))
        assert statuses(replies) == {200: 4, 429: 2}  # 2 served at once, 2 waited, 2 refused at once
        for reply in replies:
            if reply.status_code == 429:
                assert_rate_limited(reply)
        assert metric(gateway.url, "hetgate:admission_rejections_total", reason="queue_full") == 2
        assert metric(gateway.url, "hetgate:admission_active") == 0
        assert metric(gateway.url, "hetgate:admission_queued") == 0


def test_queue_timeout_and_disconnect_while_queued(sim_backend: SimThread) -> None:
    admission = {"max_concurrent": 1, "max_queued": 5, "queue_timeout_s": 0.5}
    with start(sim_backend, admission) as gateway:
        replies = asyncio.run(burst(gateway.url, [{}] * 3))
        assert statuses(replies) == {200: 1, 429: 2}
        assert metric(gateway.url, "hetgate:admission_rejections_total", reason="queue_timeout") == 2

        async def leave_while_queued() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                held = asyncio.create_task(
                    client.post(f"{gateway.url}/v1/chat/completions", json=chat_body(max_tokens=LONG))
                )
                deadline = time.monotonic() + 10
                while not await asyncio.to_thread(metric, gateway.url, "hetgate:admission_active"):
                    assert time.monotonic() < deadline, "the first request never took the slot"
                    await asyncio.sleep(0.02)
                with pytest.raises(httpx.TimeoutException):
                    await client.post(
                        f"{gateway.url}/v1/chat/completions", json=chat_body(), timeout=0.2
                    )  # queued, then the client gives up
                assert (await held).status_code == 200

        asyncio.run(leave_while_queued())
        deadline = time.monotonic() + 10
        while metric(gateway.url, "hetgate:admission_queued") or metric(
            gateway.url, "hetgate:admission_active"
        ):
            assert time.monotonic() < deadline, "a place was not given back"
            time.sleep(0.05)
        after = asyncio.run(burst(gateway.url, [{}], max_tokens=4))
        assert after[0].status_code == 200
