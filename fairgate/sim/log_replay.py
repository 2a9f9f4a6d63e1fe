"""What-if replay of the usage log (`fairgate replay`, docs/simulator/replay.md): the requests the gateway served —
arrival, tenant, app, interaction and stage, prompt and output tokens — run through the simulator under each
configuration asked for (policy, placement, backends), side by side with what really happened.

Both sides are summarised alike (``summary``): per tenant the service it received while requests were still
arriving (at the policy's cost h, each request's in proportion to its time running before the last arrival:
a policy's choice shows while tenants compete, not once everything is done), its p90 queue wait (arrival to
dispatch) and its requests; over all, Jain's index of that service over the tenants' weights, throughput, and
the interactions refused, the SLO attainment of the requests whose app had an SLO class (the targets each tenant's
rows carried, met or not as the log says or the simulation finds) and each backend's share of the tokens.
``speed`` is how much faster than the engine profile the logged backends ran (an
emulated backend's ``speed``): the simulator runs the log's arrivals that much closer together, and its times
are reported back on the log's clock. Pure: rows are plain dicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable

from fairgate.accounting.cost import make_cost
from fairgate.sim.from_log import client_of, served_rows, when
from fairgate.sim.limits import LimitTable, SimLimits
from fairgate.sim.setup import simulator_for
from fairgate.sim.targets import Slo, attained
from fairgate.sim.workload import Workload


@dataclass(frozen=True)
class Setup:
    """One configuration to replay under."""

    policy: str
    placement: str = "least-load"
    backends: int = 1

    @property
    def name(self) -> str:
        return f"{self.policy} · {self.placement} · {self.backends} backend{'s' if self.backends != 1 else ''}"


@dataclass
class Served:
    """One request as a summary reads it, on the log's clock."""

    client: str
    arrival: float
    dispatched: float | None
    prompt: int
    output: int
    interaction: str = ""
    refused: bool = False
    finished: float | None = None
    slo_met: bool | None = None  # None: its app had no SLO class
    backend: str | None = None


@dataclass
class Summary:
    name: str
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)
    jain: float = 1.0
    throughput: float = 0.0  # tokens a second, arrivals' start to the last request's dispatch (at least 1 s)
    refused_interactions: int = 0
    requests: int = 0
    slo_attainment: float | None = None  # met / requests with an SLO class (None: none had one)
    backend_shares: list[float] = field(default_factory=list)  # each backend's share of the tokens, largest first
    max_diff: float = 0.0  # the VTC paper's Max Diff over weights (``service_gap``)
    avg_diff: float = 0.0

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "requests": self.requests, "jain": round(self.jain, 4),
                "throughput_tokens_per_s": round(self.throughput, 1),
                "refused_interactions": self.refused_interactions,
                "slo_attainment": None if self.slo_attainment is None else round(self.slo_attainment, 4),
                "backend_shares": [round(x, 4) for x in self.backend_shares],
                "max_diff": round(self.max_diff, 1), "avg_diff": round(self.avg_diff, 1), "tenants": self.tenants}


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]


