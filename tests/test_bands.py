"""Priority bands over a fair policy (policies/bands.py): a higher band goes first, a band with nothing that fits
never holds a lower one back, a minimum share keeps a lower band served, and within a band the policy is the
policy alone would be (VTC's counter lift over that band's backlog only)."""

from __future__ import annotations

import pytest

from fairgate.accounting.cost import LinearCost
from fairgate.policies.bands import Banded
from fairgate.policies.dlpm import DLPM
from fairgate.policies.factory import LIVE_POLICIES, make_scheduler
from fairgate.policies.scheduler import VTC
from fairgate.policies.views import RequestView

INTERACTIVE, STANDARD, BATCH = 0, 1, 2


def view(n: int, client: str, band: int, prompt: int = 100) -> RequestView:
    return RequestView(f"r{n}", client, client.split("/")[0], "m", prompt, 10, band=band)


def drain(s, now: float = 0.0, eligible=None, backend: str = "") -> list[RequestView]:
    out = []
    while (r := s.peek(now, eligible, backend)) is not None:
        s.pop(r, now, backend)
        s.on_finish(r, 10, now)
        out.append(r)
    return out


@pytest.mark.parametrize("policy", sorted(LIVE_POLICIES))
def test_every_policy_serves_the_bands_in_order(policy):
    s = Banded(lambda: make_scheduler(policy, LinearCost(), lambda c: 1.0, rpm_limit=10_000))
    n = 0
    for band in (BATCH, STANDARD, INTERACTIVE, BATCH, STANDARD, INTERACTIVE):
        for client in ("a", "b"):
            assert s.add(view(n, f"{client}{band}/u", band), 0.0)
            n += 1
    assert len(s) == 12 and sum(s.waiting_by_client().values()) == 12
    assert [r.band for r in drain(s)] == [INTERACTIVE] * 4 + [STANDARD] * 4 + [BATCH] * 4
    assert len(s) == 0


def test_within_a_band_the_policy_orders_tenants_as_it_would_alone():
    banded = Banded(lambda: VTC(LinearCost()))
    alone = VTC(LinearCost())
    n = 0
    for k in range(20):
        for client, prompt in (("heavy", 900), ("light", 100)):
            banded.add(view(n, client, INTERACTIVE, prompt), 0.0)
            alone.add(view(n, client, INTERACTIVE, prompt), 0.0)
            n += 1
    assert [r.request_id for r in drain(banded)] == [r.request_id for r in drain(alone)]


def test_a_band_with_nothing_that_fits_does_not_hold_a_lower_one_back():
    s = Banded(lambda: VTC(LinearCost()))
    s.add(view(0, "big", INTERACTIVE, prompt=5000), 0.0)
    s.add(view(1, "small", BATCH, prompt=10), 0.0)
    fits = lambda r: r.prompt_tokens < 1000  # noqa: E731
    assert s.peek(0.0, fits).request_id == "r1"
    assert s.peek(0.0).request_id == "r0"


def test_a_minimum_share_keeps_a_lower_band_served():
    for share, expected in ((None, 0.0), (0.25, 0.25)):
        s = Banded(lambda: VTC(LinearCost()), {BATCH: share} if share else {})
        n, served = 0, []
        for client, band in (("chat", INTERACTIVE), ("bulk", BATCH)):
            for _ in range(600):
                s.add(view(n, client, band), 0.0)
                n += 1
        for _ in range(400):  # both bands stay backlogged throughout
            r = s.peek(0.0)
            s.pop(r, 0.0)
            served.append(r.band)
        assert served[200:].count(BATCH) / 200 == pytest.approx(expected, abs=0.01), share


def test_a_tenant_back_from_idle_is_lifted_over_its_own_bands_backlog():
    """VTC's counter lift (§4.1) takes the least counter of the *band's* backlog: a batch tenant starved by the
    bands does not hand an interactive newcomer its low counter."""
    s = Banded(lambda: VTC(LinearCost()))
    s.add(view(0, "starved", BATCH), 0.0)
    n = 1
    for _ in range(10):  # "busy" is served and charged; "starved" waits in the batch band at 0
        s.add(view(n, "busy", INTERACTIVE), 0.0)
        n += 1
        r = s.peek(0.0)
        assert r.client == "busy"
        s.pop(r, 0.0)
        s.on_finish(r, 10, 0.0)
    s.add(view(n, "busy", INTERACTIVE), 0.0)
    s.add(view(n + 1, "newcomer", INTERACTIVE), 0.0)
    assert s.counter("newcomer") == s.counter("busy") > 0 == s.counter("starved")


def test_dlpm_per_backend_picks_keep_their_bands():
    s = Banded(lambda: DLPM(1000.0))
    s.add(view(0, "b", BATCH), 0.0)
    s.add(view(1, "i", INTERACTIVE), 0.0)
    assert s.skips_unfit and s.peek(0.0, None, "gpu-0").request_id == "r1"
    s.pop(s.peek(0.0, None, "gpu-0"), 0.0, "gpu-0")
    assert s.peek(0.0, None, "gpu-1").request_id == "r0"
    assert s.generation("gpu-1") is not None


def test_a_tenant_waiting_in_two_bands_is_ordered_by_its_one_counter():
    """A user shared by apps of different bands (or an app whose band changed while its requests waited) is in
    two instances; a charge in one makes the other re-read its counter, so the pick is plain VTC's."""
    s = Banded(lambda: VTC(LinearCost()))
    s.add(view(0, "u", INTERACTIVE), 0.0)
    s.add(view(1, "u", BATCH), 0.0)
    s.add(view(2, "x", BATCH), 0.0)
    r = s.peek(0.0)
    assert r.request_id == "r0"
    s.pop(r, 0.0)
    s.on_finish(r, 2500, 0.0)  # u is charged 100 + 2 × 2,500 in the interactive band
    assert s.counter("u") > s.counter("x")
    assert s.peek(0.0).client == "x"  # not u, whose batch-band entry still had the old counter
