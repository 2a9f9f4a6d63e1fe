"""Faults after the first token: a stream always ends as SSE (an ``error`` event, never raw HTTP
inside the body), a silent backend and an endless one are cut by the idle and total timeouts, a client that
reads nothing is dropped, big events pass, and every case leaves its row and frees its reservation."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from fairgate.proxy.config import BackendConfig
from tests.conftest import gateway_config, run_gateway
from tests.fault_backend import fault_backend

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000 - 100}


async def _stream(gw, key: str, model: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json={**BODY, "model": model, "stream": True},
                          headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.read()


def _events(raw: bytes) -> list:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "DONE"
            for line in raw.split(b"\n\n") if line.startswith(b"data: ")]


@pytest.fixture
async def faulty(sqlite_url):
    async with fault_backend() as (backend, url):
        cfg = gateway_config(sqlite_url, backends=[BackendConfig(url=url, name="faulty")], health_interval_s=3600,
                             idle_timeout_s=0.5, request_timeout_s=1.5, write_timeout_s=0.5,
                             max_event_bytes=1_000_000)
        async with run_gateway(cfg) as gw:
            yield gw, backend


async def test_big_events_pass_and_a_silent_or_endless_backend_ends_with_an_error_event(faulty):
    gw, backend = faulty
    key = await gw.key()
    status, raw = await _stream(gw, key, "huge")  # 600 KiB events: once a 500 (aiohttp's 128 KiB lines)
    events = _events(raw)
    assert status == 200 and events[-1] == "DONE" and len(events[0]["choices"][0]["delta"]["content"]) == 600_000
    for model, code, words in (("stall", "backend_timeout", "idle_timeout_s"),
                               ("trickle", "backend_timeout", "request_timeout_s")):
        status, raw = await _stream(gw, key, model)
        assert status == 200 and b"HTTP/1.1" not in raw
        last = _events(raw)[-1]
        assert last["error"]["code"] == code and words in last["error"]["message"], last
    rows = await gw.rows()
    assert [(r["status"], r["http_status"]) for r in rows] == [("ok", 200), ("error", 504), ("error", 504)]
    assert rows[1]["completion_tokens"] == 3 and rows[2]["completion_tokens"] >= 5  # what was generated
    assert gw.gateway.pool.backends[0].inflight == 0 and gw.gateway.pool.backends[0].inflight_tokens == 0


@pytest.mark.parametrize("model, max_tokens", [("stall", BODY["max_tokens"]), ("stall", None),
                                               ("stall-bare", None)])
async def test_a_non_streaming_call_to_a_silent_backend_gets_504(faulty, model, max_tokens):
    """Billed what was generated: fetched whole, or streamed and folded (without max_tokens) from a backend
    that reports its running usage or not (then its content-bearing chunks are counted)."""
    gw, _ = faulty
    body = {**BODY, "model": model, "max_tokens": max_tokens}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", json={k: v for k, v in body.items() if v is not None},
                          headers={"Authorization": f"Bearer {await gw.key()}"}) as r:
            assert r.status == 504 and (await r.json())["error"]["code"] == "backend_timeout"
    [row] = await gw.rows()
    assert row["status"] == "error" and row["completion_tokens"] == 3


async def test_a_client_that_reads_nothing_is_dropped_and_its_backend_aborted(faulty):
    gw, backend = faulty
    key = await gw.key()
    host, port = gw.url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({**BODY, "model": "flood", "stream": True}).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    await writer.drain()
    writer.transport.pause_reading()  # never read: the gateway's writes back up
    for _ in range(100):
        await asyncio.sleep(0.1)
        if backend.disconnects:
            break
    writer.close()
    [row] = await gw.rows()
    assert backend.disconnects == 1 and row["status"] == "cancelled"
    assert 0 < row["completion_tokens"] < 2_000  # charged for what was generated before the drop
    assert gw.gateway.pool.backends[0].inflight == 0


async def test_one_failure_does_not_take_a_backend_out_three_in_a_row_eject_it(sqlite_url, tmp_path):
    """Outlier detection (Envoy's consecutive failures): once one request's failure marked the backend
    down and 503ed every request queued for its model."""
    async with fault_backend(fail_first=1) as (_, lone_url):  # a lone backend: one transient 500
        cfg = gateway_config(sqlite_url, backends=[BackendConfig(url=lone_url, name="lone")], health_interval_s=3600,
                             max_attempts=1)
        async with run_gateway(cfg) as gw:
            key = await gw.key()
            statuses = await asyncio.gather(*(_stream(gw, key, "ok") for _ in range(4)))
            assert sorted(s for s, _ in statuses) == [200, 200, 200, 503]  # only the failed one, not the queue
            assert gw.gateway.pool.candidates("ok")  # still in the pool
    async with fault_backend(fail_first=10**6) as (_, bad_url), fault_backend() as (good, good_url):
        cfg = gateway_config(f"sqlite:///{tmp_path}/pool.db", health_interval_s=3600, backends=[
            BackendConfig(url=bad_url, name="a-bad"), BackendConfig(url=good_url, name="b-good")])
        async with run_gateway(cfg) as gw:
            key = await gw.key()
            for _ in range(4):
                status, raw = await _stream(gw, key, "ok")
                assert status == 200 and _events(raw)[-1] == "DONE"
            rows = await gw.rows()
            assert [r["attempts"] for r in rows] == [2, 2, 2, 1]  # ejected after the third failure in a row
            assert [b.name for b in gw.gateway.pool.candidates("ok")] == ["b-good"]


async def test_a_backend_whose_name_stopped_resolving_is_a_failure_tried_elsewhere(sqlite_url):
    """An OS error on connecting (a name that no longer resolves, no route, no port left) is the backend's
    failure, as a refused connection is: the request goes to another backend, billed what it was served; it
    was once taken for the client's cancellation, a 500 billed its whole max_tokens."""
    async with fault_backend() as (_, one_url), fault_backend() as (_, two_url):
        cfg = gateway_config(sqlite_url, health_interval_s=3600, backends=[
            BackendConfig(url=one_url, name="a-gone"), BackendConfig(url=two_url, name="b-fine")])
        async with run_gateway(cfg) as gw:
            gw.gateway.pool.backends[0].url = "http://no-such-host.invalid:80"  # (between two health probes)
            key = await gw.key()
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
                for _ in range(2):
                    async with s.post(gw.url + "/v1/chat/completions",
                                      json={**BODY, "model": "ok", "max_tokens": 700}) as r:
                        assert r.status == 200, await r.text()
                        served = (await r.json())["usage"]["completion_tokens"]
            rows = await gw.rows()
            assert [(r["status"], r["backend"]) for r in rows] == [("ok", "b-fine")] * 2
            assert all(r["completion_tokens"] == served < 700 for r in rows)


async def test_a_model_waiting_for_headroom_does_not_block_another_model(sqlite_url):
    """Once the gate's single head blocked every model: a request for a free model waited behind a
    request for a full one — here until that one gave up at its queue timeout (3 s, a 503)."""

    from fairgate.engine.serve import start_emulator

    emu = await start_emulator(speed=50)
    try:
        async with fault_backend() as (_, url):
            cfg = gateway_config(sqlite_url, health_interval_s=3600, queue_timeout_s=3, backends=[
                BackendConfig(url=url, name="one-seat", max_num_seqs=1), BackendConfig(url=emu.url, name="emu")])
            async with run_gateway(cfg) as gw:
                key = await gw.key("app", user="same")  # one client: its requests keep their order
                first = asyncio.create_task(_stream(gw, key, "stall"))  # takes the only seat and holds it
                await asyncio.sleep(0.3)
                second = asyncio.create_task(_stream(gw, key, "stall"))  # the head: waits for that seat
                await asyncio.sleep(0.3)
                r = await gw.client(key).chat.completions.create(
                    model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                assert r.usage.completion_tokens == 2
                assert not second.done()  # served while the other model's head still waits for its seat
                [row] = [x for x in await gw.rows() if x["model"] == "sim-llama"]
                assert row["queue_wait_ms"] < 1_000
                for t in (first, second):
                    t.cancel()
                await asyncio.gather(first, second, return_exceptions=True)
    finally:
        await emu.stop()
