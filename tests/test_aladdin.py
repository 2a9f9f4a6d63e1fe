"""Aladdin's placement (policies/aladdin.py): the paper's unit example (Fig. 3), the ATGT
context budget (Eq. 4), and the placement in the simulator's gateway mode."""

from __future__ import annotations

import math

import pytest

from fairgate.accounting.latency import LatencyModel
from fairgate.policies.aladdin import Aladdin
from fairgate.policies.kv_profile import future_kv_fits as _future_kv_fits
from fairgate.policies.placement import LeastLoad
from fairgate.policies.views import BackendView, RequestView

FLAT = LatencyModel(k1=0.0, c1=0.0, k2=1e-9, c2=0.0, c3=0.0)  # latency never binds: KV alone decides


def _peak(batch: list[tuple[int, int, int]]) -> int:
    """The largest KV the batch holds in any iteration (kv(t) = t, every request from iteration 0)."""
    return max(sum(l_in + k for l_in, _, total in batch if k <= total) for k in range(max(t for *_, t in batch) + 1))


def test_figure_3_least_load_overflows_where_aladdin_pairs_long_prompts_with_long_outputs():
    """A4: two workers of M = 9 KV units, one per token; long-prompt requests LP = (l_in 4, l_out 1) and
    long-output LO = (1, 4) arrive LP, LO, LP, LO and are dispatched at once. JSQ alternates, so LP goes with LP
    and LO with LO, each pair peaking at 10 > 9; Aladdin's future-KV fit (e) pairs LP with LO: peak 7."""
    lp, lo = (4, 0, 1), (1, 0, 4)
    assert _peak([lp, lp]) == _peak([lo, lo]) == 10 and _peak([lp, lo]) == 7
    assert not _future_kv_fits([lp, lp], 9) and not _future_kv_fits([lo, lo], 9) and _future_kv_fits([lp, lo], 9)

    def requests():
        for k, (l_in, l_out) in enumerate([(4, 1), (1, 4), (4, 1), (1, 4)]):
            yield RequestView(f"r{k}", "c", "app", "m", l_in, l_out)

    def place(placement) -> dict[str, list[tuple[int, int, int]]]:
        held: dict[str, list[tuple[int, int, int]]] = {"w0": [], "w1": []}
        for r in requests():
            views = [BackendView(name, len(batch), 0, 9) for name, batch in held.items()]
            held[placement.choose(r, sorted(views, key=lambda v: v.inflight), 0.0).name].append(
                (r.prompt_tokens, 0, r.max_tokens))
        return held

    jsq = place(LeastLoad())  # (least in flight first: JSQ)
    assert sorted(max(_peak(b), 0) for b in jsq.values()) == [10, 10]
    aladdin = place(Aladdin(FLAT))
    assert all(_peak(batch) == 7 for batch in aladdin.values())


def test_the_atgt_budget_bounds_the_context_a_backend_takes():
    """(b): Σ (l_in + γ·l_pred) ≤ θ·(T_dec − c3 − c2·b)/k2. With k2 = 1 µs per context token, c3 = 10 ms, a
    20 ms ATGT and θ = 1, a backend holds 10,000 tokens of weighted context; the next request goes elsewhere, and
    with no backend left it waits (None). The paper's best fit (``pack=1``) fills one backend first; the default
    takes the least full feasible one."""
    model = LatencyModel(k1=0.0, c1=0.0, k2=1e-6, c2=0.0, c3=0.010)
    assert model.context_budget(4, 0.020) == pytest.approx(10_000)
    views = [BackendView("a", 0, 0, None), BackendView("b", 0, 0, None)]
    spread = Aladdin(model, atgt_s=0.020, theta=1.0, gamma=0.5)
    placed = [spread.choose(RequestView(f"r{k}", "c", "app", "m", 3000, 2000), views, 0.0) for k in range(5)]
    assert [p.name if p else None for p in placed] == ["a", "b", "a", "b", None]
    a = Aladdin(model, atgt_s=0.020, theta=1.0, gamma=0.5, pack=1)
    placed = [a.choose(RequestView(f"r{k}", "c", "app", "m", 3000, 2000), views, 0.0) for k in range(5)]
    # each takes 3,000 + 0.5 × 2,000 = 4,000: two per backend fit 8,000 ≤ 10,000, a third would not
    assert [p.name if p else None for p in placed] == ["a", "a", "b", "b", None]
    a.on_finish(RequestView("r0", "c", "app", "m", 3000, 2000), "a", 2000)
    assert a.choose(RequestView("r9", "c", "app", "m", 3000, 2000), views, 0.0).name == "a"


