"""What the benches share to start servers: a free port, and a wait until a URL answers 200."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(url: str, headers: dict | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, headers=headers or {}) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready")
