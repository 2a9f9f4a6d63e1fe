"""Placement: which backend a request goes to, among those that can serve its model. Pure; no I/O."""

from __future__ import annotations

from typing import Sequence

from fairgate.policies.views import BackendView, RequestView


class Placement:
    """Which backend a request goes to. What a caller may rely on is declared, never probed:
    ``routes_at_arrival`` (the request is pinned to a backend when it arrives and waits for that backend;
    else a backend is chosen when one has headroom). The hooks are no-ops unless a placement keeps state."""

    name = "base"
    routes_at_arrival = False

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        raise NotImplementedError

    def on_finish(self, request: RequestView, backend: str, generated: int) -> None:
        """``request`` ended on ``backend`` after ``generated`` output tokens."""

    def refund(self, request: RequestView, backend: str) -> None:
        """``request``, routed to ``backend``, left without running (D²LPM gives back its charge)."""

    def set_params(self, **params: float) -> None:
        """Run-time parameters (`fairgate admin locality set`); a placement without any takes none."""

    def waits(self, request: RequestView, backends: Sequence[str], now: float) -> bool:
        """True only if ``choose`` would return None for ``request`` now on any of ``backends`` (named), known
        without their views: a refusal that still stands (a caller may then skip building them). Never
        required: False is always a correct answer."""
        return False


class RoundRobin(Placement):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        b = backends[self._next % len(backends)]
        self._next += 1
        return b


class LeastLoad(Placement):
    """The backend with the smallest committed load; ties go to fewer queued, then fewer in flight."""

    name = "least-load"

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        return min(backends, key=lambda b: (b.load, b.waiting, b.inflight, b.name))


PLACEMENTS = ("round-robin", "least-load", "jsq", "client-round-robin", "prefix", "d2lpm", "power-of-two")
