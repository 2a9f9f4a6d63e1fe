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


async def events(resp: aiohttp.ClientResponse, max_line_bytes: int = 16 * 1024 * 1024
                 ) -> AsyncIterator[dict[str, Any]]:
    """The stream's JSON events, then DONE. Ends without DONE if the backend stops early. Lines are split here,
    not by aiohttp's readline (which refuses lines over 128 KiB: a big tool call or logprobs event is
    legitimate); a line over ``max_line_bytes`` is an upstream failure (LineTooLong)."""
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = bytes(buf[start:end])
            start = end + 1
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                yield DONE
                return
            if data:
                yield orjson.loads(data)
        del buf[:start]
        if len(buf) > max_line_bytes:
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
