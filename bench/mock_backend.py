"""A mock OpenAI backend for the hot-path bench: answers every chat completion with N tokens at once or as a
stream (one chunk per token, ``--chunk-delay-ms`` apart), with vLLM's usage (``stream_options``: the final usage
chunk and running usage on every chunk), so each proxy under test sees the same cheap, exact backend. A
Responses request likewise (whole, or vLLM's events: one delta per token, the usage in ``response.completed``);
an embeddings request with one 64-float vector per input.

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

    async def responses(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = int(body.get("max_output_tokens") or tokens)
        created, rid = int(time.time()), f"resp_{id(request):x}"
        item = {"type": "message", "id": "msg_" + rid, "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "tok " * n, "annotations": []}]}
        done = {"id": rid, "object": "response", "created_at": created, "model": MODEL, "status": "completed",
                "output": [item], "error": None, "usage": {
                    "input_tokens": PROMPT_TOKENS, "output_tokens": n, "total_tokens": PROMPT_TOKENS + n,
                    "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}
        if not body.get("stream"):
            return web.Response(body=orjson.dumps(done), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = 0

        def event(kind: str, **fields) -> bytes:
            nonlocal seq
            seq += 1
            return (b"event: " + kind.encode() + b"\ndata: "
                    + orjson.dumps({"type": kind, "sequence_number": seq - 1, **fields}) + b"\n\n")

        started = {**done, "status": "in_progress", "output": [], "usage": None}
        await resp.write(event("response.created", response=started) + event("response.in_progress", response=started)
                         + event("response.output_item.added", output_index=0, item={**item, "content": []})
                         + event("response.content_part.added", item_id=item["id"], output_index=0,
                                 content_index=0, part={"type": "output_text", "text": ""}))
        for _ in range(n):
            await resp.write(event("response.output_text.delta", item_id=item["id"], output_index=0,
                                   content_index=0, delta="tok "))
            if chunk_delay_s:
                await asyncio.sleep(chunk_delay_s)
        await resp.write(event("response.output_text.done", item_id=item["id"], output_index=0, content_index=0,
                               text="tok " * n)
                         + event("response.output_item.done", output_index=0, item=item)
                         + event("response.completed", response=done))
        await resp.write_eof()
        return resp

    async def embeddings(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        inputs = body.get("input")
        count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else 1
        return web.Response(body=orjson.dumps({
            "object": "list", "model": MODEL, "usage": {"prompt_tokens": PROMPT_TOKENS * count,
                                                        "total_tokens": PROMPT_TOKENS * count},
            "data": [{"index": i, "object": "embedding", "embedding": [0.125] * 64} for i in range(count)]}),
            content_type="application/json")

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench", "max_model_len": 8192}]})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
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
