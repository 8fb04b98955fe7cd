"""Where a conversation starts: the decoder of a named conversation's first turn, picked by weighted round
robin over the decode shares of the SLO plan (`scoring.slo_plan`) of the traffic seen lately.

Why: a conversation's later turns follow its KV. Each turn's prompt is the last one plus its answer, cached
where the last turn decoded, so the backend its first turn decodes on serves its later turns too. A plan
priced for the first turn alone sees only that turn, and on a mixed cluster it starts conversations on
backends that are worth more as prefillers (B200 + 2x H100, multi-turn chats: 34 of 125 started on an
H100, whose decodes then missed their TPOT; docs/policies.md, thirtieth and thirty-first passes). The
SLO plan says how the cluster's decoding is best shared at its SLO; new conversations follow it.

The solve (6-93 ms) never runs on the request path: `TrafficWindow.record` only notes each request
(one append), and the owner solves off it (`CostRanker.replan`): the gateway in a worker
thread every few seconds, the simulator every `REPLAN_EVERY` arrivals; and only when a request has named
a conversation since the last solve.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from scoring.slo_plan import Servers, Traffic, solve_slo_plan
from scoring.types import BackendSpec

WINDOW = 2048  # the requests the plan is solved over: the latest, as the traffic mix drifts
MIN_SEEN = 8  # no plan from fewer
REPLAN_EVERY = 50  # the simulator's solves, in arrivals (the gateway's are timed: REPLAN_INTERVAL_S)
REPLAN_INTERVAL_S = 5.0


class TrafficWindow:
    """The latest requests as the plan needs them. Appended to on the request path (a deque's append is
    atomic), copied by a solver thread (`list` copies a deque in one call, holding the GIL)."""

    def __init__(self, size: int = WINDOW) -> None:
        # (prompt, tokens each backend holds, outputs, TTFT target, TPOT target) per request
        self._requests: deque[tuple[float, np.ndarray, float, float, float]] = deque(maxlen=size)
        self._chatting = False  # a request named a conversation since the last snapshot

    def record(
        self, prompt: float, held: np.ndarray, outputs: float, slo: tuple[float, float], in_conversation: bool
    ) -> None:
        """`held`: the prompt tokens each backend holds (the request's own array, not copied: its
        maximum, the tokens a cluster-wide cache would have, is taken off the request path); `slo`: its
        TTFT and TPOT targets."""
        self._requests.append((prompt, held, outputs, slo[0], slo[1]))
        if in_conversation:
            self._chatting = True

    def snapshot(self) -> Traffic | None:
        """A copy of what is held; None below `MIN_SEEN` requests, and while no request has named a
        conversation since the last snapshot (only their first turns use the plan: a cluster serving
        none spends no CPU on it)."""
        if not self._chatting:
            return None
        self._chatting = False
        held = list(self._requests)
        if len(held) < MIN_SEEN:
            self._chatting = True  # not enough to plan yet: try again next time
            return None
        prompt, outputs, ttft, tpot = np.array([(r[0], r[2], r[3], r[4]) for r in held], dtype=float).T
        cached = np.array([float(r[1].max(initial=0.0)) for r in held])
        return Traffic(np.maximum(prompt, 1.0), cached, np.maximum(outputs, 1.0), ttft, tpot)


class ConversationStarts:
    """For one set of backends: the shares new conversations decode by, and how many each has started."""

    def __init__(self, specs: Sequence[BackendSpec], servers: Servers) -> None:
        self.specs = tuple(specs)
        self.servers = servers
        self.shares: np.ndarray | None = None  # replaced whole by `adopt`, so a reader sees one or the other
        self._started = np.zeros(len(specs))

    def replan(self, traffic: Traffic) -> None:
        """Solve the SLO plan of `traffic` (off the request path) and adopt its decode shares."""
        self.adopt(solve_slo_plan(self.servers, traffic).decodes)

    def adopt(self, decodes: np.ndarray) -> None:
        """Take a plan's decode shares, spread evenly over backends of one kind: the LP's optimum is a
        vertex, which may give all of a kind's share to one of its identical backends."""
        self.shares = even_within_kinds(decodes, self.specs) if decodes.sum() > 0 else None

    def pick(self, eligible: np.ndarray) -> int | None:
        """The decoder of a new conversation among `eligible` (healthy decoders): the fewest started per
        unit of share. None while there is no plan, or when it gives no eligible backend a share."""
        shares = self.shares
        if shares is None:
            return None
        weighted = eligible & (shares > 0)
        if not weighted.any():
            return None
        row = int(np.argmin(np.where(weighted, (self._started + 1.0) / np.maximum(shares, 1e-12), np.inf)))
        self._started[row] += 1.0
        return row


def even_within_kinds(shares: np.ndarray, specs: Sequence[BackendSpec]) -> np.ndarray:
    """Each backend's share replaced by the mean share of its kind (same accelerator, GPUs, roles and
    max_num_seqs)."""
    kinds = [(s.accelerator, s.gpus, s.roles, s.max_num_seqs) for s in specs]
    out = np.empty(len(specs))
    for kind in set(kinds):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        out[rows] = shares[rows].mean()
    return out
