"""How much slower each backend is than its roofline, learnt from the times its requests took.

A request's time to first token on backend b is, by the roofline, its own prefill `C` plus the work
queued ahead of it `Q` (prompts in the queue, the step in progress, prompts that joined its step after
it was planned), both in roofline seconds, less the fixed seconds of the engine steps they take (the
scheduler, kernel launches, sampling: `StepCoefficients.overhead_s`), which no efficiency scales and
which the caller takes off the measured time too (scaled with the rest, the AMD seed cluster's
corrections of ~3 put 6 ms too many on every one-step prompt, and the fit, settling between the short
prompts and the long ones, priced the long ones 10 % short). `ComputeFit` fits

    measured TTFT ~= compute * C + queue * Q + overhead

per backend, by weighted least squares over the recent outcomes (exponential forgetting), each
outcome weighted by the inverse square of its roofline prediction (the errors are relative: a 5 % miss on a
2 s prompt and on a 20 ms one say the same) times the square of the compute's share in it (an outcome
that was nearly all queue says little about the compute: weighted alike, a backend whose every prompt
waited 5-10x its own prefill had the queue model's leftover error read as slowness, B200 + 2x H100
bursts at half the fluid bound: B200 1.79 for a true 1.0, 1.01 weighted so). Two coefficients, not one,
because the queue model has
errors of its own: with one factor on `C` alone (the queue subtracted as predicted), a queue predicted
30 % too long was credited to a compute part a tenth its size, and under sustained load the factor
swung between its clips (B200 + 2x H100, shared system prompts at 0.8x the fluid bound: B200 2.93,
H100s 0.1, for a true 1.0). Fitted together, the same point learns compute 1.09 / 1.21 / 1.14 and
queue 0.94 / 0.68 / 0.68 (tests/unit/test_calibration_converges.py runs it; queue 0.66 / 0.53 / 0.49
while a running step was still counted as joinable, `scoring/cost_policy.py` `_join`). The regressors are the
roofline's own seconds, never the corrected ones, so what was learnt never feeds back into what is
measured next. The cost policy prices with the compute factor only (scoring/cost_policy.py says why).

Two weak priors hold what the data cannot tell apart: the queue factor equals the compute factor (the
roofline's assumption: the queue is the same hardware's compute), so a backend that never had a queue,
or whose queue always stood in the same ratio to its prompts, prices its queue as its compute; and both
lie near an anchor (the other backends' compute when this one was first measured), which keeps the
solve regular before any outcome. Pure numpy on 3x3 matrices: a few microseconds per outcome, off the
request path's decision (outcomes are observed after a request ends).

A third coefficient, `overhead`, is the seconds every request pays on that backend besides its
roofline work: the HTTP round trip through the gateway, tokenization, the API server's scheduling,
the first token's way back. The roofline has no such term, so without it the fit spread those seconds
over the compute factor, in proportion to each prompt's size: over HTTP on B200 + 2x H100 (Azure
conversations), prompts under 300 tokens took ~5 ms more than predicted and those over 2,000 ~14 ms
less, served whole or split alike, and the splits of short prompts planned to the edge of a
48 ms target missed it (docs/policies.md, thirty-seventh pass). It is never negative; its prior is
zero, held by `OVERHEAD_RIDGE` until outcomes of varied sizes tell it from the compute (prompts of one
size cannot: the compute takes it all, as before).
"""

from __future__ import annotations

import numpy as np

CLIP = (0.1, 10.0)
WINDOW = 128.0  # outcomes: the forgetting factor is 1 - 1 / WINDOW
# In units of one outcome whose prediction was all compute: toward the anchor, and toward queue = compute.
RIDGE = 0.001
TIE = 0.1
# Toward no overhead: 10 ms of it weighs as one outcome missed by 10 %, so a few tens of outcomes of
# varied sizes outweigh the prior, and prompts of one size leave it at zero.
OVERHEAD_RIDGE = 100.0
OVERHEAD_MAX_S = 1.0


class ComputeFit:
    """The least-squares fit of one backend: `compute` and `queue`, the factors on the roofline's own
    prefill and queue seconds, and `overhead`, the seconds each request adds to them."""

    __slots__ = ("_anchor", "_decay", "_ridge", "_xx", "_xy", "compute", "overhead", "queue")

    def __init__(self, anchor: float, window: float = WINDOW, ridge: float = RIDGE, tie: float = TIE) -> None:
        self._anchor = ridge * np.array([anchor, anchor, 0.0])
        self._decay = 1.0 - 1.0 / window
        self._ridge = np.zeros((3, 3))
        self._ridge[:2, :2] = ridge * np.eye(2) + tie * np.array([[1.0, -1.0], [-1.0, 1.0]])
        self._ridge[2, 2] = OVERHEAD_RIDGE
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self.compute = anchor
        self.queue = anchor  # the priors' solve before any outcome
        self.overhead = 0.0

    def add(self, measured_s: float, compute_s: float, queue_s: float) -> bool:
        """One outcome: `measured_s` for `compute_s` own prefill and `queue_s` ahead (roofline seconds).
        False when it says nothing (no compute, or a time that is not one; 0 is one: the caller's fixed
        seconds took it all)."""
        if compute_s <= 0 or queue_s < 0 or not np.isfinite(measured_s) or measured_s < 0:
            return False
        x = np.array([compute_s, queue_s, 1.0])
        # Relative errors (a common factor leaves the fit as it is), by the compute's share (see above).
        weight = compute_s**2 / (compute_s + queue_s) ** 4
        self._xx *= self._decay
        self._xy *= self._decay
        self._xx += weight * np.outer(x, x)
        self._xy += weight * measured_s * x
        self._solve()
        return True

    def move_to(
        self, compute: float | None = None, queue: float | None = None, overhead: float | None = None
    ) -> None:
        """Set the coefficients (another replica's view blended in) and keep the evidence: the sums are
        shifted so that they solve to the new values, so later outcomes move them as much as before."""
        theta = np.array(
            [
                self.compute if compute is None else compute,
                self.queue if queue is None else queue,
                self.overhead if overhead is None else overhead,
            ]
        )
        theta[:2] = np.clip(theta[:2], *CLIP)
        theta[2] = np.clip(theta[2], 0.0, OVERHEAD_MAX_S)
        self._xy = (self._xx + self._ridge) @ theta - self._anchor
        self.compute, self.queue, self.overhead = (float(v) for v in theta)

    def _solve(self) -> None:
        a, b = self._xx + self._ridge, self._xy + self._anchor
        theta = np.linalg.solve(a, b)
        if theta[2] < 0.0:  # no negative overhead: the best fit with none
            theta = np.append(np.linalg.solve(a[:2, :2], b[:2]), 0.0)
        self.compute, self.queue = (float(v) for v in np.clip(theta[:2], *CLIP))
        self.overhead = float(min(theta[2], OVERHEAD_MAX_S))
