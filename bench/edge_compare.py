"""fairgate's own HTTP/1.1 edge (``fairgate/http/``) against maintained servers and clients, as relays.

Four relays, each in a process of its own on one core, in front of the same mock OpenAI backend
(``mock_backend.py``), driven by the same closed-loop load (``hotpath.py``'s: keep-alive, one request in
flight per connection) on the other core:

- ``fairgate``: ``fairgate.http``'s ``Edge`` and ``Router`` in, its ``UpstreamPool`` out (httptools both
  ways);
- ``aiohttp``: ``web.Application`` in, ``ClientSession`` out (both aiohttp's);
- ``uvicorn``: a raw ASGI app (no framework) on uvicorn (httptools, uvloop) in, aiohttp's ``ClientSession``
  out. aiohttp's client rather than httpx: the same client as the aiohttp relay, so that those two differ by
  their server alone (and fairgate from the aiohttp relay by both sides); httpx is not a dependency;
- ``uvicorn+pool``: the same ASGI app on uvicorn, fairgate's ``UpstreamPool`` out: what a maintained server
  in front of fairgate's own client would cost (the client talks only to our backends; the server faces
  every client).

Each accepts ``POST /v1/chat/completions``, forwards the body to the backend with its own client and relays
the answer: a JSON answer whole (with its length), an SSE stream chunk by chunk as it is read. Each is checked
once before the load (a whole JSON answer with its usage; a stream of every token, ending in ``[DONE]``).

Measured per relay, as hotpath.py does: 64-token non-streaming requests/s over 32 keep-alive connections
(p50/p99); the latency it adds at concurrency 1 (non-streaming total; streaming first chunk with 1 ms between
chunks; each p50 against the backend called directly); streams/s with 1 ms between chunks over 128
connections (TTFT p50/p99). Also the relay's CPU per request or stream (/proc: utime + stime from the end of
each measure's 1 s warm-up, so a little of its tail too), and ``core``, rate × CPU: the share of its core the
relay used. Well below 100 %, the relay did not bound the rate, the load's core did (the load generator and
the mock share it), and the rate then says less about the relay than its CPU per request does.

The relays and, at concurrency 1, the direct calls take turns over ``--rounds``, the order alternating, so the
drift of a shared machine falls on all alike; ``--seconds`` is each measure's total over the rounds,
``--c1-stream-seconds`` the streaming one's at concurrency 1 (a stream lasts ~70 ms).

    .venv/bin/python bench/edge_compare.py [--seconds 10] [--rounds 3] [--only fairgate,uvicorn] [--json]
                                           [--c1-stream-seconds 8]

The relays import ``fairgate`` from this checkout (its root first on their PYTHONPATH). uvicorn is in the
optional group ``bench`` (``pip install -e '.[bench]'``); without it, its relays are skipped with a message.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from subprocess import Popen
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web
from hotpath import KINDS, PY, body, closed_loop, pinned, pooled
from netutil import free_port, wait_ready
from workers import cpu_s

if TYPE_CHECKING:
    from fairgate.http.client import Response as PoolResponse
    from fairgate.http.client import UpstreamPool

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATH = "/v1/chat/completions"
RELAYS = ("fairgate", "aiohttp", "uvicorn", "uvicorn+pool")
SSE = "text/event-stream"
JSON_HEADERS = {"Content-Type": "application/json"}

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]


# -- the relays: each runs as `edge_compare.py --serve NAME --port P --backend URL` ------------------------
async def serve_fairgate(port: int, backend: str) -> None:
    from fairgate.http.client import UpstreamPool
    from fairgate.http.messages import Request, Response, StreamResponse
    from fairgate.http.routing import Router
    from fairgate.http.server import Edge, Limits

    pool = UpstreamPool()

    async def chat(request: Request) -> Response | StreamResponse:
        up = await pool.post(backend, PATH, await request.read())
        try:
            if up.content_type != SSE:
                return Response(status=up.status, body=await up.read(),
                                content_type=up.content_type or "application/json")
            resp = StreamResponse(status=up.status, headers={"Content-Type": SSE})
            await resp.prepare(request)
            while chunk := await up.readany():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            up.close()  # the whole answer read: its connection back to the pool

    async def health(_request: Request) -> Response:
        return Response(body=b"ok", content_type="text/plain")

    router = Router()
    router.add("POST", PATH, chat)
    router.add("GET", "/health", health)
    edge = Edge(router, Limits(anonymous_rate=0))  # (the load sends no key: not paced, as the others are not)
    await edge.start("127.0.0.1", port)
    await asyncio.Event().wait()


async def serve_aiohttp(port: int, backend: str) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # no cap: 128 streams at once

    async def chat(request: web.Request) -> web.StreamResponse:
        async with session.post(backend + PATH, data=await request.read(), headers=JSON_HEADERS) as up:
            if up.content_type != SSE:
                return web.Response(status=up.status, body=await up.read(), content_type=up.content_type)
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": SSE})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post(PATH, chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    await asyncio.Event().wait()


def asgi_relay(backend: str, upstream: aiohttp.ClientSession | UpstreamPool) -> ASGIApp:
    """A raw ASGI relay through aiohttp's client (``uvicorn``) or fairgate's (``uvicorn+pool``)."""

    async def answer(send: Send, status: int, data: bytes, content_type: str) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type.encode()), (b"content-length", b"%d" % len(data))]})
        await send({"type": "http.response.body", "body": data})

    async def relay(send: Send, status: int, content_type: str, chunks: AsyncIterator[bytes]) -> None:
        if content_type != SSE:
            return await answer(send, status, b"".join([chunk async for chunk in chunks]), content_type)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", SSE.encode())]})  # no length: uvicorn sends it chunked
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def pool_chunks(up: PoolResponse) -> AsyncIterator[bytes]:
        while chunk := await up.readany():
            yield chunk

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            return await answer(send, 200, b"ok", "text/plain")
        if (scope["method"], scope["path"]) != ("POST", PATH):
            return await answer(send, 404, b"not found", "text/plain")
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if isinstance(upstream, aiohttp.ClientSession):
            async with upstream.post(backend + PATH, data=b"".join(parts), headers=JSON_HEADERS) as up:
                return await relay(send, up.status, up.content_type, up.content.iter_any())
        fg = await upstream.post(backend, PATH, b"".join(parts))
        try:
            await relay(send, fg.status, fg.content_type, pool_chunks(fg))
        finally:
            fg.close()

    return app


async def serve_uvicorn(port: int, backend: str, client: str = "aiohttp") -> None:
    import uvicorn

    upstream: aiohttp.ClientSession | UpstreamPool
    if client == "aiohttp":
        upstream = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    else:
        from fairgate.http.client import UpstreamPool

        upstream = UpstreamPool()
    config = uvicorn.Config(asgi_relay(backend, upstream), host="127.0.0.1", port=port, http="httptools",
                            lifespan="off", log_level="warning", access_log=False, backlog=1024)
    await uvicorn.Server(config).serve()


def serve(name: str, port: int, backend: str) -> None:
    import uvloop

    if name.startswith("uvicorn"):
        uvloop.run(serve_uvicorn(port, backend, "pool" if name == "uvicorn+pool" else "aiohttp"))
    else:
        uvloop.run({"fairgate": serve_fairgate, "aiohttp": serve_aiohttp}[name](port, backend))


# -- the load ------------------------------------------------------------------------------------------------
Target = tuple[str, int | None]  # a relay's URL and its pid (none: the backend called directly)
Stats = dict[str, Any]  # a measure's run (closed_loop's), or the rounds' summary


async def spawn(name: str, backend: str, args: argparse.Namespace, procs: list[Popen[bytes]]) -> Target:
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = pinned(args.proxy_core, [PY, __file__, "--serve", name, "--port", str(port), "--backend", backend],
                  env={**os.environ, "PYTHONPATH": path}, stderr=None)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url + "/health", timeout=30)
    return url, proc.pid


async def check(name: str, url: str, slow_url: str, tokens: int) -> None:
    """A relay that drops or mangles answers must not pass for a fast one."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + PATH, json=body(False, tokens)) as r:
            whole = orjson.loads(await r.read())
        async with s.post(slow_url + PATH, json=body(True, tokens)) as r:
            stream = (await r.read()).split(b"\n\n")
    events = [e for e in stream if e.startswith(b"data: {")]
    if whole.get("usage", {}).get("completion_tokens") != tokens or len(events) != tokens \
            or stream[-2:] != [b"data: [DONE]", b""]:
        raise SystemExit(f"{name}: the relayed answers are not the backend's ({len(events)} events)")


