"""Talking to one backend: always streaming, always asking for usage; reading its SSE events."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any, AsyncIterator

import aiohttp
import msgspec
import orjson

from fairgate.http.client import Response

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings",
         "responses": "/v1/responses", "rerank": "/v1/rerank", "score": "/v1/score", "messages": "/v1/messages"}
ANSWERS = {"chat": "choices", "completions": "choices", "embeddings": "data", "responses": "output",
           "rerank": "results", "score": "data", "messages": "content"}  # the list a whole answer holds
DONE: dict[str, Any] = {}  # sentinel for "data: [DONE]"

UPSTREAM_ERRORS = (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError)


class Retryable(Exception):
    """The backend failed before sending anything to the client; another backend may be tried."""


class BackendRejected(Exception):
    """The backend refused the request as the client's mistake (a 4xx); pass it on."""

    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(status)
        self.status, self.body = status, body


def upstream_body(body: dict[str, Any], stream: bool = True) -> dict[str, Any]:
    out = dict(body)
    out["stream"] = stream
    if stream:
        # vLLM: include_usage adds the final usage chunk; continuous_usage_stats puts running usage on every
        # chunk, so the gateway knows exactly what was generated at any moment (charging, cut-short streams).
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    else:
        out.pop("stream_options", None)
    return out


class LineTooLong(ValueError):
    pass


async def reads(resp: Response, max_line_bytes: int = 16 * 1024 * 1024) -> AsyncIterator[bytes]:
    """The stream as it arrives, one piece per network read, each cut at a line's end (an unfinished line waits
    for the next read). Lines are split here, not by aiohttp's readline (which refuses lines over 128 KiB: a
    big tool call or logprobs event is legitimate); a line over ``max_line_bytes`` is an upstream failure
    (LineTooLong). A read is the unit the gateway charges, times and writes on, so per-read work is paid once
    for all the events it brought."""
    pending: list[bytes] = []  # the unfinished line's parts
    size = 0
    while chunk := await resp.readany():
        end = chunk.rfind(b"\n")
        if end < 0:
            pending.append(chunk)
            size += len(chunk)
            if size > max_line_bytes:
                raise LineTooLong(f"an event line over {max_line_bytes} bytes")
            continue
        rest = b""
        if end + 1 < len(chunk):  # (a read ending at a line's end, the common case, is not copied)
            chunk, rest = chunk[:end + 1], chunk[end + 1:]
        if pending:
            pending.append(chunk)
            chunk = b"".join(pending)
        pending, size = ([rest], len(rest)) if rest else ([], 0)
        yield chunk
        if size > max_line_bytes:
            raise LineTooLong(f"an event line over {max_line_bytes} bytes")


