"""Fold a stream of chunks into the one JSON response a non-streaming client expects (vLLM's shape)."""

from __future__ import annotations

from typing import Any

_PLAIN = {"role", "content"}  # a delta that only carries text


class Aggregator:
    def __init__(self, endpoint: str):
        self.chat = endpoint == "chat"
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
            if chunk.get("system_fingerprint"):
                self.head["system_fingerprint"] = chunk["system_fingerprint"]
        for c in chunk.get("choices") or ():
            idx = c.get("index", 0)
            acc = self.choices.setdefault(idx, self._new_choice(idx))
            if c.get("finish_reason") is not None:
                acc["finish_reason"] = c["finish_reason"]
            if "stop_reason" in c:
                acc["stop_reason"] = c["stop_reason"]
            if c.get("logprobs"):
                self._merge_logprobs(acc, c["logprobs"])
            if self.chat:
                self._merge_delta(acc["message"], c.get("delta") or {})
            else:
                acc["text"] += c.get("text") or ""

    def add_all(self, chunks: list[dict[str, Any]]) -> None:
        """A whole stream's chunks. The common shape (one choice, text deltas only) is folded with one join;
        anything else (n > 1, tool calls, logprobs, reasoning) goes chunk by chunk."""
        if not chunks:
            return
        if self.chat:
            choices = [c for ch in chunks for c in (ch.get("choices") or ())]
            if all(c.get("index", 0) == 0 and not c.get("logprobs") and c.get("delta", {}).keys() <= _PLAIN
                   for c in choices):
                self.add({k: v for k, v in chunks[0].items() if k != "choices"})
                acc = self.choices.setdefault(0, self._new_choice(0)) if choices else None
                if acc is not None:
                    acc["message"]["content"] = "".join([c["delta"].get("content") or "" for c in choices])
                    role = next((c["delta"]["role"] for c in choices if c["delta"].get("role")), None)
                    if role:
                        acc["message"]["role"] = role
                    for c in choices:
                        if c.get("finish_reason") is not None:
                            acc["finish_reason"] = c["finish_reason"]
                        if "stop_reason" in c:
                            acc["stop_reason"] = c["stop_reason"]
                return
        for ch in chunks:
            self.add(ch)

    def _new_choice(self, idx: int) -> dict[str, Any]:
        base = {"index": idx, "logprobs": None, "finish_reason": None, "stop_reason": None}
        if self.chat:
            return {**base, "message": {"role": "assistant", "content": "", "tool_calls": []}}
        return {**base, "text": "", "prompt_logprobs": None}

    @staticmethod
    def _merge_delta(msg: dict[str, Any], delta: dict[str, Any]) -> None:
        if delta.get("role"):
            msg["role"] = delta["role"]
        if delta.get("content"):
            msg["content"] += delta["content"]
        for key in ("reasoning_content", "reasoning"):
            if delta.get(key):
                msg[key] = msg.get(key, "") + delta[key]
        for tc in delta.get("tool_calls") or ():
            i = tc.get("index", len(msg["tool_calls"]))
            while len(msg["tool_calls"]) <= i:
                msg["tool_calls"].append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            slot = msg["tool_calls"][i]
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""

    @staticmethod
    def _merge_logprobs(acc: dict[str, Any], lp: dict[str, Any]) -> None:
        if acc["logprobs"] is None:
            acc["logprobs"] = {k: (list(v) if isinstance(v, list) else v) for k, v in lp.items()}
            return
        for k, v in lp.items():
            if isinstance(v, list) and isinstance(acc["logprobs"].get(k), list):
                acc["logprobs"][k].extend(v)

    def result(self, usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self.choices[i] for i in sorted(self.choices)]
        for c in choices:
            if self.chat and not c["message"]["tool_calls"]:
                c["message"]["tool_calls"] = []
        return {"id": self.head.get("id"), "object": "chat.completion" if self.chat else "text_completion",
                "created": self.head.get("created"), "model": self.head.get("model"), "choices": choices,
                "usage": usage, **({"system_fingerprint": self.head["system_fingerprint"]}
                                   if "system_fingerprint" in self.head else {})}
