"""The gateway and the simulator dispatch through one core (fairgate/policies/dispatch_core.py): the same
workload, sent through the live gateway (one emulated backend that runs one request at a time) and simulated
in gateway mode, is dispatched in the same order; a stochastic workload (Poisson arrivals, random lengths) gives
each user the same service within 5 %."""

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


# a stochastic workload: three users with Poisson arrivals and random lengths, together more than the backend
# serves, so that the policy's order decides who is served while it lasts
SPEED = 20.0  # the emulated backend runs this many times faster than the profile the simulator runs
RATES = {"a": 120.0, "b": 80.0, "c": 60.0}  # requests a second, live (the simulator's clock: / SPEED)
PER_USER = 40


def _stochastic(seed: int = 11) -> list[tuple[float, str, int, int]]:
    """(arrival in live seconds, user, prompt words, output tokens), by arrival."""
    import random

    rng, sent = random.Random(seed), []
    for user, rate in RATES.items():
        t = 0.0
        for _ in range(PER_USER):
            t += rng.expovariate(rate)
            sent.append((t, user, rng.randint(5, 60), rng.randint(8, 64)))
    return sorted(sent)


def _service_while_backlogged(order: list[tuple[str, int, int]], window=(0.0, 0.8)) -> dict[str, float]:
    """Each user's service (prompt + 2 × output tokens, the weighted cost) in a window of the dispatches in
    which every user has requests waiting — after the first arrivals, before the lightest user runs out —,
    summed after every dispatch: its cumulative service over that time, counted in dispatches (two requests
    served the other way round move it by one request's cost, not by the whole of both)."""
    out, so_far = dict.fromkeys(RATES, 0.0), dict.fromkeys(RATES, 0.0)
    for user, prompt, output in order[int(window[0] * len(order)):int(window[1] * len(order))]:
        so_far[user] += prompt + 2 * output
        for u in out:
            out[u] += so_far[u]
    return out


async def test_the_gateway_and_the_simulator_serve_each_user_alike_on_a_stochastic_workload(sqlite_url):
    sent = _stochastic()
    cfg = gateway_config(sqlite_url, policy="vtc", emulated={"count": 1, "max_num_seqs": 2, "speed": SPEED})
    async with run_gateway(cfg) as gw:
        keys = {u: await gw.key("app", user=u) for u in RATES}
        async with aiohttp.ClientSession() as s:
            async def one(at: float, user: str, words: int, out: int) -> None:
                await asyncio.sleep(at)
                body = {"model": "sim-llama", "max_tokens": out, "ignore_eos": True,
                        "messages": [{"role": "user", "content": "word " * words}]}
                async with s.post(f"{gw.url}/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {keys[user]}"}) as r:
                    assert r.status == 200, await r.text()

            await asyncio.gather(*(one(*x) for x in sent))
        rows = await gw.rows()
    live = [(r["user"], r["prompt_tokens"], r["completion_tokens"])
            for r in sorted(rows, key=lambda r: r["dispatched_at"])]
    assert len(live) == len(sent)

    # the same arrivals on the simulator's clock, with the prompts the backend counted (per user, in order)
    counted: dict[str, list[tuple[int, int]]] = {}
    for r in sorted(rows, key=lambda r: r["arrival"]):
        counted.setdefault(r["user"], []).append((r["prompt_tokens"], r["completion_tokens"]))
    requests, nth = [], dict.fromkeys(RATES, 0)
    for i, (at, user, _, _) in enumerate(sent):
        prompt, output = counted[user][nth[user]]
        nth[user] += 1
        requests.append(SimRequest(i, user, at * SPEED, prompt, output, app="app"))
    profile = replace(get_profile("a10g-llama2-7b"), max_num_seqs=2)
    out = simulator_for(Workload("stochastic", 600.0, requests), "vtc", "least-load", profile, mode="gateway",
                        backends=1, cost=make_cost("weighted")).run()
    simulated = [(r.client, r.prompt_len, r.output_len)
                 for r in sorted(out.requests, key=lambda r: (r.dispatched, r.id))]
    got, want = _service_while_backlogged(live), _service_while_backlogged(simulated)
    for user in RATES:
        assert abs(got[user] - want[user]) <= 0.05 * want[user], (user, got, want)
    # (and the measure tells policies apart: served in arrival order, the heaviest user would get far more)
    arrived = _service_while_backlogged([(r.client, r.prompt_len, r.output_len) for r in requests])
    assert arrived["a"] > 1.2 * want["a"], (arrived, want)
