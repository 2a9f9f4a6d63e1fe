"""The wire helpers of bench/edge_attack.py: raw HTTP/1.1 heads and bodies, connections, a flood of bytes."""

from __future__ import annotations

import asyncio

HOST = "127.0.0.1"
MODEL = "evil-llama"
FILL = b"a" * 16384
PER_CONN_BYTES = 256 << 20  # the most an attacking connection (or a malicious answer) writes


def content_length(head: bytes) -> int:
    return next((int(v) for n, _, v in (x.partition(b":") for x in head.split(b"\r\n")[1:])
                 if n.strip().lower() == b"content-length"), 0)


async def read_response(r: asyncio.StreamReader) -> int:
    """One response's status; its body (Content-Length) read and dropped."""
    head = await r.readuntil(b"\r\n\r\n")
    await r.readexactly(content_length(head))
    return int(head.split(b" ", 2)[1])


async def connect(port: int, timeout: float = 5.0):
    return await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)


def shut(w: asyncio.StreamWriter | None) -> None:
    if w is not None:
        w.transport.abort()


async def flood(w: asyncio.StreamWriter, prefix: bytes, piece: bytes, until: float, stats: dict, what: str) -> None:
    """Write ``prefix``, then ``piece`` until the loop's time ``until``, the connection breaks, or the cap."""
    loop, sent = asyncio.get_running_loop(), 0
    try:
        w.write(prefix)
        while loop.time() < until and sent < PER_CONN_BYTES:
            w.write(piece)
            sent += len(piece)
            await asyncio.wait_for(w.drain(), max(0.001, until - loop.time()))
    except TimeoutError:
        stats[f"{what} writes stalled until the end"] += 1
    except OSError as e:
        stats[f"{what} ended: {type(e).__name__}"] += 1
    stats[f"{what} MB written"] += sent / 1e6


def q(values: list[float], p: float) -> float:
    """The ``p`` quantile in ms."""
    values = sorted(values)
    return values[min(len(values) - 1, int(p * (len(values) - 1)))] * 1000 if values else float("nan")
