"""Calibrated p90 TTFT predictions (accounting/calibration.py): adaptive conformal bounds cover 90 % of what
is observed, on a drifting synthetic sequence, on the Azure conversation trace in simulation and live."""

from __future__ import annotations

import math
import random

import pytest

from fairgate.accounting.calibration import CalibratedUpper, ttft_point
from fairgate.accounting.latency import BackendLatency, LatencyModel


def test_the_bound_covers_its_target_while_the_traffic_drifts():
    """The ratio observed / point drifts from ~1 to ~5 and back, with bursts, and its spread depends on the
    point's size: over 2,000 observations each class of points and the whole are covered 90 % of the time
    (quantile tracking's (B + η)/(η·T) of 10 %), and the bound is finite from the ninth observation on."""
    rng, c = random.Random(3), CalibratedUpper(0.9)
    per_class: dict[int, list[bool]] = {}
    for t in range(2000):
        point = rng.choice((0.05, 0.3, 2.0)) * rng.uniform(0.5, 1.5)
        drift = 1 + 4 * math.sin(math.pi * t / 2000) ** 2 + (3 if t % 400 < 20 else 0)
        spread = 0.8 if point < 0.1 else 0.2  # a short wait is missed by more than a long one
        observed = point * drift * rng.lognormvariate(0, spread)
        upper = c.upper(point)
        if upper is not None:
            per_class.setdefault(c._class(point), []).append(observed <= upper)
        c.observe(point, observed, upper)
    assert c.unbounded == 9 and abs(c.coverage - 0.9) <= 0.02, (c.unbounded, c.coverage)
    for covered in per_class.values():  # (~670 each)
        assert abs(sum(covered) / len(covered) - 0.9) <= 0.03, sum(covered) / len(covered)


def test_the_first_steps_are_small_until_the_spread_is_known():
    """Until 19 scores give a 0.95-quantile the integrator steps by its floor (lr × 0.05), not by a spread made
    up of the median alone (found by review: nine ratios of 0.1 made a miss move the bound 46× too far)."""
    c = CalibratedUpper(0.9)
    for _ in range(9):
        c.observe(1.0, 0.1, None)
    c.observe(1.0, 5.0, c.upper(1.0))  # a miss
    assert c.integrators[c._class(1.0)] == pytest.approx(c.lr * 0.05 * 0.9)


def test_nonsense_is_not_learnt_and_the_point_needs_a_rate():
    c = CalibratedUpper(0.9)
    for bad in ((math.nan, 1.0), (1.0, math.inf), (-1.0, 1.0), (1.0, -2.0)):
        c.observe(*bad, upper=None)
    assert c.predictions == c.unbounded == 0 and c.upper(1.0) is None  # nothing learnt: no bound yet
    with pytest.raises(ValueError):
        CalibratedUpper(1.5)
    fit = BackendLatency(LatencyModel(k1=1e-4, c1=0.01, k2=1e-7, c2=0.0, c3=0.02))
    assert ttft_point(0, 0.0, 1000, [(fit, 0)]) == pytest.approx(0.11)  # nothing ahead: its prefill
    assert ttft_point(5, 0.0, 1000, [(fit, 0)]) is None  # requests ahead and no dispatch seen: unknown
    assert ttft_point(10, 5.0, 1000, [(fit, 0)]) == pytest.approx(2.11)


