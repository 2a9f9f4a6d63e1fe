"""The Redis-backed counter store against the real Redis: atomic lifts and charges, and outage behaviour."""

from __future__ import annotations

import uuid

import pytest

from fairgate.storage.shared_state import SharedState

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def pair():
    ns = f"t{uuid.uuid4().hex[:8]}"
    a, b = SharedState(REDIS, ns, "r1", interval_s=3600), SharedState(REDIS, ns, "r2", interval_s=3600)
    yield a, b
    for s in (a, b):
        keys = s.keys
        await s.redis.delete(*keys)
        await s.redis.aclose()


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
    b.inflight_source = lambda: {"gpu-0": (700, 3)}
    await a.sync()
    await b.sync()
    await a.sync()
    assert a.global_min == ("r2|user:q", 20.0) and not a.is_mine(a.global_min[0])
    assert a.inflight == {"gpu-0": (700, 3)} and b.inflight == {}


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
    up._ops, up._pending, up._lift = down._ops, down._pending, down._lift
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
