"""The A10G / Llama-2-7B profile against the VTC artifact's whole-run throughputs
(docs/simulator/index.md#calibration).

    .venv/bin/python bench/calibration.py [C3_SECONDS ...]

For each fixed decode cost ``c3`` given (default: 0.036, 0.037, 0.038), runs the 15 workload/policy pairs whose
throughput the artifact reports and prints each error and the mean absolute error; profiles.py keeps the best.
"""

from __future__ import annotations

import sys

from fairgate.accounting.cost import make_cost
from fairgate.sim.builtin import BUILTIN
from fairgate.engine.profiles import get_profile
from fairgate.sim.report import build
from fairgate.sim.setup import scheduler_for
from fairgate.sim.simulator import Simulator
from fairgate.sim.workload import from_dict

# (workload, policy, the artifact's tokens/s; a range's midpoint)
TARGETS = [("overload", "fcfs", 876), ("overload", "vtc", 898), ("proportional", "vtc", 871),
           ("increase", "vtc", 743.5), ("poisson_short_long", "fcfs", 1475), ("poisson_short_long", "vtc", 1445),
           ("poisson_in_out", "fcfs", 1930), ("poisson_in_out", "vtc", 1671), ("real", "fcfs", 777),
           ("real", "vtc", 779), ("real", "rpm:5", 340), ("real", "rpm:10", 532), ("real", "rpm:15", 626),
           ("real", "rpm:20", 694), ("real", "rpm:30", 747)]


def throughput(workload: str, policy: str, c3: float) -> float:
    w = from_dict(BUILTIN[workload], workload)
    cost = make_cost("weighted")
    s, _ = scheduler_for(w, policy, cost)
    out = Simulator(w, s, get_profile("a10g-llama2-7b").with_overrides(c3=c3), cost=cost).run()
    return build(out, policy, "least-load", cost)["throughput_tokens_per_s"]


def main() -> None:
    for c3 in [float(a) for a in sys.argv[1:]] or [0.036, 0.037, 0.038]:
        errs = []
        cells = []
        for workload, policy, target in TARGETS:
            got = throughput(workload, policy, c3)
            errs.append((got - target) / target)
            cells.append(f"{workload}/{policy} {got:.0f} ({100 * errs[-1]:+.1f} %)")
        print(f"c3 = {1000 * c3:.1f} ms: mean |error| {100 * sum(map(abs, errs)) / len(errs):.2f} %")
        print("  " + "; ".join(cells))


if __name__ == "__main__":
    main()
