"""Limits and budgets at admission (docs/operations/limits.md): a request is held to its app's, its user's and
its key's limits — requests and tokens per minute, requests in flight — and budgets, in tokens and in money,
per calendar day, week or month or in total (policies/quota.py's meters; across replicas storage/shared_quota.py).

It reserves, after its prompt was counted and before it queues: one request; its prompt plus its predicted
output on token limits (``OutputLengths``: the mean for its app, stage and prompt length, the request's
``max_tokens`` capping it; 256 per choice until enough are seen); its prompt plus *all* it may produce on a
budget, so that concurrent requests never take a budget past its end. As its stream outgrows the prediction it
draws the rest from its token limits (``progress``, once per ``DRAW_STEP`` tokens), and when it ends it settles
every meter to what it streamed (``settle``): what a client sees billed is what it was sent, whatever its
``max_tokens``, ``n`` or a disconnect. A continuation of an interaction (stage > 0) may overdraw a budget by
``budget_overdraw`` of it, so that a budget does not cut an interaction in the middle.

Over a limit: 429 ``rate_limit_exceeded`` with ``retry-after`` (when the reservation fits again) and
``x-should-retry: true``; over a budget: 429 ``insufficient_quota`` (``x-should-retry: false``), as OpenAI
answers. OpenAI's rate-limit headers go on every response of a client with a limit, for its tightest request
limit and its tightest token limit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol
from zoneinfo import ZoneInfo

from fairgate.accounting.cost import CostFunction
from fairgate.accounting.length import OutputLengths
from fairgate.policies.quota import BUDGET, INFLIGHT, RATE, Check, Limits, QuotaBook, Refusal, headers
from fairgate.proxy.errors import APIError
from fairgate.proxy.pipeline.reservation import DEFAULT_OUTPUT_RESERVATION, Reservations, prompts_of
from fairgate.storage.identity import user_key

if TYPE_CHECKING:
    from fairgate.proxy.call import Call
    from fairgate.proxy.control.tenants import Tenants
    from fairgate.proxy.pipeline.validate import ParsedRequest

log = logging.getLogger("fairgate.quota")
DRAW_STEP = 64  # output tokens a stream runs past its reservation before it draws them
NANO = 1e9  # money is metered in nano-USD: a token at $0.15 per million is 150
TOTAL_TTL_S = 10 * 365 * 86400.0


class Store(Protocol):
    async def reserve(self, checks: list[Check], now: float) -> tuple[Refusal | None, list[float]]: ...

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None: ...


class MemoryQuotas:
    """One process's meters (no Redis)."""

    up, replicas = True, 1

    def __init__(self) -> None:
        self.local = QuotaBook()

    async def reserve(self, checks: list[Check], now: float) -> tuple[Refusal | None, list[float]]:
        return self.local.reserve(checks, now)

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None:
        self.local.apply(deltas, now)

    def pending(self) -> int:
        return 0


@dataclass(slots=True)
class Hold:
    """What a request reserved: each check with what it measures (``what``) and the amount it holds now."""

    checks: list[Check]
    what: list[str]  # "req" | "conc" | "total" | "input" | "output" | "weighted" | "usd"
    held: list[float]
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    drawing: bool = False  # a draw is on its way to the store
    settled: bool = False


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


