"""What a client without a key can make the listener spend, on raw sockets: trailers, pipelining
without reading, connection slots, 100-continue, upgrades, early refusals; and the RFC 9112 rules a request is
held to (Host, transfer codings, undecoded routes, Allow). Each test failed before its fix."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest

from fairgate.http.connection import SLICE
from fairgate.http.messages import HTTPError, Request, Response, json_response
from fairgate.http.routing import Router
from fairgate.http.server import Edge, Limits
from tests.rawhttp import error_code, exchange, peek, post, statuses

CHUNKED = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


class App:
    def __init__(self) -> None:
        self.handled = 0
        self.release = asyncio.Event()

    async def hold(self, request: Request) -> Response:
        await self.release.wait()
        return json_response({})

    async def echo(self, request: Request) -> Response:
        self.handled += 1
        return json_response({"body": (await request.read()).decode()})

    async def big(self, request: Request) -> Response:
        size = int(request.query_string or 64 << 10)
        return Response(body=b"x" * size, content_type="application/octet-stream")

    async def login(self, request: Request) -> Response:
        """A handler that authenticates: a key in ``x-key`` makes its connection trusted."""
        if request.headers.get("x-key") != "good":
            raise HTTPError(401, "no key")
        request.trust()
        return json_response({"body": (await request.read()).decode()})

    async def no_content(self, request: Request) -> Response:
        return Response(status=204, body=b"never sent")

    async def interim(self, request: Request) -> Response:
        return Response(status=101, body=b"{}")


def make_edge(**limits) -> tuple[Edge, App]:
    app, r = App(), Router()
    r.add("POST", "/echo", app.echo)
    r.add("GET", "/echo", app.echo)
    r.add("GET", "/big", app.big)
    r.add("GET", "/hold", app.hold)
    r.add("POST", "/login", app.login)
    r.add("GET", "/login", app.login)
    r.add("GET", "/204", app.no_content)
    r.add("GET", "/101", app.interim)
    base = dict(max_body_bytes=1 << 20, header_timeout_s=5.0, max_head_bytes=4096, max_headers=20,
                anonymous_idle_s=0.5, write_buffer_bytes=16 << 10, linger_s=1.0, anonymous_rate=0)
    return Edge(r, Limits(**{**base, **limits})), app


@pytest.fixture
async def edge() -> AsyncIterator[tuple[Edge, App, int]]:
    e, app = make_edge()
    port = await e.start("127.0.0.1", 0)
    yield e, app, port
    await e.shutdown(0.5)


async def test_an_endless_trailer_section_is_refused_at_the_head_limit(edge):
    e, app, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(CHUNKED + b"5\r\nhello\r\n0\r\nX-Endless: ")
    sent, answer = 0, b""
    while sent < 512 << 10 and not answer:  # 512 KiB of one trailer value, 1 KiB at a time
        w.write(b"a" * 1024)
        sent += 1024
        await asyncio.sleep(0.001)
        answer = await peek(r)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert sent <= 4096 + 2 * SLICE + 4096  # the head limit, plus what one slice and one write hold
    w.close()
    # trailer fields beyond the count limit, each small: 431 too; a short trailer section is fine
    many = b"".join(b"T%d: v\r\n" % i for i in range(30))
    assert (await exchange(port, CHUNKED + b"5\r\nhello\r\n0\r\n" + many + b"\r\n")).startswith(b"HTTP/1.1 431")
    ok = await exchange(port, CHUNKED.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                        + b"5\r\nhello\r\n0\r\nX-Checksum: 1\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200") and b'"body":"hello"' in ok


async def test_a_client_that_pipelines_without_reading_holds_one_read_and_one_answer(edge):
    e, app, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 3000)  # 90 KiB asking for 190 MiB of answers
    await asyncio.sleep(0.5)
    [conn] = e.connections
    # one 64 KiB answer beyond the high-water mark at most (the kernel's socket buffers hold some more)
    assert conn.transport.get_write_buffer_size() <= (16 << 10) + (64 << 10) + 1024
    assert len(conn._queue) <= SLICE // 30 and len(conn._held) <= 256 << 10
    got = 0
    while got < 3000 * (64 << 10):  # all of them, in order, once the client reads
        chunk = await asyncio.wait_for(r.read(1 << 20), 10)
        assert chunk
        got += len(chunk)
    w.close()


async def test_a_read_full_of_tiny_requests_queues_one_slice_of_them(edge):
    e, app, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n" * 5000)
    await asyncio.sleep(0.3)
    [conn] = e.connections
    assert 1 <= len(conn._queue) <= SLICE // 30 and conn._held  # the rest waits as bytes, not as requests
    app.release.set()
    answer = b""
    while answer.count(b"HTTP/1.1 200") < 5001:
        answer += await asyncio.wait_for(r.read(1 << 20), 10)
    w.close()


async def test_a_client_that_sends_one_request_at_a_time_and_never_reads_is_not_answered_on(edge):
    e, app, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    for _ in range(300):  # not pipelined in one write: one request, a pause, the next (19 MiB of answers asked)
        w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.002)
    [conn] = e.connections
    assert conn.transport.get_write_buffer_size() <= (16 << 10) + (64 << 10) + 1024  # waiting for the reader
    w.close()


async def test_a_waiting_requests_body_is_not_read_before_its_turn(edge):
    e, app, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n" + post("/echo", b"z" * 900_000))
    await asyncio.sleep(0.3)
    [conn] = e.connections
    waiting = conn._queue[0]
    assert waiting._size <= SLICE and len(conn._held) <= 256 << 10  # the rest stays with the client
    app.release.set()
    answer = b""
    while answer.count(b"HTTP/1.1 200") < 2:
        answer += await asyncio.wait_for(r.read(1 << 20), 10)
    w.close()


async def test_an_answer_the_client_reads_late_arrives_whole_before_the_connection_ends(edge):
    _, _, port = edge  # linger_s 1: the answer is not cut when the client reads it 1.5 s later
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    w.write(b"GET /big?%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (32 << 20))
    await asyncio.sleep(1.5)
    got = 0
    while chunk := await asyncio.wait_for(r.read(1 << 20), 10):
        got += len(chunk)
    assert got > 32 << 20
    w.close()


async def test_a_refusal_waits_for_the_requests_before_it_even_when_they_are_paced():
    e, app = make_edge(anonymous_rate=1)
    port = await e.start("127.0.0.1", 0)
    try:
        get = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
        answer = await exchange(port, get + get + b"GARBAGE\x01\r\n\r\n", timeout=4)
        assert statuses(answer) == [200, 200, 400]
    finally:
        await e.shutdown(0.5)


async def test_100_continue_only_when_a_handler_reads_the_body(edge):
    _, _, port = edge
    head = b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n"
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(head + b"\r\n")  # no key: refused without asking for the body
    answer = await asyncio.wait_for(r.read(4096), 2)
    assert statuses(answer) == [401]
    w.close()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(head + b"x-key: good\r\n\r\n")
    assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
    w.write(b"ping")
    assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)).startswith(b"HTTP/1.1 200")
    w.close()
    # never to HTTP/1.0 (RFC 9110 §10.1.1), never for a request without a body
    old = await exchange(port, b"POST /login HTTP/1.0\r\nContent-Length: 4\r\nExpect: 100-continue\r\n"
                               b"x-key: good\r\n\r\nping")
    assert statuses(old) == [200]
    get = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
    assert statuses(get) == [200]


async def test_an_early_refusal_is_read_whole_by_a_client_still_sending(edge):
    _, _, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 900000\r\n\r\n")
    for _ in range(30):  # 180 KB of the body keep coming after the 401 (≤ linger_bytes): no reset destroys it
        w.write(b"y" * 6000)
        await asyncio.sleep(0.002)
    answer = await asyncio.wait_for(r.read(), 3)
    status, err = error_code(answer)
    assert status == 401 and err["message"] == "no key" and b"Connection: close" in answer
    w.close()


async def test_an_upgrade_gets_one_answer_and_the_connection_ends(edge):
    _, app, port = edge
    up = b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
    answer = await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n" + up + b"\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    assert statuses(answer) == [200] and b"Connection: close" in answer
    answer = await exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n" + up + b"\r\nhello")
    assert statuses(answer) == [400]
    assert app.handled == 1


async def test_host_transfer_codings_and_routes_are_held_to_the_rfc(edge):
    _, _, port = edge
    close = b"Connection: close\r\n\r\n"
    assert statuses(await exchange(port, b"GET /echo HTTP/1.1\r\n" + close)) == [400]  # RFC 9112 §3.2
    assert statuses(await exchange(port, b"GET /echo HTTP/1.1\r\nHost: a\r\nHost: b\r\n" + close)) == [400]
    assert statuses(await exchange(port, b"GET /echo HTTP/1.0\r\n\r\n")) == [200]  # HTTP/1.0 needs none
    gzip = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    assert statuses(await exchange(port, gzip)) == [501]
    twice = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert statuses(await exchange(port, twice)) in ([400], [501])  # (llhttp refuses it first: 400)
    answer = await exchange(port, b"DELETE /echo HTTP/1.1\r\nHost: x\r\n" + close)
    assert statuses(answer) == [405] and b"Allow: GET, POST\r\n" in answer
    assert statuses(await exchange(port, b"GET /%65cho HTTP/1.1\r\nHost: x\r\n" + close)) == [404]
    answer = await exchange(port, b"GET /204 HTTP/1.1\r\nHost: x\r\n" + close)
    assert statuses(answer) == [204] and answer.endswith(b"\r\n\r\n") and b"never sent" not in answer
    assert b"Content-Length" not in answer
    assert statuses(await exchange(port, b"GET /101 HTTP/1.1\r\nHost: x\r\n" + close)) == [500]


async def _served(port: int, key: bool = False) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A connection that got one answer (kept alive), or None if the listener closed it."""
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /login HTTP/1.1\r\nHost: x\r\n" + (b"x-key: good\r\n" if key else b"") + b"\r\n")
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await r.readexactly(length)
        return r, w
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        return None


