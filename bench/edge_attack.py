"""The edge under every attack at once: a real `fairgate serve` (max_connections 200, the listener's other limits
at their defaults) in front of two malicious backends, attacked from 127.0.0.1 for ``--seconds`` by

- 50 connections sending a chunked POST /v1/chat/completions (valid key) whose last chunk is followed by a trailer
  section that never ends (one header line, written as fast as the socket takes it, on past the answer);
- 50 connections pipelining GET /metrics and GET /health (no key) as fast as they can write, never reading;
- 30 connections holding slots without a key (GET /health every 25 s, idle otherwise; reconnecting when closed);
- ``--keyed`` clients with a valid key sending chat completions to the malicious backends: A answers
  ``HTTP/1.1 500`` with a chunked body that never ends, B a status line and then a header line that never ends
  (both answer /v1/models and /health properly, so the gateway's pool marks them up);

while a probe sends GET /health every 20 ms, alternately on a fresh and on a kept-alive connection, and the
gateway's RSS (/proc/PID/status) and CPU time (/proc/PID/stat) are sampled every 0.5 s.

Targets: peak RSS < 200 MB, /health p99 < 50 ms (a failed probe counts as 1 s), the gateway alive at the end;
exit status 1 on FAIL. Also printed: the keyed clients' statuses (5xx expected: the backends are broken; what
matters is an answer within ``--keyed-timeout``), what each attack achieved, the gateway's log in brief.

    PYTHONPATH=. .venv/bin/python bench/edge_attack.py [--seconds 30] [--keyed 4] [--attacks trailers,pipeline,…]

The attackers and the malicious backends are two child processes at nice +10 (``--nice``): a real attacker's CPU
is not the gateway's; the probe and the sampler run here at normal priority. ``--attacks`` runs a subset, to tell
their effects apart. Every loop is bounded in count and time; every child process is ended at the end, on an
error, or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edge_wire import FILL, HOST, MODEL, connect, content_length, flood, q, read_response, shut
from netutil import free_port, wait_ready
from procstat import rss_cpu, sample

PY = sys.executable
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
PIPELINE = (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + HEALTH) * 400  # ~34 KB a write
CHILDREN: list[subprocess.Popen] = []


# -- the malicious backends (a child process) ----------------------------------------------------------------------
async def backends(ports: list[int], max_s: float) -> dict:
    stats: collections.Counter = collections.Counter()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]})
    loop = asyncio.get_running_loop()
    endless = {  # A: a 500 whose chunked body never ends; B: a status line, then a header line that never ends
        "a": ((b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n"), b"%x\r\n%s\r\n" % (len(FILL), FILL)),
        "b": (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Endless: ", FILL)}

    def serve(kind: str):
        async def conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                for _ in range(10_000):
                    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 60)
                    method, path = head.split(b" ", 2)[:2]
                    await r.readexactly(content_length(head))
                    stats[f"{kind} {method.decode()} {path.decode()}"] += 1
                    if method == b"POST" and path == b"/v1/chat/completions":
                        return await flood(w, *endless[kind], loop.time() + max_s, stats, kind)
                    if path in (b"/v1/models", b"/health"):  # what the pool probes (/metrics: 404, skipped)
                        body = models.encode() if path == b"/v1/models" else b'{"status":"ok"}'
                        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(body), body))
                    else:
                        w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    await w.drain()
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as e:
                stats[f"{kind} ended: {type(e).__name__}"] += 1
            except asyncio.CancelledError:  # the end: quietly
                pass
            finally:
                shut(w)
        return conn

    servers = [await asyncio.start_server(serve(k), HOST, p) for k, p in zip("ab", ports)]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max_s)
    for s in servers:
        s.close()
    return {k: round(v, 1) for k, v in stats.items()}


# -- the attackers (a child process) ------------------------------------------------------------------------------
async def attack(port: int, key: str, seconds: float, keyed: int, keyed_timeout: float, which: str) -> dict:
    import aiohttp

    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    s: collections.Counter = collections.Counter()
    keyed_status: collections.Counter = collections.Counter()
    keyed_lat: list[float] = []
    idle_closes: list[float] = []
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()

    def rounds(n: int = 100_000):
        return itertools.takewhile(lambda _: loop.time() < end, range(n))

    async def conn_or_none(what: str):
        try:
            rw = await connect(port)
            s[f"{what} connections"] += 1
            return rw
        except (OSError, TimeoutError):
            s[f"{what} connects failed"] += 1
            await asyncio.sleep(0.1)
            return None

    async def trailers() -> None:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\nX-Endless: "
                % (key.encode(), len(body), body))
        for _ in rounds():
            if (rw := await conn_or_none("trailer")) is None:
                continue
            status = asyncio.create_task(read_response(rw[0]))
            await flood(rw[1], head, FILL, end, s, "trailer")  # on past the answer: the linger must bound it
            try:
                s[f"trailer answered {await asyncio.wait_for(status, 1)}"] += 1
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
                s["trailer got no answer"] += 1
            shut(rw[1])

    async def pipeline() -> None:
        for _ in rounds():
            if (rw := await conn_or_none("pipeline")) is not None:
                await flood(rw[1], b"", PIPELINE, end, s, "pipeline")
                shut(rw[1])

    async def holder() -> None:
        for _ in rounds():
            if (rw := await conn_or_none("holder")) is None:
                continue
            r, w = rw
            try:
                for _ in rounds(1000):
                    w.write(HEALTH)
                    s[f"holder /health {await asyncio.wait_for(read_response(r), 10)}"] += 1
                    idle_from = loop.time()
                    try:  # idle up to 25 s, watching for the gateway's close
                        if await asyncio.wait_for(r.read(1), max(0.001, min(25.0, end - loop.time()))) == b"":
                            idle_closes.append(loop.time() - idle_from)
                            break
                    except TimeoutError:
                        continue
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
                s[f"holder ended: {type(e).__name__}"] += 1
            shut(w)

    async def client(session: aiohttp.ClientSession) -> None:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        for _ in rounds():
            t0 = time.perf_counter()
            try:
                async with session.post(f"http://{HOST}:{port}/v1/chat/completions", data=body, headers=headers) as r:
                    await r.read()
                    keyed_status[str(r.status)] += 1
            except TimeoutError:
                keyed_status["no answer (timeout)"] += 1
            except aiohttp.ClientError as e:
                keyed_status[type(e).__name__] += 1
            keyed_lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=keyed_timeout)) as session:
        plan = {"trailers": (trailers, 50), "pipeline": (pipeline, 50), "holders": (holder, 30),
                "keyed": (lambda: client(session), keyed)}
        await asyncio.gather(*(f() for name in which.split(",") for f, n in [plan[name]] for _ in range(n)))
    return {"attacks": {k: round(v, 1) for k, v in sorted(s.items())}, "keyed_status": dict(keyed_status),
            "keyed_ms": [round(q(keyed_lat, p)) for p in (0.5, 0.99, 1.0)] if keyed_lat else [],
            "idle_close_s": [round(min(idle_closes), 2), round(max(idle_closes), 2)] if idle_closes else []}


# -- the probe and the sampler (this process) ---------------------------------------------------------------------
async def probe(port: int, seconds: float) -> tuple[dict, collections.Counter]:
    """GET /health every 20 ms, alternately on a fresh connection and on a kept-alive one."""
    loop = asyncio.get_running_loop()
    lat: dict = {"fresh": [], "kept-alive": [], "connect": [], "when": []}
    fails: collections.Counter = collections.Counter()
    keep: tuple | None = None
    tick = start = loop.time()
    for i in range(int(seconds / 0.02)):
        kind, w = ("fresh" if i % 2 == 0 else "kept-alive"), None
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(1.0):
                if kind == "fresh" or keep is None:
                    r, w = await connect(port)
                    lat["connect"].append(time.perf_counter() - t0)
                    keep = (r, w) if kind == "kept-alive" else keep
                else:
                    r, w = keep
                w.write(HEALTH)
                if (status := await read_response(r)) != 200:
                    fails[f"{kind}: HTTP {status}"] += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            fails[f"{kind}: {type(e).__name__}"] += 1
            keep = None if kind == "kept-alive" else keep
            shut(w)
            t0 = time.perf_counter() - 1.0  # a failed probe counts as the timeout
        lat[kind].append(time.perf_counter() - t0)
        lat["when"].append((loop.time() - start, lat[kind][-1]))
        if kind == "fresh":
            shut(w)
        tick += 0.02
        await asyncio.sleep(max(0.0, tick - loop.time()))
    shut(keep[1] if keep else None)
    return lat, fails


async def backends_up(url: str, token: str) -> str:
    """The gateway's view of its backends (/ready with the operations token)."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s, \
                s.get(url + "/ready", headers={"Authorization": f"Bearer {token}"}) as r:
            seen = (await r.json())["backends"]
        return f"HTTP {r.status}, " + ", ".join(f"{n} {'up' if b['up'] else 'down'}" for n, b in seen.items())
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as e:
        return f"failed: {type(e).__name__}"


