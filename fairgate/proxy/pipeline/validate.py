"""Parse and validate OpenAI request bodies; every mistake becomes a 400 that names the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncio

import orjson

from fairgate.http.messages import Refused, Request
from fairgate.proxy.errors import APIError, bad_request, brief

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
MAX_N = 16  # choices per request: each holds a context's worth of KV
MAX_INPUTS = 2048  # texts or token arrays in one embeddings request (OpenAI's bound)
MAX_TOKEN_ID = 1 << 31  # a token id past any vocabulary
GENERATIVE = ("chat", "completions", "responses", "messages")  # the endpoints that generate; the pooling
# ones (embeddings, rerank, score) are prefill only


@dataclass(slots=True)
class ParsedRequest:
    endpoint: str  # "chat" | "completions" | "responses" | "messages" | "embeddings" | "rerank" | "score"
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None  # of output per choice (0 for an endpoint that generates nothing)
    user: str | None
    prompts: int = 1  # the prompts it holds: a completions or embeddings batch has several, each run on its own
    context_limit: int | None = None  # the pool's longest context for the model, asked once (proxy/app.py)
    conversation: Any = None  # a Responses request's place in its conversation (pipeline/responses.py)

    @property
    def generates(self) -> bool:
        return self.endpoint in GENERATIVE

    @property
    def prompt(self) -> Any:
        """What a completions or pooling request holds to count: its ``prompt``, ``input``, or the texts it
        pairs (each pair is run whole: a query is counted once per document it is scored against)."""
        b = self.body
        if self.endpoint == "completions":
            return b["prompt"]
        if self.endpoint == "embeddings":
            return b.get("input")
        first, second = (b["query"], b["documents"]) if self.endpoint == "rerank" else _score_sides(b)
        seconds = second if isinstance(second, list) else [second]
        firsts = first if isinstance(first, list) else [first]
        if len(firsts) == 1:  # (one text against each of the others, as a backend pairs them)
            firsts = firsts * len(seconds)
        return [text for pair in zip(firsts, seconds) for text in pair]


async def body_of(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """A request's body, within ``max_bytes`` (413) and ``timeout_s`` (408)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
    try:
        if request.complete:  # the whole body came with the headers: no wait, no timer to arm
            return request.body()
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:.0f} s",
                       code="request_timeout") from None
    except Refused as e:  # beyond max_bytes as it arrived, or its framing broken
        raise APIError(e.status, str(e), code=e.code) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(v: Any) -> bool:
    return _is_int(v) and v >= 1


def _string(v: Any) -> bool:
    return isinstance(v, str)


def _stop(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# the typed fields: (accepts the value, what it must be); null is accepted for each, as OpenAI does
FIELDS = {
    "max_tokens": (_positive, "an integer ≥ 1"),
    "max_completion_tokens": (_positive, "an integer ≥ 1"),
    "n": (lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer from 1 to {MAX_N}"),
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "user": (_string, "a string"),
    "safety_identifier": (_string, "a string"),
    # the ranges OpenAI's API reference gives (a backend would answer out-of-range values with its own 400)
    "temperature": (lambda v: _is_number(v) and 0 <= v <= 2, "a number from 0 to 2"),
    "top_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    **{name: (lambda v: _is_number(v) and -2 <= v <= 2, "a number from -2 to 2")
       for name in ("presence_penalty", "frequency_penalty")},
    "seed": (_is_int, "an integer"),
    "stop": (_stop, "a string or an array of strings"),
}


def _refuse(name: str, value: Any, expected: str):
    return bad_request(f"'{name}' must be {expected}, got {type(value).__name__}: {brief(value)}", param=name)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # (an object or array is unhashable: test the type first)
            raise bad_request(f"'{where}.role' must be one of {sorted(ROLES)}", param=f"{where}.role")
        content = m.get("content")
        if content is None and role in ("assistant", "function"):
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                             for p in content):
            continue
        raise bad_request(f"'{where}.content' must be a string or an array of content parts",
                          param=f"{where}.content")


def _token_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(_is_int(t) and 0 <= t < MAX_TOKEN_ID for t in p)


def _prompts(prompt: Any, name: str) -> int:
    """How many prompts ``prompt`` holds — a string or an array of token ids is one, an array of either is a
    batch —, or a 400 naming ``name``."""
    if isinstance(prompt, str) or _token_ids(prompt):
        return 1
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_token_ids(p) for p in prompt)):
        return len(prompt)  # (of one kind: strings, or arrays of token ids, as OpenAI and vLLM take them)
    raise bad_request(f"'{name}' must be a string, an array of strings, an array of token ids, or an array of "
                      f"arrays of token ids", param=name)


