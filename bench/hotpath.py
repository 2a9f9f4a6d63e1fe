"""The hot path, side by side: a bare aiohttp pass-through, fairgate as shipped (`fairgate serve` with no flags but
its backends: the default policy, info logs and the access log, written to a file; auth, token accounting, the
usage log), and optionally the LiteLLM proxy, each on one core in front of the same mock OpenAI backend, driven
by the same closed-loop load (keep-alive, one request in flight per connection) on the other core. Each rate
comes with the proxy's CPU per request (user + system time from /proc over the measured seconds): the load
shares a core with the backend and caps the rates, so CPU per request is the figure to compare.

    .venv/bin/python bench/hotpath.py [--seconds 10] [--rounds 3] [--litellm] [--database-url postgresql://…]
                                      [--redis-url …]

Measures, per proxy: 64-token non-streaming requests/s over 32 connections (p50/p99), the latency it adds at
concurrency 1 (non-streaming total; streaming first chunk with 1 ms between chunks; each against the backend
called directly), and
streams/s with 1 ms between chunks over 128 connections (TTFT p50/p99); prints the ratios to the bare relay.
Every proxy runs in front of both backends from the start, and the proxies take turns (``--rounds``, the order
alternating; ``--seconds`` is each measure's total over the rounds, ``--c1-stream-seconds`` the streaming one's at
concurrency 1, whose requests last ~70 ms each), so the drift of this shared machine falls on
all of them alike: one proxy measured after the other saw ±30 % swings between them.
For fairgate it then checks that every request left exactly one usage row with the right token counts.
``--only bare,fairgate,core`` measures a third proxy too: fairgate with the stages that close a request (its usage
row, access record and statistics; ``--skip`` to choose) left out by ``bench/stages.py``, to see what the
request's own path costs and what those stages add.
LiteLLM (``--litellm``) is installed by the bench into its own virtual environment (~/.cache/fairgate).
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
from netutil import free_port, wait_ready
from procstat import rss_cpu

HERE = Path(__file__).resolve().parent
PY = sys.executable
MODEL = "mock-llama"
LITELLM_VENV = Path.home() / ".cache" / "fairgate" / "litellm-venv"


def pinned(core: int, argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", str(core), *argv], stdout=subprocess.DEVNULL,
                            stderr=kw.pop("stderr", subprocess.DEVNULL), **kw)


def _q(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * (len(values) - 1)))] * 1000 if values else 0.0


async def closed_loop(url: str, headers: dict, body: dict, conns: int, seconds: float, pid: int | None = None) -> dict:
    """``conns`` connections, each sending its next request when the last one ended, for ``seconds`` (after a
    second's warm-up); with ``pid``, that process's CPU time over those seconds too."""
    lat, ttft, errors = [], [], 0
    conn = aiohttp.TCPConnector(limit=conns, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one() -> None:
            nonlocal errors
            t0 = time.perf_counter()
            first = None
            async with s.post(url, json=body, headers=headers) as r:
                async for _ in r.content.iter_any():
                    first = first or time.perf_counter()
                if r.status != 200:
                    errors += 1
                    return
            end = time.perf_counter()
            lat.append(end - t0)
            ttft.append((first or end) - t0)

        async def worker(stop: float) -> None:
            while time.perf_counter() < stop:
                await one()

        await asyncio.gather(*(worker(time.perf_counter() + 1.0) for _ in range(conns)))  # warm-up
        lat.clear(), ttft.clear()
        errors = 0
        cpu0 = rss_cpu(pid)[1] if pid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(t0 + seconds) for _ in range(conns)))
        wall = time.perf_counter() - t0
        cpu = rss_cpu(pid)[1] - cpu0 if pid else 0.0  # (user + system, in the kernel's 10 ms ticks)
    return {"wall_s": wall, "requests": len(lat), "errors": errors, "lat": lat, "ttft": ttft, "cpu_s": cpu}


PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "embeddings": "/v1/embeddings"}


def body(stream: bool, tokens: int, endpoint: str = "chat") -> dict:
    if endpoint == "responses":
        return {"model": MODEL, "input": "Hello, how are you today?", "max_output_tokens": tokens,
                "stream": stream}  # (stored, as OpenAI's default: each answer is written to the database)
    if endpoint == "embeddings":
        return {"model": MODEL, "input": "Hello, how are you today?"}
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello, how are you today?"}],
            "max_tokens": tokens, "stream": stream}


class Proxy:
    """One proxy under test in front of one backend, pinned to a core."""

    keys: dict[tuple[str, str], dict[str, str]] = {}  # fairgate's key per database and app (one app per bench
    # run, and one for ``core``, whose requests leave no usage row or, given --skip without it, rows apart)

    def __init__(self, name: str, core: int, args: argparse.Namespace, tmp: str, tag: str):
        self.name, self.core, self.args, self.tmp, self.tag = name, core, args, tmp, tag
        self.proc: subprocess.Popen | None = None
        self.headers: dict[str, str] = {}
        self.url = ""
        self.db = args.database_url or f"sqlite:///{tmp}/{'core' if name == 'core' else 'fairgate'}-{tag}.db"

    async def start(self, backend: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        if self.name == "bare":
            self.proc = pinned(self.core, [PY, str(HERE / "passthrough.py"), "--port", str(port), "--backend", backend])
            await wait_ready(self.url + "/health")
        elif self.name in ("fairgate", "core"):
            fg = [PY, "-m", "fairgate.cli.main"]
            app = self.args.app if self.name == "fairgate" else self.args.app + "-core"  # (the row check's alone)
            if (self.db, app) not in self.keys:
                subprocess.run([*fg, "admin", "app", "create", app, "--database-url", self.db], check=True,
                               stdout=subprocess.DEVNULL)
                out = subprocess.check_output([*fg, "admin", "key", "create", "--app", app, "--json",
                                               "--database-url", self.db])
                self.keys[self.db, app] = {"Authorization": f"Bearer {json.loads(out)['key']}"}
            self.headers = self.keys[self.db, app]
            extra = ["--redis-url", self.args.redis_url] if self.args.redis_url else []
            # the mock publishes no vLLM metrics: say what it can hold, as vLLM's /metrics would (else the gate
            # keeps max_inflight_per_backend, 64, and the rest of 128 streams wait in the gateway's queue)
            cfg = Path(self.tmp) / f"fairgate-{port}.yaml"
            cfg.write_text(f"backends:\n  - url: {backend}\n    max_num_seqs: 4096\n    kv_tokens: 100000000\n")
            # as shipped: default policy, info logs and the access log on, written where a user's would go (a file)
            self.log = open(Path(self.tmp) / f"fairgate-{port}.log", "wb")
            # core: fairgate with the stages that close a request (its audit row, access record, statistics) left
            # out (bench/stages.py), to see what the request's own path costs
            serve = [PY, str(HERE / "stages.py"), self.args.skip] if self.name == "core" else fg
            self.proc = pinned(self.core, [*serve, "serve", "--config", str(cfg), "--port", str(port),
                                           "--database-url", self.db, *extra, *self.args.fairgate_arg],
                               stderr=self.log)
            await wait_ready(self.url + "/v1/models", self.headers)
        else:  # litellm
            cfg = Path(self.tmp) / f"litellm-{self.tag}.yaml"
            master = "sk-bench-" + os.urandom(16).hex()  # LiteLLM refuses to start unauthenticated
            cfg.write_text(f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n"
                           f"      model: openai/{MODEL}\n      api_base: {backend}/v1\n      api_key: none\n"
                           f"general_settings:\n  master_key: {master}\n")
            self.headers = {"Authorization": f"Bearer {master}"}
            self.proc = pinned(self.core, [str(LITELLM_VENV / "bin" / "litellm"), "--config", str(cfg),
                                           "--port", str(port), "--num_workers", "1"])
            await wait_ready(self.url + "/health/liveliness", timeout=300)

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None


def ensure_litellm() -> None:
    if (LITELLM_VENV / "bin" / "litellm").exists():
        return
    print(f"installing LiteLLM into {LITELLM_VENV} …", flush=True)
    subprocess.run([PY, "-m", "venv", str(LITELLM_VENV)], check=True)
    subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)


KINDS = ("json", "json_c1", "stream_c1", "stream")


async def measure(kind: str, proxy: Proxy, args) -> dict:
    stream, conns = {"json": (False, args.conns), "json_c1": (False, 1), "stream_c1": (True, 1),
                     "stream": (True, args.stream_conns)}[kind]
    seconds = args.seconds / args.rounds / (2 if kind.endswith("_c1") else 1)
    if kind == "stream_c1":  # a stream lasts ~70 ms: enough of them for a steady median (~220 at 16 s)
        seconds = max(seconds, args.c1_stream_seconds / args.rounds)
    return await closed_loop(proxy.url + PATHS[args.endpoint], proxy.headers, body(stream, args.tokens, args.endpoint),
                             conns, seconds, proxy.proc.pid)


def pooled(runs: list[dict]) -> dict:
    """The rounds of one proxy and kind together: rates summed over time, percentiles of all requests."""
    wall = sum(r["wall_s"] for r in runs)
    lat = [x for r in runs for x in r["lat"]]
    ttft = [x for r in runs for x in r["ttft"]]
    cpu = sum(r.get("cpu_s", 0.0) for r in runs)
    return {"per_s": round(len(lat) / wall, 1), "requests": len(lat), "errors": sum(r["errors"] for r in runs),
            "cpu_us": round(cpu / max(1, len(lat) + sum(r["errors"] for r in runs)) * 1e6, 1),
            "p50_ms": round(_q(lat, 0.5), 2), "p99_ms": round(_q(lat, 0.99), 2),
            "ttft_p50_ms": round(_q(ttft, 0.5), 2), "ttft_p99_ms": round(_q(ttft, 0.99), 2),
            "rounds_per_s": [round(r["requests"] / r["wall_s"], 1) for r in runs]}


async def check_rows(args, dbs: set[str], sent: int) -> str:
    """Every request fairgate served left one usage row with the right counts (this run's app only)."""
    from sqlalchemy import func, select

    from fairgate.storage.db import make_engine, sessionmaker
    from fairgate.storage.models import UsageLog

    rows = ids = ok = tokens = 0
    for db in sorted(dbs):
        engine = make_engine(db)
        async with sessionmaker(engine)() as s:
            r, i, o, t = (await s.execute(select(
                func.count(), func.count(func.distinct(UsageLog.request_id)),
                func.count().filter(UsageLog.status == "ok"),
                func.sum(UsageLog.completion_tokens).filter(UsageLog.status == "ok")).where(
                UsageLog.app == args.app))).one()
        await engine.dispose()
        rows, ids, ok, tokens = rows + r, ids + i, ok + o, tokens + (t or 0)
    each = 0 if args.endpoint == "embeddings" else args.tokens
    good = rows == ids == ok and tokens == ok * each and rows >= sent
    return (f"{'OK' if good else 'MISMATCH'}: {rows} rows, {ids} request ids, {ok} ok, {tokens} completion tokens "
            f"({each} each expected), {sent} requests counted by the load")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--stream-conns", type=int, default=128)
    ap.add_argument("--chunk-delay-ms", type=float, default=1.0)
    ap.add_argument("--c1-stream-seconds", type=float, default=16.0,
                    help="time for the streaming measure at concurrency 1, per proxy over the rounds")
    ap.add_argument("--database-url", default=None, help="fairgate's SQL (default: a fresh SQLite file)")
    ap.add_argument("--redis-url", default=None, help="fairgate's shared state (default: in memory)")
    ap.add_argument("--litellm", action="store_true", help="also the LiteLLM proxy (installed on first use)")
    ap.add_argument("--proxy-core", type=int, default=0)
    ap.add_argument("--load-core", type=int, default=1)
    ap.add_argument("--fairgate-arg", action="append", default=[],
                    help="an extra `fairgate serve` argument (repeat it; none: as shipped)")
    ap.add_argument("--only", default=None, help="comma-separated: bare,fairgate,core,litellm")
    ap.add_argument("--skip", default="usage_row,access_log,statistics",
                    help="what `core` leaves out of fairgate (bench/stages.py)")
    ap.add_argument("--rounds", type=int, default=3, help="turns each proxy takes, alternating (--seconds in all)")
    ap.add_argument("--endpoint", choices=tuple(PATHS), default="chat",
                    help="what the load asks: chat completions, Responses (stored, the default) or embeddings "
                         "(not streamed: its stream figures repeat the others at more connections)")
    args = ap.parse_args()
    args.app = "bench-" + os.urandom(4).hex()  # this run's rows, whatever the database already holds
    os.sched_setaffinity(0, {args.load_core})
    if args.litellm:
        ensure_litellm()
    tmp = tempfile.mkdtemp(prefix="fairgate-hotpath-")
    fast_port, slow_port = free_port(), free_port()
    mocks = [pinned(args.load_core, [PY, str(HERE / "mock_backend.py"), "--port", str(fast_port)]),
             pinned(args.load_core, [PY, str(HERE / "mock_backend.py"), "--port", str(slow_port),
                                     "--chunk-delay-ms", str(args.chunk_delay_ms)])]
    fast, slow = f"http://127.0.0.1:{fast_port}", f"http://127.0.0.1:{slow_port}"
    names = (args.only or "bare,fairgate" + (",litellm" if args.litellm else "")).split(",")
    runs: dict = {name: {kind: [] for kind in KINDS} for name in names}
    proxies: dict = {}
    results: dict = {}
    try:
        await wait_ready(fast + "/health"), await wait_ready(slow + "/health")
        path = PATHS[args.endpoint]
        direct = {"json_c1": pooled([await closed_loop(fast + path, {}, body(False, args.tokens, args.endpoint),
                                                       1, args.seconds / 2)]),
                  # against the paced backend: the fast one writes a whole stream in one burst of CPU on the load's
                  # core, and the load then waits for it to read the proxy's first chunk, whatever the proxy
                  "stream_c1": pooled([await closed_loop(slow + path, {}, body(True, args.tokens, args.endpoint),
                                                         1, max(args.seconds / 2, args.c1_stream_seconds))])}
        results["direct"] = direct
        for name in names:  # each in front of the fast backend (non-streaming) and the paced one (streaming)
            for tag, backend in (("fast", fast), ("slow", slow)):
                proxies[name, tag] = Proxy(name, args.proxy_core, args, tmp, tag)
                await proxies[name, tag].start(backend)
        # rounds: each proxy in turn, the order alternating, so that the machine's drift (it is shared) falls on
        # all of them alike; the ratios are those of the pooled rounds
        for k in range(args.rounds):
            for kind in KINDS:
                for name in (names if k % 2 == 0 else names[::-1]):
                    runs[name][kind].append(await measure(kind, proxies[name, "slow" if kind.startswith(
                        "stream") else "fast"], args))
        for name in names:
            results[name] = r = {kind: pooled(runs[name][kind]) for kind in KINDS}
            print(f"{name:9s} json {r['json']['per_s']:8.1f} req/s {r['json']['cpu_us']:6.1f} µs CPU/req p50 {r['json']['p50_ms']:6.2f} p99 "
                  f"{r['json']['p99_ms']:7.2f} ms | c=1 +{r['json_c1']['p50_ms'] - direct['json_c1']['p50_ms']:.2f} ms"
                  f" (stream first chunk +{r['stream_c1']['ttft_p50_ms'] - direct['stream_c1']['ttft_p50_ms']:.2f}"
                  f" ms) | stream {r['stream']['per_s']:7.1f}/s {r['stream']['cpu_us']:6.1f} µs CPU/stream TTFT p50 {r['stream']['ttft_p50_ms']:.2f} p99 "
                  f"{r['stream']['ttft_p99_ms']:.2f} ms", flush=True)
        if "fairgate" in names:
            for tag in ("fast", "slow"):
                proxies["fairgate", tag].stop()  # its last rows written
            sent = sum(r["requests"] + r["errors"] for kind in KINDS for r in runs["fairgate"][kind])
            results["rows"] = await check_rows(args, {p.db for (n, _), p in proxies.items() if n == "fairgate"}, sent)
            print("usage rows:", results["rows"], flush=True)
    finally:
        for p in proxies.values():
            p.stop()
        for m in mocks:
            m.terminate()
            m.wait()
    if "bare" in results:
        b = results["bare"]
        for name in names:
            if name == "bare" or name not in results:
                continue
            r = results[name]
            per_round = [round(x / y, 2) for x, y in zip(r["json"]["rounds_per_s"], b["json"]["rounds_per_s"])]
            print(f"{name} / bare: CPU per request {r['json']['cpu_us'] / b['json']['cpu_us']:.2f}×, per stream "
                  f"{r['stream']['cpu_us'] / b['stream']['cpu_us']:.2f}×; throughput non-streaming "
                  f"{r['json']['per_s'] / b['json']['per_s']:.2f}× (rounds {per_round}), "
                  f"streaming {r['stream']['per_s'] / b['stream']['per_s']:.2f}× (rounds "
                  f"{[round(x / y, 2) for x, y in zip(r['stream']['rounds_per_s'], b['stream']['rounds_per_s'])]}), "
                  f"p99 {r['json']['p99_ms'] / b['json']['p99_ms']:.2f}× (non-streaming) "
                  f"{r['stream']['p99_ms'] / b['stream']['p99_ms']:.2f}× (streaming)")
    print(json.dumps({"cpus": os.cpu_count(), "args": vars(args), "results": results}))


if __name__ == "__main__":
    asyncio.run(main())
