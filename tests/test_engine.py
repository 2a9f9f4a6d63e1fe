"""The engine model shared by the emulated backend and the simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.engine.batching import Engine, EngineRequest, RequestTooLarge
from fairgate.engine.prefix_cache import PrefixCache, block_hashes
from fairgate.engine.profiles import get_profile

A10G = get_profile("a10g-llama2-7b")


def run(engine: Engine, t: float = 0.0, limit: int = 100_000) -> float:
    for _ in range(limit):
        step = engine.step(t)
        if step is None:
            return t
        t += step.duration
    raise AssertionError("engine did not drain")


def test_calibration_matches_vtc_profile():
    # docs/simulator/index.md#calibration: 36.4 ms per decode step at ~5k context, 38.6 ms at ~8.3k, plus the
    # ~3.7 ms of per-step overhead that whole-run throughputs imply (see profiles.py); prefill ≈ 4,650 tok/s
    assert 0.002 < A10G.decode_time(37, 5_000) - 0.0364 < 0.005
    assert 0.002 < A10G.decode_time(13, 8_300) - 0.0386 < 0.005
    assert A10G.decode_time(13, 8_300) - A10G.decode_time(37, 5_000) == pytest.approx(0.0386 - 0.0364, rel=0.1)
    assert A10G.prefill_time(4_650) == pytest.approx(1.0, abs=0.01)


def test_single_request_timing_and_tokens():
    e = Engine(A10G)
    r = EngineRequest("a", prompt_len=256, output_len=10)
    e.add(r)
    end = run(e)
    assert r.generated == 10 and r.done
    # one prefill (first token) and 9 decode steps
    expected = A10G.prefill_time(256) + sum(A10G.decode_time(1, 256 + i) for i in range(1, 10))
    assert end == pytest.approx(expected)
    assert r.first_token_at == pytest.approx(A10G.prefill_time(256))


def test_reserve_rule_blocks_head_of_line_and_never_overcommits():
    prof = A10G.with_overrides(kv_tokens=1000)
    e = Engine(prof)
    big = [EngineRequest(f"b{i}", 300, 200) for i in range(3)]  # 500 each: only two fit at once
    for r in big:
        e.add(r)
    step = e.step(0.0)
    assert [r.id for r in step.emitted] == ["b0", "b1"]  # one mini-batch: 500 + 500 ≤ M
    assert step.kind == "prefill" and [r.id for r in e.queue] == ["b2"]
    t = step.duration
    while not big[2].admitted_at:
        t += e.step(t).duration
    assert big[0].done and big[1].done  # b2 waited for memory, in order
    with pytest.raises(RequestTooLarge):
        e.add(EngineRequest("huge", 900, 200))


def test_abort_frees_the_slot():
    e = Engine(A10G.with_overrides(max_num_seqs=1))
    a, b = EngineRequest("a", 10, 1000), EngineRequest("b", 10, 5)
    e.add(a)
    e.add(b)
    t = e.step(0.0).duration
    t += e.step(t).duration
    assert e.running == [a] and list(e.queue) == [b]
    e.abort(a)
    run(e, t)
    assert a.generated < 1000 and b.generated == 5 and b.done


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300), st.integers(0, 50)), min_size=1, max_size=40),
       st.integers(1, 12))
def test_memory_rule_holds_and_every_request_completes(reqs, admit_every):
    """KV in use never exceeds M (no OOM, no preemption); every request gets exactly its tokens."""
    prof = A10G.with_overrides(kv_tokens=1200)
    e = Engine(prof, admit_every=admit_every)
    pending = [EngineRequest(str(i), p, o, arrival=a * 0.1) for i, (p, o, a) in enumerate(reqs)]
    pending.sort(key=lambda r: r.arrival)
    t, i = 0.0, 0
    all_reqs = list(pending)
    while i < len(pending) or not e.idle:
        while i < len(pending) and pending[i].arrival <= t:
            e.add(pending[i])
            i += 1
        step = e.step(t)
        if step is None:
            t = pending[i].arrival
            continue
        assert e.kv_used_tokens <= prof.kv_tokens  # the rule reserved every running request's future
        t += step.duration
    assert all(r.generated == r.output_len and r.done for r in all_reqs)
    assert e.generation_tokens_total == sum(r.output_len for r in all_reqs)


def test_prefix_cache_hits_whole_blocks_and_evicts_lru():
    cache = PrefixCache(capacity_blocks=4, block_size=4)
    p1 = list(range(10))  # 2 full blocks
    cached, hashes = cache.lookup(p1)
    assert cached == 0 and len(hashes) == 2
    cache.insert(hashes)
    assert cache.lookup(p1 + [99])[0] == 8  # both blocks hit
    assert cache.lookup(list(range(8)))[0] == 4  # a full match recomputes the last block
    assert cache.lookup([0, 1, 2, 3, 7, 7, 7, 7, 7])[0] == 4  # the chain breaks at the first different block
    cache.insert(block_hashes(list(range(100, 112)), 4))  # 3 new blocks: evicts the least recently used
    assert len(cache) == 4
    assert cache.hits == 8 + 4 + 4 and cache.queries == 10 + 11 + 8 + 9


def test_engine_reports_cached_tokens_and_skips_their_prefill():
    e = Engine(A10G)
    prompt = list(range(1000))
    first, second = EngineRequest("1", 1000, 1, prompt), EngineRequest("2", 1000, 1, prompt)
    e.add(first)
    d1 = e.step(0.0).duration
    e.add(second)
    d2 = e.step(d1).duration
    assert first.cached_tokens == 0 and second.cached_tokens == 992  # 62 blocks of 16
    assert d2 < d1 / 10
