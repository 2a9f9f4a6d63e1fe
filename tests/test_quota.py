"""Limits and budgets as meters (quota/meters.py), and across replicas in Redis (quota/redis_store.py):
served tokens per minute hold at the limit in every minute after the first, with four replicas racing —
where a per-replica limiter serves ~4× and a check-then-charge-after one overshoots."""

from __future__ import annotations

import asyncio
import heapq
import random
import time
import uuid
from zoneinfo import ZoneInfo

import pytest

from fairgate.quota.meters import BUDGET, INFLIGHT, RATE, Check, QuotaBook, headers, period, reset_text
from fairgate.quota.plans import HELD, UNCAPPED
from fairgate.quota.redis_store import SharedQuotas
from fairgate.quota.stores import MemoryQuotas
from fairgate.storage.redis_client import redis_client

REDIS = "redis://127.0.0.1:6379/0"
TPM = 20_000


def tpm(amount: float, key: str = "tpm:app:chat") -> Check:
    return Check(key, RATE, TPM, amount, TPM / 60.0, 120.0, "app_tpm")


def test_a_rate_meter_drains_at_its_limit_and_refuses_all_or_nothing():
    book = QuotaBook()
    assert book.reserve([tpm(15_000)], 0.0)[0] is None
    refusal, _ = book.reserve([tpm(6_000)], 0.0)
    assert refusal is not None and refusal.retry_after_s(0.0) == pytest.approx(1_000 / (TPM / 60))  # 3 s
    assert book.reserve([tpm(6_000)], 3.0)[0] is None  # 1,000 drained in 3 s
    # all or nothing: a second meter that refuses leaves the first as it was
    rpm = Check("rpm:app:chat", RATE, 1, 1, 1 / 60.0, 120.0, "app_rpm")
    assert book.reserve([rpm], 3.0)[0] is None
    key = tpm(10, "tpm:key:1")
    refusal, _ = book.reserve([key, rpm], 3.0)
    assert refusal.check is rpm and book.used("tpm:key:1", TPM / 60.0, 3.0) == 0
    # a forced draw may go past the cap (a stream that outgrew its reservation); the debt is paid by waiting
    book.apply([(tpm(0), 30_000)], 3.0)
    assert book.reserve([tpm(1)], 60.0)[0] is not None


def test_budgets_and_in_flight_never_drain():
    book = QuotaBook()
    budget = Check("tokens:app:chat:month:2026-11-01", BUDGET, 1_000, 600, 0.0, 1e6, "app_budget_tokens", 100.0)
    assert book.reserve([budget], 0.0)[0] is None
    refusal, _ = book.reserve([budget], 50.0)
    assert refusal.quota and refusal.retry_after_s(40.0) == 60.0
    book.apply([(budget, -500)], 1e5)  # settled: it used 100 of its 600
    assert book.reserve([budget], 1e5)[0] is None
    conc = Check("conc:app:chat", INFLIGHT, 2, 1, 0.0, 3600.0, "app_concurrency")
    assert [book.reserve([conc], 0.0)[0] is None for _ in range(3)] == [True, True, False]
    book.apply([(conc, -1)], 1.0)
    assert book.reserve([conc], 1.0)[0] is None


def test_openai_header_formats_and_the_tightest_limit():
    assert [reset_text(x) for x in (0.02, 1.0, 1.2, 360.0, 3723.0)] == ["20ms", "1s", "2s", "6m0s", "1h2m3s"]
    app, user = tpm(0), tpm(0, "tpm:user:chat/ann")
    user = Check(user.key, RATE, 1_000, 0, 1_000 / 60.0, 120.0, "user_tpm")
    h = headers([app, user], [10_000.0, 900.0])  # the user has 10 % left, the app 50 %
    assert h == {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "100",
                 "x-ratelimit-reset-tokens": "54s"}


def test_budget_periods_are_calendar_periods_in_the_zone():
    paris = ZoneInfo("Europe/Paris")
    t = 1_793_000_000.0  # 2026-10-26T09:33:20Z, a Monday, the day after Paris left summer time
    assert period("day", t, paris)[0] == "2026-10-26"
    name, turns = period("month", t, paris)
    assert name == "2026-10-01" and turns == 1_793_487_600.0  # 2026-11-01T00:00+01:00
    assert period("week", t + 6 * 86400, paris)[0] == "2026-10-26"
    assert period("total", t, paris) == ("total", None)


