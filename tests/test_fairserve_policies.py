"""FairServe's WSC and OIT as pure policies: the invariants A1-A8 of docs/policies/fairserve.md#checks (A6
and A9 run in the simulator, tests/test_fairserve_sim.py), and the historical statistics they read."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.accounting.app_stats import AppStats, suggest_limits
from fairgate.policies.factory import FairServeConfig, make_scheduler
from fairgate.policies.oit import OIT, OverloadConfig, overloaded
from fairgate.policies.views import BackendView, RequestView
from fairgate.policies.wsc import WSC, TokenWeights
from fairgate.accounting.cost import make_cost

_ids = iter(range(10**9))


def call(user: str, app: str = "a", prompt: int = 10, system: int = 0, interaction: str = "", stage: int = 0,
         final: bool = False) -> RequestView:
    rid = f"r{next(_ids)}"
    return RequestView(rid, user, app, "m", prompt, None, interaction or rid, stage, system_tokens=system,
                       final=final)


def stats_of(means: dict[str, tuple[int, int, int]], n: int = 5) -> AppStats:
    s = AppStats(min_samples=1)
    for app, (i, sy, o) in means.items():
        for _ in range(n):
            s.observe(app, 0, i, sy, o, now=0.0)
    return s


def run_call(s, req: RequestView, output: int, now: float = 0.0) -> None:
    s.add(req, now)
    assert s.peek(now) is req
    s.pop(req, now)
    s.on_tokens(req, output, now)
    s.on_finish(req, output, now)


def test_a1_paper_example_normalises_by_app_mean():
    """§3.2: app A averages 10 tokens, app B 50; after 5 tokens each, A's user got 50 % of a typical call, B's
    10 %: increments 0.5 and 0.1 (α = β = γ = 1), and B's user goes next."""
    stats = stats_of({"A": (5, 0, 5), "B": (25, 0, 25)})
    for charge in ("admit", "finish"):
        s = WSC(stats, tokens=TokenWeights(1, 1, 1), charge=charge)
        first = [call("ua", "A", prompt=3), call("ub", "B", prompt=3)]
        a, b = call("ua", "A"), call("ub", "B")
        for r in [*first, a, b]:  # both backlogged together, a second call each behind the first
            s.add(r, 0.0)
        for _ in first:  # each runs and finishes (under finish-charging the pick moves only then)
            r = s.peek(0.0)
            s.pop(r, 0.0)
            s.on_tokens(r, 2, 0.5)
            s.on_finish(r, 2, 0.5)
        assert {r.client for r in first} == {"ua", "ub"}
        assert abs(s.counter("ua") - 0.5) < 1e-9 and abs(s.counter("ub") - 0.1) < 1e-9
        assert s.peek(1.0) is b


def test_a2_a_typical_call_costs_e_i():
    stats = stats_of({"chat": (300, 100, 80)})
    s = WSC(stats, lambda u: 2.0 if u == "gold" else 1.0)  # E_i = 1 / weight
    for user, e in (("u", 1.0), ("gold", 0.5)):
        r = call(user, "chat", prompt=400, system=100)
        s.add(r, 0.0)  # (a lift may happen here, at the join)
        before = s.counter(user)
        s.peek(0.0)
        s.pop(r, 0.0)
        s.on_finish(r, 80, 1.0)
        assert abs(s.counter(user) - before - e) < 1e-9


def test_charging_at_admission_settles_to_the_paper_charge():
    """charge=admit charges the expected cost when the call is dispatched, tokens beyond it as they stream, and
    the exact Alg. 1 charge at the finish; a call that never ran is refunded."""
    stats = stats_of({"chat": (100, 0, 50)})
    s = WSC(stats)
    r = call("u", "chat", prompt=100)
    s.add(r, 0)
    s.peek(0)
    s.pop(r, 0)
    assert abs(s.counter("u") - 1.0) < 1e-9  # expected output charged up front
    s.on_tokens(r, 80, 0)
    assert abs(s.counter("u") - 180 / 150) < 1e-9
    s.on_finish(r, 20, 0)
    assert abs(s.counter("u") - 120 / 150) < 1e-9
    r2 = call("u", "chat", prompt=100)
    s.add(r2, 1)
    s.peek(1)
    s.pop(r2, 1)
    s.on_finish(r2, 0, 1, prompt_tokens=0)
    assert abs(s.counter("u") - 120 / 150) < 1e-9


def _oit(limit_user=2, limit_app=100):
    return OIT(lambda u: limit_user, lambda a: limit_app)


