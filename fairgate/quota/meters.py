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
store (one process, or a replica's fallback while Redis is away); quota/redis_store.py runs the same
rules in one Lua script across replicas. Every operation is O(checks): at most seven a target (its app, its
user, its key): request, token and concurrency limits, and two budgets, each with the meter of what the
requests in flight hold of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

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
    amount: float  # what the request asked of it
    cap: float | None = None  # the cap that refused it, where not the check's own (a replica's share)
    rate: float | None = None  # and the rate its meter drains at

    @property
    def quota(self) -> bool:
        """A budget spent (OpenAI's ``insufficient_quota``: retrying will not help before its period turns)."""
        return self.check.kind == BUDGET

    def retry_after_s(self, now_wall: float) -> float:
        c = self.check
        cap, rate = (c.cap if self.cap is None else self.cap), (c.rate if self.rate is None else self.rate)
        if c.kind == RATE and rate > 0:
            return max(0.0, (self.used + self.amount - cap) / rate)
        if c.kind == BUDGET:
            return math.inf if c.retry_at is None else max(0.0, c.retry_at - now_wall)
        return 1.0  # in flight: one finishes soon enough to try again


class QuotaBook:
    """Meters in memory: key → (used, at, expires).

    As a replica's fallback (quota/redis_store.py) the book holds the replica's *own* use against its share
    ``cap_scale`` of each limit: a rate meter drains at its share of the rate, a concurrency cap is its share,
    and a budget allows its share of what the fleet had left when Redis last answered (``known``)."""

    SWEEP = 1024  # meters below which expired ones are never swept

    def __init__(self) -> None:
        self._m: dict[str, tuple[float, float, float]] = {}
        self._sweep_at = self.SWEEP  # expired meters are swept when the book doubled since the last sweep:
        # amortised O(1) per new meter, and none at all while the set of meters stands still
        self.cap_scale = 1.0
        self.known: dict[str, float] = {}  # budget meter → the fleet's use of it, as Redis last said

    def __len__(self) -> int:
        return len(self._m)

    def used(self, key: str, rate: float, now: float) -> float:
        got = self._m.get(key)
        if got is None or got[2] <= now:
            return 0.0
        u = got[0] - rate * (now - got[1]) if rate and now > got[1] else got[0]
        return u if u > 0.0 else 0.0

    def reserve(self, checks: list[Check], now: float,
                amounts: list[float] | None = None) -> tuple[Refusal | None, list[float]]:
        """Reserve each check's amount (``amounts``, else each check's own) if every meter stays within its cap
        (scaled); else nothing, and the first check that refused. Returns the meters' use after it (on a
        refusal: before)."""
        if amounts is None:
            amounts = [c.amount for c in checks]
        scale, used_of = self.cap_scale, self.used
        if scale == 1.0:  # (one process, or Redis up: the caps as set)
            used = [used_of(c.key, c.rate, now) for c in checks]
            for c, u, a in zip(checks, used, amounts):
                if u + a > c.cap:
                    return Refusal(c, u, a), used
        else:
            used = [used_of(c.key, c.rate * scale, now) for c in checks]
            for c, u, a in zip(checks, used, amounts):
                share = self._budget_share(c) if c.kind == BUDGET else c.cap * scale
                # (a share below one request admits one at a time)
                if u + a > share and not (u <= 0.0 and a <= c.cap):
                    return Refusal(c, u, a, max(share, a) if a <= c.cap else share, c.rate * scale), used
        return None, self._write([(c, u + a) for c, u, a in zip(checks, used, amounts)], now)

    def _budget_share(self, c: Check) -> float:
        known = self.known.get(c.key, 0.0)
        return known + max(0.0, c.cap - known) * self.cap_scale

    def set(self, c: Check, value: float, now: float) -> None:
        """A budget meter as Redis says it stands (the fleet's use)."""
        self.known[c.key] = value
        self._write([(c, value)], now)

    def seed(self, check: Check, amount: float, now: float) -> None:
        """A meter at least at ``amount`` (a budget's spend so far by the usage log, read once per process)."""
        if check.kind == BUDGET:
            self.known[check.key] = max(self.known.get(check.key, 0.0), amount)
        if amount > self.used(check.key, check.rate * self.cap_scale, now):
            self._write([(check, amount)], now)

    def apply(self, deltas: list[tuple[Check, float]], now: float) -> list[float]:
        """Add each amount to its meter, whatever its cap (a draw, a settlement, a release)."""
        scale = self.cap_scale
        return self._write([(c, self.used(c.key, c.rate * scale, now) + amount) for c, amount in deltas], now)

    def _write(self, values: list[tuple[Check, float]], now: float) -> list[float]:
        m, out = self._m, []
        for c, u in values:
            u = u if u > 0.0 else 0.0
            ttl = c.ttl_s
            if c.rate and u / c.rate + 60.0 > ttl:
                ttl = u / c.rate + 60.0  # (a debt outlives its drain)
            expires = now + ttl
            got = m.get(c.key)
            m[c.key] = (u, now, expires if got is None or got[2] < expires else got[2])
            out.append(u)
        if len(m) >= self._sweep_at:
            self._m = {k: v for k, v in m.items() if v[2] > now}
            self.known = {k: v for k, v in self.known.items() if k in self._m}
            self._sweep_at = max(self.SWEEP, 2 * len(self._m))
        return out


def reset_text(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    if s < 60:
        return f"{s}s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    return f"{m}m{sec}s"


_NAMES = {what: (f"x-ratelimit-limit-{what}", f"x-ratelimit-remaining-{what}", f"x-ratelimit-reset-{what}")
          for what in ("requests", "tokens")}


def headers(checks: list[Check], used: list[float]) -> dict[str, str]:
    """OpenAI's rate-limit headers for the tightest request limit and the tightest token limit among
    ``checks`` (the one with the least left, as a share of its cap). O(checks), on every admitted request."""
    req = tok = None  # (share left, check, used) of the tightest of each kind
    for c, u in zip(checks, used):
        if c.kind != RATE:
            continue
        share = (c.cap - u) / c.cap
        if c.key[0] == "r":  # rpm:… | tpm:…
            if req is None or share < req[0]:
                req = (share, c, u)
        elif tok is None or share < tok[0]:
            tok = (share, c, u)
    out: dict[str, str] = {}
    for what, got in (("requests", req), ("tokens", tok)):
        if got is not None:
            _, c, u = got
            limit, remaining, reset = _NAMES[what]
            out[limit] = str(int(c.cap))
            out[remaining] = str(int(c.cap - u)) if u < c.cap else "0"
            out[reset] = reset_text(u / c.rate if c.rate else 0.0)
    return out


def period(kind: str, now: float, tz: ZoneInfo) -> tuple[str, float | None]:
    """The calendar period ``now`` (wall seconds) falls in: its name and when the next begins (None: ``total``)."""
    if kind == "total":
        return "total", None
    t = datetime.fromtimestamp(now, tz)
    day = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind == "day":
        start, nxt = day, day + timedelta(days=1)
    elif kind == "week":
        start = day - timedelta(days=day.weekday())
        nxt = start + timedelta(days=7)
    else:
        start = day.replace(day=1)
        nxt = (start + timedelta(days=32)).replace(day=1)
    nxt = nxt.replace(tzinfo=None).replace(tzinfo=tz)  # (midnight there, across a DST change)
    return start.strftime("%Y-%m-%d"), nxt.timestamp()


def period_start(name: str, tz: ZoneInfo) -> float | None:
    """When the period ``period`` named began (None: ``total``)."""
    if name == "total":
        return None
    return datetime.strptime(name, "%Y-%m-%d").replace(tzinfo=tz).timestamp()
