"""Latency models of one backend, of Aladdin's linear forms (§3, Eqs. 2-3), fitted online with prediction
intervals (docs/operations/metrics.md#latency-models):

  prefill  t_p = k1·l_in + c1            (l_in: the prompt tokens it computes, its cached prefix excluded)
  decode   t_d = k2·L_tot + c2·b + c3    (one step of a batch of b requests holding L_tot context tokens)

Each is least squares over what the backend was seen to do, every older observation weighing ``forget`` times
less than the next (so a fit follows a backend whose speed changes), seeded with an engine profile's
coefficients as ``prior_weight`` pseudo-observations spread over its range (so a new backend starts from the
profile, and its own observations take over). The residual spread gives a prediction interval: mean ± z·σ.
Backends of different speeds each have their own fit. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

Z90 = 1.645  # a two-sided 90 % interval's half-width, in standard deviations


class OnlineFit:
    """y ≈ β·x by exponentially weighted least squares over the normal equations (n ≤ 3: solved directly),
    with β ≥ 0 (every term of Aladdin's forms is a cost).

    A prior (``observe(..., real=False)``: an engine profile's line at a few points of its range) stands
    where nothing has been seen. It is kept apart and scaled by ``scale``, what the backend was seen to take
    over what the prior predicts for the same work, so a backend 10× faster than its profile, seen only one
    request at a time, is believed 10× faster where it was not seen too, instead of bending the line between
    the two (which extrapolated a step below zero at batch 7). The prior fades as real observations come."""

    def __init__(self, n: int, forget: float = 0.999, ridge: float = 1e-9):
        self.n, self.forget, self.ridge = n, forget, ridge
        self.xx = [[0.0] * n for _ in range(n)]  # the real observations' sums
        self.xy = [0.0] * n
        self.yy = 0.0
        self.w = 0.0  # effective number of observations (real, and the prior as it fades)
        self.samples = 0  # real ones (not the prior's)
        self._pxx = [[0.0] * n for _ in range(n)]  # the prior's sums, as seeded
        self._pxy = [0.0] * n
        self._pyy = 0.0
        self._pw, self._fade = 0.0, 1.0  # its weight, and how much of it is left
        self._prior_beta: list[float] | None = None
        self._seen, self._expected = 0.0, 0.0  # Σ y and Σ prior(x) over the real observations, faded alike
        self._beta: list[float] | None = None  # β and σ, refitted at most every REFIT real observations
        self._sigma = 0.0
        self._since = 0  # real observations since they were

    REFIT = 8  # a fit is read on every streamed read (the plausibility check) and by every prediction; with
    # older observations weighing 0.999 less per observation, eight more move it by under 1 %

    def observe(self, x: Sequence[float], y: float, weight: float = 1.0, real: bool = True) -> None:
        if not real:
            if self.samples:
                raise ValueError("a prior is seeded before any real observation")
            for i in range(self.n):
                for j in range(self.n):
                    self._pxx[i][j] += weight * x[i] * x[j]
                self._pxy[i] += weight * x[i] * y
            self._pyy += weight * y * y
            self._pw += weight
            self.w += weight
            self._prior_beta = self._beta = None
            return
        f = self.forget
        for i in range(self.n):
            row = self.xx[i]
            for j in range(self.n):
                row[j] = row[j] * f + weight * x[i] * x[j]
            self.xy[i] = self.xy[i] * f + weight * x[i] * y
        self.yy = self.yy * f + weight * y * y
        self.w = self.w * f + weight
        self._fade *= f
        if self._pw:
            if self._prior_beta is None:
                self._prior_beta = _non_negative(self._pxx, self._pxy, self.ridge)
            self._seen = self._seen * f + weight * y
            self._expected = self._expected * f + weight * sum(b * v for b, v in zip(self._prior_beta, x))
        self.samples += 1
        self._since += 1

    @property
    def scale(self) -> float:
        """What the backend was seen to take over what the prior predicts (1 until something is seen)."""
        return self._seen / self._expected if self._expected > 0 and self._seen > 0 else 1.0

    def _sums(self) -> tuple[list[list[float]], list[float], float]:
        """The normal equations' sums: the real observations' and the fading prior's, scaled."""
        if not self._pw:
            return self.xx, self.xy, self.yy
        d, s = self._fade, self.scale
        return ([[v + d * p for v, p in zip(row, prow)] for row, prow in zip(self.xx, self._pxx)],
                [v + d * s * p for v, p in zip(self.xy, self._pxy)], self.yy + d * s * s * self._pyy)

    def coefficients(self, refit_after: int | None = None) -> list[float] | None:
        """β, refitted first if ``refit_after`` (``REFIT``) real observations came since it was."""
        if (self._beta is None or self._since >= (self.REFIT if refit_after is None else refit_after)) \
                and self.w > 0:
            xx, xy, yy = self._sums()
            self._beta, self._since = _non_negative(xx, xy, self.ridge), 0
            # the residual standard deviation (0 until there is more than one observation per coefficient)
            sse = yy + _loss(self._beta, xx, xy)
            self._sigma = math.sqrt(max(0.0, sse) / (self.w - self.n)) if self.w > self.n else 0.0
        return self._beta

    def sigma(self) -> float:
        return self._sigma if self.coefficients() is not None else 0.0

    def mean(self, x: Sequence[float], refit_after: int | None = None) -> float:
        beta = self.coefficients(refit_after) or [0.0] * self.n
        return sum(b * v for b, v in zip(beta, x))

    def predict(self, x: Sequence[float]) -> tuple[float, float]:
        """(mean, half-width of the 90 % prediction interval)."""
        return self.mean(x), Z90 * self.sigma()


def _loss(beta: Sequence[float], xx: list[list[float]], xy: list[float]) -> float:
    """Σ(y − βx)² − Σy² = βᵀ(xx)β − 2βᵀxy, from the normal equations' sums."""
    return (sum(beta[i] * row[j] * beta[j] for i, row in enumerate(xx) for j in range(len(beta)))
            - 2 * sum(b * v for b, v in zip(beta, xy)))


def _non_negative(xx: list[list[float]], xy: list[float], ridge: float) -> list[float]:
    """argmin Σ(y − βx)² over β ≥ 0, from the normal equations: the free solution if it is non-negative, else
    the best with some coefficients held at 0 (n ≤ 3: at most 7 small solves, and only then)."""
    n = len(xy)
    best: list[float] | None = None
    best_loss = math.inf
    for mask in range((1 << n) - 1, 0, -1):  # all free first
        free = [i for i in range(n) if mask >> i & 1]
        sub = _solve([[xx[i][j] + (ridge if i == j else 0.0) for j in free] for i in free], [xy[i] for i in free])
        if sub is None or min(sub) < 0:
            continue
        beta = [0.0] * n
        for i, v in zip(free, sub):
            beta[i] = v
        if mask == (1 << n) - 1:
            return beta
        loss = _loss(beta, xx, xy)
        if loss < best_loss:
            best, best_loss = beta, loss
    return best if best is not None else [0.0] * n


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """A backend's prefill t_p = k1·l_in + c1 (Eq. 2) and decode step t_d = k2·L_tot + c2·b + c3 (Eq. 3): an
    engine profile's (engine/engine_profile.py ``latency``), a fit's as it stands (``BackendLatency.model``), and
    what Aladdin's placement plans with (policies/aladdin.py)."""

    k1: float
    c1: float
    k2: float
    c2: float
    c3: float

    def prefill(self, l_in: float) -> float:
        return self.k1 * l_in + self.c1

    def step(self, batch: int, context: float) -> float:
        return self.k2 * context + self.c2 * batch + self.c3

    def context_budget(self, batch: int, atgt_s: float) -> float:
        """l_d(b): the total context a batch of b may hold with each step within ``atgt_s`` (Aladdin, Eq. 4); with
        a fitted k2 ≤ 0, any context if the rest of the step is within it, else none."""
        left = atgt_s - self.c3 - self.c2 * batch
        if self.k2 > 0:
            return left / self.k2
        return math.inf if left >= 0 else -math.inf


class BackendLatency:
    """One backend's prefill and decode fits, seeded by ``seed`` (an engine profile's coefficients)."""

    def __init__(self, seed: LatencyModel, prior_weight: float = 20.0, forget: float = 0.999,
                 max_prompt: int = 4096, max_context: int = 100_000, max_batch: int = 64):
        self.prefill, self.decode = OnlineFit(2, forget), OnlineFit(3, forget)
        self._off: dict[int, tuple[int, float | None]] = {}  # per fit, the observations in a row too far off
        # its prediction, and since when
        for k in range(5):  # the prior: the profile's line, at a few points of its range
            l_in = max_prompt * (k + 1) / 5
            self.prefill.observe((l_in, 1.0), seed.k1 * l_in + seed.c1, prior_weight / 5, real=False)
            for b in (1, max_batch // 2, max_batch):
                ctx = max_context * (k + 1) / 5 * b / max_batch
                self.decode.observe((ctx, b, 1.0), seed.k2 * ctx + seed.c2 * b + seed.c3, prior_weight / 15,
                                    real=False)

    OUTLIER = 10.0  # an observation more than this many times off the prediction is not learnt from (a stall,
    # a restart, a queue inside the backend): the fit still follows a backend that drifts, a step at a time;
    STREAK, STREAK_S = 20, 10.0  # unless that many in a row are off, over at least that long (``now`` given;
    # one stall is seen by every stream of the batch at once): then the backend is not what its fit says (a
    # profile far from its hardware), and they are learnt until the fit has caught up

    def _plausible(self, fit: OnlineFit, predicted: float, seconds: float, now: float | None) -> bool:
        if predicted <= 0 or predicted / self.OUTLIER <= seconds <= predicted * self.OUTLIER:
            self._off.pop(id(fit), None)
            return True
        count, since = self._off.get(id(fit), (0, now))
        self._off[id(fit)] = (count + 1, since)
        return count + 1 >= self.STREAK and (now is None or since is None or now - since >= self.STREAK_S)

    CHECK_REFIT = 64  # the plausibility check (a factor of OUTLIER either way) reads a fit refitted at most this
    # many observations ago (~6 % of its memory), not every REFIT: streamed reads no longer pay for the refits

    def observe_prefill(self, l_in: int, seconds: float, now: float | None = None) -> None:
        if 0 <= l_in < 10_000_000 and 0 < seconds < 3600 \
                and self._plausible(self.prefill, self.prefill.mean((float(l_in), 1.0), self.CHECK_REFIT), seconds,
                                    now):
            self.prefill.observe((float(l_in), 1.0), seconds)

    def observe_step(self, batch: int, context: int, seconds: float, now: float | None = None) -> None:
        if 1 <= batch < 1_000_000 and 0 <= context < 1e12 and 0 < seconds < 60 \
                and self._plausible(self.decode, self.decode.mean((float(context), float(batch), 1.0),
                                                                  self.CHECK_REFIT), seconds, now):
            self.decode.observe((float(context), float(batch), 1.0), seconds)

    def prefill_time(self, l_in: int) -> tuple[float, float]:
        return self.prefill.predict((float(l_in), 1.0))

    def step_time(self, batch: int, context: int) -> tuple[float, float]:
        return self.decode.predict((float(context), float(batch), 1.0))

    def model(self) -> LatencyModel:
        """The fit as it stands, as a model."""
        (k1, c1), (k2, c2, c3) = self.prefill.coefficients(), self.decode.coefficients()
        return LatencyModel(k1, c1, k2, c2, c3)
