"""A backend that misbehaves on purpose, for the fault tests: the model a request names picks the fault.

- ``huge``: each event carries a 600 KiB content string (legitimate: large tool calls or logprobs are big);
- ``stall``: 3 events, then nothing (the connection stays open); ``stall-bare``: the same without running usage
  (a backend that reports none);
- ``trickle``: an event every 0.2 s, forever;
- ``flood``: 64 KiB events as fast as the client takes them, 2,000 of them;
- ``fail-first``: HTTP 500 before any event (counts toward outlier detection; ``fail_first=N``: the first N
  requests of any model);
- anything else: 3 events and [DONE].
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import orjson
from aiohttp import web

MODELS = ("huge", "stall", "stall-bare", "trickle", "flood", "fail-first", "ok")


def _chunk(i: int, text: str, model: str) -> bytes:
    ev = {"id": "cmpl-fault", "object": "chat.completion.chunk", "created": 0, "model": model,
          "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    if model != "stall-bare":
        ev["usage"] = {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": i + 6}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


class FaultBackend:
    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first  # answer this many requests (any model) with HTTP 500
        self.requests = 0
        self.disconnects = 0  # streams whose client (the gateway) went away before the end

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "max_model_len": 100_000} for m in MODELS]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        model = (await request.json())["model"]
        if model == "fail-first" or self.requests <= self.fail_first:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if model == "huge":
                for i in range(3):
                    await resp.write(_chunk(i, "x" * 600_000, model))
            elif model in ("stall", "stall-bare"):
                for i in range(3):
                    await resp.write(_chunk(i, "tok ", model))
                await asyncio.sleep(3600)
            elif model == "trickle":
                for i in range(100_000):
                    await resp.write(_chunk(i, "tok ", model))
                    await asyncio.sleep(0.2)
            elif model == "flood":
                for i in range(2_000):
                    await resp.write(_chunk(i, "y" * 65_536, model))
            else:
                for i in range(3):
                    await resp.write(_chunk(i, "tok ", model))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp


@asynccontextmanager
async def serving(app: web.Application, **runner_kw) -> AsyncIterator[str]:
    """``app`` served on a free local port: its URL, while the context lasts."""
    runner = web.AppRunner(app, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def fault_backend(fail_first: int = 0) -> AsyncIterator[tuple[FaultBackend, str]]:
    backend = FaultBackend(fail_first)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/v1/models", backend.models)
    app.router.add_post("/v1/chat/completions", backend.chat)
    async with serving(app, handler_cancellation=True) as url:
        yield backend, url
