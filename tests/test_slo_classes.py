"""SLO classes on a running gateway (`fairgate admin slo set`, accounting/slo.py): each request of an app with a
class carries its targets (tightened by its x-slo-* headers only where an admin allowed them), its row says
whether it met them, and `usage summary` and /metrics count attainment per class."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from fairgate.accounting.slo import SloClass
from fairgate.storage import usage_queries
from tests.conftest import gateway_config, run_gateway
from tests.test_cli import fg

OPS = {"Authorization": "Bearer ops-secret"}
ASK = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
       "extra_body": {"ignore_eos": True}}


async def test_a_class_sets_targets_and_each_row_says_whether_they_were_met(db_url):
    async with run_gateway(gateway_config(db_url, emulated={"count": 1}, ops_token="ops-secret",
                                          settings_refresh_s=0.1)) as gw:
        keys = {app: await gw.key(app) for app in ("chat", "strict", "plain")}
        await gw.admin.set_slo("chat", SloClass("gold", ttft_ms=60_000, atgt_ms=10_000, band="interactive"))
        await gw.admin.set_slo("strict", SloClass("impossible", ttft_ms=0.001))
        await gw.gateway.tenants.refresh()
        for app, key in keys.items():
            client = gw.client(key)
            await client.chat.completions.create(**ASK)
            stream = await client.chat.completions.create(**ASK, stream=True)
            assert len([c async for c in stream if c.choices and c.choices[0].delta.content]) == 8
        rows = {app: await gw.rows(app=app) for app in keys}
        for r in rows["chat"]:
            assert (r["slo_class"], r["slo_ttft_ms"], r["slo_atgt_ms"], r["slo_met"]) == ("gold", 60_000, 10_000, True)
        # the non-streamed answer came whole (nonstream_upstream: json): its ATGT is unknown, not 0
        assert [r["stream"] for r in rows["chat"]] == [False, True]
        assert rows["chat"][0]["atgt_ms"] is None and 0 < rows["chat"][1]["atgt_ms"] < 10_000
        assert [(r["slo_class"], r["slo_ttft_ms"], r["slo_met"]) for r in rows["strict"]] == [("impossible", 0.001, False)] * 2
        assert all(r["slo_class"] is None and r["slo_met"] is None for r in rows["plain"])
        assert rows["plain"][1]["atgt_ms"] > 0
        summary = {r["slo_class"]: r for r in await usage_queries.summary(gw.gateway.sessions, "slo_class")}
        assert {c: (r["requests"], r["slo_requests"], r["slo_met"]) for c, r in summary.items()} == {
            "gold": (2, 2, 2), "impossible": (2, 2, 0), None: (2, 0, 0)}
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics", headers=OPS) as r:
            text = await r.text()
        assert 'fairgate_slo_requests_total{app="chat",met="true",slo_class="gold"} 2.0' in text
        assert 'fairgate_slo_requests_total{app="strict",met="false",slo_class="impossible"} 2.0' in text
        assert 'fairgate_slo_goodput_tokens_total{app="chat",slo_class="gold"} 16.0' in text
        assert 'app="plain"' not in text.split("fairgate_slo_requests_total", 1)[1].split("# HELP", 1)[0]


async def test_slo_headers_only_tighten_and_only_where_allowed(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url, emulated={"count": 1}, settings_refresh_s=0.1)) as gw:
        key = await gw.key("chat")
        await gw.admin.set_slo("chat", SloClass("gold", ttft_ms=60_000))
        await gw.gateway.tenants.refresh()
        client = gw.client(key)

        async def targets(headers):
            await client.chat.completions.create(**ASK, extra_headers=headers)
            r = (await gw.rows(app="chat"))[-1]
            return r["slo_ttft_ms"], r["slo_atgt_ms"]

        tighter = {"x-slo-ttft-ms": "2500", "x-slo-tpot-ms": "40.5"}
        assert await targets(tighter) == (60_000, None)  # not allowed: not read
        assert await targets({"x-slo-ttft-ms": "junk"}) == (60_000, None)
        await gw.admin.allow_fields("chat", ["slo-headers"])
        await gw.gateway.tenants.refresh()
        assert await targets(tighter) == (2500, 40.5)
        assert await targets({"x-slo-ttft-ms": "3600000"}) == (60_000, None)  # never looser than its class
        for bad in ("junk", "-1", "0", "1e3", "9999999", "nan", "1.2345", "0x10"):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(**ASK, extra_headers={"x-slo-tpot-ms": bad})
            assert e.value.code == "invalid_slo_header" and "x-slo-tpot-ms" in e.value.message, bad
        rejected = [r for r in await gw.rows(app="chat") if r["status"] == "rejected"]
        assert len(rejected) == 8 and all(r["slo_class"] == "gold" and r["slo_met"] is None for r in rejected)


async def test_what_is_judged_a_whole_answer_a_refusal_and_a_throttle(sqlite_url):
    """A whole (non-streamed) answer is judged by its TTFT, an upper bound, and not by an ATGT it cannot show; a
    stream is judged by both; a request refused as malformed is not judged; one throttled is a miss."""
    async with run_gateway(gateway_config(sqlite_url, emulated={"count": 1}, settings_refresh_s=0.1)) as gw:
        client = gw.client(await gw.key("chat"))
        await gw.admin.set_slo("chat", SloClass("fast-tokens", ttft_ms=60_000, atgt_ms=0.001))
        await gw.admin.create_user("alice", app="chat", rpm=1)
        await gw.gateway.tenants.refresh()
        await client.chat.completions.create(**ASK)  # whole: TTFT met, ATGT not judged
        stream = await client.chat.completions.create(**ASK, stream=True)  # streamed: no 0.001 ms per token
        _ = [c async for c in stream]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(**{**ASK, "model": "no-such-model"})
        await client.chat.completions.create(**ASK, user="alice")
        with pytest.raises(openai.RateLimitError):  # alice's 1 request per minute
            await client.chat.completions.create(**ASK, user="alice")
        rows = await gw.rows(app="chat")
    assert [(r["status"], r["slo_class"], r["slo_met"]) for r in rows] == [
        ("ok", "fast-tokens", True), ("ok", "fast-tokens", False), ("rejected", "fast-tokens", None),
        ("ok", "fast-tokens", True), ("throttled", "fast-tokens", False)]


async def test_a_stored_class_that_does_not_parse_is_shown_as_such(sqlite_url):
    from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
    from fairgate.storage.identity import Admin

    engine = make_engine(sqlite_url)
    await ensure_schema(engine)
    admin = Admin(sessionmaker(engine))
    await admin.create_app("chat")
    for raw in ("[" * 5000, '{"name": "x", "band": "vip"}', "nonsense"):
        await admin.set_setting("app.chat.slo", raw)
        [row] = await admin.slo_classes()
        assert row["app"] == "chat" and row["error"]
    await engine.dispose()


def test_a_header_value_is_a_plain_decimal_number_of_milliseconds():
    gold = SloClass("gold", ttft_ms=500)
    assert gold.targets({"x-slo-ttft-ms": " 250.5 "}) == (250.5, None)
    for bad in ("١٢", "", " ", "+5", "5 ms", "\x00", "1_000"):
        with pytest.raises(ValueError):
            gold.targets({"x-slo-ttft-ms": bad})
    assert gold.targets(None) == (500, None)


def test_the_cli_sets_shows_and_clears_a_class_and_refuses_nonsense(sqlite_url):
    fg("admin", "app", "create", "chat", db=sqlite_url)
    for bad in (["--ttft-ms", "-5"], ["--atgt-ms", "0"], ["--band", "vip"], ["--min-share", "1.5"],
                ["--ttft-ms", "inf"], ["--class", "a b"], ["--class", ""], ["--ttft-ms", "nan"]):
        args = ["--class", "gold", *bad] if "--class" not in bad else bad
        out = fg("admin", "slo", "set", "--app", "chat", *args, db=sqlite_url, check=False)
        assert out.returncode != 0 and "error" in out.stderr + out.stdout, bad
    assert fg("admin", "slo", "set", "--app", "nope", "--class", "x", db=sqlite_url, check=False).returncode != 0
    fg("admin", "slo", "set", "--app", "chat", "--class", "gold", "--ttft-ms", "400", "--atgt-ms", "15",
       "--band", "interactive", "--sheddable", "--min-share", "0.2", db=sqlite_url)
    import json

    shown = json.loads(fg("admin", "slo", "show", "--json", db=sqlite_url).stdout)
    assert shown == [{"app": "chat", "class": "gold", "ttft_ms": 400.0, "atgt_ms": 15.0, "band": "interactive",
                      "sheddable": True, "min_share": 0.2}]
    audit = json.loads(fg("admin", "audit", "--json", db=sqlite_url).stdout)
    assert any(a["action"] == "setting.app.chat.slo" for a in audit)
    fg("admin", "slo", "clear", "--app", "chat", db=sqlite_url)
    assert json.loads(fg("admin", "slo", "show", "--json", db=sqlite_url).stdout) == []



@pytest.mark.slow
@pytest.mark.alone  # (it judges service, KV use or waits in real time: run on a quiet machine, tests/suite.py)
async def test_bands_put_the_interactive_class_first_and_come_and_go_live(sqlite_url):
    """Under FCFS a light app waits behind a flood's backlog; with its class in the interactive band and the
    flood's in the batch band it is dispatched at the next free slot. The bands come and go with the classes,
    on a running gateway, without losing a queued request."""
    import asyncio

    from fairgate.policies.bands import Banded
    from tests.test_fair_dispatch import _flood

    cfg = gateway_config(sqlite_url, policy="fcfs", emulated={"count": 1, "speed": 10.0, "kv_tokens": 1000},
                         settings_refresh_s=0.1)
    async with run_gateway(cfg) as gw:
        bulk, chat = await gw.key("bulk"), gw.client(await gw.key("chat"))
        stop = asyncio.Event()
        flood = asyncio.create_task(_flood(gw.url, bulk, 40, stop, lengths=(60, 100)))

        async def chat_waits() -> list[float]:
            before = len(await gw.rows(app="chat"))
            for _ in range(6):
                await asyncio.sleep(0.3)
                assert len(gw.gateway.dispatcher) > 5  # the flood keeps a backlog
                await chat.chat.completions.create(**{**ASK, "max_tokens": 4})
            return [r["queue_wait_ms"] for r in (await gw.rows(app="chat"))[before:]]

        await asyncio.sleep(1.0)
        fcfs = await chat_waits()
        await gw.admin.set_slo("chat", SloClass("gold", ttft_ms=10_000, band="interactive"))
        await gw.admin.set_slo("bulk", SloClass("bulk", band="batch"))
        await gw.gateway.tenants.refresh()
        assert isinstance(gw.gateway.scheduler, Banded)
        banded = await chat_waits()
        for app in ("chat", "bulk"):
            await gw.admin.unset_settings([f"app.{app}.slo"])
        await gw.gateway.tenants.refresh()
        assert not isinstance(gw.gateway.scheduler, Banded)
        stop.set()
        await flood
        rows = await gw.rows()
    # medians: ~0.1 ms against ~1.5 s here; in a cold `make test` beside the vLLM install, 57 ms (a request of
    # the interactive band waits for the next free slot) against 1.1 s
    assert sorted(banded)[3] * 10 < sorted(fcfs)[3], (fcfs, banded)
    assert {r["status"] for r in rows} <= {"ok", "cancelled"}  # (cancelled: the flood's last, when it stopped)


@pytest.mark.parametrize("policy,fairness_key", [("vtc", "app>user"), ("fairserve", "user")])
async def test_bands_coming_on_keep_counters_and_fairserve_state(sqlite_url, policy, fairness_key):
    async with run_gateway(gateway_config(sqlite_url, emulated={"count": 1}, settings_refresh_s=0.1, policy=policy,
                                          fairness_key=fairness_key)) as gw:
        client = gw.client(await gw.key("chat"))
        for user in ("alice", "bob", "alice"):
            await client.chat.completions.create(**ASK, user=user)
        keys = {r["fairness_key"] for r in await gw.rows()}
        before = {k: gw.gateway.scheduler.counter(k) for k in keys}
        parts = gw.gateway.scheduler.parts()
        assert all(v > 0 for v in before.values()) and len(parts) == 1
        await gw.key("bulk")
        await gw.admin.set_slo("bulk", SloClass("bulk", band="batch"))
        await gw.gateway.tenants.refresh()
        banded = gw.gateway.scheduler.parts()
        assert len(banded) == 3 and {k: gw.gateway.scheduler.counter(k) for k in keys} == before
        if policy == "fairserve":  # one set of open interactions and windows, the one before the switch
            assert all(p.interactions is parts[0].interactions for p in banded)
            assert all(p.oit.windows is parts[0].oit.windows for p in banded)


@pytest.mark.slow
async def test_a_sheddable_class_is_refused_at_once_when_it_could_not_start_in_time(sqlite_url):
    """Behind a flood's backlog (FCFS, one backend), a request of a sheddable class whose TTFT target the wait
    would overrun is refused at once: 429 slo_unattainable with a retry-after, the official client's retries
    off; its row says throttled, slo_unattainable, and missed. With no backlog it is served."""
    import asyncio

    from tests.test_fair_dispatch import _flood

    cfg = gateway_config(sqlite_url, policy="fcfs", emulated={"count": 1, "speed": 10.0, "kv_tokens": 1000},
                         settings_refresh_s=0.1)
    async with run_gateway(cfg) as gw:
        bulk, light = await gw.key("bulk"), gw.client(await gw.key("light"))
        await gw.admin.set_slo("light", SloClass("best-effort", ttft_ms=300, sheddable=True))
        await gw.gateway.tenants.refresh()
        await light.chat.completions.create(**ASK)  # nothing waits: served
        stop = asyncio.Event()
        flood = asyncio.create_task(_flood(gw.url, bulk, 40, stop, lengths=(60, 100)))
        await asyncio.sleep(2.0)
        assert len(gw.gateway.dispatcher) > 5
        started = asyncio.get_running_loop().time()
        with pytest.raises(openai.RateLimitError) as e:
            await light.chat.completions.create(**ASK)
        assert asyncio.get_running_loop().time() - started < 0.2  # at once, not after the wait
        assert e.value.code == "slo_unattainable" and int(e.value.response.headers["retry-after"]) >= 1
        stop.set()
        await flood
        rows = await gw.rows(app="light")
    assert [(r["status"], r["throttle_reason"], r["slo_met"]) for r in rows] == [
        ("ok", None, True), ("throttled", "slo_unattainable", False)]
