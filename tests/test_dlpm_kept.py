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
    s.on_tokens(r, 3, 0.0)  # a charge on b0 that leaves c's credit there (1000 − 500 extend − 6): no move
    assert s.generation("b0") == g
    s.on_tokens(r, 300, 0.0)  # one that spends it: who has credit changed
    assert s.generation("b0") != g and s.generation("b1")[0] == g[0]


def test_a_kept_empty_answer_is_what_asking_again_gives():
    """The contract the simulator's gate skips by: after ``peek`` found nothing for a backend, asking again
    with the same ``eligible`` while ``generation`` has not moved finds nothing too, through arrivals, picks,
    charges that do and do not spend a client's credit, refunds, finishes and requests given up, in a window or
    behind a full one (300 seeded runs)."""
    skips = 0
    for seed in range(300):
        rng = random.Random(seed)
        s = DLPM(rng.choice([200.0, 1000.0, 5000.0]), window=rng.randint(1, 6))
        fits = {}  # request id → fits on b0 (fixed: only the policy moves)
        refused, running, n, added = None, [], 0, []
        for _ in range(80):
            op = rng.randint(0, 4)
            if op == 0:
                v = RequestView(str(n), f"c{rng.randint(0, 3)}", "a", "m", rng.randint(1, 600), 8)
                fits[v.request_id] = rng.random() < 0.3
                s.add(v, 0.0)
                added.append(v)
                n += 1
            elif op == 1 and running:
                v, g = rng.choice(running)
                g2 = g + rng.randint(1, 200)
                running[running.index((v, g))] = (v, g2)
                s.on_tokens(v, g2, 0.0)
            elif op == 2 and running:
                v, g = running.pop(rng.randrange(len(running)))
                s.on_finish(v, g, 0.0, v.prompt_tokens, cached_tokens=rng.randint(0, v.prompt_tokens))
            elif op == 3:
                v = s.peek(0.0, None, "b1")
                if v is not None:
                    s.pop(v, 0.0, "b1")
            elif n and rng.random() < 0.5:  # a waiting request given up (in its window or behind it)
                s.remove(added[rng.randrange(n)], 0.0)
            if refused is not None and s.generation("b0") == refused:
                skips += 1
                assert s.peek(0.0, lambda v: fits[v.request_id], "b0") is None
            v = s.peek(0.0, lambda v: fits[v.request_id], "b0")
            if v is None:
                refused = s.generation("b0")
            else:
                refused = None
                s.pop(v, 0.0, "b0")
                running.append((v, 0))
    assert skips > 1000


def test_a_block_refreshed_after_it_was_seen_expired_is_reported_whatever_time_the_insert_names():
    """The gateway's match reads the clock at each call; a dispatch inserts with the time its pump started, a
    little earlier. A block a match already saw expired, refreshed by such an insert, must still count as
    added (the index keeps time monotone), or the kept match stays short and the pick differs from the scan."""
    index = PrefixIndex(block_size=16, ttl_s=1.0)
    clock = [0.0]
    match = lambda v, b: index.cached_tokens(v.blocks, v.prompt_tokens, b, clock[0])  # noqa: E731
    kept, scan = DLPM(5000.0, match=match), DLPM(5000.0, match=match)
    index.listeners.append(kept.on_blocks)

    def view(rid, client, ids):
        return RequestView(rid, client, "a", "m", len(ids), 8, blocks=tuple(block_hashes(ids, 16)))

    r, s = view("R", "c1", list(range(64)) + [7]), view("S", "c2", [9] * 16 + list(range(100, 117)))
    index.insert(r.blocks[:2], "b", 0.0)
    index.insert(r.blocks[:1], "b", 0.5)
    index.insert(s.blocks[:1], "b", 0.5)
    for policy in (kept, scan):
        policy.add(s, 0.5)
        policy.add(r, 0.5)
    clock[0] = 1.05
    assert kept.peek(1.05, lambda v: False, "b") is None  # R's match kept at one block: its second expired
    index.insert(r.blocks[:2], "b", 0.99)  # the pump's time, before the clock the match read
    clock[0] = 1.1
    assert kept.peek(1.1, None, "b").request_id == scan.peek(1.1, None, "b").request_id == "R"


