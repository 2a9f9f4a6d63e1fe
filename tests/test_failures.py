"""Backends that die, clients that leave: retries before the first token, clean errors after, and every
token generated is still charged."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from fairgate.proxy.config import BackendConfig
from fairgate.engine.serve import start_emulator
from tests.conftest import backend_sim_process, free_port, gateway_config, run_gateway

pytestmark = pytest.mark.slow
MSGS = [{"role": "user", "content": "tell me a long story"}]


async def test_backend_dead_before_first_token_is_retried_on_another(sqlite_url):
    healthy = await start_emulator(speed=50)
    try:
        async with backend_sim_process("--speed", "50") as (proc, victim_url):
            # "a-victim" sorts first, so least-load picks it while both look idle
            cfg = gateway_config(sqlite_url, health_interval_s=3600, backends=[
                BackendConfig(url=victim_url, name="a-victim"), BackendConfig(url=healthy.url, name="b-healthy")])
            async with run_gateway(cfg) as gw:
                proc.kill()
                proc.wait()
                r = await gw.client(await gw.key()).chat.completions.create(
                    model="sim-llama", messages=MSGS, max_tokens=6, extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 6
                [row] = await gw.rows()
                assert row["status"] == "ok" and row["backend"] == "b-healthy" and row["attempts"] == 2
                assert gw.gateway.pool.backends[0].failures == 1  # one failure: the request moved, not the pool
                assert all(b.inflight == 0 and b.inflight_tokens == 0 for b in gw.gateway.pool.backends)
    finally:
        await healthy.stop()


async def test_backend_dead_mid_stream_ends_stream_with_error_event(sqlite_url):
    async with backend_sim_process("--speed", "1") as (proc, url):  # 37 ms per token: slow enough to kill
        cfg = gateway_config(sqlite_url, health_interval_s=3600, backends=[BackendConfig(url=url, name="only")])
        async with run_gateway(cfg) as gw:
            stream = await gw.client(await gw.key()).chat.completions.create(
                model="sim-llama", messages=MSGS, max_tokens=500, stream=True, extra_body={"ignore_eos": True})
            got = 0
            with pytest.raises(openai.APIError) as e:
                async for chunk in stream:
                    got += 1
                    if got == 5:
                        proc.kill()
            assert "failed mid-stream" in e.value.message
            [row] = await gw.rows()
            assert row["status"] == "error" and row["http_status"] == 502
            assert 4 <= row["completion_tokens"] < 500  # what was generated is charged
            assert gw.gateway.pool.backends[0].inflight == 0


async def test_client_disconnect_cancels_upstream_and_charges_generated_tokens(sqlite_url):
    emu = await start_emulator(speed=1)
    try:
        cfg = gateway_config(sqlite_url, backends=[BackendConfig(url=emu.url, name="emu")])
        async with run_gateway(cfg) as gw:
            key = await gw.key()
            await gw.hang_up_after(key, {"model": "sim-llama", "messages": MSGS, "max_tokens": 1000,
                                         "ignore_eos": True}, events=10)
            engine = emu.server.runner.engine
            for _ in range(100):
                if not engine.running and not engine.waiting:
                    break
                await asyncio.sleep(0.01)
            assert not engine.running, "the backend is still generating for a client that left"
            generated = engine.generation_tokens_total
            await asyncio.sleep(0.3)
            assert engine.generation_tokens_total == generated  # nothing more is generated
            for _ in range(100):  # the handler's bookkeeping runs as its task unwinds
                rows = await gw.rows()
                if rows:
                    break
                await asyncio.sleep(0.01)
            [row] = rows
            assert row["status"] == "cancelled" and row["http_status"] == 499
            assert 9 <= row["completion_tokens"] <= generated < 1000
            assert gw.gateway.pool.backends[0].inflight == 0
    finally:
        await emu.stop()


async def test_no_backend_503_with_retry_after_and_sdk_retries(sqlite_url):
    cfg = gateway_config(sqlite_url, health_interval_s=3600, retry_after_s=0,
                         backends=[BackendConfig(url="http://127.0.0.1:9", name="nowhere", models=["sim-llama"])])
    async with run_gateway(cfg) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {await gw.key()}"},
                              json={"model": "sim-llama", "messages": MSGS}) as r:
                assert r.status == 503
                assert r.headers["retry-after"] == "0" and r.headers["x-should-retry"] == "true"
        client = gw.client(await gw.key(), max_retries=2)
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="sim-llama", messages=MSGS)
        rows = await gw.rows()
        assert [r["client_retry"] for r in rows] == [0, 0, 1, 2]  # the SDK honoured x-should-retry / retry-after
        assert all(r["status"] == "error" and r["http_status"] == 503 for r in rows)


async def test_a_backends_huge_error_event_is_retried_and_its_text_kept_short(sqlite_url, caplog):
    """A backend whose first event is an error of 1 MB: the request moves to the next backend, and what the
    gateway keeps and logs of that error (the attempt's reason) stays a few KB."""
    from aiohttp import web

    async def chat(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"error": {"message": "' + b"x" * (1 << 20) + b'"}}\n\n')
        return resp

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": "sim-llama", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    healthy = await start_emulator(speed=50)
    try:
        cfg = gateway_config(sqlite_url, health_interval_s=3600, backends=[
            BackendConfig(url=f"http://127.0.0.1:{port}", name="a-loud"), BackendConfig(url=healthy.url, name="b")])
        async with run_gateway(cfg) as gw:
            with caplog.at_level("WARNING", logger="fairgate.relay"):
                r = await gw.client(await gw.key()).chat.completions.create(model="sim-llama", messages=MSGS,
                                                                              max_tokens=3)
            assert r.choices[0].message.content
            [row] = await gw.rows()
            assert row["status"] == "ok" and row["backend"] == "b" and row["attempts"] == 2
            failed = [rec.getMessage() for rec in caplog.records if "before its first token" in rec.getMessage()]
            assert failed and all(len(m) < 2500 for m in failed)
    finally:
        await healthy.stop()
        await runner.cleanup()
