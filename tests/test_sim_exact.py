"""The simulator's shortcuts change its speed, never its answer: the gate keeps an engine's refusals across
decode steps that cannot turn them (sim/gate.py, the drift of sim/memory_rule.py) and skips asking a policy
whose generation has not moved; the engine keeps its batch's own KV as a running sum. Each run here is made
twice, with the gate asking afresh after every step and with the shortcuts, and every request must be
dispatched, admitted and finished at the same instant on the same backend."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fairgate.accounting.cost import make_cost
from fairgate.sim.builtin import BUILTIN
from fairgate.sim.gate import GatewayMode
from fairgate.sim.profiles import get_profile
from fairgate.sim.scenarios import Spec, build
from fairgate.sim.setup import simulator_for
from fairgate.sim.workload import from_dict


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
