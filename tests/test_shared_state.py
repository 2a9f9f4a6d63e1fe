"""The Redis-backed counter store against the real Redis: atomic lifts and charges, and outage behaviour."""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest

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
            await forget(s)
            await s.redis.aclose()


async def forget(s: SharedState) -> None:
    """Remove a replica's namespace from Redis (by name: a SCAN walks every key the suite left in Redis)."""
    await s.redis.delete(*s.keys, *(s.kv.key(k) for k in range(len(s.kv.shards))))


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
    # (what its requests hold at their peak, how many, capacity, wants room)
    b.inflight_source = lambda: {"gpu-0": (700, 3, 0, False)}
    a.inflight_source = lambda: {"gpu-0": (0, 0, 0, False)}  # (each hears of the backends it renews: all of its pool)
    await a.sync()
    await b.sync()
    await a.sync()
    assert a.global_min == ("r2|user:q", 20.0) and not a.is_mine(a.global_min[0])
    assert a.kv.inflight == {"gpu-0": (700, 3)} and b.kv.inflight == {"gpu-0": (0, 0)}


async def test_kv_budgets_never_add_up_past_a_backend_and_the_least_served_gets_the_free_room(pair):
    """Each replica gates a backend against its KV budget there (storage/shared_state.py): never less than what it
    committed, and together never more than the backend holds, whatever order the replicas sync in. Room no one
    holds goes to the replica whose backlogged client is the least served, if it wants room; with no one
    wanting room, each has a share at hand."""
    a, b = pair
    committed = {"r1": 300, "r2": 400}
    wants = {"r1": False, "r2": False}
    for s in (a, b):
        s.inflight_source = lambda s=s: {"gpu-0": (committed[s.replica], 2, 1000, wants[s.replica])}
    await a.sync()  # alone: a has all that is free at hand; then b's own requests are there before its budget
    await b.sync()
    for s in (a, b, a, b, a):
        await s.sync()
        assert a.kv.budget["gpu-0"] + b.kv.budget["gpu-0"] <= 1000
    assert a.kv.budget["gpu-0"] > 300 and b.kv.budget["gpu-0"] > 400  # room at hand on both
    a.add("user:p", 50)
    b.add("user:q", 20)  # b's client is the less served
    a.backlog_source, b.backlog_source = (lambda: ["user:p"]), (lambda: ["user:q"])
    wants.update(r1=True, r2=True)
    for s in (a, b, a, b, a, b):  # (who is the least served is known from the sync before)
        await s.sync()
        assert a.kv.budget["gpu-0"] + b.kv.budget["gpu-0"] <= 1000
    assert a.kv.budget["gpu-0"] == 300 and b.kv.budget["gpu-0"] == 700
    committed["r2"] = 100  # b's requests finished; it wants no more room, a still does
    wants["r2"] = False
    for s in (b, a):
        await s.sync()
    assert b.kv.budget["gpu-0"] == 100 and a.kv.budget["gpu-0"] == 900


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
    await forget(up)
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
    run = a._call

    async def answer_lost(calls):
        await run(calls)
        raise RedisTimeout("reply lost")

    a._call = answer_lost
    assert not await a.sync()
    a._call = run
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
        b.inflight_source = lambda: {"gpu-0": (900, 4, 0, False)}
        committed = [60]
        a.inflight_source = lambda: {"gpu-0": (committed[0], 1, 1000, True)}
        await b.sync()
        assert await a.sync() and a.kv.inflight == {"gpu-0": (900, 4)} and a.kv.budget == {"gpu-0": 100}
        committed[0] = 20  # its requests finish while Redis cannot be reached: its budget stands (were it held
        await proxy.cut()  # to what it committed at each failed try, it would end with none)
        assert not await a.sync() and a.kv.inflight == {"gpu-0": (900, 4)}  # a short outage keeps the view
        assert not await a.sync() and a.kv.budget == {"gpu-0": 100} and a.kv.holding == {}
        # and it holds itself to what it said at the first try that failed (had that one run and its answer been
        # lost, the others may hold what its budget was cut by)
        assert a.kv.kept == {"gpu-0": 20}
        await asyncio.sleep(0.3)
        assert not await a.sync() and a.kv.inflight == {} and a.global_min is None
        assert a.kv.budget == {} and a.kv.kept == {}
    finally:
        await a.redis.aclose()


