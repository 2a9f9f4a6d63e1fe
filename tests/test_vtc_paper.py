"""The VTC paper's acceptance checks (docs/policies/vtc.md#checks), in engine mode and in gateway mode with 1
and 4 engines, run by the simulator over the same policy objects the gateway uses."""

from __future__ import annotations

import statistics

import pytest

from tests.simhelp import mean_ttft, run, steady_service

pytestmark = pytest.mark.slow
U = 20_000  # max(w_p·L_input, w_q·M) with M = 10 000, w_q = 2 (VTC paper, Eq. 2)
MODES = [("engine", 1, 1.0), ("gateway", 1, 1.0), ("gateway", 4, 4.0)]  # 4 engines get 4× the arrivals
ONE_ENGINE = MODES[:2]  # (dispatch over 4 engines is checked by A1, A2, A7 and A13; the rest check the policy)


def within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("mode,n,scale", MODES)
def test_a1_overload_vtc_equal_fcfs_proportional(mode, n, scale):
    vtc, vdoc = run("overload", "vtc", mode, n, scale=scale)
    fcfs, fdoc = run("overload", "fcfs", mode, n, scale=scale)
    sv, sf = steady_service(vtc, 60, 540), steady_service(fcfs, 60, 540)
    assert within(sv["c1"], sv["c2"], 0.05)  # equal service (paper ≈ 658-688 each)
    assert within(sf["c2"] / sf["c1"], 2.0, 0.1)  # FCFS follows the 1:2 rates
    assert within(sv["c1"] + sv["c2"], 1340 * n, 0.1)
    assert vdoc["fairness"]["max_abs_cum_diff"] <= 2 * U * n  # Thm 4.4's 2U (M is n× larger with n engines)
    curve = fdoc["fairness"]["abs_cum_diff_curve"]
    assert curve[-1][1] > 5 * curve[1][1] and within(curve[-1][1], 249_000 * n, 0.3)  # FCFS grows linearly
    assert within(vdoc["throughput_tokens_per_s"], fdoc["throughput_tokens_per_s"], 0.02)
    assert within(vdoc["throughput_tokens_per_s"], 876 * n, 0.1)  # [A]: 876 (FCFS) / 893-904 (VTC)


@pytest.mark.parametrize("mode,n,scale", MODES)
def test_a2_proportional_under_share_clients_fully_served(mode, n, scale):
    out, _ = run("proportional", "vtc", mode, n, scale=scale)
    s = steady_service(out, 60, 540)
    assert within(s["c1"], 192 * n, 0.1) and within(s["c2"], 384 * n, 0.1)  # = demand
    for c in ("c1", "c2"):  # short and flat ([A]: ≈ 5 s: a full pool frees room only as requests finish)
        assert mean_ttft(out, c) < 8 and mean_ttft(out, c, 300) < 1.5 * mean_ttft(out, c, 0, 300)
    assert mean_ttft(out, "c3", 500) > 5 * mean_ttft(out, "c3", 0, 100)  # the over-share client queues


@pytest.mark.parametrize("mode,n,scale", ONE_ENGINE)
def test_a3_a4_on_off(mode, n, scale):
    from fairgate.sim.fairness import service_curves

    less, _ = run("on_off_less", "vtc", mode, n, scale=scale)
    total = [sum(v) for v in zip(*([y for _, y in pts] for pts in service_curves(
        less.requests, less.workload.clients, 600).values()))]
    mid = total[3:-3]
    assert max(mid) <= (1.06 if n == 1 else 1.1) * min(mid)  # total service flat (A3); 4 engines ramp up longer
    assert mean_ttft(less, "c1") < 8 and mean_ttft(less, "c2", 500) > 30
    over, _ = run("on_off_overload", "vtc", mode, n, scale=scale)
    s = steady_service(over, 60, 540)
    assert within(s["c1"], s["c2"], 0.15)  # C1 stays backlogged through OFF (A4)