async def _served_per_minute(stores, minutes: int = 5, clients: int = 200, seed: int = 1,
                             charge_after: bool = False) -> list[float]:
    """``clients`` streaming clients spread over ``stores`` (one per replica), in simulated time (events in
    time order): each asks, reserves its prompt and predicted output, streams a true output drawn around that
    prediction over a few seconds, settles at its end, and asks again; a refused one retries when told. Served
    tokens per minute, by when they streamed. ``charge_after``: a limiter that only checks before and charges
    what was used at the end (no reservation)."""
    rng = random.Random(seed)
    served = [0.0] * minutes
    events = [(rng.uniform(0, 2), i, "ask", None) for i in range(clients)]
    heapq.heapify(events)
    while events:
        t, i, what, arg = heapq.heappop(events)
        if t >= minutes * 60:
            continue
        store = stores[i % len(stores)]
        if what == "end":
            ask, used = arg
            await store.apply([(ask, used - ask.amount)], t)
            heapq.heappush(events, (t, i, "ask", None))
            continue
        prompt, predicted = rng.randint(50, 400), 150
        out = max(1, int(rng.expovariate(1 / predicted)))
        ask = tpm(0 if charge_after else prompt + predicted)
        refusal, _ = await store.reserve([ask], t)
        if refusal is not None:
            wait = 0.5 if charge_after else refusal.retry_after_s(t)
            heapq.heappush(events, (t + max(0.01, min(wait, 5.0)), i, "ask", None))
            continue
        duration = out * 0.02
        if t < minutes * 60:
            served[int(t // 60)] += prompt
        k = int(t // 60)
        while k < minutes and k * 60 < t + duration:  # its output, minute by minute as it streamed
            lo, hi = max(t, k * 60), min(t + duration, (k + 1) * 60)
            served[k] += (hi - lo) / duration * out
            k += 1
        heapq.heappush(events, (t + duration, i, "end", (ask, prompt + out)))
    return served


def _holds(served: list[float]) -> bool:
    return all(abs(s - TPM) <= 0.05 * TPM for s in served[1:])


async def test_four_replicas_hold_a_token_limit_in_every_minute_where_wrong_limiters_do_not():
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        shared = [SharedQuotas(r, tag, f"replica-{i}") for i in range(4)]
        served = await _served_per_minute(shared, minutes=3)  # (the two minutes after the first)
        assert _holds(served), served
        per_replica = await _served_per_minute([MemoryQuotas() for _ in range(4)], minutes=3)
        assert not _holds(per_replica) and min(per_replica[1:]) > 3 * TPM  # each replica its own: ~4×
        one = MemoryQuotas()
        after = await _served_per_minute([one], minutes=3, charge_after=True)
        assert not _holds(after) and after[0] > 1.3 * TPM  # checked before, charged after: overshoot (then a debt)
    finally:
        await r.aclose()


async def test_a_user_limit_inside_an_app_limit_holds_too():
    """Ann (a user limit of 5,000) and Bob (none) share an app limit of 20,000: neither limit is exceeded, and
    the app's is used in full."""
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        shared = [SharedQuotas(r, tag, f"replica-{i}") for i in range(4)]
        served = {"ann": 0.0, "all": 0.0}
        user_cap, ann_at_60 = 5_000, None
        events = [(i * 0.01, i) for i in range(80)]  # odd clients are ann's, even ones bob's
        while events:
            t, i = heapq.heappop(events)
            if t >= 180:
                continue
            if t >= 60 and ann_at_60 is None:  # what ann's meter held when the count began
                u, at = await r.hmget(f"{tag}:q:tpm:user:chat/ann", "u", "t")
                ann_at_60 = max(0.0, float(u) - user_cap / 60.0 * (60 - int(at) / 1000))
            checks = [tpm(300)] + ([Check("tpm:user:chat/ann", RATE, user_cap, 300, user_cap / 60.0, 120.0,
                                          "user_tpm")] if i % 2 else [])
            refusal, _ = await shared[i % 4].reserve(checks, t)
            if refusal is not None:
                heapq.heappush(events, (t + max(0.01, min(refusal.retry_after_s(t), 5.0)), i))
                continue
            if t >= 60:
                served["all"] += 300
                served["ann"] += 300 if i % 2 else 0
            heapq.heappush(events, (t + 1.0, i))
        # ann's limit: what her meter had room for at 60 s plus what it drained in the two minutes, never more
        # (a leaky bucket: under sustained demand that is the limit each minute, as the test above shows)
        assert served["ann"] <= user_cap - ann_at_60 + user_cap * 2 + 1e-6, (served, ann_at_60)
        assert served["ann"] >= 0.5 * user_cap * 2, served
        assert abs(served["all"] / 2 - TPM) <= 0.05 * TPM, served
    finally:
        await r.aclose()


async def test_with_redis_away_each_replica_holds_its_share_and_applies_it_once_on_return():
    r = redis_client(REDIS, 2.0)
    dead = redis_client("redis://127.0.0.1:1/0", 0.2)  # nothing listens there: Redis is away
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        a, b = SharedQuotas(r, tag, "a"), SharedQuotas(r, tag, "b")
        await r.zadd(f"{tag}:replicas", {"a": 0, "b": 0})  # two replicas beating (the shared state's heartbeats)
        assert (await a.reserve([tpm(1_000)], 0.0))[0] is None and a.up
        for q in (a, b):
            q.redis, q._script = dead, dead.register_script(q._script.script)
        got = [(await a.reserve([tpm(1_000)], 0.0))[0] is None for _ in range(12)]
        assert not a.up and got.count(True) == 9  # its share: 10,000 a minute, 1,000 of which it had reserved
        await a.apply([(tpm(0), -500)], 0.0)  # a settlement while away: kept for Redis
        assert a.pending() == 2  # the meter's sum, and the batch whose answer was lost
        for q in (a, b):
            q.redis, q._script, q._retry_at = r, r.register_script(q._script.script), 0.0
        assert (await a.reserve([tpm(0)], 0.0))[0] is None and a.up and a.pending() == 0
        used = float((await r.hget(f"{tag}:q:tpm:app:chat", "u")).decode())
        assert used == 1_000 + 9 * 1_000 - 500  # each reservation and the settlement, once
    finally:
        await r.aclose()
        await dead.aclose()


class _LostReply:
    """Redis runs the script; its reply is lost on the way back (a timeout at the wrong moment)."""

    def __init__(self, script):
        self.script = script

    async def __call__(self, keys, args):
        await self.script(keys=keys, args=args)
        raise ConnectionError("the reply was lost")


async def test_a_lost_reply_is_settled_once_and_leaks_nothing():
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        await r.zadd(f"{tag}:replicas", {"a": 0, "b": 0})  # two replicas: a's share is half of each limit
        a = SharedQuotas(r, tag, "a")
        limit = Check("tpm:app:chat", RATE, 2_000, 0, 0.0, 120.0, "app_tpm")  # (no drain: exact numbers)
        conc = Check("conc:app:chat", INFLIGHT, 2, 1, 0.0, 3600.0, "app_concurrency")
        assert (await a.reserve([limit], 0.0, [900]))[0] is None
        real = a._script
        a._script = _LostReply(real)
        refusal, _ = await a.reserve([limit], 0.0, [500])  # Redis reserved it; a's share (1,000) refused it
        assert refusal is not None and a.pending() == 1
        a._script, a._retry_at = real, 0.0
        assert (await a.reserve([limit], 0.0, [0]))[0] is None  # Redis answers: the difference is settled
        assert float((await r.hget(f"{tag}:q:tpm:app:chat", "u")).decode()) == 900  # given back, once
        # a concurrency slot whose reply was lost is not kept for good: the replica's count is written whole
        assert (await a.reserve([conc], 0.0))[0] is None
        a._script = _LostReply(real)
        await a.apply([(conc, -1)], 0.0)  # its settlement: Redis had it, the reply was lost
        a._script, a._retry_at = real, 0.0
        assert (await a.reserve([conc], 0.0))[0] is None and (await a.reserve([conc], 0.0))[0] is None
        assert int(await r.hget(f"{tag}:q:conc:app:chat", "a")) == 2  # its two in flight, no ghost
        assert a.pending() == 0
    finally:
        await r.aclose()


def test_a_share_below_one_request_admits_one_at_a_time():
    book = QuotaBook()
    book.cap_scale = 0.25  # four replicas, Redis away
    conc = Check("conc:app:chat", INFLIGHT, 2, 1, 0.0, 3600.0, "app_concurrency")
    assert book.reserve([conc], 0.0)[0] is None and book.reserve([conc], 0.0)[0] is not None
    rpm = Check("rpm:app:chat", RATE, 3, 1, 3 / 60.0, 120.0, "app_rpm")
    assert book.reserve([rpm], 0.0)[0] is None
    refusal = book.reserve([rpm], 0.0)[0]
    assert refusal is not None and refusal.retry_after_s(0.0) == pytest.approx(1 / (3 / 60 * 0.25))  # its share's


async def test_a_gateways_settlements_ride_on_the_next_round_trip():
    """A gateway's store (``deferred``, kicked by the fairness sync every 20 ms) sends draws and settlements with
    the next reservation or tick: a request costs one round trip of its own, at admission, and the meters end
    exactly where a store that sends each at once leaves them."""
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        now_q, later_q = SharedQuotas(r, tag + "n", "a"), SharedQuotas(r, tag + "d", "a", deferred=True)
        later_q.KICK_S = 60.0  # (the sync's tick, by hand below)
        conc = Check("conc:app:chat", INFLIGHT, 4, 1, 0.0, 3600.0, "app_concurrency")
        limit = Check("tpm:app:chat", RATE, 10**6, 0, 0.0, 120.0, "app_tpm")  # (no drain: exact numbers)
        for q in (now_q, later_q):
            settling = []
            for i in range(20):
                assert (await q.reserve([limit, conc], 0.0, [300, 1]))[0] is None
                settling.append(asyncio.ensure_future(q.apply([(limit, -100 - i), (conc, -1)], 0.0)))
                await asyncio.sleep(0.002)  # (the request runs; at once, its settlement's round trip is done)
            if q.deferred:
                assert q.pending() == 1 and not settling[-1].done()  # waiting for a round trip
                q.kick()  # (the sync's tick)
            await asyncio.gather(*settling)
            assert q.pending() == 0
        assert now_q.batches == 40 and later_q.batches == 21  # each settlement rode on the next reservation
        # (one client at a time; under load both share round trips between requests too)
        for q in (now_q, later_q):
            assert float((await r.hget(f"{q.tag}:q:tpm:app:chat", "u")).decode()) == 20 * 300 - sum(
                100 + i for i in range(20))
            assert int(await r.hget(f"{q.tag}:q:conc:app:chat", "a")) == 0
        # with nothing else going, a settlement goes by itself within KICK_S (no fairness sync needed)
        alone = SharedQuotas(r, tag + "a", "a", deferred=True)
        assert (await alone.reserve([conc], 0.0))[0] is None
        await asyncio.wait_for(alone.apply([(conc, -1)], 0.0), timeout=1.0)
        assert alone.batches == 2 and int(await r.hget(f"{alone.tag}:q:conc:app:chat", "a")) == 0
    finally:
        await r.aclose()


async def test_a_concurrency_count_sent_right_after_a_reservation_includes_it():
    """The next batch's count of this replica's requests in flight includes the reservations Redis confirmed in
    the batch before, even if their callers have not resumed yet (else another replica could pass the cap)."""
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        a = SharedQuotas(r, tag, "a")
        conc = Check("conc:app:chat", INFLIGHT, 3, 1, 0.0, 3600.0, "app_concurrency")
        first = asyncio.ensure_future(a.reserve([conc], 0.0))
        await asyncio.sleep(0)  # (on its way)
        second = asyncio.ensure_future(a.reserve([conc], 0.0))  # (waits for the next batch)
        assert (await first)[0] is None and (await second)[0] is None
        assert a.batches == 2 and int(await r.hget(f"{tag}:q:conc:app:chat", "a")) == 2
    finally:
        await r.aclose()


async def test_reservations_refused_in_a_round_trip_take_no_slot_from_the_next():
    """Requests refused by one limit (here their tokens a minute) in the same round trip as one that fits: the
    refused ones' slots on the concurrency meter were counted in the one admitted after them, which was
    refused in turn (app_concurrency) and left Redis counting slots nobody held."""
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        a = SharedQuotas(r, tag, "a")
        conc = Check("conc:app:chat", INFLIGHT, 3, 1, 0.0, 3600.0, "app_concurrency")
        asks = [asyncio.ensure_future(a.reserve([conc, tpm(amount)], 0.0)) for amount in (30_000,) * 3 + (10,)]
        refusals = [(await ask)[0] for ask in asks]
        assert a.batches == 1  # (one round trip)
        assert [x.check.reason if x else None for x in refusals] == ["app_tpm"] * 3 + [None]
        assert int(await r.hget(f"{tag}:q:conc:app:chat", "a")) == 1
    finally:
        await r.aclose()


def test_a_concurrency_meter_outlives_any_request_it_counts():
    """A meter unused this long is forgotten; a request still holding a slot must never outlive it (queued,
    then answered, at the longest the defaults allow), or the slot it holds would be given away."""
    from fairgate.proxy.config import GatewayConfig
    from fairgate.quota.plans import INFLIGHT_TTL_S

    c = GatewayConfig()
    assert INFLIGHT_TTL_S > c.queue_timeout_s + c.request_timeout_s


async def test_only_interactions_a_client_named_are_kept_for_their_continuations(sqlite_url):
    """Continuations of an interaction may overdraw a spent budget; a request's own interaction (none named)
    never continues, and keeping it would evict the named ones after enough requests (any tenant's)."""
    from fairgate.quota.quota_admin import set_quota
    from tests.conftest import gateway_config, run_gateway

    async with run_gateway(gateway_config(sqlite_url)) as gw:
        client = gw.client(await gw.key("chat"))
        await set_quota(gw.admin, "chat", None, None, budget_tokens=1_000_000, budget_period="month")
        await gw.gateway.tenants.refresh()
        msgs = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=2)
        assert not gw.gateway.quotas._interactions
        await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=2,
                                             extra_headers={"X-Fairgate-Interaction": "plan-1"})
        assert [interaction for _app, _user, interaction in gw.gateway.quotas._interactions] == ["plan-1"]


async def test_a_budget_held_by_a_replica_that_died_is_given_back():
    """What a replica's requests in flight reserved of a budget is that replica's: once it stops beating (a
    ``kill -9``, an OOM kill, a lost node) the budget no longer counts it, and the tenant is not refused "held by
    requests in flight" until the period ends. A replica that stopped beating keeps its part for a request's
    life (it may be cut off from Redis, its requests running); one that comes back after that settles its
    requests' spend once: nothing it reserved is taken from the budget twice."""
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        # a stopped replica's part is kept 15 s after it wrote it (a request's longest life, by default 4,200 s)
        a, b = (SharedQuotas(r, tag, name, holds_s=15.0) for name in "ab")
        budget = Check("tokens:app:chat:day:2026-11-30", BUDGET, 1_000, 0, 0.0, 1e6, "app_budget_tokens", 1e9)
        hold = Check(HELD + budget.key, BUDGET, UNCAPPED, 0, 0.0, 1e6, "app_budget_tokens", 1e9)
        await r.zadd(f"{tag}:replicas", {"a": 0, "b": 0})  # both beating at 0 s (live for 10 s)
        assert (await a.reserve([budget, hold], 0.0, [600, 600]))[0] is None  # a's request, in flight
        refusal, used = await b.reserve([budget, hold], 1.0, [600, 600])
        assert refusal is not None and refusal.quota and used == [600, 600]  # held by a's request
        await r.zadd(f"{tag}:replicas", {"b": 12_000})  # at 12 s a no longer beats: cut off, or dead
        assert (await b.reserve([budget, hold], 12.0, [600, 600]))[0] is not None  # its request may still run
        await r.zadd(f"{tag}:replicas", {"b": 20_000})  # at 20 s a's part is 20 s old: a died
        assert (await b.reserve([budget, hold], 20.0, [600, 600]))[0] is None
        await b.apply([(budget, 100 - 600), (hold, -600)], 21.0)  # b's request used 100 of its 600
        spend = f"{tag}:q:{budget.key}"
        assert float(await r.hget(spend, "u")) == 100
        await r.zadd(f"{tag}:replicas", {"a": 22_000})  # a was only paused: its request ends, using 50
        await a.apply([(budget, 50 - 600), (hold, -600)], 22.0)
        assert float(await r.hget(spend, "u")) == 150  # each request's spend once, no reservation left
        refusal, used = await b.reserve([budget, hold], 22.0, [850, 850])
        assert refusal is None and used == [1_000, 850]
    finally:
        await r.aclose()


async def test_while_redis_is_away_a_budget_held_by_other_replicas_is_not_called_spent():
    """A replica cut off from Redis refuses on its own book; a budget nearly full of the other replicas' requests
    in flight (as last seen) is "held by requests in flight, retry soon", not spent (``insufficient_quota``)."""
    r = redis_client(REDIS, 2.0)
    dead = redis_client("redis://127.0.0.1:1/0", 0.2)  # nothing listens there: Redis is away
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        a, b = SharedQuotas(r, tag, "a"), SharedQuotas(r, tag, "b")
        budget = Check("tokens:app:chat:day:2026-11-30", BUDGET, 1_000, 0, 0.0, 1e6, "app_budget_tokens", 1e9)
        hold = Check(HELD + budget.key, BUDGET, UNCAPPED, 0, 0.0, 1e6, "app_budget_tokens", 1e9)
        await r.zadd(f"{tag}:replicas", {"a": 0, "b": 0})
        assert (await b.reserve([budget, hold], 0.0, [900, 900]))[0] is None  # b's request, in flight
        assert (await a.reserve([budget, hold], 0.0, [50, 50]))[0] is None  # a sees it
        await a.apply([(budget, -50), (hold, -50)], 0.0)  # (a's request, given back)
        a.redis, a._script = dead, dead.register_script(a._script.script)
        refusal, used = await a.reserve([budget, hold], 1.0, [200, 200])
        assert refusal is not None and not a.up
        assert (refusal.used, used[1]) == (900, 900)  # all of it held, none spent (the gate's message)
    finally:
        await r.aclose()
        await dead.aclose()


async def test_a_budget_rolled_back_or_written_at_full_precision():
    """Redis restored from a snapshot (or failed over to a replica behind) holds a budget's meter still marked
    seeded but at an older spend: a spend never falls, so the replica takes it for lost and its seed brings it
    back to at least what it last saw. Spend is written to 17 digits: nano-USD past a million dollars still
    adds up. And the first batch after an outage carries any number of meters kept meanwhile."""
    r = redis_client(REDIS, 2.0)
    tag = "{t" + uuid.uuid4().hex[:8] + "}"
    try:
        await r.zadd(f"{tag}:replicas", {"a": 0})
        a = SharedQuotas(r, tag, "a")
        budget = Check("tokens:app:chat:day:2026-11-30", BUDGET, 1_000, 0, 0.0, 1e6, "app_budget_tokens", 1e9)
        hold = Check(HELD + budget.key, BUDGET, UNCAPPED, 0, 0.0, 1e6, "app_budget_tokens", 1e9)
        assert await a.seed(budget, 100.0, 0.0)
        assert (await a.reserve([budget, hold], 0.0, [900, 900]))[0] is None
        await a.apply([(hold, -900)], 0.0)  # it used all 900: spent 1,000
        await r.hset(f"{tag}:q:{budget.key}", mapping={"u": "100"})  # an older snapshot, still marked
        assert (await a.reserve([budget, hold], 0.0, [0, 0]))[0] is None and a.lost == {budget.key: 1_000}
        assert await a.seed(budget, 100.0, 0.0, a.lost.pop(budget.key))  # (the gate's re-seed)
        assert float(await r.hget(f"{tag}:q:{budget.key}", "u")) == 1_000

        usd = Check("usd:app:chat:month:2026-11", BUDGET, 1e18, 0, 0.0, 1e6, "app_budget_usd", 1e9)
        assert await a.seed(usd, 1e15, 0.0)  # $1M spent, in nano-USD
        for _ in range(100):
            await a.apply([(usd, 40.0)], 0.0)
        assert float(await r.hget(f"{tag}:q:{usd.key}", "u")) == 1e15 + 4_000

        meters = [Check(f"tokens:user:chat/u{i}:day:2026-11-30", BUDGET, 1e9, 0, 0.0, 1e6, "user_budget_tokens",
                        1e9) for i in range(9_000)]
        a._retry_at = time.monotonic() + 60  # Redis away: settlements kept, one per meter
        for c in meters:
            await a.apply([(c, 1.0)], 0.0)
        a._retry_at = 0.0
        assert (await a.reserve([budget, hold], 0.0, [0, 0]))[0] is None and a.up and a.pending() == 0
        assert float(await r.hget(f"{tag}:q:{meters[-1].key}", "u")) == 1.0
    finally:  # (its 9,000 meters would outlive the suite by days, and every SCAN after it would walk them)
        await r.delete(*[k async for k in r.scan_iter(match=f"{tag}:*", count=10_000)])
        await r.aclose()
