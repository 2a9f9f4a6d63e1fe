"""What the online latency fit (accounting/latency.py) costs on the hot path: one observed decode step (the
relay feeds one per streamed read) and one predicted step (placement, forecasts, shedding), for a backend at
its profile's speed and one four times as fast (its coefficients then held at 0 where the prior's would go
below: the slower, constrained refit).

    .venv/bin/python bench/latency_fit.py [--observations 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fairgate.accounting.latency import BackendLatency  # noqa: E402
from fairgate.engine.profiles import get_profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--observations", type=int, default=20_000)
    n = ap.parse_args().observations
    p = get_profile("a10g-llama2-7b")
    for speed in (1.0, 4.0):
        fit = BackendLatency(p.latency)
        rng = random.Random(1)
        seen = [(rng.randint(1, 8), rng.randint(100, 4000), rng.gauss(1, 0.05)) for _ in range(n)]
        start = time.perf_counter()
        for k, (b, ctx, noise) in enumerate(seen):
            fit.observe_step(b, ctx, p.decode_time(b, ctx) / speed * noise, now=k * 0.01)
        observed = time.perf_counter()
        for b, ctx, _ in seen:
            fit.step_time(b, ctx)
        done = time.perf_counter()
        print(f"backend at {speed:g}× its profile: observe_step {(observed - start) / n * 1e6:.1f} µs, "
              f"step_time {(done - observed) / n * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