async def measure(kind: str, target: Target, args: argparse.Namespace) -> Stats:
    stream, conns = {"json": (False, args.conns), "json_c1": (False, 1), "stream_c1": (True, 1),
                     "stream": (True, args.stream_conns)}[kind]
    seconds = args.seconds / args.rounds / (2 if kind.endswith("_c1") else 1)
    if kind == "stream_c1":
        seconds = max(seconds, args.c1_stream_seconds / args.rounds)
    url, pid = target
    start: list[float] = []

    async def after_warm_up() -> None:
        await asyncio.sleep(1.0)  # closed_loop's warm-up
        start.append(cpu_s(pid) if pid else 0.0)

    marker = asyncio.create_task(after_warm_up())
    run = await closed_loop(url + PATH, {}, body(stream, args.tokens), conns, seconds)
    await marker
    run["cpu_s"] = cpu_s(pid) - start[0] if pid else 0.0
    return run


def summary(runs: list[Stats]) -> Stats:
    out = pooled(runs)
    out["cpu_us"] = round(sum(r["cpu_s"] for r in runs) / max(1, out["requests"]) * 1e6, 1)
    return out


def busy(m: Stats) -> float:
    """The share of its core a relay used: near 100 %, the relay bounds the rate; well below, the load did."""
    return float(m["per_s"] * m["cpu_us"] / 1e4)


