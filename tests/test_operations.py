"""/health, /ready, /metrics, and backends that go down and come back."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import openai
import pytest

from fairgate.proxy.config import BackendConfig
from fairgate.engine.serve import start_emulator
from tests.conftest import free_port, gateway_config, run_gateway

OPS = {"Authorization": "Bearer ops-secret"}


@contextlib.asynccontextmanager
async def models_backend(handler):
    """A backend that answers only ``GET /v1/models``, with ``handler``: its URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/v1/models", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_metrics_count_requests_tokens_and_backends(sqlite_url):
    """With ops_token, /metrics needs the token and /ready names backends only to its holder."""
    async with run_gateway(gateway_config(sqlite_url, ops_token="ops-secret")) as gw:
        client = gw.client(await gw.key("chat"))
        await client.chat.completions.create(model="sim-llama", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3, extra_body={"ignore_eos": True})
        for k in range(3):  # models nobody serves: 404s, counted under "unknown", not a series each
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model=f"no-such-model-{k}", max_tokens=3,
                                                     messages=[{"role": "user", "content": "hi"}])
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/metrics") as r:
                assert r.status == 401
            async with s.get(gw.url + "/metrics", headers=OPS) as r:
                text = await r.text()
            async with s.get(gw.url + "/health") as r:
                assert r.status == 200
            async with s.get(gw.url + "/ready") as r:
                assert await r.json() == {"ready": True}  # an anonymous caller learns nothing about backends
            async with s.get(gw.url + "/ready", headers=OPS) as r:
                ready = await r.json()
    assert ready["ready"] and set(ready["backends"]) == {"emulated-0", "emulated-1"}
    assert 'fairgate_requests_total{app="chat",code="200",endpoint="chat",model="sim-llama",status="ok"} 1.0' in text
    assert 'fairgate_tokens_total{app="chat",kind="completion",model="sim-llama"} 3.0' in text
    assert 'fairgate_backend_up{backend="emulated-0"} 1.0' in text
    assert "vllm:" not in text  # the engines' own names are never re-exported
    assert "no-such-model" not in text
    assert ('fairgate_requests_total{app="chat",code="404",endpoint="chat",model="unknown",status="rejected"} 3.0'
            in text)


async def test_metrics_are_for_operators_unless_opened_and_labels_are_printable(sqlite_url):
    """/metrics names every tenant: without ops_token or ops_port it is refused, unless metrics_public opens
    it; a label never carries a control or bidi character raw."""
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "metrics_not_public"
    async with run_gateway(gateway_config(sqlite_url, metrics_public=True)) as gw:
        m = gw.gateway.metrics
        m.child(m.tenant_service, m.tenant("user:a/\u202eb\u2028")).inc()
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert r.status == 200 and 'tenant="user:a/\\\\u202eb\\\\u2028"' in text and "\u202e" not in text


async def test_keys_that_cannot_be_ours_are_refused_unseen_and_never_evict_a_tenants(sqlite_url):
    """a bearer token over 256 bytes is refused without a lookup; unknown keys are remembered apart from
    known ones, so a flood of them does not evict a tenant's key from the cache."""
    async with run_gateway(gateway_config(sqlite_url, identity_cache_ttl_s=60)) as gw:
        key = await gw.key("chat")
        cache = gw.gateway.keys
        cache.size = 20
        client = gw.client(key)
        await client.models.list()  # (not a key check)
        await client.chat.completions.create(model="sim-llama", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=1)
        async with aiohttp.ClientSession() as s:
            for i in range(50):
                async with s.post(gw.url + "/v1/chat/completions", json={},
                                  headers={"Authorization": f"Bearer fg-made-up-{i}"}) as r:
                    assert r.status == 401
            async with s.post(gw.url + "/v1/chat/completions", json={},
                              headers={"Authorization": "Bearer " + "k" * 16_000}) as r:
                assert r.status == 401
        assert key in cache._cache and len(cache._misses) == 20
        assert not any(len(k) > 256 for k in cache._misses)


async def test_backend_goes_down_and_comes_back(sqlite_url):
    port = free_port()
    emu = await start_emulator(port=port, speed=50)
    cfg = gateway_config(sqlite_url, health_interval_s=0.1, ops_token="ops-secret",
                         backends=[BackendConfig(url=f"http://127.0.0.1:{port}", name="gpu-1")])
    async with run_gateway(cfg) as gw:
        pool = gw.gateway.pool
        assert pool.backends[0].up and pool.backends[0].kv_capacity == 10_000  # from vllm:cache_config_info
        await emu.stop()
        for _ in range(50):
            if not pool.backends[0].up:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s, s.get(gw.url + "/ready", headers=OPS) as r:
            assert r.status == 503 and (await r.json())["backends"]["gpu-1"]["error"]
        emu = await start_emulator(port=port, speed=50)
        for _ in range(50):
            if pool.backends[0].up:
                break
            await asyncio.sleep(0.05)
        r = await gw.client(await gw.key()).chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "back?"}], max_tokens=2)
        assert r.usage.completion_tokens == 2
    await emu.stop()


