"""Aladdin's scheduling overhead per heartbeat against the arrival rate (acceptance check A12, the paper's
Fig. 13: "less than 50 ms" per heartbeat at about 25 req/s, growing roughly as n log n).

    .venv/bin/python bench/aladdin_heartbeat.py [--rate 5 10 25 40] [--heartbeat-ms 50]

The Azure conversation trace of ``bench/aladdin_azure.yaml`` rescaled to each rate, simulated in gateway mode on
the workers Eq. 7 gives for it (A11's fit on this trace, ⌈2.5·λ⌉: about 0.95 attainment), with every call the
gateway makes into the placement (each ``choose``, each finish) timed on the wall clock and summed per
heartbeat of simulated time (a finish in the heartbeat of the placement before it: the simulator's clock is
not read). Aladdin places each request as the gateway releases it, so a heartbeat's work is the decisions that
fall in it; the backends' views are retaken every 10 ms (the placement's own heartbeat, the live default), O(N
log n) over the N requests in flight, and a decision between is O(B log n). Reported per heartbeat that had
any work: mean, p99 and max in ms, with the decisions and requests in flight behind them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fairgate.accounting.cost import make_cost  # noqa: E402
from fairgate.sim.catalog import load  # noqa: E402
from fairgate.sim.planner import rescale  # noqa: E402
from fairgate.engine.profiles import get_profile  # noqa: E402
from fairgate.sim.setup import simulator_for  # noqa: E402


def per_heartbeat(rate: float, heartbeat_s: float, workers: int | None = None) -> dict:
    w = rescale(load(str(HERE / "aladdin_azure.yaml")), rate)
    workers = workers or math.ceil(2.5 * rate)
    sim = simulator_for(w, "fcfs", "aladdin", get_profile(w.engine), mode="gateway", backends=workers,
                        cost=make_cost("tokens"))
    placement = sim.placement
    spent: dict[int, float] = defaultdict(float)
    calls: dict[int, int] = defaultdict(int)
    inflight: dict[int, int] = {}
    clock = [0.0]  # simulated time of the last placement (a finish is counted in its heartbeat)

    def timed(name: str):
        inner = getattr(placement, name)

        def wrapper(request, *args):
            if name == "choose":
                clock[0] = args[1]
            now = clock[0]
            start = time.perf_counter()
            out = inner(request, *args)
            beat = int(now / heartbeat_s)
            spent[beat] += time.perf_counter() - start
            if name == "choose":
                calls[beat] += 1
                inflight[beat] = max(inflight.get(beat, 0), sum(placement.ledger(v.name) for v in args[0]))
            return out
        setattr(placement, name, wrapper)

    for name in ("choose", "on_finish", "refund"):
        timed(name)
    sim.run()
    ms = sorted(v * 1e3 for v in spent.values())
    return {"rate": rate, "workers": workers, "heartbeats": len(ms),
            "mean_ms": sum(ms) / len(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "max_ms": ms[-1],
            "decisions_per_heartbeat": sum(calls.values()) / max(1, len(calls)),
            "inflight_max": max(inflight.values(), default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, nargs="+", default=[5, 10, 25, 40])
    ap.add_argument("--heartbeat-ms", type=float, default=50.0)
    a = ap.parse_args()
    print(f"aladdin, time in the placement per {a.heartbeat_ms:g} ms heartbeat (Azure conv, Table 2 targets):")
    print(f"{'req/s':>6} {'workers':>7} {'in flight':>9} {'decisions':>9} {'mean ms':>8} {'p99 ms':>7} {'max ms':>7}")
    for rate in a.rate:
        r = per_heartbeat(rate, a.heartbeat_ms / 1000)
        print(f"{r['rate']:>6g} {r['workers']:>7} {r['inflight_max']:>9} {r['decisions_per_heartbeat']:>9.1f} "
              f"{r['mean_ms']:>8.3f} {r['p99_ms']:>7.3f} {r['max_ms']:>7.3f}")


if __name__ == "__main__":
    main()