def test_the_simulator_runs_aladdin_in_gateway_mode_only(tmp_path):
    from fairgate.accounting.cost import make_cost
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.workload import from_dict

    doc = {"duration_s": 30, "seed": 1, "slo": {"ttft_s": 5.0, "atgt_s": 0.08}, "clients": [
        {"id": "a", "arrival": {"kind": "poisson", "rate": 2}, "input_tokens": 500, "output_tokens": 100}]}
    w = from_dict(doc)
    with pytest.raises(ValueError, match="gateway mode"):
        simulator_for(w, "vtc", "aladdin", get_profile("a10g-llama2-7b"), backends=2, cost=make_cost("weighted"))
    sim = simulator_for(w, "vtc", "aladdin", get_profile("a10g-llama2-7b"), mode="gateway", backends=2,
                        cost=make_cost("weighted"))
    sim.run()
    assert all(r.finished is not None for r in w.requests)
    assert sim.placement.ledger("0") == sim.placement.ledger("1") == 0  # every request left its ledger
    assert sim.placement.lengths.mean("a", 0, 500) == pytest.approx(100, rel=0.2)  # learnt from finishes
    assert math.isfinite(sim.placement.predicted(w.requests[0] and sim.views["0"]))


def test_a_request_no_backend_could_ever_serve_in_time_does_not_block_the_queue():
    """A prompt whose prefill alone exceeds the TTFT target would wait forever, and the queue behind it: it
    goes to the least loaded backend instead (served late), while one that only has to wait for room waits."""
    model = LatencyModel(k1=1e-4, c1=0.0, k2=1e-6, c2=0.0, c3=0.010)
    a = Aladdin(model, atgt_s=0.020, ttft_s=0.4)
    views = [BackendView("a", 3, 0, None), BackendView("b", 1, 0, None)]
    assert a.choose(RequestView("long", "c", "app", "m", 8000, 10), views, 0.0).name == "b"  # 0.8 s of prefill
    # 3,000 + 0.5 × 9,000 = 7,500 weighted tokens, within the 0.9 × 10,000 budget alone but not beside another
    assert a.choose(RequestView("r0", "c", "app", "m", 3000, 9000), views, 0.0).name == "a"
    assert a.choose(RequestView("r1", "c", "app", "m", 3000, 9000), views, 0.0) is None  # it waits for room


def test_a_refusal_stands_until_what_it_rests_on_moves():
    """``waits``: a request refused on every backend it was offered is refused again, without its views, until
    a request is placed or finishes there, its prediction moves, a later heartbeat's view could turn a refusal,
    or its TTFT target could no longer be met even alone (then the answer turns: it goes to the least loaded
    backend)."""
    model = LatencyModel(k1=1e-4, c1=0.0, k2=1e-6, c2=0.0, c3=0.010)
    views = [BackendView("a", 1, 0, None)]
    for ttft in (0.4, 0.7):
        a = Aladdin(model, atgt_s=0.020, ttft_s=ttft, heartbeat_s=0.01)
        r0, r1 = (RequestView(f"r{k}", "c", "app", "m", 3000, 9000) for k in range(2))  # 0.3 s of prefill
        assert a.choose(r0, views, 0.0).name == "a"
        # 0.4 s: (c), r0's prefill is ahead of it; 0.7 s: (b), the two would hold more context than the ATGT allows
        assert a.choose(r1, views, 0.0) is None
        assert a.waits(r1, ["a"], 0.005) and not a.waits(r1, ["a", "b"], 0.005)  # (b was not asked)
        assert not a.waits(r0, ["a"], 0.005)  # (another request's)
        assert a.waits(r1, ["a"], 0.05)  # the views retaken since refuse it as well
        if ttft == 0.4:  # 0.4 − 0.3 s: past 0.1 s it cannot meet its TTFT even alone
            assert a.waits(r1, ["a"], 0.099) and not a.waits(r1, ["a"], 0.1001)
            assert a.choose(r1, views, 0.0999) is None and a.choose(r1, views, 0.1001).name == "a"
        else:
            assert a.waits(r1, ["a"], 0.31)
            a.lengths.observe("app", 0, 3000, 50)
            assert a.waits(r1, ["a"], 0.315)  # a length learnt that leaves its prediction as it was
            for _ in range(20):
                a.lengths.observe("app", 0, 3000, 50)
            assert not a.waits(r1, ["a"], 0.315)  # its prediction moved (to 50 tokens)
            assert a.choose(r1, views, 0.315) is None and a.waits(r1, ["a"], 0.35)  # ((d) now: r0 decodes)
            a.on_finish(r0, "a", 9000)
            assert not a.waits(r1, ["a"], 0.35) and a.choose(r1, views, 0.35).name == "a"  # room again