async def test_a_backend_reported_context_is_kept_only_when_plausible():
    """``max_model_len`` is shown to every client in /v1/models and bounds max_tokens: a bool, a negative or
    an absurd (past 64 bits: unencodable) value from a backend is ignored, not passed on."""
    from aiohttp import web

    from fairgate.proxy.control.backends import BackendPool

    cards = [{"id": "good", "max_model_len": 4096}, {"id": "bool", "max_model_len": True},
             {"id": "huge", "max_model_len": 10**30}, {"id": "neg", "max_model_len": -1},
             {"id": "text", "max_model_len": "4096"}]

    async def models(_request):
        return web.Response(body=__import__("json").dumps({"object": "list", "data": cards}),
                            content_type="application/json")

    async with models_backend(models) as url, aiohttp.ClientSession() as session:
        pool = BackendPool([BackendConfig(url=url, name="b")], session, 1.0)
        await pool.probe(pool.backends[0])
        assert pool.backends[0].up and pool.backends[0].context == {"good": 4096}


async def test_a_backend_slow_to_answer_its_probe_stays_up_until_it_persists():
    """A loaded server (a CPU vLLM running its batch) may answer one health probe late while it serves; that
    must not take it out of the pool (every request would get a 503). Three late probes in a row do."""
    from aiohttp import web

    from fairgate.proxy.control.backends import SLOW_PROBES_TO_DOWN, BackendPool

    delay = {"s": 0.0}

    async def models(_request):
        await asyncio.sleep(delay["s"])
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async with models_backend(models) as url, aiohttp.ClientSession() as session:
        pool = BackendPool([BackendConfig(url=url, name="slow")], session, 0.2)
        b = pool.backends[0]
        await pool.probe(b)
        assert b.up
        delay["s"] = 1.5  # over the probe's 1 s
        for k in range(1, SLOW_PROBES_TO_DOWN):
            await pool.probe(b)
            assert b.up and b.slow_probes == k
        delay["s"] = 0.0
        await pool.probe(b)  # an answer in time forgives the late ones
        assert b.up and b.slow_probes == 0
        delay["s"] = 1.5
        for _ in range(SLOW_PROBES_TO_DOWN):
            await pool.probe(b)
        assert not b.up and b.last_error == "TimeoutError"


async def test_an_operations_port_and_hashed_tenant_labels(sqlite_url):
    """ops_port: /metrics only there (404 on the public port), /ready's detail there; hash_tenant_labels: no
    end user's name in the metrics."""
    import errno

    async def scrape(ops_port: int) -> str:
        cfg = gateway_config(sqlite_url, ops_port=ops_port, hash_tenant_labels=True)
        async with run_gateway(cfg) as gw:
            await gw.client(await gw.key("chat", user="alice@example.com")).chat.completions.create(
                model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            async with aiohttp.ClientSession() as s:
                async with s.get(gw.url + "/metrics") as r:
                    assert r.status == 404
                async with s.get(f"http://127.0.0.1:{ops_port}/metrics") as r:
                    text = await r.text()
                async with s.get(f"http://127.0.0.1:{ops_port}/ready") as r:
                    assert "backends" in await r.json()
        return text

    for attempt in range(3):  # (a port free a moment ago may be taken by another test's connection meanwhile)
        try:
            text = await scrape(free_port())
            break
        except OSError as e:
            if e.errno != errno.EADDRINUSE or attempt == 2:
                raise
    assert "fairgate_tenant_service_total{tenant=\"t-" in text and "alice" not in text


async def test_policy_and_weights_change_live(sqlite_url):
    """`fairgate admin policy set` and weight changes reach a running gateway at its next refresh."""
    from fairgate.policies.vtc import VTC

    cfg = gateway_config(sqlite_url, policy="fcfs", settings_refresh_s=0.1)
    async with run_gateway(cfg) as gw:
        client = gw.client(await gw.key("chat", user="ann"))
        msgs = [{"role": "user", "content": "hi"}]
        await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=2)
        await gw.admin.set_setting("policy", "vtc")
        await gw.admin.set_field("user", "ann", "weight", 3.0)
        for _ in range(50):
            if gw.gateway.config.policy == "vtc" and gw.gateway.tenants.weight("user:chat/ann") == 3.0:
                break
            await asyncio.sleep(0.05)
        assert isinstance(gw.gateway.scheduler, VTC) and gw.gateway.dispatcher.scheduler is gw.gateway.scheduler
        assert gw.gateway.tenants.weight("user:chat/ann") == 3.0
        await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=2)
        rows = await gw.rows()
        assert [r["policy"] for r in rows] == ["fcfs", "vtc"]
        assert rows[1]["counter_after"] > rows[1]["counter_before"]  # charged, divided by the weight 3
        assert gw.gateway.scheduler.counter("user:chat/ann") == pytest.approx(
            (rows[1]["prompt_tokens"] + 2 * rows[1]["completion_tokens"]) / 3.0)
        audit = await gw.admin.audit_log()
        assert {"setting.policy", "user.set_weight"} <= {a["action"] for a in audit}