def summary(name: str, served: list[Served], weights: dict[str, float], cost: str = "weighted") -> Summary:
    """Per tenant: service while requests arrived, p90 queue wait, requests; and Jain's index over weights."""
    h = make_cost(cost).h
    end = max((s.arrival for s in served), default=0.0)
    start = min((s.arrival for s in served), default=0.0)
    out = Summary(name, requests=len(served))
    waits: dict[str, list[float]] = {}
    for s in served:
        t = out.tenants.setdefault(s.client, {"service": 0.0, "requests": 0, "p90_wait_s": 0.0, "p99_wait_s": 0.0})
        t["requests"] += 1
        if s.dispatched is None:
            continue
        waits.setdefault(s.client, []).append(s.dispatched - s.arrival)
        if s.dispatched < end:  # (its part served before the end, in proportion to its time running)
            done = 1.0 if s.finished is None or s.finished <= end else (end - s.dispatched) / (s.finished - s.dispatched)
            t["service"] += h(s.prompt, s.output) * done
    for client, t in out.tenants.items():
        t["p90_wait_s"] = round(_quantile(waits.get(client, []), 0.9), 4)
        t["p99_wait_s"] = round(_quantile(waits.get(client, []), 0.99), 4)
        t["service"] = round(t["service"], 1)
    shares = [t["service"] / weights.get(c, 1.0) for c, t in out.tenants.items()]
    out.jain = sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares)) if any(shares) else 1.0
    last = max((s.dispatched for s in served if s.dispatched is not None), default=start)
    out.throughput = sum(s.prompt + s.output for s in served if s.dispatched is not None) / max(last - start, 1.0)
    out.refused_interactions = len({s.interaction or id(s) for s in served if s.refused})
    judged: dict[str, list[bool]] = {}
    for s in served:
        if s.slo_met is not None:
            judged.setdefault(s.client, []).append(s.slo_met)
    for client, met in judged.items():
        out.tenants[client]["slo_attainment"] = round(sum(met) / len(met), 4)
    if judged:
        out.slo_attainment = sum(map(sum, judged.values())) / sum(map(len, judged.values()))
    out.max_diff, out.avg_diff = service_gap(served, weights, end - start, cost)
    tokens: dict[str, int] = {}
    for s in served:
        if s.backend is not None:
            tokens[s.backend] = tokens.get(s.backend, 0) + s.prompt + s.output
    total = sum(tokens.values())
    out.backend_shares = sorted((n / total for n in tokens.values()), reverse=True) if total else []
    return out


def service_gap(served: list[Served], weights: dict[str, float], span: float, cost: str = "weighted",
                ticks: int = 20) -> tuple[float, float]:
    """The VTC paper's Max and Avg Diff (sim/fairness.py ``service_difference``) over the arrivals' span, each
    tenant's service and demand over its weight: at each of ``ticks`` windows (a fifth of the span, at most a
    minute), how far the tenants fall short of the best-served one, each by no more than it asked (refused
    requests included: a limit's refusals show as a gap). Computed from the requests' dispatch and finish alike
    for what happened and for a replay. O(ticks · requests)."""
    from fairgate.sim.fairness import service_difference

    runs = [SimpleNamespace(client=s.client, arrival=s.arrival, first_token=s.dispatched, finished=s.finished,
                            prompt_len=s.prompt, output_len=s.output, rejected=s.refused) for s in served]
    window = min(60.0, span / 5) if span > 0 else 1.0
    diff = service_difference(runs, sorted({s.client for s in served}), make_cost(cost),  # type: ignore[arg-type]
                              horizon=span + window, ticks=ticks, window=window, warmup=window,
                              weights=weights, min_finish=0.0, refused_demand=True)
    return diff["max_diff"], diff["avg_diff"]


def logged(rows: Iterable[dict[str, Any]]) -> list[Served]:
    """What really happened to the requests a replay replays (``served_rows``), on the log's clock."""
    served = served_rows(rows)
    t0 = when(served[0]["arrival"])
    out = []
    for r in served:
        client = client_of(r)
        dispatched, finished = r.get("dispatched_at"), r.get("finished_at")
        out.append(Served(client, (when(r["arrival"]) - t0).total_seconds(),
                          None if dispatched is None else (when(dispatched) - t0).total_seconds(),
                          int(r["prompt_tokens"]), int(r["completion_tokens"]), r.get("interaction") or "",
                          finished=None if finished is None else (when(finished) - t0).total_seconds(),
                          slo_met=r.get("slo_met"), backend=r.get("backend")))
    return out


