"""The emulated vLLM's answers as vLLM shapes them: chat and completion chunks (``ChunkWriter``), the Responses
API's response object and events (``ResponseWriter``), and the vectors of embeddings and scores (``vector``).
One word per token (``WORDS``)."""

from __future__ import annotations

import base64
import math
import random
import struct
import time
from typing import Any

import orjson

from fairgate.engine.batching import EngineRequest

WORDS = [" " + w for w in (
    "the of and to in is that for it with as on be at by this fair token queue serve model user app time "
    "share cache batch each GPU load fast").split()]


def vector(ids: list[int], dims: int, fmt: str) -> list[float] | str:
    """A unit vector drawn from the token ids: the same input, the same embedding."""
    rng = random.Random(hash((tuple(ids), dims)))
    v = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    v = [x / norm for x in v]
    return base64.b64encode(struct.pack(f"<{dims}f", *v)).decode() if fmt == "base64" else v


class ChunkWriter:
    """Renders vLLM's response shapes for one request."""

    def __init__(self, req: EngineRequest, model: str, chat: bool, body: dict[str, Any]):
        self.req, self.model, self.chat = req, model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + req.id
        self.created = int(time.time())
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage"))
        self.continuous = self.include_usage and bool(opts.get("continuous_usage_stats"))
        self.seed = hash(req.id) % len(WORDS)

    def text(self, start: int, end: int) -> str:
        return "".join(WORDS[(self.seed + i) % len(WORDS)] for i in range(start, end))

    def usage(self, completion: int) -> dict[str, Any]:
        p = self.req.prompt_len
        return {"prompt_tokens": p, "total_tokens": p + completion, "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": self.req.cached_tokens}}

    def _finish(self, n: int) -> str | None:
        return ("length" if self.req.aborted is False and n >= self.req.output_len else None)

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def delta(self, sent: int, n: int) -> bytes:
        finish = self._finish(n)
        usage = self.usage(n) if self.continuous else None
        out = b""
        if self.chat:
            if sent == 0:
                out += self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}], self.usage(0) if self.continuous else None)
            choice = {"index": 0, "delta": {"content": self.text(sent, n)}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": self.text(sent, n), "logprobs": None, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = None
        return out + self._chunk([choice], usage)

    def final(self, sent: int) -> bytes:
        tail = self._chunk([], self.usage(sent)) if self.include_usage else b""
        return tail + b"data: [DONE]\n\n"

    def full(self, n: int) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text(0, n), "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text(0, n), "logprobs": None, "finish_reason": "length",
                      "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(n)}


class ResponseWriter:
    """Renders vLLM's Responses shapes for one request: the response object and its stream's events."""

    def __init__(self, req: EngineRequest, model: str, body: dict[str, Any]):
        self.req, self.model, self.body = req, model, body
        self.id, self.item_id = "resp_" + req.id, ("fc_" if self._calls() else "msg_") + req.id
        self.created, self.seq = int(time.time()), 0
        self.seed = hash(req.id) % len(WORDS)

    def _calls(self) -> str | None:
        """The function the request makes it call, if any."""
        tools = [t for t in self.body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
        choice = self.body.get("tool_choice")
        if isinstance(choice, dict) and isinstance(choice.get("name"), str):
            return choice["name"]
        return tools[0].get("name") if choice == "required" and tools else None

    def text(self, start: int, end: int) -> str:
        return "".join(WORDS[(self.seed + i) % len(WORDS)] for i in range(start, end))

    def _item(self, n: int, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if (name := self._calls()) is not None:
            return {"type": "function_call", "id": self.item_id, "call_id": "call_" + self.req.id, "name": name,
                    "arguments": '{"text":"' + self.text(0, n) + '"}' if done else "", "status": status}
        return {"type": "message", "id": self.item_id, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": self.text(0, n), "annotations": [], "logprobs": []}]
                if done else []}

    def response(self, n: int, final: bool = True) -> dict[str, Any]:
        cap = self.body.get("max_output_tokens")
        cut = final and isinstance(cap, int) and n >= cap and not self.body.get("ignore_eos")
        p = self.req.prompt_len
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": ("incomplete" if cut else "completed") if final else "in_progress",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
                "instructions": self.body.get("instructions"), "max_output_tokens": cap,
                "output": [self._item(n, True)] if final else [], "parallel_tool_calls": True,
                "previous_response_id": None, "reasoning": None, "store": False, "temperature": 1.0,
                "text": {"format": {"type": "text"}}, "tool_choice": self.body.get("tool_choice") or "auto",
                "tools": self.body.get("tools") or [], "top_p": 1.0, "truncation": "disabled", "metadata": {},
                "usage": {"input_tokens": p, "input_tokens_details": {"cached_tokens": self.req.cached_tokens},
                          "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": p + n} if final else None}

    def _event(self, kind: str, **fields: Any) -> bytes:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n"

    def opening(self) -> bytes:
        out = self._event("response.created", response=self.response(0, False))
        out += self._event("response.in_progress", response=self.response(0, False))
        out += self._event("response.output_item.added", output_index=0, item=self._item(0, False))
        if self._calls() is None:
            out += self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})
        return out

    def delta(self, sent: int, n: int) -> bytes:
        if self._calls() is not None:  # (the arguments' JSON, in pieces: the words are plain letters)
            return self._event("response.function_call_arguments.delta", item_id=self.item_id, output_index=0,
                               delta=('{"text":"' if sent == 0 else "") + self.text(sent, n))
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=self.text(sent, n), logprobs=[])

    def closing(self, n: int) -> bytes:
        item = self._item(n, True)
        if self._calls() is not None:
            out = self._event("response.function_call_arguments.delta", item_id=self.item_id, output_index=0,
                              delta='"}')
            out += self._event("response.function_call_arguments.done", item_id=self.item_id, output_index=0,
                               arguments=item["arguments"])
        else:
            out = self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                              text=self.text(0, n), logprobs=[])
            out += self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                               part=item["content"][0])
        out += self._event("response.output_item.done", output_index=0, item=item)
        final = self.response(n)
        return out + self._event(f"response.{final['status']}", response=final)
