"""`fairgate plan`: the fewest workers that serve a workload at its latency targets (Aladdin §3.7, Eq. 7's
question answered by simulation rather than by its closed form; docs/simulator/index.md#plan).

For each placement, the workload is simulated in gateway mode on W workers, W doubling from 1 until the SLO
attainment (sim/targets.py) reaches the target, then bisected between the last W that missed and the first that met
it: O(log W) runs. Attainment is taken as rising with W (more workers never serve a request later under these
placements); a search that reaches ``max_workers`` without meeting the target says so (``workers: None``).

``rate`` rescales the workload's arrivals to that many requests per second (its arrival times and its duration
are scaled by one factor; lengths, clients and programs stay as they are). Over several rates, ``scaling``
fits Eq. 7's line, W = k5·λ + c5, by least squares, with its R² (Aladdin's check A11: the worker count is
linear in the rate above a small one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fairgate.sim.targets import Slo, summary
from fairgate.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Plan:
    placement: str
    workers: int | None  # None: not met with max_workers
    attainment: float  # at ``workers`` (or at max_workers when not met)
    rate: float  # requests per second offered
    gpus_per_worker: int = 1

    def row(self) -> dict:
        return {"placement": self.placement, "workers": self.workers, "attainment": self.attainment,
                "rate": self.rate, "gpus": None if self.workers is None else self.workers * self.gpus_per_worker}


def mean_lengths(w: Workload) -> tuple[float, float]:
    """The workload's mean prompt and output lengths (Eq. 6's l_in and l_out)."""
    n = max(1, len(w.requests))
    return sum(r.prompt_len for r in w.requests) / n, sum(r.output_len for r in w.requests) / n


def rate_of(w: Workload) -> float:
    """Requests per second the workload offers over its duration (its calls with a static arrival)."""
    return len(w.requests) / w.duration_s if w.duration_s else 0.0


def rescale(w: Workload, rate: float) -> Workload:
    """``w`` with its arrivals compressed or stretched so that it offers ``rate`` requests per second."""
    if rate <= 0:
        raise ValueError("--rate must be a positive number of requests per second")
    factor = rate_of(w) / rate
    for r in w.requests:
        r.arrival *= factor
    w.duration_s *= factor
    return w


def with_slo(w: Workload, slo: Slo | None) -> Workload:
    """``w`` judged by ``slo`` for every client (None: by the workload's own targets)."""
    if slo is not None:
        w.slo, w.slos = slo, {}
    return w


def attainment(run: Callable[[int], Workload], workers: int) -> float:
    w = run(workers)
    return summary(w.requests, w.slo_for)["attainment"]


def fewest_workers(run: Callable[[int], Workload], target: float, max_workers: int) -> tuple[int | None, float]:
    """The fewest W ≤ max_workers whose run attains ``target`` and its attainment (None and the attainment at
    max_workers if none does). ``run(W)`` simulates on W workers and returns the workload it filled in."""
    seen: dict[int, float] = {}

    def at(k: int) -> float:
        if k not in seen:
            seen[k] = attainment(run, k)
        return seen[k]

    low, high = 0, 1  # low: the largest W known to miss (0: none yet); high: the next to try
    while at(high) < target:
        if high >= max_workers:
            return None, at(high)
        low, high = high, min(2 * high, max_workers)
    while high - low > 1:  # bisect: low misses, high meets
        mid = (low + high) // 2
        if at(mid) >= target:
            high = mid
        else:
            low = mid
    return high, at(high)


def scaling(points: list[tuple[float, int]]) -> dict[str, float] | None:
    """Eq. 7 over (rate, workers) points: ``{"k5", "c5", "r2"}`` (None with fewer than 3 points or one rate)."""
    if len(points) < 3:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    k5 = sum((x - mx) * (y - my) for x, y in points) / sxx
    c5 = my - k5 * mx
    syy = sum((y - my) ** 2 for _, y in points)
    sse = sum((y - (k5 * x + c5)) ** 2 for x, y in points)
    return {"k5": k5, "c5": c5, "r2": 1.0 - sse / syy if syy else 1.0}


def plot(rows: list[dict], fits: dict[str, dict | None], path: str) -> None:
    """Workers against rate per placement, with each placement's Eq. 7 line, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for placement in dict.fromkeys(r["placement"] for r in rows):
        pts = sorted((r["rate"], r["workers"]) for r in rows if r["placement"] == placement and r["workers"])
        line = ax.plot([x for x, _ in pts], [y for _, y in pts], "o", label=placement)[0]
        fit = fits.get(placement)
        if fit is not None and pts:
            xs = [pts[0][0], pts[-1][0]]
            ax.plot(xs, [fit["k5"] * x + fit["c5"] for x in xs], "-", color=line.get_color(), alpha=0.6,
                    label=f"{placement}: {fit['k5']:.2f}·λ {fit['c5']:+.1f} (R² {fit['r2']:.3f})")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("workers needed")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
