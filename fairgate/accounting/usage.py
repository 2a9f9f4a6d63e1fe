"""What a request has used so far, from the stream it produced: reconciled with the backend's ``usage``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Tally:
    """Token counts of one request.

    The gateway's own prompt count (``estimated_prompt``) stands until the backend reports usage; every
    chunk upstream carries running usage (vLLM's ``continuous_usage_stats``), so ``completion_tokens`` is
    exact at any moment, including when the stream is cut short. A backend that sends no usage is counted
    one token per content-bearing chunk.
    """

    estimated_prompt: int
    system_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usage_seen: bool = False
    content_chunks: int = 0

    def __post_init__(self) -> None:
        self.prompt_tokens = self.estimated_prompt

    def observe(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if usage:
            self.usage_seen = True
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
            return
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text = choice.get("text") if delta is None else (delta.get("content") or delta.get("tool_calls"))
            if text:
                self.content_chunks += 1
        if not self.usage_seen:
            self.completion_tokens = self.content_chunks

    def usage(self) -> dict[str, Any]:
        """An OpenAI ``usage`` object for these counts."""
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens": self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
