"""Gateway overhead: requests/s and added latency against calling the emulated backend directly.

Starts one `fairgate backend-sim` (so fast that generation costs ~nothing: the HTTP path dominates) and one
`fairgate serve --backend` in front of it, each in its own process, then drives both from this process.

    .venv/bin/python bench/overhead.py [--requests 2000] [--concurrency 32] [--max-tokens 16] [--policy vtc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
from netutil import free_port, wait_ready


async def drive(url: str, headers: dict, body: dict, n: int, concurrency: int) -> dict:
    latencies: list[float] = []
    ttfts: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                async with s.post(url, json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    first = None
                    async for _ in r.content.iter_any():
                        first = first or time.perf_counter()
                latencies.append(time.perf_counter() - t0)
                ttfts.append((first or time.perf_counter()) - t0)

        for _ in range(min(50, n)):  # warm-up (connections, caches)
            await one()
        latencies.clear(), ttfts.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    return {"requests_per_s": round(n / wall, 1), "p50_ms": round(q[49] * 1000, 2), "p99_ms": round(q[98] * 1000, 2),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 2)}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--speed", type=float, default=1000.0)
    ap.add_argument("--policy", default="fcfs", help="the gateway's policy (vtc: the fair queue and its charging)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fairgate-bench-")
    db = f"sqlite:///{tmp}/bench.db"
    fg = [sys.executable, "-m", "fairgate.cli.main"]
    bport, gport = free_port(), free_port()
    procs = [subprocess.Popen([*fg, "backend-sim", "--port", str(bport), "--speed", str(args.speed)],
                              stdout=subprocess.DEVNULL)]
    try:
        backend = f"http://127.0.0.1:{bport}"
        await wait_ready(backend + "/health")
        key = json.loads(subprocess.check_output([*fg, "admin", "app", "create", "bench", "--json",
                                                  "--database-url", db]) and
                         subprocess.check_output([*fg, "admin", "key", "create", "--app", "bench", "--json",
                                                  "--database-url", db]))["key"]
        procs.append(subprocess.Popen([*fg, "serve", "--port", str(gport), "--backend", backend, "--policy",
                                       args.policy, "--database-url", db, "--log-level", "warning"],
                                      stdout=subprocess.DEVNULL))
        gateway = f"http://127.0.0.1:{gport}"
        await wait_ready(gateway + "/ready")
        results = {}
        for stream in (False, True):
            body = {"model": "sim-llama", "messages": [{"role": "user", "content": "Hello, how are you today?"}],
                    "max_tokens": args.max_tokens, "ignore_eos": True, "stream": stream}
            for conc in (1, args.concurrency):
                n = args.requests if conc > 1 else max(200, args.requests // 10)
                for name, base, hdrs in (("direct", backend, {}),
                                         ("gateway", gateway, {"Authorization": f"Bearer {key}"})):
                    r = await drive(base + "/v1/chat/completions", hdrs, body, n, conc)
                    results[f"{'stream' if stream else 'json'} c={conc} {name}"] = r
                    print(f"{'stream' if stream else 'json  '} concurrency {conc:3d} {name:8s} {r}", flush=True)
        print(json.dumps({"cpus": os.cpu_count(), "policy": args.policy, "max_tokens": args.max_tokens,
                          "results": results}))
    finally:
        for p in procs:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    asyncio.run(main())
