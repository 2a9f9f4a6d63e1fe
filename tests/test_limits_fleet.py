"""A token limit through two gateway replicas sharing one Redis, and Redis cut for 30 s under load
(docs/operations/limits.md#across-replicas): the limit holds within 2× on each replica's share, no request fails
for the outage (only 429s for the limit), and what was spent meanwhile reaches Redis once when it returns."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from datetime import datetime

import aiohttp
import pytest

from fairgate.engine.serve import start_emulator
from fairgate.proxy.config import BackendConfig
from fairgate.quota.quota_admin import set_quota
from tests.conftest import gateway_config, run_gateway
from tests.tcp_proxy import TcpProxy

TPM = 6_000


async def _client(url: str, key: str, stop: asyncio.Event, outcomes: list, seed: int) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            body = {"model": "sim-llama", "stream": True, "max_tokens": rng.randint(10, 60),
                    "messages": [{"role": "user", "content": f"{rng.random()} tell me"}]}
            async with s.post(url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                if r.status == 429:
                    outcomes.append((time.monotonic(), 429))
                    await asyncio.sleep(min(float(r.headers["retry-after"]), 2.0))
                    continue
                async for _ in r.content:
                    pass
                outcomes.append((time.monotonic(), r.status))


@pytest.mark.slow
@pytest.mark.alone  # (it judges tokens served in 4 s of real time: run on a quiet machine, tests/suite.py)
async def test_a_token_limit_holds_through_a_redis_outage(tmp_path):
    proxy = await TcpProxy("127.0.0.1", 6379).start()
    emu = await start_emulator(speed=50.0)
    db, ns = f"sqlite+aiosqlite:///{tmp_path}/fleet.db", f"t{uuid.uuid4().hex[:8]}"
    cfg = lambda: gateway_config(db, backends=[BackendConfig(url=emu.url, name="gpu")],  # noqa: E731
                                 redis_url=f"redis://127.0.0.1:{proxy.port}/0", redis_namespace=ns)
    try:
        async with run_gateway(cfg()) as a, run_gateway(cfg()) as b:
            key = await a.key("chat", user="ann")
            await set_quota(a.admin, "chat", None, None, tpm=TPM)
            for gw in (a, b):
                await gw.gateway.tenants.refresh()
            stop, outcomes = asyncio.Event(), []
            clients = [asyncio.create_task(_client((a, b)[i % 2].url, key, stop, outcomes, i)) for i in range(12)]
            await asyncio.sleep(5.0)
            t_cut = time.monotonic()
            await proxy.cut()
            await asyncio.sleep(30.0)
            assert not a.gateway.quotas.store.up and not b.gateway.quotas.store.up  # said so (/ready too)
            assert a.gateway.quotas.store.pending() > 0  # spent meanwhile, kept for Redis
            await proxy.start()
            t_back = time.monotonic()
            await asyncio.sleep(6.0)
            stop.set()
            await asyncio.gather(*clients)
            await asyncio.sleep(0.5)
            quotas = [gw.gateway.quotas.store for gw in (a, b)]
            assert all(q.up and q.pending() == 0 for q in quotas)  # applied once on return
            rows = await a.rows()  # (one database: every replica's rows)
    finally:
        await proxy.cut()
        await emu.stop()
    assert {status for _, status in outcomes} <= {200, 429}  # no request failed for the outage
    assert {r["status"] for r in rows} <= {"ok", "throttled", "cancelled"}
    served = lambda lo, hi: sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows  # noqa: E731
                                if lo <= datetime.fromisoformat(r["arrival"]).timestamp() < hi)
    wall = time.time() - time.monotonic()
    during = served(t_cut + wall, t_cut + 30 + wall)
    print(f"served: 5 s before {served(t_cut + wall - 5, t_cut + wall)}, 30 s cut {during}, "
          f"4 s after {served(t_back + wall + 2, t_back + wall + 6)}")
    assert 0 < during <= 2 * TPM / 2, during  # 30 s on the replicas' shares: within 2× of the limit's 3,000
    after = served(t_back + wall + 2, t_back + wall + 6)
    assert after <= 1.5 * TPM / 15, after  # and back in Redis, the fleet's meter again (4 s: 400 at the limit)
