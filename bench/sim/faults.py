"""Fault injection for the simulated vLLM backend, to test the gateway's failure rules.

A `FaultPlan` is set at start (`--faults JSON`) and replaced at run time (`POST /sim/faults` with the
same JSON; `DELETE /sim/faults` clears it; `GET /sim/faults` shows what is left). Keys:

  error_status        HTTP status (429, 500, 503, ...) returned, with an OpenAI error body, to
                      generation requests instead of running them
  error_count         how many requests get it (null: every request until cleared)
  error_for_s         ... or every request for this many wall seconds from when the plan is set
                      (overload is a period, not a count: a gateway that backs off a busy server sends
                      it fewer requests, which would stretch a counted burst of 503s over a longer time)
  first_byte_delay_s  wall seconds to stall before the response status line
  chunk_delay_s       wall seconds to stall before each SSE chunk after the first
  delay_count         how many requests the two stalls apply to (null: all)
  close_after_chunks  abort the TCP connection after this many SSE chunks (0: before any byte;
                      a non-streamed response is aborted before its body whatever the value)
  close_count         how many requests are cut (null: all)
  stream_error_after_chunks  after this many SSE chunks, send vLLM's in-band error event
                      (`data: {"error": {...}}`, code 500) and `data: [DONE]`, as a failing engine does;
                      a non-streamed request gets a 500 error response instead
  stream_error_count  how many streams get it (null: all)
  health_status       status of GET /health (null: 200)
  refuse_connections_s  stop listening (connections are refused) for this many seconds and drop the
                      open connections; the server listens again on the same port afterwards
  paths               which generation paths the request faults apply to (default: both)

Faults on requests apply in arrival order; counts are consumed as requests arrive.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class FaultPlan:
    error_status: int | None = None
    error_count: int | None = None
    error_for_s: float | None = None
    first_byte_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    delay_count: int | None = None
    close_after_chunks: int | None = None
    close_count: int | None = None
    stream_error_after_chunks: int | None = None
    stream_error_count: int | None = None
    health_status: int | None = None
    refuse_connections_s: float = 0.0
    paths: list[str] = field(default_factory=lambda: list(GENERATION_PATHS))

    @classmethod
    def from_dict(cls, data: Any) -> FaultPlan:
        if not isinstance(data, dict):
            raise ValueError("a fault plan must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fault keys {unknown}; known: {sorted(known)}")
        plan = cls(**data)
        plan._validate()
        return plan

    def _validate(self) -> None:
        for name in ("error_status", "health_status"):
            status = getattr(self, name)
            if status is not None and not (isinstance(status, int) and 100 <= status <= 599):
                raise ValueError(f"{name} must be an HTTP status code, got {status!r}")
        if self.error_for_s is not None and self.error_count is not None:
            raise ValueError("error_count and error_for_s exclude each other")
        if self.error_for_s is not None and (
            not isinstance(self.error_for_s, int | float) or self.error_for_s < 0
        ):
            raise ValueError("error_for_s must be a number >= 0 or null")
        for name in ("first_byte_delay_s", "chunk_delay_s", "refuse_connections_s"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a number >= 0")
        counted = ("error_count", "delay_count", "close_after_chunks", "close_count")
        for name in (*counted, "stream_error_after_chunks", "stream_error_count"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name} must be an integer >= 0 or null")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class RequestFaults:
    """The faults one request will suffer, decided when it arrives."""

    error_status: int | None = None
    first_byte_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    close_after_chunks: int | None = None
    stream_error_after_chunks: int | None = None


NO_FAULTS = RequestFaults()


class FaultInjector:
    """Holds the current plan and hands each arriving request its share of it."""

    def __init__(self, plan: FaultPlan | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = FaultPlan()
        self._clock = clock
        self._errors_until = math.inf  # set by set_plan: when a timed error (`error_for_s`) ends
        self.set_plan(plan or FaultPlan())

    def set_plan(self, plan: FaultPlan) -> None:
        # A private copy: counts are consumed here, and one plan may configure several servers.
        self.plan = copy.deepcopy(plan)
        timed = plan.error_for_s
        self._errors_until = math.inf if timed is None else self._clock() + timed

    def clear(self) -> None:
        self.plan = FaultPlan()

    @property
    def health_status(self) -> int:
        return self.plan.health_status or 200

    def admit(self, path: str) -> RequestFaults:
        plan = self.plan
        if path not in plan.paths:
            return NO_FAULTS
        if (
            plan.error_status is not None
            and self._clock() < self._errors_until
            and _take(plan, "error_count")
        ):
            return RequestFaults(error_status=plan.error_status)
        delayed = (plan.first_byte_delay_s or plan.chunk_delay_s) and _take(plan, "delay_count")
        closes = plan.close_after_chunks is not None and _take(plan, "close_count")
        errs = plan.stream_error_after_chunks is not None and _take(plan, "stream_error_count")
        if not delayed and not closes and not errs:
            return NO_FAULTS
        return RequestFaults(
            first_byte_delay_s=plan.first_byte_delay_s if delayed else 0.0,
            chunk_delay_s=plan.chunk_delay_s if delayed else 0.0,
            close_after_chunks=plan.close_after_chunks if closes else None,
            stream_error_after_chunks=plan.stream_error_after_chunks if errs else None,
        )


def _take(plan: FaultPlan, count_name: str) -> bool:
    """Consume one use of a counted fault; a null count never runs out."""
    remaining = getattr(plan, count_name)
    if remaining is None:
        return True
    if remaining <= 0:
        return False
    setattr(plan, count_name, remaining - 1)
    return True
