"""Outlier detection: take a backend that keeps failing real requests out of rotation, as Envoy does.

A pure state machine (no I/O, time passed in). Its inputs are verdicts on single attempts, already
attributed by gateway/retry.py, which decides what a backend is to blame for:

  SUCCESS  a 2xx answer: both consecutive counters go back to 0
  ERROR    a 5xx the backend is to blame for: counts toward `consecutive_5xx`
  GATEWAY  a gateway failure (connect error, reset, time-to-first-byte timeout, 502/504): counts toward
           `consecutive_gateway_failure` and, as in Envoy, toward `consecutive_5xx` too

Backpressure (429/503) and 4xx say nothing about a backend's health and never arrive here.

Ejection: a counter reaching its threshold ejects the backend for `base_ejection_time_s` x level, where
level is how often it was ejected (it decays by one per `decay_interval_s` spent back in rotation), capped
at `max_ejection_time_s`. At most `max_ejection_percent` of a pool is ejected at once, rounded down but
at least one backend, and never the whole pool. An ejection over the cap is deferred, not forgotten: the
counter stays at its threshold, so the next failure ejects once the cap allows. When its time is up a
backend returns with clean counters (no half-open trial: like Envoy, it simply takes traffic again, and
a still-broken backend is re-ejected for longer). Verdicts on a backend while it is ejected (requests
that started before, or panic routing) change nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

from gateway.config import Outlier


class Verdict(Enum):
    SUCCESS = "success"
    ERROR = "error"
    GATEWAY = "gateway"


class OutlierState:
    """One backend's passive health; owned by its OutlierPool."""

    __slots__ = ("consecutive_5xx", "consecutive_gateway", "ejected_until", "key", "level", "returned_at")

    def __init__(self, key: str) -> None:
        self.key = key  # the backend id, so that the pool can say who returned
        self.consecutive_5xx = 0
        self.consecutive_gateway = 0
        self.ejected_until: float | None = None
        self.level = 0
        self.returned_at = 0.0

    def ejected(self, now: float) -> bool:
        return self.ejected_until is not None and now < self.ejected_until


class OutlierPool:
    """The backends of one model: ejection decisions, with the cap on how many are out at once."""

    def __init__(self, settings: Outlier, members: Sequence[OutlierState]) -> None:
        self.settings = settings
        self.members = tuple(members)
        n = len(self.members)
        self.max_ejected = min(n - 1, max(1, math.floor(n * settings.max_ejection_percent / 100)))
        self._ejected: list[OutlierState] = []  # returned lazily: see release_due

    def record(self, member: OutlierState, verdict: Verdict, now: float) -> bool:
        """Count one verdict; True when it ejected the backend."""
        if member.ejected_until is not None:
            if member.ejected(now):
                return False
            self.release_due(now)
        if verdict is Verdict.SUCCESS:
            member.consecutive_5xx = 0
            member.consecutive_gateway = 0
            return False
        member.consecutive_5xx += 1
        if verdict is Verdict.GATEWAY:
            member.consecutive_gateway += 1
        if not self._over_threshold(member):
            return False
        self.release_due(now)
        if len(self._ejected) >= self.max_ejected:
            return False
        self._eject(member, now)
        return True

    def ejected_now(self, now: float) -> list[OutlierState]:
        """The members ejected at `now` (those whose time is over are released lazily, not here)."""
        return [m for m in self._ejected if m.ejected(now)] if self._ejected else []

    def release_due(self, now: float) -> list[OutlierState]:
        """Bring back every backend whose ejection time is over; returns them."""
        if not self._ejected:
            return []
        due = [m for m in self._ejected if not m.ejected(now)]
        for member in due:
            self._ejected.remove(member)
            member.returned_at = member.ejected_until or now  # when it took traffic again, not when noticed
            member.ejected_until = None
            member.consecutive_5xx = 0
            member.consecutive_gateway = 0
        return due

    def ejection_time(self, member: OutlierState) -> float:
        """How long the current (or last) ejection of `member` lasts."""
        s = self.settings
        return min(s.base_ejection_time_s * member.level, s.max_ejection_time_s)

    def _over_threshold(self, member: OutlierState) -> bool:
        s = self.settings
        return (0 < s.consecutive_5xx <= member.consecutive_5xx) or (
            0 < s.consecutive_gateway_failure <= member.consecutive_gateway
        )

    def _eject(self, member: OutlierState, now: float) -> None:
        if member.level:
            calm = int((now - member.returned_at) // self.settings.decay_interval_s)
            member.level = max(0, member.level - calm)
        member.level += 1
        member.ejected_until = now + self.ejection_time(member)
        self._ejected.append(member)
