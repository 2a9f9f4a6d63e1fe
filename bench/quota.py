"""What limits and budgets add per request (the goal: ≤ 30 µs in memory; one Redis round trip across
replicas): a request held to an app's TPM and RPM, its user's TPM and a monthly budget reserves on four meters at
admission (and, beside the budget, the meter of what requests in flight hold of it) and settles them at its end.

    .venv/bin/python bench/quota.py [--n 20000] [--meters 1000]

``--meters``: how many other tenants' meters the store holds (a decision must not grow with them).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from fairgate.quota.meters import BUDGET, RATE, Check, QuotaBook
from fairgate.quota.plans import HELD, UNCAPPED
from fairgate.quota.redis_store import SharedQuotas
from fairgate.storage.redis_client import redis_client


def checks(i: int) -> list[Check]:
    app, user = f"app{i % 50}", f"user{i % 500}"
    return [Check(f"rpm:app:{app}", RATE, 1e9, 1, 1e9 / 60, 120.0, "app_rpm"),
            Check(f"tpm:app:{app}", RATE, 1e12, 300, 1e12 / 60, 120.0, "app_tpm"),
            Check(f"tpm:user:{user}", RATE, 1e12, 300, 1e12 / 60, 120.0, "user_tpm"),
            Check(f"tokens:app:{app}:month:2026-11-01", BUDGET, 1e15, 2_300, 0.0, 3e6, "app_budget_tokens"),
            Check(f"{HELD}tokens:app:{app}:month:2026-11-01", BUDGET, UNCAPPED, 2_300, 0.0, 3e6, "app_budget_tokens")]


def memory(n: int, meters: int) -> float:
    book = QuotaBook()
    for i in range(meters):
        book.apply([(Check(f"tpm:other:{i}", RATE, 1e6, 0, 1e4), 1)], 0.0)
    cs = [checks(i) for i in range(n)]
    t0 = time.perf_counter()
    for i, c in enumerate(cs):
        now = i * 1e-4
        book.reserve(c, now)
        book.apply([(c[1], -100), (c[2], -100), (c[3], -2_000), (c[4], -2_300)], now)  # its settlement
    return (time.perf_counter() - t0) / n * 1e6


async def shared(n: int, concurrency: int, deferred: bool) -> tuple[float, float, float]:
    """Median reservation round trip, requests/s, and round trips per request. ``deferred``: as a gateway
    runs it, settlements ride on the next reservation or the fairness sync's 20 ms tick."""
    r = redis_client("redis://127.0.0.1:6379/0", 2.0)
    q = SharedQuotas(r, "{bench" + uuid.uuid4().hex[:6] + "}", "bench", deferred=deferred)
    lat: list[float] = []
    settling: list[asyncio.Future] = []

    async def tick():
        while True:
            await asyncio.sleep(0.02)
            q.kick()

    async def one(i: int):
        c = checks(i)
        t0 = time.perf_counter()
        await q.reserve(c, time.time())
        lat.append(time.perf_counter() - t0)
        await asyncio.sleep(0.001)  # (the request runs)
        settling.append(asyncio.ensure_future(q.apply([(c[1], -100), (c[2], -100), (c[3], -2_000), (c[4], -2_300)], time.time())))

    ticker = asyncio.ensure_future(tick())
    t0 = time.perf_counter()
    for start in range(0, n, concurrency):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + concurrency))))
    await asyncio.gather(*settling)
    wall = time.perf_counter() - t0
    ticker.cancel()
    await r.aclose()
    return statistics.median(lat) * 1e6, n / wall, q.batches / n


async def gate(n: int) -> float:
    """The whole admission in memory: which limits apply (app, user, key), the checks (a budget's calendar
    period), the reservation, the headers; then the settlement."""
    from fairgate.accounting.cost import make_cost
    from fairgate.accounting.length import OutputLengths
    from fairgate.proxy.call import Call
    from fairgate.proxy.control.tenants import Tenants
    from fairgate.proxy.pipeline.quota_gate import QuotaGate
    from fairgate.proxy.pipeline.validate import ParsedRequest
    from fairgate.quota.meters import Limits
    from fairgate.quota.stores import MemoryQuotas

    tenants = Tenants(None)
    tenants._apps = {"chat": (1.0, 10**9)}
    tenants.quotas = {"app:chat": Limits(tpm=10**12, budget_tokens=10**15, budget_period="month"),
                      "user:chat/ann": Limits(tpm=10**12)}
    g = QuotaGate(tenants, MemoryQuotas(), make_cost("weighted"), OutputLengths())
    body = {"model": "m", "messages": []}
    parsed = ParsedRequest("chat", body, "m", True, False, 200, None)
    calls = []
    for i in range(n):
        c = Call(f"r{i}", "chat", app="chat", user="ann", key_id=1, model="m")
        c.tally.estimated_prompt = c.tally.prompt_tokens = 300
        calls.append(c)
    t0 = time.perf_counter()
    for c in calls:
        await g.admit(c, parsed, False)
        c.tally.completion_tokens = 120
        g.settle(c)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--meters", type=int, default=1_000)
    a = ap.parse_args()
    for meters in (a.meters, a.meters * 100):
        print(f"memory: reserve 5 meters + settle 4, {meters:,} other meters: {memory(a.n, meters):.1f} µs/request")
    async def best(runs: int, n: int) -> float:
        return min([await gate(n) for _ in range(runs)])

    print(f"memory, the whole admission (app RPM + TPM + monthly budget, user TPM) and settlement: "
          f"{asyncio.run(gate(a.n)):.1f} µs/request over {a.n:,} (collections included), "
          f"{asyncio.run(best(25, 3_000)):.1f} µs/request in the best of 25 runs of 3,000")
    for conc in (1, 32):
        for deferred in (False, True):
            med, rate, trips = asyncio.run(shared(a.n // 4, conc, deferred))
            how = "settlements with the next round trip" if deferred else "settlements sent at once"
            print(f"redis, {conc} at once, {how}: reserve round trip median {med:.0f} µs; {rate:,.0f} "
                  f"requests/s (reserve + settle); {trips:.2f} round trips per request")


if __name__ == "__main__":
    main()
