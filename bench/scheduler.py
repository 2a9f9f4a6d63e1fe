"""Scheduler and simulator speed.

    .venv/bin/python bench/scheduler.py

1. One VTC decision (peek + pop + one generated token + the finish + the arrival that refills the queue)
   against the number of backlogged clients: a decision must not scan every client. The same for
   FairServe (OIT's admission check on the arrival, WSC's pick with half the calls continuations, the
   charge at admission and the settlement at the finish).
2. The simulator: simulated requests per second of wall time on built-in workloads.
"""

from __future__ import annotations

import random
import time

from fairgate.accounting.app_stats import AppStats
from fairgate.accounting.cost import LinearCost
from fairgate.policies.factory import FairServeConfig, make_scheduler
from fairgate.policies.vtc import VTC
from fairgate.policies.views import RequestView


def _time_decisions(s, call, clients: int, decisions: int, waiting: int = 2) -> float:
    """Backlog every client with ``waiting`` calls, then time ``decisions`` rounds of: pick, dispatch, one token,
    the finish, and the client's next call arriving (through ``admit`` first, for a policy that throttles)."""
    seq = 0
    for c in range(clients):
        for _ in range(waiting):
            s.add(call(seq, c), 0.0)
            seq += 1
    t0 = time.perf_counter()
    for k in range(decisions):
        req = s.peek(k)
        s.pop(req, k)
        s.on_tokens(req, 1, k)
        s.on_finish(req, 1, k)
        nxt = call(seq, int(req.client[1:]))
        seq += 1
        if s.throttles:
            s.admit(nxt, k, overloaded=True)
        s.add(nxt, k)
    return (time.perf_counter() - t0) / decisions


def decision_cost(clients: int, decisions: int = 20_000, waiting: int = 2) -> float:
    rng = random.Random(0)
    return _time_decisions(VTC(LinearCost()), lambda seq, c: RequestView(
        str(seq), f"c{c}", "app", "m", rng.randint(1, 512), 256), clients, decisions, waiting)


def fairserve_decision_cost(clients: int, decisions: int = 20_000, waiting: int = 2, policy: str = "fairserve") -> float:
    rng = random.Random(0)
    stats = AppStats(min_samples=1)
    for a in range(10):
        stats.observe(f"app{a}", 0, 100 * (a + 1), 50, 64, 0.0)
    s = make_scheduler(policy, LinearCost(), lambda c: 1.0, stats=stats,
                       fairserve=FairServeConfig(user_limit=lambda u: 10**9, app_limit=lambda a: None))

    def call(seq: int, client: int) -> RequestView:
        x = f"x{client}" if seq % 2 else str(seq)  # half the calls continue an interaction
        return RequestView(str(seq), f"c{client}", f"app{client % 10}", "m", rng.randint(1, 512), 256, x, 1,
                           system_tokens=20)

    return _time_decisions(s, call, clients, decisions, waiting)


def simulator_speed(workload: str, policy: str, mode: str = "engine", backends: int = 1) -> tuple[int, float]:
    from fairgate.accounting.cost import make_cost
    from fairgate.sim.catalog import load
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.setup import scheduler_for
    from fairgate.sim.simulator import Simulator

    w = load(workload)
    cost = make_cost("weighted")
    s, stats = scheduler_for(w, policy, cost)
    t0 = time.perf_counter()
    Simulator(w, s, get_profile(w.engine or "a10g-llama2-7b"), mode=mode, backends=backends, cost=cost,
              stats=stats).run()
    return len(w.requests), time.perf_counter() - t0


if __name__ == "__main__":
    for n in (10, 1_000, 100_000):
        print(f"VTC decision with {n:>7,} backlogged clients: {decision_cost(n) * 1e6:6.2f} µs")
    for n in (10, 1_000, 100_000):
        print(f"FairServe decision with {n:>7,} backlogged users: {fairserve_decision_cost(n) * 1e6:6.2f} µs")
    for workload, policy, mode, backends in (("overload", "fcfs", "engine", 1), ("overload", "vtc", "engine", 1),
                                             ("real", "vtc", "engine", 1), ("overload", "vtc", "gateway", 4),
                                             ("fairserve", "fairserve", "gateway", 2),
                                             ("fairserve", "vtc", "gateway", 2)):
        n, wall = simulator_speed(workload, policy, mode, backends)
        print(f"simulate {workload:9s} {policy:9s} {mode:7s} x{backends}: {n} requests in {wall:5.2f} s "
              f"= {n / wall:7.0f} simulated requests/s")
