"""The Redis-backed counter store against the real Redis: atomic lifts and charges, and outage behaviour."""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest

from fairgate.accounting.kv_curve import Curve, upper
from fairgate.policies.kv_profile import KVProfile
from fairgate.storage.shared_state import SharedState

REDIS = "redis://127.0.0.1:6379/0"


@asynccontextmanager
async def shared_pair(url: str) -> AsyncIterator[tuple[SharedState, SharedState]]:
    """Two replicas' shared state in a fresh namespace (synced by hand), removed afterwards."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    a, b = SharedState(url, ns, "r1", interval_s=3600), SharedState(url, ns, "r2", interval_s=3600)
    try:
        yield a, b
    finally:
        for s in (a, b):
            await s.redis.delete(*s.keys)
            await s.redis.aclose()


def now(s: SharedState) -> dict[str, float]:
    """A replica's budget per backend at the next step."""
    return {b: float(curve.at(0.0)) for b, (curve, *_) in s.budget.items()}


@pytest.fixture
async def pair():
    async with shared_pair(REDIS) as p:
        yield p


async def test_charges_from_two_replicas_add_up(pair):
    a, b = pair
    a.add("user:x", 10)
    b.add("user:x", 5)
    a.add("user:x", 1)
    a.backlog_source = lambda: ["user:x"]  # a replica reads back the clients it queues or charges
    assert await a.sync() and await b.sync() and await a.sync()
    assert a.get("user:x") == b.get("user:x") == 16


async def test_lift_is_a_max_inside_redis(pair):
    """A lift computed on a stale view never lowers a counter another replica has raised meanwhile."""
    a, b = pair
    b.add("user:y", 100)
    await b.sync()
    a.lift("user:y", 40)  # a thinks y is at 0: lifts to 40
    a.add("user:y", 2)
    await a.sync()
    assert a.get("user:y") == 102  # max(100, 40) + 2, not 42


async def test_backlog_minimum_and_inflight_are_shared(pair):
    a, b = pair
    a.add("user:p", 50)
    b.add("user:q", 20)
    a.backlog_source = lambda: ["user:p"]
    b.backlog_source = lambda: ["user:q"]
    # (what its requests hold at each future step, how many, capacity, wants room, read rate)
    b.inflight_source = lambda: {"gpu-0": (Curve.flat(700), 3, 0, False, 0.0)}
    await a.sync()
    await b.sync()
    await a.sync()
    assert a.global_min == ("r2|user:q", 20.0) and not a.is_mine(a.global_min[0])
    assert a.inflight == {"gpu-0": (700, 3)} and b.inflight == {}


async def test_kv_budgets_never_add_up_past_a_backend_and_the_least_served_gets_the_free_room(pair):
    """Each replica gates a backend against its KV budget there (storage/shared_state.py): never less than what it
    committed, and together never more than the backend holds, whatever order the replicas sync in. Room no one
    holds goes to the replica whose backlogged client is the least served, if it wants room; with no one
    wanting room, each has a share at hand."""
    a, b = pair
    committed = {"r1": 300, "r2": 400}
    wants = {"r1": False, "r2": False}
    for s in (a, b):
        s.inflight_source = lambda s=s: {"gpu-0": (Curve.flat(committed[s.replica]), 2, 1000, wants[s.replica], 0.0)}
    await a.sync()  # alone: a has all that is free at hand; then b's own requests are there before its budget
    await b.sync()
    for s in (a, b, a, b, a):
        await s.sync()
        assert now(a)["gpu-0"] + now(b)["gpu-0"] <= 1000
    assert now(a)["gpu-0"] > 300 and now(b)["gpu-0"] > 400  # room at hand on both
    a.add("user:p", 50)
    b.add("user:q", 20)  # b's client is the less served
    a.backlog_source, b.backlog_source = (lambda: ["user:p"]), (lambda: ["user:q"])
    wants.update(r1=True, r2=True)
    for s in (a, b, a, b):
        await s.sync()
        assert now(a)["gpu-0"] + now(b)["gpu-0"] <= 1000
    assert now(a)["gpu-0"] == 300 and now(b)["gpu-0"] == 700
    committed["r2"] = 100  # b's requests finished; it wants no more room, a still does
    wants["r2"] = False
    for s in (b, a):
        await s.sync()
    assert now(b)["gpu-0"] == 100 and now(a)["gpu-0"] == 900


