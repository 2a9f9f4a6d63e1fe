"""Calibrated upper predictions (issue #28: "the predicted p90 TTFT covers 90 ± 3 % of observed").

A point prediction (a request's wait for those ahead of it at the recent dispatch rate, plus its prefill on the
fastest fit: ``ttft_point``) is turned into an upper bound that a fraction ``target`` of observations fall
under, by adaptive conformal inference (Gibbs & Candès, "Adaptive Conformal Inference Under Distribution Shift",
NeurIPS 2021): the bound is the point times the (1 − α_t)-quantile of the recent ratios observed / point, and
after each observation α_t moves by γ·(α − miss), α = 1 − target. Whatever the traffic does, the fraction of
misses over T predictions is then within (1 + γ)/(γ·T) of α (their Prop. 4.1): ±2.1 % over 1,000 requests at
γ = 0.05, when each observation comes before the next prediction. A gateway's do not: a burst of requests is
predicted at once and its misses all arrive together, and at γ = 0.05 they drove α_t below 0 (an infinite bound)
for half of a bursty live run. The default γ = 0.005 leaves calibration to the window's quantile and lets α_t
correct slow drift only (0.893 live, 0.90 in simulation: tests/test_calibration.py). A level past 1 gives an
infinite bound (None), past 0 a bound of 0. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from typing import Iterable

from fairgate.accounting.latency import BackendLatency


class EventRate:
    """Events (dispatches, arrivals) per second over the last ``window`` of them within ``horizon_s``."""

    def __init__(self, window: int = 200, horizon_s: float = 60.0):
        self._times: deque[float] = deque(maxlen=window)
        self.horizon_s = horizon_s

    def event(self, now: float) -> None:
        self._times.append(now)

    def per_s(self, now: float) -> float:
        """The rate until ``now`` (a lull since the last event lowers it; events older than the horizon are
        forgotten, so a day idle does not make the next minute look slow)."""
        times = self._times
        while times and now - times[0] > self.horizon_s:
            times.popleft()
        if len(times) < 2:
            return 0.0
        return (len(times) - 1) / max(now - times[0], 1e-6)


def ttft_point(ahead: int, rate: float, prompt_tokens: int,
               backends: Iterable[tuple[BackendLatency, int]]) -> float | None:
    """Seconds to a request's first token: the wait for ``ahead`` requests at ``rate`` dispatches per second,
    then its prefill on the backend where it would come soonest, behind the prompt tokens dispatched there and
    not yet prefilled (each backend as (its fit, those tokens)); None when requests wait and none has left
    yet."""
    if ahead and rate <= 0:
        return None
    wait = ahead / rate if ahead else 0.0
    return wait + max(0.0, min((fit.prefill_time(pending + prompt_tokens)[0] for fit, pending in backends),
                               default=0.0))


class CalibratedUpper:
    def __init__(self, target: float = 0.9, gamma: float = 0.005, window: int = 500, floor_s: float = 0.001):
        if not 0 < target < 1 or not 0 < gamma < 1 or window < 1:
            raise ValueError("target and gamma are fractions in (0, 1), window a positive count")
        self.target, self.gamma, self.floor_s = target, gamma, floor_s
        self.alpha = 1.0 - target  # α_t, the miss rate aimed at now
        self._window: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self.predictions = 0  # observations with a finite bound made before them, and how many it covered
        self.covered = 0
        self.unbounded = 0  # observations whose bound was infinite (the first; after a run of misses)

    def upper(self, point: float) -> float | None:
        """The bound for a request whose point prediction is ``point`` seconds (None: unbounded)."""
        ratios = self._sorted
        level = 1.0 - self.alpha
        if level >= 1.0 or not ratios:
            return None
        if level <= 0.0:
            return 0.0
        k = math.ceil(level * (len(ratios) + 1)) - 1  # the conformal quantile of n scores
        if k >= len(ratios):
            return None
        return max(point, self.floor_s) * ratios[k]

    def observe(self, point: float, observed: float, upper: float | None) -> None:
        """The request predicted ``point`` (and bounded by ``upper``, as ``upper`` said then) took ``observed``."""
        if not (math.isfinite(point) and math.isfinite(observed)) or point < 0 or observed < 0:
            return
        miss = upper is not None and observed > upper
        if upper is None:
            self.unbounded += 1
        else:
            self.predictions += 1
            self.covered += not miss
        self.alpha += self.gamma * ((1.0 - self.target) - miss)
        ratio = observed / max(point, self.floor_s)
        if len(self._window) == self._window.maxlen:
            old = self._window[0]
            del self._sorted[bisect_left(self._sorted, old)]
        self._window.append(ratio)
        insort(self._sorted, ratio)

    @property
    def coverage(self) -> float | None:
        """The fraction of observations the finite bound made before them covered (None before any)."""
        return self.covered / self.predictions if self.predictions else None
