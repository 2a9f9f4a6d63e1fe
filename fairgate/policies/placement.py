"""Placement: which backend a request goes to, among those that can serve its model. Pure; no I/O."""

from __future__ import annotations

from typing import Protocol, Sequence

from fairgate.policies.views import BackendView, RequestView


class Placement(Protocol):
    name: str

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        b = backends[self._next % len(backends)]
        self._next += 1
        return b


class LeastLoad:
    """The backend with the smallest committed load; ties go to fewer queued, then fewer in flight."""

    name = "least-load"

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        return min(backends, key=lambda b: (b.load, b.waiting, b.inflight, b.name))


def make_placement(name: str) -> Placement:
    return {"round-robin": RoundRobin, "least-load": LeastLoad}[name]()
