"""FairServe-like scenarios (docs/simulator/index.md#the-fairserve-scenarios): the CoPilot trace is private,
so this generates one with its published shape —

- many apps whose prompt and output sizes differ by an order of magnitude (Fig. 3; Table 4's anchors 999 to
  14,854 prompt tokens, scaled by ``token_scale`` to fit the engine), with app-specific system prompts (Fig. 5);
- agent apps whose interactions fan out into several calls over stages (Fig. 4, Table 2: ~27 % of
  interactions have more than one call; 2-10 calls typical), single-call chat apps for the rest;
- heavy-tailed per-user rates (log-normal; Fig. 2: most users far below the p99), a few abusive users
  flooding a chat app at many times the normal range;
- a disjoint warm-up ("the previous day", without abusers) from which the per-(app, stage) statistics and
  the throttling limits are learned (docs/policies/fairserve.md#ambiguity-a7: limits at the p99 of normal
  per-minute counts).

Every scenario is written in the YAML workload format (``clients:`` with ``interaction:``), so a user can
dump, edit and rerun it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any, Callable

from fairgate.accounting.app_stats import suggest_limits
from fairgate.sim.workload import Workload, from_dict


@dataclass(frozen=True)
class Spec:
    apps: int = 10
    agent_apps: int = 5
    users: int = 200
    abusers: int = 3
    abuser_rate_per_min: float = 300.0
    median_rate_per_min: float = 1.5  # interactions per user per minute (log-normal median)
    max_rate_per_min: float = 6.0
    rate_sigma: float = 1.0
    duration_s: float = 600.0
    seed: int = 11
    token_scale: float = 0.1
    timeout_s: float | None = None
    think_s: float = 0.2
    engine: str = "a100-llama2-13b"
    limit_quantile: float = 0.99
    app_limit_headroom: float = 2.0  # an app limit is for app-wide floods: 2 × the p99 of its normal minutes


def _spread(mean: float, rel: float = 0.5) -> dict[str, Any]:
    m = max(1, int(round(mean)))
    return {"dist": "uniform", "low": max(1, int(m * (1 - rel))), "high": max(1, int(math.ceil(m * (1 + rel))))}


def scenario_dict(spec: Spec, *, abusers: bool = True, seed: int | None = None) -> dict[str, Any]:
    rng = random.Random(spec.seed)  # the apps and users are the same whatever the arrival seed
    apps = []
    agents = set(rng.sample(range(1, spec.apps), spec.agent_apps))  # not the most popular app
    for a in range(spec.apps):
        prompt = math.exp(rng.uniform(math.log(1000), math.log(15000))) * spec.token_scale
        apps.append({"name": f"app{a:02d}", "agent": a in agents, "prompt": prompt,
                     "system": prompt * rng.uniform(0.0, 0.5), "output": math.exp(rng.uniform(math.log(30),
                                                                                              math.log(300)))})
    for app in apps:
        if app["agent"]:  # a planner, 1-3 tool stages (one may fan out), an aggregator
            n_mid = rng.randint(1, 3)
            stages = [{"calls": 1, "f_in": 0.5, "f_out": 0.5}]
            stages += [{"calls": rng.choice((1, 1, 2, 3)), "f_in": 1.0, "f_out": 1.0} for _ in range(n_mid)]
            stages += [{"calls": 1, "f_in": 1.5, "f_out": 1.5}]
            app["stages"] = stages
    popularity = [1.0 / (k + 1) ** 0.8 for k in range(spec.apps)]
    clients = []
    for u in range(spec.users):
        app = apps[rng.choices(range(spec.apps), popularity)[0]]
        rate = min(spec.max_rate_per_min, spec.median_rate_per_min * math.exp(rng.gauss(0.0, spec.rate_sigma))) / 60.0
        clients.append(_client(f"u{u:03d}", app, rate))
    if abusers:
        chat = [a for a in apps if not a["agent"]]
        for k in range(spec.abusers):
            c = _client(f"abuser{k}", chat[k % len(chat)], spec.abuser_rate_per_min / 60.0)
            clients.append({**c, "abusive": True})
    return {"duration_s": spec.duration_s, "seed": spec.seed if seed is None else seed, "engine": spec.engine,
            "timeout_s": spec.timeout_s, "clients": clients}


def _client(cid: str, app: dict[str, Any], rate: float) -> dict[str, Any]:
    c: dict[str, Any] = {"id": cid, "app": app["name"], "arrival": {"kind": "poisson", "rate": rate}}
    user = app["prompt"] - app["system"]
    if not app.get("agent"):
        return {**c, "input_tokens": _spread(user), "system_tokens": _spread(app["system"], 0.1),
                "output_tokens": _spread(app["output"])}
    return {**c, "interaction": {"think_s": 0.2, "stages": [
        {"calls": s["calls"], "input_tokens": _spread(user * s["f_in"]),
         "system_tokens": _spread(app["system"], 0.1), "output_tokens": _spread(app["output"] * s["f_out"])}
        for s in app["stages"]]}}


def build(spec: Spec = Spec(), name: str = "fairserve") -> Workload:
    w = from_dict(scenario_dict(spec), name)
    w.think_s = spec.think_s
    history = from_dict(scenario_dict(spec, abusers=False, seed=spec.seed + 1000), name + "-warmup")
    w.history = history.requests
    arrivals = []
    for r in history.requests:  # later stages have no static arrival: place them after their first call
        t = r.arrival if r.arrival != math.inf else _first_arrival(history, r) + 2.0 * r.stage
        arrivals.append((t, r.client, r.app))
    lim = suggest_limits(arrivals, q=spec.limit_quantile, app_headroom=spec.app_limit_headroom)
    w.limits = {"user_rpm": lim.user_rpm, "app_rpm": lim.app_rpm}
    return w


def _first_arrival(w: Workload, r) -> float:
    return w.requests[w.interactions[r.interaction][0][0]].arrival


def case_study(timeout_s: float = 60.0, users_per_app: int = 5, duration_s: float = 300.0) -> Workload:
    """Table 4 (§5.5): three apps — 14 (6,370 prompt / 102 decode tokens on average), 7 (14,854 / 74) and 12
    (999 / 32) — sending 269, 139 and 448 requests with a client timeout, far beyond one engine's capacity.
    The paper gives neither the duration, the users nor the timeout: 300 s, 5 users per app, 60 s."""
    apps = {"app14": (269, 6370, 102), "app07": (139, 14854, 74), "app12": (448, 999, 32)}
    clients = []
    for app, (n, prompt, decode) in apps.items():
        for u in range(users_per_app):
            clients.append({"id": f"{app}-u{u}", "app": app,
                            "arrival": {"kind": "poisson", "rate": n / users_per_app / duration_s},
                            "input_tokens": _spread(prompt, 0.3), "output_tokens": _spread(decode, 0.3)})
    data = {"duration_s": duration_s, "seed": 14, "engine": "a100-llama2-13b", "timeout_s": timeout_s,
            "clients": clients}
    w = from_dict(data, "fairserve_case")
    w.history = from_dict({**data, "seed": 1014}, "warmup").requests
    return w


SCENARIOS: dict[str, Callable[[], Workload]] = {
    "fairserve_case": case_study,
    "fairserve": lambda: build(Spec(), "fairserve"),
    "fairserve_timeout": lambda: build(replace(Spec(), timeout_s=30.0), "fairserve_timeout"),
    "fairserve_small": lambda: build(replace(Spec(), users=60, apps=6, agent_apps=2, duration_s=300.0,
                                             median_rate_per_min=1.5), "fairserve_small"),
}