async def test_unreachable_redis_keeps_local_state_and_reconciles():
    ns = f"t{uuid.uuid4().hex[:8]}"
    down = SharedState("redis://127.0.0.1:1/0", ns, "r1", interval_s=3600)
    down.add("user:z", 7)
    down.lift("user:w", 3)
    assert not await down.sync() and not down.up
    assert down.get("user:z") == 7 and down.get("user:w") == 3  # the policy keeps working on the mirror
    await down.redis.aclose()
    # the same pending operations reach Redis once it is there
    up = SharedState(REDIS, ns, "r1", interval_s=3600)
    up._fold, up._unacked, up._batch = down._fold, down._unacked, down._batch
    assert await up.sync() and up.up
    assert up.get("user:z") == 7 and up.get("user:w") == 3
    await up.redis.delete(*up.keys)
    await up.redis.aclose()


async def test_statistics_merged_in_redis_equal_the_local_ones(pair):
    """Two replicas' observations, merged by the Lua script, give the statistics one process would have learned:
    same counts, same decayed sums, same histogram buckets (the script's bucket() is Python's)."""
    import time

    from fairgate.accounting.app_stats import AppStats

    a, b = pair
    now = time.time()
    obs = [("chat", 0, 100, 20, 50, now), ("chat", 1, 3000, 0, 7, now + 1), ("agent", 0, 0, 512, 1023, now + 2),
           ("agent", 0, 15, 63, 1, now + 3)]
    local, merged = AppStats(landmark=now), AppStats()
    sa, sb = a.stats(), b.stats()
    try:
        for i, o in enumerate(obs):
            local.observe(*o)
            (sa if i % 2 else sb).observe(*o)
        assert await sa.sync(merged) and await sb.sync(merged)
        got = {(e["app"], e["stage"]): e for e in merged.dump()["entries"]}
        want = local.dump()["entries"]
        assert len(got) == len(want)
        for e in want:
            g = got[(e["app"], e["stage"])]
            assert g["n"] == e["n"] and g["w"] == pytest.approx(e["w"], rel=1e-6)
            for cls, d in e["dists"].items():
                assert g["dists"][cls]["hist"].keys() == d["hist"].keys()
                assert g["dists"][cls]["sum_wx"] == pytest.approx(d["sum_wx"], rel=1e-6)
    finally:
        await a.redis.delete(sa.key, sa.landmark_key)


async def test_an_outage_keeps_one_pending_operation_per_client_and_a_lost_answer_applies_once(pair):
    """Once a Redis outage queued one operation per streamed chunk, and a sync whose answer was lost
    (the script ran, the reply timed out) was sent again and applied twice."""
    from redis.exceptions import TimeoutError as RedisTimeout

    a, b = pair
    for _ in range(1_000):  # a long stream, charged chunk by chunk, with a lift in the middle
        a.add("user:s", 1.0)
    a.lift("user:s", 5_000.0)
    for _ in range(1_000):
        a.add("user:s", 1.0)
    assert a.pending_ops == 1 and a.get("user:s") == 6_000.0
    run = a._script

    async def answer_lost(**kw):
        await run(**kw)
        raise RedisTimeout("reply lost")

    a._script = answer_lost
    assert not await a.sync()
    a._script = run
    a.add("user:s", 7.0)  # charged while the batch's fate was unknown
    assert await a.sync() and await a.sync() and await b.sync()
    b.backlog_source = lambda: ["user:s"]
    await b.sync()
    assert a.get("user:s") == b.get("user:s") == 6_007.0  # the lost-answer batch applied once


async def test_other_replicas_inflight_is_dropped_when_redis_stays_away(pair):
    """A replica cut off from Redis for longer than ttl_s stops counting the others' last in-flight against its
    own headroom (once it stayed frozen for the whole outage)."""
    import asyncio

    from tests.tcp_proxy import TcpProxy

    _, b = pair
    proxy = await TcpProxy("127.0.0.1", 6379).start()
    a = SharedState(f"redis://127.0.0.1:{proxy.port}/0", b.keys[0][1:].split("}")[0], "r1", interval_s=3600,
                    ttl_s=0.2)
    try:
        b.inflight_source = lambda: {"gpu-0": (Curve.flat(900), 4, 0, False, 0.0)}
        committed = [60]
        a.inflight_source = lambda: {"gpu-0": (Curve.flat(committed[0]), 1, 1000, True, 0.0)}
        await b.sync()
        assert await a.sync() and a.inflight == {"gpu-0": (900, 4)} and now(a) == {"gpu-0": 100}
        committed[0] = 20  # its requests finish while Redis cannot be reached: its budget stands (were it held
        await proxy.cut()  # to what it committed at each failed try, it would end with none)
        assert not await a.sync() and a.inflight == {"gpu-0": (900, 4)}  # a short outage keeps the view
        assert not await a.sync() and now(a) == {"gpu-0": 100} and a.holding == {}
        # and it holds itself to what it said at the first try that failed (had that one run and its answer been
        # lost, the others may hold what its budget was cut by)
        assert float(a.kept["gpu-0"][0].at(0.0)) == 20
        await asyncio.sleep(0.3)
        assert not await a.sync() and a.inflight == {} and a.global_min is None and a.budget == {} and a.kept == {}
    finally:
        await a.redis.aclose()