async def test_a_database_policy_is_said_aloud_and_unset_hands_it_back(sqlite_url, caplog):
    """The database's policy (`admin policy set`) wins over the configured one at start, and the gateway says
    so; `admin policy unset` returns every running gateway to its --policy (fairgate/proxy/control/settings.py)."""
    from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
    from fairgate.storage.identity import Admin

    engine = make_engine(sqlite_url)
    await ensure_schema(engine)
    await Admin(sessionmaker(engine), "ops").set_setting("policy", "vtc")
    await Admin(sessionmaker(engine), "ops").set_setting("placement", "no-such-placement")
    await engine.dispose()
    cfg = gateway_config(sqlite_url, policy="fcfs", settings_refresh_s=0.1)
    with caplog.at_level("WARNING", logger="fairgate"):
        async with run_gateway(cfg) as gw:
            assert gw.gateway.config.policy == "vtc" and gw.gateway.config.placement == "least-load"
            said = [r.getMessage() for r in caplog.records]
            assert any("policy vtc from the database overrides the configured fcfs (flag)" in m
                       and "fairgate admin policy unset" in m for m in said), said
            assert any("ignoring the database's placement 'no-such-placement'" in m for m in said), said
            assert (await gw.admin.unset_settings(["policy"]))["unset"] == ["policy"]
            for _ in range(50):
                if gw.gateway.config.policy == "fcfs":
                    break
                await asyncio.sleep(0.05)
            assert gw.gateway.config.policy == "fcfs" and gw.gateway.dispatcher.scheduler is gw.gateway.scheduler
            audit = await gw.admin.audit_log()
            assert audit[0]["action"] == "setting.policy" and audit[0]["after"] is None


async def test_locality_parameters_change_live(sqlite_url):
    """`fairgate admin locality set` reaches a running DLPM / D²LPM gateway at its next refresh; a value the
    theorems forbid (Q^w = inf) is refused by the gateway too, keeping the last good one."""
    cfg = gateway_config(sqlite_url, policy="dlpm", placement="d2lpm", settings_refresh_s=0.1)
    async with run_gateway(cfg) as gw:
        s, placement = gw.gateway.scheduler, gw.gateway.dispatcher.placement
        assert (s.quantum, s.window, placement.client_quantum) == (4000.0, 32, 20_000.0)
        for key, value in (("quantum", "500"), ("window", "8"), ("client_quantum", "inf")):
            await gw.admin.set_setting(f"locality.{key}", value)
        for _ in range(50):
            if s.quantum == 500.0:
                break
            await asyncio.sleep(0.05)
        assert (s.quantum, s.window, placement.client_quantum) == (500.0, 8, 20_000.0)
        await gw.admin.set_setting("locality.client_quantum", "3000")
        for _ in range(50):
            if placement.client_quantum == 3000.0:
                break
            await asyncio.sleep(0.05)
        assert placement.client_quantum == 3000.0 and gw.gateway.config.locality.quantum == 500.0
        client = gw.client(await gw.key("chat", user="ann"))  # and it serves under them
        r = await client.chat.completions.create(model="sim-llama", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert "setting.locality.quantum" in {a["action"] for a in await gw.admin.audit_log()}


async def test_rpm_policy_throttles_with_429_and_records_it(sqlite_url):
    import openai

    async with run_gateway(gateway_config(sqlite_url, policy="rpm")) as gw:
        key = await gw.key("chat", user="eve")
        await gw.admin.set_field("user", "eve", "rpm_limit", 2)
        await gw.gateway.tenants.refresh()
        client = gw.client(key)
        msgs = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=1)
        assert e.value.response.headers["retry-after"] == "30"  # (2 a minute: the next fits in 30 s)
        rows = await gw.rows()
        assert [(r["status"], r["throttle_reason"]) for r in rows] == [
            ("ok", None), ("ok", None), ("throttled", "rate_limit_exceeded")]
        summary = await __import__("fairgate.storage.usage_queries", fromlist=["x"]).summary(
            gw.gateway.sessions, "user")
        assert summary[0]["throttled"] == 1


