"""What reaches the backend of a client's body: the fields an app may forward, and the cache salt the gateway
sets. Every field is on one of three lists:

- forwarded: the OpenAI request fields (the spec fairgate serves) and vLLM's sampling and structured-output
  extras, none of which reaches outside the request;
- guarded (refused with a 400 unless an admin allows them for the app, `fairgate admin app allow`): fields that
  change how the server renders or schedules the prompt, move KV between servers, load code, or make the
  server fetch remote media (``remote_media``, for image/audio/video/file URLs that are not ``data:`` URLs);
- anything else: refused with a 400, as OpenAI refuses an unrecognised argument.

``cache_salt`` is always the gateway's (a client's own is dropped): vLLM reuses a cached prefix only for requests
with the same salt, so one tenant cannot probe whether another's prompt is cached (cf. CVE-2025-46570)."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

from fairgate.printable import printable
from fairgate.proxy.errors import APIError
from fairgate.storage.models import GUARDED_FIELDS

OPENAI_FIELDS = frozenset((
    "model", "messages", "prompt", "suffix", "echo", "best_of", "max_tokens", "max_completion_tokens", "n",
    "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "stream", "stream_options", "user", "safety_identifier", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "response_format", "reasoning_effort", "verbosity",
    "metadata", "store", "service_tier", "modalities", "audio", "prediction", "web_search_options",
    "moderation", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"))
VLLM_SAMPLING_FIELDS = frozenset((
    "top_k", "min_p", "repetition_penalty", "length_penalty", "use_beam_search", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern", "return_tokens_as_token_ids",
    "return_token_ids", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents"))
# embeddings: OpenAI's fields and vLLM's pooling extras that shape only this request's own answer
EMBEDDING_FIELDS = frozenset(("model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
                              "add_special_tokens", "embed_dtype", "endianness"))
# the Responses API: OpenAI's fields (``previous_response_id`` and ``store`` are the gateway's to act on: the
# backend gets the expanded input and store false) and vLLM's sampling extras for it
RESPONSE_FIELDS = frozenset((
    "model", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "parallel_tool_calls",
    "previous_response_id", "reasoning", "store", "stream", "stream_options", "temperature", "text", "tool_choice",
    "tools", "top_logprobs", "top_p", "truncation", "user", "safety_identifier", "include", "prompt_cache_key",
    "service_tier", "logit_bias", "top_k", "min_p", "presence_penalty", "frequency_penalty", "skip_special_tokens",
    "include_stop_str_in_output"))
# vLLM's rerank and score (pooling models): the texts, and what shapes only this request's answer
PAIR_FIELDS = frozenset(("model", "user", "truncate_prompt_tokens", "max_tokens_per_query", "max_tokens_per_doc",
                         "instruction", "use_activation"))
# Anthropic's Messages API, as vLLM serves it
ANTHROPIC_FIELDS = frozenset(("model", "messages", "max_tokens", "metadata", "stop_sequences", "stream", "system",
                              "temperature", "tool_choice", "tools", "top_k", "top_p", "thinking"))
FORWARDED = {"messages": ANTHROPIC_FIELDS, "chat": OPENAI_FIELDS | VLLM_SAMPLING_FIELDS, "completions": OPENAI_FIELDS | VLLM_SAMPLING_FIELDS,
             "embeddings": EMBEDDING_FIELDS, "responses": RESPONSE_FIELDS,
             "rerank": PAIR_FIELDS | {"query", "documents", "top_n"},
             "score": PAIR_FIELDS | {"text_1", "text_2", "queries", "documents"}}
SALT_MODES = ("app", "user", "shared")
MEDIA_PARTS = ("image_url", "video_url", "audio_url", "file", "file_url")


@functools.lru_cache(maxsize=65_536)  # one hash per tenant, not per request
def cache_salt(mode: str, app: str, user_key: str | None) -> str | None:
    """The salt for a request: one per app (default), per user within its app, or none (``shared``: every
    tenant's prefixes are reused by every other). Not a secret: the client can never choose it."""
    if mode == "shared":
        return None
    scope = f"app:{app}" if mode == "app" or user_key is None else f"user:{user_key}"
    return "fg-" + hashlib.sha256(scope.encode()).hexdigest()[:32]


def _refuse(field: str, why: str) -> APIError:
    shown = printable(field[:80])  # (a client's name for a field: bounded, and never a terminal's escape)
    return APIError(400, f"'{shown}' {why}", param=shown, code="unsupported_parameter")


def _remote_media(messages: Any) -> bool:
    """A chat message's or a Responses item's content part names a URL the server would fetch (any but
    ``data:``): a chat part's ``image_url`` (…) object or string, a Responses part's ``image_url`` or
    ``file_url``, a function call output's parts too."""
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        for content in (m.get("content"), m.get("output")):
            for part in content if isinstance(content, list) else ():
                if not isinstance(part, dict):
                    continue
                source = part.get("source")  # (an Anthropic image or document block)
                if isinstance(source, dict) and source.get("type") == "url":
                    return True
                for kind in MEDIA_PARTS:
                    ref = part.get(kind)
                    url = ref.get("url") or ref.get("file_url") if isinstance(ref, dict) else ref
                    if isinstance(url, str) and not url.startswith("data:"):
                        return True
    return False


def refuse_remote_media(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """A 400 for a body whose messages or input name remote media, unless the app may send it."""
    if "remote_media" not in allowed and (_remote_media(body.get("messages")) or _remote_media(body.get("input"))):
        raise _refuse("messages" if body.get("messages") is not None else "input",
                      "holds a remote media URL, which this app may not send (send a data: URL, or an admin can "
                      "allow it: `fairgate admin app allow APP remote_media`)")


def backend_body(body: dict[str, Any], allowed: frozenset[str], salt: str | None,
                 endpoint: str = "chat") -> dict[str, Any]:
    """The body sent upstream; a field the app may not send is a 400 naming it. ``allowed``: the app's guarded
    fields an admin allowed."""
    out: dict[str, Any] = {}
    forwarded = FORWARDED[endpoint]
    for field, value in body.items():
        if field == "cache_salt":
            continue
        if field in forwarded or field in allowed:
            out[field] = value
        elif field in GUARDED_FIELDS:
            raise _refuse(field, "is not allowed for this app (an admin can allow it: "
                                 f"`fairgate admin app allow APP {field}`)")
        else:
            raise _refuse(field, "is not a parameter fairgate forwards" + (
                "" if endpoint == "chat" else f" to /v1/{endpoint}"))
    refuse_remote_media(body, allowed)
    if salt is not None:
        out["cache_salt"] = salt
    return out
