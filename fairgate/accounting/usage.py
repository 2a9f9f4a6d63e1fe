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
    # what the request allows: a backend's report outside [0, cap] is clamped (``clamped`` says it was), so a
    # backend can neither lower a tenant's counter nor bill past the context and n × max_tokens
    prompt_cap: int = 1 << 31
    completion_cap: int = 1 << 31
    clamped: bool = False

    def __post_init__(self) -> None:
        self.prompt_tokens = self.estimated_prompt

    def allow(self, prompts: int, n: int, max_tokens: int | None, context: int | None,
              unbounded: int = 1 << 20) -> int:
        """Set what the request allows the backend to report: per prompt (a completions batch has several) the
        context (else 4× the gateway's own count, at least +4,096), and n × max_tokens of output (else the
        context, else ``unbounded``). Returns the events a stream may hold: the output's, plus each choice's
        role and finish, the usage chunk and [DONE]."""
        est = self.estimated_prompt
        self.prompt_cap = prompts * context if context is not None else max(4 * est, est + 4096)
        self.completion_cap = prompts * n * (max_tokens or context or unbounded)
        return self.completion_cap + 2 * prompts * n + 2

    def _bound(self, value: Any, cap: int) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= cap:
            return value
        if value is None:
            return 0
        self.clamped = True
        return min(max(value, 0), cap) if isinstance(value, int) else 0

    def report(self, prompt: Any, completion: Any, cached: Any = 0) -> None:
        """The backend's usage (its running or final count), bounded. Every read of a stream brings one: the
        usual report (plain integers within bounds, nothing cached) is taken without the bound's calls."""
        self.usage_seen = True
        if (type(prompt) is int and 0 <= prompt <= self.prompt_cap
                and type(completion) is int and 0 <= completion <= self.completion_cap
                and (cached is None or type(cached) is int and cached == 0)):
            self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt, completion, 0
            return
        self.prompt_tokens = self._bound(prompt, self.prompt_cap)
        self.completion_tokens = self._bound(completion, self.completion_cap)
        self.cached_tokens = self._bound(cached, self.prompt_tokens)

    def observe(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if usage:
            if isinstance(usage, dict):
                details = usage.get("prompt_tokens_details")
                self.report(usage.get("prompt_tokens"), usage.get("completion_tokens"),
                            details.get("cached_tokens") if isinstance(details, dict) else 0)
            else:
                self.clamped = True
            return
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if delta is None:
                text = choice.get("text")
            else:
                text = (delta.get("content") or delta.get("tool_calls")) if isinstance(delta, dict) else None
            if text:
                self.content_chunks += 1
        if not self.usage_seen:
            self.completion_tokens = min(self.content_chunks, self.completion_cap)

    def usage(self) -> dict[str, Any]:
        """An OpenAI ``usage`` object for these counts."""
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens": self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