async def test_a_backend_keeps_the_sums_of_its_budgets_and_forgets_a_replica_that_stops_renewing(pair):
    """A renewal costs Redis the same however many replicas share a backend: the backend keeps the sums of their
    budgets, requests and wants beside their entries (storage/sync_lua.py). The sums always equal the entries',
    and a replica that stops renewing for ``ttl_s`` is taken out of them and dropped (within a second): its
    budget goes back to the others."""
    import asyncio
    import struct

    a, b = pair
    a.ttl_s = b.ttl_s = 0.5
    a.inflight_source = lambda: {"gpu-0": (200, 2, 1000, True), "gpu-1": (50, 1, 1000, False)}
    b.inflight_source = lambda: {"gpu-0": (300, 3, 1000, False)}
    for s in (a, b, a, b):
        await s.sync()
    for backend in (b"gpu-0", b"gpu-1"):
        tag = [a.kv.key(k) for k in range(6) if await a.redis.hexists(a.kv.key(k), backend)][0]
        sums = list(struct.unpack("<4d", await a.redis.hget(tag, backend)))
        rows = [struct.unpack("<3d", v) for r in (b"r1", b"r2") if (v := await a.redis.hget(tag, backend + b"|" + r))]
        assert sums == [sum(r[0] for r in rows), sum(r[1] for r in rows), len(rows), sum(r[2] for r in rows)]
    assert a.kv.budget["gpu-0"] + b.kv.budget["gpu-0"] <= 1000
    assert b.kv.budget["gpu-0"] == 300  # (a wants room: b keeps its own)
    assert a.kv.inflight["gpu-0"] == (300, 3) and b.kv.inflight["gpu-0"] == (a.kv.budget["gpu-0"], 2)
    await asyncio.sleep(1.1)  # b stops renewing: past its ttl, and a second since they were last looked for
    await a.sync()
    assert a.kv.budget["gpu-0"] == 1000 and a.kv.inflight["gpu-0"] == (0, 0)
    for k in range(6):
        assert not [f for f in await a.redis.hkeys(a.kv.key(k)) if f.endswith(b"r2")]


