"""The dispatch core (fairgate/policies/dispatch_core.py) that the live dispatcher and the simulator's
gateway mode both run: pins made at arrival count as each backend's queue and are given back when a request
leaves unserved, and the simulator pins as the gateway does (RR+LPM: each request served where round-robin
put it)."""

from __future__ import annotations

from dataclasses import replace

from fairgate.accounting.cost import make_cost
from fairgate.engine.profiles import get_profile
from fairgate.policies.dispatch_core import Pins, routes
from fairgate.policies.factory import make_placement, make_scheduler
from fairgate.policies.views import BackendView, RequestView
from fairgate.sim.builtin import BUILTIN
from fairgate.sim.setup import simulator_for
from fairgate.sim.workload import from_dict


def _view(rid: str) -> RequestView:
    return RequestView(rid, "c", "a", "m", 100, 10, rid, 0)


def test_pins_count_as_the_backends_queue_and_are_refunded_when_a_request_leaves_unserved():
    seen, refunded = [], []

    class Shortest:  # the backend with the fewest waiting, as the placement is shown them
        routes_at_arrival = True

        def choose(self, request, backends, now):
            seen.append({b.name: b.waiting for b in backends})
            return min(backends, key=lambda b: (b.waiting, b.name))

        def refund(self, request, backend):
            refunded.append((request.request_id, backend))

    pins, place = Pins(), Shortest()
    views = [BackendView("b0", 0, 0, 1000, waiting=1), BackendView("b1", 0, 0, 1000)]
    assert [pins.route(place, _view(f"r{k}"), views, 0.0) for k in range(3)] == ["b1", "b0", "b1"]
    assert seen[-1] == {"b0": 2, "b1": 1}  # (its own queue, and the requests pinned to it)
    assert pins.waits_for("r0", "b1") and not pins.waits_for("r0", "b0")
    assert pins.waits_for("r0", "b0", up={"b0"})  # pinned to a backend that is down: any may take it
    assert pins.unpin(place, _view("r0"), ran=True) == "b1" and refunded == []
    assert pins.unpin(place, _view("r1"), ran=False) == "b0" and refunded == [("r1", "b0")]
    assert pins.waiting == {"b1": 1} and pins.unpin(place, _view("r1"), ran=False) is None


def test_which_pairs_route_at_arrival():
    cost = make_cost("weighted")
    lpm, vtc = make_scheduler("lpm", cost, lambda _c: 1.0), make_scheduler("vtc", cost, lambda _c: 1.0)
    assert routes(lpm, make_placement("round-robin")) and not routes(lpm, make_placement("least-load"))
    assert routes(vtc, make_placement("d2lpm", lambda _v, _b: 0))
    assert not routes(vtc, make_placement("round-robin"))


def test_the_simulator_serves_each_request_where_round_robin_pinned_it_as_the_gateway_does():
    """``lpm`` behind ``round-robin`` in gateway mode is the DLPM paper's RR+LPM: each request is pinned to
    the next engine as it arrives and runs there (no steal: round-robin does not route at arrival of its
    own)."""
    w = from_dict(dict(BUILTIN["d2lpm_tot"], duration_s=6.0), "d2lpm_tot")
    sim = simulator_for(w, "lpm", "round-robin", get_profile(w.engine), mode="gateway", backends=4,
                        cost=make_cost("weighted"))
    out = sim.run()
    ran = sorted((r.arrival, r.id, r.backend) for r in out.requests if r.backend is not None)
    assert len(ran) > 40
    assert [backend for _, _, backend in ran[:40]] == [k % 4 for k in range(40)], ran[:40]


def test_pins_keep_a_view_s_other_fields():
    pins = Pins()

    class First:
        routes_at_arrival = True

        def choose(self, request, backends, now):
            self.got = backends
            return backends[0]

    place = First()
    pins.route(place, _view("r0"), [BackendView("b0", 3, 300, 1000, waiting=2, running=3)], 0.0)
    assert place.got == [replace(BackendView("b0", 3, 300, 1000, running=3), waiting=2)]
