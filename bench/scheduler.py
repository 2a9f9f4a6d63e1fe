"""Scheduler and simulator speed.

    .venv/bin/python bench/scheduler.py

1. One VTC decision (peek + pop + the arrival that refills the queue + the charge of one generated token)
   against the number of backlogged clients: a decision must not scan every client.
2. The simulator: simulated requests per second of wall time on built-in workloads.
"""

from __future__ import annotations

import random
import time

from fairgate.accounting.cost import LinearCost
from fairgate.policies.scheduler import VTC
from fairgate.policies.views import RequestView


def decision_cost(clients: int, decisions: int = 20_000) -> float:
    rng = random.Random(0)
    s = VTC(LinearCost())
    seq = 0
    for c in range(clients):  # every client backlogged with two requests
        for _ in range(2):
            s.add(RequestView(str(seq), f"c{c}", "app", "m", rng.randint(1, 512), 256), 0.0)
            seq += 1
    t0 = time.perf_counter()
    for k in range(decisions):
        req = s.peek(k)
        s.pop(req, k)
        s.on_tokens(req, 1, k)
        s.add(RequestView(str(seq), req.client, "app", "m", rng.randint(1, 512), 256), k)
        seq += 1
    return (time.perf_counter() - t0) / decisions


def simulator_speed(workload: str, policy: str, mode: str = "engine", backends: int = 1) -> tuple[int, float]:
    from fairgate.accounting.cost import make_cost
    from fairgate.policies.factory import make_scheduler
    from fairgate.sim.profiles import get_profile
    from fairgate.sim.simulator import Simulator
    from fairgate.sim.workload import load

    w = load(workload)
    cost = make_cost("weighted")
    s = make_scheduler(policy, cost, lambda c: w.weights.get(c, 1.0))
    t0 = time.perf_counter()
    Simulator(w, s, get_profile("a10g-llama2-7b"), mode=mode, backends=backends, cost=cost).run()
    return len(w.requests), time.perf_counter() - t0


if __name__ == "__main__":
    for n in (10, 1_000, 100_000):
        print(f"VTC decision with {n:>7,} backlogged clients: {decision_cost(n) * 1e6:6.2f} µs")
    for workload, policy, mode, backends in (("overload", "fcfs", "engine", 1), ("overload", "vtc", "engine", 1),
                                             ("real", "vtc", "engine", 1), ("overload", "vtc", "gateway", 4)):
        n, wall = simulator_speed(workload, policy, mode, backends)
        print(f"simulate {workload:9s} {policy:5s} {mode:7s} x{backends}: {n} requests in {wall:5.2f} s "
              f"= {n / wall:7.0f} simulated requests/s")
