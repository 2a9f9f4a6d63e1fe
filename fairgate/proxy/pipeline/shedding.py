"""Shedding: a request of a sheddable SLO class (`fairgate admin slo set … --sheddable`) that could not get its
first token within its TTFT target, even if it waited its turn, is refused at once with the reason and a
``retry-after`` instead of served late (docs/guide/slo.md#shedding).

Its expected first token = its wait + its prefill: the wait is the requests ahead of it (those waiting in its
band and above, as its policy orders them: `Scheduler.waiting_ahead`) over the rate the gateway has been dispatching at (the last
``window`` dispatches); the prefill is the fastest serving backend's fitted prefill for its prompt
(`accounting/latency.py`). Nothing waiting ahead: never shed. O(waiting tenants) per sheddable request.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable

from fairgate.accounting.latency import BackendLatency
from fairgate.proxy.errors import APIError


class EventRate:
    """Events (dispatches, arrivals) per second over the last ``window`` of them within ``horizon_s``."""

    def __init__(self, window: int = 200, horizon_s: float = 60.0):
        self._times: deque[float] = deque(maxlen=window)
        self.horizon_s = horizon_s

    def event(self, now: float) -> None:
        self._times.append(now)

    def per_s(self, now: float) -> float:
        """The rate until ``now`` (a lull since the last event lowers it; events older than the horizon are
        forgotten, so a day idle does not make the next minute look slow)."""
        times = self._times
        while times and now - times[0] > self.horizon_s:
            times.popleft()
        if len(times) < 2:
            return 0.0
        return (len(times) - 1) / max(now - times[0], 1e-6)


def expected_ttft(ahead: int, rate: float, prompt_tokens: int, fits: Iterable[BackendLatency]) -> float:
    """Seconds until its first token: the wait for ``ahead`` requests at ``rate``, then the fastest prefill; 0
    with nothing ahead (then it is never shed: were its backends slower than the fits say, a shed request would
    never be seen to correct them)."""
    if ahead == 0:
        return 0.0
    wait = math.inf if rate <= 0 else ahead / rate
    return wait + max(0.0, min((f.prefill_time(prompt_tokens)[0] for f in fits), default=0.0))


def refusal(expected_s: float, target_ms: float, retry_after_s: int) -> APIError | None:
    """The 429 that sheds it, if its expected first token is past its target."""
    if not expected_s * 1000.0 > target_ms:  # (NaN: not shed)
        return None
    waited = "an unknown time" if math.isinf(expected_s) else f"{expected_s * 1000.0:.0f} ms"
    retry = retry_after_s if math.isinf(expected_s) else max(retry_after_s, min(math.ceil(expected_s), 600))
    return APIError(429, f"its first token is expected in {waited}, past its SLO class's TTFT target of "
                    f"{target_ms:.0f} ms: shed (its class is sheddable)", code="slo_unattainable",
                    headers={"retry-after": str(retry), "x-should-retry": "true"})
