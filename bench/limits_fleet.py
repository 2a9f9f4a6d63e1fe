"""A token limit held live by a fleet: four gateway replicas sharing one Redis, 200
streaming clients spread over them, 20,000 tokens a minute for their app. Prints the tokens served in each
minute (the usage rows, by arrival) against the limit; ``--alone`` runs the same replicas without Redis (each
holds the limit by itself: about 4× gets through).

    .venv/bin/python bench/limits_fleet.py [--minutes 3] [--replicas 4] [--clients 200] [--tpm 20000] [--alone]
                                           [--mix]

``--mix``: each client sends streamed chat, Responses turns (continuing its conversation) and embeddings
batches alike, all counted against the one limit.

(tests/test_quota.py checks the same in simulated time over a real Redis, and tests/test_limits_fleet.py live
through two replicas and a Redis outage; this is the whole thing live, too long for the suite.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the tests' gateway harness)

from fairgate.engine.serve import start_emulator  # noqa: E402
from fairgate.proxy.config import BackendConfig  # noqa: E402
from fairgate.quota.quota_admin import set_quota  # noqa: E402
from tests.conftest import gateway_config, run_gateway  # noqa: E402


def request(rng: random.Random, mix: bool, previous: str | None) -> tuple[str, dict]:
    """A streamed chat completion; with ``mix``, as often a Responses turn (continuing the client's
    conversation two times in three) or an embeddings batch of four texts."""
    kind = rng.choice(("chat", "responses", "embeddings")) if mix else "chat"
    text = f"{rng.random()} tell me a story"
    if kind == "responses":
        return "/v1/responses", {"model": "sim-llama", "input": text, "max_output_tokens": rng.randint(20, 200),
                                 "previous_response_id": previous if rng.random() < 2 / 3 else None}
    if kind == "embeddings":
        return "/v1/embeddings", {"model": "sim-llama", "input": [text * rng.randint(1, 20) for _ in range(4)]}
    return "/v1/chat/completions", {"model": "sim-llama", "stream": True, "max_tokens": rng.randint(20, 200),
                                    "messages": [{"role": "user", "content": text}]}


async def client(url: str, key: str, stop: asyncio.Event, seed: int, statuses: dict[int, int],
                 mix: bool = False) -> None:
    rng, previous = random.Random(seed), None
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            path, body = request(rng, mix, previous)
            async with s.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                statuses[r.status] = statuses.get(r.status, 0) + 1
                if r.status == 429:  # as the official clients do: wait what retry-after says
                    await asyncio.sleep(min(float(r.headers["retry-after"]), 20.0) * rng.uniform(1.0, 1.2))
                    continue
                if path == "/v1/responses":
                    previous = (await r.json()).get("id") if r.status == 200 else None
                    continue
                async for _ in r.content:
                    pass


async def main(a: argparse.Namespace) -> None:
    db = f"sqlite+aiosqlite:///{tempfile.mkdtemp()}/fleet.db"
    redis = None if a.alone else "redis://127.0.0.1:6379/0"
    ns = f"bench{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        emus = [await start_emulator(speed=20.0, seed=i) for i in range(2)]
        for e in emus:
            stack.push_async_callback(e.stop)
        backends = [BackendConfig(url=e.url, name=f"gpu-{i}") for i, e in enumerate(emus)]
        gws = [await stack.enter_async_context(run_gateway(gateway_config(
            db, backends=backends, redis_url=redis, redis_namespace=ns))) for _ in range(a.replicas)]
        key = await gws[0].key("chat", user="ann")
        await set_quota(gws[0].admin, "chat", None, None, tpm=a.tpm)
        for gw in gws:
            await gw.gateway.tenants.refresh()
        stop, statuses = asyncio.Event(), {}
        start = time.time()
        tasks = [asyncio.create_task(client(gws[i % len(gws)].url, key, stop, i, statuses, a.mix))
                 for i in range(a.clients)]
        for m in range(a.minutes):
            await asyncio.sleep(60.0)
            print(f"minute {m + 1} of {a.minutes}: answers so far {dict(sorted(statuses.items()))}", flush=True)
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.sleep(1.0)
        rows = await gws[0].rows()
    minutes = [0] * a.minutes
    for r in rows:
        k = int((datetime.fromisoformat(r["arrival"]).timestamp() - start) // 60)
        if 0 <= k < a.minutes:
            minutes[k] += r["prompt_tokens"] + r["completion_tokens"]
    how = "each replica alone (no Redis)" if a.alone else "one Redis"
    what = "clients of chat, responses and embeddings" if a.mix else "streaming clients"
    print(f"{a.replicas} replicas, {how}, {a.clients} {what}, limit {a.tpm:,} tokens a minute")
    for k, served in enumerate(minutes):
        print(f"  minute {k + 1}: {served:,} tokens ({served / a.tpm:.3f}× the limit)")
    print(f"  answers: {dict(sorted(statuses.items()))}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--tpm", type=int, default=20_000)
    ap.add_argument("--alone", action="store_true", help="no Redis: each replica holds the limit by itself")
    ap.add_argument("--mix", action="store_true", help="chat, Responses turns and embeddings batches alike")
    asyncio.run(main(ap.parse_args()))
