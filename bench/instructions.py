"""Instructions per request, counted by callgrind: a figure the machine's noise does not move (seconds of CPU
swing ±30 % on a shared machine; instructions repeat to within a few percent).

``fairgate serve`` as shipped (info logs, the access log on, the default policy; SQLite, in-memory state) runs
under ``valgrind --tool=callgrind`` in front of the hot-path bench's mock backend; a warm-up, then callgrind's
counters are zeroed, ``--requests`` 64-token chat completions are sent ``--concurrency`` at a time, the counters
are dumped, and their total is divided by the requests. Start-up and warm-up are not counted; the idle work
of a few seconds before the load (health checks, flushes, syncs) is measured too, and subtracted in
proportion to the load's seconds.

    .venv/bin/python bench/instructions.py [--requests 2000] [--concurrency 8] [--stream] [--bare]
                                           [--database-url …] [--redis-url …] [--json]

With ``--redis-url`` the shared state syncs every second instead of every 20 ms: the sync's work goes with time,
not with requests (``bench/sync_cost.py`` measures it), and is left out of a request's count.

A stream is counted with ``--stream --chunk-delay-ms 10``: every read then brings one token, as a backend
decoding at 10-50 ms a step sends them. At 1 ms a chunk the gateway, slowed ~50× by callgrind, falls behind
the mock and each read gathers several tokens — the more, the slower the machine — so the count moves with the
machine (2.6-2.9 M a stream where one token a read costs 8.1 M).

``--bare`` counts the bare aiohttp relay (``bench/passthrough.py``) instead: the floor for a Python gateway.
``--skip usage_row,access_log,statistics`` leaves those stages of a request's end out (``bench/stages.py``), to
count what each costs; a stream's ``read_charge`` and ``read_fit``, what each read pays for them.
``tests/test_hotpath_cost.py`` runs this at a smaller size and fails when the count grows by more than 10 %
over the baseline recorded in ``tests/data/hotpath_instructions.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
PY = sys.executable
sys.path.insert(0, str(HERE))
from netutil import free_port, wait_ready  # noqa: E402


def _totals(path: Path) -> int:
    """The Ir total of a callgrind dump."""
    text = path.read_text(errors="replace")
    m = re.search(r"^(?:totals|summary):\s+(\d+)", text, re.M)
    if not m:
        raise RuntimeError(f"no totals in {path}")
    return int(m.group(1))


def _dumped(tmp: Path, keep: str | None = None) -> int:
    """The total of callgrind's last dump (``callgrind_control`` returns once it is written), then removed."""
    dump = max(tmp.glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]), default=None)
    if dump is None:
        raise RuntimeError("callgrind wrote no dump")
    if keep:  # for callgrind_annotate
        shutil.copy(dump, keep)
    total = _totals(dump)
    dump.unlink()
    return total


async def _load(url: str, headers: dict, body: dict, requests: int, concurrency: int) -> int:
    """``requests`` requests, ``concurrency`` at a time; the number answered 200 with the whole body read."""
    ok = 0
    todo = iter(range(requests))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def worker() -> None:
            nonlocal ok
            for _ in todo:
                async with s.post(url, json=body, headers=headers) as r:
                    await r.read()
                    ok += r.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def _control(pid: int, flag: str) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


