"""Aladdin's placement on a running gateway (policies/aladdin.py over proxy/control/latency_fits.py's fits): over
backends of two speeds it learns which of them can meet a class's targets and keeps the class's requests
there, where least-load and D²LPM spread them over all four."""

from __future__ import annotations

import asyncio
import random

import pytest

from fairgate.accounting.slo import SloClass
from fairgate.proxy.config import BackendConfig
from fairgate.engine.serve import start_emulator
from tests.conftest import gateway_config, run_gateway

# two backends at the profile's pace (a 37 ms decode step) and two at half of it (74 ms): an ATGT target of
# 55 ms can be met on the first two only
SPEEDS = {"fast-a": 1.0, "fast-b": 1.0, "slow-a": 0.5, "slow-b": 0.5}
GOLD = SloClass("gold", ttft_ms=2_000, atgt_ms=55, band="interactive")


@pytest.mark.slow
@pytest.mark.alone
async def test_aladdin_keeps_more_requests_within_their_targets_than_least_load_and_d2lpm(sqlite_url):
    """One gateway over the four backends; the placement is switched live (`fairgate admin locality set
    placement …`) between phases of open-loop arrivals at 3 per second, half of them long prompts (~1,000
    tokens), half short, 20-40 output tokens each. Least-load (first: every backend's fit learns its pace from
    its streams) and D²LPM send the slow backends their share, which misses the ATGT target; Aladdin, reading
    the fits, keeps the class on the two backends that meet it."""
    emulators = [await start_emulator(speed=speed, seed=k) for k, speed in enumerate(SPEEDS.values())]
    try:
        cfg = gateway_config(sqlite_url, backends=[BackendConfig(url=e.url, name=name)
                                                   for e, name in zip(emulators, SPEEDS)],
                             placement="least-load", latency_profile="a10g-llama2-7b", settings_refresh_s=0.1,
                             health_interval_s=3600)
        async with run_gateway(cfg) as gw:
            rng = random.Random(5)
            results = {}
            for placement in ("least-load", "d2lpm", "aladdin"):
                await gw.admin.set_setting("placement", placement)
                client = gw.client(await gw.key(placement))
                await gw.admin.set_slo(placement, GOLD)
                await gw.gateway.tenants.refresh()
                assert gw.gateway.config.placement == placement

                async def ask(k: int) -> None:
                    stream = await client.chat.completions.create(
                        model="sim-llama", max_tokens=rng.randint(20, 40), stream=True,
                        extra_body={"ignore_eos": True},
                        messages=[{"role": "user", "content": f"{k} " + "lorem " * (1000 if k % 2 else 40)}])
                    _ = [c async for c in stream]

                tasks = []
                for k in range(40):
                    tasks.append(asyncio.ensure_future(ask(k)))
                    await asyncio.sleep(1 / 3)
                await asyncio.gather(*tasks)
                rows = await gw.rows(app=placement)
                served = {}
                for r in rows:
                    served[r["backend"]] = served.get(r["backend"], 0) + 1
                results[placement] = (sum(bool(r["slo_met"]) for r in rows) / len(rows), served)
            steps = {name: gw.gateway.latency.model(name).step(1, 1000) for name in SPEEDS}
    finally:
        for e in emulators:
            await e.stop()
    print(results, steps)
    assert min(steps["slow-a"], steps["slow-b"]) > 1.5 * max(steps["fast-a"], steps["fast-b"])  # learnt
    aladdin = results["aladdin"][0]
    # (1.00 in most runs; 0.875-0.925 in a cold `make test` beside a vLLM build: its targets are in real time)
    assert aladdin >= 0.8 and all(aladdin > results[p][0] + 0.2 for p in ("least-load", "d2lpm")), results
    # Least-load and D²LPM send the slow pair about a third of the 40; Aladdin none in most runs, and one or two
    # in a cold `make test` on a loaded machine: a request whose TTFT budget ran out while it waited goes to the
    # least loaded backend, as the placement says. Four (one in ten) is the bound.
    slow = {p: counts.get("slow-a", 0) + counts.get("slow-b", 0) for p, (_, counts) in results.items()}
    assert slow["aladdin"] <= 4 and min(slow["least-load"], slow["d2lpm"]) >= 8, results


@pytest.mark.slow
async def test_vtc_in_front_of_aladdin_keeps_two_flooding_tenants_within_15_percent(sqlite_url):
    """The fair queue says who is next, Aladdin only where: two tenants of one classed app flooding with 16 and
    32 concurrent streams get weighted service within 15 % of each other (test_fair_dispatch.py's flood)."""
    from tests.test_fair_dispatch import EMULATED, SECONDS, _run, _service

    cfg = gateway_config(sqlite_url, policy="vtc", placement="aladdin", emulated=EMULATED,
                         latency_profile="a10g-llama2-7b")
    async with run_gateway(cfg) as gw:
        await gw.key("tenants")
        await gw.admin.set_slo("tenants", SloClass("loose", ttft_ms=60_000, atgt_ms=1_000))
        await gw.gateway.tenants.refresh()
        rows = await _run(gw, {"a": 16, "b": 32}, seconds=SECONDS)
        assert all(b.inflight == 0 and b.inflight_tokens == 0 for b in gw.gateway.pool.backends)  # no leak
        assert all(gw.gateway.dispatcher.placement.ledger(b.name) == 0 for b in gw.gateway.pool.backends)
    a, b = _service(rows["a"]), _service(rows["b"])
    assert len(rows["a"]) > 10 and {r["slo_class"] for r in rows["a"]} == {"loose"}
    assert abs(a - b) <= 0.15 * max(a, b), (a, b)


async def test_aladdin_parameters_are_set_live_and_nonsense_is_refused(sqlite_url):
    """`fairgate admin locality set --gamma/--theta/--pack` reach a running gateway's aladdin placement within a
    settings refresh; values out of range are refused by the CLI and by the configuration."""
    from fairgate.proxy.config import ConfigError, load_config
    from tests.test_slo_plan import cli

    async with run_gateway(gateway_config(sqlite_url, placement="aladdin", settings_refresh_s=0.1)) as gw:
        placement = gw.gateway.dispatcher.placement
        assert (placement.gamma, placement.theta, placement.pack) == (0.5, 0.9, False)
        out = await asyncio.to_thread(cli, "admin", "locality", "set", "--theta", "0.7", "--pack", "1",
                                      "--gamma", "0.25", "--database-url", sqlite_url)
        assert out.returncode == 0, out.stderr
        await gw.gateway.tenants.refresh()
        assert (placement.gamma, placement.theta, placement.pack) == (0.25, 0.7, True)
        for args in (["--theta", "0"], ["--gamma", "1.5"], ["--pack", "2"]):
            bad = await asyncio.to_thread(cli, "admin", "locality", "set", *args, "--database-url", sqlite_url)
            assert bad.returncode != 0 and args[0] in bad.stderr, (args, bad.stderr)
    with pytest.raises(ConfigError, match="theta"):
        load_config(None, locality={"theta": 0})
