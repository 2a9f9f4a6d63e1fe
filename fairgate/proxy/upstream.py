"""Talking to one backend: always streaming, always asking for usage; reading its SSE events."""

from __future__ import annotations

from typing import Any, AsyncIterator

import aiohttp
import orjson

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DONE: dict[str, Any] = {}  # sentinel for "data: [DONE]"

UPSTREAM_ERRORS = (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError)


class Retryable(Exception):
    """The backend failed before sending anything to the client; another backend may be tried."""


class BackendRejected(Exception):
    """The backend refused the request as the client's mistake (a 4xx); pass it on."""

    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(status)
        self.status, self.body = status, body


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out["stream"] = True
    # vLLM: include_usage adds the final usage chunk; continuous_usage_stats puts running usage on every chunk,
    # so the gateway knows exactly what was generated at any moment (for charging and for cut-short streams).
    out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return out


class LineTooLong(ValueError):
    pass


async def batches(resp: aiohttp.ClientResponse, max_line_bytes: int = 16 * 1024 * 1024
                  ) -> AsyncIterator[list[dict[str, Any]]]:
    """The stream's JSON events, as one list per network read (never empty), the last one ending with DONE;
    the stream ends without DONE if the backend stops early. A read is the unit the gateway charges, times
    and writes on, so per-read work is paid once for all the events it brought. Lines are split here, not by
    aiohttp's readline (which refuses lines over 128 KiB: a big tool call or logprobs event is legitimate); a
    line over ``max_line_bytes`` is an upstream failure (LineTooLong)."""
    pending: list[bytes] = []  # the unfinished line's parts
    size = 0
    loads = orjson.loads
    async for chunk in resp.content.iter_any():
        if b"\n" not in chunk:
            pending.append(chunk)
            size += len(chunk)
            if size > max_line_bytes:
                raise LineTooLong(f"an event line over {max_line_bytes} bytes")
            continue
        if pending:
            pending.append(chunk)
            chunk = b"".join(pending)
        lines = chunk.split(b"\n")
        rest = lines.pop()
        pending, size = ([rest], len(rest)) if rest else ([], 0)
        out: list[dict[str, Any]] = []
        for line in lines:
            if line[:5] != b"data:":
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out.append(DONE)
                yield out
                return
            if data:
                out.append(loads(data))
        if out:
            yield out
        if size > max_line_bytes:
            raise LineTooLong(f"an event line over {max_line_bytes} bytes")


async def error_body(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    raw = await resp.read()
    try:
        body = orjson.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body
        message = body.get("message") or body.get("detail") or raw.decode(errors="replace")
    except (orjson.JSONDecodeError, AttributeError):
        message = raw.decode(errors="replace")[:500]
    return {"error": {"message": str(message), "type": None, "param": None, "code": resp.status}}
