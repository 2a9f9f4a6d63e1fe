"""What the replicas' syncs cost Redis (storage/shared_state.py, storage/sync_lua.py) at fleet sizes: each
replica renews its KV budget on every backend at every sync, as the gateway does every 20 ms.

For each number of backends (16, 64, 256) and replicas (2, 8, 16), against one private redis-server and
against a three-node Redis Cluster the bench starts: the replicas (in this process) sync in turn, each with a
few backlogged clients and claims on every backend that change at every sync (a third of them wanting more
room), and each server's own CPU time (INFO cpu, its idle rate just before subtracted) is read over the
rounds. Reported: Redis's CPU per sync (all nodes), the load of each
node were every replica to sync every 20 ms (µs per round × 50), and a replica's own CPU per sync.

    .venv/bin/python bench/sync_cost.py [--backends 16 64 256] [--replicas 2 8 16] [--rounds 60] [--targets one cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fairgate.storage.shared_state import SharedState  # noqa: E402
from tests.test_redis_cluster import redis_cluster  # noqa: E402
from tests.test_replicas import redis_server  # noqa: E402

SYNCS_A_SECOND = 50  # redis_sync_s: 20 ms


def cpu(port: int) -> float:
    info = redis.Redis(port=port).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def idle_rates(ports: list[int], seconds: float = 1.0) -> list[float]:
    before = [cpu(p) for p in ports]
    time.sleep(seconds)
    return [(cpu(p) - b) / seconds for p, b in zip(ports, before)]


async def run(url: str, ports: list[int], backends: int, replicas: int,
              rounds: int) -> tuple[float, list[float], float]:
    ns = f"bench{uuid.uuid4().hex[:6]}"
    states = [SharedState(url, ns, f"r{i}", interval_s=3600) for i in range(replicas)]
    rng = random.Random(0)
    for s in states:  # what its requests hold on each backend, moving on at every sync as requests come and go
        s.inflight_source = lambda: {f"gpu-{b}": (rng.randint(100, 2_000), rng.randint(1, 12), 20_000,
                                                  rng.random() < 0.3) for b in range(backends)}
        s.backlog_source = lambda s=s: [f"user:{s.replica}:{k}" for k in range(4)]
        for k in range(4):
            s.add(f"user:{s.replica}:{k}", rng.random())
    try:
        for _ in range(3):
            for s in states:
                assert await s.sync(), s.link.reason
        idle = idle_rates(ports, 0.5)  # (the servers' own background, measured just before)
        began, mine = time.monotonic(), time.process_time()
        before = [cpu(p) for p in ports]
        for _ in range(rounds):
            for s in states:
                for k in range(4):
                    s.add(f"user:{s.replica}:{k}", 1.0)
                assert await s.sync(), s.link.reason
        elapsed, mine = time.monotonic() - began, time.process_time() - mine
        used = [cpu(p) - b - rate * elapsed for p, b, rate in zip(ports, before, idle)]
        per_round = [max(0.0, u) / rounds for u in used]
        return sum(per_round) / replicas, [x * SYNCS_A_SECOND for x in per_round], mine / (rounds * replicas)
    finally:
        for s in states:
            await s.redis.aclose()
        for port in ports:  # (each size starts on empty servers)
            redis.Redis(port=port).flushall()


@asynccontextmanager
async def servers(target: str):
    """The ports of a private redis-server (tests/test_replicas.py's), or of a three-node cluster."""
    if target == "one":
        async with redis_server() as (_, _, port):
            yield [port]
    else:
        with redis_cluster(Path(tempfile.mkdtemp())) as ports:
            yield ports


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--targets", nargs="+", choices=["one", "cluster"], default=["one", "cluster"])
    args = ap.parse_args()
    print("target        backends  replicas  Redis µs per sync  each node's load at a sync every 20 ms  "
          "replica's CPU per sync (µs)")
    for target in args.targets:
        async with servers(target) as ports:
            url = (f"redis://127.0.0.1:{ports[0]}/0" if len(ports) == 1
                   else "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports))
            name = "one Redis" if target == "one" else "3-node cluster"
            for backends in args.backends:
                for replicas in args.replicas:
                    per_sync, load, mine = await run(url, ports, backends, replicas, args.rounds)
                    loads = " ".join(f"{x:5.0%}" for x in load)
                    print(f"{name:14s}{backends:8d}  {replicas:8d}  {per_sync * 1e6:17.0f}  {loads:>38s}  "
                          f"{mine * 1e6:10.0f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
