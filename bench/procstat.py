"""A process's memory and CPU as a bench sees them, from /proc (Linux)."""

from __future__ import annotations

import asyncio
import os
import time


def rss_cpu(pid: int) -> tuple[float, float]:
    """The process's RSS (MB) and CPU time so far (s, user + system)."""
    with open(f"/proc/{pid}/status") as f:
        rss = next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")), 0.0)  # 0: exiting
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def sample(pid: int, seconds: float) -> list[tuple[float, float, float]]:
    """(time, RSS, CPU time) every 0.5 s, while the process lives."""
    out, t0 = [], time.monotonic()
    for _ in range(int(seconds / 0.5) + 1):
        try:
            out.append((time.monotonic() - t0, *rss_cpu(pid)))
        except OSError:  # it has gone
            break
        await asyncio.sleep(0.5)
    return out
