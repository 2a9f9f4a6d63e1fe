"""Three SLO classes at 1.3× overload in the simulator (policies/bands.py over VTC): the interactive
class keeps its TTFT target, tenants within each class stay fair, the pool is as busy as under FCFS, and the
batch band keeps its minimum share."""

from __future__ import annotations

from fairgate.accounting.cost import make_cost
from fairgate.sim import fairness, report
from fairgate.engine.profiles import get_profile
from fairgate.sim.setup import simulator_for
from fairgate.sim.workload import from_dict

DURATION, BACKENDS, PROFILE = 120.0, 2, "a10g-llama2-7b"
COST = make_cost("weighted")
# each class's clients, their share of the offered load and lengths. The interactive and standard classes are
# served all they ask (their two clients ask alike); the batch class, backlogged, gets what is left, and one of
# its clients asks twice as often as the other (FCFS serves them about 1:2, VTC alike)
CLASSES = {
    "interactive": {"share": 0.15, "split": (1, 1), "input": 200, "output": 60, "slo": {"ttft_s": 2.0}},
    "standard": {"share": 0.45, "split": (1, 1), "input": 400, "output": 120, "slo": {"ttft_s": 30.0}},
    "batch": {"share": 0.40, "split": (1, 2), "input": 800, "output": 150, "min_share": 0.15},
}


def _doc(total_rate: float, bands: bool) -> dict:
    clients = []
    for band, c in CLASSES.items():
        rate = total_rate * c["share"] / sum(c["split"])
        for k, part in enumerate(c["split"]):
            client = {"id": f"{band}{k}", "arrival": {"kind": "poisson", "rate": rate * part},
                      "input_tokens": c["input"], "output_tokens": c["output"]}
            if "slo" in c:
                client["slo"] = c["slo"]
            if bands:
                client["band"] = band
                if "min_share" in c:
                    client["min_share"] = c["min_share"]
            clients.append(client)
    return {"duration_s": DURATION, "seed": 11, "clients": clients}


def _run(doc: dict, policy: str):
    w = from_dict(doc)
    out = simulator_for(w, policy, "least-load", get_profile(PROFILE), mode="gateway", backends=BACKENDS,
                        cost=COST).run()
    return w, report.build(out, policy, "least-load", COST)


def _capacity() -> float:
    """Requests per second the pool completes of this mix when flooded (5× what it could take)."""
    w, _ = _run(_doc(40.0, bands=False), "fcfs")
    done = [r for r in w.requests if r.finished is not None and r.finished <= DURATION]
    return len(done) / DURATION


def test_three_classes_at_1_3x_overload():
    rate = 1.3 * _capacity()
    w, banded = _run(_doc(rate, bands=True), "vtc")
    flat_w, flat = _run(_doc(rate, bands=False), "fcfs")
    by_band = banded["slo"]["by_band"]
    # the interactive class keeps its TTFT target; FCFS, with no classes, breaks it
    assert by_band["interactive"]["attainment"] >= 0.99, by_band
    assert flat["clients"]["interactive0"]["slo_attainment"] < 0.5
    # within each class, weighted service by the horizon is fair (the backlogged ones asked 1:2)
    served = fairness.accumulated(w.requests, list(w.clients), DURATION, COST)
    for band in CLASSES:
        jain = fairness.jain([served[f"{band}0"], served[f"{band}1"]])
        assert jain >= 0.95, (band, served)
    flat_served = fairness.accumulated(flat_w.requests, list(flat_w.clients), DURATION, COST)
    assert fairness.jain([flat_served["batch0"], flat_served["batch1"]]) < 0.95  # FCFS serves the batch class 1:2
    # work-conserving: as many tokens served by the horizon as FCFS, and more of them within their targets
    # (goodput: the output of the requests with a target that met it)
    assert banded["throughput_at_horizon_tokens_per_s"] >= 0.95 * flat["throughput_at_horizon_tokens_per_s"]

    def goodput(wl) -> int:
        return sum(r.generated for r in wl.requests if wl.slo_for(r.client) is not None
                   and r.finished is not None and r.finished <= DURATION
                   and r.first_token - r.arrival <= wl.slo_for(r.client).ttft_s)

    assert goodput(w) >= goodput(flat_w)
    # the batch band, last in order, keeps its minimum share of the dispatches while the pool is busy
    busy = [w.bands[r.client] for r in w.requests if r.dispatched is not None and 10 < r.dispatched < DURATION]
    assert busy.count(2) / len(busy) >= 0.15 - 0.03, busy.count(2) / len(busy)
    print({"rate": rate, "by_band": {b: v["attainment"] for b, v in by_band.items()},
           "jain": {b: fairness.jain([served[f"{b}0"], served[f"{b}1"]]) for b in CLASSES},
           "throughput": (banded["throughput_at_horizon_tokens_per_s"], flat["throughput_at_horizon_tokens_per_s"]),
           "goodput": (goodput(w), goodput(flat_w)), "batch_share": busy.count(2) / len(busy)})
