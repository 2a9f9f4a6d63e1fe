"""The simulator's shortcuts change its speed, never its answer: the gate keeps an engine's refusals across
decode steps that cannot turn them (sim/gate.py, the drift of engine/memory_rule.py) and skips asking a policy
whose generation has not moved; the engine keeps its batch's own KV as a running sum. Each run here is made
twice, with the gate asking afresh after every step and with the shortcuts, and every request must be
dispatched, admitted and finished at the same instant on the same backend. (Engine mode keeps no such
shortcut; its one regression is pinned below.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fairgate.accounting.cost import make_cost
from fairgate.sim.builtin import BUILTIN
from fairgate.sim.gate import GatewayMode
from fairgate.engine.profiles import get_profile
from fairgate.sim.scenarios import Spec, build
from fairgate.sim.setup import simulator_for
from fairgate.sim.workload import SimRequest, Workload, finalize, from_dict


def workload(name: str, duration: float):
    if name == "timeouts":  # FairServe's scenario, small, with a client timeout that aborts running calls
        return build(replace(Spec(), users=40, apps=4, agent_apps=2, duration_s=duration, timeout_s=8.0), name)
    return from_dict(dict(BUILTIN[name], duration_s=duration), name)


def outcome(name: str, policy: str, placement: str, keep: bool, duration: float, params=None):
    w = workload(name, duration)
    sim = simulator_for(w, policy, placement, get_profile(w.engine or "a10g-llama2-7b"), mode="gateway",
                        backends=2, cost=make_cost("weighted"), params=params, check_invariants=True)
    sim.keep_refusals = keep
    out = sim.run()
    assert not out.invariant_violations, out.invariant_violations[:3]
    assert out.idle_with_fitting_queue == 0
    return [(r.id, r.dispatched, r.admitted, r.finished, r.backend, r.rejected) for r in out.requests]


@pytest.mark.parametrize("name,policy,placement,duration,params", [
    ("d2lpm_lcqa", "dlpm", "d2lpm", 20.0, None),  # prefixes shared: the held blocks and the cache move
    ("dlpm_misbehaving", "dlpm", "least-load", 60.0, {"window": 3}),
    ("overload", "vtc", "least-load", 60.0, None),
    ("timeouts", "fairserve", "least-load", 60.0, None),  # aborts: running calls dropped
])
def test_the_shortcuts_give_the_plain_answer(name, policy, placement, duration, params):
    kept = outcome(name, policy, placement, True, duration, params)
    assert GatewayMode.keep_refusals  # (the default)
    assert kept == outcome(name, policy, placement, False, duration, params)
    assert sum(1 for x in kept if x[3] is not None) > 50  # enough finished to have moved through many states


def test_the_engines_queue_is_asked_even_when_nothing_lives_in_it():
    """Engine mode: a VTC client whose only waiting request is given up leaves the backlog when the policy is
    next asked, so when it sends again it rejoins with the counter lift. An engine that skipped asking an
    empty-looking queue kept it a member, unlifted, with a counter below b's (found by review). Both join at 5.0
    lifted to the same floor; c, served less before, wins the tie and goes first, its counter the floor's plus
    its charges."""
    rows = [  # (client, arrival, prompt, output)
        ("b", 0.0, 2000, 1), ("c", 1.0, 20, 3000),  # c's first runs until its timeout (aborted) ...
        ("c", 1.0, 6000, 2000),  # ... its second does not fit beside it, waits, and is given up at 4.0
        ("b", 1.0, 3000, 30), ("b", 5.0, 5000, 20), ("c", 5.0, 5000, 20),  # the last two do not fit together
    ]
    reqs = finalize([SimRequest(i, c, t, p, o) for i, (c, t, p, o) in enumerate(rows)], {})
    w = Workload("stale", 10.0, reqs, {}, {}, None, {}, 0.0, 3.0)
    long_context = get_profile("a10g-llama2-7b").with_overrides(max_model_len=16_384)  # (6,000-token prompts)
    sim = simulator_for(w, "vtc", "least-load", long_context, mode="engine", cost=make_cost("weighted"))
    out = sim.run()
    assert out.requests[5].admitted == 5.0 and out.requests[4].admitted > 5.0
    assert {c: round(sim.s.counter(c)) for c in "bc"} == {"b": 10068, "c": 10102}


@pytest.mark.parametrize("name,policy,placement,backends,cost", [
    ("overload", "vtc", "least-load", 2, "weighted"),
    ("overload", "vtc", "least-load", 2, "profile"),  # charges that are not whole numbers
    ("weighted", "vtc", "least-load", 2, "weighted"),  # weights: each charge divided by 2, 3, …
    ("overload", "vtc-predict", "least-load", 2, "weighted"),  # output paid up front (charged step by step)
    ("poisson_in_out", "wsc", "least-load", 2, "weighted"),
    ("d2lpm_lcqa", "dlpm", "d2lpm", 4, "weighted"),  # prefixes cached: a run's finish inserts its output blocks
    ("azure", "vtc", "aladdin", 4, "weighted"),  # latency targets: TTFT predictions, Aladdin's time-based views
])
def test_quiet_runs_give_the_step_by_step_answer(name, policy, placement, backends, cost):
    """An engine's decode steps while nothing waits in the gateway or on it run as one event
    (Engine.decode_run): every request's dispatch, admission, first token and finish, each client's counter
    and the TTFT predictions' coverage are what stepping one at a time gives, to the bit (each step of a run
    is charged as it would have been: a run's tokens charged at once would round otherwise, found by review)."""
    def run(quiet: bool):
        w = (from_dict({"duration_s": 120, "engine": "a100-llama2-7b", "slo": {"ttft_s": 0.4, "atgt_s": 0.015},
                        "trace": {"path": "azure-2023-conv.csv", "format": "azure", "clients": 10}})
             if name == "azure" else workload(name, 20.0 if name == "d2lpm_lcqa" else 60.0))  # (its caches make
        sim = simulator_for(w, policy, placement, get_profile(w.engine or "a10g-llama2-7b"),  # it the slowest)
                            mode="gateway", backends=backends, cost=make_cost(cost))
        sim.quiet_runs = quiet
        out = sim.run()
        coverage = out.ttft_predictions.report() if out.ttft_predictions else None
        counters = getattr(sim.s, "counters", None)
        return ([(r.id, r.dispatched, r.admitted, r.first_token, r.finished, r.backend, r.rejected)
                 for r in out.requests], dict(counters.items()) if hasattr(counters, "items") else None,
                coverage, out.horizon_tokens), sum(e.runs for e in sim._engines)

    (quiet, runs), (plain, none) = run(True), run(False)
    assert none == 0 and runs > 5, runs  # (the runs happened: few where the queue is rarely empty)
    assert quiet == plain
    assert sum(1 for x in plain[0] if x[4] is not None) > 100