async def read_whole(resp: Response, max_bytes: int) -> bytes:
    """A non-streamed answer, whole; one over ``max_bytes`` is an upstream failure (LineTooLong)."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise LineTooLong(f"an answer over {max_bytes} bytes")
    parts, size = [], 0
    while chunk := await resp.readany():
        parts.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise LineTooLong(f"an answer over {max_bytes} bytes")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def parse(data: bytes) -> list[dict[str, Any]]:
    """The JSON events of whole lines of a stream, DONE last if it came (what follows it is ignored)."""
    out: list[dict[str, Any]] = []
    for line in data.split(b"\n"):
        if line[:5] != b"data:":
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            out.append(DONE)
            break
        if payload:
            out.append(_event(payload))
    return out


def _event(payload: bytes) -> dict[str, Any]:
    ev = orjson.loads(payload)
    if not isinstance(ev, dict):  # a ValueError: an upstream failure, as malformed JSON is
        raise ValueError(f"an event that is not a JSON object: {payload[:80]!r}")
    return ev


def first_event(data: bytes) -> dict[str, Any] | None:
    """The first event of a read (None if it holds none)."""
    for line in data.split(b"\n", 8):
        if line[:5] == b"data:" and (payload := line[5:].strip()):
            return DONE if payload == b"[DONE]" else _event(payload)
    return None


_NUMBER = re.compile(rb"[ \t]*(\d+)")
_TOO_MANY = 1 << 62  # a count of more than 18 digits: past any cap, so the tally clamps it


def _int_after(data: bytes, key: bytes, start: int = 0) -> int | None:
    """The integer after the last ``key`` in ``data[start:]`` (None if there is none): scanned in C whatever its
    length (a backend may send megabytes of digits), and converted only when it has 18 digits at most."""
    i = data.rfind(key, start)
    if i < 0:
        return None
    m = _NUMBER.match(data, i + len(key))
    if m is None:
        return None
    digits = m.group(1)
    return int(digits) if len(digits) <= 18 else _TOO_MANY


def running_usage(data: bytes, start: int = 0) -> tuple[int | None, int | None]:
    """The last (prompt_tokens, completion_tokens) a read's running usage reports (from ``start`` on), by a byte
    scan: a key in JSON text is quoted bare, inside a string value its quotes are escaped, so only usage objects
    match."""
    return _int_after(data, b'"prompt_tokens":', start), _int_after(data, b'"completion_tokens":', start)


# an event's running usage, its last key (its object may hold one object: prompt_tokens_details)
_RUNNING_USAGE = re.compile(rb',"usage":\{[^{}\n]*(?:\{[^{}\n]*\}[^{}\n]*)?\}(?=\}\n)')


def stream_end(data: bytes) -> tuple[bytes, bytes]:
    """A read cut where the stream's end begins — the usage-only chunk (its ``"choices":[]``) or ``[DONE]``,
    whichever comes first —: (what comes before, the end's lines)."""
    cut = len(data)
    if (i := data.find(b'"choices":[]')) >= 0:
        cut = data.rfind(b"\n", 0, i) + 1
    if (j := data.find(b"data: [DONE]", 0, cut)) >= 0:
        cut = j
    return (data, b"") if cut == len(data) else (data[:cut], data[cut:])


def _whole_events(data: bytes) -> int:
    """How many events a read holds if it is whole ``data: {…}`` events only, as vLLM writes them, else 0: it
    begins with an event, ends with one, and every newline it holds is in an event's end (two or three scans in
    C)."""
    if data[:7] != b"data: {" or data[-3:] != b"}\n\n" or b"\r" in data:  # (a CR: an SSE client's line end)
        return 0
    if (lines := data.count(b"\n")) == 2:  # (one event: its end is the read's)
        return 1
    events = data.count(b"}\n\ndata: {") + 1
    return events if lines == 2 * events else 0


_EVENTS = msgspec.json.Decoder(list[msgspec.Raw])  # a JSON array's text checked, its items left as bytes


def relayable(data: bytes) -> tuple[bytes, int, int | None, int, int | None] | None:
    """A read from the middle of a stream as the client gets it, without parsing its events: the backend's
    events less the running usage the gateway asked for, when the read has the shape vLLM writes — only
    ``data: {…}`` events, each ending with its usage — and holds no error, no ``[DONE]`` and no usage-only
    chunk. Returns (what to send, its events, then the last running usage: prompt, completion and cached
    tokens, each None where absent), or None: the read is parsed event by event. A key in JSON text is quoted
    bare and a raw newline never occurs in it, so neither the pattern nor the scan can match inside a string.
    The events are checked to be JSON (all at once); one that is not sends the read to the event-by-event path."""
    if not (events := _whole_events(data)) or has_error(data) or b'"choices":[]' in data:
        return None
    out = _RUNNING_USAGE.sub(b"", data)
    if b'"usage":' in out:  # a usage the pattern did not take (not the last key): parse
        return None
    # what the client gets is JSON: its events checked as one array, in C, none built or written again
    array = b"[" + out[6:-2].replace(b"}\n\ndata: {", b"},{") + b"]"
    try:
        if len(_EVENTS.decode(array)) != events:
            return None
        if not array.isascii():
            array.decode()  # (its UTF-8: the decoder skips what a string holds)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # a malformed event: parsed one by one,
        return None  # it fails the call as it always did
    prompt, completion, cached = _last_usage(data)
    if completion is None:
        return None
    return out, events, prompt, completion, cached


_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Details(msgspec.Struct):
    cached_tokens: _Count | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: _Count | None = None
    completion_tokens: _Count | None = None
    prompt_tokens_details: _Details | None = None


_USAGE = msgspec.json.Decoder(_Usage)
_SHORT_USAGE = 512  # bytes: a usage object this short is decoded (its numbers short enough to convert)


def _last_usage(data: bytes) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached tokens) of a relayable read's last running usage: its last event's last
    member, decoded in C when it is short; else (megabytes of digits, or numbers as no backend writes them)
    scanned."""
    u = data.rfind(b',"usage":{')
    if u < 0:
        return None, None, None
    if len(data) - u < _SHORT_USAGE:
        try:
            usage = _USAGE.decode(memoryview(data)[u + 9:-3])  # (the event ends "}}\n\n")
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        else:
            details = usage.prompt_tokens_details
            return usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details else None
    return (*running_usage(data, u), _int_after(data, b'"cached_tokens":', u))


def ends(data: bytes) -> bool:
    """The read holds the stream's ``data: [DONE]`` line (JSON text never holds a raw newline)."""
    i = data.rfind(b"[DONE]")
    if i < 0:
        return False
    start = data.rfind(b"\n", 0, i) + 1
    line = data[start:data.find(b"\n", i) if data.find(b"\n", i) >= 0 else len(data)]
    return line[:5] == b"data:" and line[5:].strip() == b"[DONE]"


def has_error(data: bytes) -> bool:
    """The read may hold an error event (a bare ``"error":`` key; escaped quotes inside text do not match)."""
    return b'"error":' in data


ERROR_BODY_BYTES = 64 << 10  # of a backend's error answer: what is read of it, within ERROR_BODY_S
ERROR_BODY_S = 5.0


async def _error_bytes(resp: Response) -> bytes:
    """At most ``ERROR_BODY_BYTES`` of an error answer, read within ``ERROR_BODY_S``: an endless or trickling
    error body must cost neither memory nor the request's whole first-token timeout."""
    parts, size = [], 0
    try:
        async with asyncio.timeout(ERROR_BODY_S):
            while size < ERROR_BODY_BYTES and (chunk := await resp.readany()):
                parts.append(chunk)
                size += len(chunk)
    except TimeoutError:
        pass
    resp.close()  # what is left is not read: the connection is closed, not reused
    return b"".join(parts)[:ERROR_BODY_BYTES]


async def error_body(resp: Response) -> dict[str, Any]:
    raw = await _error_bytes(resp)
    try:
        body = orjson.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body
        message = body.get("message") or body.get("detail") or raw.decode(errors="replace")
    except (orjson.JSONDecodeError, AttributeError):
        message = raw.decode(errors="replace")
    return {"error": {"message": str(message)[:500], "type": None, "param": None, "code": resp.status}}
