"""`fairgate plan`: the fewest workers that serve a workload at its latency targets (Aladdin §3.7, Eq. 7's
question answered by simulation rather than by its closed form; docs/simulator/index.md#plan).

For each placement, the workload is simulated in gateway mode on W workers, W doubling from 1 until the SLO
attainment (sim/slo.py) reaches the target, then bisected between the last W that missed and the first that met
it: O(log W) runs. Attainment is taken as rising with W (more workers never serve a request later under these
placements); a search that reaches ``max_workers`` without meeting the target says so (``workers: None``).

``rate`` rescales the workload's arrivals to that many requests per second (its arrival times and its duration
are scaled by one factor; lengths, clients and programs stay as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fairgate.sim.slo import Slo, summary
from fairgate.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Plan:
    placement: str
    workers: int | None  # None: not met with max_workers
    attainment: float  # at ``workers`` (or at max_workers when not met)
    rate: float  # requests per second offered

    def row(self) -> dict:
        return {"placement": self.placement, "workers": self.workers, "attainment": self.attainment,
                "rate": self.rate}


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