def table(results: dict[str, dict[str, Stats]], names: list[str], args: argparse.Namespace) -> None:
    d = results["direct"]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} cores, load average {load} (1, 5, 15 min) at the end")
    print(f"backend called directly, concurrency 1, p50: {d['json_c1']['p50_ms']:.2f} ms non-streaming, "
          f"{d['stream_c1']['ttft_p50_ms']:.2f} ms to the first chunk of a stream")
    ref = "fairgate" if "fairgate" in names else names[0]
    j0, s0 = results[ref]["json"]["per_s"], results[ref]["stream"]["per_s"]
    print(f"{'':13s}|{'non-streaming, ' + str(args.conns) + ' connections':^49s}|{'added at c=1, p50':^19s}|"
          f"{'streaming, ' + str(args.stream_conns) + ' connections':^51s}|")
    x = "×" + ref[:5]
    print(f"{'relay':13s}| {'req/s':>8s} {x:>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'µs/req':>7s} {'core':>5s} |"
          f" {'json ms':>7s} {'1st ms':>8s} | {'streams/s':>9s} {x:>7s} {'TTFT p50':>8s} {'p99 ms':>7s} "
          f"{'µs/str':>7s} {'core':>5s} | errors")
    for name in names:
        r = results[name]
        j, s = r["json"], r["stream"]
        print(f"{name:13s}| {j['per_s']:8.1f} {j['per_s'] / j0:6.2f}× {j['p50_ms']:7.2f} {j['p99_ms']:7.2f} "
              f"{j['cpu_us']:7.1f} {busy(j):4.0f}% | {r['json_c1']['p50_ms'] - d['json_c1']['p50_ms']:+7.2f} "
              f"{r['stream_c1']['ttft_p50_ms'] - d['stream_c1']['ttft_p50_ms']:+8.2f} | {s['per_s']:9.1f} "
              f"{s['per_s'] / s0:6.2f}× {s['ttft_p50_ms']:8.2f} {s['ttft_p99_ms']:7.2f} {s['cpu_us']:7.1f} "
              f"{busy(s):4.0f}% | {sum(k['errors'] for k in r.values())}")
    for kind in ("json", "stream"):
        print(f"per round, {kind} /s: " + "; ".join(f"{n} {results[n][kind]['rounds_per_s']}" for n in names))