async def test_budget_curves_add_up_to_the_backend_at_every_step_and_share_what_peaks_apart(pair):
    """Budgets are curves over the future decode steps (accounting/kv_curve.py): requests of two replicas that
    peak at different steps share a backend that flat budgets (each replica's peak at every step) would split.
    Here r1's request grows from 590 to 600 in its last 10 steps and r2's two from 300 to 700 in 200: their
    peaks add up to 1,300 > 1,000, yet together they never pass 920. Whatever the order of the syncs, at every step the
    budgets add up to at most 1,000, each covers its own requests, and the least-served replica wanting room
    (r2) gets what r1 leaves once its requests end. (Once both have synced: the first to sync hands itself the
    room it does not know is taken; a budget never falls below the requests it has.)"""
    a, b = pair
    mine = {"r1": [(10, 590)], "r2": [(200, 150), (200, 150)]}
    for s in (a, b):
        p = KVProfile(list(mine[s.replica]), None)
        s.inflight_source = lambda s=s, p=p: {"gpu-0": (upper(p.ends, p.start_sums, 0), 3, 1000, True, 0.0)}
    a.add("user:p", 50)
    b.add("user:q", 20)  # b's client is the less served
    a.backlog_source, b.backlog_source = (lambda: ["user:p"]), (lambda: ["user:q"])

    def held(items, e):
        return sum(start + e for end, start in items if end >= e)

    steps = range(0, 400)
    await a.sync()  # (alone: a hands itself all the room, before it hears of b's requests)
    await b.sync()  # (b's requests stand: a budget never falls below them)
    for s in (a, b, a, b):
        await s.sync()
        ca, cb = a.budget["gpu-0"][0], b.budget["gpu-0"][0]
        assert all(ca.at(float(e)) + cb.at(float(e)) <= 1000 + 1e-6 for e in steps)
    ca, cb = a.budget["gpu-0"][0], b.budget["gpu-0"][0]
    assert all(ca.at(float(e)) >= held(mine["r1"], e) - 1e-6 for e in steps)  # each covers its requests
    assert all(cb.at(float(e)) >= held(mine["r2"], e) - 1e-6 for e in steps)
    assert cb.at(11.0) >= 1000 - 1e-6  # past r1's requests, the whole backend is r2's to fill
    assert ca.at(11.0) <= 1e-6  # (r1, wanting room too but not the least served, holds its own requests only)


async def test_budgets_aged_by_the_backends_step_clock_hold_together_as_time_passes(pair):
    """Requests advance a step at a time; each replica's budget is aged by the steps the backend took since it was
    given, on one step clock per backend (storage/sync_lua.py), so however the syncs interleave, at any moment
    the budgets as their gates read them (accounting/kv_curve.py: the least within a step or so of their age) add up
    to at most the backend at every future step. Both replicas want room, their requests move on at 400 steps
    a second, and the syncs come 0-15 ms apart (once both have synced: the first to sync hands itself the room
    it does not yet know the other's requests hold)."""
    import asyncio
    import random

    import numpy as np

    from fairgate.accounting.kv_curve import Margin

    loop, rng, rate = asyncio.get_running_loop(), random.Random(7), 400.0
    t0 = loop.time()
    mine = {"r1": [(rng.randint(20, 300), rng.randint(10, 60)) for _ in range(4)],
            "r2": [(rng.randint(20, 300), rng.randint(10, 60)) for _ in range(4)]}  # (at most 2 × 4 × 360 < 3,000)

    def curve(replica: str) -> Curve:  # its requests as they stand now: each `rate` steps a second further on
        d = int(rate * (loop.time() - t0))
        items = [(end - d, start + d) for end, start in mine[replica] if end > d]
        p = KVProfile(items, None)
        return upper(p.ends, p.start_sums, 0)

    a, b = pair
    for s in (a, b):
        s.inflight_source = lambda s=s: {"gpu-0": (curve(s.replica), 4, 3000, True, rate)}
        s.backlog_source = lambda s=s: ["user:" + s.replica]
    steps = np.arange(0.0, 700.0)
    worst = -np.inf
    for s in (a, b, a):  # (the first to sync hands itself room it does not know the other's requests hold)
        await s.sync()
    for _ in range(30):
        await rng.choice((a, b)).sync()
        await asyncio.sleep(rng.choice((0.0, 0.005, 0.015)))
        if len(a.budget) == len(b.budget) == 1:
            now = loop.time()
            total = sum(Margin([], np.zeros(0), 0, c, r * (now - at), slack=1).room(steps + r * (now - at))
                        for c, at, r in (a.budget["gpu-0"], b.budget["gpu-0"]))
            worst = max(worst, float((total - 3000).max()))
    assert worst <= 1e-6, worst