async def test_kv_state_is_spread_over_six_cluster_slots():
    """The KV budgets sit under six hash tags a sixth of the slot space apart, so a Redis Cluster of 2, 3 or 6
    nodes spreads them evenly over its nodes; the counters stay on the namespace's one slot (what must be atomic
    there is)."""
    from redis.crc import key_slot

    from fairgate.storage.kv_budgets import kv_shards

    for ns in ("fairgate", "prod-eu"):
        slots = [key_slot(("{" + tag + "}:gpu-0").encode()) for tag in kv_shards(ns)]
        assert [slot * 6 // 16384 for slot in slots] == list(range(6))
        for nodes in (2, 3, 6):  # (slots split evenly, as redis-cli --cluster create splits them)
            assert [sum(1 for slot in slots if slot * nodes // 16384 == n) for n in range(nodes)] == \
                [6 // nodes] * nodes
    s = SharedState(REDIS, "fairgate", "r1")
    assert len({key_slot(k.encode()) for k in s.keys}) == 1
    await s.redis.aclose()


async def test_a_replica_that_wants_room_syncs_sooner_but_never_more_than_its_share_of_redis(monkeypatch):
    """``wake`` brings the next sync forward to a quarter of the interval (room another replica frees reaches a
    replica that wants it sooner), and never to less than keeps its scripts within SYNC_SHARE of Redis's time
    (the script measures its own)."""
    import asyncio

    from fairgate.storage import shared_state
    from fairgate.storage.shared_state import SYNC_SHARE

    monkeypatch.setattr(shared_state, "IDLE_SYNCS", 1)  # (idle, as it is here, it would sync less often still)

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
        await forget(s)
        await s.redis.aclose()


async def test_an_idle_replica_syncs_five_times_less_often_until_work_comes():
    """A replica with nothing charged, queued or running syncs every IDLE_SYNCS intervals (an idle gateway wakes
    ~10 times a second, not 50); a charge brings the next sync at once, and the interval back."""
    import asyncio

    from fairgate.storage.shared_state import IDLE_SYNCS

    s = SharedState(REDIS, f"t{uuid.uuid4().hex[:8]}", "r1", interval_s=0.02)
    loop = asyncio.get_running_loop()

    async def next_sync() -> float:
        count, began = s.syncs, loop.time()
        while s.syncs == count:
            await asyncio.sleep(0.002)
        return loop.time() - began

    try:
        await s.start()
        gaps = [await next_sync() for _ in range(3)]  # (the first may begin mid-wait)
        assert min(gaps[1:]) >= 0.9 * IDLE_SYNCS * s.interval_s, gaps
        s.add("ann", 1.0)
        assert await next_sync() < 0.08
        assert s._periodic.interval_s == s.interval_s  # (it sent a charge: not idle)
    finally:
        await s.stop()
        await forget(s)
        await s.redis.aclose()


async def test_work_that_comes_during_a_sync_keeps_the_replica_busy():
    """A request that arrives while a sync's answer is on its way is not missed by that sync's judgement
    (the replica stays at every interval), and the idle interval stays well inside the ttl after which the
    other replicas count a replica gone."""
    from fairgate.storage.shared_state import IDLE_SYNCS

    s = SharedState(REDIS, f"t{uuid.uuid4().hex[:8]}", "r1", interval_s=0.02)
    try:
        assert await s.sync() and s._periodic.interval_s == IDLE_SYNCS * 0.02  # nothing here: idle
        real = s._call

        async def arrival_meanwhile(calls):
            s.touch()  # a request arrives while the answer is on its way
            return await real(calls)

        s._call = arrival_meanwhile
        assert await s.sync() and s._periodic.interval_s == 0.02
        s._call = real
        assert await s.sync() and s._periodic.interval_s == IDLE_SYNCS * 0.02
        s.interval_s = 1.0  # (a long interval: idle, a quarter of the ttl at most)
        assert await s.sync() and s._periodic.interval_s == s.ttl_s / 4
    finally:
        await forget(s)
        await s.redis.aclose()


async def test_replicas_of_the_budget_curves_are_reported_while_they_share_the_namespace(pair, caplog):
    """Rolling update from the KV budget curves (``fg4_sync``): the two versions share the counters but not the
    KV budgets, so the backends may preempt meanwhile. A replica says so in its log, once, while a replica of
    the earlier version is there, and again once it has gone (its heartbeat stopped: its entries are dropped)."""
    import asyncio
    import time

    a, _ = pair
    a.ttl_s = 0.3
    caplog.set_level("INFO", logger="fairgate.shared")
    tag = a.keys[0].split(":")[0]
    await a.redis.zadd(f"{tag}:replicas", {"old": int(time.time() * 1000)})
    await a.redis.hset(f"{tag}:inflight", "old|gpu-0", "700 3")
    assert await a.sync() and await a.sync() and a.older
    said = [r.getMessage() for r in caplog.records if r.name == "fairgate.shared" and r.levelname == "WARNING"]
    assert len(said) == 1 and "earlier version" in said[0] and "preempt" in said[0], said
    await asyncio.sleep(0.4)  # (its heartbeat is past the ttl)
    assert await a.sync() and not a.older
    assert await a.redis.hlen(f"{tag}:inflight") == 0
    assert any("no longer share" in r.getMessage() for r in caplog.records)
