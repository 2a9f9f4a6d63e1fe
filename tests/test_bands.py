"""Priority bands over a fair policy (policies/bands.py): a higher band goes first, a band with nothing that fits
never holds a lower one back, a minimum share keeps a lower band served, and within a band the policy is the
policy alone would be (VTC's counter lift over that band's backlog only)."""

from __future__ import annotations

import pytest

from fairgate.accounting.cost import LinearCost
from fairgate.policies.bands import Banded
from fairgate.policies.dlpm import DLPM
from fairgate.policies.factory import LIVE_POLICIES, make_scheduler
from fairgate.policies.vtc import VTC
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


def _run(doc: dict, policy: str = "vtc"):
    from fairgate.accounting.cost import make_cost
    from fairgate.sim import report
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.workload import from_dict

    w = from_dict(doc)
    out = simulator_for(w, policy, "least-load", get_profile("a10g-llama2-7b"), mode="gateway", backends=1,
                        cost=make_cost("weighted")).run()
    return w, report.build(out, policy, "least-load", make_cost("weighted"))


def _three_classes(bands: bool, share: float | None = 0.15) -> dict:
    def client(cid, band, rate, inp, out):
        c = {"id": cid, "arrival": {"kind": "poisson", "rate": rate}, "input_tokens": inp, "output_tokens": out}
        if bands:
            c["band"] = band
            if band == "batch" and share:
                c["min_share"] = share
        return c
    return {"duration_s": 60, "seed": 5, "slo": {"ttft_s": 2.0}, "clients": [
        client("chat1", "interactive", 0.6, 200, 100), client("chat2", "interactive", 0.6, 200, 100),
        client("std1", "standard", 1.0, 400, 200), client("std2", "standard", 1.0, 400, 200),
        client("bulk1", "batch", 1.5, 600, 300), client("bulk2", "batch", 1.5, 600, 300)]}


def test_in_the_simulator_bands_serve_the_interactive_class_first_and_keep_a_minimum_share():
    """The simulator runs the same Banded object as the gateway (workload keys ``band:`` and ``min_share:``): at
    overload the interactive clients' TTFT drops against the same run without bands, the bands' order shows in
    the waits, the batch band keeps about its minimum share of dispatches, and the document reports per band."""
    w, doc = _run(_three_classes(bands=True))
    _, flat = _run(_three_classes(bands=False))
    ttft = {c: v["p50_ttft_s"] for c, v in doc["clients"].items()}
    assert max(ttft["chat1"], ttft["chat2"]) < min(ttft["std1"], ttft["std2"]) < min(ttft["bulk1"], ttft["bulk2"])
    assert doc["slo"]["by_band"]["interactive"]["attainment"] > flat["slo"]["attainment"]
    assert set(doc["slo"]["by_band"]) == {"interactive", "standard", "batch"} and "by_band" not in flat["slo"]
    def dispatched(w) -> list[int]:  # the bands of the dispatches before the horizon (the share is of them all)
        return [w.bands[r.client] for r in sorted(w.requests, key=lambda r: r.dispatched or 1e9)
                if r.dispatched is not None and r.dispatched < 60]

    busy = dispatched(w)
    assert len(busy) > 100 and busy.count(BATCH) / len(busy) == pytest.approx(0.15, abs=0.03)
    strict = dispatched(_run(_three_classes(bands=True, share=None))[0])
    assert strict.count(BATCH) / len(strict) < 0.08  # without a share the batch band waits (its first few aside)


def test_what_waits_ahead_of_a_request_follows_the_policys_order():
    """Shedding's estimate (pipeline/shedding.py): FCFS serves all that waits first; a fair policy serves the
    tenant's own queue and each other waiting tenant about once, however deep their queues; bands put the
    higher bands' requests first."""
    from fairgate.policies.scheduler import FCFS

    fair, fifo = VTC(LinearCost()), FCFS(LinearCost())
    for n in range(200):
        for s in (fair, fifo):
            s.add(view(n, "bulk", STANDARD), 0.0)
    fair.add(view(900, "other", STANDARD), 0.0)
    newcomer = view(999, "light", STANDARD)
    assert fair.waiting_ahead(newcomer) == 2 and fifo.waiting_ahead(newcomer) == 200
    assert fair.waiting_ahead(view(998, "bulk", STANDARD)) == 201  # its own 200, and "other" once
    s = Banded(lambda: VTC(LinearCost()))
    for n, band in enumerate((INTERACTIVE, STANDARD, STANDARD, BATCH, BATCH, BATCH)):
        s.add(view(n, f"c{n}", band), 0.0)
    assert [s.waiting_ahead(view(99, "new", b)) for b in (INTERACTIVE, STANDARD, BATCH)] == [1, 3, 6]
    assert VTC(LinearCost()).waiting_ahead(newcomer) == 0


@pytest.mark.parametrize("policy", ["vtc", "dlpm"])
def test_a_policys_own_waiting_ahead_is_the_contracts_estimate(policy):
    """DLPM answers ``waiting_ahead`` in O(1) (its backlog's size), and VTC for a client already waiting: the
    base's walk of the waiting tenants gives the same, through arrivals, picks and requests given up. For a
    client joining, VTC counts its exact place, at most the base's estimate."""
    import random

    from fairgate.policies.scheduler import Scheduler

    rng, s = random.Random(1), make_scheduler(policy, LinearCost(), lambda c: 1.0)
    waiting = []
    for n in range(400):
        if rng.random() < 0.6 or not waiting:
            v = view(n, f"c{rng.randint(0, 12)}", STANDARD)
            s.add(v, 0.0)
            waiting.append(v)
        elif rng.random() < 0.5:
            r = s.peek(0.0)
            s.pop(r, 0.0)
            waiting.remove(r)
        else:
            r = waiting.pop(rng.randrange(len(waiting)))
            s.remove(r, 0.0)
            s.peek(0.0)  # (VTC drops what was given up as its pick meets it)
        probe = view(10_000 + n, f"c{rng.randint(0, 14)}", STANDARD)
        if policy == "dlpm":
            assert s.waiting_ahead(probe) == Scheduler.waiting_ahead(s, probe)
        elif probe.client in s.waiting_by_client():  # VTC counts a given-up request until its pick meets it
            assert 0 <= s.waiting_ahead(probe) - Scheduler.waiting_ahead(s, probe) <= len(s._gone) + 1
        else:  # a client joining: its exact place, never more than the estimate (policies/backlog.py)
            assert 0 <= s.waiting_ahead(probe) <= Scheduler.waiting_ahead(s, probe) + len(s._gone)