def _check_embeddings(body: dict[str, Any]) -> int:
    if "input" not in body:
        raise bad_request("'input' is required", param="input")
    inputs = _prompts(body["input"], "input")
    if inputs > MAX_INPUTS:
        raise bad_request(f"'input' holds {inputs} inputs; at most {MAX_INPUTS} are allowed", param="input")
    texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
    if any(t == "" for t in texts):
        raise bad_request("'input' cannot hold an empty string", param="input")
    if body.get("stream"):
        raise bad_request("'stream' is not supported for embeddings", param="stream")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and not _positive(dims):
        raise _refuse("dimensions", dims, "an integer ≥ 1")
    return inputs


MAX_DOCUMENTS = 1024  # texts a rerank or score request pairs


def _score_sides(body: dict[str, Any]) -> tuple[Any, Any]:
    return (body["text_1"], body["text_2"]) if "text_1" in body else (body.get("queries"), body.get("documents"))


def _texts(value: Any, name: str, one: bool = False) -> int:
    """A non-empty string (``one``), or that or a non-empty array of at most MAX_DOCUMENTS of them: how many."""
    if isinstance(value, str) and value:
        return 1
    if not one and isinstance(value, list) and 0 < len(value) <= MAX_DOCUMENTS and all(
            isinstance(t, str) and t for t in value):
        return len(value)
    what = "a non-empty string" if one else f"a non-empty string or an array of 1 to {MAX_DOCUMENTS} of them"
    raise bad_request(f"'{name}' must be {what}", param=name)


def _check_pairs(endpoint: str, body: dict[str, Any]) -> int:
    """A rerank (``query`` against ``documents``) or score request (``text_1`` and ``text_2``, or ``queries``
    and ``documents``): the pairs it runs, each a prompt."""
    if endpoint == "rerank":
        _texts(body.get("query"), "query", one=True)
        pairs = _texts(body.get("documents"), "documents")
        top_n = body.get("top_n")
        if top_n is not None and not (_is_int(top_n) and top_n >= 0):
            raise _refuse("top_n", top_n, "an integer ≥ 0")
        return pairs
    names = ("text_1", "text_2") if "text_1" in body else ("queries", "documents")
    if "text_1" in body and ("queries" in body or "documents" in body):  # (a backend may score either: refused,
        # never forwarded with one form checked and counted and the other not)
        raise bad_request("give 'text_1' and 'text_2', or 'queries' and 'documents', not both", param="queries")
    first, second = (_texts(body.get(n), n) for n in names)
    if first > 1 and first != second:
        raise bad_request(f"'{names[0]}' holds {first} texts and '{names[1]}' {second}: one, or as many",
                          param=names[0])
    return second


ANTHROPIC_ROLES = ("user", "assistant")


def _check_anthropic(body: dict[str, Any]) -> None:
    """Anthropic's Messages API (``/v1/messages``): ``max_tokens`` required, ``messages`` of user and assistant
    turns whose content is a string or an array of blocks, ``system`` a string or an array of text blocks."""
    if not _positive(body.get("max_tokens")):
        raise _refuse("max_tokens", body.get("max_tokens"), "an integer ≥ 1 (it is required)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ANTHROPIC_ROLES:
            raise bad_request(f"'{where}.role' must be 'user' or 'assistant'", param=f"{where}.role")
        content = m.get("content")
        if not (isinstance(content, str) or isinstance(content, list) and all(
                isinstance(b, dict) and isinstance(b.get("type"), str) for b in content)):
            raise bad_request(f"'{where}.content' must be a string or an array of content blocks",
                              param=f"{where}.content")
    system = body.get("system")
    if system is not None and not (isinstance(system, str) or isinstance(system, list) and all(
            isinstance(b, dict) and isinstance(b.get("text"), str) for b in system)):
        raise bad_request("'system' must be a string or an array of text blocks", param="system")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and set(meta) <= {"user_id"} and (
            meta.get("user_id") is None or isinstance(meta["user_id"], str))):
        raise bad_request("'metadata' may hold 'user_id', a string", param="metadata")
    for name, ok, what in (("stop_sequences", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                            "an array of strings"),
                           ("top_k", lambda v: _is_int(v) and v >= 0, "an integer ≥ 0"),
                           ("tools", lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
                            "an array of tools"),
                           ("tool_choice", lambda v: isinstance(v, dict), "an object"),
                           ("thinking", lambda v: isinstance(v, dict), "an object")):
        value = body.get(name)
        if value is not None and not ok(value):
            raise _refuse(name, value, what)


