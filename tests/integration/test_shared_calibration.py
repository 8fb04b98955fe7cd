"""Gateway replicas share what the cost policy learnt through Redis (gateway/replicas.py): a replica
that has measured nothing takes the others' corrections, replicas agree within a few exchanges, and a
replica that stops publishing is forgotten after the share's TTL. Real redis-server, real routers."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
import redis

from gateway.config import GatewayConfig
from gateway.registry import Registry
from gateway.replicas import SharedLoad
from kvindex.replica_share import ReplicaShare
from scoring.catalog import load_catalog
from scoring.router import build_router
from scoring.types import Mode, Outcome, Prediction, Router
from tests.redis_server import redis_server

__all__ = ["redis_server"]

MODEL = "deepseek-r1"
BACKEND = "mi300x-0"
PREFIX = "calibration-test"


@pytest.fixture(autouse=True)
def empty_redis(redis_server):
    """Each test starts with nothing shared: the server is the session's."""
    client = redis.Redis.from_url(redis_server.url)
    for key in client.scan_iter(match="{" + PREFIX + "}*"):
        client.delete(key)
    client.close()


def registry() -> Registry:
    row = {"id": BACKEND, "url": "http://127.0.0.1:9", "model": MODEL, "accelerator": "mi300x", "gpus": 8}
    config = GatewayConfig.model_validate({"models": [{"name": MODEL, "spec": MODEL}], "backends": [row]})
    return Registry(config)


def learn_slowness(router: Router, truth: float, rounds: int = 200) -> None:
    """Outcomes of a backend whose prefill takes `truth` times what the roofline says."""
    for _ in range(rounds):
        k = router.correction(BACKEND)
        pred = Prediction(compute_s=k * 0.1, ttft_s=k * 0.1, tpot_s=0.01, roofline_compute_s=0.1)
        outcome = Outcome(
            BACKEND, Mode.AGGREGATED, 8000, 0, 64, truth * 0.1, 1.0, predicted=pred, tpot_s=0.02
        )
        router.observe(outcome)


def replica(
    stack: contextlib.AsyncExitStack, url: str, name: str, router: Router, ttl_s: float = 5.0
) -> SharedLoad:
    share = ReplicaShare.from_url(url, PREFIX, name, ttl_s)
    stack.push_async_callback(share.close)
    return SharedLoad(registry(), share, 0.2, ttl_s, lambda: {MODEL: router})


def reader(stack: contextlib.AsyncExitStack, url: str, ttl_s: float = 5.0) -> ReplicaShare:
    """A replica that publishes nothing: it reads what the others share."""
    share = ReplicaShare.from_url(url, PREFIX, "reader", ttl_s)
    stack.push_async_callback(share.close)
    return share.for_kind(f"calibration:{MODEL}")


async def exchange(replicas: list[SharedLoad], rounds: int) -> None:
    for _ in range(rounds):
        for r in replicas:
            await r.share_calibration()


def test_replicas_agree_on_what_one_of_them_learnt(redis_server):
    model = load_catalog().model(MODEL)
    learnt, fresh = build_router("cost", model=model), build_router("cost", model=model)
    learn_slowness(learnt, 4.0)
    assert learnt.correction(BACKEND) == pytest.approx(4.0, rel=0.02)
    assert learnt.tpot_correction(BACKEND) == pytest.approx(2.0, rel=0.05)
    assert fresh.correction(BACKEND) == 1.0

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await agree(stack)

    async def agree(stack: contextlib.AsyncExitStack) -> None:
        a, b = replica(stack, redis_server.url, "a", learnt), replica(stack, redis_server.url, "b", fresh)
        await exchange([a, b], 1)
        # b took half of a's (log) correction at once, for compute and TPOT alike.
        assert fresh.correction(BACKEND) == pytest.approx(2.0, rel=0.05)
        assert fresh.tpot_correction(BACKEND) == pytest.approx(math.sqrt(2.0), rel=0.05)
        await exchange([a, b], 6)
        agreed = fresh.correction(BACKEND)
        assert learnt.correction(BACKEND) == pytest.approx(agreed, rel=0.05)
        assert 1.5 < agreed < 4.0

    asyncio.run(scenario())


def test_a_silent_replica_is_forgotten_after_the_ttl(redis_server):
    model = load_catalog().model(MODEL)
    learnt = build_router("cost", model=model)
    learn_slowness(learnt, 4.0)

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await forget(stack)

    async def forget(stack: contextlib.AsyncExitStack) -> None:
        a = replica(stack, redis_server.url, "a", learnt, ttl_s=0.3)
        await a.share_calibration()
        share = reader(stack, redis_server.url, 0.3)
        assert (await share.exchange_values({}))[f"compute/{BACKEND}"] == [pytest.approx(4.0, rel=0.02)]
        deadline = asyncio.get_running_loop().time() + 5.0
        while await share.exchange_values({}):  # a publishes nothing more: its hash expires in Redis
            assert asyncio.get_running_loop().time() < deadline, "a silent replica's values never expired"
            await asyncio.sleep(0.05)

    asyncio.run(scenario())


def test_policies_that_learn_nothing_share_nothing(redis_server):
    router = build_router("least_load")

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await replica(stack, redis_server.url, "a", router).share_calibration()
            assert await reader(stack, redis_server.url).exchange_values({}) == {}

    asyncio.run(scenario())
