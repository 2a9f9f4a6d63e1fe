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
from typing import Iterable

from fairgate.accounting.calibration import ttft_point
from fairgate.accounting.latency import BackendLatency
from fairgate.proxy.errors import APIError


def expected_ttft(ahead: int, rate: float, prompt_tokens: int,
                  fits: Iterable[tuple[BackendLatency, int]]) -> float:
    """Seconds until its first token (``ttft_point``, each backend as (its fit, prompt tokens it has yet to
    prefill)): the wait for ``ahead`` requests at ``rate``, then the soonest prefill; 0
    with nothing ahead (then it is never shed: were its backends slower than the fits say, a shed request would
    never be seen to correct them)."""
    return expected_from(ahead, ttft_point(ahead, rate, prompt_tokens, fits) if ahead else None)


def expected_from(ahead: int, point: float | None) -> float:
    """``expected_ttft`` from its point already made (``ttft_point``: the gateway's p90 forecast makes it)."""
    if ahead == 0:
        return 0.0
    return math.inf if point is None else point


def refusal(expected_s: float, target_ms: float, retry_after_s: int) -> APIError | None:
    """The 429 that sheds it, if its expected first token is past its target."""
    if not expected_s * 1000.0 > target_ms:  # (NaN: not shed)
        return None
    waited = "an unknown time" if math.isinf(expected_s) else f"{expected_s * 1000.0:.0f} ms"
    retry = retry_after_s if math.isinf(expected_s) else max(retry_after_s, min(math.ceil(expected_s), 600))
    return APIError(429, f"its first token is expected in {waited}, past its SLO class's TTFT target of "
                    f"{target_ms:.0f} ms: shed (its class is sheddable)", code="slo_unattainable",
                    headers={"retry-after": str(retry), "x-should-retry": "true"})
