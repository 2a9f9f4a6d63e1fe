"""Limits and budgets as one kind of meter (docs/operations/limits.md): every limit a request is held to is a
``Check`` on a meter whose ``used`` amount must stay within ``cap``.

- a rate limit (requests or tokens per minute) is a leaky bucket: ``used`` drains at ``rate`` = cap / 60 per
  second (GCRA's meter; a sliding limit with no window edge to burst at), so a client held at its limit is
  served exactly cap per minute, and ``reset`` is the time until the meter is empty again (OpenAI's header);
- a budget (tokens or money per calendar period, or in total) is a meter that never drains, its key naming
  the period;
- a concurrency cap is a meter of the requests in flight.

A request *reserves* its amounts on every meter at once, all or nothing (``reserve``): prompt tokens, which the
gateway counts exactly, plus the output it is expected to produce; as its stream outgrows that it *draws*
more, and when it ends it *settles* to the exact count (``apply``: forced, never refused, a meter may go
over its cap: the debt is paid by the next requests waiting). So concurrent requests on any number of
replicas overshoot a limit by at most what they drew beyond their reservations, and a budget — reserved at the
most a request may produce — by nothing. Pure: no I/O, time is passed in; ``QuotaBook`` is the in-memory meter
store (one process, or a replica's fallback while Redis is away); storage/shared_quota.py runs the same
rules in one Lua script across replicas. Every operation is O(checks), ≤ 8 per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RATE, BUDGET, INFLIGHT = "rate", "budget", "inflight"


@dataclass(frozen=True, slots=True)
class Check:
    key: str  # the meter: "tpm:app:chat", "rpm:key:12", "usd:user:chat/ann:2026-11", "conc:app:chat"
    kind: str  # RATE | BUDGET | INFLIGHT
    cap: float
    amount: float  # what this request reserves on it
    rate: float = 0.0  # drained per second (RATE: cap / 60)
    ttl_s: float = 120.0  # how long the meter must outlive its last change (a budget: to its period's end)
    reason: str = ""  # what a refusal names: "app_tpm", "user_budget_usd", …
    retry_at: float | None = None  # BUDGET: when the period turns (None: a total budget never does)


@dataclass(frozen=True, slots=True)
class Limits:
    """One app's, user's or key's limits and budget, as an admin set them (None: none)."""

    rpm: int | None = None
    tpm: int | None = None
    tpm_kind: str = "total"  # total | input | output | weighted (the cost function's h(prompt, output))
    concurrency: int | None = None
    budget_tokens: int | None = None
    budget_usd: float | None = None
    budget_period: str = "month"  # day | week | month | total


@dataclass(frozen=True, slots=True)
class Refusal:
    check: Check
    used: float

    @property
    def quota(self) -> bool:
        """A budget spent (OpenAI's ``insufficient_quota``: retrying will not help before its period turns)."""
        return self.check.kind == BUDGET

    def retry_after_s(self, now_wall: float) -> float:
        c = self.check
        if c.kind == RATE and c.rate > 0:
            return max(0.0, (self.used + c.amount - c.cap) / c.rate)
        if c.kind == BUDGET:
            return math.inf if c.retry_at is None else max(0.0, c.retry_at - now_wall)
        return 1.0  # in flight: one finishes soon enough to try again


def drained(used: float, rate: float, elapsed: float) -> float:
    return max(0.0, used - rate * max(0.0, elapsed)) if rate else used


class QuotaBook:
    """Meters in memory: key → (used, at, expires). ``cap_scale`` scales every cap (a replica's share of the
    fleet's limits while Redis is away)."""

    SWEEP = 4096  # operations between sweeps of expired meters (amortised O(1))

    def __init__(self) -> None:
        self._m: dict[str, tuple[float, float, float]] = {}
        self._ops = 0
        self.cap_scale = 1.0

    def __len__(self) -> int:
        return len(self._m)

    def used(self, key: str, rate: float, now: float) -> float:
        got = self._m.get(key)
        if got is None or got[2] <= now:
            return 0.0
        return drained(got[0], rate, now - got[1])

    def reserve(self, checks: list[Check], now: float) -> tuple[Refusal | None, list[float]]:
        """Reserve every check's amount if each meter stays within its cap (scaled); else nothing, and the first
        check that refused. Returns the meters' use after it (on a refusal: before)."""
        used = [self.used(c.key, c.rate, now) for c in checks]
        for c, u in zip(checks, used):
            if u + c.amount > c.cap * self.cap_scale:
                return Refusal(c, u), used
        return None, self.apply([(c, c.amount) for c in checks], now)

    def apply(self, deltas: list[tuple[Check, float]], now: float) -> list[float]:
        """Add each amount to its meter, whatever its cap (a draw, a settlement, a release)."""
        out = []
        for c, amount in deltas:
            got = self._m.get(c.key)
            expires = max(got[2] if got else 0.0, now + c.ttl_s)
            u = max(0.0, self.used(c.key, c.rate, now) + amount)
            self._m[c.key] = (u, now, expires)
            out.append(u)
        self._ops += 1
        if self._ops % self.SWEEP == 0:
            self._m = {k: v for k, v in self._m.items() if v[2] > now}
        return out


def reset_text(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    return f"{m}m{sec}s" if m else f"{sec}s"


def headers(checks: list[Check], used: list[float]) -> dict[str, str]:
    """OpenAI's rate-limit headers for the tightest request limit and the tightest token limit among
    ``checks`` (the one with the least left, as a share of its cap)."""
    out: dict[str, str] = {}
    for what, prefix in (("requests", "rpm:"), ("tokens", "tpm:")):
        best = None
        for c, u in zip(checks, used):
            if c.kind == RATE and c.key.startswith(prefix):
                left = max(0.0, c.cap - u)
                if best is None or left / c.cap < best[0]:
                    best = (left / c.cap, c, u, left)
        if best is not None:
            _, c, u, left = best
            out[f"x-ratelimit-limit-{what}"] = str(int(c.cap))
            out[f"x-ratelimit-remaining-{what}"] = str(int(left))
            out[f"x-ratelimit-reset-{what}"] = reset_text(u / c.rate if c.rate else 0.0)
    return out
