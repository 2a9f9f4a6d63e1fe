"""The gateway's own HTTP/1.1 client to its backends, against a real aiohttp server: connections are kept
alive and reused, a stale one is retried unseen, a response given up early closes its connection (the
backend stops generating), a stream's connection is reused once its end arrives, failures are the relay's
upstream errors, and an https backend's certificate is verified."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess

import pytest
from aiohttp import web

from fairgate.http.client import UpstreamPool
from tests.conftest import free_port


@contextlib.asynccontextmanager
async def server(keepalive_s: float = 75.0):
    seen = {"peers": [], "gone": 0}

    async def whole(request: web.Request) -> web.Response:
        seen["peers"].append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"echo": len(await request.read())})

    async def stream(request: web.Request) -> web.StreamResponse:
        seen["peers"].append(request.transport.get_extra_info("peername")[1])
        n = int(request.query.get("n", "3"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await asyncio.sleep(0.05)  # the chunked body's end comes a moment after the last event
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            seen["gone"] += 1
            raise
        return resp

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (3 << 20), content_type="application/octet-stream")

    app = web.Application()
    app.router.add_post("/whole", whole)
    app.router.add_post("/stream", stream)
    app.router.add_post("/big", big)
    runner = web.AppRunner(app, keepalive_timeout=keepalive_s, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_connections_are_kept_alive_and_reused():
    pool = UpstreamPool()
    async with server() as (url, seen):
        for _ in range(3):
            r = await pool.post(url, "/whole", b'{"a": 1}')
            assert (r.status, r.content_type, await r.read()) == (200, "application/json", b'{"echo": 8}')
            r.close()
        assert len(set(seen["peers"])) == 1
    await pool.close()


async def test_a_connection_the_backend_closed_is_retried_unseen():
    pool = UpstreamPool()
    async with server(keepalive_s=0.05) as (url, seen):
        r = await pool.post(url, "/whole", b"{}")
        await r.read()
        r.close()
        await asyncio.sleep(0.3)  # the server closes the idle connection
        r = await pool.post(url, "/whole", b"{}")
        assert r.status == 200 and await r.read() == b'{"echo": 2}'
        assert len(set(seen["peers"])) == 2
    await pool.close()


async def test_a_stream_read_to_its_end_keeps_its_connection_and_one_given_up_closes_it():
    pool = UpstreamPool()
    async with server() as (url, seen):
        r = await pool.post(url, "/stream", b"{}")
        got = b""
        while chunk := await r.readany():
            got += chunk
            if got.endswith(b"data: [DONE]\n\n"):
                break
        assert got == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        r.release()  # before the body's end arrived: kept for when it does
        await asyncio.sleep(0.2)
        r = await pool.post(url, "/stream?n=50", b"{}")
        assert await r.readany() == b"data: 0\n\n"
        r.close()  # given up: the server sees the client go
        for _ in range(100):
            if seen["gone"]:
                break
            await asyncio.sleep(0.01)
        assert seen["gone"] == 1 and seen["peers"][0] == seen["peers"][1]
        r = await pool.post(url, "/whole", b"{}")  # and the next request opens a fresh connection
        await r.read()
        assert seen["peers"][2] != seen["peers"][1]
    await pool.close()


async def test_a_large_body_arrives_whole_through_paused_reads():
    pool = UpstreamPool(high_water=64 << 10)
    async with server() as (url, _):
        r = await pool.post(url, "/big", b"{}")
        assert r.content_length == 3 << 20 and await r.read() == b"x" * (3 << 20)
        r.close()
    await pool.close()


async def test_failures_are_the_relays_upstream_errors():
    pool = UpstreamPool(connect_timeout_s=2)
    with pytest.raises(ConnectionError):
        await pool.post(f"http://127.0.0.1:{free_port()}", "/whole", b"{}")  # refused

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"SSH-2.0-nope\r\n\r\n")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(not_http, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    with pytest.raises(ValueError):
        await pool.post(f"http://127.0.0.1:{port}", "/whole", b"{}")
    srv.close()
    await pool.close()


async def test_an_https_backend_is_verified_and_served(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def whole(request: web.Request) -> web.Response:
        return web.json_response({"tls": request.secure})

    app = web.Application()
    app.router.add_post("/whole", whole)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_tls).start()
    try:
        with pytest.raises(ConnectionError):  # the system's CAs do not know this certificate
            await UpstreamPool().post(f"https://localhost:{port}", "/whole", b"{}")
        pool = UpstreamPool(ssl_context=ssl.create_default_context(cafile=str(cert)))
        r = await pool.post(f"https://localhost:{port}", "/whole", b"{}")
        assert r.status == 200 and await r.read() == b'{"tls": true}'
        r.close()
        await pool.close()
    finally:
        await runner.cleanup()