async def test_shared_budgets_cover_each_replicas_requests_at_every_step_and_odd_rates_are_unknown(pair):
    """With no replica wanting room each has half of what is free at hand: a budget of fractional slope, which
    still covers the replica's own requests at every step (they run, whatever the others were told) and, beside
    the other's, stays within the backend. A step rate that is not a finite, sane number counts as unknown."""
    import math

    import numpy as np

    a, b = pair
    mine = {"r1": [(600, 0), (1500, 40)], "r2": [(900, 100)]}
    rates = {"r1": float("nan"), "r2": 1e12}
    for s in (a, b):
        p = KVProfile(list(mine[s.replica]), None)
        s.inflight_source = lambda s=s, p=p: {"gpu-0": (upper(p.ends, p.start_sums, 0), 2, 5000, False,
                                                         rates[s.replica])}
    for s in (a, b, a, b):
        await s.sync()
    steps = np.arange(0.0, 2500.0)
    ca, cb = a.budget["gpu-0"][0], b.budget["gpu-0"][0]
    assert a.budget["gpu-0"][2] == b.budget["gpu-0"][2] == 0  # (no step clock: no rate anyone trusts)
    assert all(math.isfinite(x) for x in (*ca.v, *ca.s, *cb.v, *cb.s))
    for c, replica in ((ca, "r1"), (cb, "r2")):
        assert all(c.at(e) >= sum(start + e for end, start in mine[replica] if end >= e) - 1e-6 for e in steps)
    assert (ca.at(steps) + cb.at(steps)).max() <= 5000 + 1e-6
    assert ca.at(1600.0) > 1000 and cb.at(1600.0) > 1000  # (and each has some room at hand)


async def test_a_replica_that_wants_room_syncs_sooner_but_never_more_than_its_share_of_redis():
    """``wake`` brings the next sync forward to a quarter of the interval (room another replica frees reaches a
    replica that wants it sooner), and never to less than keeps its scripts within SYNC_SHARE of Redis's time
    (the script measures its own)."""
    import asyncio

    from fairgate.storage.shared_state import SYNC_SHARE

    async def next_sync(s: SharedState, within: float) -> float:
        loop, count = asyncio.get_running_loop(), s.syncs
        began = loop.time()
        while s.syncs == count and loop.time() - began < within:
            await asyncio.sleep(0.005)
        return loop.time() - began if s.syncs > count else float("inf")

    s = SharedState(REDIS, f"t{uuid.uuid4().hex[:8]}", "r1", interval_s=1.0)
    try:
        await s.start()
        assert 0 < s.script_s < 0.01 and s._periodic.soonest_s == 0.25
        await next_sync(s, 3.0)  # (a sync just ran: the next is an interval away, or a quarter once woken)
        s.wake()
        assert await next_sync(s, 0.9) < 0.9
        s.script_s = 2 * s.interval_s * SYNC_SHARE  # scripts that cost Redis that much: no sooner than the interval
        await s.sync()
        assert s._periodic.soonest_s == s.interval_s
        await next_sync(s, 3.0)
        s.wake()
        assert await next_sync(s, 0.6) == float("inf")
    finally:
        await s.stop()
        await s.redis.delete(*s.keys)
        await s.redis.aclose()


async def test_a_replica_of_the_flat_budget_script_is_counted_at_its_budget_at_every_step(pair):
    """Rolling upgrade: a replica still on ``fg3_sync`` writes one flat budget and no curve; one on the curves
    script counts it at that budget at every step (and writes the most its own curve reaches where the other
    reads it)."""
    import time

    import numpy as np

    a, _ = pair
    tag = a.keys[0].split(":")[0]
    await a.redis.zadd(f"{tag}:replicas", {"old": int(time.time() * 1000)})
    await a.redis.hset(f"{tag}:inflight", "old|gpu-0", "700 3")
    a.inflight_source = lambda: {"gpu-0": (Curve.flat(100), 1, 1000, True, 0.0)}
    a.backlog_source = lambda: ["user:p"]
    await a.sync()
    curve = a.budget["gpu-0"][0]
    assert a.inflight == {"gpu-0": (700, 3)}
    assert np.allclose(curve.at(np.arange(0.0, 3000.0)), 300)  # its 100 and all that is free: 1,000 - 700
    assert (await a.redis.hget(f"{tag}:inflight", "r1|gpu-0")).split()[0] == b"300"
