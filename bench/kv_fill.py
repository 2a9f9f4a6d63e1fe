"""How much of the backends' KV the gate fills (issue #28 asks ≥ 0.8 with no preemption): the two-replica flood
of tests/test_replicas.py (two tenants, one per replica, one Redis, two emulated backends of 1,000 KV tokens),
run at several ``gate_overcommit`` values — 1.0 is the gateway as configured by default; above it the gate
reserves more than the backends hold, so requests wait in the backends' own queues, which shows the emulator's
own ceiling on this workload.

    .venv/bin/python bench/kv_fill.py [OVERCOMMIT ...]      (default: 1.0 1.1 1.2)
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the tests' gateway harness)

from tests.test_replicas import FLOODS, SECONDS, _flood_through, redis_server, two_replicas  # noqa: E402


async def one(overcommit: float) -> None:
    async with redis_server() as (_, url, _):
        async with two_replicas(f"sqlite:///{tempfile.mkdtemp()}/kv.db", url,
                                gate_overcommit=overcommit) as (replicas, emus):
            service, queued, kv_use = await _flood_through(replicas, emus, FLOODS, SECONDS)
    print(f"gate_overcommit {overcommit}: mean KV use {kv_use:.2f}, requests waiting in the backends' queues "
          f"{queued:.2f}, service {service}", flush=True)


if __name__ == "__main__":
    for value in [float(x) for x in sys.argv[1:]] or [1.0, 1.1, 1.2]:
        asyncio.run(one(value))
