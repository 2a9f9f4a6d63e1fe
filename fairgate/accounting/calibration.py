"""Calibrated upper predictions ("the predicted p90 TTFT covers 90 ± 3 % of observed").

A point prediction (a request's wait for those ahead of it at the recent dispatch rate, plus its prefill on the
fastest fit: ``ttft_point``) is turned into an upper bound that a fraction ``target`` of observations fall
under. The score of an observation is log(observed / point); the bound is the point times exp(q + I):

- q, the conformal (target)-quantile of the last ``window`` scores *of the point's class*: points are classed
  by magnitude, a factor of 4 apart (under 0.1 s, to 0.4, 1.6, 6.4 s, beyond), because a gateway's errors are
  not one ratio: a request with nothing ahead of it misses its ~0.1 s prefill by a fixed overhead, one behind
  a queue by a share of its wait (Mondrian conformal prediction, Vovk et al. 2003: each class is calibrated on
  its own, so each covers its target, and so does the whole). A class with fewer than ``min_scores`` uses the
  scores of all classes.
- I, the class's integrator (Angelopoulos, Candès & Tibshirani, "Conformal PID Control for Time Series
  Prediction", NeurIPS 2023, §2, quantile tracking): after each observation of a bounded prediction,
  I += η·(miss − (1 − target)), with η scaled to the class's scores as theirs is (η = ``lr`` times the spread
  q95 − q50 of the scores, at least 0.05: a class whose misses are 30× its point moves by more than one missed
  by 20 %). With a fixed η their bound holds whatever the traffic does: as the scores are bounded, so is I, and
  the fraction of misses over T bounded predictions is within (B + η·d)/(η·T) of 1 − target (B: the scores'
  range; d: the predictions made before an observation returns, a burst's size at most). With η following
  the spread, the bounded I limits a sum of misses weighted by η instead: the guarantee is approximate, and
  so is each class's own coverage (Mondrian's holds for exchangeable scores, which a sliding window and an
  integrator do not keep). What it gives on real traffic is measured: tests/test_calibration.py.

The bound never becomes infinite, unlike adaptive conformal inference's level (Gibbs & Candès, 2021), which a
gateway's bursts of misses, all observed together, drove past 1 for a quarter of a live run. Unbounded (None)
only until ⌈1/(1 − target)⌉ − 1 scores exist (nine at 0.9: a 0.9-quantile of fewer is not defined). Pure: no
I/O, no clock.
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


class _Scores:
    """The last ``window`` scores, sorted as well, for their conformal quantile in O(log n) per update."""

    def __init__(self, window: int):
        self._window: deque[float] = deque(maxlen=window)
        self.sorted: list[float] = []

    def add(self, score: float) -> None:
        if len(self._window) == self._window.maxlen:
            del self.sorted[bisect_left(self.sorted, self._window[0])]
        self._window.append(score)
        insort(self.sorted, score)

    def quantile(self, level: float) -> float | None:
        """The conformal ``level``-quantile of n scores: the ⌈level·(n + 1)⌉-th smallest (None: too few)."""
        k = math.ceil(level * (len(self.sorted) + 1)) - 1
        return self.sorted[k] if k < len(self.sorted) else None


class CalibratedUpper:
    EDGES_S = (0.1, 0.4, 1.6, 6.4)  # the classes of a point's magnitude (seconds)

    def __init__(self, target: float = 0.9, lr: float = 0.1, window: int = 500, min_scores: int = 30,
                 floor_s: float = 0.001):
        if not 0 < target < 1 or not 0 < lr <= 1 or window < 1 or min_scores < 1:
            raise ValueError("target is a fraction in (0, 1), lr in (0, 1], window and min_scores positive counts")
        self.target, self.lr, self.min_scores, self.floor_s = target, lr, min_scores, floor_s
        self._all = _Scores(window)
        self._classes = [_Scores(window) for _ in range(len(self.EDGES_S) + 1)]
        self.integrators = [0.0] * len(self._classes)  # I per class (log units)
        self.predictions = 0  # observations with a bound made before them, and how many it covered
        self.covered = 0
        self.unbounded = 0  # observations whose bound was infinite (before nine scores)

    def _class(self, point: float) -> int:
        return bisect_left(self.EDGES_S, point)

    def _scores(self, c: int) -> _Scores:
        return self._classes[c] if len(self._classes[c].sorted) >= self.min_scores else self._all

    def upper(self, point: float) -> float | None:
        """The bound for a request whose point prediction is ``point`` seconds (None: unbounded). O(1)."""
        c = self._class(point)
        q = self._scores(c).quantile(self.target)
        if q is None:
            return None
        return max(point, self.floor_s) * math.exp(min(q + self.integrators[c], 50.0))

    def observe(self, point: float, observed: float, upper: float | None) -> None:
        """The request predicted ``point`` (and bounded by ``upper``, as ``upper`` said then) took ``observed``.
        O(window) at worst (the sorted window's insertion), O(log window) comparisons."""
        if not (math.isfinite(point) and math.isfinite(observed)) or point < 0 or observed < 0:
            return
        c = self._class(point)
        if upper is None:
            self.unbounded += 1
        else:
            miss = observed > upper
            self.predictions += 1
            self.covered += not miss
            scores = self._scores(c)
            high, mid = scores.quantile(0.95), scores.quantile(0.5)
            spread = max(high - mid, 0.05) if high is not None and mid is not None else 0.05  # (few scores yet)
            self.integrators[c] += self.lr * spread * (miss - (1.0 - self.target))
        score = math.log(max(observed, self.floor_s) / max(point, self.floor_s))
        self._all.add(score)
        self._classes[c].add(score)

    @property
    def coverage(self) -> float | None:
        """The fraction of observations the finite bound made before them covered (None before any)."""
        return self.covered / self.predictions if self.predictions else None
