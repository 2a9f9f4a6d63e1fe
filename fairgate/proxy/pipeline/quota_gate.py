"""Limits and budgets at admission (docs/operations/limits.md): a request is held to its app's, its user's and
its key's limits — requests and tokens per minute, requests in flight — and budgets, in tokens and in money,
per calendar day, week or month or in total (accounting/quota.py's meters; across replicas storage/shared_quota.py).

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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from zoneinfo import ZoneInfo

from fairgate.accounting.cost import CostFunction
from fairgate.accounting.length import OutputLengths
from fairgate.accounting.quota import (BUDGET, INFLIGHT, RATE, Check, Limits, QuotaBook, Refusal, headers,
                                      period, period_start)
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
MAX_INTERACTIONS = 100_000  # interactions remembered as admitted (their continuations may overdraw a budget)
FULL_S = 5.0  # the longest a meter seen full refuses before the prompt is counted (pipeline/quota_gate.py)


class Store(Protocol):
    synchronous: bool  # its ``local`` book is the whole truth: the gate reserves and settles there directly
    async def reserve(self, checks: list[Check], now: float,
                      amounts: list[float] | None = None) -> tuple[Refusal | None, list[float]]: ...

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None: ...

    async def seed(self, check: Check, amount: float, now: float) -> None: ...


class MemoryQuotas:
    """One process's meters (no Redis): the gate calls its book directly, with no task or await."""

    up, replicas, synchronous = True, 1, True

    def __init__(self) -> None:
        self.local = QuotaBook()

    async def reserve(self, checks: list[Check], now: float,
                      amounts: list[float] | None = None) -> tuple[Refusal | None, list[float]]:
        return self.local.reserve(checks, now, amounts)

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None:
        self.local.apply(deltas, now)

    async def seed(self, check: Check, amount: float, now: float) -> None:
        self.local.seed(check, amount, now)

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
    seeds: list[tuple[int, str, float | None, str]] = field(default_factory=list)  # budgets: (check, target,
    # period start, unit), each meter started from the usage log once per process
    drawing: bool = False  # a draw is on its way to the store
    settled: bool = False


