"""Held KV for P/D disaggregation, as a mixin of `SchedulerCore`: a `prefill_only` request computes its
prompt, emits one token and keeps its blocks (`held`) until `release_kv` (the decoder pulled) or its lease
expires; a request with remote KV waits in `transferring` until its pull ends (`ready_at`), then runs."""

from __future__ import annotations

from bench.sim.sched_request import HELD, RUNNING, ReqState, RequestEvent


class KVLeases:
    """The P/D part of the scheduler core; `SchedulerCore` owns the lists and frees the blocks."""

    held: dict[str, ReqState]
    transferring: list[ReqState]
    running: list[ReqState]
    requests: dict[str, ReqState]

    def _free(self, req: ReqState) -> None:
        raise NotImplementedError  # SchedulerCore returns the blocks to its pool

    def release_kv(self, request_id: str) -> bool:
        """The decoder pulled a prefill-only request's KV: unpin its blocks (False if not held)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.requests.pop(request_id, None)
        self._free(req)
        return True

    def next_wakeup(self) -> float | None:
        """When something not yet runnable becomes so (a KV transfer ends, a lease expires)."""
        times = [r.ready_at for r in self.transferring] + [r.held_until for r in self.held.values()]
        return min(times) if times else None

    def _hold(self, req: ReqState) -> RequestEvent:
        req.state = HELD
        self.held[req.spec.request_id] = req
        return RequestEvent(req.spec.request_id, True, "length", req.cached_tokens, 1)

    def _expire_leases(self, now: float) -> None:
        for request_id in [rid for rid, r in self.held.items() if r.held_until <= now]:
            self.release_kv(request_id)

    def _finish_transfers(self, now: float) -> list[str]:
        if not self.transferring:
            return []
        still, pulled = [], []
        for req in self.transferring:
            if req.ready_at <= now:
                req.state = RUNNING
                self.running.append(req)
                pulled.append(req.spec.request_id)
            else:
                still.append(req)
        self.transferring = still
        return pulled