def test_a_new_gamma_reaches_what_the_request_could_meet_alone():
    """What a waiting request could meet alone is kept while it waits, but not across a parameter change: γ
    counts its predicted output in (b), so a raised γ can leave it unable to meet its ATGT even alone, and it
    goes to the least loaded backend as with that γ from the start (a review found the kept answer stale)."""
    model = LatencyModel(k1=1e-5, c1=0.0, k2=1e-5, c2=0.0, c3=0.010)
    views = [BackendView("a", 1, 0, None)]
    r0, r1 = (RequestView(f"r{k}", "c", "app", "m", 500, 900) for k in range(2))
    a = Aladdin(model, atgt_s=0.02, gamma=0.0)
    assert a.choose(r0, views, 0.0).name == "a"
    assert a.choose(r1, views, 0.001) is None  # (b) beside r0; alone, at γ 0, it would meet its ATGT
    a.set_params(gamma=1.0)  # alone now: 1e-5 × (500 + 900) + 0.010 > 0.020
    assert a.choose(r1, views, 0.5).name == "a"
    fresh = Aladdin(model, atgt_s=0.02, gamma=1.0)
    assert fresh.choose(r0, views, 0.0).name == "a" and fresh.choose(r1, views, 0.5).name == "a"


@pytest.mark.parametrize("seed", range(8))
def test_a_kept_refusal_is_the_answer_a_fresh_decision_gives(seed):
    """A refusal kept (``waits``) across heartbeats answers as deciding afresh at every event does, views
    retaken: one Aladdin keeps refusals, one does not, both see the same arrivals, decisions and finishes on
    backends of two speeds, with ATGT targets above and below their decode steps (the (d) bound's two cases),
    long prompts in bursts, short outputs that outlive their predictions (re-predictions), a small KV; every
    answer, and every prediction held, is the same."""
    import random

    rng = random.Random(seed)
    fast = LatencyModel(k1=8e-5, c1=0.01, k2=2e-7, c2=2e-4, c3=0.008)
    slow = LatencyModel(k1=1.6e-4, c1=0.02, k2=4e-7, c2=4e-4, c3=0.016)
    models = {"a": fast, "b": fast, "c": slow}
    params = dict(theta=rng.choice([0.5, 0.9, 1.0]), pack=rng.choice([0, 1]), heartbeat_s=0.01,
                  default_output=rng.choice([20, 200]))
    kept, fresh = Aladdin(models.__getitem__, **params), Aladdin(models.__getitem__, **params)
    fresh.keeps_refusals = False
    capacity = rng.choice([None, 30_000])
    views = [BackendView(name, 0, 0, capacity) for name in models]
    queue: list[RequestView] = []
    placed: list[tuple[RequestView, str]] = []
    t, skipped, n = 0.0, 0, 0
    for _ in range(3000):
        t += rng.expovariate(1 / 0.006)
        for _ in range(rng.choice([0] * 12 + [1, 1, 3])):  # (bursts: prefills in flight together)
            n += 1
            queue.append(RequestView(f"r{n}", "c", "app", "m", rng.choice([200, 1500, 4000]),
                                     rng.choice([30, 300, 1500]), arrival=t,
                                     ttft_s=rng.choice([0.4, 1.5]), atgt_s=rng.choice([0.012, 0.03, 0.1])))
        if placed and rng.random() < 0.08:
            r, backend = placed.pop(rng.randrange(len(placed)))
            generated = rng.randint(1, 2 * r.max_tokens)
            for a in (kept, fresh):
                a.on_finish(r, backend, generated)
        if queue:
            skipped += kept.waits(queue[0], [v.name for v in views], t)
            got = [a.choose(queue[0], views, t) for a in (kept, fresh)]
            assert [v and v.name for v in got] == [v and v.name for v in got[::-1]], (t, queue[0])
            if got[0] is not None:
                placed.append((queue.pop(0), got[0].name))
            assert predictions(kept) == predictions(fresh), t  # (re-predictions made at the same views)
    assert skipped > 50 and len(placed) > 5, (skipped, len(placed))


