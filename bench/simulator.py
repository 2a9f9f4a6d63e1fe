"""The simulator's speed: simulated requests per wall-clock second, for the runs `fairgate plan` and replay
will repeat many times (the targets: ≥ 1,000/s on the overloaded prefix workload under DLPM + D²LPM,
≥ 1,500/s on the 1-hour Azure conversation replay under every policy; ≥ 2,000/s on it under
VTC + Aladdin, here on 4 A100-7B backends at Table 2's targets).

    .venv/bin/python bench/simulator.py [--only NAME] [--trace PATH] [--profile]

Each run is `fairgate simulate`'s (the same ``simulator_for``), timed from the built workload to the
outcome: loading and parsing the trace are not counted (they are once per workload, not per run).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

from fairgate.accounting.cost import make_cost
from fairgate.sim.catalog import load
from fairgate.sim.planner import rescale
from fairgate.engine.profiles import get_profile
from fairgate.sim.setup import simulator_for

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure-2023-conv.csv"


def runs(trace: Path) -> list[tuple]:
    """(label, workload, policy, placement, backends[, rate]), all in gateway mode."""
    out: list[tuple] = [("flood dlpm+d2lpm", "d2lpm_lcqa_flood", "dlpm", "d2lpm", 4)]
    if trace.exists():
        spec = Path(tempfile.mkdtemp()) / "azure-conv-1h.yaml"
        spec.write_text(f"duration_s: 3600\ntrace: {{path: {trace}, format: azure, clients: 10}}\n")
        out += [(f"azure-1h {p}", str(spec), p, "least-load", 4) for p in ("vtc", "wsc", "fairserve", "dlpm")]
        slo = spec.with_name("azure-conv-1h-slo.yaml")  # Aladdin at Table 2's targets (≥ 2,000/s)
        slo.write_text(f"duration_s: 3600\nengine: a100-llama2-7b\nslo: {{ttft_s: 0.4, atgt_s: 0.015}}\n"
                       f"trace: {{path: {trace}, format: azure, clients: 10}}\n")
        out.append(("azure-1h vtc+aladdin", str(slo), "vtc", "aladdin", 4))
    # many engines, mostly idle (fairgate plan's large pools): the five minutes of bench/aladdin_azure.yaml at
    # 40 req/s on 192 engines, least-load (an event costs the engines it touches, not the pool)
    out.append(("azure-5m@40 x192 least-load", str(Path(__file__).with_name("aladdin_azure.yaml")), "vtc",
                "least-load", 192, 40.0))
    return out


def one(workload: str, policy: str, placement: str, backends: int, profile: bool,
        rate: float | None = None) -> tuple[int, float]:
    w = load(workload)
    if rate is not None:
        rescale(w, rate)
    sim = simulator_for(w, policy, placement, get_profile(w.engine or "a10g-llama2-7b"), mode="gateway",
                        backends=backends, cost=make_cost("weighted"))
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    sim.run()
    elapsed = time.perf_counter() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return len(w.requests), elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the labels containing this")
    ap.add_argument("--trace", type=Path, default=AZURE, help="the Azure 2023 conversation trace")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    print(f"{'run':24s} {'requests':>9s} {'seconds':>8s} {'requests/s':>11s}")
    for label, workload, policy, placement, backends, *rate in runs(a.trace):
        if a.only and a.only not in label:
            continue
        n, s = one(workload, policy, placement, backends, a.profile, *rate)
        print(f"{label:24s} {n:9,d} {s:8.1f} {n / s:11,.0f}", flush=True)


if __name__ == "__main__":
    main()