def test_a3_no_throttling_without_overload():
    o = _oit(limit_user=1, limit_app=1)
    assert all(o.check(call("abuser"), False, False, t * 0.01) is None for t in range(500))


def test_a4_a_continuation_is_never_throttled_it_waits():
    s = make_scheduler("fairserve", make_cost("weighted"), lambda u: 1.0,
                       fairserve=FairServeConfig(user_limit=lambda u: 1, app_limit=lambda a: 1))
    first = call("u", interaction="x1", stage=0)
    assert s.admit(first, 0.0, overloaded=True) is None  # 1st arrival: within the limit of 1
    s.add(first, 0.0)
    s.peek(0.0)
    s.pop(first, 0.0)
    for k in range(1, 30):  # the user is now far over its limit, the pool overloaded
        nxt = call("u", interaction="x1", stage=k)
        assert s.admit(nxt, 0.1 * k, overloaded=True) is None
        s.add(nxt, 0.1 * k)
    assert len(s) == 29
    new = call("u", interaction="x2")
    t = s.admit(new, 3.0, overloaded=True)
    assert t is not None and t.reason == "user_limit"


def test_a5_user_limit_is_checked_before_the_app_limit_and_retry_after_is_honest():
    o = _oit(limit_user=3, limit_app=3)
    for k in range(3):
        assert o.check(call("u", "app"), False, True, float(k)) is None
    t = o.check(call("u", "app"), False, True, 10.0)
    assert t.reason == "user_limit" and t.count == 4 and t.limit == 3
    assert abs(t.retry_after_s - 51.0) < 1e-9  # the 2nd arrival (t = 1) leaves the window at 61 s
    assert o.check(call("u", "app"), False, True, 10.0 + t.retry_after_s - 1).reason == "user_limit"
    fresh = _oit(limit_user=3, limit_app=3)
    for k in range(4):
        fresh.check(call(f"u{k}", "app"), False, True, float(k))
    assert fresh.check(call("other", "app"), False, True, 5.0).reason == "app_limit"
    # after retry-after, the same user is admitted again
    o2 = _oit(limit_user=2)
    o2.check(call("v"), False, True, 0.0)
    o2.check(call("v"), False, True, 1.0)
    t = o2.check(call("v"), False, True, 2.0)
    assert o2.check(call("v"), False, True, 2.0 + t.retry_after_s + 1e-6) is None


def test_a7_counter_lift():
    stats = stats_of({"a": (10, 0, 10)})
    s = WSC(stats)
    for _ in range(5):
        run_call(s, call("busy"), 10)
    # Q empty: the returning idle user is lifted to the last user to leave Q
    s.add(call("idle"), 1.0)
    assert s.counter("idle") >= s.counter("busy") - 1e-9
    s2 = WSC(stats)
    for _ in range(3):
        run_call(s2, call("b1"), 10)
    for _ in range(6):
        run_call(s2, call("b2"), 10)
    s2.add(call("b1"), 1.0)
    s2.add(call("b2"), 1.0)
    s2.add(call("late"), 1.0)
    assert abs(s2.counter("late") - min(s2.counter("b1"), s2.counter("b2"))) < 1e-9


ops = st.lists(st.tuples(st.sampled_from(["add_new", "add_x", "pop", "finish"]), st.integers(0, 4),
                         st.integers(0, 3)), min_size=1, max_size=120)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_a8_continuations_go_first_and_the_counters_are_the_papers(script):
    """Whatever arrives, while a continuation call waits, no call that would start a new interaction is
    admitted ahead of it; every finished call charges exactly E·(α·L_I + β·L_S + γ·L_O)/w_aj."""
    stats = stats_of({"a": (30, 10, 20), "b": (300, 0, 5)})
    s = WSC(stats, lambda u: 1.0 + int(u[1:]), charge="finish")
    running: list[tuple[RequestView, int]] = []
    t = 0.0
    for op, u, x in script:
        t += 0.1
        user, app = f"u{u}", "ab"[u % 2]
        if op == "add_new":
            s.add(call(user, app, prompt=20 + u, system=5), t)
        elif op == "add_x":
            s.add(call(user, app, prompt=40, interaction=f"x{u}-{x}", stage=x), t)
        elif op == "pop" and (head := s.peek(t)) is not None:
            conts = [w.req for q in s._cont.values() for w in q if w.live]
            if conts:
                assert any(r is head for r in conts), "a continuation waits; the head must be one"
                assert s.counter(head.client) == min(s.counter(r.client) for r in conts)
            else:
                assert s.counter(head.client) == min(s.counter(c) for c in s.waiting_clients())
            s.pop(head, t)
            running.append((head, 3 + x))
        elif op == "finish" and running:
            r, out = running.pop(0)
            before = s.counter(r.client)
            s.on_finish(r, out, t)
            assert abs(s.counter(r.client) - before - s.call_cost(r, out)) < 1e-9