@pytest.mark.parametrize("policy", ["vtc", "dlpm", "wsc", "fcfs"])
async def test_request_limits_hold_under_every_policy(sqlite_url, policy):
    """`admin limit set --rpm` is enforced whatever the policy (it was only under `rpm`): the user's limit,
    then the app's, each with an honest retry-after; a refused request does not count; other apps go on."""
    import openai

    async with run_gateway(gateway_config(sqlite_url, policy=policy)) as gw:
        eve, ann = gw.client(await gw.key("chat", user="eve")), gw.client(await gw.key("chat", user="ann"))
        other = gw.client(await gw.key("search", user="eve"))
        await gw.admin.set_field("user", "eve", "rpm_limit", 2, app="chat")
        await gw.admin.set_field("app", "chat", "rpm_limit", 3)
        await gw.gateway.tenants.refresh()
        msgs = [{"role": "user", "content": "hi"}]
        ask = lambda c: c.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=1)  # noqa: E731
        for _ in range(2):
            await ask(eve)
        for _ in range(2):
            with pytest.raises(openai.RateLimitError) as e:
                await ask(eve)
            assert e.value.code == "rate_limit_exceeded" and "user is limited to 2 requests per minute" in str(e.value)
            assert 28 <= int(e.value.response.headers["retry-after"]) <= 30  # (2 a minute: one more in 30 s)
        await ask(ann)  # the app's third: refusals of eve's did not count
        with pytest.raises(openai.RateLimitError) as e:
            await ask(ann)
        assert "app is limited to 3 requests per minute" in str(e.value)
        for _ in range(3):
            await ask(other)  # another app's user of the same name is not chat/eve
        rows = await gw.rows()
        assert [r["status"] for r in rows].count("throttled") == 3
        assert gw.gateway.quotas.refused == {"user_rpm": 2, "app_rpm": 1}


async def test_the_placement_changes_live_and_a_request_given_up_is_refunded(sqlite_url):
    """`fairgate admin locality placement d2lpm` reaches a running gateway: the index is built, waiting
    requests are routed by D²LPM from then on, and a routed request its client gives up before it runs gets
    its input charge (Algorithm 2, line 16) back."""
    cfg = gateway_config(sqlite_url, policy="dlpm", placement="least-load", settings_refresh_s=0.1,
                         emulated={"count": 2, "speed": 4.0, "kv_tokens": 700})
    async with run_gateway(cfg) as gw:
        await gw.admin.set_setting("placement", "d2lpm")
        for _ in range(50):
            if gw.gateway.dispatcher.placement.name == "d2lpm":
                break
            await asyncio.sleep(0.05)
        placement = gw.gateway.dispatcher.placement
        assert placement.name == "d2lpm" and gw.gateway.config.placement == "d2lpm"
        client = gw.client(await gw.key("chat", user="ann"))

        async def ask(n: int, max_tokens: int):
            return await client.chat.completions.create(
                model="sim-llama", messages=[{"role": "user", "content": f"question {n}"}], max_tokens=max_tokens,
                extra_body={"ignore_eos": True})

        running = [asyncio.create_task(ask(k, 400)) for k in range(2)]  # one per backend: no room for more
        while gw.gateway.dispatcher.stats.dispatched < 2:
            await asyncio.sleep(0.01)
        before = {c: dict(q) for c, q in placement.q.items()}
        waiting = asyncio.create_task(ask(3, 400))
        while len(gw.gateway.dispatcher) < 1:
            await asyncio.sleep(0.01)
        (who, charged), = placement.q.items()
        assert sum(charged.values()) < sum(before[who].values())  # routed: its input charged where it is pinned
        waiting.cancel()  # the client gives up before it runs
        while len(gw.gateway.dispatcher):
            await asyncio.sleep(0.01)
        assert placement.q[who] == before[who]  # refunded
        await asyncio.gather(*running)


async def test_power_of_two_serves_live_and_keeps_no_load_after(sqlite_url):
    """`placement: power-of-two` in a gateway: every request served, the pool shared, and its ledger of
    predicted work empty once they have all ended (nothing leaks)."""
    cfg = gateway_config(sqlite_url, placement="power-of-two", emulated={"count": 4, "speed": 20.0})
    async with run_gateway(cfg) as gw:
        client = gw.client(await gw.key("chat"))
        answers = await asyncio.gather(*(client.chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": f"q {k}"}], max_tokens=8) for k in range(40)))
        assert all(a.choices[0].message.content for a in answers)
        placement = gw.gateway.dispatcher.placement
        assert placement.name == "power-of-two" and placement._load == {} and placement._placed == {}
        rows = await gw.rows(app="chat")
        assert len({r["backend"] for r in rows}) == 4, {r["backend"] for r in rows}
