"""One Aladdin placement (policies/aladdin.py) as the backends fill: the cost the requests in flight could put
on every dispatch (the target: at most 200 µs with 1,000 requests over 8 backends).

    .venv/bin/python bench/aladdin.py [--backends 8] [--inflight 16 128] [--decisions 3000] [--spacing-ms 1]

A decision is what the gateway does per dispatch: the oldest request on some backend finishes (its ledger
entry leaves, its output is learnt), and the next request is placed. Time advances ``--spacing-ms`` per decision (1 ms:
a 10 ms heartbeat's view is retaken every tenth; past 10 ms, at every decision). Targets: the Aladdin paper's Table 2 TTFT (0.4 s) with an ATGT loose
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

from fairgate.engine.profiles import get_profile  # noqa: E402
from fairgate.policies.aladdin import Aladdin  # noqa: E402
from fairgate.policies.views import BackendView, RequestView  # noqa: E402


def decision_cost(backends: int, per_backend: int, decisions: int, seed: int = 1, spacing_s: float = 0.001) -> float:
    p = get_profile("a100-llama2-7b")
    a = Aladdin(p.latency, atgt_s=0.5, ttft_s=0.4, max_batch=p.max_num_seqs)
    rng = random.Random(seed)
    views = [BackendView(f"b{i}", 0, 0, p.kv_tokens) for i in range(backends)]
    live: deque[tuple[RequestView, str]] = deque()
    now, n = 0.0, 0

    def place() -> None:
        nonlocal n, now
        n += 1
        r = RequestView(f"r{n}", f"c{n % 100}", "app", "m", rng.randint(50, 500), None, arrival=now)
        chosen = a.choose(r, views, now)
        live.append((r, chosen.name if chosen is not None else views[0].name))
        now += spacing_s

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
    ap.add_argument("--spacing-ms", type=float, default=1.0, help="Time between decisions (the heartbeat: 10 ms).")
    a = ap.parse_args()
    print(f"one aladdin placement over {a.backends} backends, {a.spacing_ms:g} ms apart (µs):")
    for per in a.inflight:
        print(f"  {per * a.backends:>6,} in flight ({per} per backend): "
              f"{decision_cost(a.backends, per, a.decisions, spacing_s=a.spacing_ms / 1000):8.1f}")


if __name__ == "__main__":
    main()
