"""Placement that knows what each backend caches (docs/policies/locality.md#baselines). Pure: no I/O, time
passed in.

``match(view, backend)`` gives the prompt tokens a backend probably caches for a request (the prefix index in
the gateway, the router's index or the engines' caches in the simulator); ``s_w``, a backend's outstanding
requests, is its view's ``inflight + waiting``.

- ``prefix``: Preble's E2 rule at its minimum (docs/policies/locality.md#preble): *exploit* when the matched
  prefix is longer than the rest of the prompt (match ratio > ``ratio``, 0.5) — the longest-match backend,
  least loaded among ties — otherwise *explore*: the least-loaded backend. No fairness (it can pin a client to
  one backend, C6).
- ``d2lpm`` (DoubleQ, Algorithm 2, §5.2): per client × backend deficits q_{i,w} with quantum Q^w
  (``client_quantum``); the longest-match backends where the client still has credit first, else any backend
  where it has credit, shortest queue first; when it has credit nowhere, every backend of the client gets
  Q^w (repeated until one is positive). Charged w_e · the *full* input at dispatch (line 16; not extend
  tokens, on purpose: docs/policies/locality.md#two-charges) and w_q · output at the finish (line 22). Q^w
  must be finite (Thm A.5).
- ``client-round-robin``: each client's successive requests rotate over the backends (the distributed VTC
  baseline, docs/policies/locality.md#baselines).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from fairgate.policies.placement import Placement
from fairgate.policies.views import BackendView, RequestView

Match = Callable[[RequestView, str], int]


def _queue(b: BackendView) -> int:
    return b.inflight + b.waiting


def _longest(request: RequestView, backends: Sequence[BackendView], match: Match) -> tuple[int, list[BackendView]]:
    best, group = 0, []
    for b in backends:
        m = match(request, b.name)
        if m > best:
            best, group = m, [b]
        elif m == best and m > 0:
            group.append(b)
    return best, group


class PrefixPlacement(Placement):
    name = "prefix"
    routes_at_arrival = True  # the gateway pins the request at arrival (Preble's global scheduler)

    def __init__(self, match: Match, ratio: float = 0.5):
        self.match, self.ratio = match, ratio

    def set_params(self, ratio: float | None = None) -> None:
        if ratio is not None:
            if not 0 <= ratio <= 1:
                raise ValueError("the match ratio is a fraction in [0, 1]")
            self.ratio = float(ratio)

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        best, group = _longest(request, backends, self.match)
        if group and best > self.ratio * request.prompt_tokens:  # exploit
            return min(group, key=lambda b: (_queue(b), b.load, b.name))
        return min(backends, key=lambda b: (b.load, _queue(b), b.name))  # explore



class DoubleQ(Placement):
    name = "d2lpm"
    routes_at_arrival = True  # Algorithm 2 routes at arrival; each backend's queue is then served in order

    def __init__(self, match: Match, client_quantum: float = 20_000.0, *, w_e: float = 1.0, w_q: float = 2.0,
                 weights: Callable[[str], float] | None = None):
        if not client_quantum > 0 or math.isinf(client_quantum):
            raise ValueError("the client quantum Q^w must be positive and finite (Thm A.5)")
        self.match, self.client_quantum, self.w_e, self.w_q = match, float(client_quantum), w_e, w_q
        self.weight = weights or (lambda _c: 1.0)
        self.q: dict[str, dict[str, float]] = {}  # client → backend → q_{i,w}
        self.refills = 0

    def set_params(self, client_quantum: float | None = None) -> None:
        if client_quantum is not None:
            if not client_quantum > 0 or math.isinf(client_quantum):
                raise ValueError("the client quantum Q^w must be positive and finite (Thm A.5)")
            self.client_quantum = float(client_quantum)

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        qi = self.q.setdefault(request.client, {})
        for b in backends:
            qi.setdefault(b.name, 0.0)
        avail = [b for b in backends if qi[b.name] > 0]
        if not avail:  # lines 5–6: every backend of the client gets Q^w until one is positive
            quantum = self.client_quantum * self.weight(request.client)
            k = min(int(-qi[b.name] // quantum) + 1 for b in backends)
            for w in qi:
                qi[w] += k * quantum
            self.refills += k
            avail = [b for b in backends if qi[b.name] > 0]
        _, group = _longest(request, backends, self.match)
        names = {b.name for b in group}
        cand = [b for b in avail if b.name in names] or avail  # lines 7–9
        chosen = min(cand, key=lambda b: (_queue(b), b.load, b.name))
        qi[chosen.name] -= self.w_e * request.prompt_tokens  # line 16: the full input
        return chosen

    def on_finish(self, request: RequestView, backend: str, generated: int) -> None:
        qi = self.q.get(request.client)
        if qi is not None and backend in qi:
            qi[backend] -= self.w_q * generated  # line 22

    def refund(self, request: RequestView, backend: str) -> None:
        """The request routed to ``backend`` never ran (given up, timed out, re-routed): line 16's charge of
        its input is given back, so a client is not charged for work no backend did."""
        qi = self.q.get(request.client)
        if qi is not None and backend in qi:
            qi[backend] += self.w_e * request.prompt_tokens


class ClientRoundRobin(Placement):
    name = "client-round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        k = self._next.get(request.client, 0)
        self._next[request.client] = k + 1
        return sorted(backends, key=lambda b: b.name)[k % len(backends)]

