"""Sliding request-rate windows per user and per app (FairServe's c^r_{g,u} and c^r_a, Alg. 1 l.19).

Every arrival is counted, throttled or not (the paper counts before it decides). Pure: time is passed in.
The memory store is the single-process default; the Redis store implements the same two methods.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, runtime_checkable


@runtime_checkable
class WindowStore(Protocol):
    """Sliding windows of arrivals per key; ``storage/shared_fairserve.py``'s Redis store satisfies it too."""

    def hit(self, key: str, now: float) -> int: ...

    def count(self, key: str, now: float) -> int: ...

    def retry_after(self, key: str, now: float, limit: int) -> float: ...


class MemoryWindows:
    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self._t: dict[str, deque[float]] = {}

    def _trim(self, key: str, now: float) -> deque[float]:
        q = self._t.setdefault(key, deque())
        while q and q[0] <= now - self.window_s:
            q.popleft()
        return q

    def hit(self, key: str, now: float) -> int:
        """Record one arrival; the count in the window, including it."""
        q = self._trim(key, now)
        q.append(now)
        return len(q)

    def count(self, key: str, now: float) -> int:
        return len(self._trim(key, now))

    def retry_after(self, key: str, now: float, limit: int) -> float:
        """Seconds until the window holds fewer than ``limit`` arrivals (so one more is within the limit)."""
        q = self._trim(key, now)
        excess = len(q) - limit
        if excess < 0:
            return 0.0
        return max(0.0, q[excess] + self.window_s - now)