async def main(args: argparse.Namespace) -> None:
    names = [n for n in (args.only or ",".join(RELAYS)).split(",") if n]
    if unknown := set(names) - set(RELAYS):
        raise SystemExit(f"unknown relay(s) {sorted(unknown)}: choose among {', '.join(RELAYS)}")
    if importlib.util.find_spec("uvicorn") is None and any(n.startswith("uvicorn") for n in names):
        print("uvicorn is not installed (pip install -e '.[bench]'): its relays are skipped", file=sys.stderr)
        names = [n for n in names if not n.startswith("uvicorn")]
    if not names:
        raise SystemExit("no relay to measure")
    os.sched_setaffinity(0, {args.load_core})
    fast_port, slow_port = free_port(), free_port()
    procs = [pinned(args.load_core, [PY, str(HERE / "mock_backend.py"), "--port", str(fast_port)]),
             pinned(args.load_core, [PY, str(HERE / "mock_backend.py"), "--port", str(slow_port),
                                     "--chunk-delay-ms", str(args.chunk_delay_ms)])]
    fast, slow = f"http://127.0.0.1:{fast_port}", f"http://127.0.0.1:{slow_port}"
    # the fast backend for the non-streaming measures, the paced one (1 ms a chunk) for the streaming ones
    targets: dict[str, dict[str, Target]] = {"direct": {"fast": (fast, None), "slow": (slow, None)}}
    runs: dict[str, dict[str, list[Stats]]] = {n: {k: [] for k in KINDS} for n in ("direct", *names)}
    try:
        await wait_ready(fast + "/health")
        await wait_ready(slow + "/health")
        for name in names:
            targets[name] = {"fast": await spawn(name, fast, args, procs),
                             "slow": await spawn(name, slow, args, procs)}
            await check(name, targets[name]["fast"][0], targets[name]["slow"][0], args.tokens)
        for k in range(args.rounds):
            for kind in KINDS:
                order = (["direct"] if kind.endswith("_c1") else []) + names
                for name in order if k % 2 == 0 else order[::-1]:
                    target = targets[name]["slow" if kind.startswith("stream") else "fast"]
                    runs[name][kind].append(await measure(kind, target, args))
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    results = {n: {k: summary(r) for k, r in kinds.items() if r} for n, kinds in runs.items()}
    table(results, names, args)
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "args": vars(args),
                          "fairgate": str(ROOT / "fairgate"), "results": results}))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="each measure's time over all rounds")
    ap.add_argument("--rounds", type=int, default=3, help="turns each relay takes, the order alternating")
    ap.add_argument("--c1-stream-seconds", type=float, default=8.0,
                    help="the streaming measure at concurrency 1: its time per relay over the rounds")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--stream-conns", type=int, default=128)
    ap.add_argument("--chunk-delay-ms", type=float, default=1.0)
    ap.add_argument("--proxy-core", type=int, default=0)
    ap.add_argument("--load-core", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated: " + ",".join(RELAYS))
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    ap.add_argument("--serve", choices=RELAYS, help=argparse.SUPPRESS)  # a relay's own process
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    return ap.parse_args()


if __name__ == "__main__":
    args = parse()
    if args.serve:
        serve(args.serve, args.port, args.backend.rstrip("/"))
    else:
        asyncio.run(main(args))
