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

    A request of several choices (``n`` > 1, or a completions batch of several prompts) streams each chunk's
    running usage for that chunk's choice alone — its output so far, its own prompt — and the sums only in the
    final usage chunk (``"choices": []``). So each choice's count and each prompt's are kept, and the request
    is billed their sums wherever the stream stops (a prompt not yet reported at the gateway's count of it);
    the final usage, when it comes, is checked against them and the larger kept (``disagreed`` says it was
    below them).
    """

    estimated_prompt: int
    system_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, where the backend says (``reasoned``)
    usage_seen: bool = False
    content_chunks: int = 0
    # what the request allows: a backend's report outside [0, cap] is clamped (``clamped`` says it was), so a
    # backend can neither lower a tenant's counter nor bill past the context and n × max_tokens
    prompt_cap: int = 1 << 31
    completion_cap: int = 1 << 31
    clamped: bool = False
    disagreed: bool = False
    choices: int = 1  # prompts × n (``allow``), and n: choice i is of prompt i // n
    per_prompt: int = 1
    _outputs: dict[int, int] | None = None  # choice → its running output; prompt → its prompt tokens, and its
    _inputs: dict[int, tuple[int, int]] | None = None  # cached ones (several choices only)
    _output_sum: int = 0
    _input_sum: int = 0
    _cached_sum: int = 0

    def __post_init__(self) -> None:
        self.prompt_tokens = self.estimated_prompt

    def allow(self, prompts: int, n: int, max_tokens: int | None, context: int | None,
              unbounded: int = 1 << 20) -> int:
        """Set what the request allows the backend to report: per prompt (a completions batch has several) the
        context (else 4× the gateway's own count, at least +4,096), and n × max_tokens of output (else the
        context, else ``unbounded``; 0 for a request that generates nothing: embeddings). Returns the events a
        stream may hold: the output's, plus each choice's role and finish, the usage chunk and [DONE]."""
        est = self.estimated_prompt
        self.prompt_cap = prompts * context if context is not None else max(4 * est, est + 4096)
        self.completion_cap = prompts * n * (max_tokens if max_tokens is not None else context or unbounded)
        self.choices, self.per_prompt = prompts * n, n
        if self.choices > 1:
            self._outputs, self._inputs = {}, {}
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
        # (a count the backend leaves out keeps the one the gateway had: its estimate, or the tokens seen)
        self.prompt_tokens = self.prompt_tokens if prompt is None else self._bound(prompt, self.prompt_cap)
        self.completion_tokens = (self.completion_tokens if completion is None
                                  else self._bound(completion, self.completion_cap))
        self.cached_tokens = self._bound(cached, self.prompt_tokens)

    @staticmethod
    def _counts(usage: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(prompt, completion, cached) of a chat or completions usage, or of a response's (``input_tokens``)."""
        if "input_tokens" in usage:  # (a response's, or Anthropic's: its cached prompt as cache_read_input_tokens)
            details = usage.get("input_tokens_details")
            return (usage.get("input_tokens"), usage.get("output_tokens"),
                    details.get("cached_tokens") if isinstance(details, dict) else usage.get("cache_read_input_tokens"))
        details = usage.get("prompt_tokens_details")
        return (usage.get("prompt_tokens"), usage.get("completion_tokens"),
                details.get("cached_tokens") if isinstance(details, dict) else 0)

    def answered(self, answer: dict[str, Any]) -> None:
        """A whole (non-streamed) answer, or a response's terminal event's response: its usage holds the sums."""
        usage = answer.get("usage")
        if usage and isinstance(usage, dict):
            self.report(*self._counts(usage))
            self.reasoned(usage)
        elif usage:
            self.clamped = True

    def reasoned(self, usage: dict[str, Any]) -> None:
        """The reasoning tokens a usage reports (``completion_tokens_details`` or ``output_tokens_details``),
        bounded by the output."""
        details = usage.get("output_tokens_details") or usage.get("completion_tokens_details")
        if isinstance(details, dict) and (n := details.get("reasoning_tokens")) is not None:
            self.reasoning_tokens = self._bound(n, self.completion_tokens)

    def observe(self, chunk: dict[str, Any]) -> None:
        """A stream's chunk."""
        usage = chunk.get("usage")
        if usage:
            if isinstance(usage, dict):
                counts = self._counts(usage)
                choices = chunk.get("choices")
                if self._outputs is None:
                    self.report(*counts)
                elif isinstance(choices, list) and choices:
                    self._running(choices[0], *counts)
                else:
                    self._final(*counts)
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

    def _running(self, choice: Any, prompt: Any, completion: Any, cached: Any) -> None:
        """One choice's running usage (a request of several choices): its output so far, its prompt's count."""
        index = choice.get("index") if isinstance(choice, dict) else None
        if type(index) is not int or not 0 <= index < self.choices:
            self.clamped = True  # (not a choice of this request: its count is not taken)
            return
        self.usage_seen = True
        outputs, inputs = self._outputs, self._inputs
        out = self._bound(completion, self.completion_cap)
        if out > (was := outputs.get(index, 0)):  # (a count only grows: a backend cannot take output back)
            outputs[index] = out
            self._output_sum += out - was
        tokens = self._bound(prompt, self.prompt_cap)
        entry = (tokens, self._bound(cached, tokens))
        p = index // self.per_prompt
        was_p = inputs.get(p)
        if was_p is None or entry[0] > was_p[0]:
            inputs[p] = entry
            self._input_sum += entry[0] - (was_p[0] if was_p else 0)
            self._cached_sum += entry[1] - (was_p[1] if was_p else 0)
        self._sums()

    def _sums(self) -> None:
        prompts = self.choices // self.per_prompt
        unseen = prompts - len(self._inputs)  # (generated alongside: each at the gateway's count of it)
        self.prompt_tokens = min(self._input_sum + unseen * (self.estimated_prompt // prompts), self.prompt_cap)
        self.completion_tokens = min(self._output_sum, self.completion_cap)
        self.cached_tokens = min(self._cached_sum, self.prompt_tokens)

    def _final(self, prompt: Any, completion: Any, cached: Any) -> None:
        """The final usage of a request of several choices: the sums, checked against the choices' own; the
        larger of each is kept."""
        self.usage_seen = True
        self._sums()
        final_prompt = self._bound(prompt, self.prompt_cap)
        final_completion = self._bound(completion, self.completion_cap)
        if final_completion < self.completion_tokens or final_prompt < self._input_sum:
            self.disagreed = True
        if final_prompt:  # (the backend's sum covers the prompts no chunk reported)
            self.prompt_tokens = max(final_prompt, self._input_sum)
        self.completion_tokens = max(final_completion, self.completion_tokens)
        self.cached_tokens = max(self._bound(cached, self.prompt_tokens), self.cached_tokens)

    def usage(self) -> dict[str, Any]:
        """An OpenAI ``usage`` object for these counts."""
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens": self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
