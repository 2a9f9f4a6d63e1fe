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
    """y ≈ β·x by exponentially weighted least squares over the normal equations (n ≤ 3: solved directly)."""

    def __init__(self, n: int, forget: float = 0.999, ridge: float = 1e-9):
        self.n, self.forget, self.ridge = n, forget, ridge
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n
        self.yy = 0.0
        self.w = 0.0  # effective number of observations
        self.samples = 0  # real ones (not the prior's)
        self._beta: list[float] | None = None

    def observe(self, x: Sequence[float], y: float, weight: float = 1.0, real: bool = True) -> None:
        f = self.forget
        for i in range(self.n):
            row = self.xx[i]
            for j in range(self.n):
                row[j] = row[j] * f + weight * x[i] * x[j]
            self.xy[i] = self.xy[i] * f + weight * x[i] * y
        self.yy = self.yy * f + weight * y * y
        self.w = self.w * f + weight
        self.samples += real
        self._beta = None

    def coefficients(self) -> list[float] | None:
        if self._beta is None and self.w > 0:
            self._beta = _solve([[v + (self.ridge if i == j else 0.0) for j, v in enumerate(row)]
                                 for i, row in enumerate(self.xx)], list(self.xy))
        return self._beta

    def sigma(self) -> float:
        """The residual standard deviation (0 until there is more than one observation per coefficient)."""
        beta = self.coefficients()
        if beta is None or self.w <= self.n:
            return 0.0
        # Σ(y − βx)² = yy − 2βᵀxy + βᵀ(xx)β
        quad = sum(beta[i] * self.xx[i][j] * beta[j] for i in range(self.n) for j in range(self.n))
        sse = self.yy - 2 * sum(b * v for b, v in zip(beta, self.xy)) + quad
        return math.sqrt(max(0.0, sse) / (self.w - self.n))

    def mean(self, x: Sequence[float]) -> float:
        beta = self.coefficients() or [0.0] * self.n
        return sum(b * v for b, v in zip(beta, x))

    def predict(self, x: Sequence[float]) -> tuple[float, float]:
        """(mean, half-width of the 90 % prediction interval)."""
        return self.mean(x), Z90 * self.sigma()


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
class Coefficients:
    k1: float
    c1: float
    k2: float
    c2: float
    c3: float


class BackendLatency:
    """One backend's prefill and decode fits, seeded by ``seed`` (an engine profile's coefficients)."""

    def __init__(self, seed: Coefficients, prior_weight: float = 20.0, forget: float = 0.999,
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

    def observe_prefill(self, l_in: int, seconds: float, now: float | None = None) -> None:
        if 0 <= l_in < 10_000_000 and 0 < seconds < 3600 \
                and self._plausible(self.prefill, self.prefill.mean((float(l_in), 1.0)), seconds, now):
            self.prefill.observe((float(l_in), 1.0), seconds)

    def observe_step(self, batch: int, context: int, seconds: float, now: float | None = None) -> None:
        if 1 <= batch < 1_000_000 and 0 <= context < 1e12 and 0 < seconds < 60 \
                and self._plausible(self.decode, self.decode.mean((float(context), float(batch), 1.0)), seconds, now):
            self.decode.observe((float(context), float(batch), 1.0), seconds)

    def prefill_time(self, l_in: int) -> tuple[float, float]:
        return self.prefill.predict((float(l_in), 1.0))

    def step_time(self, batch: int, context: int) -> tuple[float, float]:
        return self.decode.predict((float(context), float(batch), 1.0))

    def coefficients(self) -> Coefficients:
        (k1, c1), (k2, c2, c3) = self.prefill.coefficients(), self.decode.coefficients()
        return Coefficients(k1, c1, k2, c2, c3)
