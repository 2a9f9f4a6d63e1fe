"""How fast `fairgate replay` goes through a usage log: a synthetic log of ``--rows`` served requests (``--tenants``
users of 10 apps, Poisson arrivals at ``--rate`` requests a second per backend, prompts and outputs of 50-2,000
and 10-500 tokens) written to a fresh PostgreSQL database, then replayed on ``--backends`` backends of the
``--engine`` profile under each ``--policy`` (one configuration each, run one after the other, as `fairgate
replay` runs one per process); reports rows a second per configuration, the database read included, beside the
CPU it took and the replay's median p90 queue wait. The default rate keeps an A100 pool busy with queues that
drain (median p90 wait of a few seconds); at 6 a second, as this bench once used, the pool is overloaded and
the queue grows for the whole log (waits of minutes; on the A10G profile, an hour).

    .venv/bin/python bench/replay_rows.py [--rows 1000000] [--backends 64] [--rate 4.5] [--engine a100-llama2-7b]
                                          [--policy vtc --policy fcfs] [--server postgresql://…]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone

import asyncpg

from fairgate.storage.db import make_engine, upgrade

RATE = 4.5  # requests a second per backend (``--rate``)


async def _write(url: str, rows: int, tenants: int, backends: int, per_backend: float = RATE, seed: int = 1) -> None:
    engine = make_engine(url)
    await upgrade(engine)
    await engine.dispose()
    rng = random.Random(seed)
    rate = backends * per_backend
    t0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
    t, records = 0.0, []
    for i in range(rows):
        t += rng.expovariate(rate)
        user = f"u{rng.randrange(tenants)}"
        app = f"app{hash(user) % 10}"
        arrival = t0 + timedelta(seconds=t)
        dispatched = arrival + timedelta(seconds=rng.expovariate(2.0))
        prompt, output = rng.randint(50, 2000), rng.randint(10, 500)
        finished = dispatched + timedelta(seconds=0.05 + output * 0.03)
        records.append((f"req-{i}", app, user, f"user:{app}/{user}", f"ix-{i // 3}", i % 3, "chat", True, prompt,
                        0, 0, output, 0, prompt, arrival, dispatched, finished, "ok", 200, 1, 0, "vtc",
                        f"gpu-{rng.randrange(backends)}"))
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.copy_records_to_table("usage_log", records=records, columns=[
            "request_id", "app", "user", "fairness_key", "interaction", "stage", "endpoint", "stream",
            "prompt_tokens", "system_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
            "estimated_prompt_tokens", "arrival", "dispatched_at", "finished_at", "status", "http_status",
            "attempts", "client_retry", "policy", "backend"])
    finally:
        await conn.close()


async def _database(server: str, create: bool, name: str) -> None:
    conn = await asyncpg.connect(server)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"' if create else f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--tenants", type=int, default=200)
    ap.add_argument("--backends", type=int, default=64)
    ap.add_argument("--rate", type=float, default=RATE, help="requests a second per backend")
    ap.add_argument("--engine", default="a100-llama2-7b", help="the backends' engine profile")
    ap.add_argument("--policy", action="append", default=None)
    ap.add_argument("--server", default="postgresql://postgres@127.0.0.1:5432/test")
    args = ap.parse_args()
    name = f"fairgate_bench_{uuid.uuid4().hex[:8]}"
    asyncio.run(_database(args.server, True, name))
    url = args.server.rsplit("/", 1)[0] + "/" + name
    try:
        started = time.perf_counter()
        asyncio.run(_write(url, args.rows, args.tenants, args.backends, args.rate))
        print(f"{args.rows:,} rows written in {time.perf_counter() - started:.0f} s", flush=True)
        for policy in args.policy or ["vtc", "fcfs"]:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "replay", "--database-url", url,
                                   "--policy", policy, "--engine", args.engine, "--speed", "1", "--json"],
                                  capture_output=True, text=True)
            wall = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode != 0:
                sys.exit(done.stderr)
            doc = json.loads(done.stdout)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            waits = sorted(t["p90_wait_s"] for t in doc["replays"][0]["tenants"].values())
            print(f"{policy}: {doc['requests']:,} requests replayed in {wall:.0f} s: {doc['requests'] / wall:,.0f} "
                  f"rows/s ({cpu:.0f} s of CPU); median p90 wait {waits[len(waits) // 2]:.1f} s", flush=True)
    finally:
        asyncio.run(_database(args.server, False, name))


if __name__ == "__main__":
    main()
