"""Build scheduler objects by name: the simulator and the live gateway make theirs here."""

from __future__ import annotations

import random
from typing import Callable

from fairgate.accounting.cost import CostFunction
from fairgate.accounting.predictor import EMAPredictor
from fairgate.policies.scheduler import FCFS, LCF, RPM, VTC, Scheduler, VTCPredict

SIM_POLICIES = ("fcfs", "rpm", "lcf", "vtc", "vtc-predict", "vtc-oracle", "vtc-range")
LIVE_POLICIES = ("fcfs", "rpm", "lcf", "vtc", "vtc-predict")  # oracle and ±50% read the true output length


def make_scheduler(name: str, cost: CostFunction, weights: Callable[[str], float], *,
                   rpm_limit: int | Callable[[str], int] = 20, seed: int = 0, counters=None) -> Scheduler:
    """``rpm:N`` sets the RPM limit inline; ``vtc-range`` is VTC(±50%) of App. B.3 (simulator only, as is
    ``vtc-oracle``: both read the true output length)."""
    if name.startswith("rpm:"):
        name, rpm_limit = "rpm", int(name.split(":", 1)[1])
    if name == "fcfs":
        return FCFS(cost, weights)
    if name == "rpm":
        return RPM(rpm_limit, cost, weights)
    if name == "lcf":
        return LCF(cost, weights, counters)
    if name == "vtc":
        return VTC(cost, weights, counters)
    if name == "vtc-predict":
        ema = EMAPredictor()
        return VTCPredict(lambda r: ema.predict(r.client), lambda r, n: ema.observe(r.client, n), cost, weights,
                          counters)
    if name == "vtc-oracle":
        return VTCPredict(lambda r: r.true_output or 0, None, cost, weights, counters)
    if name == "vtc-range":
        rng = random.Random(seed)
        return VTCPredict(lambda r: (r.true_output or 0) * rng.uniform(0.5, 1.5), None, cost, weights, counters)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(SIM_POLICIES)} (rpm:N for a limit)")
