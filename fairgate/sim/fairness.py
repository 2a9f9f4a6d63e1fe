"""The VTC paper's fairness metrics, computed as its artifact does (docs/simulator/index.md#fairness-metrics),
plus Jain's index.

Service attribution: a request's cost (h(p, o); p + 2o by default) is spread uniformly over
[first token, finish]. Windowed service and demand are rates (per second) over a 60 s window.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable

from fairgate.accounting.cost import CostFunction, LinearCost
from fairgate.sim.workload import SimRequest

LINEAR = LinearCost()


@dataclass(frozen=True, slots=True)
class _Span:
    client: str
    start: float
    end: float
    cost: float
    arrival: float
    demand: float


def _spans(reqs: Iterable[SimRequest], cost: CostFunction, min_finish: float = 0.0,
           refused_demand: bool = False) -> list[_Span]:
    """Each served request's service over [first token, finish] and its demand at its arrival; with
    ``refused_demand``, a refused request's demand too (no service)."""
    out = []
    for r in reqs:
        if r.rejected and refused_demand:
            out.append(_Span(r.client, r.arrival, r.arrival + 1.0, 0.0, r.arrival,
                             LINEAR.h(r.prompt_len, r.output_len)))
            continue
        if r.rejected or r.finished is None or r.first_token is None:
            continue
        if r.finished <= r.first_token or r.finished < min_finish:
            continue
        out.append(_Span(r.client, r.first_token, r.finished, cost.h(r.prompt_len, r.output_len), r.arrival,
                         LINEAR.h(r.prompt_len, r.output_len)))
    return out


def _overlap(s: _Span, a: float, b: float) -> float:
    return max(0.0, min(b, s.end) - max(a, s.start)) / (s.end - s.start)


def windowed(spans: list[_Span], clients: list[str], a: float, b: float) -> tuple[dict[str, float], dict[str, float]]:
    """(service, demand) per client over [a, b), both per second of the window."""
    width = b - a
    service = dict.fromkeys(clients, 0.0)
    demand = dict.fromkeys(clients, 0.0)
    for s in spans:
        if s.client not in service:  # a client not asked for (figures show at most 8)
            continue
        if s.end > a and s.start < b:
            service[s.client] += s.cost * _overlap(s, a, b) / width
        if a <= s.arrival < b:
            demand[s.client] += s.demand / width
    return service, demand


def service_difference(reqs: list[SimRequest], clients: list[str], cost: CostFunction = LINEAR,
                       horizon: float = 600.0, ticks: int = 20, window: float = 60.0,
                       warmup: float = 30.0, weights: dict[str, float] | None = None, min_finish: float = 1.0,
                       refused_demand: bool = False) -> dict[str, float]:
    """Max / Avg Diff and Diff Var of Tables 2-6: at each tick, Σ_j min(max_s − s_j, |r_j − s_j|); with
    ``weights``, each client's service and demand divided by its weight (a share it is owed, not a gap); with
    ``refused_demand``, refused requests count in their client's demand (what it asked, not only what it got).
    The paper's artifact drops requests that finish in the first second (``min_finish``) and refusals."""
    spans = _spans(reqs, cost, min_finish=min_finish, refused_demand=refused_demand)
    diffs = []
    for k in range(1, ticks):
        x = (horizon - warmup) / ticks * k
        s, r = windowed(spans, clients, x, x + window)
        if weights:
            s = {c: v / weights.get(c, 1.0) for c, v in s.items()}
            r = {c: v / weights.get(c, 1.0) for c, v in r.items()}
        top = max(s.values()) if s else 0.0
        diffs.append(sum(min(top - s[c], abs(r[c] - s[c])) for c in clients))
    if not diffs:
        return {"max_diff": 0.0, "avg_diff": 0.0, "diff_var": 0.0}
    return {"max_diff": max(diffs), "avg_diff": statistics.fmean(diffs), "diff_var": statistics.pvariance(diffs)}


def accumulated(reqs: list[SimRequest], clients: list[str], x: float, cost: CostFunction = LINEAR,
                start: float = 0.0, min_finish: float = 1.0) -> dict[str, float]:
    """W_i(start, x): each client's service received in [start, x) under the artifact's attribution."""
    out = dict.fromkeys(clients, 0.0)
    for s in _spans(reqs, cost, min_finish=min_finish):
        if s.end > start and s.start < x:
            out[s.client] += s.cost * _overlap(s, start, x)
    return out


def abs_diff_curve(reqs: list[SimRequest], clients: list[str], horizon: float, cost: CostFunction = LINEAR,
                   ticks: int = 20, min_finish: float = 1.0) -> list[tuple[float, float]]:
    """Figs 3a/7b/8b: max_i W_i(0, x) − min_i W_i(0, x) at x = horizon/ticks·k. Fig 15 (`plot_6.4`) drops
    requests finishing before 120 s (``min_finish=120``) and starts its axis there."""
    out = []
    for k in range(1, ticks):
        x = horizon / ticks * k
        if x < min_finish:
            continue
        w = accumulated(reqs, clients, x, cost, min_finish=min_finish)
        out.append((x, max(w.values()) - min(w.values())))
    return out


def jain(values: list[float]) -> float:
    values = [v for v in values]
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def service_curves(reqs: list[SimRequest], clients: list[str], horizon: float, cost: CostFunction = LINEAR,
                   ticks: int = 30, window: float = 60.0) -> dict[str, list[tuple[float, float]]]:
    """Figs 3b-10: received service per client in a window around each tick (weighted tokens/s)."""
    spans = _spans(reqs, cost)
    curves: dict[str, list[tuple[float, float]]] = {c: [] for c in clients}
    for k in range(1, ticks):
        x = horizon / ticks * k
        s, _ = windowed(spans, clients, x - window / 2, x + window / 2)
        for c in clients:
            curves[c].append((x, s[c]))
    return curves


def response_curves(reqs: list[SimRequest], clients: list[str], horizon: float, ticks: int = 30,
                    window: float = 60.0) -> dict[str, list[tuple[float, float | None]]]:
    """Mean first-token latency of requests whose first token falls in the window (gaps when none)."""
    curves: dict[str, list[tuple[float, float | None]]] = {c: [] for c in clients}
    for k in range(1, ticks):
        x = horizon / ticks * k
        a, b = x - window / 2, x + window / 2
        for c in clients:
            lat = [r.first_token - r.arrival for r in reqs if r.client == c and r.first_token is not None
                   and a <= r.first_token < b]
            curves[c].append((x, statistics.fmean(lat) if lat else None))
    return curves