def test_fanout_siblings_become_continuations_once_one_is_admitted():
    s = WSC(stats_of({"a": (10, 0, 10)}))
    calls = [call("agent", interaction="run", stage=1) for _ in range(3)]
    other = call("light")
    for c in calls:
        s.add(c, 0.0)
    s.on_finish(c, 0, 0.0)  # a stray finish of an unknown call is ignored
    assert s.peek(0.0) is calls[0]
    s.pop(calls[0], 0.0)
    s.add(other, 0.1)  # a new user with the smallest counter arrives ...
    assert s.peek(0.1) is calls[1]  # ... but the interaction's waiting calls continue first
    s.pop(calls[1], 0.1)
    assert s.peek(0.1) is calls[2]


def test_overload_signal():
    cfg = OverloadConfig(kv_threshold=0.9, queue_threshold=1)
    b = [BackendView("b0", 3, 800, 1000), BackendView("b1", 3, 950, 1000)]
    assert not overloaded(b, 0, cfg)
    assert overloaded(b, 1, cfg)  # requests wait for headroom
    assert overloaded([BackendView("b0", 3, 950, 1000), BackendView("b1", 3, 900, 1000)], 0, cfg)
    assert overloaded([BackendView("b0", 1, 10, 1000, waiting=2)], 0, cfg)  # vLLM queues on its own
    assert overloaded([BackendView("b0", 1, 10, 1000, kv_usage=0.95)], 0, cfg)


def test_app_stats_fallbacks_decay_percentiles_and_snapshots():
    s = AppStats(half_life_s=100.0, min_samples=2, default=(1, 2, 3))
    assert s.expected("x", 0).source == "default"
    for k in range(4):
        s.observe("x", 0, 100, 10, 50, now=k)
    assert s.expected("x", 0).source == "stage" and abs(s.expected("x", 0).input - 100) < 1e-9
    assert s.expected("x", 7).source == "app" and s.expected("zz", 0).source == "global"
    for k in range(4):  # much later, much larger: the old observations have decayed away
        s.observe("x", 0, 1000, 10, 50, now=2000 + k)
    assert 990 < s.expected("x", 0).input <= 1000
    p, m = AppStats(statistic="p95", min_samples=1), AppStats(statistic="median", min_samples=1)
    for k in range(100):
        for stats in (p, m):
            stats.observe("y", 0, 10 if k < 90 else 5000, 0, 1, now=0)
    assert 4000 < p.expected("y", 0).input < 6000
    assert 9 < m.expected("y", 0).input < 11  # the median does not see the tail p95 sees
    copy = AppStats(half_life_s=100.0, min_samples=2)
    copy.load(s.dump())
    assert copy.expected("x", 0) == s.expected("x", 0)
    s.rebase(5000.0)
    assert abs(s.expected("x", 0).input - copy.expected("x", 0).input) < 1e-6


def test_suggested_limits_sit_above_normal_behaviour():
    arrivals = [(m * 60 + k, f"u{u}", "chat") for m in range(30) for u in range(20) for k in range(u % 5 + 1)]
    arrivals += [(m * 60 + k * 0.1, "bot", "chat") for m in range(30) for k in range(300)]
    lim = suggest_limits(arrivals, q=0.95)
    assert 5 <= lim.user_rpm < 300  # the normal users' per-minute counts, not the bot's
    assert lim.user_p["bot"] == 300 and lim.app_rpm["chat"] >= 300


def test_stage_statistics_are_capped_per_app_and_the_least_used_stage_goes():
    """A client naming a fresh X-Fairgate-Stage per call does not grow the statistics without bound: past
    the cap, the stage with the least decayed weight is dropped, its calls fall back to the app's statistics,
    and a snapshot loaded elsewhere keeps the same stages."""
    s = AppStats(min_samples=1, max_stages_per_app=3)
    for _ in range(5):
        s.observe("a", 0, 100, 0, 10, now=0)  # the app's real stage, used often
    for stage in range(1, 40):  # a private stage per call
        s.observe("a", stage, 10_000, 0, 10, now=stage)
    s.observe("b", 5, 1, 0, 1, now=40)
    stages = sorted(k[1] for k in s.entries if k[0] == "a" and k[1] >= 0)
    assert len(stages) == 3 and 0 in stages and 39 in stages  # the busy stage stays, the newest is kept
    assert s.expected("a", 7).source == "app" and s.expected("b", 5).source == "stage"
    small = AppStats(min_samples=1, max_stages_per_app=2)
    small.load(s.dump())
    assert sorted(k[1] for k in small.entries if k[0] == "a" and k[1] >= 0) == [0, 39]


