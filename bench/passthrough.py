"""The bare pass-through the hot-path bench compares against: aiohttp in, aiohttp out, bytes relayed as they
come, nothing parsed, counted or logged: the floor for a Python gateway.

    python bench/passthrough.py --port 18002 --backend http://127.0.0.1:18001
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def make_app(backend: str) -> web.Application:
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        async with app["session"].request(request.method, backend + request.path_qs, data=await request.read(),
                                          headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get(
                "Content-Type", "application/json")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", required=True)
    args = ap.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(make_app(args.backend.rstrip("/")), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
