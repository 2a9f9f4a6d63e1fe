"""Two-level fairness (fairness_key app>user): apps share the pool by weight and each app's share is divided
among its users, so an app cannot gain share by inventing users. The same policy object runs in the simulator
(here) and the gateway (test_tenant_scope.py)."""

from __future__ import annotations

import random

from fairgate.accounting.cost import LinearCost
from fairgate.policies.factory import make_scheduler
from fairgate.policies.two_level import TwoLevel, app_counter
from fairgate.engine.profiles import get_profile
from fairgate.sim.simulator import Simulator
from fairgate.sim.workload import SimRequest, Workload

COST = LinearCost()
PROFILE = get_profile("a10g-llama2-7b").with_overrides(kv_tokens=4_000)
DURATION = 60.0


def _flood(users: dict[str, str], rate: float = 4.0, seed: int = 1) -> Workload:
    """Every user (→ its app) sends far more than the engine serves: all stay backlogged throughout."""
    rng = random.Random(seed)
    reqs = []
    for user, app in users.items():
        t = rng.random() / rate
        while t < DURATION:
            reqs.append(SimRequest(0, user, t, rng.randint(50, 200), rng.randint(50, 200), app=app))
            t += rng.expovariate(rate)
    reqs.sort(key=lambda r: r.arrival)
    for k, r in enumerate(reqs):
        r.id = k
    return Workload("apps", DURATION, reqs)


def _service(out, horizon: float) -> dict[str, float]:
    """Weighted service received per client up to ``horizon`` (while every client is still backlogged)."""
    return {c: sum(v for t, v in incs if t <= horizon) for c, incs in out.ledger.items()}


def _by_app(service: dict[str, float], users: dict[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for user, amount in service.items():
        out[users[user]] = out.get(users[user], 0.0) + amount
    return out


def _run(users: dict[str, str], weights: dict[str, float], two_level: bool) -> tuple[dict, dict]:
    s = make_scheduler("vtc", COST, lambda c: weights.get(c, 1.0), two_level=two_level)
    out = Simulator(_flood(users), s, PROFILE, mode="gateway", check_invariants=True, record_ledger=True).run()
    service = _service(out, horizon=DURATION * 0.8)
    return _by_app(service, users), service


def test_an_app_that_invents_users_gains_no_share():
    """App "many" sends as 6 users and app "one" as a single user. VTC over users gives "many" about 6× the
    service; two-level fairness gives the apps equal shares, and "many"'s share is split evenly among its users."""
    users = {"solo": "one", **{f"m{i}": "many" for i in range(6)}}
    flat, _ = _run(users, {}, two_level=False)
    apps, per_user = _run(users, {}, two_level=True)
    assert flat["many"] > 4 * flat["one"], flat
    assert abs(apps["many"] - apps["one"]) <= 0.1 * apps["one"], apps
    many = [per_user[f"m{i}"] for i in range(6)]
    assert max(many) - min(many) <= 0.25 * min(many), many


def test_app_weights_then_user_weights():
    """Apps weighted 1:2, and inside the heavier app its two users weighted 1:3."""
    users = {"a": "light", "b1": "heavy", "b2": "heavy"}
    weights = {"app:light": 1.0, "app:heavy": 2.0, "b1": 1.0, "b2": 3.0}
    apps, per_user = _run(users, weights, two_level=True)
    assert abs(apps["heavy"] / apps["light"] - 2) <= 0.2, apps
    assert abs(per_user["b2"] / per_user["b1"] - 3) <= 0.45, per_user


def test_an_app_rejoining_the_backlog_is_lifted_not_credited():
    """Counter lift at the app level (VTC §4.1): an app idle while others were served does not come back with
    a credit that lets it monopolise the pool."""
    s = TwoLevel(lambda: make_scheduler("vtc", COST, lambda _c: 1.0), COST)
    from fairgate.policies.views import RequestView

    def req(i: int, app: str, user: str) -> RequestView:
        return RequestView(f"r{i}", f"user:{app}/{user}", app, "m", 100, 10)

    busy = [req(i, "busy", "u") for i in range(5)]
    for r in busy:
        s.add(r, 0.0)
    for r in busy[:4]:
        assert s.peek(0.0) is r
        s.pop(r, 0.0)
        s.on_finish(r, 10, 0.0)
    late = req(99, "late", "v")
    s.add(late, 1.0)
    assert s.counter(app_counter("late")) == s.counter(app_counter("busy"))  # lifted to the backlog's minimum
    assert s.counter("user:late/v") == 0.0  # the user level is the app's own business
    assert s.peek(1.0) is busy[4]  # tie on the app counter: the app seen first goes first


def test_the_requests_ahead_are_counted_as_apps_take_turns_not_as_users():
    """Shedding's estimate of the wait (``waiting_ahead``) follows the order the policy serves: under app>user
    an app flooding as 200 users is one app taking turns, so a request of another app has about one request
    ahead of it, not 200 (as under per-user fairness, where each of the 200 is a tenant)."""
    from fairgate.policies.views import RequestView

    def view(k: int, app: str, user: str) -> RequestView:
        return RequestView(f"r{k}", f"{app}/{user}", app, "m", 100, 50)

    two = TwoLevel(lambda: make_scheduler("vtc", COST, lambda _c: 1.0), COST)
    flat = make_scheduler("vtc", COST, lambda _c: 1.0)
    for k in range(200):
        for s in (two, flat):
            s.add(view(k, "flood", f"u{k}"), 0.0)
    other = view(999, "other", "ann")
    assert two.waiting_ahead(other) == 1 and flat.waiting_ahead(other) == 200
    two.add(view(1000, "other", "ann"), 0.0)
    assert two.waiting_ahead(other) == 3  # its app's queued request first: two turns, the flood's one between
