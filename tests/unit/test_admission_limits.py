"""Admission control (gateway/admission.py) with an injected clock: limits, buckets, the global queue."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.admission import OPEN_TICKET, Admission, Ticket
from gateway.config import AdmissionConfig
from gateway.errors import RateLimited
from gateway.schemas import Kind, parse_body


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(max_tokens: int | None = 100, prompt: str = "x" * 400) -> Any:
    body: dict[str, Any] = {"model": "m", "prompt": prompt}  # 400 characters: 100 estimated tokens
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_body(orjson.dumps(body), Kind.COMPLETIONS)


def key(name: str, tenant: str | None = None) -> dict[bytes, bytes]:
    headers = {b"authorization": f"Bearer {name}".encode()}
    if tenant is not None:
        headers[b"x-tenant"] = tenant.encode()
    return headers


class Harness:
    def __init__(self, **config: Any) -> None:
        self.clock = Clock()
        self.rejections: list[str] = []
        self.admission = Admission(AdmissionConfig(**config), self.rejections.append, self.clock)

    async def admit(self, headers: dict[bytes, bytes], req: Any = None) -> Ticket:
        return await self.admission.admit(headers, req if req is not None else request())

    async def reject(self, headers: dict[bytes, bytes], req: Any = None) -> RateLimited:
        with pytest.raises(RateLimited) as caught:
            await self.admit(headers, req)
        error = caught.value
        assert error.status == 429
        body = orjson.loads(error.body())["error"]
        assert body["type"] == "rate_limit_exceeded" and body["code"] == 429
        assert self.rejections[-1] == error.reason
        return error


def retry_after(error: RateLimited) -> int:
    return int(dict(error.headers)[b"retry-after"])


async def test_no_limits_hands_out_the_open_ticket() -> None:
    h = Harness()
    assert not h.admission.enabled
    assert await h.admit(key("a")) is OPEN_TICKET


async def test_per_key_concurrency() -> None:
    h = Harness(per_key={"max_concurrent": 2})
    first, _ = await h.admit(key("a")), await h.admit(key("a"))
    error = await h.reject(key("a"))
    assert error.reason == "key_concurrency" and retry_after(error) == 1
    await h.admit(key("b"))  # another key has its own limit
    first.release()
    first.release()  # idempotent: frees one place, not two
    await h.admit(key("a"))
    await h.reject(key("a"))


async def test_token_bucket_refills_with_the_clock_and_says_when() -> None:
    h = Harness(per_key={"tokens_per_s": 100, "burst_tokens": 400})
    for _ in range(2):
        (await h.admit(key("a"))).release()  # 100 prompt + 100 max_tokens each: the bucket is empty
    error = await h.reject(key("a"))
    assert error.reason == "key_tokens" and retry_after(error) == 2  # 200 tokens at 100/s
    h.clock.now += 1.0
    await h.reject(key("a"))  # 100 of 200 refilled
    h.clock.now += 1.0
    await h.admit(key("a"))


async def test_unset_max_tokens_is_charged_the_default() -> None:
    h = Harness(per_key={"tokens_per_s": 1, "burst_tokens": 2000}, default_max_tokens=950)
    (await h.admit(key("a"), request(max_tokens=None))).release()  # 100 + 950: 950 left
    error = await h.reject(key("a"), request(max_tokens=900))  # 100 + 900 > 950
    assert error.reason == "key_tokens"
    await h.admit(key("a"), request(max_tokens=850))


async def test_request_bigger_than_the_bucket_needs_a_full_bucket() -> None:
    h = Harness(per_key={"tokens_per_s": 10, "burst_tokens": 50})
    (await h.admit(key("a"), request(max_tokens=5000))).release()  # full bucket: admitted, now in debt
    error = await h.reject(key("a"))
    assert retry_after(error) > 5  # the debt is paid back before the next one


async def test_tenant_limits_apply_to_the_header_value() -> None:
    h = Harness(tenant_header="X-Tenant", per_tenant={"max_concurrent": 1})
    await h.admit(key("a", "t1"))
    error = await h.reject(key("b", "t1"))  # another key, same tenant
    assert error.reason == "tenant_concurrency"
    await h.admit(key("a", "t2"))
    await h.admit(key("a"))  # no header: the anonymous tenant


async def test_a_rejection_charges_nothing() -> None:
    h = Harness(
        tenant_header="x-tenant",
        per_key={"tokens_per_s": 1, "burst_tokens": 200},
        per_tenant={"max_concurrent": 1},
    )
    held = await h.admit(key("a", "t"), request(max_tokens=None, prompt="x" * 40))  # 10 + 1024
    held.release()
    h.clock.now += 2000  # the debt is paid back and the bucket full again
    held = await h.admit(key("b", "t"))
    await h.reject(key("a", "t"))  # tenant full: key a's bucket must stay untouched
    held.release()
    await h.admit(key("a", "t"))  # 200 tokens: exactly the full bucket


async def test_global_queue_is_fifo_bounded_and_timed() -> None:
    h = Harness(max_concurrent=1, max_queued=2, queue_timeout_s=5)
    first = await h.admit(key("a"))
    second = asyncio.create_task(h.admit(key("b")))
    third = asyncio.create_task(h.admit(key("c")))
    while h.admission.queued < 2:
        await asyncio.sleep(0)
    error = await h.reject(key("d"))
    assert error.reason == "queue_full"
    first.release()
    ticket = await second  # the longest waiter gets the slot
    assert not third.done() and h.admission.active == 1
    ticket.release()
    (await third).release()
    assert h.admission.active == 0 and h.admission.queued == 0


async def test_queue_timeout() -> None:
    h = Harness(max_concurrent=1, max_queued=5, queue_timeout_s=0.05)
    held = await h.admit(key("a"))
    error = await h.reject(key("b"))
    assert error.reason == "queue_timeout"
    assert h.admission.queued == 0
    held.release()
    assert h.admission.active == 0


async def test_cancelled_waiter_gives_back_its_places() -> None:
    h = Harness(max_concurrent=1, max_queued=5, queue_timeout_s=5, per_key={"max_concurrent": 2})
    held = await h.admit(key("a"))
    waiting = asyncio.create_task(h.admit(key("a")))
    while h.admission.queued < 1:
        await asyncio.sleep(0)
    waiting.cancel()  # the client went away while queued
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert h.admission.queued == 0
    held.release()
    assert h.admission.active == 0
    tickets = [await h.admit(key("a"))]  # key a has both places back
    tickets.append(asyncio.create_task(h.admit(key("a"))))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert h.admission.queued == 1


async def test_queue_rejection_refunds_tokens_and_places() -> None:
    h = Harness(
        max_concurrent=2, max_queued=0, per_key={"tokens_per_s": 1, "burst_tokens": 400, "max_concurrent": 2}
    )
    other = await h.admit(key("b"))
    held = await h.admit(key("a"))  # 200 of 400 tokens, 1 of 2 places
    assert (await h.reject(key("a"))).reason == "queue_full"  # its 200 tokens and its place come back
    other.release()
    (await h.admit(key("a"))).release()  # takes the last 200 tokens and the second place
    held.release()


async def test_identities_are_bounded_and_idle_ones_forgotten() -> None:
    h = Harness(per_key={"tokens_per_s": 100, "burst_tokens": 300}, max_identities=2)
    a = await h.admit(key("a"))
    (await h.admit(key("b"))).release()
    error = await h.reject(key("c"))  # a is in flight, b's bucket is not full yet
    assert error.reason == "identities"
    h.clock.now += 10  # b's bucket refills: b can be forgotten
    await h.admit(key("c"))
    a.release()
    assert len(h.admission.limiters[0].table) == 2


def test_keys_are_stored_as_digests_only() -> None:
    h = Harness(per_key={"max_concurrent": 5})
    asyncio.run(h.admit(key("sk-secret-value")))
    (name,) = h.admission.limiters[0].table
    assert b"sk-secret" not in name and len(name) == 16
