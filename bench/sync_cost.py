"""What one replica's sync costs Redis (storage/sync_lua.py), by backends and replicas: each replica publishes,
for every backend, the curve of what its requests hold over the future decode steps and gets its KV budget
curve back (accounting/kv_curve.py). The script's work is O(backends × replicas × cells), cells ≈ 16 + 8 an
octave of the longest request's remaining steps (46 at 220 steps, 70 at 2,000).

Redis's own accounting (INFO commandstats, µs per EVALSHA) over 200 syncs of each replica in turn, against the
local Redis at 127.0.0.1:6379:

    .venv/bin/python bench/sync_cost.py [BACKENDS ...]      (default: 2 8 64)
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fairgate.accounting.kv_curve import upper  # noqa: E402
from fairgate.policies.kv_profile import KVProfile  # noqa: E402
from fairgate.storage.shared_state import SharedState  # noqa: E402

URL = "redis://127.0.0.1:6379/0"


async def cost(backends: int, replicas: int, longest: int, syncs: int = 200) -> float:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    states = [SharedState(URL, ns, f"r{i}", interval_s=3600) for i in range(replicas)]
    rng = random.Random(0)
    for s in states:
        curves = {}
        for b in range(backends):  # a dozen requests each, ending within ``longest`` steps
            p = KVProfile([(rng.randint(1, longest), rng.randint(20, 400)) for _ in range(12)], None)
            curves[f"gpu-{b}"] = (upper(p.ends, p.start_sums, 0), 12, 20_000, True, 40.0)
        s.inflight_source = lambda curves=curves: curves
        s.backlog_source = lambda s=s: [f"user:{s.replica}"]
    try:
        for _ in range(3):
            for s in states:
                await s.sync()
        r = redis.Redis.from_url(URL)
        r.config_resetstat()
        for _ in range(syncs):
            for s in states:
                await s.sync()
        return float(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
    finally:
        for s in states:
            await s.redis.delete(*s.keys)
            await s.redis.aclose()


def main() -> None:
    sizes = [int(x) for x in sys.argv[1:]] or [2, 8, 64]
    print("backends  replicas  longest request  µs per sync  µs per backend  Redis busy at 50 syncs/s per replica")
    for backends in sizes:
        for replicas in (2, 4):
            for longest in (220, 2000):
                us = asyncio.run(cost(backends, replicas, longest, syncs=max(20, 400 // backends)))
                busy = us * 50 * replicas / 1e6
                print(f"{backends:8d}  {replicas:8d}  {longest:15d}  {us:11.0f}  {us / backends:14.1f}  {busy:8.0%}",
                      flush=True)


if __name__ == "__main__":
    main()