async def test_slots_held_without_a_key_give_way_to_a_tenant():
    e, _ = make_edge(max_connections=4, max_connections_per_client=1000, anonymous_idle_s=30.0)
    port = await e.start("127.0.0.1", 0)
    try:
        anonymous = [await _served(port) for _ in range(4)]
        assert all(anonymous) and len(e.connections) == 4
        tenant = await _served(port, key=True)  # the listener is full of idle anonymous ones: the oldest goes
        assert tenant is not None
        assert await asyncio.wait_for(anonymous[0][0].read(), 2) == b""
        trusted = [tenant] + [await _served(port, key=True) for _ in range(3)]
        assert all(trusted)  # each took an anonymous connection's place
        assert await _served(port) is None  # full of tenants: a newcomer is refused
    finally:
        await e.shutdown(0.5)


async def test_one_client_address_holds_at_most_its_share():
    e, _ = make_edge(max_connections=100, max_connections_per_client=3, anonymous_idle_s=30.0)
    port = await e.start("127.0.0.1", 0)
    try:
        held = [await _served(port, key=True) for _ in range(3)]
        assert all(held)
        assert await _served(port, key=True) is None  # 127.0.0.1 has its 3
        held[0][1].close()
        await asyncio.sleep(0.1)
        assert await _served(port) is not None
    finally:
        await e.shutdown(0.5)