def predictions(a: Aladdin) -> dict[str, int]:
    return {rid: s.l_pred for led in a._ledgers.values() for rid, s in led.sent.items()}


def test_the_kept_kv_profile_answers_as_a_brute_force_walk_through_adds_and_removes():
    """(e) is checked against a profile kept up to date as requests come and go (policies/aladdin.py
    ``_Profile``); after any sequence of adds and removes it answers as walking every future iteration does."""
    import random

    from fairgate.policies.kv_profile import KVProfile as _Profile

    def brute(items: list[tuple[int, int]], end: int, start: int, capacity: int) -> bool:
        everyone = [*items, (end, start)]
        return all(sum(s + k for e, s in everyone if e >= k) <= capacity
                   for k in range(max(e for e, _ in everyone) + 1) if any(e >= k for e, _ in everyone))

    rng = random.Random(7)
    for _ in range(200):
        capacity = rng.randint(20, 200)
        items = [(rng.randint(0, 30), rng.randint(0, 30)) for _ in range(rng.randint(0, 8))]
        profile = _Profile(list(items), capacity)
        for _ in range(10):
            if items and rng.random() < 0.4:
                gone = items.pop(rng.randrange(len(items)))
                profile.remove(*gone)
            else:
                new = (rng.randint(0, 30), rng.randint(0, 30))
                items.append(new)
                profile.add(*new)
            probe = (rng.randint(0, 30), rng.randint(0, 30))
            assert profile.fits(*probe) == brute(items, *probe, capacity), (items, probe, capacity)


def test_what_could_block_the_queue_does_not():
    """Found by review: a request that fits no backend's KV even alone is sent on (the backend refuses what it
    cannot hold) rather than held forever with its model's queue behind it; a stream running past its
    predicted length does not turn the decode slack of (d) negative for everyone after it; a fitted k2 ≤ 0
    does not make the ATGT budget infinite when the step already misses the target; and a request placed
    twice leaves the first backend's ledger."""
    model = LatencyModel(k1=1e-5, c1=0.0, k2=1e-6, c2=0.0, c3=0.010)
    a = Aladdin(model, atgt_s=0.020, ttft_s=1.0)
    views = [BackendView("a", 0, 0, 1000), BackendView("b", 0, 0, 1000)]
    huge = RequestView("huge", "c", "app", "m", 500, 2**31 - 1)  # max_tokens read until a mean is learnt
    assert a.choose(huge, views, 0.0) is not None
    a.on_finish(huge, "a", 10)
    # one stream, predicted 10 tokens, still running at t = 5 s (~400 tokens at ~11 ms a step): new requests
    # still fit beside it
    lengths = Aladdin(model, atgt_s=0.020, ttft_s=1.0)
    for k in range(30):
        lengths.lengths.observe("app", 0, 100, 10)
    lengths.choose(RequestView("long", "c", "app", "m", 100, None), views[:1], 0.0)
    assert lengths.choose(RequestView("new", "c", "app", "m", 100, None), views[:1], 5.0) is not None
    negative = LatencyModel(k1=0.0, c1=0.0, k2=-1e-9, c2=0.006, c3=0.040)  # k2 fitted < 0: 46 ms alone, 52 ms
    assert negative.context_budget(2, 0.050) == -math.inf and negative.context_budget(2, 0.1) == math.inf  # by 2
    b = Aladdin(negative, atgt_s=0.050)
    placed = [b.choose(RequestView(f"r{k}", "c", "app", "m", 10, 10), views[:1], 0.0) for k in range(3)]
    assert placed[0] is not None and placed[1:] == [None, None]  # (the others wait: each would fit alone)
    again = Aladdin(FLAT)
    r = RequestView("x", "c", "app", "m", 10, 10)
    again.choose(r, views[:1], 0.0)
    again.choose(r, views[1:], 0.0)  # placed again, elsewhere
    assert (again.ledger("a"), again.ledger("b")) == (0, 1)
    again.choose(r, views[1:], 0.0)  # and again on the same one, its only request
    assert again.ledger("b") == 1


