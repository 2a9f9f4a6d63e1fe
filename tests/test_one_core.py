"""The gateway and the simulator dispatch through one core (fairgate/policies/dispatch_core.py): the same
workload, sent through the live gateway (one emulated backend that runs one request at a time) and simulated
in gateway mode, is dispatched in the same order."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp

from fairgate.accounting.cost import make_cost
from fairgate.engine.profiles import get_profile
from fairgate.sim.setup import simulator_for
from fairgate.sim.workload import SimRequest, Workload
from tests.conftest import gateway_config, run_gateway

# per user: how many requests, of how many words of prompt and how many output tokens
USERS = {"a": (6, 40, 60), "b": (6, 5, 12), "c": (6, 20, 30)}


async def test_the_gateway_and_the_simulator_dispatch_a_workload_in_the_same_order(sqlite_url):
    cfg = gateway_config(sqlite_url, policy="vtc", emulated={"count": 1, "max_num_seqs": 1, "speed": 10.0})
    async with run_gateway(cfg) as gw:
        keys = {u: await gw.key("app", user=u) for u in USERS}
        sent = [(u, words, out) for k in range(6) for u, (n, words, out) in USERS.items() if k < n]
        async with aiohttp.ClientSession() as s:
            async def one(user: str, words: int, out: int) -> None:
                auth = {"Authorization": f"Bearer {keys[user]}"}
                body = {"model": "sim-llama", "max_tokens": out, "ignore_eos": True,
                        "messages": [{"role": "user", "content": "word " * words}]}
                async with s.post(f"{gw.url}/v1/chat/completions", headers=auth, json=body) as r:
                    assert r.status == 200, await r.text()

            tasks = []
            for user, words, out in sent:  # arriving in this order, each queued before the next is sent
                tasks.append(asyncio.create_task(one(user, words, out)))
                while len(gw.gateway.dispatcher) + sum(1 for t in tasks if t.done()) < len(tasks) - 1:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.002)
            await asyncio.gather(*tasks)
        rows = sorted(await gw.rows(), key=lambda r: r["dispatched_at"])
    live = [r["user"] for r in rows]
    assert len(live) == len(sent)

    # the same requests in the simulator: arriving in the same order, with the prompts the backend counted
    counted = {}
    for r in rows:
        counted.setdefault(r["user"], []).append((r["prompt_tokens"], r["completion_tokens"]))
    requests, nth = [], dict.fromkeys(USERS, 0)
    for i, (user, _, _) in enumerate(sent):
        prompt, output = counted[user][nth[user]]
        nth[user] += 1
        requests.append(SimRequest(i, user, i * 0.001, prompt, output, app="app"))
    w = Workload("same", 600.0, requests)
    profile = replace(get_profile("a10g-llama2-7b"), max_num_seqs=1)
    out = simulator_for(w, "vtc", "least-load", profile, mode="gateway", backends=1,
                        cost=make_cost("weighted")).run()
    simulated = [r.client for r in sorted(out.requests, key=lambda r: (r.dispatched, r.id))]
    assert live == simulated, (live, simulated)
    assert live != [user for user, _, _ in sent]  # (the policy's order, not the arrivals': a b c b b c b a …)