async def test_a_connection_without_a_key_is_paced_one_with_a_key_is_not():
    e, app = make_edge(anonymous_rate=20)
    port = await e.start("127.0.0.1", 0)
    try:
        for key, least_s, most_s in ((b"", 1.4, 4.0), (b"x-key: good\r\n", 0.0, 1.0)):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            started = asyncio.get_running_loop().time()
            w.write(b"GET /login HTTP/1.1\r\nHost: x\r\n" + key + b"\r\n" + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n" * 49)
            answer = b""
            while answer.count(b"HTTP/1.1 ") < 50:
                answer += await asyncio.wait_for(r.read(1 << 16), 5)
            took = asyncio.get_running_loop().time() - started
            assert least_s <= took <= most_s, (key, took)  # 20 at once, then 20 a second: 30 more take 1.5 s
            w.close()
    finally:
        await e.shutdown(0.5)


async def test_an_anonymous_connection_idles_briefly_a_tenants_longer(edge):
    _, _, port = edge  # anonymous_idle_s 0.5, header_timeout_s 5
    anonymous, tenant = await _served(port), await _served(port, key=True)
    assert await asyncio.wait_for(anonymous[0].read(), 2) == b""
    assert await peek(tenant[0], 0.5) == b"" and not tenant[0].at_eof()
    tenant[1].close()
