"""Locality, live: the gateway over 4 emulated backends with prefix caching, driven by the official openai client.

Two tenants flood it with questions about their own documents (a long shared prefix each, a short question,
a short answer), B with more concurrency than A. Against `least-load`, DLPM, VTC with the `prefix` placement and
D²LPM (DLPM with the `d2lpm` placement) must raise the prefix hit rate and the throughput per GPU-second, and
D²LPM must keep the two tenants' service within 25 % of each other while both are backlogged. Served in the
order of their streams (24 against 40), they would be 40 % apart. Measured (12 s, Q^u 500, Q^w 1,000): 0.2-0.8 %
in two runs side by side, 18 % once under the whole suite's load; at 8 s with Q^u 1,000 / Q^w 2,000, 0.2-8.8 %
alone and once 19 % under the suite. The bound, 2|W|(U + Q^u) (Thm 5.1), is absolute: a loaded machine serves
fewer tokens in the window, so the same gap is a larger share."""

from __future__ import annotations

import asyncio
import random
from datetime import datetime, timedelta, timezone

import aiohttp
import pytest

from tests.conftest import gateway_config, run_gateway

pytestmark = pytest.mark.slow

SECONDS = 12.0
# 4 backends 20x faster than an A10G, each holding ~6 documents beside its running requests: the pool can
# cache every document once, not every document everywhere
EMULATED = {"count": 4, "speed": 2.0, "kv_tokens": 4_000}
DOCS, DOC_WORDS = 6, 700  # per tenant; ~900 tokens each with the chat framing
FLOODS = {"a": 24, "b": 40}
# quanta scaled to a run of ~45 k weighted tokens per tenant (the defaults, Q^u 4,000 and Q^w 20,000 per
# backend, bound the gap by more than that: Thm 4.1 / 5.1 give O(|W|·(U + Q)))
LOCALITY = {"quantum": 500.0, "client_quantum": 1000.0}


def _documents(tenant: str) -> list[str]:
    rng = random.Random(tenant)
    words = ["fair", "queue", "token", "cache", "prefix", "batch", "decode", "prefill", "tenant", "share"]
    return [f"Document {tenant}-{d}: " + " ".join(rng.choice(words) for _ in range(DOC_WORDS))
            for d in range(DOCS)]


def _worker(gw, key: str, tenant: str, seed: int, stop: asyncio.Event):
    client = gw.client(key)
    docs = _documents(tenant)

    async def loop() -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            doc = rng.choice(docs)
            await client.chat.completions.create(
                model="sim-llama", max_tokens=rng.randint(8, 24), extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": doc},
                          {"role": "user", "content": f"question {rng.random():.6f}: what does it say?"}])

    return loop()


async def _run(db_url: str, policy: str, placement: str) -> dict:
    cfg = gateway_config(db_url, policy=policy, placement=placement, emulated=EMULATED, locality=LOCALITY,
                         metrics_public=True)
    async with run_gateway(cfg) as gw:
        keys = {t: await gw.key("docs", user=t) for t in FLOODS}
        stop = asyncio.Event()
        # the streams start interleaved (a, b, b, a, b, b, …), so neither tenant is backlogged before the other
        streams = sorted(((i / c, t, i) for t, c in FLOODS.items() for i in range(c)))
        tasks = [asyncio.create_task(_worker(gw, keys[t], t, hash((t, i)), stop)) for _, t, i in streams]
        await asyncio.sleep(SECONDS - 1.0)
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            metrics = await r.text()  # while both tenants are backlogged (deficits exist only then)
        await asyncio.sleep(1.0)
        stop.set()
        stopped = datetime.now(timezone.utc)
        await asyncio.gather(*tasks)
        for _ in range(100):
            if all(b.inflight == 0 and b.inflight_tokens == 0 for b in gw.gateway.pool.backends):
                break
            await asyncio.sleep(0.05)
        assert all(b.inflight == 0 and b.inflight_tokens == 0 for b in gw.gateway.pool.backends)  # no leak
        rows = [r for r in await gw.rows() if r["status"] == "ok"]
        busy = sum(e.server.runner.engine.busy_s for e in gw.gateway.emulators)
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    # the service DLPM equalizes: uncached (extend) input plus output at w_q = 2, as the backends reported it,
    # of the requests dispatched while both tenants are backlogged: after the first second (the first
    # dispatches fill an empty pool with whoever came first) and before the floods stop (what is still queued
    # then drains with no competition: more of B's, which has more streams)
    start = min(_when(r["dispatched_at"]) for r in rows) + timedelta(seconds=1)
    service = {t: sum(r["prompt_tokens"] - r["cached_tokens"] + 2 * r["completion_tokens"]
                      for r in rows if r["user"] == t and start <= _when(r["dispatched_at"]) < stopped)
               for t in FLOODS}
    # requests per second of modelled GPU time: what locality saves, whatever CPU the test machine lends the
    # emulators (with every backend saturated, as here, the pool's throughput is 4 x this)
    out = {"hit_rate": cached / prompt, "requests": len(rows), "per_gpu_s": len(rows) / busy,
           "service": service, "metrics": metrics,
           "predicted": [r["predicted_cached_tokens"] for r in rows], "cached": [r["cached_tokens"] for r in rows]}
    print(f"{policy}/{placement}: hit rate {out['hit_rate']:.2f}, {len(rows)} requests, "
          f"{out['per_gpu_s']:.1f} per GPU-second, service {service}")
    return out