def simulate(w: Workload, setup: Setup, profile, speed: float = 1.0, cost: str = "weighted",
             params: dict[str, float] | None = None, limits: LimitTable | None = None,
             epoch0: float = 0.0) -> list[Served]:
    """``w`` (fresh: the simulator fills its requests in) under ``setup``, on the log's clock. Its tenants'
    targets (``w.slos``, on the log's clock) are scaled to the simulator's, as its arrivals are. With
    ``limits``, each request meets its app's and user's limits as it arrives (sim/limits.py), on the log's
    clock from ``epoch0`` (its first arrival, in epoch seconds)."""
    for r in w.requests:
        r.arrival *= speed
    w.slos = {c: Slo(s.ttft_s * speed, s.atgt_s * speed) for c, s in w.slos.items()}
    h = make_cost(cost)
    out = simulator_for(w, setup.policy, setup.placement, profile, mode="gateway", backends=setup.backends,
                        cost=h, params=params,
                        limits=SimLimits(limits, h, epoch0, speed, request_limits=setup.policy != "fairserve")
                        if limits else None).run()
    return [Served(r.client, r.arrival / speed, None if r.dispatched is None else r.dispatched / speed,
                   r.prompt_len, r.output_len, r.interaction, r.rejected or r.cancelled,
                   None if r.finished is None else r.finished / speed,
                   None if (slo := w.slos.get(r.client)) is None else attained(r, slo),
                   None if r.backend is None else str(r.backend)) for r in out.requests]


def replay(w: Workload, setup: Setup, profile, speed: float = 1.0, cost: str = "weighted",
           params: dict[str, float] | None = None, limits: LimitTable | None = None,
           epoch0: float = 0.0) -> Summary:
    return summary(setup.name, simulate(w, setup, profile, speed, cost, params, limits, epoch0), w.weights, cost)


def fitted_speed(real: list[Served], fresh, setup: Setup, profile, speed: float = 1.0, rounds: int = 5,
                 params: dict[str, float] | None = None) -> float:
    """The speed at which the profile's requests take as long, arrival to finish, as the log's did under the
    configuration that served them (``setup``): what the backends and the gateway between them really ran at,
    their waits included (a gateway that leaves a seat idle between two requests is slower than its backends).
    ``fresh()`` makes the workload anew. Found by the secant method on the log of the speed (the time taken
    falls with the speed, faster than in proportion once requests queue), in at most ``rounds`` simulations,
    within a factor of 8 of ``speed``; it stops within 1 %."""
    logged_s = sum(s.finished - s.arrival if s.finished is not None else 0.0 for s in real)
    if logged_s <= 0:
        return speed
    lo, hi = math.log(speed) - math.log(8), math.log(speed) + math.log(8)
    x, tried = math.log(speed), []
    for _ in range(rounds):
        simulated_s = sum(s.finished - s.arrival if s.finished is not None else 0.0  # (one it refused: as
                          for s in simulate(fresh(), setup, profile, math.exp(x), params=params))  # the log's)
        if simulated_s <= 0:
            break
        g = math.log(simulated_s / logged_s)  # > 0: the simulation is slower than the log, so speed it up
        tried.append((x, g))
        if abs(g) < 0.01:
            break
        if len(tried) >= 2 and tried[-1][1] != tried[-2][1]:
            (x0, g0), (x1, g1) = tried[-2], tried[-1]
            x = x1 - g1 * (x1 - x0) / (g1 - g0)
        else:
            x += 0.5 * g
        x = min(max(x, lo), hi)
    return math.exp(min(tried, key=lambda t: abs(t[1]))[0]) if tried else speed


def fewest_backends(rows: list[tuple[Setup, dict[str, Any]]], max_wait_s: float) -> dict[str, int | None]:
    """Per policy and placement, the fewest backends among those replayed that kept every tenant's p99 queue
    wait within ``max_wait_s`` (None: none did)."""
    best: dict[str, int | None] = {}
    for setup, row in sorted(rows, key=lambda x: x[0].backends):
        key = f"{setup.policy} · {setup.placement}"
        best.setdefault(key, None)
        if best[key] is None and all(t["p99_wait_s"] <= max_wait_s for t in row["tenants"].values()):
            best[key] = setup.backends
    return best
