"""Policy objects for a simulated workload: the shared factory, fed with what the workload's history teaches
(per-(app, stage) token statistics for WSC; OIT's and RPM's limits at the p99 of normal behaviour)."""

from __future__ import annotations

import math

from fairgate.accounting.app_stats import AppStats, suggest_limits
from fairgate.accounting.cost import CostFunction
from fairgate.policies.factory import FairServeConfig, make_scheduler
from fairgate.policies.scheduler import Scheduler
from fairgate.sim.workload import Workload


def learn_stats(w: Workload) -> AppStats:
    """The warm-up slice (or, without one, the workload's own calls) as the statistics' history."""
    stats = AppStats(min_samples=3)
    for r in w.history or w.requests:
        stats.observe(r.app, r.stage, r.prompt_len - r.system_len, r.system_len, r.output_len, now=0.0)
    return stats


def limits(w: Workload) -> dict:
    if w.limits:
        return w.limits
    reqs = w.history or w.requests
    lim = suggest_limits((r.arrival, r.client, r.app) for r in reqs if r.arrival != math.inf)
    return {"user_rpm": lim.user_rpm, "app_rpm": lim.app_rpm}


def scheduler_for(w: Workload, policy: str, cost: CostFunction, *, charge: str = "admit",
                  alpha: float = 1.0, beta: float = 2.0, gamma: float = 1.0,
                  params: dict[str, float] | None = None) -> tuple[Scheduler, AppStats]:
    stats = learn_stats(w)
    lim = limits(w)
    app_rpm = lim.get("app_rpm") or {}
    fs = FairServeConfig(alpha, beta, gamma, charge, user_limit=lambda _u: lim.get("user_rpm"),
                         app_limit=lambda a: app_rpm.get(a))

    def build() -> Scheduler:
        return make_scheduler(policy, cost, lambda c: w.weights.get(c, 1.0), stats=stats, fairserve=fs,
                              rpm_limit=int(lim.get("user_rpm") or 20), params=params)

    if w.bands:  # priority bands over the policy, as the gateway runs them (policies/bands.py)
        from fairgate.policies.bands import Banded

        return Banded(build, w.min_shares), stats
    return build(), stats


def split_params(placement: str, params: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """``--set`` values: those the placement names are its own, the rest the policy's."""
    from fairgate.policies.factory import PLACEMENT_PARAMS

    mine = PLACEMENT_PARAMS.get(placement, ())
    return ({k: v for k, v in params.items() if k not in mine}, {k: v for k, v in params.items() if k in mine})


def simulator_for(w: Workload, policy: str, placement: str, profile, *, mode: str = "engine", backends: int = 1,
                  cost: CostFunction, charge: str = "admit", params: dict[str, float] | None = None, **kw):
    """The simulator a command line names. Engine mode with several backends is the distributed setting: each
    engine runs its own copy of the policy, and the placement routes each request as it arrives
    (``ClusterSimulator``); gateway mode queues in the gateway and places each request it releases. A simulated
    request's max_tokens is its true output length: no placement reads it (``read_max_tokens=False``)."""
    from fairgate.policies.factory import make_placement
    from fairgate.sim.simulator import Simulator

    policy_params, placement_params = split_params(placement, params or {})
    weights = lambda c: w.weights.get(c, 1.0)  # noqa: E731
    scheduler, stats = scheduler_for(w, policy, cost, charge=charge, params=policy_params)
    if placement == "aladdin":
        if mode != "gateway":
            raise ValueError("the aladdin placement runs in gateway mode (--mode gateway): it holds a request in "
                             "the gateway when no backend can meet its targets")
        from fairgate.policies.aladdin import Aladdin

        sim = Simulator(w, scheduler, profile, mode=mode, backends=backends, cost=cost, stats=stats, **kw)
        models = [p.latency for p in sim.profiles]  # (each engine its own)
        sim.placement = Aladdin(lambda name: models[int(name)], max_batch=profile.max_num_seqs,  # (each request
                                read_max_tokens=False, **placement_params)  # its client's targets; its max_tokens:
        # the true output, not read)
        return sim
    if mode == "engine" and backends > 1:
        from fairgate.sim.cluster import ClusterSimulator

        local = [scheduler] + [scheduler_for(w, policy, cost, charge=charge, params=policy_params)[0]
                               for _ in range(backends - 1)]
        sim = ClusterSimulator(w, local, profile, placement=None, cost=cost, stats=stats, **kw)
        sim.placement = make_placement(placement, sim.match, placement_params, weights, read_max_tokens=False)
        return sim
    sim = Simulator(w, scheduler, profile, mode=mode, backends=backends, cost=cost, stats=stats, **kw)
    sim.placement = make_placement(placement, None, placement_params, weights, read_max_tokens=False)
    return sim
