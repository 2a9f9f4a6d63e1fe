"""Every policy runs with every placement, and both are honoured: the live dispatcher, driven directly (two
backends, one busier than the other), asked for one request under each pair the gateway accepts."""

from __future__ import annotations

import asyncio

import pytest

from fairgate.accounting.cost import LinearCost
from fairgate.accounting.latency import LatencyModel
from fairgate.policies.factory import LIVE_POLICIES, make_placement, make_scheduler
from fairgate.policies.views import RequestView
from fairgate.proxy.config import PLACEMENTS
from fairgate.proxy.control.backends import Backend, BackendPool
from fairgate.proxy.pipeline.dispatcher import Dispatcher

MODEL = LatencyModel(k1=1e-4, c1=0.01, k2=1e-6, c2=1e-4, c3=0.01)  # (fast: every target met anywhere)


def _pool() -> tuple[BackendPool, list[Backend]]:
    backends = [Backend(name, f"http://{name}", kv_capacity=100_000, up=True, models={"m"}) for name in ("b0", "b1")]
    backends[0].acquire(3_000)  # b0 is the busier one (held by a request of another gateway path)
    pool = BackendPool.__new__(BackendPool)
    pool.backends = backends
    pool.candidates = lambda model, exclude=(): [b for b in backends if b.name not in exclude]
    return pool, backends


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("policy", LIVE_POLICIES)
async def test_the_placement_is_honoured_under_every_policy(policy, placement):
    """Least-load puts the request on the less busy backend; every other placement is asked, and the request
    is placed where it said (pinned there at arrival under a policy that picks per backend: each backend then
    serves its own pins; another may take one only when it would otherwise idle, as the dispatcher says)."""
    pool, (b0, b1) = _pool()
    place = make_placement(placement, models=lambda _b: MODEL)
    asked: list[str | None] = []
    choose = place.choose

    def spy(view, views, now):
        chosen = choose(view, views, now)
        asked.append(None if chosen is None else chosen.name)
        return chosen

    place.choose = spy
    d = Dispatcher(make_scheduler(policy, LinearCost(), lambda _c: 1.0), pool, place)
    ticket = await asyncio.wait_for(d.acquire(RequestView("r1", "c", "app", "m", 100, 50), 1_000, output=50), 1)
    ran_on = ticket.future.result().name
    if placement in ("least-load", "jsq"):
        assert ran_on == "b1" and ticket.placed_on == "b1"
    else:
        assert asked and asked[0] is not None, asked
        assert ticket.placed_on == asked[0], (ticket.placed_on, asked)


async def test_a_request_its_placement_has_no_backend_for_waits_under_a_per_backend_policy():
    """Under ``dlpm`` a placement asked at arrival may answer "none now" (Aladdin, when no backend meets the
    request's targets): the request waits — no backend takes it, none steals it — and is asked about again,
    and runs where the placement then says."""
    from fairgate.policies.placement import Placement

    class Later(Placement):
        name = "later"
        asked = 0

        def choose(self, request, backends, now):
            self.asked += 1
            return None if self.asked < 3 else next(b for b in backends if b.name == "b0")

    pool, (b0, b1) = _pool()
    place = Later()
    d = Dispatcher(make_scheduler("dlpm", LinearCost(), lambda _c: 1.0), pool, place)
    ticket = await asyncio.wait_for(d.acquire(RequestView("r1", "c", "app", "m", 100, 50), 1_000, output=50), 2)
    assert place.asked >= 3 and ticket.future.result().name == "b0" and ticket.placed_on == "b0"


async def test_a_client_that_leaves_as_its_backend_is_granted_leaves_nothing_running():
    """The client goes away in the very turn a backend is granted to its request: the request is not sent (its
    caller sees the cancellation) and the backend's seat is handed back. (Python 3.11's ``wait_for`` returned
    the grant and swallowed the cancellation: the request would have run for nobody.)"""
    pool, (b0, b1) = _pool()
    pool.backends = [b0]
    pool.candidates = lambda model, exclude=(): [b0]
    b0.max_num_seqs = 1  # its one seat taken (the request of another gateway path, in _pool)
    d = Dispatcher(make_scheduler("vtc", LinearCost(), lambda _c: 1.0), pool, make_placement("least-load"))
    asking = asyncio.create_task(d.acquire(RequestView("r1", "c", "app", "m", 100, 50), 1_000, output=50))
    await asyncio.sleep(0.01)
    assert not asking.done() and b0.inflight == 1  # waiting for the seat
    b0.release(3_000)
    d.pump()  # the seat granted to the waiting request ...
    assert b0.inflight == 1
    asking.cancel()  # ... in the turn its client leaves
    with pytest.raises(asyncio.CancelledError):
        await asking
    assert b0.inflight == 0 and b0.inflight_tokens == 0
