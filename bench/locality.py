"""Locality speed: one DLPM decision over a backlogged pool, D²LPM's routing, and the prefix index at 1 M blocks.

    .venv/bin/python bench/locality.py [--clients 1000] [--backends 8] [--waiting 2] [--decisions 5000]

1. One DLPM decision as the gateway makes it (``peek`` for a backend with headroom, ``pop``, one generated
   token, the finish, the index insert of the dispatched prompt, and the client's next request arriving), with
   every client backlogged. Each client has its own 1,024-token prefix (64 blocks, its own salt) held by two of
   the backends, and a 64-token question of its own. A decision must not walk every queued request's chain for
   every backend: DLPM keeps each windowed request's match per backend and each client's best, and matches a
   request again only when blocks where its match stops are added there, or blocks inside it removed.
2. One D²LPM routing (``choose`` over every backend, with its match per backend).
3. The prefix index holding 1 M blocks (8 backends × 131,072): ``insert`` and ``match`` of a 64-block chain.
4. Precise mode: one KV event message (a ``BlockStored`` of 64 blocks, as vLLM sends it) decoded and folded
   into the index; with ``--tokenize-url URL --model NAME``, one ``/tokenize`` round trip to that backend (what
   ``locality.tokenize: backend`` adds to each request).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import aiohttp

from fairgate.accounting.kv_events import BlockStored, EventFold, KVEventBatch, decode, encode
from fairgate.accounting.prefix import PrefixIndex, block_hashes
from fairgate.policies.dlpm import DLPM
from fairgate.policies.locality import DoubleQ
from fairgate.policies.views import BackendView, RequestView

PREFIX, QUESTION, BS = 1024, 64, 16


def _request(seq: int, client: int, rng: random.Random) -> RequestView:
    ids = [client * 10_000 + i for i in range(PREFIX)] + [rng.randrange(1 << 30) for _ in range(QUESTION)]
    return RequestView(str(seq), f"c{client}", "app", "m", len(ids), 32,
                       blocks=tuple(block_hashes(ids, BS, f"salt-{client}")))


def _pool(clients: int, backends: int, waiting: int) -> tuple[PrefixIndex, list[list[RequestView]], random.Random]:
    rng = random.Random(0)
    index = PrefixIndex(BS)
    names = [f"b{k}" for k in range(backends)]
    queued = []
    for c in range(clients):
        reqs = [_request(c * waiting + j, c, rng) for j in range(waiting)]
        for b in (names[c % backends], names[(c * 7 + 3) % backends]):
            index.insert(reqs[0].blocks[:PREFIX // BS], b)
        queued.append(reqs)
    return index, queued, rng


def dlpm_decision(clients: int, backends: int, waiting: int, decisions: int, warm: int = 0) -> tuple[float, float]:
    index, queued, rng = _pool(clients, backends, waiting)
    s = DLPM(4000.0, match=lambda v, b: index.cached_tokens(v.blocks, v.prompt_tokens, b))
    index.listeners.append(s.on_blocks)
    for reqs in queued:
        for r in reqs:
            s.add(r, 0.0)
    seq = clients * waiting
    names = [f"b{k}" for k in range(backends)]
    # the arrivals, made before the clock starts (hashing a prompt is the request path's cost, not the policy's)
    asks = {c: [r.blocks for r in reqs] for c, reqs in enumerate(queued)}
    hits = 0
    t0 = time.perf_counter()
    for k in range(-warm, decisions):  # untimed: the first decisions match every queue, prefixes land everywhere
        if k == 0:
            hits, t0 = 0, time.perf_counter()
        b = names[k % backends]
        now = k * 1e-3  # a decision every millisecond
        req = s.peek(now, None, b)
        hits += index.cached_tokens(req.blocks, req.prompt_tokens, b) > 0
        s.pop(req, now, b)
        index.insert(req.blocks, b, now)
        s.on_tokens(req, 1, now)
        s.on_finish(req, 1, now)
        c = int(req.client[1:])
        s.add(RequestView(str(seq), req.client, "app", "m", req.prompt_tokens, 32, blocks=asks[c][seq % waiting]),
              now)
        seq += 1
    return (time.perf_counter() - t0) / decisions, hits / decisions


def d2lpm_route(clients: int, backends: int, decisions: int) -> float:
    index, queued, _ = _pool(clients, backends, 1)
    router = DoubleQ(lambda v, b: index.cached_tokens(v.blocks, v.prompt_tokens, b), 20_000.0)
    views = [BackendView(f"b{k}", 0.5, 0, 10_000) for k in range(backends)]
    t0 = time.perf_counter()
    for k in range(decisions):
        req = queued[k % clients][0]
        chosen = router.choose(req, views, float(k))
        router.on_finish(req, chosen.name, 32)
    return (time.perf_counter() - t0) / decisions


def index_at_a_million(backends: int = 8, per_backend: int = 131_072, ops: int = 20_000) -> tuple[float, float, int]:
    index = PrefixIndex(BS)
    rng = random.Random(1)
    names = [f"b{k}" for k in range(backends)]
    for b in names:
        index.set_capacity(b, per_backend)
    chains = []
    for k in range(backends * per_backend // 64):
        chain = [rng.randrange(1 << 62) for _ in range(64)]
        index.insert(chain, names[k % backends])
        chains.append(chain)
    size = len(index)
    probes = [(chains[(j := rng.randrange(len(chains)))], names[j % backends]) for _ in range(ops)]
    t0 = time.perf_counter()
    for chain, backend in probes:  # a chain on the backend that holds it (or held it: the oldest were evicted)
        index.match(chain, backend)
    match = (time.perf_counter() - t0) / ops
    fresh = [[rng.randrange(1 << 62) for _ in range(64)] for _ in range(ops)]
    t0 = time.perf_counter()
    for k in range(ops):  # 64 new blocks into a full backend: 64 evicted
        index.insert(fresh[k], names[k % backends], float(k))
    return match, (time.perf_counter() - t0) / ops, size


def fold_events(messages: int = 20_000) -> float:
    """One BlockStored message of 64 blocks (engine hashes are 64-bit ints, as vLLM's), decoded and folded."""
    rng = random.Random(2)
    frames = []
    for k in range(messages):
        tokens = [rng.randrange(4096) for _ in range(64 * BS)]
        event = BlockStored([rng.randrange(1 << 64) for _ in range(64)], None, tokens, BS, None, "GPU", None,
                            [[f"salt-{k % 100}"]] + [None] * 63)
        frames.append(encode(KVEventBatch(float(k), [event]), k))
    fold = EventFold(PrefixIndex(BS, precise=True), "b0")
    t0 = time.perf_counter()
    for k, f in enumerate(frames):
        fold.receive(*decode(f), now=float(k))
    return (time.perf_counter() - t0) / messages


async def tokenize_round_trip(url: str, model: str, n: int = 200) -> tuple[float, float]:
    doc = " ".join(f"w{i % 37}" for i in range(120))
    body = {"model": model, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": "q?"}],
            "add_generation_prompt": True}
    times = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url.rstrip("/") + "/tokenize", json=body) as r:
                assert r.status == 200, await r.text()
                await r.json()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[n // 2], times[int(n * 0.99)]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--waiting", type=int, default=2)
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--tokenize-url", help="a vLLM (or emulated) backend: time its /tokenize")
    ap.add_argument("--model", default="tiny")
    a = ap.parse_args()
    for n in sorted({10, a.clients}):
        cost, hit = dlpm_decision(n, a.backends, a.waiting, a.decisions)
        print(f"DLPM decision, {n:>5,} backlogged clients × {a.waiting} waiting, {a.backends} backends: "
              f"{cost * 1e6:8.1f} µs (a cached prefix chosen in {hit:.0%})")
    print(f"D²LPM routing over {a.backends} backends: {d2lpm_route(a.clients, a.backends, a.decisions) * 1e6:8.1f} µs")
    match, insert, size = index_at_a_million(a.backends)
    print(f"prefix index with {size:,} blocks: match of a 64-block chain {match * 1e6:.1f} µs, "
          f"insert {insert * 1e6:.1f} µs")
    print(f"KV events: one 64-block BlockStored decoded and folded into the index: {fold_events() * 1e6:.1f} µs")
    if a.tokenize_url:
        p50, p99 = asyncio.run(tokenize_round_trip(a.tokenize_url, a.model))
        print(f"/tokenize round trip at {a.tokenize_url} (a ~330-token chat): p50 {p50 * 1e3:.2f} ms, "
              f"p99 {p99 * 1e3:.2f} ms")
