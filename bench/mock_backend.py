"""A mock OpenAI backend for the hot-path bench: answers every chat completion with N tokens at once or as a
stream (one chunk per token, ``--chunk-delay-ms`` apart), with vLLM's usage (``stream_options``: the final usage
chunk and running usage on every chunk), so each proxy under test sees the same cheap, exact backend.

    python bench/mock_backend.py --port 18001 [--tokens 64] [--chunk-delay-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

MODEL = "mock-llama"
PROMPT_TOKENS = 12


def make_app(tokens: int, chunk_delay_s: float) -> web.Application:
    head = {"object": "chat.completion.chunk", "model": MODEL}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = int(body.get("max_tokens") or tokens)
        created = int(time.time())
        rid = f"chatcmpl-{id(request):x}"
        if not body.get("stream"):
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}
            return web.Response(body=orjson.dumps({
                "id": rid, "object": "chat.completion", "created": created, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * n},
                             "finish_reason": "length"}], "usage": usage}), content_type="application/json")
        opts = body.get("stream_options") or {}
        running, final = opts.get("continuous_usage_stats"), opts.get("include_usage")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            ev = {"id": rid, **head, "created": created,
                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": "tok "} if i == 0
                               else {"content": "tok "}, "finish_reason": "length" if i == n - 1 else None}]}
            if running:
                ev["usage"] = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": i + 1,
                               "total_tokens": PROMPT_TOKENS + i + 1}
            await resp.write(b"data: " + orjson.dumps(ev) + b"\n\n")
            if chunk_delay_s:
                await asyncio.sleep(chunk_delay_s)
        if final:
            await resp.write(b"data: " + orjson.dumps({"id": rid, **head, "created": created, "choices": [], "usage": {
                "prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench", "max_model_len": 8192}]})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chunk-delay-ms", type=float, default=0.0)
    args = ap.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(make_app(args.tokens, args.chunk_delay_ms / 1000), host="127.0.0.1", port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
