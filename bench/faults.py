"""The fault suite at full length, with the figures the README quotes. Every process is real:
`fairgate serve`, `fairgate backend-sim`, PostgreSQL and Redis (reached through a TCP proxy that this script
cuts and restores).

    .venv/bin/python bench/faults.py [kill] [streams] [redis] [postgres]   (default: all)
        [--trials 200] [--streams 2000] [--redis-down 30] [--pg-down 60]

kill      backend processes killed before the first token and mid-stream, alternately: every stream must end
          with [DONE] (served elsewhere) or an SSE error event, and no reservation may leak
streams   N concurrent streams held by one gateway process (a backend process that trickles a token a second)
redis     Redis cut for S seconds under a closed-loop load: failed requests
postgres  PostgreSQL cut for S seconds under load: usage rows lost (rows in the database vs requests sent)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.overhead import free_port, wait_ready  # noqa: E402
from tests.tcp_proxy import TcpProxy  # noqa: E402

PY = sys.executable
PG = "postgresql://postgres@127.0.0.1:5432/test"


def fg(*args: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "fairgate.cli.main", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def admin_key(db: str) -> str:
    run = lambda *a: json.loads(subprocess.run([PY, "-m", "fairgate.cli.main", *a, "--json", "--database-url", db],  # noqa: E731
                                              capture_output=True, text=True, check=True).stdout)
    run("admin", "app", "create", "bench")
    return run("admin", "key", "create", "--app", "bench")["key"]


async def gateway(tmp: Path, db: str, extra: str = "", admin_db: str | None = None
                  ) -> tuple[subprocess.Popen, str, str]:
    key = admin_key(admin_db or db)  # (a blocking call: never through this process's own proxy)
    port = free_port()
    cfg = tmp / f"gw-{port}.yaml"
    cfg.write_text(f"port: {port}\ndatabase_url: {db}\nusage_journal: {tmp}/journal-{port}\nmetrics_public: true\n{extra}")
    proc = fg("serve", "--config", str(cfg), "--log-level", "warning")
    await wait_ready(f"http://127.0.0.1:{port}/ready", timeout=120)
    return proc, f"http://127.0.0.1:{port}", key


async def stream(s: aiohttp.ClientSession, url: str, key: str, body: dict, on_event=None) -> str:
    """'done', 'error' (an SSE error event) or 'broken' (anything else: a lost stream)."""
    async with s.post(url + "/v1/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            return f"http {r.status}"
        n = 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            n += 1
            if on_event is not None:
                on_event(n)
            if line.strip() == b"data: [DONE]":
                return "done"
            if b'"error"' in line[:20]:
                return "error"
    return "broken"


async def inflight(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("fairgate_backend_inflight{", "fairgate_backend_inflight_tokens{")))


async def kill_trials(tmp: Path, trials: int) -> None:
    ports = [free_port(), free_port()]
    sims = [fg("backend-sim", "--port", str(p), "--speed", "2") for p in ports]
    for p in ports:
        await wait_ready(f"http://127.0.0.1:{p}/health")
    backends = "".join(f"  - {{url: 'http://127.0.0.1:{p}', name: {n}}}\n" for p, n in zip(ports, ("a", "b")))
    gw, url, key = await gateway(tmp, f"sqlite:///{tmp}/kill.db", "health_interval_s: 3600\n"
                                 "outlier_consecutive_failures: 1000000\nbackends:\n" + backends)
    outcomes: dict[str, int] = {}
    leaks = 0
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "go"}], "max_tokens": 40,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        for trial in range(trials):
            before = trial % 2 == 0
            if before:  # "a" is dead when the request arrives: it must be served by "b"
                sims[0].kill()
                sims[0].wait()
                result = await stream(s, url, key, body)
            else:  # "a" dies after the 5th event
                def on_event(n: int) -> None:
                    if n == 5:
                        sims[0].kill()
                result = await stream(s, url, key, body, on_event)
                sims[0].wait()
            outcomes[f"{'before' if before else 'mid'}:{result}"] = outcomes.get(
                f"{'before' if before else 'mid'}:{result}", 0) + 1
            sims[0] = fg("backend-sim", "--port", str(ports[0]), "--speed", "2")
            await wait_ready(f"http://127.0.0.1:{ports[0]}/health")
            await asyncio.sleep(0.05)
            leaks += await inflight(s, url) != 0
    gw.terminate()
    gw.wait()
    for p in sims:
        p.kill()
    print(f"kill: {trials} trials → {dict(sorted(outcomes.items()))}; trials with a leaked reservation: {leaks}")


async def many_streams(tmp: Path, n: int) -> None:
    port = free_port()
    sim = fg("backend-sim", "--port", str(port), "--speed", "0.05", "--kv-tokens", "10000000",
             "--max-num-seqs", str(n + 100))
    await wait_ready(f"http://127.0.0.1:{port}/health")
    gw, url, key = await gateway(tmp, f"sqlite:///{tmp}/streams.db", f"max_queued_per_tenant: {n}\n"
                                 f"backends:\n  - url: http://127.0.0.1:{port}\n")
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "go"}], "max_tokens": 20,
            "ignore_eos": True}
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        peak = [0]

        async def watch() -> None:
            while True:
                async with s.get(url + "/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith("fairgate_backend_inflight{"):
                            peak[0] = max(peak[0], int(float(line.rsplit(" ", 1)[1])))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(stream(s, url, key, body) for _ in range(n)), return_exceptions=True)
        watcher.cancel()
    done = sum(r == "done" for r in results)
    print(f"streams: {n} concurrent → {done} completed with [DONE], peak {peak[0]} in flight at once, "
          f"{time.monotonic() - started:.1f} s; others: {[r for r in results if r != 'done'][:5]}")
    gw.terminate()
    gw.wait()
    sim.kill()


async def load(url: str, key: str, stop: asyncio.Event, clients: int = 8) -> tuple[int, int]:
    sent = failed = 0
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def one(s: aiohttp.ClientSession) -> None:
        nonlocal sent, failed
        while not stop.is_set():
            sent += 1
            try:
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    failed += r.status != 200
            except aiohttp.ClientError:
                failed += 1

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s) for _ in range(clients)))
    return sent, failed


async def outage(tmp: Path, what: str, down_s: float) -> None:
    target = 6379 if what == "redis" else 5432
    proxy = await TcpProxy("127.0.0.1", target).start()
    name = f"fairgate_bench_{uuid.uuid4().hex[:8]}"
    if what == "postgres":
        conn = await asyncpg.connect(PG)
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()
        db = f"postgresql://postgres@127.0.0.1:{proxy.port}/{name}"
        direct = PG.rsplit("/", 1)[0] + "/" + name
        extra = ""
    else:
        db = direct = f"sqlite:///{tmp}/redis.db"
        extra = f"redis_url: redis://127.0.0.1:{proxy.port}/0\nredis_namespace: bench{uuid.uuid4().hex[:6]}\n"
    gw, url, key = await gateway(tmp, db, "emulated: {count: 2, speed: 20.0}\n" + extra, admin_db=direct)
    stop = asyncio.Event()
    task = asyncio.create_task(load(url, key, stop))
    await asyncio.sleep(3)
    await proxy.cut()
    await asyncio.sleep(down_s)
    await proxy.start()
    await asyncio.sleep(3)
    stop.set()
    sent, failed = await task
    gw.terminate()
    await asyncio.to_thread(gw.wait)  # its last rows go through this process's proxy: keep the loop running
    line = f"{what}: down {down_s:.0f} s under 8 closed-loop clients → {sent} requests, {failed} failed"
    if what == "postgres":
        conn = await asyncpg.connect(PG.rsplit("/", 1)[0] + "/" + name)
        rows = await conn.fetchval("SELECT count(*) FROM usage_log")
        await conn.close()
        conn = await asyncpg.connect(PG)
        await conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await conn.close()
        line += f", {rows} usage rows ({sent - rows} lost)"
    print(line)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", nargs="*", default=["kill", "streams", "redis", "postgres"])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--redis-down", type=float, default=30)
    p.add_argument("--pg-down", type=float, default=60)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "kill" in a.which:
            await kill_trials(tmp, a.trials)
        if "streams" in a.which:
            await many_streams(tmp, a.streams)
        if "redis" in a.which:
            await outage(tmp, "redis", a.redis_down)
        if "postgres" in a.which:
            await outage(tmp, "postgres", a.pg_down)


if __name__ == "__main__":
    asyncio.run(main())