async def count(requests: int = 2000, concurrency: int = 8, stream: bool = False, bare: bool = False,
                warmup: int = 200, database_url: str | None = None, redis_url: str | None = None,
                tokens: int = 64, keep: str | None = None, idle_seconds: float = 6.0,
                chunk_delay_ms: float = 0.0, skip: str = "") -> dict:
    """Instructions per request of fairgate as shipped (or of the bare relay) under callgrind."""
    if not shutil.which("valgrind"):
        raise RuntimeError("valgrind is not installed")
    tmp = Path(tempfile.mkdtemp(prefix="fairgate-instr-"))
    backend_port, port = free_port(), free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    try:
        procs.append(subprocess.Popen([PY, str(HERE / "mock_backend.py"), "--port", str(backend_port),
                                       "--tokens", str(tokens), "--chunk-delay-ms", str(chunk_delay_ms)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        await wait_ready(backend + "/health")
        headers: dict[str, str] = {}
        out = tmp / "callgrind.out"
        # instrumented only from the warm-up on: the start-up (imports) runs ~5× faster uninstrumented
        grind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-line=no",
                 "--instr-atstart=no"]
        if bare:
            argv = [*grind, PY, str(HERE / "passthrough.py"), "--port", str(port), "--backend", backend]
            ready = f"http://127.0.0.1:{port}/health"
        else:
            db = database_url or f"sqlite:///{tmp}/fairgate.db"
            fg = [PY, "-m", "fairgate.cli.main"]
            app = "instr-" + os.urandom(4).hex()
            subprocess.run([*fg, "admin", "app", "create", app, "--database-url", db], check=True,
                           stdout=subprocess.DEVNULL, env=env)
            key = json.loads(subprocess.check_output([*fg, "admin", "key", "create", "--app", app, "--json",
                                                      "--database-url", db], env=env))["key"]
            headers = {"Authorization": f"Bearer {key}"}
            cfg = tmp / "fairgate.yaml"
            # with Redis the state syncs every second, not every 20 ms: the sync's work goes with time, not with
            # requests, and under callgrind a busy loop runs fewer of them than an idle one, so subtracting the
            # idle seconds' took off more than the load's syncs cost (0.54 M a request, against 0.97 M without)
            sync = "redis_sync_s: 1.0\n" if redis_url else ""
            cfg.write_text(f"{sync}backends:\n  - url: {backend}\n    max_num_seqs: 4096\n    kv_tokens: 100000000\n")
            serve = [PY, str(HERE / "stages.py"), skip] if skip else fg  # (stages left out: bench/stages.py)
            argv = [*grind, *serve, "serve", "--config", str(cfg), "--port", str(port), "--database-url", db,
                    *(["--redis-url", redis_url] if redis_url else [])]
            ready = f"http://127.0.0.1:{port}/v1/models"
        log = open(tmp / "server.log", "wb")
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
        procs.append(server)
        await wait_ready(ready, headers, timeout=600)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "mock-llama", "messages": [{"role": "user", "content": "Hello, how are you today?"}],
                "max_tokens": tokens, "stream": stream}
        _control(server.pid, "--instr=on")
        await _load(url, headers, body, warmup, concurrency)
        # the idle work (timers: health checks, flushes, syncs) of a second, subtracted from the measure below
        # in proportion to its seconds: a loaded machine stretches them under callgrind, not the requests' work
        _control(server.pid, "--zero")
        t0 = time.monotonic()
        await asyncio.sleep(idle_seconds)
        _control(server.pid, "--dump")
        idle_per_s = _dumped(tmp) / (time.monotonic() - t0)
        _control(server.pid, "--zero")
        t0 = time.monotonic()
        ok = await _load(url, headers, body, requests, concurrency)
        wall = time.monotonic() - t0
        _control(server.pid, "--dump")
        total = _dumped(tmp, keep)
        work = total - idle_per_s * wall
        if ok != requests:
            raise RuntimeError(f"{requests - ok} of {requests} requests failed (log: {tmp / 'server.log'})")
        return {"proxy": "bare" if bare else "fairgate", "skip": skip, "stream": stream, "requests": requests,
                "concurrency": concurrency, "instructions": total, "idle_per_s": round(idle_per_s),
                "per_request": round(work / requests), "wall_s": round(wall, 1), "python": sys.version.split()[0]}
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--chunk-delay-ms", type=float, default=0.0,
                    help="the mock's pause between chunks (0: a stream in one burst; 10: a read per token, as from "
                    "vLLM, however slowly callgrind runs the gateway; at 1 a read gathers several, more on a slower "
                    "machine)")
    ap.add_argument("--bare", action="store_true", help="the bare aiohttp relay instead of fairgate")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", default=None, help="copy callgrind's dump of the measured requests here")
    ap.add_argument("--skip", default="", help="stages left out, comma-separated (usage_row, access_log, "
                    "statistics; a stream's read_charge, read_fit: bench/stages.py), to count what they cost")
    args = ap.parse_args()
    r = asyncio.run(count(args.requests, args.concurrency, args.stream, args.bare, args.warmup, args.database_url,
                          args.redis_url, keep=args.keep, chunk_delay_ms=args.chunk_delay_ms, skip=args.skip))
    print(json.dumps(r) if args.json else
          f"{r['proxy']}{' streaming' if r['stream'] else ''}{f' without {args.skip}' if args.skip else ''}: "
          f"{r['per_request'] / 1e6:.3f} M instructions a request "
          f"({r['requests']} at concurrency {r['concurrency']}, {r['wall_s']} s under callgrind)")


if __name__ == "__main__":
    main()
