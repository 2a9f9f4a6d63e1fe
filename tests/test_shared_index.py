"""Two gateway replicas share what they know of the backends' prefix caches: the approximate index through
Redis (each replica's dispatches), the precise one by subscribing to the same KV events."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack, asynccontextmanager

from fairgate.proxy.config import BackendConfig
from fairgate.engine.serve import start_emulator
from tests.conftest import gateway_config, run_gateway

REDIS = "redis://127.0.0.1:6379/0"
DOC = "Document shared: " + " ".join(f"item{i}" for i in range(300))
MSGS = [{"role": "system", "content": DOC}, {"role": "user", "content": "what does it say?"}]


@asynccontextmanager
async def _replicas(tmp_path, index: str):
    async with AsyncExitStack() as stack:
        events = "tcp://127.0.0.1:0" if index == "precise" else None
        emus = [await start_emulator(speed=20.0, seed=i, kv_events=events) for i in range(2)]
        for e in emus:
            stack.push_async_callback(e.stop)
        backends = [BackendConfig(url=e.url, name=f"gpu-{i}",
                                  kv_events=e.server.kv_events.endpoint if e.server.kv_events else None)
                    for i, e in enumerate(emus)]
        ns = f"t{uuid.uuid4().hex[:8]}"
        replicas = [await stack.enter_async_context(run_gateway(gateway_config(
            f"sqlite:///{tmp_path}/shared.db", policy="dlpm", backends=backends, redis_url=REDIS,
            redis_namespace=ns, health_interval_s=0.2, locality={"index": index}))) for _ in range(2)]
        await asyncio.sleep(0.3)  # health checks mark the backends up; SUB sockets connect
        client = replicas[0].client(await replicas[0].key("docs", user="u"))
        await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=4)
        backend = (await replicas[0].rows())[-1]["backend"]
        yield replicas, backend, emus[int(backend[-1])]


async def _holds(replica, backend: str, want: set[int]) -> bool:
    for _ in range(100):
        if set(replica.gateway.live.index._blocks.get(backend, ())) == want:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_the_approximate_index_is_shared_through_redis(tmp_path):
    async with _replicas(tmp_path, "approximate") as (replicas, backend, _):
        first, second = (r.gateway for r in replicas)
        learned = set(first.live.index._blocks[backend])
        assert len(learned) >= 20  # the document's blocks, from the dispatch
        assert await _holds(replicas[1], backend, learned)  # the second dispatched nothing itself
        assert not second.live.index._blocks.get(next(n for n in ("gpu-0", "gpu-1") if n != backend))
        assert second.live.shared_index.applied >= 1 and first.live.shared_index.published >= 1


async def test_replicas_follow_the_same_kv_events(tmp_path):
    async with _replicas(tmp_path, "precise") as (replicas, backend, emu):
        engine = set(emu.server.runner.engine.cache._lru)
        assert len(engine) >= 20
        for replica in replicas:  # both learn from the engine's events, not from the dispatch
            assert await _holds(replica, backend, engine)
            assert replica.gateway.live.shared_index is None  # nothing to exchange: the events are the truth