@pytest.mark.parametrize("mode,n,scale", ONE_ENGINE)
def test_a5_a6_poisson_bounded_vs_growing(mode, n, scale):
    for workload, fcfs_end in (("poisson_short_long", 212_000), ("poisson_in_out", 628_000)):
        _, v = run(workload, "vtc", mode, n, scale=scale)
        _, f = run(workload, "fcfs", mode, n, scale=scale)
        vc, fc = v["fairness"]["abs_cum_diff_curve"], f["fairness"]["abs_cum_diff_curve"]
        assert max(d for _, d in vc[len(vc) // 2:]) < 1.5 * max(d for _, d in vc[: len(vc) // 2])  # flat
        assert max(d for _, d in vc) < 1.5 * 2 * U * n  # artifact: 11-18 k (Fig 7), 39-41 k ≈ 2U (Fig 8)
        assert within(fc[-1][1], fcfs_end * n, 0.3)  # FCFS grows linearly
    _, v = run("poisson_in_out", "vtc", mode, n, scale=scale)
    _, f = run("poisson_in_out", "fcfs", mode, n, scale=scale)
    assert v["throughput_tokens_per_s"] < f["throughput_tokens_per_s"]  # [A]: 1,671 vs ≈1,930


@pytest.mark.parametrize("mode,n,scale", MODES)
def test_a7_isolation_from_a_ramping_client(mode, n, scale):
    vtc, _ = run("increase", "vtc", mode, n, scale=scale)
    fcfs, _ = run("increase", "fcfs", mode, n, scale=scale)
    assert mean_ttft(vtc, "c1", 480) < 1.0  # C1 unaffected as C2 ramps past its share
    assert mean_ttft(fcfs, "c1", 540) > 5 * mean_ttft(vtc, "c1", 540)


@pytest.mark.parametrize("mode,n,scale", ONE_ENGINE)
def test_a8_distribution_shift_vtc_vs_lcf(mode, n, scale):
    vtc, _ = run("dist_shift", "vtc", mode, n, scale=scale)
    lcf, _ = run("dist_shift", "lcf", mode, n, scale=scale)
    sv, sl = steady_service(vtc, 360, 570), steady_service(lcf, 360, 570)
    assert within(sv["c1"], sv["c2"], 0.05)  # phase 2: equal under VTC
    assert 1.15 < sl["c1"] / sl["c2"] < 1.6  # LCF inherits C1's phase-1 deficit ([A]: ≈ 770 / 590)
    # phase 3: C1 is served at its demand (under VTC once its phase-2 backlog has drained, by ≈ 740 s)
    p3v, p3l = steady_service(vtc, 750, 870), steady_service(lcf, 660, 870)
    assert within(p3v["c1"], 384 * n, 0.1) and within(p3l["c1"], 384 * n, 0.1)


def test_a9_a11_real_trace_table_2():
    doc = {p: run("real", p)[1] for p in ("fcfs", "lcf", "vtc", "vtc-predict", "vtc-oracle", "rpm:5", "rpm:10",
                                          "rpm:15", "rpm:20", "rpm:30")}
    f = {p: d["fairness"] for p, d in doc.items()}
    thr = {p: d["throughput_tokens_per_s"] for p, d in doc.items()}
    for p in ("vtc", "vtc-predict", "vtc-oracle"):
        assert f[p]["avg_diff"] < 0.7 * f["fcfs"]["avg_diff"]  # paper: 0.58×
        assert f[p]["max_diff"] < f["fcfs"]["max_diff"]
    assert f["vtc-oracle"]["avg_diff"] < f["vtc"]["avg_diff"]
    # Max Diff ordering: RPM(5) < the VTC family < RPM(20) < RPM(30) < LCF, FCFS
    vtc_family = [f[p]["max_diff"] for p in ("vtc", "vtc-predict", "vtc-oracle")]
    assert f["rpm:5"]["max_diff"] < min(vtc_family) and max(vtc_family) < f["rpm:20"]["max_diff"]
    assert f["rpm:20"]["max_diff"] < f["rpm:30"]["max_diff"] < min(f["lcf"]["max_diff"], f["fcfs"]["max_diff"])
    work_conserving = [thr[p] for p in ("fcfs", "lcf", "vtc", "vtc-predict", "vtc-oracle")]
    assert max(work_conserving) < 1.02 * min(work_conserving)
    assert within(thr["vtc"], 779, 0.1)
    rpm = [thr[f"rpm:{k}"] for k in (5, 10, 15, 20, 30)]
    assert rpm == sorted(rpm) and rpm[-1] < thr["vtc"]  # the fairness-throughput dilemma (Fig 14)
    for got, paper in zip(rpm, (340, 532, 626, 694, 747)):
        assert within(got, paper, 0.1)
    assert within(doc["rpm:5"]["clients"]["2"]["rejected"] + sum(
        c["rejected"] for k, c in doc["rpm:5"]["clients"].items() if k != "2"), 919, 0.1)


@pytest.mark.parametrize("mode,n,scale", MODES)
def test_a13_weighted(mode, n, scale):
    out, _ = run("weighted", "vtc", mode, n, scale=scale)
    s = steady_service(out, 60, 300)
    base = s["c1"]
    for i in (2, 3, 4):
        assert within(s[f"c{i}"] / base, i, 0.05)
    eq, _ = run("weighted_equal", "vtc", mode, n, scale=scale)
    s = steady_service(eq, 60, 300)
    assert max(s.values()) < 1.15 * min(s.values())


@pytest.mark.parametrize("mode,n,scale", ONE_ENGINE)
def test_a14_length_prediction(mode, n, scale):
    for workload in ("predict_2", "predict_8"):
        d = {p: run(workload, p, mode, n, scale=scale)[1] for p in ("vtc", "vtc-range", "vtc-oracle")}
        m = {p: x["fairness"]["max_diff"] for p, x in d.items()}
        assert m["vtc-oracle"] < m["vtc-range"] < m["vtc"]
        assert m["vtc"] > 3 * m["vtc-oracle"]
        # Throughput is tokens over the makespan, and the makespan of a uniform overload depends on how the
        # reserve-the-future memory rule packs the last requests: 828-862 tokens/s among the three here
        # ([A]: 875-904); 4 engines add the tail's idle engines.
        t = [x["throughput_tokens_per_s"] for x in d.values()]
        assert max(t) < (1.05 if n == 1 else 1.08) * min(t)


def test_a9_max_diff_ratio_is_robust_to_the_step_time():
    """Max Diff is one window's worst: across step times of 35-39 ms its medians keep the paper's ratios (VTC ≈
    0.48 × FCFS on Max Diff, 0.58 on Avg Diff; bench/table2.py --sweep prints the runs)."""
    from bench.table2 import sweep

    med = {p: [statistics.median(r[i] for r in sweep(p)) for i in range(2)] for p in ("fcfs", "vtc")}
    assert within(med["vtc"][0] / med["fcfs"][0], 0.48, 0.3)
    assert within(med["vtc"][1] / med["fcfs"][1], 0.58, 0.15)


def test_a10_real_trace_response_times():
    """Fig 12: FCFS hurts every client; VTC keeps mid-rate clients fast and delays only the heavy ones."""
    from collections import Counter

    fcfs, _ = run("real", "fcfs")
    vtc, _ = run("real", "vtc")
    count = Counter(r.client for r in fcfs.requests)
    order = sorted(count, key=lambda c: (count[c], c))
    mid, heavy = [order[12], order[13]], [order[25], order[26]]  # the paper's 13th/14th and 26th/27th
    for c in mid:
        assert mean_ttft(vtc, c) < 5 and mean_ttft(fcfs, c) > 30  # paper: 2.9 / 3.4 s vs 77 / 55 s
    assert sum(mean_ttft(vtc, c) for c in heavy) >= sum(mean_ttft(fcfs, c) for c in heavy)


@pytest.mark.timeout(900)  # a sweep of engine-mode runs: 240 s alone on a machine 3× slower than usual
def test_a12_ablation_memory_pool_and_length():
    """Fig 15: the accumulated difference grows with the pool M and with request length until it saturates at
    the bound. One run's value is bimodal in the step time (bench/fig15.py), so compare medians over a sweep
    (every other step time of the bench's nine: the medians of 512×2 and 768×2 are the nine's, 45 % sooner)."""
    from bench.fig15 import SETTINGS, SWEEP_C3, sweep

    med = {name: statistics.median(v) for name, v in ((n, sweep(n, SWEEP_C3[::2])) for n in SETTINGS)}
    assert med["256×2"] < 0.5 * med["512×2"]  # paper: 32.0 k vs 51.5 k
    assert within(med["512×2"], med["768×2"], 0.15)  # saturated: paper 51.5 k ≈ 50.3 k
    assert med["512×2, M=65000"] > 1.15 * med["512×2"]  # larger pool, larger batches (paper 1.8×)
    assert med["768×2"] < 2 * 35_000 and med["512×2, M=65000"] < 2 * 65_000  # below U = w_q·M


def test_a15_profiled_cost_tables_3_and_4():
    t4 = {p: run("predict_2", p, cost="profile")[1]["fairness"] for p in ("fcfs", "vtc", "vtc-oracle")}
    assert t4["vtc-oracle"]["max_diff"] < 0.1 * t4["vtc"]["max_diff"] < t4["fcfs"]["max_diff"]  # 4.28/137/323
    assert within(t4["fcfs"]["max_diff"], 323.18, 0.15)
    t3 = {p: run("real", p, cost="profile")[1]["fairness"] for p in ("fcfs", "vtc", "vtc-oracle", "rpm:5")}
    assert t3["rpm:5"]["avg_diff"] < t3["vtc-oracle"]["avg_diff"] < t3["vtc"]["avg_diff"] < t3["fcfs"]["avg_diff"]