def _check_responses(body: dict[str, Any]) -> None:
    """The Responses API's own fields (its ``input`` items: pipeline/responses.py); what fairgate does not run
    (background responses, stored conversations and prompts) is a 400 naming it."""
    from fairgate.proxy.pipeline.responses import input_items

    if "input" not in body:
        raise bad_request("'input' is required", param="input")
    input_items(body["input"])
    for name, what in (("background", "background responses"), ("conversation", "the Conversations API"),
                       ("prompt", "stored prompt templates")):
        if body.get(name):
            raise bad_request(f"'{name}': fairgate does not serve {what}", param=name,
                              code="unsupported_parameter")
    prev = body.get("previous_response_id")
    if prev is not None and not (isinstance(prev, str) and 0 < len(prev) <= 64):
        raise _refuse("previous_response_id", prev, "a response id")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and len(meta) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items())):
        raise _refuse("metadata", meta, "an object of at most 16 strings (keys ≤ 64, values ≤ 512 characters)")
    for name, ok, what in (("max_output_tokens", _positive, "an integer ≥ 1"),
                           ("max_tool_calls", _positive, "an integer ≥ 1"),
                           ("store", lambda v: isinstance(v, bool), "a boolean"),
                           ("parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean"),
                           ("instructions", _string, "a string"),
                           ("truncation", lambda v: v in ("auto", "disabled"), "'auto' or 'disabled'"),
                           ("include", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                            "an array of strings"),
                           ("tools", lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
                            "an array of tools"),
                           ("tool_choice", lambda v: isinstance(v, (str, dict)), "a string or an object"),
                           ("text", lambda v: isinstance(v, dict), "an object"),
                           ("reasoning", lambda v: isinstance(v, dict), "an object")):
        value = body.get(name)
        if value is not None and not ok(value):
            raise _refuse(name, value, what)


def parse(raw: bytes, endpoint: str) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("'model' is required and must be a string", param="model")
    if not body["model"].isprintable():  # (it is shown in logs, rows and an operator's terminal)
        raise bad_request("'model' must be printable characters", param="model")
    prompts = 1
    if endpoint == "chat":
        if "messages" not in body:
            raise bad_request("'messages' is required", param="messages")
        _check_messages(body["messages"])
    elif endpoint == "completions":
        if "prompt" not in body:
            raise bad_request("'prompt' is required", param="prompt")
        prompts = _prompts(body["prompt"], "prompt")
    elif endpoint == "responses":
        _check_responses(body)
    elif endpoint == "messages":
        _check_anthropic(body)
    elif endpoint == "embeddings":
        prompts = _check_embeddings(body)
    else:
        prompts = _check_pairs(endpoint, body)
    if endpoint not in GENERATIVE and body.get("stream"):
        raise bad_request(f"'stream' is not supported for {endpoint}", param="stream")
    for name, value in body.items():  # only the fields sent (a request names a handful of them)
        check = FIELDS.get(name)
        if check is not None and value is not None and not check[0](value):
            raise _refuse(name, value, check[1])
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    if body.get("stream_options") is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if opts.get("include_usage") is not None and not isinstance(opts["include_usage"], bool):
        raise _refuse("include_usage", opts["include_usage"], "a boolean")
    max_tokens = body.get("max_completion_tokens") if endpoint == "chat" else None
    max_tokens = max_tokens if max_tokens is not None else body.get(
        "max_output_tokens" if endpoint == "responses" else "max_tokens")
    if max_tokens is not None and max_tokens >= 2**31:
        raise bad_request("'max_tokens' is out of range", param="max_tokens")
    if endpoint not in GENERATIVE:
        max_tokens = 0
    user = body.get("user") or body.get("safety_identifier")
    if endpoint == "messages":  # (Anthropic's end user: metadata.user_id)
        user = (body.get("metadata") or {}).get("user_id")
    return ParsedRequest(endpoint, body, body["model"], stream, bool(opts.get("include_usage")), max_tokens, user,
                         prompts)