class QuotaGate:
    def __init__(self, tenants: Tenants, store: Store, cost: CostFunction, lengths: OutputLengths,
                 timezone: str = "UTC", overdraw: float = 0.05, metrics=None):
        self.tenants, self.store, self.cost, self.lengths = tenants, store, cost, lengths
        self.tz, self.overdraw, self.metrics = ZoneInfo(timezone), overdraw, metrics
        self._tasks: set[asyncio.Task] = set()
        self.refused: dict[str, int] = {}
        self._last: dict[tuple, dict[str, str]] = {}  # a client's latest headers (for errors before admission)

    # -- what applies ---------------------------------------------------------------------------------------
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

    def _checks(self, call: Call, targets, prompt: int, expected: int, most: int, now: float) -> Hold:
        checks, what, price = [], [], self.tenants.prices.get(call.model or "")
        for scope, name, lim in targets:
            if lim.rpm:
                checks.append(Check("rpm:" + name, RATE, lim.rpm, 1, lim.rpm / 60.0, 120.0, f"{scope}_rpm"))
                what.append("req")
            if lim.tpm:
                amount = self._measure(lim.tpm_kind, prompt, expected, 0)
                checks.append(Check("tpm:" + name, RATE, lim.tpm, amount, lim.tpm / 60.0, 120.0, f"{scope}_tpm"))
                what.append(lim.tpm_kind)
            if lim.concurrency:
                checks.append(Check("conc:" + name, INFLIGHT, lim.concurrency, 1, 0.0, 3600.0,
                                    f"{scope}_concurrency"))
                what.append("conc")
            budgets = [("tokens", lim.budget_tokens, "total"), ("usd", lim.budget_usd, "usd")]
            for unit, cap, measure in budgets:
                if cap is None:
                    continue
                name_p, turns = period(lim.budget_period, now, self.tz)
                scale = NANO if unit == "usd" else 1.0
                if call.stage > 0:  # an interaction's continuation: never cut in the middle
                    cap = cap * (1 + self.overdraw)
                amount = self._measure(measure, prompt, most, 0, price)
                ttl = TOTAL_TTL_S if turns is None else turns - now + 86400.0
                checks.append(Check(f"{unit}:{name}:{lim.budget_period}:{name_p}", BUDGET, cap * scale, amount, 0.0,
                                    ttl, f"{scope}_budget_{unit}", turns))
                what.append(measure)
        return Hold(checks, what, [c.amount for c in checks], call.model or "")

    def _measure(self, what: str, prompt: int, output: int, cached: int, price=None) -> float:
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

    # -- admission ------------------------------------------------------------------------------------------
    async def admit(self, call: Call, parsed: ParsedRequest, shared_user: bool, request_limits: bool = True) -> None:
        """Reserve what ``call`` may use on every meter it is held to (``call.hold``), or refuse it: 429."""
        targets = self.targets(call.app, call.user, shared_user, call.key_id, request_limits)
        if not targets:
            return
        call.prompts = prompts_of(parsed.body)
        n = parsed.body.get("n") or 1
        call.n = (n if isinstance(n, int) else 1) * call.prompts
        prompt = call.tally.estimated_prompt
        most = Reservations.most(call, parsed)
        each = self.lengths.predict(call.app, call.stage, prompt // call.prompts, parsed.max_tokens,
                                    DEFAULT_OUTPUT_RESERVATION)
        expected = min(most, call.n * each)
        now = time.time()
        hold = self._checks(call, targets, prompt, expected, most, now)
        refusal, used = await self.store.reserve(hold.checks, now)
        if refusal is not None:
            raise self._refuse(call, hold, refusal, now)
        hold.headers = headers(hold.checks, used)
        self._last[(call.app, call.user, call.key_id)] = hold.headers
        call.hold = hold

    def _refuse(self, call: Call, hold: Hold, refusal: Refusal, now: float) -> APIError:
        c = refusal.check
        self.refused[c.reason] = self.refused.get(c.reason, 0) + 1
        if self.metrics is not None:
            self.metrics.limited.labels(c.reason).inc()
        # the refusing limit's headers, over the client's latest for the other kind
        hdrs = {**self._last.get((call.app, call.user, call.key_id), {}), **headers([c], [refusal.used])}
        scope = c.reason.split("_")[0]
        if refusal.quota:
            unit = "USD" if c.key.startswith("usd:") else "tokens"
            cap = c.cap / NANO if unit == "USD" else c.cap
            return APIError(429, f"You exceeded your current quota: this {scope}'s budget of {cap:g} {unit} per "
                                 f"{c.key.split(':')[-2] if c.retry_at is not None else 'all time'} is spent "
                                 "(`fairgate admin budget set`).", type="insufficient_quota",
                            code="insufficient_quota", headers={**hdrs, "x-should-retry": "false"})
        retry = max(1, math.ceil(refusal.retry_after_s(now)))
        what = {"rpm": "requests per minute", "tpm": "tokens per minute",
                "concurrency": "requests in flight"}[c.reason.split("_", 1)[1]]
        if c.amount > c.cap:
            retry_note = f"this request needs {c.amount:.0f}, more than the limit: it will never fit"
        else:
            retry_note = f"retry in {retry} s"
        return APIError(429, f"Rate limit reached: this {scope} is limited to {c.cap:.0f} {what} "
                             f"(`fairgate admin limit set`); {retry_note}", code="rate_limit_exceeded",
                        headers={**hdrs, "retry-after": str(retry), "x-should-retry": "true"})

    def last_headers(self, app: str, user: str | None, key_id: int | None) -> dict[str, str]:
        return self._last.get((app, user, key_id), {})

    # -- as it streams, and at its end --------------------------------------------------------------------------
    def progress(self, call: Call) -> None:
        """A stream's output so far: past its reservation by ``DRAW_STEP`` or more, it draws the rest from its
        token limits (a budget holds all the request may produce already)."""
        hold = call.hold
        if hold is None or hold.drawing or hold.settled:
            return
        t = call.tally
        deltas = []
        for i, (c, what) in enumerate(zip(hold.checks, hold.what)):
            if c.kind == RATE and what not in ("req", "input"):
                need = self._measure(what, t.prompt_tokens, t.completion_tokens, 0) - hold.held[i]
                if need >= DRAW_STEP:
                    deltas.append((i, need))
        if deltas:
            for i, need in deltas:
                hold.held[i] += need
            hold.drawing = True
            self._spawn(self._draw(hold, [(hold.checks[i], need) for i, need in deltas]))

    async def _draw(self, hold: Hold, deltas: list[tuple[Check, float]]) -> None:
        try:
            await self.store.apply(deltas, time.time())
        finally:
            hold.drawing = False

    def settle(self, call: Call) -> None:
        """Every meter to what the request used (its row's counts); its slot in flight given back."""
        hold = call.hold
        if hold is None or hold.settled:
            return
        hold.settled = True
        t = call.tally
        prompt = t.prompt_tokens if (t.usage_seen or call.dispatched_at) else 0
        price = self.tenants.prices.get(hold.model)
        deltas = []
        for i, (c, what) in enumerate(zip(hold.checks, hold.what)):
            if what == "req":
                continue
            used = 0.0 if what == "conc" else self._measure(what, prompt, t.completion_tokens, t.cached_tokens,
                                                            price)
            deltas.append((c, used - hold.held[i]))
        self._spawn(self.store.apply(deltas, time.time()))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a settlement of limits failed: %s", task.exception())

    async def drain(self) -> None:
        """Settlements still on their way (at shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _with_rpm(own: Limits | None, rpm: int | None) -> Limits:
    """An app's or user's limits with its request limit (kept on its own row)."""
    own = own or Limits()
    return Limits(rpm or None, own.tpm, own.tpm_kind, own.concurrency, own.budget_tokens, own.budget_usd,
                  own.budget_period)
