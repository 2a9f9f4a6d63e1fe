"""How close fairgate's real setting (gateway mode: the policy orders the gateway's queue, FCFS engines behind a
dispatch gate) comes to the paper's (engine mode: the policy is the engine's queue).

    .venv/bin/python bench/gateway_gap.py

Prints, for engine mode, gateway mode with 1 engine and gateway mode with 4 engines at 4× the arrivals: the
per-client service of the 2-client overload (Fig 3) and of weighted VTC 1:2:3:4 (Fig 16), their throughput,
and VTC's Max / Avg Diff on the real trace and on the 8-client overload (Table 6).
"""

from __future__ import annotations

import statistics

from fairgate.accounting.cost import make_cost
from fairgate.policies.factory import make_scheduler
from fairgate.sim import fairness as F
from fairgate.sim.builtin import scaled
from fairgate.engine.profiles import get_profile
from fairgate.sim.report import build
from fairgate.sim.simulator import Simulator
from fairgate.sim.workload import from_dict

MODES = (("engine", 1), ("gateway", 1), ("gateway", 4))


def run(workload: str, mode: str, n: int):
    w = from_dict(scaled(workload, n), workload)
    cost = make_cost("weighted")
    s = make_scheduler("vtc", cost, lambda c: w.weights.get(c, 1.0))
    out = Simulator(w, s, get_profile(w.engine or "a10g-llama2-7b"), mode=mode, backends=n, cost=cost).run()
    return out, build(out, "vtc", "least-load", cost)


def service(out, lo: float = 60, hi: float = 300) -> str:
    """Mean windowed service per client (weighted tokens/s) over ticks in [lo, hi]."""
    curves = F.service_curves(out.requests, out.workload.clients, out.workload.duration_s)
    return " / ".join(f"{statistics.fmean(y for x, y in curves[c] if lo <= x <= hi):.0f}" for c in sorted(curves))


def main() -> None:
    print("| setting | " + " | ".join(f"{m} × {n}" for m, n in MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for workload in ("overload", "weighted"):
        runs = [run(workload, m, n) for m, n in MODES]
        print(f"| {workload}: service | " + " | ".join(service(o) for o, _ in runs) + " |")
        print(f"| {workload}: throughput | " + " | ".join(f"{d['throughput_tokens_per_s']:.0f}" for _, d in runs)
              + " |")
    for workload in ("real", "predict_8"):
        cells = []
        for m, n in MODES:
            if workload == "real" and n > 1:
                cells.append("—")  # a trace cannot be scaled by rate
                continue
            f = run(workload, m, n)[1]["fairness"]
            cells.append(f"{f['max_diff']:.0f} / {f['avg_diff']:.0f}")
        print(f"| {workload}: VTC Max / Avg Diff | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
