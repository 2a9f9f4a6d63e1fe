"""Fig 15 of the VTC paper (the ablation on A100 / Llama-2-13B): VTC's accumulated service difference grows with
the memory pool M and with the request length until it reaches the bound, over a sweep of step times.

    .venv/bin/python bench/fig15.py

The largest accumulated difference after 120 s (the `plot_6.4` metric) of two uniform clients is bimodal in
the step time: whether one client's mini-batches land in phase with the other's finishes decides it. So each
setting is run with the decode step's fixed cost ``c3`` from 21 to 29 ms (25 ms calibrated) and compared by
its median; the paper's single runs: 256×2 32.0 k, 512×2 51.5 k, 768×2 50.3 k (M = 35 000), 512×2 89.4 k at
M = 65 000.
"""

from __future__ import annotations

import statistics

from fairgate.accounting.cost import make_cost
from fairgate.policies.factory import make_scheduler
from fairgate.sim import fairness as F
from fairgate.sim.builtin import BUILTIN
from fairgate.engine.profiles import get_profile
from fairgate.sim.simulator import Simulator
from fairgate.sim.workload import from_dict

SWEEP_C3 = tuple(0.021 + 0.001 * i for i in range(9))
SETTINGS = {"256×2": ("ablation_256", None), "512×2": ("ablation_512", None), "768×2": ("ablation_768", None),
            "512×2, M=65000": ("ablation65_512", 65_000)}
PAPER = {"256×2": 32.0, "512×2": 51.5, "768×2": 50.3, "512×2, M=65000": 89.4}


def variation(workload: str, kv_tokens: int | None, c3: float | None = None) -> float:
    """max over ticks ≥ 120 s of max_i W_i(0, x) − min_i W_i(0, x) under VTC (tokens)."""
    w = from_dict(BUILTIN[workload], workload)
    cost = make_cost("weighted")
    s = make_scheduler("vtc", cost, lambda _c: 1.0)
    profile = get_profile("a100-llama2-13b").with_overrides(kv_tokens=kv_tokens, c3=c3)
    out = Simulator(w, s, profile, cost=cost).run()
    return max(d for _, d in F.abs_diff_curve(out.requests, w.clients, 600, min_finish=120))


def sweep(setting: str, c3s: tuple[float, ...] = SWEEP_C3) -> list[float]:
    workload, kv = SETTINGS[setting]
    return [variation(workload, kv, c3) for c3 in c3s]


def main() -> None:
    print(f"c3 (ms): {', '.join(f'{1000 * c:.0f}' for c in SWEEP_C3)}")
    for name in SETTINGS:
        runs = sweep(name)
        print(f"{name:15} median {statistics.median(runs) / 1000:5.1f} k (paper {PAPER[name]} k); runs: "
              f"{', '.join(f'{v / 1000:.1f}' for v in runs)}")


if __name__ == "__main__":
    main()
