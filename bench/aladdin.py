"""One Aladdin placement (policies/aladdin.py) as the backends fill: the cost the requests in flight could put
on every dispatch (issue #28's target: at most 200 µs with 1,000 requests over 8 backends).

    .venv/bin/python bench/aladdin.py [--backends 8] [--inflight 16 128] [--decisions 3000]

A decision is what the gateway does per dispatch: the oldest request on some backend finishes (its ledger
entry leaves, its output is learnt), and the next request is placed. Time advances 1 ms per decision, so a
10 ms heartbeat's view is retaken every tenth. Targets: the note's Table 2 TTFT (0.4 s) with an ATGT loose
enough (0.5 s) that every backend takes ``--inflight`` requests; the queue waiting in the gateway is not seen by
the placement (it places the head the policy names), so its depth does not enter the cost.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fairgate.policies.aladdin import Aladdin, LatencyModel  # noqa: E402
from fairgate.policies.views import BackendView, RequestView  # noqa: E402
from fairgate.sim.profiles import get_profile  # noqa: E402


def decision_cost(backends: int, per_backend: int, decisions: int, seed: int = 1) -> float:
    p = get_profile("a100-llama2-7b")
    a = Aladdin(LatencyModel(p.k1, p.c1, p.k2, p.c2, p.c3), atgt_s=0.5, ttft_s=0.4, max_batch=p.max_num_seqs)
    rng = random.Random(seed)
    views = [BackendView(f"b{i}", 0, 0, p.kv_tokens) for i in range(backends)]
    live: deque[tuple[RequestView, str]] = deque()
    now, n = 0.0, 0

    def place() -> None:
        nonlocal n, now
        n += 1
        r = RequestView(f"r{n}", f"c{n % 100}", "app", "m", rng.randint(50, 500), None)
        chosen = a.choose(r, views, now)
        live.append((r, chosen.name if chosen is not None else views[0].name))
        now += 0.001

    while len(live) < backends * per_backend:
        place()
    start = time.perf_counter()
    for _ in range(decisions):
        done, backend = live.popleft()
        a.on_finish(done, backend, rng.randint(20, 400))
        place()
    return (time.perf_counter() - start) / decisions * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--inflight", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--decisions", type=int, default=3000)
    a = ap.parse_args()
    print(f"one aladdin placement over {a.backends} backends (µs):")
    for per in a.inflight:
        print(f"  {per * a.backends:>6,} in flight ({per} per backend): "
              f"{decision_cost(a.backends, per, a.decisions):8.1f}")


if __name__ == "__main__":
    main()