def test_a_ttft_target_counts_the_time_already_waited():
    model = LatencyModel(k1=1e-4, c1=0.0, k2=1e-6, c2=0.0, c3=0.010)
    a = Aladdin(model, ttft_s=0.5, pack=1)
    views = [BackendView("a", 3, 0, None), BackendView("b", 1, 0, None)]
    fresh = RequestView("fresh", "c", "app", "m", 3000, 10, arrival=10.0)  # 0.3 s of prefill
    a.choose(RequestView("first", "c", "app", "m", 1000, 10), views[:1], 10.0)
    assert a.choose(fresh, views, 10.0).name == "a"  # 0.1 + 0.3 s of prefills there: within 0.5 s
    late = RequestView("late", "c", "app", "m", 3000, 10, arrival=9.7)  # waited 0.3 s already: 0.2 s left
    assert a.choose(late, views, 10.0).name == "b"  # could not make it even alone: served late, least loaded


def test_a_prompt_whose_prefill_just_fits_its_ttft_goes_where_nothing_decodes():
    """(c) counts the decode step in progress: where a stream decodes, a new prefill starts when that step
    ends. A prompt of 0.39 s of prefill under a 0.4 s target meets it only on an idle backend; one of 0.2 s
    meets it anywhere, and (best fit) joins the busy one."""
    model = LatencyModel(k1=1e-4, c1=0.0, k2=1e-6, c2=0.0, c3=0.012)  # a 12 ms step, and some
    a = Aladdin(model, atgt_s=0.5, ttft_s=0.4, pack=1)
    views = [BackendView("busy", 1, 0, None), BackendView("idle", 0, 0, None)]
    a.choose(RequestView("s", "c", "app", "m", 100, 500), views[:1], 0.0)  # decoding from 0.01 s on
    assert a.choose(RequestView("long", "c", "app", "m", 3900, 10, arrival=1.0), views, 1.0).name == "idle"
    assert a.choose(RequestView("short", "c", "app", "m", 2000, 10, arrival=1.0), views, 1.0).name == "busy"
    # behind a prefill not yet done, too: the engine decodes once after it before it admits again (found by
    # review: a 3,900-token prompt placed behind a 100-token one missed 0.4 s by 6 ms)
    b = Aladdin(model, atgt_s=0.5, ttft_s=0.4, pack=1)
    b.choose(RequestView("a", "c", "app", "m", 100, 10), views[:1], 0.0)
    assert b.choose(RequestView("b", "c", "app", "m", 3850, 10, arrival=0.001), views, 0.001).name == "idle"