@pytest.mark.parametrize("trace,backends", [("conv", 4), ("conv", 12), ("code", 8)])
def test_in_simulation_the_p90_ttft_covers_90_percent_of_the_azure_traces(trace, backends):
    """Five minutes of the Azure 2023 conversation and code traces on a100-llama2-7b at the Aladdin paper's Table 2
    targets, gateway mode, from overloaded (conv on 4: attainment 0.48) to provisioned: every prediction is made
    at arrival, before its request is seen."""
    from fairgate.accounting.cost import make_cost
    from fairgate.engine.profiles import get_profile
    from fairgate.sim import report
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.targets import OVER_CONTEXT
    from fairgate.sim.workload import from_dict

    w = from_dict({"duration_s": 300, "engine": "a100-llama2-7b", "slo": {"ttft_s": 0.4, "atgt_s": 0.015},
                   "trace": {"path": f"azure-2023-{trace}.csv", "format": "azure", "clients": 10}})  # (vendored)
    out = simulator_for(w, "vtc", "least-load", get_profile("a100-llama2-7b"), mode="gateway", backends=backends,
                        cost=make_cost("weighted")).run()
    p90 = report.build(out, "vtc", "least-load", make_cost("weighted"))["slo"]["ttft_p90"]
    queued = [r for r in w.requests if r.throttle_reason != OVER_CONTEXT]  # (a prompt the model cannot take is
    assert p90["predictions"] > 0.95 * len(queued) and p90["unbounded"] < 0.02 * len(queued), p90  # refused first)
    assert abs(p90["coverage"] - 0.9) <= 0.03, p90


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.solo  # (its p90 coverage, within 0.03 of 0.9: a neighbour's flood once moved it to 0.86)
async def test_live_the_p90_ttft_in_each_row_covers_90_percent_over_backends_of_two_speeds(sqlite_url):
    """2,400 streams of a classed app over two emulated backends, one twice as fast as the other, in waves
    that fill the queue and drain it (prompts of 20-1,500 words): the p90 TTFT each row carries covers 90 ± 3 %
    of the first tokens that follow, and /metrics says so."""
    import asyncio

    import aiohttp

    from fairgate.accounting.slo import SloClass
    from fairgate.engine.serve import start_emulator
    from fairgate.proxy.config import BackendConfig
    from tests.conftest import gateway_config, run_gateway

    emulators = [await start_emulator(speed=speed, seed=k, kv_tokens=4000) for k, speed in enumerate((20.0, 10.0))]
    try:
        cfg = gateway_config(sqlite_url, backends=[BackendConfig(url=e.url, name=f"b{k}")
                                                   for k, e in enumerate(emulators)],
                             latency_profile="a10g-llama2-7b", metrics_public=True, health_interval_s=3600)
        async with run_gateway(cfg) as gw:
            key = await gw.key("chat")
            await gw.admin.set_slo("chat", SloClass("gold", ttft_ms=60_000))
            await gw.gateway.tenants.refresh()
            rng = random.Random(9)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                async def ask(k: int) -> None:
                    body = {"model": "sim-llama", "max_tokens": rng.randint(4, 24), "ignore_eos": True,
                            "stream": True, "messages": [{"role": "user", "content": f"{k} " + "lorem " * rng.choice(
                                (20, 100, 400, 1500))}]}
                    async with s.post(gw.url + "/v1/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {key}"}) as r:
                        assert r.status == 200, await r.text()
                        await r.read()

                for wave in range(24):  # a burst of 40-80 at once, then a trickle
                    burst = [asyncio.ensure_future(ask(wave * 100 + k)) for k in range(rng.randint(40, 80))]
                    trickle = []
                    while len(burst) + len(trickle) < 100:
                        trickle.append(asyncio.ensure_future(ask(wave * 100 + 99 - len(trickle))))
                        await asyncio.sleep(0.01)
                    await asyncio.gather(*burst, *trickle)
                async with s.get(gw.url + "/metrics") as r:
                    coverage = next(float(x.split()[1]) for x in (await r.text()).splitlines()
                                    if x.startswith("fairgate_ttft_prediction_coverage "))
            rows = await gw.rows(app="chat")
    finally:
        for e in emulators:
            await e.stop()
    judged = [r for r in rows if r["predicted_ttft_ms"] is not None]
    from datetime import datetime

    def ttft_ms(r) -> float:
        return (datetime.fromisoformat(r["first_token_at"]) - datetime.fromisoformat(r["arrival"])).total_seconds() * 1e3

    within = [ttft_ms(r) <= r["predicted_ttft_ms"] for r in judged]
    assert len(rows) == 2400 and len(judged) > 1300, (len(rows), len(judged))  # (the first wave has no history, nor
    # a request that waits while none has left lately: fewer when a vLLM build shares the machine: 1,468 in a cold
    # `make test` on a machine 1.4× slower than usual; ±0.03 around 0.9 over 1,300 is still 3.5 standard errors)
    print(f"rows: {sum(within) / len(within):.3f} of {len(judged)}; gauge: {coverage:.3f}")
    assert abs(sum(within) / len(within) - 0.9) <= 0.03, sum(within) / len(within)
    assert abs(coverage - 0.9) <= 0.03
