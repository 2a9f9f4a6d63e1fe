"""`fairgate serve --workers N`: what one more worker costs and brings, on a machine without a core to spare.

    .venv/bin/python bench/workers.py [--rate 600] [--seconds 10] [--redis-url redis://127.0.0.1:6379/6]

Throughput scales with N only if a request costs each worker as much CPU as it costs a lone one (no
contention between replicas: the shared counters go through Redis) and Redis keeps up. Measured without a
free core for each worker, so for N = 1 and N = 2 (both with Redis, named backend, SQLite):
- idle, for as long: the CPU the workers spend on their own (health probes, Redis sync, refreshes);
- at a fixed offered rate (open loop, below saturation): the CPU the gateway's processes and Redis spent per
  request beyond that (/proc, utime + stime), and the latency; the capacity of N dedicated cores follows as
  (N × 1000 ms − idle work) / (net CPU per request), and the scaling as that capacity's ratio;
- closed loop (32 connections), whatever this machine gives: the load, the mock backend and the workers share
  its 2 cores, so this is not the scaling, only what the box does.
Every request must leave one usage row (checked per run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from hotpath import PY, _q, body, closed_loop
from netutil import free_port, wait_ready

HERE = Path(__file__).resolve().parent
FG = [PY, "-m", "fairgate.cli.main"]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def redis_pid(url: str) -> int | None:
    port = url.split(":")[2].split("/")[0]
    out = subprocess.run(["pgrep", "-f", f"redis-server.*:{port}"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


async def open_loop(url: str, headers: dict, rate: float, seconds: float) -> dict:
    """Requests sent at ``rate`` per second whatever the answers (64 connections at most), for ``seconds``."""
    lat, errors, tasks = [], 0, []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        async def one() -> None:
            nonlocal errors
            t0 = time.perf_counter()
            async with s.post(url, json=body(False, 64), headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    return
            lat.append(time.perf_counter() - t0)

        start = time.perf_counter()
        n = int(rate * seconds)
        for k in range(n):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return {"sent": n, "ok": len(lat), "errors": errors, "per_s": round(len(lat) / wall, 1),
            "p50_ms": round(_q(lat, 0.5), 2), "p99_ms": round(_q(lat, 0.99), 2)}


async def rows_ok(db: str, sent: int) -> str:
    from sqlalchemy import func, select

    from fairgate.storage.db import make_engine, sessionmaker
    from fairgate.storage.models import UsageLog

    engine = make_engine(db)
    async with sessionmaker(engine)() as s:
        rows, ok, tokens = (await s.execute(select(func.count(), func.count().filter(UsageLog.status == "ok"),
                                                   func.sum(UsageLog.completion_tokens)))).one()
    await engine.dispose()
    good = rows == ok and rows >= sent and tokens == 64 * ok  # (warm-up requests are not counted in ``sent``)
    return f"{'OK' if good else 'MISMATCH'}: {rows} rows, {ok} ok, {tokens} completion tokens, {sent} requests sent"


async def run(n: int, args, backend: str, tmp: str) -> dict:
    db = f"sqlite:///{tmp}/workers-{n}.db"
    subprocess.run([*FG, "admin", "app", "create", "bench", "--database-url", db], check=True,
                   stdout=subprocess.DEVNULL)
    key = json.loads(subprocess.check_output([*FG, "admin", "key", "create", "--app", "bench", "--json",
                                              "--database-url", db]))["key"]
    headers = {"Authorization": f"Bearer {key}"}
    cfg = Path(tmp) / f"workers-{n}.yaml"
    cfg.write_text(f"backends:\n  - url: {backend}\n    max_num_seqs: 4096\n    kv_tokens: 100000000\n"
                   f"redis_namespace: bench{n}-{os.urandom(3).hex()}\n")  # this run's own state in Redis
    port = free_port()
    sup = subprocess.Popen([*FG, "serve", "--config", str(cfg), "--port", str(port), "--policy", "vtc",
                            "--database-url", db, "--redis-url", args.redis_url, "--log-level", "warning",
                            *(["--workers", str(n)] if n > 1 else [])])
    url = f"http://127.0.0.1:{port}"
    out: dict = {"workers": n}
    try:
        await wait_ready(url + "/v1/models", headers)
        pids = children(sup.pid) if n > 1 else [sup.pid]
        rpid = redis_pid(args.redis_url)
        await open_loop(url + "/v1/chat/completions", headers, args.rate, 1.0)  # warm-up
        idle = sum(cpu_s(p) for p in pids)
        await asyncio.sleep(args.seconds)  # the workers' own periodic work (probes, Redis sync, refreshes)
        idle = sum(cpu_s(p) for p in pids) - idle
        before = [cpu_s(p) for p in pids], cpu_s(rpid) if rpid else 0.0
        r = await open_loop(url + "/v1/chat/completions", headers, args.rate, args.seconds)
        after = [cpu_s(p) for p in pids], cpu_s(rpid) if rpid else 0.0
        gw = [a - b for a, b in zip(after[0], before[0])]
        out["open_loop"] = {**r, "gateway_cpu_ms_per_request": round(1000 * sum(gw) / r["ok"], 3),
                            "idle_cpu_ms_per_s": round(1000 * idle / args.seconds, 1),
                            "net_cpu_ms_per_request": round(1000 * (sum(gw) - idle) / r["ok"], 3),
                            "per_worker_cpu_s": [round(x, 2) for x in gw],
                            "redis_cpu_ms_per_request": round(1000 * (after[1] - before[1]) / r["ok"], 3)}
        c = await closed_loop(url + "/v1/chat/completions", headers, body(False, 64), 32, args.seconds)
        out["closed_loop_per_s"] = round(c["requests"] / c["wall_s"], 1)
        sent = int(args.rate * (1.0 + args.seconds)) + c["requests"] + c["errors"]
    finally:
        sup.terminate()
        sup.wait()
    out["rows"] = await rows_ok(db, sent)  # (the closed loop's warm-up requests are not counted: ≥ expected)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=600.0, help="offered requests/s (open loop), below saturation")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/6")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fairgate-workers-")
    port = free_port()
    mock = subprocess.Popen([PY, str(HERE / "mock_backend.py"), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    backend = f"http://127.0.0.1:{port}"
    results = []
    try:
        await wait_ready(backend + "/health")
        for n in (1, 2):
            r = await run(n, args, backend, tmp)
            results.append(r)
            o = r["open_loop"]
            print(f"workers {n}: open loop {o['per_s']} req/s (offered {args.rate}), p50 {o['p50_ms']} p99 "
                  f"{o['p99_ms']} ms, gateway CPU {o['gateway_cpu_ms_per_request']} ms/request ("
                  f"{o['net_cpu_ms_per_request']} beyond its idle {o['idle_cpu_ms_per_s']} ms/s; per worker "
                  f"{o['per_worker_cpu_s']} s), Redis {o['redis_cpu_ms_per_request']} ms/request | closed loop "
                  f"{r['closed_loop_per_s']} req/s on this box | rows {r['rows']}", flush=True)
    finally:
        mock.terminate()
        mock.wait()
    # on N dedicated cores a second holds N × 1000 ms of CPU, less the workers' idle work, at the net cost a request
    cap = [(r["workers"] * 1000 - r["open_loop"]["idle_cpu_ms_per_s"]) / r["open_loop"]["net_cpu_ms_per_request"]
           for r in results]
    redis_ms = results[1]["open_loop"]["redis_cpu_ms_per_request"] * cap[1]
    print(f"capacity on dedicated cores: 1 worker {cap[0]:.0f} req/s, 2 workers {cap[1]:.0f} req/s: "
          f"{cap[1] / cap[0]:.2f}× (Redis then needs {redis_ms:.0f} ms of CPU a second)")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    asyncio.run(main())
