"""How much of the backends' KV the gate fills, and whether they preempt (the aim: ≥ 0.8 with no
preemption): the two-tenant flood of tests/test_replicas.py onto two emulated backends of 1,000 KV tokens that
admit and preempt as vLLM v1 does (sim/vllm_engine.py), run

- ``two``: one tenant through each of two replicas sharing one Redis (the test's setting: each replica gates
  against its KV budget, storage/shared_state.py);
- ``one``: both tenants through one replica (one gate sees the whole pool).

at several ``gate_overcommit`` values (1.0 is the gateway as configured by default; above it the gate reserves
more than the backends hold).

    .venv/bin/python bench/kv_fill.py [two|one] [OVERCOMMIT ...]      (default: two 1.0)
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the tests' gateway harness)

from tests.test_replicas import FLOODS, SECONDS, _flood_through, redis_server, two_replicas  # noqa: E402


async def one_run(mode: str, overcommit: float) -> None:
    floods = FLOODS if mode == "two" else {n: (0, *rest) for n, (_, *rest) in FLOODS.items()}
    async with redis_server() as (_, url, _):
        async with two_replicas(f"sqlite:///{tempfile.mkdtemp()}/kv.db", url,
                                gate_overcommit=overcommit) as (replicas, emus):
            service, queued, kv_use, preempted = await _flood_through(replicas, emus, floods, SECONDS)
    print(f"{mode} replica(s), gate_overcommit {overcommit}: mean KV use {kv_use:.2f}, requests waiting in the "
          f"backends' queues {queued:.2f}, preemptions {preempted}, service {service}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = args.pop(0) if args and args[0] in ("two", "one") else "two"
    for value in [float(x) for x in args] or [1.0]:
        asyncio.run(one_run(mode, value))