def test_aladdins_kept_refusals_give_the_plain_answer():
    """Aladdin's ``waits`` (a refusal kept within a heartbeat) lets the gate skip building views: the same
    dispatches, to the bit, as asking afresh at every step's end."""
    def run(keep: bool):
        w = from_dict({"duration_s": 120, "engine": "a100-llama2-7b", "slo": {"ttft_s": 0.4, "atgt_s": 0.015},
                       "trace": {"path": "azure-2023-conv.csv", "format": "azure", "clients": 10}})
        sim = simulator_for(w, "vtc", "aladdin", get_profile("a100-llama2-7b"), mode="gateway", backends=3,
                            cost=make_cost("weighted"))
        sim.placement.keeps_refusals = keep
        asked = []
        waits = sim.placement.waits
        sim.placement.waits = lambda *a: asked.append(waits(*a)) or asked[-1]
        out = sim.run()
        return [(r.id, r.dispatched, r.admitted, r.first_token, r.finished, r.backend) for r in out.requests], \
            sum(asked)

    (kept, skipped), (plain, none) = run(True), run(False)
    assert none == 0 and skipped > 1000, skipped
    assert kept == plain


@pytest.mark.parametrize("name,policy,placement,backends", [
    ("overload", "vtc", "least-load", 4),
    ("timeouts", "fairserve", "least-load", 2),  # 115 calls given up, running: aborts wake an engine
    ("d2lpm_lcqa", "dlpm", "d2lpm", 4),  # (15 s of it: its caches make it the slowest)
    ("azure", "vtc", "aladdin", 16),  # quiet runs' charges at the same instant as other engines' steps
])
def test_asking_only_the_engines_woken_gives_the_answer_of_asking_all(name, policy, placement, backends):
    """Gateway mode asks an engine to step only once it was handed a request, ended a step or aborted one
    (``wake_only``): with many engines most are idle, and asking each at every event made a run O(events ×
    engines). Every request and every counter is what asking all of them gives, to the bit."""
    def run(wake_only: bool):
        w = (from_dict({"duration_s": 120, "engine": "a100-llama2-7b", "slo": {"ttft_s": 0.4, "atgt_s": 0.015},
                        "trace": {"path": "azure-2023-conv.csv", "format": "azure", "clients": 10}})
             if name == "azure" else workload(name, 15.0 if name == "d2lpm_lcqa" else 60.0))
        sim = simulator_for(w, policy, placement, get_profile(w.engine or "a10g-llama2-7b"), mode="gateway",
                            backends=backends, cost=make_cost("weighted"))
        sim.wake_only = wake_only
        out = sim.run()
        counters = getattr(sim.s, "counters", None)
        return ([(r.id, r.dispatched, r.admitted, r.first_token, r.finished, r.backend, r.rejected, r.abandoned)
                 for r in out.requests], dict(counters.items()) if hasattr(counters, "items") else None,
                out.horizon_tokens)

    woken, every = run(True), run(False)
    assert woken == every
    assert sum(1 for x in every[0] if x[4] is not None) > 100
