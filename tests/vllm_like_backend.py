"""A backend that counts and streams usage the way vLLM does, for the hostile-tenant tests
(tests/test_hostile_meter.py): it generates one token per choice per step, ``max_tokens`` of them (1,000 without
it; its EOS comes only after ``k`` tokens when the request's text says ``eos:k``), and

- streams each choice's chunks with *that choice's* running usage — its own output so far and its own prompt's
  tokens — and the sums only in the final usage chunk (``"choices": []``), as vLLM's ``continuous_usage_stats``
  does for ``n`` > 1 and for a completions batch of several prompts (choice ``p × n + i`` is prompt ``p``'s);
- counts a chat prompt as a chat template renders it: each message's role, its text, its tool calls as JSON;
  the request's ``tools`` as JSON indented by four spaces (Llama 3.1's template: ``tojson(indent=4)``); its
  ``documents``; and each image at ``IMAGE_TOKENS`` (a vision model's placeholder tokens) — with cl100k as its
  tokenizer.

``GET /v1/models`` lists ``fake`` with a 32,768-token context.
"""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import orjson
from aiohttp import web

from fairgate.accounting.tokenizer import get_encoding
from tests.fault_backend import serving

MODEL = "fake"
CONTEXT = 32_768
IMAGE_TOKENS = 1_200
FRAMING = 4  # a message's start, role separator and end tokens


def count(text: str) -> int:
    return len(get_encoding().encode(text, disallowed_special=()))


def chat_prompt_tokens(body: dict[str, Any]) -> int:
    total = 3
    for m in body.get("messages") or []:
        total += FRAMING + count(str(m.get("role", "")))
        content = m.get("content")
        if isinstance(content, str):
            total += count(content)
        for part in content if isinstance(content, list) else ():
            if part.get("type") == "text":
                total += count(str(part.get("text", "")))
            elif part.get("type") in ("image_url", "input_image"):
                total += IMAGE_TOKENS
        for call in m.get("tool_calls") or ():
            total += count(json.dumps(call.get("function", call)))
    if body.get("tools"):
        total += count("Available functions:\n" + "\n".join(json.dumps(t, indent=4) for t in body["tools"]))
    for doc in body.get("documents") or ():
        total += count(json.dumps(doc))
    return total


class VLLMLike:
    def __init__(self, step_s: float = 0.002):
        self.step_s = step_s
        self.requests: list[dict[str, Any]] = []  # each request's body and its prompt tokens per prompt

    def _prompts(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        if endpoint == "chat":
            return [chat_prompt_tokens(body)]
        prompt = body["prompt"]
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        return [len(p) if isinstance(p, list) else count(p) for p in prompts]

    async def complete(self, request: web.Request) -> web.StreamResponse:
        endpoint = "chat" if request.path.endswith("/chat/completions") else "completions"
        body = await request.json()
        prompts = self._prompts(endpoint, body)
        n, steps = int(body.get("n") or 1), int(body.get("max_tokens") or body.get("max_completion_tokens") or 1000)
        eos = re.search(rb"eos:(\d+)", orjson.dumps(body.get("messages") or body.get("prompt")))
        stop = eos is not None and int(eos.group(1)) < steps  # (a natural end, before max_tokens)
        steps = int(eos.group(1)) if stop else steps
        finish = "stop" if stop else "length"
        record = {"endpoint": endpoint, "prompts": prompts, "n": n, "max_tokens": steps, "sent": 0}
        self.requests.append(record)
        kind = "chat.completion" if endpoint == "chat" else "text_completion"
        sums = {"prompt_tokens": sum(prompts), "completion_tokens": len(prompts) * n * steps,
                "total_tokens": sum(prompts) + len(prompts) * n * steps}
        if not body.get("stream"):
            choices = [{"index": k, "finish_reason": finish,
                        **({"message": {"role": "assistant", "content": "tok " * steps}} if endpoint == "chat"
                           else {"text": "tok " * steps})} for k in range(len(prompts) * n)]
            return web.json_response({"id": "x", "object": kind, "created": 0, "model": MODEL,
                                      "choices": choices, "usage": sums})
        opts = body.get("stream_options") or {}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for step in range(steps):
                out = []
                for k in range(len(prompts) * n):
                    delta = {"delta": {"content": "tok "}} if endpoint == "chat" else {"text": "tok "}
                    ev = {"id": "x", "object": kind + (".chunk" if endpoint == "chat" else ""), "created": 0,
                          "model": MODEL, "choices": [{"index": k, **delta,
                                                       "finish_reason": finish if step == steps - 1 else None}]}
                    if opts.get("continuous_usage_stats"):
                        p = prompts[k // n]
                        ev["usage"] = {"prompt_tokens": p, "completion_tokens": step + 1,
                                       "total_tokens": p + step + 1}
                    out.append(b"data: " + orjson.dumps(ev) + b"\n\n")
                await resp.write(b"".join(out))
                record["sent"] = (step + 1) * len(out)  # (output tokens written so far, over all choices)
                await asyncio.sleep(self.step_s)
            if opts.get("include_usage"):
                final = {"id": "x", "object": kind, "created": 0, "model": MODEL, "choices": [], "usage": sums}
                await resp.write(b"data: " + orjson.dumps(final) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                              "max_model_len": CONTEXT}]})


@asynccontextmanager
async def vllm_like(step_s: float = 0.002) -> AsyncIterator[tuple[VLLMLike, str]]:
    backend = VLLMLike(step_s)
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/v1/models", backend.models)
    app.router.add_get("/health", backend.health)
    app.router.add_post("/v1/chat/completions", backend.complete)
    app.router.add_post("/v1/completions", backend.complete)
    async with serving(app, access_log=None) as url:
        yield backend, url