def _when(value) -> datetime:
    when = datetime.fromisoformat(value) if isinstance(value, str) else value
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    db = tmp_path_factory.mktemp("locality") / "least-load.db"
    return asyncio.run(_run(f"sqlite:///{db}", "vtc", "least-load"))


async def test_dlpm_raises_hit_rate_and_throughput(baseline, tmp_path):
    dlpm = await _run(f"sqlite:///{tmp_path}/dlpm.db", "dlpm", "least-load")
    assert dlpm["hit_rate"] > baseline["hit_rate"] + 0.2, (dlpm["hit_rate"], baseline["hit_rate"])
    assert dlpm["per_gpu_s"] > 1.15 * baseline["per_gpu_s"], (dlpm["per_gpu_s"], baseline["per_gpu_s"])
    # DLPM alone over a shared queue (deficits per backend) is not checked for fairness here: measured 5-15 %
    # apart over three runs; within Thm 4.1's bound, which for this short run is far wider
    # the index's predictions were recorded beside the backends' reports, and mostly right
    predicted = [p for p in dlpm["predicted"] if p is not None]
    assert len(predicted) == dlpm["requests"]
    right = sum(abs(p - c) <= 16 for p, c in zip(dlpm["predicted"], dlpm["cached"]))
    assert right >= 0.8 * len(predicted), right / len(predicted)
    m = dlpm["metrics"]
    for series in ('fairgate_prefix_tokens_total{backend="emulated-0",kind="cached"}',
                   'fairgate_tenant_prefix_tokens_total{kind="cached",tenant="user:docs/a"}',
                   'fairgate_prefix_index_blocks{backend="emulated-3"}',
                   'fairgate_tenant_deficit{backend="emulated-1",tenant="user:docs/b"}'):
        assert series in m, series


@pytest.mark.parametrize("policy,placement", [("vtc", "prefix"), ("dlpm", "d2lpm")])
async def test_prefix_placements_raise_hit_rate(baseline, tmp_path, policy, placement):
    """Routing at arrival by prefix (Preble's rule under VTC's order; D²LPM: DoubleQ routing and DLPM on each
    backend, Algorithm 2) raises the hit rate and the throughput; D²LPM keeps the floods' service close."""
    run = await _run(f"sqlite:///{tmp_path}/{placement}.db", policy, placement)
    assert run["hit_rate"] > baseline["hit_rate"] + 0.2, (run["hit_rate"], baseline["hit_rate"])
    assert run["per_gpu_s"] > 1.1 * baseline["per_gpu_s"], (run["per_gpu_s"], baseline["per_gpu_s"])
    a, b = run["service"]["a"], run["service"]["b"]
    if placement == "d2lpm":  # DoubleQ spreads each client over the pool (finite Q^w), DLPM orders each backend
        assert abs(a - b) <= 0.25 * max(a, b), run["service"]
