"""How much of the backends' KV the gate fills, and whether they preempt (the aim: ≥ 0.8 with no
preemption): the two-tenant flood of tests/test_replicas.py onto two emulated backends of 1,000 KV tokens that
admit and preempt as vLLM v1 does (engine/vllm_engine.py), run

- ``two``: one tenant through each of two replicas sharing one Redis (the test's setting: each replica gates
  against its KV budget, storage/kv_budgets.py);
- ``one``: both tenants through one replica (one gate sees the whole pool).

at several ``gate_overcommit`` values (1.0 is the gateway as configured by default; above it the gate reserves
more than the backends hold). ``--demand K`` multiplies each tenant's connections (16 and 32 in the test);
``--weights WA WB`` gives the tenants those weights and ``--lengths LO HI`` both tenants the same output
lengths, and the run reports the ratio of their service (VTC serves backlogged tenants in their weights' ratio).

    .venv/bin/python bench/kv_fill.py [two|one] [OVERCOMMIT ...] [--demand K] [--weights WA WB] [--lengths LO HI]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the tests' gateway harness)

from tests.test_replicas import FLOODS, SECONDS, _flood_through, redis_server, two_replicas  # noqa: E402


async def one_run(mode: str, overcommit: float, args) -> None:
    floods = {n: (r if mode == "two" else 0, c * args.demand, tuple(args.lengths) if args.lengths else lengths)
              for n, (r, c, lengths) in FLOODS.items()}
    async with redis_server() as (_, url, _):
        async with two_replicas(f"sqlite:///{tempfile.mkdtemp()}/kv.db", url,
                                gate_overcommit=overcommit) as (replicas, emus):
            if args.weights:
                await replicas[0].admin.create_app("tenants")
                for name, weight in zip(floods, args.weights):
                    await replicas[0].admin.create_user(name, app="tenants", weight=weight)
            service, queued, kv_use, preempted = await _flood_through(replicas, emus, floods, args.seconds)
    ratio = f", service ratio {service['a'] / max(service['b'], 1):.2f}" if args.weights else ""
    print(f"{mode} replica(s), gate_overcommit {overcommit}: mean KV use {kv_use:.2f}, requests waiting in the "
          f"backends' queues {queued:.2f}, preemptions {preempted}, service {service}{ratio}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", choices=["two", "one"], default="two")
    ap.add_argument("overcommit", nargs="*", type=float, default=[1.0])
    ap.add_argument("--demand", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=SECONDS, help="how long the flood lasts (the test's 20 s)")
    ap.add_argument("--weights", type=float, nargs=2, default=None)
    ap.add_argument("--lengths", type=int, nargs=2, default=None)
    args = ap.parse_args()
    for value in args.overcommit:
        asyncio.run(one_run(args.mode, value, args))


if __name__ == "__main__":
    main()
