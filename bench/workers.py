"""`fairgate serve --workers N`: what one more worker costs and brings, on a machine without a core to spare.

    .venv/bin/python bench/workers.py [--rate 400] [--seconds 12] [--rounds 4] [--redis-url redis://…/6]

Throughput scales with N only if a request costs each worker as much CPU as it costs a lone one (no
contention between replicas: the shared counters go through Redis) and Redis keeps up. Measured without a
free core for each worker, so for N = 1 and N = 2 (both with Redis, named backend, SQLite):
- both running at once, idle for ``--seconds``: the CPU each spends on its own (probes, Redis sync, refreshes);
- then loaded in turns (``--rounds`` windows each, the order alternating, so the machine's drift falls on both
  alike) at the same offered rate per worker (open loop, below saturation: each worker's loop batches as
  much as the lone one's): the CPU the gateway's processes and Redis
  spent per request beyond that idle work (/proc, utime + stime); the capacity of N dedicated cores follows
  as (N × 1000 ms − idle work) / (net CPU per request), and the scaling as that capacity's ratio;
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


class Gateway:
    """``fairgate serve`` with ``n`` workers in front of ``backend``: its own SQLite and Redis namespace."""

    def __init__(self, n: int, backend: str, args, tmp: str):
        self.n, self.args = n, args
        self.db = f"sqlite:///{tmp}/workers-{n}.db"
        subprocess.run([*FG, "admin", "app", "create", "bench", "--database-url", self.db], check=True,
                       stdout=subprocess.DEVNULL)
        key = json.loads(subprocess.check_output([*FG, "admin", "key", "create", "--app", "bench", "--json",
                                                  "--database-url", self.db]))["key"]
        self.headers = {"Authorization": f"Bearer {key}"}
        cfg = Path(tmp) / f"workers-{n}.yaml"
        cfg.write_text(f"backends:\n  - url: {backend}\n    max_num_seqs: 4096\n    kv_tokens: 100000000\n"
                       f"redis_namespace: bench{n}-{os.urandom(3).hex()}\n")  # this run's own state in Redis
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.sup = subprocess.Popen([*FG, "serve", "--config", str(cfg), "--port", str(port), "--policy", "vtc",
                                     "--database-url", self.db, "--redis-url", args.redis_url, "--log-level",
                                     "warning", *(["--workers", str(n)] if n > 1 else [])])
        self.pids: list[int] = []
        self.sent = 0
        self.cpu = self.redis_cpu = 0.0
        self.loops: list[dict] = []

    async def ready(self) -> None:
        await wait_ready(self.url.rsplit("/", 2)[0] + "/models", self.headers)
        self.pids = children(self.sup.pid) if self.n > 1 else [self.sup.pid]

    def cpu_now(self) -> float:
        return sum(cpu_s(p) for p in self.pids)

    async def window(self, rate: float, seconds: float, rpid: int | None) -> None:
        """One open-loop window: its requests, and the CPU the workers and Redis spent on them."""
        c0, r0 = self.cpu_now(), cpu_s(rpid) if rpid else 0.0
        r = await open_loop(self.url, self.headers, rate, seconds)
        self.cpu += self.cpu_now() - c0
        self.redis_cpu += (cpu_s(rpid) if rpid else 0.0) - r0
        self.loops.append(r)
        self.sent += r["sent"]

    def stop(self) -> None:
        self.sup.terminate()
        self.sup.wait()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=400.0,
                    help="offered requests/s per worker (open loop), below saturation")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/6")
    ap.add_argument("--rounds", type=int, default=4, help="open-loop windows per gateway, in turns")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fairgate-workers-")
    port = free_port()
    mock = subprocess.Popen([PY, str(HERE / "mock_backend.py"), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    backend = f"http://127.0.0.1:{port}"
    gateways: list[Gateway] = []
    try:
        await wait_ready(backend + "/health")
        gateways = [Gateway(n, backend, args, tmp) for n in (1, 2)]
        for g in gateways:
            await g.ready()
            await open_loop(g.url, g.headers, args.rate, 1.0)  # warm-up
            g.sent += int(args.rate)
        rpid = redis_pid(args.redis_url)
        # idle, both at once: each one's own periodic work (probes, Redis sync every 20 ms, refreshes)
        idle0, ridle0 = [g.cpu_now() for g in gateways], cpu_s(rpid) if rpid else 0.0
        await asyncio.sleep(args.seconds)
        idle = [(g.cpu_now() - c) / args.seconds for g, c in zip(gateways, idle0)]  # CPU s per s
        redis_idle = ((cpu_s(rpid) if rpid else 0.0) - ridle0) / args.seconds
        # loaded in turns, the order alternating, so that the machine's drift falls on both alike
        for k in range(args.rounds):
            for g in (gateways if k % 2 == 0 else gateways[::-1]):
                await g.window(args.rate * g.n, args.seconds / args.rounds, rpid)  # the same load per worker
        results = []
        for g, idle_s in zip(gateways, idle):
            ok = sum(r["ok"] for r in g.loops)
            busy = args.seconds  # the windows' total length
            net = (g.cpu - idle_s * busy) / ok
            lat_p50 = sorted(r["p50_ms"] for r in g.loops)[len(g.loops) // 2]
            c = await closed_loop(g.url, g.headers, body(False, 64), 32, args.seconds / 2)
            g.sent += c["requests"] + c["errors"]
            results.append({"workers": g.n, "ok": ok, "errors": sum(r["errors"] for r in g.loops),
                            "idle_cpu_ms_per_s": round(1000 * idle_s, 1),
                            "gateway_cpu_ms_per_request": round(1000 * g.cpu / ok, 3),
                            "net_cpu_ms_per_request": round(1000 * net, 3),
                            "redis_cpu_ms_per_request": round(1000 * (g.redis_cpu - redis_idle * busy) / ok, 3),
                            "p50_ms_median_window": lat_p50,
                            "closed_loop_per_s": round(c["requests"] / c["wall_s"], 1)})
        for g in gateways:
            g.stop()
        for g, r in zip(gateways, results):
            r["rows"] = await rows_ok(g.db, g.sent)
            print(f"workers {r['workers']}: {r['ok']} requests at {args.rate * r['workers']:.0f}/s offered "
                  f"({r['errors']} errors), "
                  f"window p50 {r['p50_ms_median_window']} ms; gateway CPU {r['gateway_cpu_ms_per_request']} "
                  f"ms/request, {r['net_cpu_ms_per_request']} beyond its idle {r['idle_cpu_ms_per_s']} ms/s; "
                  f"Redis {r['redis_cpu_ms_per_request']} ms/request | closed loop {r['closed_loop_per_s']} req/s "
                  f"on this box | rows {r['rows']}", flush=True)
    finally:
        for g in gateways:
            g.stop()
        mock.terminate()
        mock.wait()
    # on N dedicated cores a second holds N × 1000 ms of CPU, less the workers' idle work, at the net cost a request
    cap = [(r["workers"] * 1000 - r["idle_cpu_ms_per_s"]) / r["net_cpu_ms_per_request"] for r in results]
    redis_ms = max(0.0, results[1]["redis_cpu_ms_per_request"]) * cap[1] + 1000 * redis_idle
    print(f"capacity on dedicated cores: 1 worker {cap[0]:.0f} req/s, 2 workers {cap[1]:.0f} req/s: "
          f"{cap[1] / cap[0]:.2f}× (Redis then needs ~{redis_ms:.0f} ms of CPU a second)")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    asyncio.run(main())