def test_an_interaction_s_protection_is_learnt_from_its_app_s_interactions():
    """An app whose interactions make 3 calls (a few make 5), beside many one-off calls: one of its
    interactions is protected for twice what 99 % of them make, 6 calls, and a flood tagged with one of its interaction ids is throttled past
    them; an app of 12-call interactions gets 24; an app the statistics do not know yet, ``max_calls`` (32)."""
    stats = AppStats(min_samples=5)
    for k in range(300):
        for stage in range(5 if k < 2 else 3):  # (2 of 300 reach 5 calls: under 1 %)
            stats.observe("short", stage, 10, 0, 10, now=0.0)
        for stage in range(12):
            stats.observe("long", stage, 10, 0, 10, now=0.0)
    for _ in range(1000):  # calls outside any interaction are stage 0 too: they do not shorten the bound
        stats.observe("short", 0, 10, 0, 10, now=0.0)
    assert (stats.interaction_calls("short"), stats.interaction_calls("long"), stats.interaction_calls("new")) \
        == (3, 12, None)
    s = make_scheduler("fairserve", make_cost("weighted"), lambda u: 1.0, stats=stats,
                       fairserve=FairServeConfig(user_limit=lambda u: 1, app_limit=lambda a: 1000))
    assert [s.interaction_bound(app) for app in ("short", "long", "new")] == [6, 24, 32]
    first = call("flood", "short", interaction="x", stage=0)
    s.add(first, 0.0)
    s.pop(s.peek(0.0), 0.0)
    admitted = []
    for k in range(1, 40):  # the pool overloaded, the user past its limit of 1 a minute
        nxt = call("flood", "short", interaction="x", stage=min(k, 63))
        if s.admit(nxt, 0.01 * k, overloaded=True) is None:
            s.add(nxt, 0.01 * k)
            admitted.append(nxt)
    assert len(admitted) == 5  # 1 admitted + 5 waiting as continuations = 6; the other 34 throttled


def test_an_interaction_is_protected_for_its_first_max_calls_only():
    """A flood tagged with one interaction id: its first ``max_interaction_calls`` calls (admitted, or waiting
    as continuations) are continuations — served first, never throttled —; past them its calls are ordinary:
    throttled by OIT under overload, and served after a less-served user's."""
    s = make_scheduler("fairserve", make_cost("weighted"), lambda u: 1.0,
                       fairserve=FairServeConfig(user_limit=lambda u: 1, app_limit=lambda a: 1000,
                                                 max_interaction_calls=4))
    first = call("flood", interaction="x", stage=0)
    s.add(first, 0.0)
    s.peek(0.0)
    s.pop(first, 0.0)
    admitted, throttled = [], 0
    for k in range(1, 20):  # the pool overloaded, the user past its limit of 1 a minute
        nxt = call("flood", interaction="x", stage=k)
        if s.admit(nxt, 0.01 * k, overloaded=True) is not None:
            throttled += 1
            continue
        s.add(nxt, 0.01 * k)
        admitted.append(nxt)
    assert len(admitted) == 3 and throttled == 16  # 1 admitted + 3 waiting as continuations = 4
    light = call("light")
    s.add(light, 0.5)
    order = []
    while (head := s.peek(0.5)) is not None:
        s.pop(head, 0.5)
        order.append(head)
    assert order == admitted + [light]
    # without overload nothing is throttled, but past the bound the calls wait as ordinary ones
    s2 = WSC(stats_of({"a": (10, 0, 10)}), max_calls=2)
    run = [call("flood", interaction="y", stage=k) for k in range(5)]
    s2.add(run[0], 0.0)
    s2.pop(s2.peek(0.0), 0.0)
    for c in run[1:]:
        s2.add(c, 0.1)
    s2.add(light2 := call("light"), 0.2)
    assert [s2.peek(0.3)] == [run[1]]  # the one continuation within the bound goes first
    s2.pop(run[1], 0.3)
    assert s2.peek(0.3) is light2  # then the least-served user: the flood's other calls are ordinary
