"""Admission control: per-key and per-tenant limits and a bounded global queue, answered with 429.

Checked once per request, after the request is parsed and before any backend is touched:

  1. per API key and per tenant (the value of `admission.tenant_header`): at most `max_concurrent`
     requests admitted or queued at once, and a token bucket refilled at `tokens_per_s` and holding
     `burst_tokens`, charged with the prompt estimate plus `max_tokens` (`default_max_tokens` when unset);
  2. globally: at most `max_concurrent` requests served at once; up to `max_queued` more wait, FIFO, at most
     `queue_timeout_s`.

Over any limit the request gets 429 with `Retry-After` (seconds until the bucket holds enough, else 1) and
an OpenAI error of type `rate_limit_exceeded`. Pure asyncio: no I/O, the clock is injected. Keys are held
only as SHA-256 digests and never logged or used as labels; a tenant's name is not logged either. The
number of tracked identities is bounded (`max_identities`); one with nothing in flight and a full bucket
is forgotten. Limits are per gateway process.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import AdmissionConfig, RateLimit
from gateway.errors import RateLimited
from gateway.schemas import ParsedRequest, estimate_prompt_tokens

Clock = Callable[[], float]
OnReject = Callable[[str], None]

_BURST_SECONDS = 10.0  # burst_tokens 0: the bucket holds this many seconds of tokens_per_s


class Ticket:
    """An admitted request; `release()` (idempotent) gives its places back."""

    __slots__ = ("_admission", "_identities", "_slot")

    def __init__(self, admission: Admission | None, identities: tuple[_Identity, ...], slot: bool) -> None:
        self._admission = admission
        self._identities = identities
        self._slot = slot

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release(self._identities, self._slot)


OPEN_TICKET = Ticket(None, (), False)  # what a gateway without admission limits hands out


@dataclass(slots=True)
class _Identity:
    """One key's or one tenant's live state."""

    active: int = 0  # admitted or queued now
    level: float = 0.0  # tokens in the bucket at `stamp`
    stamp: float = 0.0


class _Limiter:
    """Concurrency and token-rate limits for one kind of identity (API keys, or tenants)."""

    def __init__(self, limit: RateLimit, kind: str, max_identities: int, clock: Clock) -> None:
        self.limit = limit
        self.kind = kind
        self.capacity = float(limit.burst_tokens or limit.tokens_per_s * _BURST_SECONDS)
        self.max_identities = max_identities
        self.clock = clock
        self.table: dict[bytes, _Identity] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.limit.max_concurrent or self.limit.tokens_per_s)

    def check(self, name: bytes, cost: int) -> _Identity:
        """The identity's state if one more request of `cost` tokens fits; raises RateLimited if not."""
        state = self.table.get(name)
        now = self.clock()
        if state is None:
            state = self._new(name, now)
        limit = self.limit
        if limit.max_concurrent and state.active >= limit.max_concurrent:
            raise RateLimited(
                f"Too many concurrent requests for this {self.kind}.", f"{self.kind}_concurrency"
            )
        if limit.tokens_per_s:
            self._refill(state, now)
            need = min(cost, self.capacity)  # a request bigger than the bucket needs a full bucket
            if need > state.level:
                wait_s = (need - state.level) / limit.tokens_per_s
                raise RateLimited(
                    f"Token rate limit reached for this {self.kind}.", f"{self.kind}_tokens", wait_s
                )
        return state

    def _new(self, name: bytes, now: float) -> _Identity:
        if len(self.table) >= self.max_identities:
            self._forget_idle(now)
            if len(self.table) >= self.max_identities:
                raise RateLimited("Too many distinct clients at once; retry shortly.", "identities")
        state = _Identity(level=self.capacity, stamp=now)
        self.table[name] = state
        return state

    def _refill(self, state: _Identity, now: float) -> None:
        state.level = min(self.capacity, state.level + (now - state.stamp) * self.limit.tokens_per_s)
        state.stamp = now

    def _forget_idle(self, now: float) -> None:
        """Drop identities with nothing in flight whose bucket is full again (they are as if new)."""
        for name, state in list(self.table.items()):
            if state.active == 0:
                self._refill(state, now)
                if state.level >= self.capacity:
                    del self.table[name]


class Admission:
    def __init__(self, config: AdmissionConfig, on_reject: OnReject, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.on_reject = on_reject
        self.tenant_header = config.tenant_header.encode() if config.tenant_header else None
        limiters = [_Limiter(config.per_key, "key", config.max_identities, clock)]
        if self.tenant_header is not None:
            limiters.append(_Limiter(config.per_tenant, "tenant", config.max_identities, clock))
        self.limiters = tuple(limiter for limiter in limiters if limiter.enabled)
        self.counts_tokens = any(limiter.limit.tokens_per_s for limiter in self.limiters)
        self.max_concurrent = config.max_concurrent
        self.enabled = bool(self.limiters or self.max_concurrent)
        self.active = 0  # requests holding a global slot
        self.waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self.waiters)

    async def admit(self, headers: dict[bytes, bytes], request: ParsedRequest) -> Ticket:
        """A ticket for this request, or RateLimited (counted by reason) when it is over a limit."""
        if not self.enabled:
            return OPEN_TICKET
        try:
            identities, cost = self._take_identities(headers, request)
            try:
                slot = await self._take_slot()
            except BaseException:
                self._give_back(identities, cost)
                raise
        except RateLimited as error:
            self.on_reject(error.reason)
            raise
        return Ticket(self, identities, slot)

    def _take_identities(
        self, headers: dict[bytes, bytes], request: ParsedRequest
    ) -> tuple[tuple[_Identity, ...], int]:
        if not self.limiters:
            return (), 0
        cost = 0
        if self.counts_tokens:
            cost = estimate_prompt_tokens(request) + (request.max_tokens or self.config.default_max_tokens)
        # Every limit is checked before any is charged: a rejection leaves no trace.
        identities = tuple(limiter.check(self._name(limiter, headers), cost) for limiter in self.limiters)
        for state in identities:
            state.active += 1
            state.level -= cost
        return identities, cost

    def _name(self, limiter: _Limiter, headers: dict[bytes, bytes]) -> bytes:
        if limiter.kind == "key":
            return hashlib.sha256(headers.get(b"authorization", b"")).digest()[:16]
        assert self.tenant_header is not None
        return headers.get(self.tenant_header, b"")

    async def _take_slot(self) -> bool:
        if not self.max_concurrent:
            return False
        if self.active < self.max_concurrent and not self.waiters:
            self.active += 1
            return True
        if len(self.waiters) >= self.config.max_queued:
            raise RateLimited("The gateway is at capacity; retry shortly.", "queue_full")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as error:
            if waiter.done() and not waiter.cancelled():
                self._pass_slot()  # handed a slot just as we gave up: pass it on
            else:
                waiter.cancel()
                self.waiters.remove(waiter)
            if isinstance(error, asyncio.CancelledError):
                raise
            raise RateLimited("Timed out waiting for capacity; retry shortly.", "queue_timeout") from None
        return True

    def _pass_slot(self) -> None:
        """Hand a freed global slot to the longest waiter, or return it."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def _give_back(self, identities: tuple[_Identity, ...], cost: int) -> None:
        """Undo `_take_identities` for a request that was not admitted after all (tokens refunded)."""
        for state in identities:
            state.level += cost
        self._release(identities, False)

    def _release(self, identities: tuple[_Identity, ...], slot: bool) -> None:
        if slot:
            self._pass_slot()
        for state in identities:
            state.active -= 1