def test_in_simulation_a_pool_of_two_speeds_is_placed_as_live():
    """The workload key ``speeds:`` makes a heterogeneous pool (engine k runs speeds[k] × the profile), and
    Aladdin gets each engine's own model: the simulated twin of tests/test_aladdin_live.py (two engines at the
    profile's pace, two at half of it, a 55 ms ATGT class, half ~1,000-token prompts) keeps the class on the
    fast pair where least-load sends the slow pair its share."""
    from fairgate.accounting.cost import make_cost
    from fairgate.engine.profiles import get_profile
    from fairgate.sim import report
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.workload import WorkloadError, from_dict

    doc = {"duration_s": 60, "seed": 3, "speeds": [1, 1, 0.5, 0.5], "slo": {"ttft_s": 2.0, "atgt_s": 0.055},
           "clients": [{"id": c, "arrival": {"kind": "poisson", "rate": 1.5}, "input_tokens": n,
                        "output_tokens": {"dist": "uniform", "low": 20, "high": 40}}
                       for c, n in (("long", 1000), ("short", 40))]}
    out = {}
    for placement in ("least-load", "aladdin"):
        w = from_dict(doc)
        sim = simulator_for(w, "vtc", placement, get_profile("a10g-llama2-7b"), mode="gateway", backends=4,
                            cost=make_cost("weighted"))
        assert [p.c3 for p in sim.profiles] == pytest.approx([0.037, 0.037, 0.074, 0.074])
        done = report.build(sim.run(), "vtc", placement, make_cost("weighted"))
        slow = sum(r.backend in (2, 3) for r in w.requests if r.finished is not None) / len(w.requests)
        out[placement] = (done["slo"]["attainment"], slow)
    print(out)
    assert out["aladdin"][0] >= 0.95 and out["aladdin"][0] > out["least-load"][0] + 0.2, out
    assert out["aladdin"][1] < 0.05 < out["least-load"][1], out
    for bad in ([], [0], [1, "2"], "fast", [True]):
        with pytest.raises(WorkloadError, match="speeds"):
            from_dict({**doc, "speeds": bad})
    with pytest.raises(ValueError, match="gateway mode"):
        simulator_for(from_dict(doc), "vtc", "least-load", get_profile("a10g-llama2-7b"), backends=1,
                      cost=make_cost("weighted"))


def test_a_request_that_outlives_its_predicted_length_is_predicted_anew():
    """Algorithm 2's underestimate (§4.3): 9 of 10 answers of this app are 100 tokens, 1 is 1,000, so a new
    request is predicted ≈ 190. One that has had time for 300 tokens is among the long ones: E[L | L > 300] ≈
    1,000, and the backend's ATGT budget (b) counts that from the next view on, refusing a prompt it would
    otherwise take (it waits). Never past the request's own max_tokens."""
    from fairgate.accounting.length import OutputLengths

    lengths = OutputLengths()
    for k in range(100):
        lengths.observe("app", 0, 100, 1000 if k % 10 == 0 else 100)
    assert lengths.mean_beyond("app", 0, 100, 300) == pytest.approx(1000, rel=0.1)
    model = LatencyModel(k1=0.0, c1=0.0, k2=1e-6, c2=0.0, c3=0.010)  # 10,000 context tokens at 20 ms, b ≥ 2
    views = [BackendView("a", 0, 0, None)]

    def placed(cap: int) -> list[str | None]:
        a = Aladdin(model, atgt_s=0.020, theta=1.0, gamma=1.0, lengths=lengths)
        first = a.choose(RequestView("long", "c", "app", "m", 100, cap), views, 0.0)
        out = [first.name if first else None]
        for k, now in enumerate((0.5, 3.5)):  # 0.5 s of decoding at 10.1 ms a step: 49 tokens; 3.5 s: 346
            nxt = a.choose(RequestView(f"doc{k}", "c", "app", "m", 9000, 2000), views, now)
            out.append(nxt.name if nxt else None)
            if nxt is not None:
                a.refund(RequestView(f"doc{k}", "c", "app", "m", 9000, 2000), nxt.name)
        return out

    # a 9,000-token prompt (itself predicted ≈ 190) fits beside the long one as predicted (≈ 290 tokens of it)
    # at 0.5 s, not once it is re-predicted at 1,100 at 3.5 s
    assert placed(cap=4000) == ["a", "a", None]
    assert placed(cap=400) == ["a", "a", "a"]  # (its max_tokens bounds the re-prediction: 100 + 400 fits)
    # live, the tokens a stream has actually produced are read instead of the time it had: one held up in its
    # backend's queue (30 tokens in 3.5 s) has not outlived its prediction, and is not re-predicted
    streamed = Aladdin(model, atgt_s=0.020, theta=1.0, gamma=1.0, lengths=lengths, progress=lambda rid: 30)
    streamed.choose(RequestView("long", "c", "app", "m", 100, 4000), views, 0.0)
    assert streamed.choose(RequestView("doc", "c", "app", "m", 9000, 2000), views, 3.5).name == "a"
    assert streamed._ledgers["a"].sent["long"].l_pred < 300
    a = Aladdin(model, atgt_s=0.020, theta=1.0, gamma=1.0, lengths=lengths)
    long = RequestView("long", "c", "app", "m", 100, 4000)
    a.choose(long, views, 0.0)
    a.choose(RequestView("short", "c", "app", "m", 100, 4000), views, 3.4)  # (its view re-predicts "long")
    assert a._ledgers["a"].sum_pred == a._ledgers["a"].sent["long"].l_pred + a._ledgers["a"].sent["short"].l_pred
    assert a._ledgers["a"].sent["long"].l_pred > 900
    a.on_finish(long, "a", 1000)
    a.on_finish(RequestView("short", "c", "app", "m", 100, 4000), "a", 100)
    assert a._ledgers == {} and a._where == {}  # (nothing left behind by the re-prediction)


