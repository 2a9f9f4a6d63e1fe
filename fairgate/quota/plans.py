"""Which limits a request is held to, as checks on meters (docs/operations/limits.md): its app's, its user's and
its key's request, token and concurrency limits and budgets, read from the tenants (`fairgate admin
limit|budget set`), and what each check measures. The checks of a target are built once per (limits, calendar
period, continuation) and kept, the same objects request after request; what a request reserved (``Hold``)
is here too. Pure but for the clock read by the caller."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

from fairgate.accounting.cost import CostFunction
from fairgate.quota.meters import (
    BUDGET,
    INFLIGHT,
    RATE,
    Check,
    Limits,
    period,
    period_start,
)
from fairgate.storage.identity import user_key

if TYPE_CHECKING:
    from fairgate.proxy.call import Call
    from fairgate.proxy.control.tenants import Tenants

NANO = 1e9  # money is metered in nano-USD: a token at $0.15 per million is 150
HELD = "hold:"  # a budget's companion meter: what the requests in flight reserved of it (across replicas,
# each replica's part: quota/redis_store.py)
UNCAPPED = 1e300
TOTAL_TTL_S = 10 * 365 * 86400.0
INFLIGHT_TTL_S = 2 * 86400.0  # a concurrency meter unused this long is forgotten: far past any request's life
# (queue_timeout_s + request_timeout_s, 4,200 s by default), or a request running when it expired would be too


@dataclass(slots=True)
class Hold:
    """What a request reserved: each check with what it measures (``what``) and the amount it holds now."""

    checks: list[Check]
    what: list[str]  # "req" | "conc" | "total" | "input" | "output" | "weighted" | "usd" | "hold:total" | "hold:usd"
    held: list[float]
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    seeds: list[tuple[int, str, float | None, str]] = field(default_factory=list)  # budgets: (check, target,
    # period start, unit), each meter started from the usage log once per process
    drawing: bool = False  # a draw is on its way to the store
    settled: bool = False
    unreserved: list[tuple[str, float]] = field(default_factory=list)  # per token limit, what it left
    # unreserved (all it may produce, over what it reserved): QuotaGate's bound on a poisoned prediction


class QuotaPlans:
    """The checks each request is held to, kept per target until the tenants are read again or a period turns."""

    def __init__(self, tenants: Tenants, cost: CostFunction, timezone: str = "UTC", overdraw: float = 0.05):
        self.tenants, self.cost, self.tz, self.overdraw = tenants, cost, ZoneInfo(timezone), overdraw
        self._periods: dict[str, tuple[str, float | None, float | None]] = {}  # day|week|month|total → current
        self._templates: dict[tuple, list] = {}  # (target, limits, continuation, period) → its checks
        self._plans: dict[tuple, list] = {}  # (app, user, shared, key, request limits, continuation) → checks
        self._plans_version, self._plans_until = -1, math.inf

    def targets(self, app: str, user: str | None, shared: bool, key_id: int | None,
                request_limits: bool = True) -> list[tuple[str, str, Limits]]:
        """(scope, meter name, limits) for the app, the user and the key, where any limit is set; an app's and a
        user's request limit only with ``request_limits`` (FairServe's OIT applies them its own way)."""
        t = self.tenants
        out = []
        app_rpm = t.app_limit(app) if request_limits else None
        own = t.quotas.get("app:" + app)
        if own is not None or app_rpm:
            out.append(("app", "app:" + app, _with_rpm(own, app_rpm)))
        if user is not None:
            uk = user_key(app, user, shared)
            user_rpm = t.own_limit("user:" + uk) if request_limits else None
            own = t.quotas.get("user:" + uk)
            if own is not None or user_rpm:
                out.append(("user", "user:" + uk, _with_rpm(own, user_rpm)))
        if key_id is not None and (own := t.quotas.get(f"key:{key_id}")) is not None:
            out.append(("key", f"key:{key_id}", own))
        return out

    def plan(self, call: Call, shared_user: bool, request_limits: bool, continuation: bool,
             now: float) -> list:
        """[(check, what it measures, seed)] of every limit ``call`` is held to: kept per (app, user, key,
        continuation) until the tenants are read again or a budget's period turns, in a map of bounded size
        (a client may name a new user on every request)."""
        if self._plans_version != self.tenants.version or now >= self._plans_until or len(self._plans) >= 8192:
            self._plans, self._plans_version, self._plans_until = {}, self.tenants.version, math.inf
        key = (call.app, call.user, shared_user, call.key_id, request_limits, continuation)
        plan = self._plans.get(key)
        if plan is None:
            plan = []
            for _scope, name, lim in self.targets(call.app, call.user, shared_user, call.key_id, request_limits):
                plan += self._kept(name, lim, continuation, now)
                if lim.budget_tokens or lim.budget_usd:
                    turns = self._period(lim.budget_period, now)[2]
                    self._plans_until = min(self._plans_until, math.inf if turns is None else turns)
            self._plans[key] = plan
        return plan

    def checks(self, call: Call, plan: list, prompt: int, expected: int, most: int) -> Hold:
        """The request's checks and what it reserves on each."""
        checks, what, amounts, seeds = [], [], [], []
        price = self.tenants.prices.get(call.model or "")
        for c, measure, seed in plan:
            if seed is not None:
                seeds.append((len(checks), *seed))
            checks.append(c)
            what.append(measure)
            amounts.append(self.measure(measure, prompt, most if c.kind == BUDGET else expected, 0, price))
        return Hold(checks, what, amounts, call.model or "", seeds=seeds)

    def _kept(self, name: str, lim: Limits, continuation: bool, now: float) -> list:
        """[(check, what it measures, (target, period start, unit) for a budget)] of one target's limits."""
        periods = tuple(self._period(lim.budget_period, now)) if lim.budget_tokens or lim.budget_usd else ()
        key = (name, lim, continuation, periods)
        got = self._templates.get(key)
        if got is not None:
            return got
        scope, out = name.split(":", 1)[0], []
        if lim.rpm:
            out.append((Check("rpm:" + name, RATE, lim.rpm, 1, lim.rpm / 60.0, 120.0, f"{scope}_rpm"), "req", None))
        if lim.tpm:
            out.append((Check("tpm:" + name, RATE, lim.tpm, 0, lim.tpm / 60.0, 120.0, f"{scope}_tpm"),
                        lim.tpm_kind, None))
        if lim.concurrency:
            out.append((Check("conc:" + name, INFLIGHT, lim.concurrency, 1, 0.0, INFLIGHT_TTL_S,
                              f"{scope}_concurrency"), "conc", None))
        for unit, cap, measure in (("tokens", lim.budget_tokens, "total"), ("usd", lim.budget_usd, "usd")):
            if cap is None:
                continue
            name_p, start, turns = periods
            if continuation:  # an interaction's continuation: never cut in the middle
                cap = cap * (1 + self.overdraw)
            ttl = TOTAL_TTL_S if turns is None else turns - now + 86400.0
            meter = f"{unit}:{name}:{lim.budget_period}:{name_p}"
            out.append((Check(meter, BUDGET, cap * (NANO if unit == "usd" else 1.0), 0, 0.0, ttl,
                              f"{scope}_budget_{unit}", turns), measure, (name, start, unit)))
            # beside it, what the requests in flight hold of it (never refuses): a budget refused by that alone
            # is answered "retry soon", one whose spend is at its end "insufficient quota"
            out.append((Check(HELD + meter, BUDGET, UNCAPPED, 0, 0.0, ttl, f"{scope}_budget_{unit}", turns),
                        HELD + measure, None))
        if len(self._templates) >= 4096:  # (limits changed many times: start afresh)
            self._templates.clear()
        self._templates[key] = out
        return out

    def _period(self, kind: str, now: float) -> tuple[str, float | None, float | None]:
        """The calendar period ``now`` is in (its name, start and end), computed once per period."""
        got = self._periods.get(kind)
        if got is None or not (got[1] is None or got[1] <= now) or (got[2] is not None and now >= got[2]):
            name, turns = period(kind, now, self.tz)
            got = self._periods[kind] = (name, period_start(name, self.tz), turns)
        return got

    def measure(self, what: str, prompt: int, output: int, cached: int, price=None) -> float:
        if what[0] == "h":  # (a budget's held meter measures as its budget)
            what = what[len(HELD):]
        if what == "req" or what == "conc":
            return 1.0
        if what == "input":
            return float(prompt)
        if what == "output":
            return float(output)
        if what == "weighted":
            return float(self.cost.h(prompt, output))
        if what == "usd":
            if price is None:
                return 0.0
            return ((prompt - cached) * price[0] + cached * price[2] + output * price[1]) * 1e3  # nano-USD
        return float(prompt + output)


def _with_rpm(own: Limits | None, rpm: int | None) -> Limits:
    """An app's or user's limits with its request limit (kept on its own row)."""
    own = own or Limits()
    return Limits(rpm or None, own.tpm, own.tpm_kind, own.concurrency, own.budget_tokens, own.budget_usd,
                  own.budget_period)