class QuotaGate:
    def __init__(self, tenants: Tenants, store: Store, cost: CostFunction, lengths: OutputLengths,
                 timezone: str = "UTC", overdraw: float = 0.05, metrics=None, spent=None):
        self.tenants, self.store, self.cost, self.lengths = tenants, store, cost, lengths
        self.spent = spent  # async (target, period start, unit, prices) → its spend by the usage log
        self._seeded: dict[str, asyncio.Future] = {}  # budget meter → its seeding (once per process)
        self._periods: dict[str, tuple[str, float | None, float | None]] = {}  # day|week|month|total → current
        self._templates: dict[tuple, list] = {}  # (target, limits, continuation, period) → its checks
        self._plans: dict[tuple, list] = {}  # (app, user, shared, key, request limits, continuation) → checks
        self._plans_version, self._plans_until = -1, math.inf
        self._interactions: OrderedDict[tuple, None] = OrderedDict()  # (app, user, interaction) admitted, newest last
        self._seed_after: dict[str, float] = {}  # budget meter → when to read the usage log again after a failure
        self.tz, self.overdraw, self.metrics = ZoneInfo(timezone), overdraw, metrics
        self._tasks: set[asyncio.Task] = set()
        self.refused: dict[str, int] = {}
        # each key's latest headers (for errors before admission): by key, which an admin creates — never by a
        # user name, which a client may make up on every request
        self._last: dict[int | None, dict[str, str]] = {}
        # meter → (refused before counting until, it has room again at, its refusal, reason)
        self._full: dict[str, tuple[float, float, APIError, str]] = {}

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

    def _plan(self, call: Call, shared_user: bool, request_limits: bool, now: float) -> list:
        """[(check, what it measures, seed)] of every limit ``call`` is held to: kept per (app, user, key,
        continuation) until the tenants are read again or a budget's period turns, in a map of bounded size
        (a client may name a new user on every request)."""
        if self._plans_version != self.tenants.version or now >= self._plans_until or len(self._plans) >= 8192:
            self._plans, self._plans_version, self._plans_until = {}, self.tenants.version, math.inf
        continuation = self._continues(call)
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

    def _continues(self, call: Call) -> bool:
        """A later stage of an interaction this gate admitted a call of (the stage a client names alone buys
        nothing: a made-up one would overdraw every budget)."""
        return call.stage > 0 and (call.app, call.user, call.interaction) in self._interactions

    def _admitted(self, call: Call) -> None:
        if call.interaction:
            key = (call.app, call.user, call.interaction)
            self._interactions[key] = None
            self._interactions.move_to_end(key)
            if len(self._interactions) > MAX_INTERACTIONS:
                self._interactions.popitem(last=False)

    def _checks(self, call: Call, plan: list, prompt: int, expected: int, most: int) -> Hold:
        """The request's checks and what it reserves on each."""
        checks, what, amounts, seeds = [], [], [], []
        price = self.tenants.prices.get(call.model or "")
        for c, measure, seed in plan:
            if seed is not None:
                seeds.append((len(checks), *seed))
            checks.append(c)
            what.append(measure)
            amounts.append(self._measure(measure, prompt, most if c.kind == BUDGET else expected, 0, price))
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
            out.append((Check("conc:" + name, INFLIGHT, lim.concurrency, 1, 0.0, 3600.0, f"{scope}_concurrency"),
                        "conc", None))
        for unit, cap, measure in (("tokens", lim.budget_tokens, "total"), ("usd", lim.budget_usd, "usd")):
            if cap is None:
                continue
            name_p, start, turns = periods
            if continuation:  # an interaction's continuation: never cut in the middle
                cap = cap * (1 + self.overdraw)
            ttl = TOTAL_TTL_S if turns is None else turns - now + 86400.0
            out.append((Check(f"{unit}:{name}:{lim.budget_period}:{name_p}", BUDGET,
                              cap * (NANO if unit == "usd" else 1.0), 0, 0.0, ttl, f"{scope}_budget_{unit}", turns),
                        measure, (name, start, unit)))
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
        now = time.time()
        plan = self._plan(call, shared_user, request_limits, now)
        if not plan:
            return
        call.prompts = prompts_of(parsed.body)
        n = parsed.body.get("n") or 1
        call.n = (n if isinstance(n, int) else 1) * call.prompts
        prompt = call.tally.estimated_prompt
        most = Reservations.most(call, parsed)
        each = self.lengths.predict(call.app, call.stage, prompt // call.prompts, parsed.max_tokens,
                                    DEFAULT_OUTPUT_RESERVATION)
        expected = min(most, call.n * each)
        hold = self._checks(call, plan, prompt, expected, most)
        for i, target, start, unit in hold.seeds:
            if hold.checks[i].key not in self._seeded or not self._seeded[hold.checks[i].key].done():
                await self._seed(hold.checks[i], target, start, unit)
        if self.store.synchronous:  # (one process: no await, nothing to cancel)
            refusal, used = self.store.local.reserve(hold.checks, now, hold.held)
        else:
            reserving = asyncio.ensure_future(self.store.reserve(hold.checks, now, list(hold.held)))
            try:
                refusal, used = await asyncio.shield(reserving)
            except asyncio.CancelledError:  # the client left while Redis answered: what it reserved goes back
                reserving.add_done_callback(lambda done: self._orphaned(done, hold))
                raise
        if refusal is not None:
            error = self._refuse(call, hold, refusal, now)
            self._note_full(refusal, error, now)
            raise error
        hold.headers = headers(hold.checks, used)
        self._admitted(call)
        self._last[call.key_id] = hold.headers
        call.hold = hold

    def precheck(self, call: Call, shared_user: bool, request_limits: bool = True) -> None:
        """Before its prompt is counted: a request held to a meter that was full a moment ago (nothing fits it
        until then) is refused at once, so a client looping past its limit costs no tokenizing. O(its meters)."""
        if not self._full:
            return
        now = time.time()
        for _scope, name, _lim in self.targets(call.app, call.user, shared_user, call.key_id, request_limits):
            for kind in ("rpm:", "tpm:") if self._continues(call) else ("rpm:", "tpm:", "tokens:", "usd:"):
                got = self._full.get(kind + name)
                if got is not None and got[0] > now:
                    _, retry_at, e, reason = got
                    self.refused[reason] = self.refused.get(reason, 0) + 1
                    if self.metrics is not None:
                        self.metrics.limited.labels(reason).inc()
                    headers = dict(e.headers)
                    if "retry-after" in headers:  # (as it stands now)
                        headers["retry-after"] = str(max(1, math.ceil(retry_at - now)))
                    raise APIError(e.status, e.message, code=e.code, type=e.type, headers=headers)

    async def _seed(self, check: Check, target: str, start: float | None, unit: str) -> None:
        """A budget's meter, the first time this process meets it, raised to what the usage log says was spent in
        its period (a restart, or a Redis that lost its keys, forgets nothing the rows hold). Concurrent first
        requests wait for the same read."""
        if self.spent is None or time.monotonic() < self._seed_after.get(check.key, 0.0):
            return
        got = self._seeded.get(check.key)
        if got is None:
            got = self._seeded[check.key] = asyncio.ensure_future(self._read_and_seed(check, target, start, unit))
        await asyncio.shield(got)

    async def _read_and_seed(self, check: Check, target: str, start: float | None, unit: str) -> None:
        try:
            amount = await self.spent(target, start, unit, self.tenants.prices)
        except Exception as e:  # noqa: BLE001 — the database away: enforce from the meters alone, say so
            log.warning("budget %s: could not read its spend from the usage log (%s); counting from the meters",
                        target, e)
            self._seeded.pop(check.key, None)
            self._seed_after[check.key] = time.monotonic() + 10.0  # (not every request waits on the database)
            return
        if amount > 0:
            await self.store.seed(check, amount, time.time())

    def _note_full(self, refusal: Refusal, error: APIError, now: float) -> None:
        """A meter nothing can fit for a while (a request limit, a token limit in debt, a spent budget) refuses
        without a look at Redis until then, for at most ``FULL_S`` (an admin may raise it meanwhile)."""
        c, used = refusal.check, refusal.used
        if c.kind == RATE and c.key.startswith("rpm:"):
            wait = refusal.retry_after_s(now)
        elif c.kind == RATE:
            wait = (used - c.cap) / c.rate if c.rate else 0.0
        elif c.kind == BUDGET and used >= c.cap:
            wait = refusal.retry_after_s(now)
        else:
            return
        if wait > 0:
            meter = c.key.rsplit(":", 2)[0] if c.kind == BUDGET else c.key
            self._full[meter] = (now + min(wait, FULL_S), now + wait, error, c.reason)

    def _refuse(self, call: Call, hold: Hold, refusal: Refusal, now: float) -> APIError:
        c = refusal.check
        self.refused[c.reason] = self.refused.get(c.reason, 0) + 1
        if self.metrics is not None:
            self.metrics.limited.labels(c.reason).inc()
        # the refusing limit's headers, over the client's latest for the other kind
        hdrs = {**self._last.get(call.key_id, {}), **headers([c], [refusal.used])}
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
        never = refusal.amount > c.cap
        retry_note = (f"this request needs {refusal.amount:.0f}, more than the limit: it will never fit" if never
                      else f"retry in {retry} s")
        return APIError(429, f"Rate limit reached: this {scope} is limited to {c.cap:.0f} {what} "
                             f"(`fairgate admin limit set`); {retry_note}", code="rate_limit_exceeded",
                        headers={**hdrs, "retry-after": str(retry), "x-should-retry": "false" if never else "true"})

    def _orphaned(self, done: asyncio.Future, hold: Hold) -> None:
        if done.cancelled() or done.exception() is not None or done.result()[0] is not None:
            return
        self._spawn(self.store.apply([(c, -held) for c, what, held in zip(hold.checks, hold.what, hold.held)
                                      if what != "req"], time.time()))

    def last_headers(self, key_id: int | None) -> dict[str, str]:
        return self._last.get(key_id, {})

    # -- as it streams, and at its end --------------------------------------------------------------------------
    def progress(self, call: Call) -> None:
        """A stream's output so far: past its reservation by ``DRAW_STEP`` or more, it draws the rest from its
        token limits, and from its budgets if it outgrew all it was thought to be able to produce (no
        max_tokens, a model whose context is unknown)."""
        hold = call.hold
        if hold is None or hold.drawing or hold.settled:
            return
        t = call.tally
        deltas, price = [], None
        for i, (c, what) in enumerate(zip(hold.checks, hold.what)):
            if c.kind != INFLIGHT and what not in ("req", "input"):  # (a budget holds all the request may
                if what == "usd" and price is None:  # produce: it draws only past that, when that was unknown)
                    price = self.tenants.prices.get(hold.model)
                need = self._measure(what, t.prompt_tokens, t.completion_tokens, 0, price) - hold.held[i]
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
        if self.store.synchronous:
            self.store.local.apply(deltas, time.time())
        else:
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
