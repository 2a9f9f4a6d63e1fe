"""KV curves over the future decode steps (accounting/kv_curve.py): what a replica publishes bounds what its
requests hold at every step, and the gate's check against a budget curve is exact at every step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from msgspec import msgpack

from fairgate.accounting.kv_curve import GRID, Curve, Margin, upper
from fairgate.policies.kv_profile import KVProfile

items = st.lists(st.tuples(st.integers(1, 400), st.integers(1, 300)), max_size=12)


def held(requests: list[tuple[int, int]], fixed: int, e: int) -> int:
    """What requests (end, start) hold at step e: start + e each, while e ≤ end (policies/kv_profile.py)."""
    return fixed + sum(start + e for end, start in requests if end >= e)


@settings(max_examples=150, deadline=None)
@given(items, st.sampled_from([0, 50]))
def test_what_a_replica_publishes_bounds_its_requests_at_every_step(requests, fixed):
    profile = KVProfile(list(requests), None)
    curve = upper(profile.ends, profile.start_sums, fixed)
    assert all(curve.at(float(e)) >= held(requests, fixed, e) for e in range(0, 700))
    assert all(curve.at(float(e)) == held(requests, fixed, e) for e in GRID[GRID < 700].astype(int))  # exact there
    sent = Curve.unpacked(msgpack.decode(curve.packed()))  # (as the sync script reads it: trimmed, whole tokens)
    assert all(sent.at(float(e)) == curve.at(float(e)) for e in range(0, 700))


@settings(max_examples=80, deadline=None)
@given(items, items, st.sampled_from([0.0, 1.0, 3.0, 10.0, 4.6]), st.integers(0, 300), st.integers(1, 200),
       st.integers(1, 3), st.sampled_from([1000, 800]), st.sampled_from([0, 1]))
def test_a_newcomer_fits_a_budget_curve_exactly_when_it_fits_at_every_step(mine, others, aged, end, start,
                                                                           copies, capacity, slack):
    """The budget: the backend less another replica's requests (their upper curve); the check is the brute force
    one over every step: this replica's requests and the newcomer's copies, within the budget aged by ``aged``
    steps, give or take ``slack`` (the least of those), and within the capacity."""
    theirs = KVProfile(list(others), None)
    their_curve = upper(theirs.ends, theirs.start_sums, 0)
    budget = Curve(1000 - their_curve.v, -their_curve.s)
    profile = KVProfile(list(mine), None)
    margin = Margin(profile.ends, profile.start_sums, 0, budget, aged, capacity, slack)

    def room(e: int) -> float:  # (the least within ``slack`` of e + aged: sampled finely, and every cell start)
        x = e + aged
        near = [max(0.0, x - slack + i * slack / 8) for i in range(17)]
        starts = [g for g in GRID if x - slack < g <= x + slack and 0 < g < GRID[len(budget.v)]]
        near += starts + [g - 1e-9 for g in starts]
        return min(min(float(budget.at(y)) for y in near), capacity)

    rooms = [room(e) for e in range(0, 1200)]
    fits = all(held(mine, 0, e) + (copies * (start + e) if e <= end else 0) <= rooms[e] + 1e-9 for e in range(1200))
    assert margin.fits(end, start, copies) == fits
    assert abs(margin.free() - max(0.0, min(rooms[e] - held(mine, 0, e) for e in range(1200)))) < 1e-6
