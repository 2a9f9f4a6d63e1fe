"""DLPM's decision as the gateway makes it, against the full scan the simulator makes: the kept matches and
bests (policies/dlpm_best.py), CHECKREFILL's bookkeeping, and the generation a caller may skip a repeated ask
by."""

from __future__ import annotations

import random

import pytest

from fairgate.accounting.prefix import PrefixIndex, block_hashes
from fairgate.policies.dlpm import DLPM
from fairgate.policies.scheduler import nothing
from fairgate.policies.views import RequestView


@pytest.mark.parametrize("ttl", [None, 0.5])
def test_the_kept_bests_pick_what_the_full_scan_picks(ttl):
    """The gateway's DLPM keeps each windowed request's match per backend and each client's best (told by the
    index what changed); the simulator's rescans everything. On the same index and the same calls they make
    the same decisions, with eligibility (requests that fit), evictions, finishes that correct the charge,
    requests given up, windows of 1 to 12, and (``ttl``) blocks that expire unannounced: 150 seeded runs of 120
    steps (hypothesis's short lists rarely reach the states where a stale best would differ)."""
    decisions = 0
    for seed in range(150):
        rng = random.Random(seed)
        index = PrefixIndex(block_size=16, ttl_s=ttl)
        match = lambda v, b: index.cached_tokens(v.blocks, v.prompt_tokens, b, now)  # noqa: E731
        window = rng.randint(1, 12)
        kept, scan = DLPM(5000.0, match=match, window=window), DLPM(5000.0, match=match, window=window)
        index.listeners.append(kept.on_blocks)
        now, seq, waiting, running = 0.0, 0, [], []
        for _ in range(120):
            kind, client, prefix, backend = rng.randint(0, 3), rng.randint(0, 3), rng.randint(0, 2), rng.randint(0, 2)
            limit, b = rng.randint(40, 400), f"b{backend}"
            now += 0.05
            if kind == 0:  # an arrival: a shared prefix (3-5 blocks) and a tail of its own
                ids = [1000 * prefix + i for i in range(16 * (3 + prefix))] + [seq] * (4 + 16 * rng.randint(0, 9))
                v = RequestView(str(seq), f"c{client}", "a", "m", len(ids), 8, blocks=tuple(block_hashes(ids, 16)))
                seq += 1
                kept.add(v, now)
                scan.add(v, now)
                waiting.append(v)
            elif kind == 1:  # a backend with room for prompts up to ``limit`` tokens
                fits = lambda v: v.prompt_tokens <= limit  # noqa: E731
                a, c = kept.peek(now, fits, b), scan.peek(now, fits, b)
                assert (a and a.request_id) == (c and c.request_id), (seed, now)
                if a is not None:
                    decisions += 1
                    kept.pop(a, now, b)
                    scan.pop(c, now, b)
                    waiting.remove(a)
                    index.insert(a.blocks, b, now)
                    running.append(a)
            elif kind == 2 and running:  # a finish, the backend reporting its cached tokens
                r = running.pop(rng.randrange(len(running)))
                cached = 16 * rng.randint(0, 4)
                kept.on_finish(r, 3, now, r.prompt_tokens, cached_tokens=cached)
                scan.on_finish(r, 3, now, r.prompt_tokens, cached_tokens=cached)
            elif kind == 3 and waiting and rng.random() < 0.3:  # a client gives up
                r = waiting.pop(rng.randrange(len(waiting)))
                kept.remove(r, now)
                scan.remove(r, now)
            else:  # the backend's capacity shrinks or grows: evictions
                index.set_capacity(b, limit // 16)
        assert kept.memo and all(kept.deficits(f"b{k}") == scan.deficits(f"b{k}") for k in range(3))
    assert decisions > 2000



def test_a_refund_above_the_quantum_does_not_turn_checkrefill_into_a_charge():
    """A correction (the backend cached more than the index predicted) can leave a client's q above Q^u. An
    empty pick then must leave every deficit as it was: it once took a quantum *from* every indebted client
    (the refill count came out negative), each time a backend with nothing that fit was asked."""
    s = DLPM(1000.0)
    a, b = RequestView("a", "rich", "x", "m", 3000, 8), RequestView("b", "poor", "x", "m", 100, 8)
    s.add(a, 0.0)
    s.pop(a, 0.0)  # q_rich = -3000
    s.on_finish(a, 0, 0.0, 3000, cached_tokens=3000)  # the prompt was cached after all: +3000 → 0
    s.add(RequestView("a2", "rich", "x", "m", 10, 8), 0.0)
    s.add(b, 0.0)
    s.deficits()["rich"] = 2500.0  # above Q^u, as a refund may leave it
    s.deficits()["poor"] = -1500.0
    before = dict(s.deficits())
    assert s.peek(0.0, nothing) is None
    assert s.peek(0.0, lambda r: False) is None
    assert s.deficits() == before


def test_an_unchanged_generation_means_the_same_empty_answer():
    """``generation`` moves with the queues and the backend's deficits, so a caller that got nothing may skip
    asking again until it moves; ``nothing`` gives the answer a scan that found nothing gives."""
    s = DLPM(1000.0)
    for k in range(4):
        s.add(RequestView(str(k), f"c{k % 2}", "x", "m", 500, 8), 0.0)
    assert s.peek(0.0, nothing, "b0") is None
    g = s.generation("b0")
    assert s.peek(0.0, lambda r: False, "b0") is None and s.generation("b0") == g
    r = s.peek(0.0, None, "b0")
    s.pop(r, 0.0, "b0")
    assert s.generation("b0") != g
    g = s.generation("b0")
    s.on_tokens(r, 3, 0.0)  # a charge on b0
    assert s.generation("b0") != g and s.generation("b1")[0] == g[0]