def test_a_backend_no_longer_asked_keeps_nothing_growing():
    """A backend asked once and then never again (down, removed): its kept state stays bounded by what waits
    now, however many requests come and clients go."""
    s = DLPM(1e9, window=2)
    s.on_blocks("b0", None)  # a match source that reports changes: the kept path
    for i in range(3):
        s.add(RequestView(str(i), "c", "a", "m", 10, 8), 0.0)
    s.peek(0.0, None, "b1")
    n = 3
    for i in range(5000):
        s.add(RequestView(str(n), "c", "a", "m", 10, 8), 0.0)
        n += 1
        r = s.peek(0.0, None, "b0")
        s.pop(r, 0.0, "b0")
        s.on_finish(r, 1, 0.0)
        if i % 5 == 0:  # other clients come and go
            v = RequestView(str(n), f"x{i}", "a", "m", 10, 8)
            n += 1
            s.add(v, 0.0)
            s.remove(v, 0.0)
    bests = s._bests
    kept_b1 = bests._kept.get("c", {}).get("b1")
    assert kept_b1 is None or len(kept_b1.pending) <= 2
    assert len(bests._dirty["b1"]) <= 1 and len(bests._memo) <= 1 and not bests._parked["b1"]


def test_a_versioned_eligible_gives_the_answers_of_asking_afresh():
    """A caller may give ``eligible`` a version (scheduler.version_of): DLPM then keeps each client's best
    under it and asks again only of the clients whose window changed. Against a twin asked afresh every time,
    the same picks on three backends, through arrivals, picks, charges, finishes, requests given up behind a
    window or in it, a window resized, and fit answers that change (each change a new version): 300 seeded
    runs."""
    picks = 0
    for seed in range(300):
        rng = random.Random(seed)
        quantum, window = rng.choice([200.0, 1000.0, 5000.0]), rng.randint(1, 6)
        kept, fresh = DLPM(quantum, window=window), DLPM(quantum, window=window)
        fits: dict[tuple[str, str], bool] = {}  # (backend, request id) → fits there, until it is redrawn
        version = {b: 0 for b in ("b0", "b1", "b2")}
        running, waiting, n = [], [], 0
        for _ in range(100):
            op, b = rng.randint(0, 5), f"b{rng.randint(0, 2)}"
            if op == 0:
                v = RequestView(str(n), f"c{rng.randint(0, 3)}", "a", "m", rng.randint(1, 600), 8)
                n += 1
                for s in (kept, fresh):
                    s.add(v, 0.0)
                waiting.append(v)
            elif op == 1:
                def answer(v, b=b):
                    return fits.setdefault((b, v.request_id), rng.random() < 0.4)
                versioned = lambda v: answer(v)  # noqa: E731
                versioned.version = (b, version[b])
                a, c = kept.peek(0.0, versioned, b), fresh.peek(0.0, answer, b)
                assert (a and a.request_id) == (c and c.request_id), seed
                if a is not None:
                    picks += 1
                    for s, r in ((kept, a), (fresh, c)):
                        s.pop(r, 0.0, b)
                    waiting.remove(a)
                    running.append(a)
            elif op == 2 and running:
                v, generated = rng.choice(running), rng.randint(1, 300)
                for s in (kept, fresh):
                    s.on_tokens(v, generated, 0.0)
            elif op == 3 and running:
                v = running.pop(rng.randrange(len(running)))
                for s in (kept, fresh):
                    s.on_finish(v, 300, 0.0, v.prompt_tokens, cached_tokens=0)
            elif op == 4 and waiting and rng.random() < 0.5:
                v = waiting.pop(rng.randrange(len(waiting)))
                for s in (kept, fresh):
                    s.remove(v, 0.0)
            elif op == 5:  # a backend's room moved: its answers are drawn again, under a new version
                if rng.random() < 0.1:
                    w = rng.randint(1, 6)
                    for s in (kept, fresh):
                        s.set_params(window=w)
                for key in [key for key in fits if key[0] == b]:
                    del fits[key]
                version[b] += 1
    assert picks > 1500