def spawn(argv: list[str], **kw) -> subprocess.Popen:
    CHILDREN.append(p := subprocess.Popen(argv, **kw))
    return p


def stop(p: subprocess.Popen, wait_s: float = 10.0) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def app_key(db: str) -> str:
    fg = [PY, "-m", "fairgate.cli.main"]
    subprocess.run([*fg, "admin", "app", "create", "edge", "--database-url", db], check=True, stdout=subprocess.DEVNULL)
    return json.loads(subprocess.check_output([*fg, "admin", "key", "create", "--app", "edge", "--json",
                                               "--database-url", db]))["key"]


async def main(a: argparse.Namespace, tmp: Path, db: str, key: str, log) -> int:
    fg = [PY, "-m", "fairgate.cli.main"]
    me = [PY, str(Path(__file__).resolve()), "--nice", str(a.nice), "--seconds", str(a.seconds)]
    bports, port, ops = [free_port(), free_port()], free_port(), os.urandom(8).hex()
    bad = spawn([*me, "--role", "backends", "--ports", f"{bports[0]},{bports[1]}"], stdout=subprocess.PIPE)
    (tmp / "gateway.yaml").write_text(
        f"port: {port}\ndatabase_url: {db}\nusage_journal: {tmp}/journal\nusage_dead_letter: {tmp}/dead.jsonl\n"
        f"max_connections: {a.max_connections}\nops_token: {ops}\nfirst_token_timeout_s: 10\ndrain_s: 3\nbackends:\n"
        f"  - {{url: 'http://{HOST}:{bports[0]}', name: a-500-endless-body}}\n"
        f"  - {{url: 'http://{HOST}:{bports[1]}', name: b-endless-header}}\n")
    gw = spawn([*fg, "serve", "--config", str(tmp / "gateway.yaml"), "--log-level", "warning"], stdout=log,
               stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    await wait_ready(url + "/ready", timeout=60)
    print(f"gateway pid {gw.pid} on :{port}; /ready: {await backends_up(url, ops)}", flush=True)
    base, _ = await probe(port, 1.0)
    rss_before = rss_cpu(gw.pid)[0]
    print(f"before: RSS {rss_before:.1f} MB, /health p50 {q(base['fresh'] + base['kept-alive'], 0.5):.2f} ms "
          f"p99 {q(base['fresh'] + base['kept-alive'], 0.99):.2f} ms", flush=True)

    atk = spawn([*me, "--role", "attack", "--port", str(port), "--keyed", str(a.keyed), "--keyed-timeout",
                 str(a.keyed_timeout), "--attacks", a.attacks], stdout=subprocess.PIPE,
                env={**os.environ, "EDGE_ATTACK_KEY": key})
    await asyncio.sleep(0.5)  # the attack under way
    load = os.getloadavg()[0]
    (lat, fails), samples = await asyncio.gather(probe(port, a.seconds - 0.5), sample(gw.pid, a.seconds))
    for _ in range(int(a.keyed_timeout + 30) * 10):  # its last keyed requests may still be waiting for answers
        if atk.poll() is not None:
            break
        await asyncio.sleep(0.1)
    if atk.poll() != 0:
        raise RuntimeError(f"the attackers' process failed (exit status {atk.poll()})")
    result = json.loads(atk.stdout.read())
    after = ((await sample(gw.pid, 2.0)) or [(0.0, 0.0, 0.0)])[-1][1]
    stop(bad)
    bad_stats = json.loads(bad.communicate()[0] or "{}")

    allv = lat["fresh"] + lat["kept-alive"]
    peak, p99 = max(x[1] for x in samples), q(allv, 0.99)
    windows = range((len(samples) - 1) // 5)
    cpu = [(samples[min(len(samples) - 1, 5 * k + 5)][2] - samples[5 * k][2]) / 2.5 for k in windows]
    print(f"\nattack: {a.seconds:.0f} s ({a.attacks}); gateway alive after: {gw.poll() is None}; "
          f"/ready after: {await backends_up(url, ops)}")
    print(f"gateway CPU: {(samples[-1][2] - samples[0][2]) / max(samples[-1][0], 0.5):.0%} of a core; machine load "
          f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    print(f"peak RSS: {peak:.1f} MB (before {rss_before:.1f}, 2 s after the attack {after:.1f})")
    print(f"/health: {len(allv)} probes, p50 {q(allv, 0.5):.2f} ms, p99 {p99:.2f} ms, max {q(allv, 1.0):.2f} ms; "
          f"failed {sum(fails.values())} {dict(fails)}")
    for kind, v in ((k, lat[k]) for k in ("fresh", "kept-alive", "connect")):
        print(f"  {kind:10s} {len(v):5d}, p50 {q(v, 0.5):.2f} p99 {q(v, 0.99):.2f} max {q(v, 1.0):.2f} ms")
    print("every 2.5 s:\n  RSS MB     " + " ".join(f"{samples[5 * k][1]:4.0f}" for k in windows) +
          "\n  CPU %      " + " ".join(f"{c * 100:4.0f}" for c in cpu) +
          "\n  p99 ms     " + " ".join(f"{q([v for t, v in lat['when'] if k <= t / 2.5 < k + 1], 0.99):4.0f}"
                                    for k in windows))
    print(f"keyed clients' statuses: {result['keyed_status']}; latency p50/p99/max {result['keyed_ms']} ms "
          f"(client timeout {a.keyed_timeout:.0f} s)")
    print("attacks: " + "; ".join(f"{k} {v}" for k, v in result["attacks"].items()))
    print(f"slot holders closed when idle after {result['idle_close_s']} s (min, max)")
    print("malicious backends: " + "; ".join(f"{k} {v}" for k, v in sorted(bad_stats.items())))
    text = (tmp / "gateway.log").read_text(errors="replace")
    warnings = collections.Counter(re.sub(r"req-\w+|a{20,}", "…", line.split(" ", 3)[-1])[:120]
                                   for line in text.splitlines() if " WARNING " in line or " ERROR " in line)
    print(f"gateway log: {len(text.splitlines())} lines, {text.count('Traceback')} tracebacks; most common:\n  "
          + "\n  ".join(f"{n}× {m}" for m, n in warnings.most_common(5)))
    checks = {"peak RSS < 200 MB": peak < 200, "/health p99 < 50 ms": p99 < 50,
              "gateway alive at the end": gw.poll() is None}
    for name, good in checks.items():
        print(f"{'PASS' if good else 'FAIL'}: {name}")
    print("HELD" if all(checks.values()) else "DID NOT HOLD")
    return 0 if all(checks.values()) else 1


def cli() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--keyed", type=int, default=4, help="clients with a valid key sending chat completions")
    ap.add_argument("--keyed-timeout", type=float, default=30.0, help="their client timeout per request (s)")
    ap.add_argument("--max-connections", type=int, default=200)
    ap.add_argument("--attacks", default="trailers,pipeline,holders,keyed", help="a subset, to tell them apart")
    ap.add_argument("--nice", type=int, default=10, help="niceness of the attackers and the malicious backends")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary directory (the gateway's log)")
    ap.add_argument("--role", choices=("main", "backends", "attack"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role != "main":
        os.nice(a.nice)
        try:
            stats = asyncio.run(backends([int(p) for p in a.ports.split(",")], a.seconds + 120) if a.role == "backends"
                                else attack(a.port, os.environ["EDGE_ATTACK_KEY"], a.seconds, a.keyed,
                                            a.keyed_timeout, a.attacks))
        except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the parent reports
            return 130
        print(json.dumps(stats), flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fairgate-edge-"))
    try:
        db = f"sqlite:///{tmp}/edge.db"
        with open(tmp / "gateway.log", "w") as log:
            return asyncio.run(main(a, tmp, db, app_key(db), log))
    except KeyboardInterrupt:
        print("interrupted: the gateway, the attackers and the backends are being ended", file=sys.stderr)
        return 130
    finally:  # also on Ctrl-C or an error: no child outlives the script
        for p in reversed(CHILDREN):
            stop(p)
        if a.keep_tmp:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(cli())
