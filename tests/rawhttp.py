"""Raw-socket helpers for the listener's tests: what a client sends, byte for byte, and what comes back."""

from __future__ import annotations

import asyncio
import re

import orjson


async def exchange(port: int, raw: bytes, *, timeout: float = 3.0) -> bytes:
    """Send ``raw``, read until the server closes (or ``timeout``)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(raw)
    out = b""
    try:
        while chunk := await asyncio.wait_for(r.read(65536), timeout):
            out += chunk
    except (asyncio.TimeoutError, ConnectionError):
        pass
    w.close()
    return out


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def peek(r: asyncio.StreamReader, timeout: float = 0.01) -> bytes:
    try:
        return await asyncio.wait_for(r.read(4096), timeout)
    except asyncio.TimeoutError:
        return b""


def error_code(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body)["error"]


def statuses(answer: bytes) -> list[int]:
    """The status of every response in ``answer`` (a 100 Continue included; a status line may follow a body)."""
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]