def test_the_mean_beyond_counts_a_bucket_for_its_part_above_what_was_generated():
    """E[L | L > l] from the histograms: lengths spread over 100-199 have a mean beyond 150 of about 175;
    beyond them all, nothing (None); an app's all-prompts histogram answers where the prompt's bucket has
    nothing that long."""
    from fairgate.accounting.length import OutputLengths

    lengths = OutputLengths()
    for k in range(1000):
        lengths.observe("app", 0, 100, 100 + k % 100)
    assert lengths.mean_beyond("app", 0, 100, 150) == pytest.approx(175, rel=0.05)
    assert lengths.mean_beyond("app", 0, 100, 99) == pytest.approx(150, rel=0.05)
    assert lengths.mean_beyond("app", 0, 100, 250) is None
    for _ in range(30):
        lengths.observe("app", 0, 5000, 2000)  # long prompts, long answers: another bucket
    assert lengths.mean_beyond("app", 0, 100, 250) == pytest.approx(2000, rel=0.1)


def test_power_of_two_sends_each_request_to_the_less_loaded_of_two_drawn_at_random():
    """Fig. 12's baseline: two backends at random (the seed's draws), the one with less predicted work (prompt
    + predicted output of what it holds) takes the request; finishing gives the work back."""
    import random

    from fairgate.policies.power_of_two import PowerOfTwo

    views = [BackendView(name, 0, 0, None) for name in "abcd"]
    p, draws, load = PowerOfTwo(seed=1), random.Random(1), dict.fromkeys("abcd", 0)
    placed = []
    for k in range(60):
        size = 50 + 37 * (k % 7)  # requests of different sizes, so the loads differ
        first, second = (views[i].name for i in draws.sample(range(4), 2))
        expected = second if load[second] < load[first] else first
        got = p.choose(RequestView(f"r{k}", "c", "app", "m", size, 100), views, 0.0).name
        assert got == expected, k
        load[got] += size + 100
        placed.append((k, got, size))
    assert p._load == {n: v for n, v in load.items() if v}
    for k, name, size in placed:
        p.on_finish(RequestView(f"r{k}", "c", "app", "m", size, 100), name, 100)
    assert p._load == {} and p._placed == {}


def test_the_papers_best_fit_meets_99_percent_with_under_0_7_of_least_loads_workers():
    """Acceptance check A11 at its lowest rate (the whole sweep, 5-40 req/s, is `fairgate plan` in
    docs/policies/aladdin.md): five minutes of the Azure conversation trace at 5 req/s, Table 2's targets.
    Aladdin's best fit with θ 0.5 meets 99 % on 10 workers; least-load misses it on 15 (so it needs more than
    10 / 0.7) and meets it on 24."""
    from fairgate.accounting.cost import make_cost
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.planner import rescale
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.targets import summary
    from fairgate.sim.workload import from_dict

    def attainment(placement: str, workers: int, **params) -> float:
        w = rescale(from_dict({"duration_s": 300, "engine": "a100-llama2-7b",
                               "slo": {"ttft_s": 0.4, "atgt_s": 0.015},
                               "trace": {"path": "azure-2023-conv.csv", "format": "azure", "clients": 10}}), 5.0)
        simulator_for(w, "vtc", placement, get_profile("a100-llama2-7b"), mode="gateway", backends=workers,
                      cost=make_cost("weighted"), params=params).run()
        return summary(w.requests, w.slo_for)["attainment"]

    assert attainment("aladdin", 10, pack=1.0, theta=0.5) >= 0.99
    assert attainment("least-load", 15) < 0.99 <= attainment("least-load", 24)
