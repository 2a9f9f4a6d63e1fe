"""Limits and budgets at admission (docs/operations/limits.md): a request is held to its app's, its user's and
its key's limits — requests and tokens per minute, requests in flight — and budgets, in tokens and in money,
per calendar day, week or month or in total (quota/meters.py's meters; across replicas quota/redis_store.py).

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
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from fairgate.accounting.cost import CostFunction
from fairgate.accounting.length import OutputLengths
from fairgate.proxy.errors import APIError
from fairgate.proxy.pipeline.reservation import DEFAULT_OUTPUT_RESERVATION, Reservations
from fairgate.quota.meters import BUDGET, INFLIGHT, RATE, Check, Refusal, headers
from fairgate.quota.plans import NANO, Hold, QuotaPlans
from fairgate.quota.stores import Store

if TYPE_CHECKING:
    from fairgate.proxy.call import Call
    from fairgate.proxy.control.tenants import Tenants
    from fairgate.proxy.pipeline.validate import ParsedRequest

log = logging.getLogger("fairgate.quota")
DRAW_STEP = 64  # output tokens a stream runs past its reservation before it draws them
MAX_INTERACTIONS = 100_000  # interactions remembered as admitted (their continuations may overdraw a budget)
MAX_SEEDED = 16_384  # budget meters remembered as seeded (a seed raises a meter: one read again is harmless)
FULL_S = 5.0  # the longest a meter seen full refuses before the prompt is counted (pipeline/quota_gate.py)
SCALE_KEEP = 0.99  # a prompt scale's excess over 1 kept per request counted below it (~100 requests to fade)
MAX_SCALE = 4.0  # the most a backend may report over the gateway's count (Tally's prompt cap)
# of a token limit, the most its requests in flight may leave unreserved (all they may produce over what was
# predicted): a request past it reserves more than its prediction, so a predictor an app taught short answers
# buys a burst of at most this over the limit (docs/operations/limits.md)
UNRESERVED = 0.5


class QuotaGate:
    def __init__(self, tenants: Tenants, store: Store, cost: CostFunction, lengths: OutputLengths,
                 timezone: str = "UTC", overdraw: float = 0.05, metrics=None, spent=None):
        self.tenants, self.store, self.cost, self.lengths = tenants, store, cost, lengths
        self.spent = spent  # async (target, period start, unit, prices) → its spend by the usage log
        self._seeded: dict[str, asyncio.Future] = {}  # budget meter → its seeding (once per process)
        self._interactions: OrderedDict[tuple, None] = OrderedDict()  # (app, user, interaction) admitted, newest last
        self._seed_after: dict[str, float] = {}  # budget meter → when to read the usage log again after a failure
        self.plans = QuotaPlans(tenants, cost, timezone, overdraw)  # which checks a request is held to
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self.refused: dict[str, int] = {}
        # each key's latest headers (for errors before admission): by key, which an admin creates — never by a
        # user name, which a client may make up on every request
        self._last: dict[int | None, dict[str, str]] = {}
        # meter → (refused before counting until, it has room again at, its refusal, reason)
        self._full: dict[str, tuple[float, float, APIError, str]] = {}
        self._unreserved: dict[str, float] = {}  # token limit → what this replica's requests in flight left
        # unreserved on it (``_bounded``): one entry per limit with a request in flight
        self.prompt_scale: dict[tuple[str, str], float] = {}  # (app, model) → the backend's prompt count over the
        # gateway's, at its highest lately: reservations cover a prompt the model's tokenizer and template count
        # higher than the gateway's count (never below 1: a count above the backend's is what is reserved)

    # -- what applies ---------------------------------------------------------------------------------------
    def _continues(self, call: Call) -> bool:
        """A later stage of an interaction this gate admitted a call of (the stage a client names alone buys
        nothing: a made-up one would overdraw every budget)."""
        return call.stage > 0 and (call.app, call.user, call.interaction) in self._interactions

    def _admitted(self, call: Call) -> None:
        if call.interaction and call.continuable:  # (one the client named: a request's own never continues)
            key = (call.app, call.user, call.interaction)
            self._interactions[key] = None
            self._interactions.move_to_end(key)
            if len(self._interactions) > MAX_INTERACTIONS:
                self._interactions.popitem(last=False)

    # -- admission ------------------------------------------------------------------------------------------
    async def admit(self, call: Call, parsed: ParsedRequest, shared_user: bool, request_limits: bool = True,
                    requests_only: bool = False) -> None:
        """Reserve what ``call`` may use on every meter it is held to (``call.hold``), or refuse it: 429.
        ``requests_only``: its limits on requests (per minute, in flight) alone, for a request that is not served
        tokens (a tokenization, a count)."""
        now = time.time()
        plan = self.plans.plan(call, shared_user, request_limits, self._continues(call), now)
        if requests_only:
            plan = [entry for entry in plan if entry[1] in ("req", "conc")]
        if not plan:
            return
        call.prompts = parsed.prompts
        n = parsed.body.get("n") or 1
        call.n = (n if isinstance(n, int) else 1) * call.prompts
        prompt = call.tally.estimated_prompt
        if (scale := self.prompt_scale.get((call.app, call.model))) is not None:
            prompt = math.ceil(prompt * scale)
        most = Reservations.most(call, parsed)
        each = self.lengths.predict(call.app, call.stage, prompt // call.prompts, parsed.max_tokens,
                                    DEFAULT_OUTPUT_RESERVATION)
        expected, unreserved = self._bounded(plan, prompt, min(most, call.n * each), most)
        hold = self.plans.checks(call, plan, prompt, expected, most)
        self._leave_unreserved(unreserved, 1.0)  # (at once: the admissions that overtake it while it waits
        try:  # for Redis see it)
            for again in (False, True):
                for i, target, start, unit in hold.seeds:
                    if hold.checks[i].key not in self._seeded or not self._seeded[hold.checks[i].key].done():
                        await self._seed(hold.checks[i], target, start, unit)
                        now = time.time()  # (after the wait: a rate meter's clock never goes back)
                if self.store.synchronous:  # (one process: no await, nothing to cancel)
                    refusal, used = self.store.local.reserve(hold.checks, now, hold.held)
                    break
                reserving = asyncio.ensure_future(self.store.reserve(hold.checks, now, list(hold.held)))
                try:
                    refusal, used = await asyncio.shield(reserving)
                except asyncio.CancelledError:  # the client left while Redis answered: what it reserved goes back
                    reserving.add_done_callback(lambda done: self._orphaned(done, hold))
                    raise
                if refusal is not None or again or not self._forgotten(hold):
                    break
                # a budget Redis lost: what this reserved goes back, and it reserves again once the budget's
                # meter holds its spend by the usage log
                self._spawn(self.store.apply([(c, -held) for c, held in zip(hold.checks, hold.held)], time.time()))
            if refusal is not None:
                if refusal.quota:  # (its spend: less what the requests in flight hold of it)
                    k = hold.checks.index(refusal.check)
                    held = used[k + 1] if k + 1 < len(used) and hold.what[k + 1][0] == "h" else 0.0
                    refusal = dataclasses.replace(refusal, used=max(0.0, refusal.used - held))
                error = self._refuse(call, hold, refusal, now)
                self._note_full(refusal, error, now)
                raise error
        except BaseException:
            self._leave_unreserved(unreserved, -1.0)
            raise
        hold.headers = headers(hold.checks, used)
        hold.unreserved = unreserved
        self._admitted(call)
        self._last[call.key_id] = hold.headers
        call.hold = hold

    def _bounded(self, plan: list, prompt: int, expected: int, most: int) -> tuple[int, list[tuple[str, float]]]:
        """The output a request reserves on its token limits: ``expected`` (predicted), raised where the
        requests in flight would otherwise leave more than ``UNRESERVED`` of a limit (this replica's share of it)
        unreserved — never past what the limit holds, nor past ``most``; and, per limit, what it leaves
        unreserved. O(its token limits)."""
        gaps = []
        for c, what, _seed in plan:
            if c.kind != RATE or what in ("req", "input") or expected >= most:
                continue
            top = self.plans.measure(what, prompt, most, 0)
            slope = top - self.plans.measure(what, prompt, most - 1, 0)  # (its last token's: the steepest of a
            # cost convex in the output, so that stepping back room / slope leaves at most room unreserved)
            room = UNRESERVED * c.cap / max(1, self.store.replicas) - self._unreserved.get(c.key, 0.0)
            if top - self.plans.measure(what, prompt, expected, 0) > room and slope > 0:
                fits = (c.cap - self.plans.measure(what, prompt, 0, 0)) / slope  # (all the limit may ever hold)
                expected = max(expected, min(most, math.ceil(most - max(0.0, room) / slope), math.floor(fits)))
            gaps.append((c.key, what, top))
        return expected, [(key, top - self.plans.measure(what, prompt, expected, 0)) for key, what, top in gaps]

    def _leave_unreserved(self, gaps: list[tuple[str, float]], sign: float) -> None:
        """Add (``sign`` 1) or take back (-1) what a request leaves unreserved on each token limit."""
        for key, gap in gaps:
            left = self._unreserved.get(key, 0.0) + sign * gap
            if left > 1e-6:
                self._unreserved[key] = left
            else:
                self._unreserved.pop(key, None)

    def precheck(self, call: Call, shared_user: bool, request_limits: bool = True, continues: bool = False) -> None:
        """Before its prompt is counted (or its conversation read): a request held to a meter that was full a
        moment ago (nothing fits it until then) is refused at once, so a client looping past its limit costs no
        tokenizing. A request that ``continues`` an interaction, or one this gate knows, is held to its rate
        limits alone (a budget lets an interaction finish). O(its meters)."""
        if not self._full:
            return
        now = time.time()
        continues = continues or self._continues(call)
        for _scope, name, _lim in self.plans.targets(call.app, call.user, shared_user, call.key_id, request_limits):
            for kind in ("rpm:", "tpm:") if continues else ("rpm:", "tpm:", "tokens:", "usd:"):
                got = self._full.get(kind + name)
                if got is not None and got[0] > now:
                    _, retry_at, e, reason = got
                    call.limit = reason
                    self.refused[reason] = self.refused.get(reason, 0) + 1
                    if self.metrics is not None:
                        self.metrics.limited.labels(reason).inc()
                    headers = dict(e.headers)
                    if "retry-after" in headers:  # (as it stands now)
                        headers["retry-after"] = str(max(1, math.ceil(retry_at - now)))
                    raise APIError(e.status, e.message, code=e.code, type=e.type, headers=headers)

    def _forgotten(self, hold: Hold) -> bool:
        """Whether the store lost one of ``hold``'s budget meters since it was seeded (Redis restarted without
        persistence, was flushed, or failed over to a replica behind): each is then read from the usage log again
        (``_seed``) before the request reserves again. O(its budgets)."""
        if not self.store.lost or self.spent is None:
            return False
        lost = [hold.checks[i].key for i, *_ in hold.seeds if hold.checks[i].key in self.store.lost
                and time.monotonic() >= self._seed_after.get(hold.checks[i].key, 0.0)]
        for key in lost:
            if (got := self._seeded.get(key)) is not None and got.done():
                del self._seeded[key]
                log.warning("budget meter %s: lost by Redis; reading its spend from the usage log again", key)
        return bool(lost)

    async def _seed(self, check: Check, target: str, start: float | None, unit: str) -> None:
        """A budget's meter, the first time this process meets it and again once the store lost it, raised to
        what the usage log says was spent in its period (a restart, or a Redis that lost its keys, forgets
        nothing the rows hold). Concurrent requests wait for the same read."""
        if self.spent is None or time.monotonic() < self._seed_after.get(check.key, 0.0):
            return
        got = self._seeded.get(check.key)
        if got is None:
            if len(self._seeded) >= MAX_SEEDED:  # (past periods' meters: one met again is read again, harmlessly)
                self._seeded = {k: f for k, f in self._seeded.items() if not f.done()}
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
        # (even at 0, so the meter is marked seeded; one Redis lost gets back the spend it had when last seen)
        if await self.store.seed(check, amount, time.time(), self.store.lost.get(check.key, 0.0)):
            self.store.lost.pop(check.key, None)
        else:  # Redis away, or its answer lost: seeded again by the next request that meets it
            self._seeded.pop(check.key, None)
            self._seed_after[check.key] = time.monotonic() + 1.0

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
        call.limit = c.reason
        self.refused[c.reason] = self.refused.get(c.reason, 0) + 1
        if self.metrics is not None:
            self.metrics.limited.labels(c.reason).inc()
        # the refusing limit's headers, over the client's latest for the other kind
        hdrs = {**self._last.get(call.key_id, {}), **headers([c], [refusal.used])}
        scope = c.reason.split("_")[0]
        if refusal.quota:  # (``used``: its spend, without what the requests in flight hold)
            unit = "USD" if c.key.startswith("usd:") else "tokens"
            cap = c.cap / NANO if unit == "USD" else c.cap
            per = c.key.split(':')[-2] if c.retry_at is not None else 'all time'
            if refusal.used + refusal.amount <= (c.cap if refusal.cap is None else refusal.cap):
                # the spend leaves room for it: what the requests in flight reserved does not, until they end
                return APIError(429, f"Rate limit reached: this {scope}'s budget of {cap:g} {unit} per {per} is "
                                     "held by its requests in flight until they end; retry in 1 s",
                                code="rate_limit_exceeded",
                                headers={**hdrs, "retry-after": "1", "x-should-retry": "true"})
            return APIError(429, f"You exceeded your current quota: this {scope}'s budget of {cap:g} {unit} per "
                                 f"{per} is spent, or has less left than this request may use "
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
                need = self.plans.measure(what, t.prompt_tokens, t.completion_tokens, 0, price) - hold.held[i]
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

    def _learn_scale(self, call: Call) -> None:
        """The backend's count of a prompt over the gateway's: the scale its app's next requests on that model
        reserve at, at the highest seen lately (it rises at once, and fades back over ~100 requests)."""
        t = call.tally
        if not (t.usage_seen and t.estimated_prompt > 0 and call.model):
            return
        key = (call.app, call.model)
        was = self.prompt_scale.get(key, 1.0)
        scale = max(min(t.prompt_tokens / t.estimated_prompt, MAX_SCALE), 1.0 + (was - 1.0) * SCALE_KEEP)
        if scale <= 1.0 and key not in self.prompt_scale:
            return
        if len(self.prompt_scale) >= 65_536:  # (apps and models are an admin's: bounded anyway)
            self.prompt_scale.clear()
        self.prompt_scale[key] = scale

    def settle(self, call: Call) -> None:
        """Every meter to what the request used (its row's counts); its slot in flight given back."""
        hold = call.hold
        if hold is None or hold.settled:
            return
        self._learn_scale(call)
        hold.settled = True
        self._leave_unreserved(hold.unreserved, -1.0)
        t = call.tally
        prompt = t.prompt_tokens if (t.usage_seen or call.ran) else 0
        price = self.tenants.prices.get(hold.model)
        deltas = []
        for i, (c, what) in enumerate(zip(hold.checks, hold.what)):
            if what == "req":
                continue
            used = 0.0 if what == "conc" or what[0] == "h" else self.plans.measure(
                what, prompt, t.completion_tokens, t.cached_tokens, price)
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
            self.store.kick()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


